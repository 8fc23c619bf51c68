// A small, fully asynchronous HTTP/1.1 server (Boost.Beast on Boost.Asio) for ELDR's operational
// endpoints (/metrics, /healthz, /readyz), and the basis of its HTTP proxy.
//
// Connections: every connection is served by non-blocking reads and writes on a pool of io threads
// (HttpServerOptions::threads), so thousands of idle or slow connections never delay a request on
// another one. Each connection has its own deadlines (see HttpServerOptions): an idle keep-alive
// connection is closed after `idle_timeout`; once the first byte of a request arrived, the whole
// request (head and body) must arrive within `request_timeout` (slowloris defence); a response must
// be written within `write_timeout`. Beyond `max_connections` open connections, a new connection
// gets a short 503 and is closed.
//
// Protocol: HTTP/1.0 and HTTP/1.1, keep-alive (HTTP/1.1 by default, HTTP/1.0 with
// `Connection: keep-alive`), `Connection: close`, pipelined requests (answered one at a time, in
// order), chunked request bodies, `Expect: 100-continue`. Every response carries `Server: eldr`,
// `Date` and, except 204 and 304, `Content-Length` (RFC 9110 forbids it in a 204); a streamed
// response (see ResponseStream) is chunked instead (HTTP/1.0: ends with the connection). Requests are
// checked strictly, the rules shared with ParseHttpRequest:
//   400  unparsable bytes (bad method token, line endings, header syntax, chunk framing),
//        a target that is not origin-form ("/path?query"; "*" only with OPTIONS; no absolute URLs,
//        no authority-form, no '#', no control or non-ASCII bytes), HTTP/1.1 without exactly one
//        Host, more than one Host, a conflicting or invalid Content-Length, Content-Length with
//        Transfer-Encoding, a Transfer-Encoding whose final coding is not chunked
//   414  a request line longer than max_header_bytes
//   431  request line + header fields longer than max_header_bytes
//   413  a body (declared or received) longer than max_body_bytes
//   501  a transfer coding other than plain `chunked`
//   505  an HTTP version other than 1.0 and 1.1
// After any of these the connection is closed. Error bodies are short fixed texts that never echo
// request bytes. Routing (404, 405, HEAD, OPTIONS) is HttpRouter's; see there.
//
// Robustness: no exception escapes a handler, a completion handler or an io thread; a request
// handler that throws is answered 500. Closing connections is "lingering" (the server shuts down
// its sending side, then discards what the client still sends for up to 500 ms / 256 KiB) so a
// client that sent more than was read still receives the error response instead of a reset.
//
// Thread-safety: HttpRouter is not synchronised (build it, then hand it to HttpServer::Create);
// the server's own methods may be called from any thread. Request handlers run on the io threads,
// concurrently with each other when threads > 1 (never two at once for one connection), so they
// must be thread-safe then; a handler blocks its io thread while it runs, so handlers should be
// quick (serialising a metrics registry is fine).
#ifndef ELDR_HTTP_HTTP_SERVER_H_
#define ELDR_HTTP_HTTP_SERVER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
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

struct HttpServerOptions {
  // "host:port" to listen on: an IPv4 address ("127.0.0.1:9090", "0.0.0.0:9090"), a bracketed
  // IPv6 address ("[::1]:9090", "[::]:9090"), or a host name ("localhost:9090", resolved at Start;
  // the first resolved address that can be bound is used). An empty host (":9090") means every
  // IPv4 interface. Port 0 picks any free port (see HttpServer::port()).
  std::string listen = "127.0.0.1:0";
  // io threads, [1, 256]. Handlers run on them.
  int threads = 1;
  // Open connections at most, [1, 1000000]. A connection accepted beyond it gets a short 503 and
  // is closed (best effort: at most 64 such refusals are written at a time, others are just closed).
  int max_connections = 256;
  // Request line + header fields at most, in bytes, [64, 61440] (Beast cannot store a field of
  // 64 KiB). Beyond: 414 (request line) or 431, and the connection closes.
  size_t max_header_bytes = 8 * 1024;
  // Request body at most, in bytes (de-chunked), [0, 1 GiB]. Beyond: 413, and the connection closes.
  size_t max_body_bytes = 64 * 1024;
  // Once a request's first byte arrived, its head and body must have arrived within this; else
  // the connection is closed without a response (slowloris defence). > 0, at most a year.
  absl::Duration request_timeout = absl::Seconds(10);
  // A keep-alive connection on which no request starts within this is closed. > 0, at most a year.
  absl::Duration idle_timeout = absl::Seconds(60);
  // A response (or an error response) must be written within this, else the connection is
  // closed. > 0, at most a year.
  absl::Duration write_timeout = absl::Seconds(30);
  // Requests served on one connection at most, >= 1; the last one is answered with
  // `Connection: close`.
  int max_requests_per_connection = 10000;
};

