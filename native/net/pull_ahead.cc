#include "native/net/pull_ahead.h"

#include <algorithm>
#include <cstring>
#include <iterator>

namespace dlt {

PulledAhead::PulledAhead(std::string table, PullMode mode, uint32_t dim, const int64_t* ids,
                         size_t n, bool refresh)
    : table_(std::move(table)), mode_(mode), dim_(dim), refresh_(refresh), ids_(ids, ids + n) {
  index_.Run(ids_.data(), static_cast<int64_t>(n), &unique_, &slot_);
  rows_.resize(unique_.size() * dim_);
  stale_.assign(unique_.size(), 0);
}

bool PulledAhead::Matches(const int64_t* ids, size_t n) const {
  return n == ids_.size() && std::memcmp(ids, ids_.data(), n * sizeof(int64_t)) == 0;
}

void PulledAhead::Finish(bool ok) {
  std::unique_lock<std::mutex> lock(mu_);
  done_ = true;
  ok_ = ok;
  RunThenIfIdle(&lock);
}

void PulledAhead::Then(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_ || refreshing_) {
      then_ = std::move(fn);
      return;
    }
  }
  fn();
}

void PulledAhead::RunThenIfIdle(std::unique_lock<std::mutex>* lock) {
  std::function<void()> then;
  if (done_ && !refreshing_) then.swap(then_);
  lock->unlock();
  if (then) then();
}

bool PulledAhead::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

bool PulledAhead::ok() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ok_;
}

bool PulledAhead::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ && ok_ && !refreshing_ && std::find(stale_.begin(), stale_.end(), 1) == stale_.end();
}

void PulledAhead::SetTaken() {
  std::lock_guard<std::mutex> lock(mu_);
  taken_ = true;
}

std::vector<int64_t> PulledAhead::TakeStale() {
  std::vector<int64_t> ids;
  refreshing_at_.clear();
  for (size_t i = 0; i < unique_.size(); ++i) {
    if (!stale_[i]) continue;
    stale_[i] = 0;
    refreshing_at_.push_back(static_cast<uint32_t>(i));
    ids.push_back(unique_[i]);
  }
  return ids;
}

std::vector<int64_t> PulledAhead::BeginRefresh() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_ || !ok_ || taken_ || refreshing_) return {};
  std::vector<int64_t> ids = TakeStale();
  refreshing_ = !ids.empty();
  return ids;
}

std::vector<int64_t> PulledAhead::RefreshDone(const float* rows) {
  std::unique_lock<std::mutex> lock(mu_);
  if (rows == nullptr) {
    for (uint32_t at : refreshing_at_) stale_[at] = 1;  // the lookup pulls them
  } else {
    for (size_t k = 0; k < refreshing_at_.size(); ++k) {
      std::memcpy(rows_.data() + size_t{refreshing_at_[k]} * dim_, rows + k * dim_,
                  sizeof(float) * dim_);
    }
  }
  std::vector<int64_t> next;
  if (rows != nullptr && !taken_) next = TakeStale();
  refreshing_ = !next.empty();
  if (!refreshing_) {
    refreshing_at_.clear();
    RunThenIfIdle(&lock);
  }
  return next;
}

size_t PulledAhead::MarkStale(const int64_t* ids, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t marked = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t at = index_.Find(ids[i]);
    if (at >= 0 && !stale_[at]) {
      stale_[at] = 1;
      ++marked;
    }
  }
  return marked;
}

std::vector<int64_t> PulledAhead::StaleIds() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  for (size_t i = 0; i < unique_.size(); ++i) {
    if (stale_[i]) out.push_back(unique_[i]);
  }
  return out;
}

void PulledAhead::Refresh(const float* rows) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0, k = 0; i < unique_.size(); ++i) {
    if (!stale_[i]) continue;
    std::memcpy(rows_.data() + i * dim_, rows + k * dim_, sizeof(float) * dim_);
    ++k;
  }
}

