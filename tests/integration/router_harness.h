// Test harness for integration tests: the real eldr-router binary on kernel-chosen loopback ports
// (on top of the process harness, testing/process.h), small centroid artifacts, Route requests,
// /metrics scrapes and parsing, TLS certificates made with the openssl CLI.
//
// Every wait is bounded; a RouterProcess kills its child when it goes out of scope (and the child
// dies with the test process through PR_SET_PDEATHSIG), so a failing test never leaks a daemon.
#ifndef ELDR_TESTS_INTEGRATION_ROUTER_HARNESS_H_
#define ELDR_TESTS_INTEGRATION_ROUTER_HARNESS_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "eldr/v1/router.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "health.grpc.pb.h"
#include "testing/process.h"

namespace eldr::testing {

// Writes `contents` to `path` (replacing it atomically); fails the test on error.
void WriteTextFile(const std::string& path, const std::string& contents);
std::string ReadTextFile(const std::string& path);

class RouterProcess {
 public:
  // Starts eldr-router with `args` plus --listen/--admin_listen/--metrics_listen on 127.0.0.1:0
  // (unless `args` sets them) and a --port_file, and waits (bounded) until the port file appears
  // (testing/process.h, StartRouter).
  static absl::StatusOr<std::unique_ptr<RouterProcess>> Start(const TempDir& dir, std::vector<std::string> args,
                                                              absl::Duration timeout = absl::Seconds(20));

  int grpc_port() const { return grpc_port_; }
  int admin_port() const { return admin_port_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return process_->pid(); }
  std::string target() const { return "127.0.0.1:" + std::to_string(grpc_port_); }
  std::string admin_target() const { return "127.0.0.1:" + std::to_string(admin_port_); }

  void Signal(int signal) const;
  // The exit code (or 128 + signal) once it exits; nullopt on timeout.
  std::optional<int> WaitForExit(absl::Duration timeout);
  // Everything the daemon wrote to stderr so far.
  std::string Log() const;

  std::shared_ptr<grpc::Channel> Channel() const;
  std::unique_ptr<eldr::v1::DecodeRouter::Stub> RouterStub() const;
  std::unique_ptr<eldr::v1::RouterAdmin::Stub> AdminStub() const;
  std::unique_ptr<grpc::health::v1::Health::Stub> HealthStub() const;

 private:
  RouterProcess() = default;

  std::unique_ptr<ChildProcess> process_;
  int grpc_port_ = 0;
  int admin_port_ = 0;
  int metrics_port_ = 0;
};

// ---- Artifacts and requests: the bundled traces' geometry (26 x 64) ----
inline constexpr int kLayers = 26;
inline constexpr int kExperts = 64;

// An artifact (variant "count", every layer) whose row i is uniform over the experts of block
// blocks[i] (16 experts per block: block b = experts [16b, 16b + 16)) in every layer, so a
// signature concentrated on block b scores only the rows of block b. `workers` names the rows
// (empty: unnamed rows).
std::string ArtifactJson(const std::vector<int>& blocks, const std::vector<std::string>& workers = {});
// `n` workers w0..w(n-1) at fictitious addresses 10.0.0.<i>:8000, as a --workers value.
std::string WorkerFlag(int n);

// Counts concentrated on block b (plus nothing elsewhere), int16 little-endian.
eldr::v1::RouteRequest BlockRequest(int block, const std::string& request_id = "req");

// ---- Daemon set-ups and RPC helpers shared by the integration tests ----
// A client context whose deadline is `timeout` from now: every RPC of a test is bounded.
std::unique_ptr<grpc::ClientContext> Ctx(absl::Duration timeout = absl::Seconds(10));
// Flags of the standard daemon: workers w0..w3, an artifact whose row i (named wi) is block i, so
// BlockRequest(i) goes to wi. The artifact is written into `dir`.
std::vector<std::string> StandardArgs(const TempDir& dir);
// RouterProcess::Start that records a test failure (and returns null) when the daemon does not start.
std::unique_ptr<RouterProcess> MustStart(const TempDir& dir, std::vector<std::string> args);
// RouterAdmin.GetState (a failed RPC is a test failure; the response is then empty).
eldr::v1::GetStateResponse State(const RouterProcess& router);
// The worker `id` in `state`, or null. Points into `state`.
const eldr::v1::WorkerState* FindWorker(const eldr::v1::GetStateResponse& state, const std::string& id);

// Routes BlockRequest(block) on `router` and completes the lease: the worker id, or "" when the
// Route failed (the Complete's outcome is not looked at).
std::string RouteAndComplete(const RouterProcess& router, int block);

// Route + Complete of BlockRequest(n % 4) in a loop on a thread of its own, over `targets` in
// turn (one stub each), with `pause` between two routes, until Stop(): counts the routes, the
// failed RPCs (Route or Complete) and keeps each route's latency.
class RouteTraffic {
 public:
  explicit RouteTraffic(std::vector<const RouterProcess*> targets, absl::Duration pause = absl::ZeroDuration());
  ~RouteTraffic() { Stop(); }
  RouteTraffic(const RouteTraffic&) = delete;
  RouteTraffic& operator=(const RouteTraffic&) = delete;

