#include "testing/raw_http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace eldr::testing {

bool SendAll(int fd, absl::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t sent = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(sent));
  }
  return true;
}

std::optional<std::string> RawHttpHead::Header(absl::string_view name) const {
  for (const auto& [header, value] : headers) {
    if (header == name) return value;
  }
  return std::nullopt;
}

RawHttpClient::RawHttpClient(int port, int receive_buffer) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (receive_buffer > 0) ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void RawHttpClient::CloseNow(bool reset) {
  if (fd_ < 0) return;
  if (reset) {
    const linger hard{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
  }
  ::close(fd_);
  fd_ = -1;
}

std::optional<RawHttpHead> RawHttpClient::ReadHead(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  size_t end = std::string::npos;
  while ((end = pending_.find("\r\n\r\n")) == std::string::npos) {
    if (!Fill(deadline)) return std::nullopt;
  }
  RawHttpHead head;
  const std::vector<absl::string_view> lines = absl::StrSplit(absl::string_view(pending_).substr(0, end), "\r\n");
  const std::vector<absl::string_view> status_line = absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
  if (status_line.size() < 2 || !absl::SimpleAtoi(status_line[1], &head.status)) return std::nullopt;
  head.version = std::string(status_line[0]);
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == absl::string_view::npos) return std::nullopt;
    head.headers.emplace_back(absl::AsciiStrToLower(lines[i].substr(0, colon)),
                              std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1))));
  }
  pending_.erase(0, end + 4);
  return head;
}

std::optional<RawHttpResponse> RawHttpClient::ReadResponse(bool head_request, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::optional<RawHttpHead> head = ReadHead(timeout);
  if (!head.has_value()) return std::nullopt;
  RawHttpResponse response{*std::move(head)};
  if (head_request || response.status < 200 || response.status == 204 || response.status == 304) return response;
  size_t length = 0;
  const std::optional<std::string> content_length = response.Header("content-length");
  if (!content_length.has_value() || !absl::SimpleAtoi(*content_length, &length)) return std::nullopt;
  std::optional<std::string> body = ReadBytes(length, deadline - absl::Now());
  if (!body.has_value()) return std::nullopt;
  response.body = *std::move(body);
  return response;
}

std::optional<std::string> RawHttpClient::ReadChunk(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  size_t line_end = std::string::npos;
  while ((line_end = pending_.find("\r\n")) == std::string::npos) {
    if (!Fill(deadline)) return std::nullopt;
  }
  size_t size = 0;
  if (!absl::SimpleHexAtoi(absl::string_view(pending_).substr(0, line_end), &size)) return std::nullopt;
  const size_t needed = line_end + 2 + size + 2;
  while (pending_.size() < needed) {
    if (!Fill(deadline)) return std::nullopt;
  }
  if (pending_.compare(needed - 2, 2, "\r\n") != 0) return std::nullopt;
  std::string payload = pending_.substr(line_end + 2, size);
  pending_.erase(0, needed);
  return payload;
}

std::optional<std::string> RawHttpClient::ReadBytes(size_t size, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (pending_.size() < size) {
    if (!Fill(deadline)) return std::nullopt;
  }
  std::string bytes = pending_.substr(0, size);
  pending_.erase(0, size);
  return bytes;
}

bool RawHttpClient::WaitClosed(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!closed_) {
    if (!Fill(deadline) && !closed_) return false;
  }
  return true;
}

bool RawHttpClient::StaysQuiet(absl::Duration quiet) {
  const size_t before = pending_.size();
  Fill(absl::Now() + quiet);
  return pending_.size() == before && !closed_;
}

bool RawHttpClient::Fill(absl::Time deadline) {
  if (closed_ || fd_ < 0) return false;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return false;
  pollfd descriptor{fd_, POLLIN, 0};
  const int ready = ::poll(&descriptor, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
  if (ready <= 0) return false;
  char chunk[16384];
  const ssize_t got = ::recv(fd_, chunk, sizeof(chunk), 0);
  if (got <= 0) {
    closed_ = true;
    return false;
  }
  pending_.append(chunk, static_cast<size_t>(got));
  return true;
}

}  // namespace eldr::testing
