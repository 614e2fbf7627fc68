#include "native/core/work_queue.h"

#include <utility>

namespace dlt {

WorkQueue::WorkQueue(int threads) : state_(std::make_shared<State>()) {
  for (int i = 0; i < threads; ++i) {
    // Each thread holds the state: a detached worker never touches freed memory.
    threads_.emplace_back([state = state_] { Run(state); });
  }
}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
  }
  state_->cv.notify_all();
  for (std::thread& t : threads_) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // we run inside one of its closures; it exits once that returns
    } else {
      t.join();
    }
  }
}

void WorkQueue::Schedule(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push_back(std::move(fn));
  }
  state_->cv.notify_one();
}

void WorkQueue::Run(const std::shared_ptr<State>& state) {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&] { return state->stopping || !state->queue.empty(); });
      if (state->queue.empty()) return;
      fn = std::move(state->queue.front());
      state->queue.pop_front();
    }
    fn();
  }
}

}  // namespace dlt
