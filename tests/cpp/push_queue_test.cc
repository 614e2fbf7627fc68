// PushQueue: at most max_inflight pushes run, the rest wait their turn; an
// asynchronous push's error reaches the next push or flush, a synchronous
// one's only its caller; a flush waits for every push before it. The test
// is the worker pool: it runs each scheduled push when it chooses.
#include "native/net/push_queue.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/cpp/harness.h"

namespace dlt {
namespace {

// Pushes handed to the worker pool, run by the test in order.
struct ManualPool {
  std::vector<std::function<void()>> scheduled;
  void RunNext() {
    std::function<void()> fn = std::move(scheduled.front());
    scheduled.erase(scheduled.begin());
    fn();
  }
  std::function<void(std::function<void()>)> Scheduler() {
    return [this](std::function<void()> fn) { scheduled.push_back(std::move(fn)); };
  }
};

DLT_TEST(TestPushQueueBoundsPushesInFlight) {
  ManualPool pool;
  LatencyHistogram wait;
  PushQueue queue(2, pool.Scheduler(), &wait);
  std::vector<int> admitted, ran;
  for (int i = 0; i < 4; ++i) {
    queue.Enqueue(
        [&ran, i]() {
          ran.push_back(i);
          return OkStatus();
        },
        [&admitted, i](const Status& s) {
          EXPECT(s.ok());
          admitted.push_back(i);
        });
  }
  EXPECT((admitted == std::vector<int>{0, 1}));  // the others wait: backpressure
  EXPECT(queue.inflight() == 2 && queue.waiting() == 2 && pool.scheduled.size() == 2);
  pool.RunNext();  // push 0 done: push 2 starts
  EXPECT((admitted == std::vector<int>{0, 1, 2}) && queue.waiting() == 1);
  while (!pool.scheduled.empty()) pool.RunNext();
  EXPECT((ran == std::vector<int>{0, 1, 2, 3}) && (admitted == std::vector<int>{0, 1, 2, 3}));
  EXPECT(queue.inflight() == 0 && queue.waiting() == 0);
}

DLT_TEST(TestPushQueueReportsAnAsyncErrorOnceToTheNextPush) {
  ManualPool pool;
  PushQueue queue(4, pool.Scheduler());
  queue.Enqueue([]() { return Unavailable("shard 1 gone"); }, [](const Status& s) {});
  pool.RunNext();
  Status seen;
  bool ran = false;
  queue.Enqueue(
      [&ran]() {
        ran = true;
        return OkStatus();
      },
      [&seen](const Status& s) { seen = s; });
  EXPECT(seen.code() == Code::kUnavailable && !ran && pool.scheduled.empty());
  EXPECT(seen.message() ==
         "an earlier asynchronous push failed, and this push was not sent: shard 1 gone");
  queue.Enqueue([]() { return OkStatus(); }, [&seen](const Status& s) { seen = s; });
  EXPECT(seen.ok() && pool.scheduled.size() == 1);  // reported once, then cleared
  pool.RunNext();
}

DLT_TEST(TestPushQueueGivesASyncErrorToItsCallerOnly) {
  ManualPool pool;
  PushQueue queue(1, pool.Scheduler());
  Status finished, admitted;
  queue.Enqueue([]() { return InvalidArgument("non-finite gradient"); },
                [&admitted](const Status& s) { admitted = s; },
                [&finished](const Status& s) { finished = s; });
  pool.RunNext();
  EXPECT(admitted.ok() && finished.code() == Code::kInvalidArgument);
  Status flushed = Internal("not called");
  queue.Flush([&flushed](const Status& s) { flushed = s; });
  EXPECT(flushed.ok());  // not kept for others
}

DLT_TEST(TestPushQueueFlushWaitsForEveryPushAndTakesTheFirstError) {
  ManualPool pool;
  PushQueue queue(1, pool.Scheduler());
  Status flushed = Internal("not called");
  queue.Flush([&flushed](const Status& s) { flushed = s; });
  EXPECT(flushed.ok());  // nothing queued: at once
  queue.Enqueue([]() { return Status(Code::kDeadlineExceeded, "first"); }, [](const Status&) {});
  queue.Enqueue([]() { return Unavailable("second"); }, [](const Status&) {});
  int flushes = 0;
  queue.Flush([&](const Status& s) {
    ++flushes;
    flushed = s;
  });
  EXPECT(flushes == 0);
  pool.RunNext();  // the first fails; the second starts
  EXPECT(flushes == 0);
  pool.RunNext();
  EXPECT(flushes == 1 && flushed.code() == Code::kDeadlineExceeded);
  queue.Flush([&flushed](const Status& s) { flushed = s; });
  EXPECT(flushed.ok());  // reported once
}

DLT_TEST(TestPushQueueFlushWaitsForThePushesBeforeItOnly) {
  // Pushes queued after a flush are not waited for: it waited for an empty
  // queue, which a steady stream of pushes (another thread's steps) never
  // left. Out of order too: a later push finishing first frees nobody.
  ManualPool pool;
  PushQueue queue(2, pool.Scheduler());
  queue.Enqueue([]() { return OkStatus(); }, [](const Status&) {});  // 0
  queue.Enqueue([]() { return OkStatus(); }, [](const Status&) {});  // 1
  int flushes = 0;
  queue.Flush([&flushes](const Status& s) { flushes += s.ok(); });
  queue.Enqueue([]() { return OkStatus(); }, [](const Status&) {});  // 2, waits for a turn
  std::function<void()> first = std::move(pool.scheduled.front());
  pool.scheduled.erase(pool.scheduled.begin());
  pool.RunNext();  // push 1 done: push 2 starts
  EXPECT(flushes == 0 && pool.scheduled.size() == 1);
  first();  // push 0 done: every push before the flush finished, push 2 runs
  EXPECT(flushes == 1 && queue.inflight() == 1);
  queue.Enqueue([]() { return OkStatus(); }, [](const Status&) {});  // 3
  queue.Flush([&flushes](const Status& s) { flushes += s.ok(); });
  pool.RunNext();
  EXPECT(flushes == 1);
  pool.RunNext();
  EXPECT(flushes == 2 && queue.inflight() == 0);
}

DLT_TEST(TestPushQueueOnThreads) {
  // Real threads: every push runs once, never more than the bound at once.
  std::vector<std::thread> threads;
  std::mutex mu;
  PushQueue queue(3, [&](std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu);
    threads.emplace_back(std::move(fn));
  });
  std::atomic<int> running{0}, most{0}, done{0};
  for (int i = 0; i < 40; ++i) {
    queue.Enqueue(
        [&]() {
          const int now = ++running;
          int seen = most.load();
          while (now > seen && !most.compare_exchange_weak(seen, now)) {
          }
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          --running;
          ++done;
          return OkStatus();
        },
        [](const Status&) {});
  }
  std::atomic<bool> flushed{false};
  queue.Flush([&flushed](const Status& s) { flushed = s.ok(); });
  for (int spins = 0; !flushed && spins < 20000; ++spins) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT(flushed && done == 40 && most <= 3);
  std::lock_guard<std::mutex> lock(mu);
  for (std::thread& t : threads) t.join();
}

}  // namespace
}  // namespace dlt
