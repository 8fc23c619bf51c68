// Test support: a TCP proxy on a loopback port that forwards every byte to `upstream` and back,
// holding each chunk of the upstream's replies for `reply_delay` first: a slow Redis (or a slow
// network to it) that still answers everything, in order.
#ifndef ELDR_TESTS_CLUSTER_DELAY_PROXY_H_
#define ELDR_TESTS_CLUSTER_DELAY_PROXY_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace eldr::cluster::testing {

class DelayProxy {
 public:
  // Listens on 127.0.0.1 (a free port) and forwards each accepted connection to
  // 127.0.0.1:upstream_port. The delay may be changed at any time (applies to chunks read after).
  static absl::StatusOr<std::unique_ptr<DelayProxy>> Start(int upstream_port, absl::Duration reply_delay);
  // Closes every connection and joins the threads.
  ~DelayProxy();

  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  void set_reply_delay(absl::Duration delay) {
    reply_delay_us_.store(absl::ToInt64Microseconds(delay), std::memory_order_relaxed);
  }
  int64_t connections() const { return connections_.load(std::memory_order_relaxed); }

 private:
  DelayProxy(int listen_fd, int port, int upstream_port, absl::Duration reply_delay);
  void AcceptLoop();
  // Copies from `from` to `to` until either side closes; delays each chunk when `delayed`.
  void Pump(int from, int to, bool delayed);
  void Track(int fd);

  const int listen_fd_;
  const int port_;
  const int upstream_port_;
  std::atomic<int64_t> reply_delay_us_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> connections_{0};
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eldr::cluster::testing

#endif  // ELDR_TESTS_CLUSTER_DELAY_PROXY_H_
