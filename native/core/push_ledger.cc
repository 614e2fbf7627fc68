#include "native/core/push_ledger.h"

#include <algorithm>
#include <cstddef>

#include "native/core/random.h"
#include "native/core/routing.h"

namespace dlt {
namespace {

struct HashKeys {
  uint64_t client, seq;
};

}  // namespace

size_t PushLedger::Hash::operator()(const PushId& id) const {
  static const HashKeys keys = {RandomWord(), RandomWord()};
  return static_cast<size_t>(Mix64(id.seq ^ keys.seq ^ Mix64(id.client ^ keys.client)));
}

void WriterFirstLock::lock_shared() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !writer_ && writers_waiting_ == 0; });
  ++readers_;
}

void WriterFirstLock::unlock_shared() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--readers_ == 0) cv_.notify_all();
}

void WriterFirstLock::lock() {
  std::unique_lock<std::mutex> lock(mu_);
  ++writers_waiting_;
  cv_.wait(lock, [&] { return !writer_ && readers_ == 0; });
  --writers_waiting_;
  writer_ = true;
}

void WriterFirstLock::unlock() {
  std::lock_guard<std::mutex> lock(mu_);
  writer_ = false;
  cv_.notify_all();
}

bool PushLedger::Begin(const PushId& id, Status* status, const PushId* ancestors,
                       size_t num_ancestors) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    bool in_progress = false;
    for (size_t i = 0; i < num_ancestors && !in_progress; ++i) {
      auto it = entries_.find(ancestors[i]);
      if (it == entries_.end()) continue;
      if (it->second.done) {
        *status = it->second.status;
        return false;
      }
      in_progress = true;
    }
    if (!in_progress) {
      auto it = entries_.find(id);
      if (it == entries_.end()) {
        entries_.emplace(id, Entry{});
        return true;
      }
      if (it->second.done) {
        *status = it->second.status;
        return false;
      }
    }
    cv_.wait(lock);  // the same push, in progress on another connection
  }
}

void PushLedger::End(const PushId& id, const Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  RecordLocked(id, status);
  for (uint32_t mask = tracked_; mask != 0; mask &= mask - 1) {
    std::vector<PushId>& applied = applied_[__builtin_ctz(mask)];
    applied.push_back(id);
    // A stream that takes no round (its standby down: an async primary's
    // last standby is never detached) keeps the newest ids the ledger
    // remembers, not every push since: an older one is forgotten here too,
    // and its next round, a whole copy, sends Done()'s ids instead.
    if (applied.size() >= 2 * capacity_) {
      applied.erase(applied.begin(), applied.end() - static_cast<std::ptrdiff_t>(capacity_));
    }
  }
  cv_.notify_all();
}

void PushLedger::Abandon(const PushId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(id);
  cv_.notify_all();
}

void PushLedger::RecordLocked(const PushId& id, const Status& status) {
  Entry& e = entries_[id];
  if (!e.done) order_.push_back(id);
  e.done = true;
  e.status = status;
  while (order_.size() > capacity_) {
    entries_.erase(order_.front());
    order_.pop_front();
  }
}

void PushLedger::set_tracked(uint32_t stream, bool tracked) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tracked) {
    tracked_ |= 1u << stream;
  } else {
    tracked_ &= ~(1u << stream);
    std::vector<PushId>().swap(applied_[stream]);
  }
}

void PushLedger::TakeApplied(uint32_t stream, std::vector<PushId>* ids) {
  std::lock_guard<std::mutex> lock(mu_);
  ids->swap(applied_[stream]);
  applied_[stream].clear();
}

void PushLedger::Insert(const PushId* ids, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) RecordLocked(ids[i], OkStatus());
  cv_.notify_all();
}

void PushLedger::set_capacity(size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  capacity_ = std::max(capacity, kCapacity);
}

size_t PushLedger::capacity() const {
  std::lock_guard<std::mutex> lock(mu_);
  return capacity_;
}

void PushLedger::Absorb(PushLedger* other) {
  std::vector<PushId> done;
  other->Done(other->capacity(), &done);
  {
    std::lock_guard<std::mutex> lock(mu_);
    capacity_ = std::max(capacity_, done.size() + kCapacity);
  }
  Insert(done.data(), done.size());
}

void PushLedger::Done(size_t max, std::vector<PushId>* ids) const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = std::min(max, order_.size());
  ids->assign(order_.end() - static_cast<std::ptrdiff_t>(n), order_.end());
}

void PushLedger::ForgetDone() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const PushId& id : order_) entries_.erase(id);
  order_.clear();
  for (std::vector<PushId>& applied : applied_) applied.clear();
}

size_t PushLedger::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return order_.size();
}

}  // namespace dlt
