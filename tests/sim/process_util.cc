#include "sim/process_util.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace eldr::sim::testing {
namespace {

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Forks and execs `argv` with stdout/stderr redirected to the given files (empty: inherited).
pid_t Spawn(const std::vector<std::string>& argv, const std::string& out_path,
            const std::string& err_path) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;
  // Child: die with the test, whatever happens to it.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
  if (!out_path.empty()) {
    const int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) dup2(fd, STDOUT_FILENO);
  }
  if (!err_path.empty()) {
    const int fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) dup2(fd, STDERR_FILENO);
  }
  std::vector<char*> raw;
  for (const std::string& arg : argv) raw.push_back(const_cast<char*>(arg.c_str()));
  raw.push_back(nullptr);
  execv(raw[0], raw.data());
  _exit(127);
}

// Waits for `pid` up to `timeout_s`; returns its exit code, or -1 on timeout.
int WaitFor(pid_t pid, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    int status = 0;
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return -1;
    }
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

std::string BinaryPath(const std::string& name) {
  const char* dir = std::getenv("ELDR_BIN_DIR");
  return absl::StrCat(dir != nullptr ? dir : ".", "/", name);
}

std::string MakeTempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = absl::StrCat(base != nullptr ? base : "/tmp", "/eldr-sim-test-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return "/tmp";
  return pattern;
}

CommandResult RunCommand(const std::vector<std::string>& argv, double timeout_s) {
  const std::string dir = MakeTempDir();
  const std::string out = dir + "/stdout", err = dir + "/stderr";
  const pid_t pid = Spawn(argv, out, err);
  CommandResult result;
  result.exit_code = WaitFor(pid, timeout_s);
  if (result.exit_code == -1) {
    kill(pid, SIGKILL);
    WaitFor(pid, 5);
    result.exit_code = 137;
  }
  result.out = ReadWholeFile(out);
  result.err = ReadWholeFile(err);
  std::remove(out.c_str());
  std::remove(err.c_str());
  rmdir(dir.c_str());
  return result;
}

absl::StatusOr<std::unique_ptr<RouterDaemon>> RouterDaemon::Start(
    const std::string& dir, const std::vector<std::string>& args, double timeout_s) {
  const std::string binary = BinaryPath("eldr-router");
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat(binary, " is missing: build the eldr-router target"));
  }
  std::unique_ptr<RouterDaemon> daemon(new RouterDaemon());
  const std::string port_file = dir + "/ports.json";
  daemon->log_path_ = dir + "/eldr-router.log";
  std::vector<std::string> argv = {binary, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                                   "--port_file=" + port_file};
  argv.insert(argv.end(), args.begin(), args.end());
  daemon->pid_ = Spawn(argv, "", daemon->log_path_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(daemon->pid_, &status, WNOHANG) == daemon->pid_) {
      daemon->pid_ = -1;
      return absl::InternalError(absl::StrCat("eldr-router exited at start: ", daemon->Log()));
    }
    const std::string ports = ReadWholeFile(port_file);
    if (!ports.empty()) {
      const nlohmann::json parsed = nlohmann::json::parse(ports, nullptr, false);
      if (!parsed.is_discarded() && parsed.contains("grpc_port")) {
        daemon->grpc_port_ = parsed["grpc_port"].get<int>();
        return daemon;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("eldr-router wrote no port file within ", timeout_s, " s: ", daemon->Log()));
}

RouterDaemon::~RouterDaemon() {
  if (pid_ <= 0) return;
  kill(pid_, SIGTERM);
  if (WaitFor(pid_, 10) == -1) {
    kill(pid_, SIGKILL);
    WaitFor(pid_, 5);
  }
}

std::string RouterDaemon::Log() const { return ReadWholeFile(log_path_); }

}  // namespace eldr::sim::testing
