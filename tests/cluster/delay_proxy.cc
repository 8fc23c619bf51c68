#include "cluster/delay_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace eldr::cluster::testing {

namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

bool WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DelayProxy>> DelayProxy::Start(int upstream_port, absl::Duration reply_delay) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in address = Loopback(0);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || ::listen(fd, 64) != 0) {
    const std::string error = std::strerror(errno);
    ::close(fd);
    return absl::InternalError(absl::StrCat("bind/listen: ", error));
  }
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return std::unique_ptr<DelayProxy>(new DelayProxy(fd, ntohs(address.sin_port), upstream_port, reply_delay));
}

DelayProxy::DelayProxy(int listen_fd, int port, int upstream_port, absl::Duration reply_delay)
    : listen_fd_(listen_fd),
      port_(port),
      upstream_port_(upstream_port),
      reply_delay_us_(absl::ToInt64Microseconds(reply_delay)) {
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

DelayProxy::~DelayProxy() {
  stopping_.store(true);
  ::shutdown(listen_fd_, SHUT_RDWR);
  acceptor_.join();
  ::close(listen_fd_);
  std::vector<std::thread> pumps;
  {
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    pumps.swap(pumps_);
  }
  for (std::thread& pump : pumps) pump.join();
  absl::MutexLock lock(&mu_);
  for (int fd : fds_) ::close(fd);
}

void DelayProxy::Track(int fd) {
  absl::MutexLock lock(&mu_);
  fds_.push_back(fd);
}

void DelayProxy::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd waiting{listen_fd_, POLLIN, 0};
    if (::poll(&waiting, 1, 50) <= 0) continue;
    const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    const int upstream = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address = Loopback(upstream_port_);
    if (upstream < 0 || ::connect(upstream, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      if (upstream >= 0) ::close(upstream);
      ::close(client);
      continue;
    }
    const int one = 1;
    ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::setsockopt(upstream, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    connections_.fetch_add(1);
    Track(client);
    Track(upstream);
    absl::MutexLock lock(&mu_);
    if (stopping_.load()) {
      ::shutdown(client, SHUT_RDWR);
      ::shutdown(upstream, SHUT_RDWR);
    }
    pumps_.emplace_back([this, client, upstream] { Pump(client, upstream, /*delayed=*/false); });
    pumps_.emplace_back([this, client, upstream] { Pump(upstream, client, /*delayed=*/true); });
  }
}

void DelayProxy::Pump(int from, int to, bool delayed) {
  char buffer[16384];
  while (!stopping_.load()) {
    const ssize_t n = ::recv(from, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (delayed) {
      const absl::Time due = absl::Now() + absl::Microseconds(reply_delay_us_.load(std::memory_order_relaxed));
      while (!stopping_.load() && absl::Now() < due)
        absl::SleepFor(std::min(due - absl::Now(), absl::Milliseconds(20)));
    }
    if (!WriteAll(to, buffer, static_cast<size_t>(n))) break;
  }
  // One side is gone: end both directions, so the other pump wakes and leaves too.
  ::shutdown(from, SHUT_RDWR);
  ::shutdown(to, SHUT_RDWR);
}

}  // namespace eldr::cluster::testing
