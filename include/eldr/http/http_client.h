// An asynchronous HTTP/1.1 client (Boost.Beast on Boost.Asio) for ELDR's proxy, engine emulator
// and load generator: many concurrent calls on a few io threads, response bodies delivered piece by
// piece as they arrive (server-sent events, proxied streams), keep-alive connection reuse per
// origin, and deadlines per phase of a call.
//
// A call (HttpClient::Start) goes through: connect (or reuse an idle pooled connection), write the
// request, read the response head, read the body. Callbacks report the head once, each body piece
// as it arrives (de-chunked), and the end once. The end is exactly one of:
//   OK                 the whole body arrived (the connection returns to the pool when reusable)
//   UNAVAILABLE        could not resolve or connect, or the connection failed before the response
//                      head arrived (nothing of the response was seen: the caller may retry
//                      elsewhere; `ClientResult::head_received` is false)
//   DEADLINE_EXCEEDED  a deadline of ClientRequest passed (which one: in the message)
//   CANCELLED          ClientCall::Cancel was called
//   INTERNAL           the response is malformed or exceeds a limit (the message says which), or
//                      the connection failed in the middle of the body
// Redirects are not followed; 1xx interim responses other than 101 are skipped. A pooled
// connection that turns out closed by the server before any response byte is retried once on a
// new connection, transparently (the request was never processed).
//
// Thread-safety: HttpClient and ClientCall methods may be called from any thread. The callbacks of
// one call run one at a time, in order (head, pieces, end), on an io thread of the client; they
// must not block, and may call Start or Cancel (also on their own call). After the end callback
// no callback of that call runs again. Destroying the client cancels every call still running and
// waits for the io threads; it must not run on one of them.
#ifndef ELDR_HTTP_HTTP_CLIENT_H_
#define ELDR_HTTP_HTTP_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace eldr::http {

struct HttpClientOptions {
  // io threads, [1, 256]. Callbacks run on them.
  int threads = 1;
  // Idle keep-alive connections kept per origin (host:port), [0, 100000]; 0 disables reuse.
  int max_idle_per_origin = 256;
  // An idle pooled connection is closed after this. > 0.
  absl::Duration idle_connection_timeout = absl::Seconds(30);
  // Response head (status line + fields) at most, bytes, [64, 1 MiB]. Beyond: INTERNAL.
  size_t max_response_header_bytes = 64 * 1024;
  // Response body at most, bytes (de-chunked), for every call; [0, 64 GiB]. Beyond: INTERNAL.
  uint64_t max_response_body_bytes = uint64_t{1} << 30;
};

// OK, or INVALID_ARGUMENT naming the first offending field ("HttpClientOptions.threads ...").
absl::Status ValidateHttpClientOptions(const HttpClientOptions& options);

struct ClientRequest {
  std::string method = "GET";
  // The origin: a host name or an IPv4/IPv6 address (IPv6 without brackets), and a port 1..65535.
  std::string host;
  int port = 0;
  // Origin-form target, e.g. "/v1/completions?x=1".
  std::string target = "/";
  // Extra fields, sent as given (names must be tokens, values without CR/LF/NUL: else the call
  // ends INVALID_ARGUMENT at once). Host, Content-Length and Connection are the client's own and
  // dropped here.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;  // sent with Content-Length (also 0 for POST/PUT/PATCH)

  // Deadlines, each measured from the start of its phase; InfiniteDuration disables one.
  absl::Duration connect_timeout = absl::Seconds(5);  // resolve + TCP connect
  // From the request's last byte written to the response head's last byte.
  absl::Duration first_byte_timeout = absl::InfiniteDuration();
  // Longest silence between two body pieces (and between the head and the first piece).
  absl::Duration idle_timeout = absl::InfiniteDuration();
  // The whole call, from Start to the end.
  absl::Duration total_timeout = absl::InfiniteDuration();
};

struct ClientResponseHead {
  int status = 0;                                            // 100..999 as sent
  int version = 11;                                          // 10 or 11
  std::vector<std::pair<std::string, std::string>> headers;  // in order, values trimmed
  // The value of the first field named `name` (ASCII case-insensitive), or nullopt.
  std::optional<absl::string_view> Header(absl::string_view name) const;
};

struct ClientResult {
  absl::Status status;             // see the top of this file
  bool head_received = false;      // the response head arrived (the server saw the request)
  uint64_t body_bytes = 0;         // de-chunked body bytes delivered to on_body
  bool connection_reused = false;  // the call ran on a pooled keep-alive connection
};

struct ClientCallbacks {
  // The response head, once (not for a call that ends before it arrives).
  std::function<void(const ClientResponseHead& head)> on_head;
  // Each piece of the body as it arrives (never empty).
  std::function<void(absl::string_view piece)> on_body;
  // The end, exactly once.
  std::function<void(const ClientResult& result)> on_done;
};

// A call in progress.
class ClientCall {
 public:
  virtual ~ClientCall() = default;
  // Ends the call with CANCELLED unless it already ended (the connection is closed, never reused;
  // the server sees the client go away). Idempotent; from any thread, also from a callback.
  virtual void Cancel() = 0;
};

class HttpClient {
 public:
  // INVALID_ARGUMENT (see ValidateHttpClientOptions) for bad options. Starts the io threads.
  static absl::StatusOr<std::unique_ptr<HttpClient>> Create(HttpClientOptions options);

  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;
  virtual ~HttpClient() = default;

  // Starts a call; the callbacks report its progress. Never blocks and never fails synchronously:
  // invalid requests end through on_done (INVALID_ARGUMENT).
  virtual std::shared_ptr<ClientCall> Start(ClientRequest request, ClientCallbacks callbacks) = 0;

  // Calls in progress now.
  virtual int64_t active_calls() const = 0;
  // Pooled idle connections now.
  virtual int64_t idle_connections() const = 0;

 protected:
  HttpClient() = default;
};

// A whole response, for Fetch.
struct FetchedResponse {
  ClientResponseHead head;
  std::string body;
};

// Starts `request` on `client` and collects the body (at most `max_body_bytes`: beyond, the call
// is cancelled and `done` gets INTERNAL). `done` runs once on an io thread. For small calls (KV
// pulls, /v1/models, health checks).
std::shared_ptr<ClientCall> Fetch(HttpClient& client, ClientRequest request, size_t max_body_bytes,
                                  std::function<void(absl::StatusOr<FetchedResponse>)> done);

// Blocking convenience for tests and tools (never on an io thread of `client`): Fetch and wait.
absl::StatusOr<FetchedResponse> FetchAndWait(HttpClient& client, ClientRequest request,
                                             size_t max_body_bytes = 64 << 20);

}  // namespace eldr::http

#endif  // ELDR_HTTP_HTTP_CLIENT_H_