// OK, or INVALID_ARGUMENT naming the first offending field (e.g. "HttpServerOptions.threads ...").
absl::Status ValidateHttpServerOptions(const HttpServerOptions& options);

struct HttpRequest {
  std::string method;  // as sent; methods are case-sensitive ("GET", "PATCH", any token)
  std::string target;  // as sent: origin-form "/path?query", or "*" (OPTIONS only)
  std::string path;    // `target` up to its first '?', as sent (not percent-decoded); "*" for "*"
  std::string query;   // what follows the first '?' of `target`, without it; empty when none
  int version = 11;    // 10 (HTTP/1.0) or 11 (HTTP/1.1)
  // The head's fields (never a chunked body's trailer fields) in arrival order, except that a
  // repeated name is grouped at its first occurrence; names as sent, values without surrounding
  // whitespace.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;  // de-chunked; the trailer fields of a chunked body are dropped
  std::string peer;  // the client's "address:port" ("[v6]:port" for IPv6); empty from ParseHttpRequest

  // The value of the first header named `name` (ASCII case-insensitive), or nullopt. The view
  // points into `headers`.
  std::optional<absl::string_view> Header(absl::string_view name) const;
};

struct HttpResponse {
  // 200..599; anything else is answered 500 by HttpRouter::Dispatch.
  int status = 200;
  // Sent as Content-Type unless empty (and not for 204/304).
  std::string content_type = "text/plain; charset=utf-8";
  // Not sent for 204 and 304, nor to HEAD.
  std::string body;
  // Extra header fields, in order. Dropped: names that are not HTTP tokens, values holding CR, LF
  // or NUL, and the fields the server owns (Connection, Content-Length, Content-Type, Date,
  // Keep-Alive, Server, Transfer-Encoding, Upgrade).
  std::vector<std::pair<std::string, std::string>> headers;
  // For a response to HEAD: the Content-Length to announce (the size of the body a GET would
  // get). Unset: the size of `body`. Ignored for other methods.
  std::optional<uint64_t> head_content_length;
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

// ---- Streamed responses ---------------------------------------------------------------------------
// A response that a streaming handler (HttpRouter::HandleStreaming) writes later and piece by
// piece, from any thread: server-sent events, a proxied body, a response that waits for an
// upstream call. The handler returns at once; the connection stays with the response until it is
// finished, aborted, or the client goes away.
//
// Either Respond() once (a whole response, exactly as a non-streamed handler's), or Begin() once,
// then any number of Write(), then Finish(). Begin sends the head at once (HTTP/1.1: with
// `Transfer-Encoding: chunked`, each Write one chunk, Finish the last chunk, and the connection is
// kept alive for the next request; HTTP/1.0: without a length, and Finish closes the connection).
// Calls out of that order, and every call after Finish, Abort or the client's going away, are
// ignored (never a crash). A response to HEAD, and a 204 or 304, sends the head only and discards
// the writes (their `written` callbacks report true). When the last reference to a stream goes
// away before it ended, the server ends it: 500 before Begin, Abort after it.
//
// While a streamed response is open the server keeps reading the connection, so a client that
// closes it (even half-closes it) or resets it is noticed at once: the OnClosed callback runs,
// later calls are ignored, and the response's queued bytes are dropped. Bytes of a pipelined next
// request that arrive meanwhile are kept (up to max_header_bytes + max(max_body_bytes, 64 KiB);
// beyond that the server stops reading until the response ends, and then notices a client that
// goes away only by a failed write) and served after Finish.
//
// Every write must be written to the socket within HttpServerOptions::write_timeout, else the
// connection is closed (OnClosed runs). A response that is never finished holds its connection
// until the client goes away or the server stops: the handler owns its own deadlines.
//
// Thread-safety: every method may be called from any thread, concurrently; the calls of one
// response take effect in the order they were made. Callbacks run on an io thread of the server
// (the responses that HttpServer::Stop ends run theirs on Stop's thread, before Stop returns),
// never inside a call of this interface, and must not block. Calls made once Stop has joined the
// io threads (and after the server is destroyed) are ignored and their callbacks never run: there
// is no io thread left to run them. A stream may outlive its server.
class ResponseStream {
 public:
  virtual ~ResponseStream() = default;