  void Stop();
  int64_t routes() const { return routes_.load(); }
  int64_t failures() const { return failures_.load(); }
  std::string last_error() const;
  // The latency percentile (q in [0, 1]) of the routes made since the last call, in
  // microseconds; -1 when there were none.
  double TakePercentileUs(double q);

 private:
  void Run();

  std::vector<std::unique_ptr<eldr::v1::DecodeRouter::Stub>> stubs_;
  const absl::Duration pause_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> routes_{0};
  std::atomic<int64_t> failures_{0};
  mutable absl::Mutex mu_;
  std::vector<double> latencies_us_ ABSL_GUARDED_BY(mu_);
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// ---- Metrics ----
struct Sample {
  std::map<std::string, std::string> labels;
  double value = 0;
};
// Parses the Prometheus text format; every non-comment line must be `name{labels} value`.
// Returns samples by metric name (histograms under name_bucket/_sum/_count) and the TYPE lines.
struct ParsedMetrics {
  std::map<std::string, std::vector<Sample>> samples;
  std::map<std::string, std::string> types;  // family name -> counter/gauge/histogram/...
  // Value of the sample of `name` whose labels include all of `labels`; nullopt if none.
  std::optional<double> Value(const std::string& name, const std::map<std::string, std::string>& labels = {}) const;
};
absl::StatusOr<ParsedMetrics> ParsePrometheusText(const std::string& text);
absl::StatusOr<ParsedMetrics> ScrapeMetrics(int port);
// The sum of the samples of `name` whose labels include all of `labels` (0 when none).
double MetricSum(const ParsedMetrics& metrics, const std::string& name,
                 const std::map<std::string, std::string>& labels = {});
// MetricSum of a fresh scrape of the daemon; a failed scrape is a test failure (and -1).
double Scraped(const RouterProcess& router, const std::string& name,
               const std::map<std::string, std::string>& labels = {});

// ---- TLS ----
struct CertificateSet {
  std::string ca_cert;  // paths
  std::string server_cert;
  std::string server_key;
  std::string client_cert;
  std::string client_key;
};
// A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed by
// the CA, written under `dir` with file names prefixed by `prefix`. EC P-256 keys (fast).
absl::StatusOr<CertificateSet> MakeCertificates(const TempDir& dir, const std::string& prefix);

// A TLS channel to 127.0.0.1:port that verifies the server against the CA file `ca` (as
// "localhost") and, when `cert` is given, presents that client certificate with `key`. Each
// channel gets its own connection (no shared subchannel), so a handshake happens per channel.
std::shared_ptr<grpc::Channel> TlsChannel(int port, const std::string& ca, const std::string& cert = "",
                                          const std::string& key = "");

}  // namespace eldr::testing

#endif  // ELDR_TESTS_INTEGRATION_ROUTER_HARNESS_H_
