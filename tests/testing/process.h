// The test harness for real processes, shared by every test that runs a built binary (integration,
// simulator, soak, deploy helpers): temporary folders, child processes that never outlive the test
// (PR_SET_PDEATHSIG, kill on destruction), eldr-router started on kernel-chosen loopback ports,
// and a minimal HTTP client for its operations endpoint. No GoogleTest dependency: the soak driver
// uses it too. Every wait is bounded.
#ifndef ELDR_TESTS_TESTING_PROCESS_H_
#define ELDR_TESTS_TESTING_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace eldr::testing {

// <ELDR_BIN_DIR>/<name> (ELDR_BIN_DIR is set by CTest; "." without it).
std::string BinaryPath(const std::string& name);

// The bundled traces: <ELDR_DATA_DIR>/esft-routing (ELDR_DATA_DIR is set by CTest; "data" without it).
std::string BundledTraceDir();

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

// Waits until `port_file` holds a JSON object whose `key` is an integer (a daemon's port file, as
// eldr-proxy and eldr-engine-emu write it: {"port": N, "pid": P, ...}) and returns it. Fails early
// (with the daemon's log) when the process exits first, and when the file does not name the
// process's "pid" (e.g. a stale file of another run).
absl::StatusOr<int> WaitForPort(const std::string& port_file, const std::string& key, ChildProcess& process,
                                absl::Duration timeout = absl::Seconds(20));

// Waits until `port_file` holds the daemon's port JSON ({"grpc_port","admin_port","metrics_port",
// "pid"}). Fails early (with the daemon's log) when the process exits first, or as WaitForPort.
absl::StatusOr<DaemonPorts> WaitForPortFile(const std::string& port_file, ChildProcess& process,
                                            absl::Duration timeout = absl::Seconds(20));

// GET http://127.0.0.1:<port><path> (a plain HTTP/1.0 client). Returns the body of a 200 answer.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path, absl::Duration timeout = absl::Seconds(5));

// The value of the sample `series` (exact text before the value, e.g.
// `eldr_scrape_errors_total{worker="w0",kind="transport"}`) on a Prometheus page, or nullopt.
std::optional<double> SampleValue(const std::string& page, const std::string& series);

// Runs a binary to completion (bounded; killed with SIGKILL past `timeout`, exit_code 137).
struct ProcessResult {
  int exit_code = -1;  // 128 + signal when killed
  std::string stdout_text;
  std::string stderr_text;
  bool timed_out = false;
};
ProcessResult RunProcess(const std::string& binary, const std::vector<std::string>& args,
                         absl::Duration timeout = absl::Seconds(60));

// eldr-router as a child of the test: `args` plus --listen, --admin_listen and --metrics_listen on
// 127.0.0.1:0 (unless `args` sets them) and a --port_file in `dir`; returns once it listens.
struct RouterChild {
  std::unique_ptr<ChildProcess> process;
  DaemonPorts ports;
};
absl::StatusOr<RouterChild> StartRouter(const TempDir& dir, std::vector<std::string> args,
                                        absl::Duration timeout = absl::Seconds(20));
// Whether `args` sets flag `name` (--name or --name=...).
bool HasFlag(const std::vector<std::string>& args, const std::string& name);

// One HTTP exchange on 127.0.0.1:<port>: sends `request` as given (raw bytes; for hostile-client
// tests) and reads until the server closes or `timeout`. Returns what the server sent.
absl::StatusOr<std::string> HttpExchange(int port, const std::string& request,
                                         absl::Duration timeout = absl::Seconds(5));
// The status code of an HTTP response text, or -1 when it is not one.
int HttpStatusOf(const std::string& response);

// A loopback port that was just free (bound to 127.0.0.1:0, noted, closed): nobody listens there,
// so a connection to it is refused. 0 when no socket could be bound. The port is free for anyone
// once this returns: a test running beside this one may start a server there at any moment, so it
// is "dead" for an instant only. For an address that must stay dead, use ReservedLoopbackPort.
int UnusedLoopbackPort();

// A loopback TCP port that stays dead for the object's lifetime: a socket bound to 127.0.0.1:0
// that never listens. A connection to the port is refused (ECONNREFUSED on Linux: no listener, so
// the SYN is answered with RST), and no other socket can bind the port meanwhile (this one sets
// neither SO_REUSEADDR nor SO_REUSEPORT; the kernel skips a bound port for ephemeral ports too), so
// no test running beside this one can ever serve there. For the "dead" engine, router or worker
// addresses a test relies on for longer than an instant. Move-only; the destructor closes it.
class ReservedLoopbackPort {
 public:
  // INTERNAL when no socket could be made or bound.
  static absl::StatusOr<ReservedLoopbackPort> Create();
  ReservedLoopbackPort(ReservedLoopbackPort&& other) noexcept;
  ReservedLoopbackPort& operator=(ReservedLoopbackPort&& other) noexcept;
  ReservedLoopbackPort(const ReservedLoopbackPort&) = delete;
  ReservedLoopbackPort& operator=(const ReservedLoopbackPort&) = delete;
  ~ReservedLoopbackPort();

  int port() const { return port_; }
  // "127.0.0.1:<port>".
  std::string address() const;

 private:
  ReservedLoopbackPort(int fd, int port) : fd_(fd), port_(port) {}
  int fd_ = -1;
  int port_ = 0;
};

// Calls `condition` every `period` until it holds or `timeout` passes; returns whether it held
// (it is called once more at the deadline).
template <typename Condition>
bool PollUntil(Condition condition, absl::Duration timeout, absl::Duration period = absl::Milliseconds(5)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (condition()) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(period);
  }
}

}  // namespace eldr::testing

#endif  // ELDR_TESTS_TESTING_PROCESS_H_
