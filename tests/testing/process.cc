#include "testing/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"

namespace eldr::testing {
namespace {

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

}  // namespace

std::string BinaryPath(const std::string& name) {
  const char* dir = std::getenv("ELDR_BIN_DIR");
  return absl::StrCat(dir != nullptr ? dir : ".", "/", name);
}

std::string BundledTraceDir() {
  const char* dir = std::getenv("ELDR_DATA_DIR");
  return absl::StrCat(dir != nullptr ? dir : "data", "/esft-routing");
}

TempDir::TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "eldr-test-XXXXXX").string();
  char* made = mkdtemp(pattern.data());
  path_ = made != nullptr ? made : "";
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                                                  const std::string& log_path,
                                                                  const std::string& stdout_path) {
  if (argv.empty()) return absl::InvalidArgumentError("Spawn: empty argv");
  if (access(argv[0].c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("not an executable: ", argv[0], " (is ELDR_BIN_DIR set and the target built?)"));
  }
  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) return absl::InternalError(absl::StrCat("cannot create ", log_path, ": ", std::strerror(errno)));
  const int out_fd =
      stdout_path.empty() ? log_fd : open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out_fd < 0) {
    close(log_fd);
    return absl::InternalError(absl::StrCat("cannot create ", stdout_path, ": ", std::strerror(errno)));
  }
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    close(log_fd);
    if (out_fd != log_fd) close(out_fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // The child: dies with its parent (a killed soak run leaves nothing behind), the log as
    // stderr, default signal mask.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(out_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(log_fd);
  if (out_fd != log_fd) close(out_fd);
  return std::unique_ptr<ChildProcess>(new ChildProcess(pid, log_path));
}

ChildProcess::~ChildProcess() {
  if (Running()) {
    kill(pid_, SIGKILL);
    (void)Wait(absl::Seconds(10));
  }
}

std::string ChildProcess::Log(size_t max_bytes) const {
  std::string log = ReadWholeFile(log_path_);
  if (log.size() > max_bytes) log = "..." + log.substr(log.size() - max_bytes);
  return log;
}

bool ChildProcess::Running() {
  if (exit_code_.has_value()) return false;
  int status = 0;
  const pid_t done = waitpid(pid_, &status, WNOHANG);
  if (done == 0) return true;
  if (done == pid_) {
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  } else {
    exit_code_ = -1;  // not our child any more: nothing to wait for
  }
  return false;
}

absl::StatusOr<int> ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (Running()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("pid ", pid_, " still runs after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return *exit_code_;
}

void ChildProcess::Signal(int signal) const {
  if (!exit_code_.has_value()) kill(pid_, signal);
}

std::optional<int64_t> ChildProcess::RssKib() const {
  if (exit_code_.has_value()) return std::nullopt;
  const std::string status = ReadWholeFile(absl::StrCat("/proc/", pid_, "/status"));
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, "VmRSS:")) continue;
    line = absl::StripAsciiWhitespace(line);
    absl::ConsumeSuffix(&line, "kB");
    int64_t kib = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib)) return kib;
  }
  return std::nullopt;
}

absl::StatusOr<int> WaitForPort(const std::string& port_file, const std::string& key, ChildProcess& process,
                                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (!process.Running()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the daemon exited before listening; its log:\n", process.Log()));
    }
    const std::string text = ReadWholeFile(port_file);
    if (!text.empty()) {
      const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (json.is_object() && json.contains(key) && json[key].is_number_integer()) {
        const nlohmann::json pid = json.value("pid", nlohmann::json());
        if (pid != static_cast<int64_t>(process.pid())) {
          return absl::InternalError(
              absl::StrCat("port file ", port_file, " names pid ", pid.dump(), ", not the daemon's ", process.pid()));
        }
        return json[key].get<int>();
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("no \"", key, "\" in port file ", port_file, " after ",
                                                  absl::FormatDuration(timeout), "; daemon log:\n", process.Log()));
}

absl::StatusOr<DaemonPorts> WaitForPortFile(const std::string& port_file, ChildProcess& process,
                                            absl::Duration timeout) {
  absl::StatusOr<int> grpc = WaitForPort(port_file, "grpc_port", process, timeout);
  if (!grpc.ok()) return grpc.status();
  const nlohmann::json json = nlohmann::json::parse(ReadWholeFile(port_file), nullptr, /*allow_exceptions=*/false);
  DaemonPorts ports;
  ports.grpc = *grpc;
  ports.admin = json.value("admin_port", ports.grpc);
  ports.metrics = json.value("metrics_port", 0);
  return ports;
}

absl::StatusOr<std::string> HttpExchange(int port, const std::string& request, absl::Duration timeout) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect 127.0.0.1:", port, ": ", std::strerror(error)));
  }
  if (!request.empty() &&
      send(fd, request.data(), request.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string response;
  char buffer[8192];
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd entry{fd, POLLIN, 0};
    if (left_ms <= 0 || poll(&entry, 1, static_cast<int>(left_ms)) <= 0) {
      close(fd);
      if (!response.empty()) return response;
      return absl::DeadlineExceededError(
          absl::StrCat("no answer on port ", port, " within ", absl::FormatDuration(timeout)));
    }
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    response.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return response;
}

absl::StatusOr<ReservedLoopbackPort> ReservedLoopbackPort::Create() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  // Bound, never listen()ed: the port is held and refuses every connection.
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const int error = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("bind 127.0.0.1:0: ", std::strerror(error)));
  }
  return ReservedLoopbackPort(fd, ntohs(address.sin_port));
}

