// Small process helpers for the simulator's tests: run a command and capture its output, and run
// the real eldr-router on a kernel-chosen loopback port for the duration of a test.
//
// Every wait is bounded. A RouterDaemon kills its child when it goes out of scope, and the child
// dies with the test process (PR_SET_PDEATHSIG), so a failing test never leaks a daemon.
#ifndef ELDR_TESTS_SIM_PROCESS_UTIL_H_
#define ELDR_TESTS_SIM_PROCESS_UTIL_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace eldr::sim::testing {

// <ELDR_BIN_DIR>/<name> (ELDR_BIN_DIR is set by CTest).
std::string BinaryPath(const std::string& name);
// A fresh folder under TEST_TMPDIR or /tmp.
std::string MakeTempDir();

struct CommandResult {
  int exit_code = -1;  // 128 + signal when killed
  std::string out;
  std::string err;
};

// Runs `argv` (no shell), waits at most `timeout_s` (then kills it: exit_code 137).
CommandResult RunCommand(const std::vector<std::string>& argv, double timeout_s);

class RouterDaemon {
 public:
  // Starts eldr-router with `args` plus --listen and --metrics_listen on 127.0.0.1:0 and a
  // --port_file, and waits until the port file names the chosen port.
  static absl::StatusOr<std::unique_ptr<RouterDaemon>> Start(const std::string& dir,
                                                             const std::vector<std::string>& args,
                                                             double timeout_s = 20);
  ~RouterDaemon();  // SIGTERM, bounded wait, then SIGKILL

  std::string target() const { return "127.0.0.1:" + std::to_string(grpc_port_); }
  std::string Log() const;

 private:
  RouterDaemon() = default;
  pid_t pid_ = -1;
  int grpc_port_ = 0;
  std::string log_path_;
};

}  // namespace eldr::sim::testing

#endif  // ELDR_TESTS_SIM_PROCESS_UTIL_H_
