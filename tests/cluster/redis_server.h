// Test support: a real redis-server (Debian's /usr/bin/redis-server) as a child of the test, on a
// loopback port of its own, with its own folder and no persistence, killed with the test.
#ifndef ELDR_TESTS_CLUSTER_REDIS_SERVER_H_
#define ELDR_TESTS_CLUSTER_REDIS_SERVER_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "eldr/core/centroid_artifact.h"
#include "testing/process.h"

namespace eldr::cluster::testing {

// The redis-server binary: $ELDR_REDIS_SERVER, else /usr/bin/redis-server.
std::string RedisServerBinary();

class RedisServer {
 public:
  // Starts a fresh, empty server ("--save '' --appendonly no", DEBUG enabled) on a port that was
  // just free; retries a few ports when one was taken meanwhile. Returns once PING answers.
  static absl::StatusOr<std::unique_ptr<RedisServer>> Start(std::vector<std::string> extra_args = {});
  ~RedisServer();

  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  const std::string& dir() const { return dir_.path(); }

  // SIGKILL and reap.
  void Kill();
  // Kill (if running) and start again, empty, on the same port. Returns once PING answers.
  absl::Status Restart();
  // SIGSTOP / SIGCONT: a hung server whose port still accepts connections.
  void Pause();
  void Resume();
  std::string Log() const;

 private:
  RedisServer(int port, std::vector<std::string> extra_args) : port_(port), extra_args_(std::move(extra_args)) {}
  absl::Status Launch();

  int port_;
  std::vector<std::string> extra_args_;
  eldr::testing::TempDir dir_;
  std::unique_ptr<eldr::testing::ChildProcess> process_;
  int launches_ = 0;
};

// A small valid artifact: `k` unit rows over 4 layers x 8 experts (variant count), rows named
// w0..w{k-1}, the rows rotated by `variant` so two variants differ.
CentroidArtifact TestArtifact(int k = 3, int variant = 0);

// Polls `condition` every 5 ms until it holds or `timeout` passes; returns whether it held.
template <typename F>
bool WaitFor(F condition, absl::Duration timeout) {
  return eldr::testing::PollUntil(std::move(condition), timeout);
}

}  // namespace eldr::cluster::testing

#endif  // ELDR_TESTS_CLUSTER_REDIS_SERVER_H_