  // Sends a whole response (as HttpRouter::Dispatch would for a non-streamed handler's answer,
  // HEAD handling included) and ends this response.
  virtual void Respond(HttpResponse response) = 0;
  // Sends the status line and the head: `status` 200..599 (else 500 is sent), `content_type`
  // unless empty, `headers` filtered as HttpResponse::headers are.
  virtual void Begin(int status, std::string content_type,
                     std::vector<std::pair<std::string, std::string>> headers = {}) = 0;
  // Queues `bytes` as the next piece of the body (an empty piece is a no-op). `written`, when set,
  // runs once the piece was handed to the socket (true), or when it never will be (false: the
  // client went away, the response was aborted, the server stopped). Never blocks.
  virtual void Write(std::string bytes, std::function<void(bool written)> written = nullptr) = 0;
  // Ends the body; the connection goes on with the next request (HTTP/1.1 keep-alive).
  virtual void Finish() = 0;
  // Ends the response abruptly: the connection is closed at once, without the last chunk (a client
  // sees a truncated body). For upstream failures after the head was sent.
  virtual void Abort() = 0;
  // Runs `callback` once, when the response ends for any other reason than Finish or Respond: the
  // client closed or reset the connection, a write timed out, Abort was called, the server stopped.
  // Set it before Begin/Respond; a second call replaces the first callback. If the connection is
  // already gone, `callback` runs soon (on an io thread). Once Finish or Respond was called it
  // never runs (a client that goes away after that shows in the `written` callbacks only).
  virtual void OnClosed(std::function<void()> callback) = 0;
  // Body bytes queued by Write and not yet handed to the socket (for backpressure).
  virtual size_t queued_bytes() const = 0;
  // True once the response ended (Finish, Respond, Abort, or the client went away).
  virtual bool done() const = 0;
};

// Serves one request by writing to `stream`, now or later, from any thread. Runs on an io thread:
// it must return quickly (start the work, do not wait for it). An exception thrown before the
// response began is answered 500; after that, the connection is closed.
using StreamingHandler = std::function<void(HttpRequest request, std::shared_ptr<ResponseStream> stream)>;

// A routing table of exact paths with their allowed methods. Pure (no I/O), copyable.
// Thread-safety: Dispatch is const and may run concurrently; Handle must not run concurrently
// with anything else on the same router.
class HttpRouter {
 public:
  // Serves requests whose `path` is exactly `path` (e.g. "/metrics"; no prefix matching, no
  // percent-decoding; the query does not take part) with `methods` (case-sensitive, e.g.
  // {"GET"}). Registering a path again replaces its route.
  void Handle(std::string path, std::vector<std::string> methods, HttpHandler handler);
  // The same for a streaming handler (see ResponseStream). Routing (404, 405, OPTIONS) is the same
  // as for Handle; HEAD on a route allowing GET reaches the handler with method "HEAD" (its
  // stream sends heads only). Dispatch answers such a route 500: only the server streams.
  void HandleStreaming(std::string path, std::vector<std::string> methods, StreamingHandler handler);

  // The streaming handler that serves `request`: its path has a HandleStreaming route and its
  // method is one of the route's (or HEAD on a route allowing GET). Null otherwise (Dispatch
  // answers it: 404, 405, OPTIONS, "*"). The pointer is valid while the router is not changed.
  const StreamingHandler* FindStreamingHandler(const HttpRequest& request) const;

