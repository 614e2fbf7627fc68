// A client's queue of pushes: at most `max_inflight` run at once and the
// rest wait their turn (backpressure on the training step); an asynchronous
// push's error is kept and reported by the next push or flush; a flush
// waits for every push queued before it. Pure C++ (the op library's
// ClientResource holds one; tests/cpp tests it alone).
#ifndef TF_DLT_NATIVE_NET_PUSH_QUEUE_H_
#define TF_DLT_NATIVE_NET_PUSH_QUEUE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "native/core/status.h"
#include "native/net/server_stats.h"

namespace dlt {

class PushQueue {
 public:
  using Work = std::function<Status()>;
  using Done = std::function<void(const Status&)>;

  // `schedule` runs a push's work on a worker thread; `wait`, when given,
  // records how long each push waited to start (microseconds).
  PushQueue(int max_inflight, std::function<void(std::function<void()>)> schedule,
            LatencyHistogram* wait = nullptr);

  // Queues a push (`work` does it). `admitted` runs when it starts (OK), or
  // at once with the error of an earlier asynchronous push, which it then
  // clears (`work` then never runs). `finished`, when given, gets the push's
  // result (a synchronous push); without it the push is asynchronous and
  // its error is kept for the next Enqueue or Flush. Callbacks never run
  // under the queue's lock.
  void Enqueue(Work work, Done admitted, Done finished = nullptr);
  // Calls `done` once every push queued before it finished (pushes queued
  // after it are not waited for: it waited for an empty queue, which a
  // steady stream of pushes never left), with the first asynchronous error
  // not yet reported (then cleared).
  void Flush(Done done);

  // Pushes running, and waiting to start.
  int inflight() const;
  int waiting() const;

 private:
  struct Pending {
    uint64_t seq;
    uint64_t enqueued_us;
    Work work;
    Done admitted;
    Done finished;
  };
  void Start(Pending push);
  void OnDone(uint64_t seq, const Status& status, bool record_error);
  // Every push numbered below this one has finished.
  uint64_t FinishedBelowLocked() const;

  const int max_inflight_;
  const std::function<void(std::function<void()>)> schedule_;
  LatencyHistogram* const wait_;
  mutable std::mutex mu_;
  int inflight_ = 0;               // guarded by mu_
  std::deque<Pending> waiting_;    // guarded by mu_
  uint64_t next_seq_ = 0;          // guarded by mu_
  std::set<uint64_t> unfinished_;  // queued or running pushes; guarded by mu_
  // Flushes, each with the number of the first push queued after it (so
  // in order of that number).
  std::deque<std::pair<uint64_t, Done>> flush_waiters_;  // guarded by mu_
  Status async_error_;                                   // guarded by mu_
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_PUSH_QUEUE_H_