void PulledAhead::CopyRows(float* out) const {
  GatherBySlot(rows_.data(), slot_.data(), ids_.size(), dim_, out);
}

std::shared_ptr<PulledAhead> PullAhead::Begin(const std::string& table, PullMode mode, uint32_t dim,
                                              const int64_t* ids, size_t n, bool refresh,
                                              uint32_t pulls_per_batch) {
  auto pulled = std::make_shared<PulledAhead>(table, mode, dim, ids, n, refresh);
  pulls_per_batch = std::max<uint32_t>(pulls_per_batch, 1);
  std::lock_guard<std::mutex> lock(mu_);
  Batches& batches = batches_[table];
  if (batches.in_batch >= pulls_per_batch) {
    ++batches.batch;
    batches.in_batch = 0;
  }
  ++batches.in_batch;
  pulled->batch_ = batches.batch;
  std::deque<std::shared_ptr<PulledAhead>>& queue = waiting_[table];
  if (queue.size() >= max_per_table_ * pulls_per_batch) {
    queue.front()->SetTaken();  // dropped: nothing refreshes it any more
    queue.pop_front();
    ++counts_.dropped;
  }
  queue.push_back(pulled);
  ++counts_.begun;
  return pulled;
}

std::shared_ptr<PulledAhead> PullAhead::Take(const std::string& table, PullMode mode, uint32_t dim,
                                             const int64_t* ids, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = waiting_.find(table);
  if (it == waiting_.end()) return nullptr;
  std::deque<std::shared_ptr<PulledAhead>>& queue = it->second;
  // The newest match: an older one of the same ids is a batch a lookup
  // skipped, or one begun by an input pipeline that stopped (a fit that
  // ended or failed, before a checkpoint was loaded): its rows may be older
  // than the lookup's own pull ahead, which came later.
  for (auto r = queue.rbegin(); r != queue.rend(); ++r) {
    if ((*r)->mode() != mode || (*r)->dim() != dim || !(*r)->Matches(ids, n)) continue;
    const auto p = std::prev(r.base());
    std::shared_ptr<PulledAhead> taken = std::move(*p);
    taken->SetTaken();
    // Older ones of earlier batches were skipped by the lookups they were
    // for: never taken (and no longer refreshed). Those of its own batch
    // wait for the batch's other lookups.
    std::deque<std::shared_ptr<PulledAhead>> kept;
    for (auto q = queue.begin(); q != p; ++q) {
      if ((*q)->batch() < taken->batch()) {
        (*q)->SetTaken();
        ++counts_.dropped;
      } else {
        kept.push_back(std::move(*q));
      }
    }
    kept.insert(kept.end(), std::make_move_iterator(p + 1), std::make_move_iterator(queue.end()));
    queue.swap(kept);
    ++counts_.taken;
    return taken;
  }
  return nullptr;
}

std::vector<std::shared_ptr<PulledAhead>> PullAhead::Pushed(const std::string& table,
                                                            const int64_t* ids, size_t n) {
  std::vector<std::shared_ptr<PulledAhead>> marked;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = waiting_.find(table);
  if (it == waiting_.end()) return marked;
  for (const std::shared_ptr<PulledAhead>& pulled : it->second) {
    if (!pulled->refresh()) continue;
    const size_t stale = pulled->MarkStale(ids, n);
    counts_.stale_rows += stale;
    if (stale) marked.push_back(pulled);
  }
  return marked;
}

size_t PullAhead::DropAll() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t dropped = 0;
  for (auto& [table, queue] : waiting_) {
    for (const std::shared_ptr<PulledAhead>& pulled : queue) pulled->SetTaken();
    dropped += queue.size();
  }
  waiting_.clear();
  batches_.clear();  // the next pipeline starts its batches afresh
  counts_.dropped += dropped;
  return dropped;
}

void PullAhead::CountRefreshed(size_t rows) {
  std::lock_guard<std::mutex> lock(mu_);
  counts_.refreshed_rows += rows;
}

PullAhead::Counts PullAhead::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

}  // namespace dlt
