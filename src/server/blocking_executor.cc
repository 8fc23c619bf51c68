#include "server/blocking_executor.h"

#include <utility>

namespace eldr::server {

BlockingExecutor::BlockingExecutor(int threads) {
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

BlockingExecutor::~BlockingExecutor() { Shutdown(); }

bool BlockingExecutor::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  queue_.push_back(std::move(task));
  return true;
}

void BlockingExecutor::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void BlockingExecutor::Loop() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BlockingExecutor* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->stopping_ || !self->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace eldr::server
