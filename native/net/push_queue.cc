#include "native/net/push_queue.h"

#include <chrono>
#include <string>
#include <utility>

namespace dlt {
namespace {

uint64_t NowMicros() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

PushQueue::PushQueue(int max_inflight, std::function<void(std::function<void()>)> schedule,
                     LatencyHistogram* wait)
    : max_inflight_(max_inflight < 1 ? 1 : max_inflight),
      schedule_(std::move(schedule)),
      wait_(wait) {}

void PushQueue::Enqueue(Work work, Done admitted, Done finished) {
  Pending push{0, NowMicros(), std::move(work), std::move(admitted), std::move(finished)};
  Status earlier;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!async_error_.ok()) {
      earlier = std::move(async_error_);
      async_error_ = OkStatus();
    } else {
      push.seq = next_seq_++;
      unfinished_.insert(unfinished_.end(), push.seq);
      if (inflight_ >= max_inflight_) {
        waiting_.push_back(std::move(push));  // backpressure: admitted later
        return;
      }
      ++inflight_;
    }
  }
  if (!earlier.ok()) {
    push.admitted(Status(
        earlier.code(),
        "an earlier asynchronous push failed, and this push was not sent: " + earlier.message()));
    return;
  }
  Start(std::move(push));
}

void PushQueue::Start(Pending push) {
  if (wait_ != nullptr) wait_->Record(NowMicros() - push.enqueued_us);
  Done admitted = std::move(push.admitted);
  schedule_(
      [this, seq = push.seq, work = std::move(push.work), finished = std::move(push.finished)]() {
        const Status status = work();
        if (finished) finished(status);
        OnDone(seq, status, /*record_error=*/!finished);
      });
  admitted(OkStatus());
}

void PushQueue::OnDone(uint64_t seq, const Status& status, bool record_error) {
  std::vector<Pending> to_start;
  std::vector<Done> flushed;
  Status flush_status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --inflight_;
    unfinished_.erase(seq);
    if (record_error && !status.ok() && async_error_.ok()) async_error_ = status;
    while (!waiting_.empty() && inflight_ < max_inflight_) {
      to_start.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
      ++inflight_;
    }
    // Flushes wait in the order they came, each for the pushes before it.
    const uint64_t finished_below = FinishedBelowLocked();
    while (!flush_waiters_.empty() && flush_waiters_.front().first <= finished_below) {
      flushed.push_back(std::move(flush_waiters_.front().second));
      flush_waiters_.pop_front();
    }
    if (!flushed.empty()) {
      flush_status = std::move(async_error_);
      async_error_ = OkStatus();
    }
  }
  for (Pending& p : to_start) Start(std::move(p));
  for (Done& done : flushed) done(flush_status);
}

uint64_t PushQueue::FinishedBelowLocked() const {
  return unfinished_.empty() ? next_seq_ : *unfinished_.begin();
}

void PushQueue::Flush(Done done) {
  Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (FinishedBelowLocked() < next_seq_) {
      flush_waiters_.emplace_back(next_seq_, std::move(done));
      return;
    }
    status = std::move(async_error_);
    async_error_ = OkStatus();
  }
  done(status);
}

int PushQueue::inflight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inflight_;
}

int PushQueue::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(waiting_.size());
}

}  // namespace dlt
