// Soak support: run the real eldr-router (or any built tool) as a child process, find the ports it
// bound, read its Prometheus page and its memory use, and never leave it behind.
#ifndef ELDR_TESTS_SOAK_PROCESS_H_
#define ELDR_TESTS_SOAK_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace eldr::soak {

// A fresh, empty temporary folder removed (recursively) on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A child process whose stderr goes to a log file (and stdout too, unless `stdout_path` is
// given). The destructor kills (SIGKILL) and reaps it if it still runs, so a failing run never
// leaks a daemon.
class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(const std::vector<std::string>& argv,
                                                             const std::string& log_path,
                                                             const std::string& stdout_path = "");
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  // The log so far (the last `max_bytes` of it).
  std::string Log(size_t max_bytes = 16384) const;

  // False once the process exited (it is then reaped and its status kept).
  bool Running();
  // Waits up to `timeout` for the exit. Returns the exit code, or 128 + signal when killed by one;
  // DEADLINE_EXCEEDED when it still runs.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  void Signal(int signal) const;
  // Resident memory in KiB from /proc/<pid>/status (VmRSS); nullopt once it exited.
  std::optional<int64_t> RssKib() const;

 private:
  ChildProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}
  pid_t pid_;
  std::string log_path_;
  std::optional<int> exit_code_;
};

struct DaemonPorts {
  int grpc = 0;
  int admin = 0;
  int metrics = 0;
};

// Waits until `port_file` holds the daemon's port JSON ({"grpc_port","admin_port","metrics_port"}).
// Fails early (with the daemon's log) when the process exits first.
absl::StatusOr<DaemonPorts> WaitForPortFile(const std::string& port_file, ChildProcess& process,
                                            absl::Duration timeout = absl::Seconds(20));

// GET http://127.0.0.1:<port><path> (a plain HTTP/1.0 client). Returns the body of a 200 answer.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path, absl::Duration timeout = absl::Seconds(5));

// The value of the sample `series` (exact text before the value, e.g.
// `eldr_scrape_errors_total{worker="w0",kind="transport"}`) on a Prometheus page, or nullopt.
std::optional<double> SampleValue(const std::string& page, const std::string& series);

}  // namespace eldr::soak

#endif  // ELDR_TESTS_SOAK_PROCESS_H_
