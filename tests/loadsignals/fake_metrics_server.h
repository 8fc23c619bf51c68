// Test support: a real HTTP/1.1 server on 127.0.0.1 that plays a decode worker's Prometheus
// endpoint (vLLM or SGLang text format) with numbers the test changes, and that can misbehave on
// demand (malformed page, HTTP error, hanging, refusing connections).
//
// POSIX sockets, one accept thread plus one thread per connection (keep-alive is honoured, as a
// scraper reuses its connection). Thread-safe: every setter may be called while requests are served.
#ifndef ELDR_TESTS_LOADSIGNALS_FAKE_METRICS_SERVER_H_
#define ELDR_TESTS_LOADSIGNALS_FAKE_METRICS_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace eldr::testing {

// The numbers a fake worker reports.
struct FakeLoad {
  double running = 0;
  double waiting = 0;
  double kv_usage = 0;
};

// A full vLLM (v1) /metrics page as its prometheus_client writes it: HELP/TYPE lines, the three
// load gauges with `engine` and `model_name` labels (one series per data-parallel engine, `load`
// split evenly between `engines`), counters with _created samples, histograms with +Inf buckets,
// info gauges with many labels, and the Python process collectors.
std::string VllmMetricsPage(const FakeLoad& load, const std::string& model_name, int engines = 1);
// An SGLang /metrics page with sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage.
std::string SglangMetricsPage(const FakeLoad& load, const std::string& model_name);

class FakeMetricsServer {
 public:
  enum class Mode {
    kServe,      // 200 with the current page
    kMalformed,  // 200 with a page that is not valid text format
    kHttpError,  // 503
    kHang,       // reads requests and never answers them (a scraper times out)
    kDown,       // the listening socket is closed: connections are refused
  };

  // Binds 127.0.0.1:0 and starts serving `/metrics` with a vLLM page of zero load.
  static absl::StatusOr<std::unique_ptr<FakeMetricsServer>> Start(std::string model_name = "test-model");
  ~FakeMetricsServer();

  int port() const { return port_; }
  // http://127.0.0.1:<port>/metrics
  std::string url() const;

  // Serves a vLLM page with these numbers from now on.
  void SetLoad(const FakeLoad& load, int engines = 1);
  // Serves exactly `body` from now on.
  void SetPage(std::string body);
  // Changes the behaviour. Leaving kDown binds the same port again; the error says if that failed.
  absl::Status SetMode(Mode mode);

  // /metrics requests answered with a page (kServe or kMalformed).
  int64_t pages_served() const { return pages_served_.load(); }
  // Requests received, answered or not.
  int64_t requests_received() const { return requests_received_.load(); }

 private:
  explicit FakeMetricsServer(std::string model_name);
  absl::Status Listen(int port);
  void AcceptLoop();
  void ServeConnection(int fd);
  bool WaitReadable(int fd, int timeout_ms) const;

  const std::string model_name_;
  int port_ = 0;
  int wake_pipe_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> pages_served_{0};
  std::atomic<int64_t> requests_received_{0};

  mutable absl::Mutex mu_;
  std::string page_ ABSL_GUARDED_BY(mu_);
  Mode mode_ ABSL_GUARDED_BY(mu_) = Mode::kServe;
  int listen_fd_ ABSL_GUARDED_BY(mu_) = -1;
  struct Connection {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::thread accept_thread_;
  std::vector<Connection> connection_threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eldr::testing

#endif  // ELDR_TESTS_LOADSIGNALS_FAKE_METRICS_SERVER_H_