ReservedLoopbackPort::ReservedLoopbackPort(ReservedLoopbackPort&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), port_(std::exchange(other.port_, 0)) {}

ReservedLoopbackPort& ReservedLoopbackPort::operator=(ReservedLoopbackPort&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    port_ = std::exchange(other.port_, 0);
  }
  return *this;
}

ReservedLoopbackPort::~ReservedLoopbackPort() {
  if (fd_ >= 0) close(fd_);
}

std::string ReservedLoopbackPort::address() const { return absl::StrCat("127.0.0.1:", port_); }

int UnusedLoopbackPort() {
  absl::StatusOr<ReservedLoopbackPort> reserved = ReservedLoopbackPort::Create();
  return reserved.ok() ? reserved->port() : 0;  // free again once `reserved` closes
}

int HttpStatusOf(const std::string& response) {
  if (response.size() < 12 || response.compare(0, 5, "HTTP/") != 0) return -1;
  int status = -1;
  if (!absl::SimpleAtoi(response.substr(9, 3), &status)) return -1;
  return status;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path, absl::Duration timeout) {
  absl::StatusOr<std::string> response =
      HttpExchange(port, absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"), timeout);
  if (!response.ok()) return response.status();
  const size_t header_end = response->find("\r\n\r\n");
  if (header_end == std::string::npos) return absl::DataLossError("no HTTP header in the answer");
  if (HttpStatusOf(*response) != 200) {
    return absl::UnavailableError(absl::StrCat("HTTP answer: ", response->substr(0, response->find('\r'))));
  }
  return response->substr(header_end + 4);
}

bool HasFlag(const std::vector<std::string>& args, const std::string& name) {
  for (const std::string& a : args) {
    if (a == "--" + name || absl::StartsWith(a, "--" + name + "=")) return true;
  }
  return false;
}

ProcessResult RunProcess(const std::string& binary, const std::vector<std::string>& args, absl::Duration timeout) {
  ProcessResult result;
  TempDir dir;
  std::vector<std::string> argv = {binary};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<std::unique_ptr<ChildProcess>> child =
      ChildProcess::Spawn(argv, dir.File("stderr"), dir.File("stdout"));
  if (!child.ok()) {
    result.stderr_text = std::string(child.status().message());
    return result;
  }
  absl::StatusOr<int> code = (*child)->Wait(timeout);
  if (!code.ok()) {
    result.timed_out = true;
    (*child)->Signal(SIGKILL);
    code = (*child)->Wait(absl::Seconds(10));
  }
  result.exit_code = code.value_or(-1);
  result.stdout_text = ReadWholeFile(dir.File("stdout"));
  result.stderr_text = ReadWholeFile(dir.File("stderr"));
  return result;
}

absl::StatusOr<RouterChild> StartRouter(const TempDir& dir, std::vector<std::string> args, absl::Duration timeout) {
  static std::atomic<int> counter{0};
  const int id = ++counter;
  const std::string port_file = dir.File(absl::StrCat("ports-", id, ".json"));
  for (const char* flag : {"listen", "admin_listen", "metrics_listen"}) {
    if (!HasFlag(args, flag)) args.push_back(absl::StrCat("--", flag, "=127.0.0.1:0"));
  }
  args.push_back("--port_file=" + port_file);
  args.insert(args.begin(), BinaryPath("eldr-router"));
  RouterChild router;
  absl::StatusOr<std::unique_ptr<ChildProcess>> child =
      ChildProcess::Spawn(args, dir.File(absl::StrCat("router-", id, ".log")));
  if (!child.ok()) return child.status();
  router.process = *std::move(child);
  absl::StatusOr<DaemonPorts> ports = WaitForPortFile(port_file, *router.process, timeout);
  if (!ports.ok()) return ports.status();
  router.ports = *ports;
  return router;
}

std::optional<double> SampleValue(const std::string& page, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(page, '\n')) {
    if (!absl::ConsumePrefix(&line, series) || line.empty() || line[0] != ' ') continue;
    double value = 0;
    const absl::string_view token =
        absl::StripAsciiWhitespace(line).substr(0, absl::StripAsciiWhitespace(line).find(' '));
    if (absl::SimpleAtod(token, &value)) return value;
  }
  return std::nullopt;
}

}  // namespace eldr::testing
