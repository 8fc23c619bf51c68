// A small queue of threads for the few RPCs that do blocking work (reading and indexing a centroid
// artifact), so callback-API reactors never block gRPC's event threads.
//
// Thread-safety: Submit and Shutdown may be called from any thread.
#ifndef ELDR_SERVER_BLOCKING_EXECUTOR_H_
#define ELDR_SERVER_BLOCKING_EXECUTOR_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace eldr::server {

class BlockingExecutor {
 public:
  explicit BlockingExecutor(int threads);
  // Shutdown() if not done yet.
  ~BlockingExecutor();

  BlockingExecutor(const BlockingExecutor&) = delete;
  BlockingExecutor& operator=(const BlockingExecutor&) = delete;

  // Queues `task`. Returns false (and drops the task) once Shutdown has begun: the caller then
  // answers the RPC itself.
  bool Submit(std::function<void()> task);

  // Runs every queued task, then joins the threads. Idempotent.
  void Shutdown();

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace eldr::server

#endif  // ELDR_SERVER_BLOCKING_EXECUTOR_H_
