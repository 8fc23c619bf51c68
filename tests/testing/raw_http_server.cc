#include "testing/raw_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace eldr::testing {

bool WaitReadable(int fd, absl::Duration timeout) {
  pollfd entry{fd, POLLIN, 0};
  const int ready = ::poll(&entry, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  return ready > 0;
}

bool WaitForPeerClose(int fd, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  char buffer[4096];
  while (absl::Now() < deadline) {
    if (!WaitReadable(fd, absl::Milliseconds(50))) continue;
    const ssize_t got = ::recv(fd, buffer, sizeof(buffer), 0);
    if (got <= 0) return true;
  }
  return false;
}

std::optional<std::string> RawRequestReader::Next(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const size_t end = buffer_.find("\r\n\r\n");
    if (end != std::string::npos) {
      size_t length = 0;
      const std::string head = absl::AsciiStrToLower(buffer_.substr(0, end));
      const size_t field = head.find("\r\ncontent-length:");
      if (field != std::string::npos) {
        const size_t line_end = head.find("\r\n", field + 2);
        (void)absl::SimpleAtoi(
            absl::StripAsciiWhitespace(
                head.substr(field + 17, line_end == std::string::npos ? std::string::npos : line_end - field - 17)),
            &length);
      }
      if (buffer_.size() >= end + 4 + length) {
        std::string request = buffer_.substr(0, end + 4 + length);
        buffer_.erase(0, end + 4 + length);
        return request;
      }
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration() || !WaitReadable(fd_, left)) return std::nullopt;
    char chunk[16384];
    const ssize_t got = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (got <= 0) return std::nullopt;
    buffer_.append(chunk, static_cast<size_t>(got));
  }
}

RawHttpServer::RawHttpServer(Handler handler, int backlog, bool accept_connections) : handler_(std::move(handler)) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(listen_fd_, backlog) != 0) {
    error_ = absl::StrCat("raw server: bind/listen failed: ", std::strerror(errno));
    return;
  }
  socklen_t length = sizeof(address);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&address), &length);
  port_ = ntohs(address.sin_port);
  if (accept_connections) accept_thread_ = std::thread([this] { AcceptLoop(); });
}

RawHttpServer::~RawHttpServer() {
  stop_.store(true);
  if (accept_thread_.joinable()) accept_thread_.join();
  {
    absl::MutexLock lock(&mu_);
    for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  for (std::thread& thread : threads_) thread.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void RawHttpServer::AcceptLoop() {
  while (!stop_.load()) {
    if (!WaitReadable(listen_fd_, absl::Milliseconds(20))) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    const int index = accepted_.fetch_add(1);
    absl::MutexLock lock(&mu_);
    open_fds_.push_back(fd);
    threads_.emplace_back([this, fd, index] {
      handler_(fd, index);
      {
        absl::MutexLock lock(&mu_);
        open_fds_.erase(std::find(open_fds_.begin(), open_fds_.end(), fd));
      }
      ::close(fd);
    });
  }
}

}  // namespace eldr::testing
