// A process-wide set of parked threads that run the parts of one call at
// once: fn(0) .. fn(n-1), on the pool's threads and the caller's, returning
// when all have run. Calls from several threads share the pool; each caller
// works on its own call too, so a call never waits for a thread that is busy
// with another. Used for a batch's cold reads (disk_tier.cc) and for the
// client's exchange with several shards (client_exchange.cc), and for a
// replication round's rows (RowStreamPool).
#ifndef TF_DLT_NATIVE_CORE_TASK_POOL_H_
#define TF_DLT_NATIVE_CORE_TASK_POOL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace dlt {

class TaskPool {
 public:
  // Never destroyed: its threads outlive main (a static's destructor would
  // race them).
  static TaskPool* Create(int threads) { return new TaskPool(threads); }
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  int threads() const { return threads_; }

  // Runs fn(i) for every i in [0, n); returns once all have run.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
    if (n <= 1 || threads_ == 0) {
      for (size_t i = 0; i < n; ++i) fn(i);
      return;
    }
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(job);
    }
    // As many threads as there are parts besides the caller's first.
    const size_t helpers = std::min<size_t>(n - 1, static_cast<size_t>(threads_));
    for (size_t k = 0; k < helpers; ++k) wake_.notify_one();
    Work(job.get());
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return job->finished == n; });
  }

 private:
  struct Job {
    const std::function<void(size_t)>* fn = nullptr;
    size_t n = 0;
    std::atomic<size_t> next{0};
    size_t finished = 0;  // guarded by mu_
  };

  explicit TaskPool(int threads) : threads_(std::max(threads, 0)) {
    for (int t = 0; t < threads_; ++t) std::thread([this] { Loop(); }).detach();
  }

  void Work(Job* job) {
    size_t ran = 0;
    for (size_t i; (i = job->next.fetch_add(1, std::memory_order_relaxed)) < job->n; ++ran) {
      (*job->fn)(i);
    }
    if (ran == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    job->finished += ran;
    if (job->finished == job->n) done_.notify_all();
  }

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return !jobs_.empty(); });
      std::shared_ptr<Job> job = jobs_.front();
      if (job->next.load(std::memory_order_relaxed) >= job->n) {  // all taken
        jobs_.pop_front();
        continue;
      }
      lock.unlock();
      Work(job.get());
      lock.lock();
    }
  }

  const int threads_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::deque<std::shared_ptr<Job>> jobs_;
};

// The threads that read, send and apply a replication round's rows beside
// the thread that owns the round (replicator.cc, request_handler.cc,
// table_stream.cc): one per core but that one, up to 7, on machines of 4
// cores or more; none below (there they would only take turns with the
// pushes that wait for them). TF_DLT_ROW_STREAM_THREADS sets the number
// (0 to 64).
inline TaskPool& RowStreamPool() {
  static TaskPool* pool = [] {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    int threads = cores >= 4 ? std::min(cores - 1, 7) : 0;
    if (const char* set = std::getenv("TF_DLT_ROW_STREAM_THREADS")) {
      threads = std::clamp(std::atoi(set), 0, 64);
    }
    return TaskPool::Create(threads);
  }();
  return *pool;
}

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_TASK_POOL_H_
