// A fixed set of worker threads running closures in FIFO order. No TF or
// Python headers, so the C++ suite (and its sanitizer build) tests it.
#ifndef TF_DLT_NATIVE_CORE_WORK_QUEUE_H_
#define TF_DLT_NATIVE_CORE_WORK_QUEUE_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace dlt {

class WorkQueue {
 public:
  explicit WorkQueue(int threads);
  // Lets the workers drain the queue, then joins them. It may run on one of
  // the queue's own workers (a closure dropped the last reference to the
  // queue's owner): that worker is detached and finishes on the state it
  // shares with the queue, which outlives the queue object.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  void Schedule(std::function<void()> fn);

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;  // guarded by mu
    bool stopping = false;                    // guarded by mu
  };
  static void Run(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
  std::vector<std::thread> threads_;
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_WORK_QUEUE_H_
