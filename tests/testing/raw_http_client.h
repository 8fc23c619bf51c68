// A blocking HTTP/1.x client on a raw loopback TCP socket, for tests that must see (or send) the
// exact wire bytes: malformed, pipelined, slow and non-reading clients, chunk framing, when the
// head and each piece arrive, when the server closes. Every read has a deadline (poll). No
// GoogleTest dependency, like the rest of eldr_testing.
#ifndef ELDR_TESTS_TESTING_RAW_HTTP_CLIENT_H_
#define ELDR_TESTS_TESTING_RAW_HTTP_CLIENT_H_

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace eldr::testing {

// Sends all of `bytes` on socket `fd` (MSG_NOSIGNAL, retrying on EINTR); false when the peer is gone.
bool SendAll(int fd, absl::string_view bytes);

// A response head read off the wire.
struct RawHttpHead {
  std::string version;  // "HTTP/1.1"
  int status = 0;
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased, values trimmed

  // The first value of header `name` (lower case), or nullopt.
  std::optional<std::string> Header(absl::string_view name) const;
};

// A whole Content-Length framed response.
struct RawHttpResponse : RawHttpHead {
  std::string body;
};

class RawHttpClient {
 public:
  static constexpr absl::Duration kDefaultTimeout = absl::Seconds(5);

  // Connects to 127.0.0.1:port (TCP_NODELAY); `receive_buffer` > 0 shrinks SO_RCVBUF first.
  explicit RawHttpClient(int port, int receive_buffer = 0);
  ~RawHttpClient() { CloseNow(); }
  RawHttpClient(const RawHttpClient&) = delete;
  RawHttpClient& operator=(const RawHttpClient&) = delete;

  bool connected() const { return connected_; }

  bool Send(absl::string_view bytes) { return fd_ >= 0 && SendAll(fd_, bytes); }

  // Closes the socket; `reset` makes the kernel send RST instead of FIN.
  void CloseNow(bool reset = false);

  // The response head, or nullopt when the connection closes, the head is malformed, or `timeout`
  // passes first.
  std::optional<RawHttpHead> ReadHead(absl::Duration timeout = kDefaultTimeout);

  // One whole response: the head, then a Content-Length body (none for HEAD, 1xx, 204, 304), all
  // within `timeout`. Nullopt on close, timeout, a malformed head, or a body without a valid
  // Content-Length.
  std::optional<RawHttpResponse> ReadResponse(bool head_request = false, absl::Duration timeout = kDefaultTimeout);

  // One chunk of a chunked body: its payload ("" for the last chunk, whose empty trailer is
  // consumed too), or nullopt on close, timeout or bad framing.
  std::optional<std::string> ReadChunk(absl::Duration timeout = kDefaultTimeout);

  // `size` bytes (an unframed body), or nullopt.
  std::optional<std::string> ReadBytes(size_t size, absl::Duration timeout = kDefaultTimeout);

  // True when the server closes the connection (EOF or reset) within `timeout`; what arrives
  // meanwhile is kept in leftover().
  bool WaitClosed(absl::Duration timeout = kDefaultTimeout);

  // Whether nothing arrives (and the connection stays open) for `quiet`.
  bool StaysQuiet(absl::Duration quiet);

  // What arrived and was not consumed by a read yet.
  const std::string& leftover() const { return pending_; }

 private:
  // Reads what is available before `deadline` into pending_; false on timeout or close.
  bool Fill(absl::Time deadline);

  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
  std::string pending_;
};

}  // namespace eldr::testing

#endif  // ELDR_TESTS_TESTING_RAW_HTTP_CLIENT_H_