  // Answers one request:
  //   unknown path                             404
  //   method of the route                      the handler's response
  //   HEAD on a route allowing GET (not HEAD)  the handler's response (it sees method "HEAD")
  //                                            without body, head_content_length = body size
  //   OPTIONS on a route not allowing OPTIONS  204 with `Allow`
  //   any other method                         405 with `Allow`
  //   OPTIONS with path "*"                    204, `Allow` listing every routed method
  //   another method with path "*"             400
  // A handler that throws, or returns a status outside 200..599, is answered 500 (the exception's
  // text is not sent). `Allow` lists the route's methods in registration order, then HEAD (when
  // GET is allowed) and OPTIONS, e.g. "GET, HEAD, OPTIONS".
  HttpResponse Dispatch(const HttpRequest& request) const;

  // The `Allow` value of `path` (see Dispatch), or empty when the path has no route.
  std::string AllowHeader(absl::string_view path) const;

 private:
  struct Route {
    std::vector<std::string> methods;
    std::string allow;
    HttpHandler handler;                 // set for Handle routes
    StreamingHandler streaming_handler;  // set for HandleStreaming routes
  };
  std::map<std::string, Route, std::less<>> routes_;
};

// Monotonic counters since Create (open_connections is a gauge).
struct HttpServerStats {
  uint64_t connections_accepted = 0;   // connections served (refused ones are not counted here)
  uint64_t connections_refused = 0;    // accepted beyond max_connections: 503 (or just closed)
  uint64_t connections_timed_out = 0;  // closed by idle_timeout, request_timeout or write_timeout
  uint64_t requests = 0;               // complete, valid requests passed to the router
  uint64_t responses_2xx = 0;          // every response written, by class (refusals excluded)
  uint64_t responses_4xx = 0;
  uint64_t responses_5xx = 0;
  uint64_t malformed_requests = 0;  // answered 400, 501 or 505 by the request checks
  uint64_t oversized_requests = 0;  // answered 413, 414 or 431
  int64_t open_connections = 0;     // connections open now (refused ones excluded)
  // Streamed responses (ResponseStream) not ended yet: still being written, or finished by their
  // handler with pieces not yet handed to the socket. A graceful shutdown waits for 0 before Stop.
  int64_t open_streams = 0;
};

class HttpServer {
 public:
  // A server for `router`, not yet listening. INVALID_ARGUMENT (see ValidateHttpServerOptions)
  // for bad options.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Create(HttpServerOptions options, HttpRouter router);

  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;
  // Stop()s. Must not run on one of the server's own io threads (i.e. inside a handler).
  ~HttpServer();

  // Resolves and binds `listen`, starts listening and the io threads; port() is valid from then
  // on. UNAVAILABLE with a message naming the address when it cannot be resolved, is already in
  // use, is not an address of this machine, or needs privileges; FAILED_PRECONDITION when called
  // twice or after Stop (a server runs once).
  absl::Status Start();

  // The bound port (the chosen one for port 0); 0 before Start succeeded.
  int port() const;

  // Closes the listening socket and every connection (requests in flight are abandoned without a
  // response; a handler already running finishes first and Stop waits for it; open streamed
  // responses end as if the client went away, their callbacks running on this thread), and joins
  // the io threads. Afterwards no handler runs and open_connections is 0. Takes well under a second
  // unless a handler runs long. Idempotent; callable from any thread, also before Start. From
  // inside a handler it only initiates the stop (the io threads finish once the handlers return;
  // a later Stop or the destructor joins them).
  void Stop();

  // A snapshot of the counters; callable from any thread at any time.
  HttpServerStats stats() const;

 private:
  class Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Parses one request from `bytes` with the limits (max_header_bytes, max_body_bytes) and the
// checks of the server (see the top of this file); bytes after the first request are ignored.
// Returns the request, or an error with a short fixed reason that never echoes the input:
// RESOURCE_EXHAUSTED for what the server answers 413/414/431, INVALID_ARGUMENT for everything
// else (what it answers 400/501/505, and bytes that end before the request does). Only the limit
// fields of `limits` are used and they are not validated (0 is a valid body limit). Thread-safe.
absl::StatusOr<HttpRequest> ParseHttpRequest(absl::string_view bytes, const HttpServerOptions& limits);

}  // namespace eldr::http

#endif  // ELDR_HTTP_HTTP_SERVER_H_
