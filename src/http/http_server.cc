#include "eldr/http/http_server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace eldr::http {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = net::ip::tcp;
using SteadyClock = std::chrono::steady_clock;
using RequestParser = bhttp::request_parser<bhttp::string_body>;

// Closing a connection: after shutting down the sending side, what the client still sends is read
// and discarded for at most this long / this many bytes, so that it receives the last response
// instead of a reset (a close with unread input makes the kernel send RST).
constexpr auto kLingerTime = std::chrono::milliseconds(500);
constexpr size_t kLingerBytes = 256 * 1024;
// The first read of a request (waiting under idle_timeout) and every lingering read.
constexpr size_t kReadChunk = 16 * 1024;
// Refusals (503 beyond max_connections) being written at once; beyond, refused sockets are just closed.
constexpr int kMaxRefusalsInFlight = 64;
// The read buffer holds at most one header plus one read of the parser; a chunk-size line (which
// Beast does not limit) longer than this fails the request instead of growing the buffer.
constexpr size_t kReadBufferSlack = 64 * 1024;
// While a response is streamed, the bytes of pipelined requests kept at most are max_header_bytes
// plus the larger of max_body_bytes and this.
constexpr size_t kStreamReadSlack = 64 * 1024;
// The terminating chunk of a chunked body (no trailer fields).
constexpr absl::string_view kLastChunk = "0\r\n\r\n";
constexpr absl::string_view kCrlf = "\r\n";
// The most a 503 refusal may take to write.
constexpr auto kRefusalWriteTimeout = std::chrono::seconds(1);
// After an accept error that a retry cannot cure at once (out of descriptors or memory).
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(50);

// Beast stores a header field's name and value lengths in 16 bits and throws for longer ones; a
// header limit below that keeps every field (which Beast bounds by the limit) storable.
constexpr size_t kMaxHeaderBytes = 60 * 1024;

constexpr char kContinueResponse[] = "HTTP/1.1 100 Continue\r\n\r\n";

// ---- Request checks shared by the server and ParseHttpRequest ------------------------------------

// Why a request is refused: the response status and a fixed, input-free reason.
struct Rejection {
  int status;
  absl::string_view reason;
};

bool IsOversizedStatus(int status) { return status == 413 || status == 414 || status == 431; }

bool IsTokenChar(char c) {
  if (absl::ascii_isalnum(static_cast<unsigned char>(c))) return true;
  switch (c) {
    case '!':
    case '#':
    case '$':
    case '%':
    case '&':
    case '\'':
    case '*':
    case '+':
    case '-':
    case '.':
    case '^':
    case '_':
    case '`':
    case '|':
    case '~':
      return true;
    default:
      return false;
  }
}

bool IsToken(absl::string_view text) { return !text.empty() && std::all_of(text.begin(), text.end(), IsTokenChar); }

// A field value the server may send: no CR, LF or NUL (header injection), no other control byte
// but HTAB.
bool IsSendableFieldValue(absl::string_view value) {
  return std::none_of(value.begin(), value.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return (byte < 0x20 && byte != '\t') || byte == 0x7f;
  });
}

// Origin-form targets: visible ASCII only, no fragment.
bool IsOriginFormTarget(absl::string_view target) {
  if (target.empty() || target.front() != '/') return false;
  return std::all_of(target.begin(), target.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return byte > 0x20 && byte < 0x7f && byte != '#';
  });
}

// The checks a successfully parsed head must also pass (see the top of http_server.h).
std::optional<Rejection> CheckRequestHead(const RequestParser& parser) {
  const bhttp::request_header<>& head = parser.get();
  if (head.version() != 10 && head.version() != 11) return Rejection{505, "HTTP version not supported"};
  const beast::string_view target = head.target();
  if (target == "*") {
    if (head.method() != bhttp::verb::options) {
      return Rejection{400, "the asterisk target is only allowed with OPTIONS"};
    }
  } else if (!IsOriginFormTarget(absl::string_view(target.data(), target.size()))) {
    return Rejection{400, "the request target must be an absolute path"};
  }
  const size_t hosts = head.count(bhttp::field::host);
  if (hosts > 1) return Rejection{400, "more than one Host header"};
  if (hosts == 0 && head.version() == 11) return Rejection{400, "missing Host header"};
  const size_t codings = head.count(bhttp::field::transfer_encoding);
  if (codings > 0) {
    const bool plain_chunked =
        codings == 1 && absl::EqualsIgnoreCase(
                            absl::StripAsciiWhitespace(absl::string_view(head[bhttp::field::transfer_encoding].data(),
                                                                         head[bhttp::field::transfer_encoding].size())),
                            "chunked");
    if (!parser.chunked()) return Rejection{400, "the final transfer coding must be chunked"};
    if (!plain_chunked) return Rejection{501, "transfer coding not supported"};
  }
  return std::nullopt;
}

// Beast refuses every version but 1.0 and 1.1 as malformed; a well-formed request line with
// another version ("... HTTP/2.0") deserves 505 instead. `request_line` starts at the request line.
bool HasWellFormedOtherVersion(absl::string_view request_line) {
  const size_t end = request_line.find("\r\n");
  if (end == absl::string_view::npos) return false;
  const absl::string_view line = request_line.substr(0, end);
  if (line.size() < 9) return false;
  const absl::string_view version = line.substr(line.size() - 9);
  return version[0] == ' ' && absl::StartsWith(version.substr(1), "HTTP/") && absl::ascii_isdigit(version[6]) &&
         version[7] == '.' && absl::ascii_isdigit(version[8]);
}

// A Beast parse error as a response. `start_line_parsed` tells a request line that is too long
// (414) from header fields that are (431); `unconsumed` is what the parser has not consumed (the
// request line itself when that is what failed).
Rejection RejectionForParseError(const beast::error_code& error, bool start_line_parsed, absl::string_view unconsumed) {
  if (error == bhttp::error::header_limit) {
    return start_line_parsed ? Rejection{431, "request header fields too large"}
                             : Rejection{414, "request line too long"};
  }
  if (error == bhttp::error::body_limit) return Rejection{413, "request body too large"};
  if (error == bhttp::error::buffer_overflow) return Rejection{413, "chunk header too large"};
  if (error == bhttp::error::bad_method) return Rejection{400, "malformed request method"};
  if (error == bhttp::error::bad_target) return Rejection{400, "malformed request target"};
  if (error == bhttp::error::bad_version) {
    return !start_line_parsed && HasWellFormedOtherVersion(unconsumed) ? Rejection{505, "HTTP version not supported"}
                                                                       : Rejection{400, "malformed HTTP version"};
  }
  if (error == bhttp::error::bad_field || error == bhttp::error::bad_value || error == bhttp::error::bad_obs_fold) {
    return Rejection{400, "malformed header field"};
  }
  if (error == bhttp::error::bad_line_ending) return Rejection{400, "malformed line ending"};
  if (error == bhttp::error::bad_content_length) return Rejection{400, "invalid Content-Length"};
  if (error == bhttp::error::bad_transfer_encoding) return Rejection{400, "invalid Transfer-Encoding"};
  if (error == bhttp::error::bad_chunk || error == bhttp::error::bad_chunk_extension) {
    return Rejection{400, "malformed chunked body"};
  }
  return Rejection{400, "malformed request"};
}

// Beast sets the method when it has parsed the request line; methods are non-empty tokens.
bool StartLineParsed(const RequestParser& parser) { return !parser.get().method_string().empty(); }

void ConfigureParser(RequestParser& parser, size_t max_header_bytes, size_t max_body_bytes) {
  parser.header_limit(
      static_cast<std::uint32_t>(std::min<size_t>(max_header_bytes, std::numeric_limits<std::uint32_t>::max())));
  parser.body_limit(static_cast<std::uint64_t>(max_body_bytes));
}

absl::string_view View(beast::string_view text) { return absl::string_view(text.data(), text.size()); }

// The request as far as its head tells, taken as soon as the head is complete and checked. Beast
// adds a chunked body's trailer fields to the head's container (and may recompute keep-alive from
// them), so the head is copied before the body is read: a trailer can never add a second Host or
// a framing field after the checks. Repeated field names come out grouped at their first
// occurrence (Beast's order).
HttpRequest RequestFromHead(const bhttp::request_header<>& head) {
  HttpRequest request;
  request.method = std::string(View(head.method_string()));
  request.target = std::string(View(head.target()));
  const size_t question = request.target.find('?');
  if (question == std::string::npos) {
    request.path = request.target;
  } else {
    request.path = request.target.substr(0, question);
    request.query = request.target.substr(question + 1);
  }
  request.version = static_cast<int>(head.version());
  for (const auto& field : head) {
    request.headers.emplace_back(std::string(View(field.name_string())), std::string(View(field.value())));
  }
  return request;
}

absl::Status RejectionStatus(const Rejection& rejection) {
  return IsOversizedStatus(rejection.status) ? absl::ResourceExhaustedError(rejection.reason)
                                             : absl::InvalidArgumentError(rejection.reason);
}

// ---- Responses ------------------------------------------------------------------------------------

HttpResponse ErrorResponse(int status, absl::string_view reason) {
  HttpResponse response;
  response.status = status;
  response.body = absl::StrCat(reason, "\n");
  return response;
}

bool IsServerOwnedField(absl::string_view name) {
  for (absl::string_view owned : {"connection", "content-length", "content-type", "date", "keep-alive", "server",
                                  "transfer-encoding", "upgrade"}) {
    if (absl::EqualsIgnoreCase(name, owned)) return true;
  }
  return false;
}

bool StatusHasNoBody(int status) { return status == 204 || status == 304; }

std::string HttpDate() { return absl::FormatTime("%a, %d %b %Y %H:%M:%S GMT", absl::Now(), absl::UTCTimeZone()); }

// Fills `out` with the wire form of `response` (see HttpResponse for what is sent and dropped).
void BuildWireResponse(HttpResponse&& response, bool head_request, unsigned version, bool keep_alive,
                       bhttp::response<bhttp::string_body>& out) {
  out = {};
  const int status = response.status >= 200 && response.status <= 599 ? response.status : 500;
  out.result(static_cast<unsigned>(status));
  // Beast writes "<unknown-status>" for codes it does not know; send the class's name instead.
  const beast::string_view reason = bhttp::obsolete_reason(static_cast<bhttp::status>(status));
  if (reason == "<unknown-status>") {
    out.reason(status < 300   ? "Success"
               : status < 400 ? "Redirection"
               : status < 500 ? "Client Error"
                              : "Server Error");
  }
  out.version(version);
  out.set(bhttp::field::server, "eldr");
  out.set(bhttp::field::date, HttpDate());
  const bool bodiless = StatusHasNoBody(status);
  if (!bodiless && !response.content_type.empty() && IsSendableFieldValue(response.content_type)) {
    out.set(bhttp::field::content_type, response.content_type);
  }
  for (const auto& [name, value] : response.headers) {
    if (!IsToken(name) || !IsSendableFieldValue(value) || IsServerOwnedField(name)) continue;
    out.insert(beast::string_view(name.data(), name.size()), beast::string_view(value.data(), value.size()));
  }
  if (!bodiless) {
    if (head_request) {
      out.content_length(response.head_content_length.value_or(response.body.size()));
    } else {
      out.body() = std::move(response.body);
      out.content_length(out.body().size());
    }
  }
  out.keep_alive(keep_alive);
}

constexpr absl::Duration kMaxTimeout = absl::Hours(24 * 365);

std::chrono::steady_clock::duration ToSteady(absl::Duration duration) {
  return std::chrono::duration_cast<SteadyClock::duration>(absl::ToChronoNanoseconds(duration));
}

// ---- Listen address --------------------------------------------------------------------------------

struct ListenAddress {
  std::string host;  // an address literal (IPv6 without brackets) or a name
  uint16_t port = 0;
};

absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view listen) {
  const auto invalid = [](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("HttpServerOptions.listen ", why));
  };
  absl::string_view host, port;
  if (absl::StartsWith(listen, "[")) {
    const size_t close = listen.find(']');
    if (close == absl::string_view::npos || close + 1 >= listen.size() || listen[close + 1] != ':') {
      return invalid("must be [IPv6]:port, e.g. [::1]:9090");
    }
    host = listen.substr(1, close - 1);
    port = listen.substr(close + 2);
    beast::error_code error;
    net::ip::make_address_v6(std::string(host), error);
    if (error) return invalid("holds an invalid IPv6 address");
  } else {
    const size_t colon = listen.rfind(':');
    if (colon == absl::string_view::npos) return invalid("must be host:port, e.g. 127.0.0.1:9090");
    host = listen.substr(0, colon);
    port = listen.substr(colon + 1);
    if (absl::StrContains(host, ':')) return invalid("must bracket an IPv6 address, e.g. [::1]:9090");
    if (!std::all_of(host.begin(), host.end(), [](char c) {
          return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
        })) {
      return invalid("holds an invalid host name");
    }
  }
  uint32_t port_number = 0;
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &port_number) || port_number > 65535) {
    return invalid("must end with a port number in [0, 65535]");
  }
  ListenAddress address;
  address.host = host.empty() ? "0.0.0.0" : std::string(host);
  address.port = static_cast<uint16_t>(port_number);
  return address;
}

std::string EndpointText(const tcp::endpoint& endpoint) {
  const net::ip::address address = endpoint.address();
  return address.is_v6() ? absl::StrCat("[", address.to_string(), "]:", endpoint.port())
                         : absl::StrCat(address.to_string(), ":", endpoint.port());
}

// ---- Server state shared with the connections --------------------------------------------------------

class Connection;

// What connections need from the server. Connections hold it by shared_ptr: the last of them may be
// destroyed inside ~io_context, after the server object's other members are gone.
struct ServerShared {
  ServerShared(HttpServerOptions options_in, HttpRouter router_in, net::io_context::executor_type io_executor_in)
      : options(std::move(options_in)),
        router(std::move(router_in)),
        request_timeout(ToSteady(options.request_timeout)),
        idle_timeout(ToSteady(options.idle_timeout)),
        write_timeout(ToSteady(options.write_timeout)),
        io_executor(io_executor_in) {}

  bool Stopping() const { return stopping.load(std::memory_order_acquire); }

  void CountResponse(int status) {
    if (status >= 500) {
      responses_5xx.fetch_add(1, std::memory_order_relaxed);
    } else if (status >= 400) {
      responses_4xx.fetch_add(1, std::memory_order_relaxed);
    } else if (status >= 200 && status < 300) {
      responses_2xx.fetch_add(1, std::memory_order_relaxed);
    }
  }

  const HttpServerOptions options;
  const HttpRouter router;
  const SteadyClock::duration request_timeout;
  const SteadyClock::duration idle_timeout;
  const SteadyClock::duration write_timeout;
  // For callbacks of streamed responses that have no connection left to run on. Only used while
  // `accepting_posts` is true (the io_context exists then).
  const net::io_context::executor_type io_executor;

  // Posts from outside the io threads (ResponseStream calls, which may come from any thread and
  // after the server is gone) happen under a reader lock while this is true; Stop sets it false
  // before it closes the connections, so nothing is posted once the io_context may be destroyed.
  absl::Mutex post_mu;
  bool accepting_posts ABSL_GUARDED_BY(post_mu) = true;

  std::atomic<bool> stopping{false};
  std::atomic<uint64_t> connections_accepted{0};
  std::atomic<uint64_t> connections_refused{0};
  std::atomic<uint64_t> connections_timed_out{0};
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> responses_2xx{0};
  std::atomic<uint64_t> responses_4xx{0};
  std::atomic<uint64_t> responses_5xx{0};
  std::atomic<uint64_t> malformed_requests{0};
  std::atomic<uint64_t> oversized_requests{0};
  std::atomic<int64_t> open_connections{0};
  std::atomic<int64_t> open_streams{0};
  std::atomic<int> refusals_in_flight{0};

  // Every live connection, so that Stop can close them.
  absl::Mutex mu;
  uint64_t next_connection_id ABSL_GUARDED_BY(mu) = 0;
  std::unordered_map<uint64_t, std::weak_ptr<Connection>> connections ABSL_GUARDED_BY(mu);
};

// Runs a callback of a streamed response; what it throws goes nowhere (it must not unwind an io
// thread, and the response it belongs to has no one to tell).
void RunStreamCallback(const std::function<void()>& callback) {
  if (!callback) return;
  try {
    callback();
  } catch (...) {
  }
}

void RunWrittenCallback(const std::function<void(bool)>& written, bool ok) {
  if (!written) return;
  try {
    written(ok);
  } catch (...) {
  }
}

// ---- Streamed responses: the state shared by the handler's side and the connection's ----------------

// The call-time state of one streamed response: what the handler has called so far (so that
// calls out of order are refused at once, and done()/queued_bytes() are exact), and the OnClosed
// callback. Accepted calls are posted to the connection's strand in the order they were made (the
// post happens under `mu_`); the Connection applies them. Thread-safe.
class StreamCore : public std::enable_shared_from_this<StreamCore> {
 public:
  StreamCore(std::shared_ptr<ServerShared> shared, std::weak_ptr<Connection> connection)
      : shared_(std::move(shared)), connection_(std::move(connection)) {}

  StreamCore(const StreamCore&) = delete;
  StreamCore& operator=(const StreamCore&) = delete;

  // ResponseStream's calls (any thread).
  void Respond(HttpResponse response);
  void Begin(int status, std::string content_type, std::vector<std::pair<std::string, std::string>> headers);
  void Write(std::string bytes, std::function<void(bool)> written);
  void Finish();
  void Abort();
  void OnClosed(std::function<void()> callback);
  size_t queued_bytes() const { return queued_bytes_.load(std::memory_order_acquire); }
  bool done() const { return done_.load(std::memory_order_acquire); }

  // The handler's last reference went away: ends a response that has not ended (500 before Begin,
  // Abort after it).
  void Abandon();

  // The connection's side (its strand). The response ended without Finish or Respond having been
  // called: later calls are ignored; returns the OnClosed callback the caller must run (empty when
  // none was set, or when Finish or Respond was called first).
  std::function<void()> Closed();
  // Bytes counted by Write that were handed to the socket or dropped.
  void Unqueue(size_t bytes) {
    if (bytes > 0) queued_bytes_.fetch_sub(bytes, std::memory_order_acq_rel);
  }

 private:
  enum class Phase {
    kFresh,  // neither Begin nor Respond yet
    kBegun,  // Begin accepted: Write and Finish are
    kEnded,  // Finish, Respond, Abort, or the connection's end
  };

  // Posts `make_apply()(connection, core)` to the connection's strand; false when it cannot (the
  // server stopped, or the connection is gone), and then make_apply is not called (what it would
  // have moved from stays with the caller).
  template <typename MakeApply>
  bool PostToConnection(MakeApply make_apply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `callback` soon on an io thread (dropped once the server stopped).
  void PostCallback(std::function<void()> callback);

  const std::shared_ptr<ServerShared> shared_;
  const std::weak_ptr<Connection> connection_;

  mutable absl::Mutex mu_;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kFresh;
  bool completed_ ABSL_GUARDED_BY(mu_) = false;  // Finish or Respond was accepted
  bool closed_ ABSL_GUARDED_BY(mu_) = false;     // Closed() ran
  std::function<void()> on_closed_ ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> queued_bytes_{0};
  std::atomic<bool> done_{false};
};

// What a streaming handler holds. Its destruction (the handler's last reference going away) ends a
// response the handler left open, so that an abandoned stream cannot hold its connection forever.
class StreamHandle final : public ResponseStream {
 public:
  explicit StreamHandle(std::shared_ptr<StreamCore> core) : core_(std::move(core)) {}
  ~StreamHandle() override { core_->Abandon(); }

  void Respond(HttpResponse response) override { core_->Respond(std::move(response)); }
  void Begin(int status, std::string content_type, std::vector<std::pair<std::string, std::string>> headers) override {
    core_->Begin(status, std::move(content_type), std::move(headers));
  }
  void Write(std::string bytes, std::function<void(bool written)> written) override {
    core_->Write(std::move(bytes), std::move(written));
  }
  void Finish() override { core_->Finish(); }
  void Abort() override { core_->Abort(); }
  void OnClosed(std::function<void()> callback) override { core_->OnClosed(std::move(callback)); }
  size_t queued_bytes() const override { return core_->queued_bytes(); }
  bool done() const override { return core_->done(); }

 private:
  const std::shared_ptr<StreamCore> core_;
};

// One piece of a streamed response on the wire: `framing` (a head, a chunk-size line, the last
// chunk), then `payload` (body bytes as the handler wrote them, counted in queued_bytes), then
// `trailer` (a chunk's CRLF). Any of them may be empty.
struct StreamPiece {
  std::string framing;
  std::string payload;
  absl::string_view trailer;  // static storage
  std::function<void(bool)> written;
};

// The response a Connection is streaming (at most one at a time). StreamPiece and ActiveStream are
// at namespace scope, not nested in Connection: clang does not see a nested struct with default
// member initializers as default-constructible inside its enclosing class (std::optional::emplace).
struct ActiveStream {
  std::shared_ptr<StreamCore> core;
  bool head_request = false;
  unsigned version = 11;
  bool keep_alive = false;        // what the request and the server allow after this response
  bool chunked = false;           // body pieces are framed as chunks (HTTP/1.1, once begun)
  bool discard_body = false;      // HEAD, 204, 304: pieces never reach the wire
  bool end_queued = false;        // Finish or Respond: once the queue is written, the response ended
  bool close_after_end = false;   // HTTP/1.0 body, or no keep-alive: linger and close afterwards
  bool peer_gone = false;         // a read failed while a write was in flight: end after that write
  std::deque<StreamPiece> queue;  // not yet being written
};

// One accepted TCP connection. Every method but CloseFromStop runs on the connection's strand
// (the stream's executor), one at a time; the object lives as long as a completion handler holds it,
// and while a streamed response is open (which may have no operation pending: see
// self_while_streaming_).
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  enum class Mode {
    kServe,   // read requests, answer them
    kRefuse,  // over max_connections: answer 503 and close
  };

  Connection(tcp::socket socket, std::shared_ptr<ServerShared> shared, Mode mode)
      : stream_(std::move(socket)),
        shared_(std::move(shared)),
        mode_(mode),
        buffer_(shared_->options.max_header_bytes + kReadBufferSlack) {
    if (mode_ == Mode::kServe) {
      shared_->open_connections.fetch_add(1, std::memory_order_relaxed);
    } else {
      shared_->refusals_in_flight.fetch_add(1, std::memory_order_relaxed);
    }
  }

  ~Connection() {
    // Only reached with a stream open when the io_context is destroyed with this connection's
    // handlers unrun; its callbacks are dropped then, never run.
    if (active_stream_.has_value()) {
      active_stream_->core->Closed();
      shared_->open_streams.fetch_sub(1, std::memory_order_relaxed);
    }
    if (mode_ == Mode::kServe) {
      shared_->open_connections.fetch_sub(1, std::memory_order_relaxed);
    } else {
      shared_->refusals_in_flight.fetch_sub(1, std::memory_order_relaxed);
    }
    if (registered_) {
      absl::MutexLock lock(&shared_->mu);
      shared_->connections.erase(id_);
    }
  }

  // Registers with the server and begins serving on the strand.
  void Start() {
    {
      absl::MutexLock lock(&shared_->mu);
      id_ = shared_->next_connection_id++;
      shared_->connections.emplace(id_, weak_from_this());
      registered_ = true;
    }
    beast::error_code error;
    const tcp::endpoint remote = stream_.socket().remote_endpoint(error);
    if (!error) peer_ = EndpointText(remote);
    net::dispatch(stream_.get_executor(), beast::bind_front_handler(&Connection::Begin, shared_from_this()));
  }

  // The strand every method but CloseFromStop runs on.
  beast::tcp_stream::executor_type executor() { return stream_.get_executor(); }

  // Closes the socket, cancelling every operation, and ends an open streamed response (on the
  // strand, which Stop runs next). Only for Stop, once no io thread runs (so the strand's state
  // may be read here).
  void CloseFromStop() {
    stream_.close();
    if (active_stream_.has_value()) {
      net::post(stream_.get_executor(), [self = shared_from_this()] { self->StreamLost(); });
    }
  }

  // ---- A streamed response's calls, as StreamCore posts them (on the strand). Each is ignored
  // unless `core` is this connection's open stream.

  void StreamBegin(const std::shared_ptr<StreamCore>& core, int status, std::string content_type,
                   std::vector<std::pair<std::string, std::string>> headers) {
    if (!IsOpenStream(core)) return;
    ActiveStream& active = *active_stream_;
    HttpResponse head;
    head.status = status;
    head.content_type = std::move(content_type);
    head.headers = std::move(headers);
    StreamPiece piece;
    int sent_status = 500;
    try {
      bhttp::response<bhttp::string_body> wire;
      BuildWireResponse(std::move(head), /*head_request=*/true, active.version, active.keep_alive, wire);
      sent_status = static_cast<int>(wire.result_int());
      const bool bodiless = StatusHasNoBody(sent_status);
      active.discard_body = active.head_request || bodiless;
      if (!bodiless) {
        wire.content_length(boost::none);
        if (active.version >= 11) {
          wire.chunked(true);
          active.chunked = true;
        } else if (!active.head_request) {
          // HTTP/1.0 has no chunks: the body ends with the connection.
          wire.keep_alive(false);
          active.close_after_end = true;
        }
      }
      if (!active.keep_alive) active.close_after_end = true;
      piece.framing = SerializeHead(wire);
    } catch (...) {  // allocation failure
      return StreamLost();
    }
    shared_->CountResponse(sent_status);
    active.queue.push_back(std::move(piece));
    PumpStreamWrites();
  }

  void StreamRespond(const std::shared_ptr<StreamCore>& core, HttpResponse response) {
    if (!IsOpenStream(core)) return;
    ActiveStream& active = *active_stream_;
    bool keep_alive = active.keep_alive;
    StreamPiece piece;
    int sent_status = 500;
    try {
      bhttp::response<bhttp::string_body> wire;
      try {
        BuildWireResponse(std::move(response), active.head_request, active.version, keep_alive, wire);
      } catch (...) {
        keep_alive = false;
        BuildWireResponse(ErrorResponse(500, "internal server error"), false, active.version, false, wire);
      }
      sent_status = static_cast<int>(wire.result_int());
      piece.framing = SerializeHead(wire);
      piece.payload = std::move(wire.body());
    } catch (...) {  // allocation failure
      return StreamLost();
    }
    shared_->CountResponse(sent_status);
    active.close_after_end = !keep_alive;
    active.end_queued = true;
    active.queue.push_back(std::move(piece));
    PumpStreamWrites();
  }

  void StreamWrite(const std::shared_ptr<StreamCore>& core, std::string bytes, std::function<void(bool)> written) {
    if (!IsOpenStream(core)) {
      core->Unqueue(bytes.size());
      return RunWrittenCallback(written, false);
    }
    ActiveStream& active = *active_stream_;
    StreamPiece piece;
    piece.written = std::move(written);
    if (active.discard_body || bytes.empty()) {
      // Nothing goes on the wire; the callback still runs in order, after the pieces before it.
      core->Unqueue(bytes.size());
    } else {
      if (active.chunked) {
        piece.framing = absl::StrCat(absl::Hex(bytes.size()), kCrlf);
        piece.trailer = kCrlf;
      }
      piece.payload = std::move(bytes);
    }
    active.queue.push_back(std::move(piece));
    PumpStreamWrites();
  }

  void StreamFinish(const std::shared_ptr<StreamCore>& core) {
    if (!IsOpenStream(core)) return;
    ActiveStream& active = *active_stream_;
    if (active.chunked && !active.discard_body) {
      StreamPiece piece;
      piece.framing = std::string(kLastChunk);
      active.queue.push_back(std::move(piece));
    }
    active.end_queued = true;
    PumpStreamWrites();
  }

  void StreamAbort(const std::shared_ptr<StreamCore>& core) {
    if (IsOpenStream(core)) StreamLost();
  }

 private:
  void Begin() {
    if (mode_ == Mode::kRefuse) {
      Respond(ErrorResponse(503, "too many connections"), /*head_request=*/false, /*version=*/11,
              /*keep_alive=*/false);
      return;
    }
    WaitForRequest();
  }

  // Between requests: wait (idle_timeout) for the first byte of the next one, unless a pipelined
  // one is already buffered.
  void WaitForRequest() {
    if (shared_->Stopping()) return Close();
    RestoreReadLimit();
    if (buffer_.size() > 0) return ReadHeader();
    stream_.expires_after(shared_->idle_timeout);
    stream_.async_read_some(buffer_.prepare(kReadChunk),
                            beast::bind_front_handler(&Connection::OnFirstBytes, shared_from_this()));
  }

  void OnFirstBytes(beast::error_code error, size_t bytes) {
    if (shared_->Stopping()) return Close();
    if (error) {
      if (error == beast::error::timeout) shared_->connections_timed_out.fetch_add(1, std::memory_order_relaxed);
      return Close();  // the client closed or reset, or it idled too long
    }
    buffer_.commit(bytes);
    ReadHeader();
  }

  // The request's clock starts now: head and body must arrive by request_deadline_.
  void ReadHeader() {
    parser_.emplace();
    ConfigureParser(*parser_, shared_->options.max_header_bytes, shared_->options.max_body_bytes);
    request_deadline_ = SteadyClock::now() + shared_->request_timeout;
    stream_.expires_at(request_deadline_);
    bhttp::async_read_header(stream_, buffer_, *parser_,
                             beast::bind_front_handler(&Connection::OnHeader, shared_from_this()));
  }

  void OnHeader(beast::error_code error, size_t header_bytes) {
    if (shared_->Stopping()) return Close();
    if (error) return OnReadError(error);
    // Beast limits the request line and the fields separately; the limit is on their sum.
    if (header_bytes > shared_->options.max_header_bytes) {
      return Reject(Rejection{431, "request header fields too large"});
    }
    if (std::optional<Rejection> rejection = CheckRequestHead(*parser_)) return Reject(*rejection);
    request_ = RequestFromHead(parser_->get());
    request_keep_alive_ = parser_->keep_alive();
    if (parser_->is_done()) return OnRequestComplete();
    const bhttp::request_header<>& head = parser_->get();
    if (head.version() == 11 && absl::EqualsIgnoreCase(View(head[bhttp::field::expect]), "100-continue")) {
      // The interim response shares the request's deadline.
      net::async_write(stream_, net::buffer(kContinueResponse, sizeof(kContinueResponse) - 1),
                       beast::bind_front_handler(&Connection::OnContinueWritten, shared_from_this()));
      return;
    }
    ReadBody();
  }

  void OnContinueWritten(beast::error_code error, size_t /*bytes*/) {
    if (shared_->Stopping()) return Close();
    if (error) return OnReadError(error);
    ReadBody();
  }

  void ReadBody() {
    stream_.expires_at(request_deadline_);
    bhttp::async_read(stream_, buffer_, *parser_, beast::bind_front_handler(&Connection::OnBody, shared_from_this()));
  }

  void OnBody(beast::error_code error, size_t /*bytes*/) {
    if (shared_->Stopping()) return Close();
    if (error) return OnReadError(error);
    OnRequestComplete();
  }

  void OnReadError(const beast::error_code& error) {
    if (error == beast::error::timeout) {
      shared_->connections_timed_out.fetch_add(1, std::memory_order_relaxed);
      return Close();  // Beast has closed the socket already
    }
    // The client went away mid-request (or between requests): nobody to answer.
    if (error == bhttp::error::end_of_stream || error == bhttp::error::partial_message) return Close();
    if (error.category() == beast::error_code(bhttp::error::bad_method).category()) {
      const net::const_buffer unconsumed = buffer_.data();
      return Reject(
          RejectionForParseError(error, StartLineParsed(*parser_),
                                 absl::string_view(static_cast<const char*>(unconsumed.data()), unconsumed.size())));
    }
    Close();  // a socket error: reset, aborted
  }

  // Answers a refused request and closes the connection.
  void Reject(const Rejection& rejection) {
    if (IsOversizedStatus(rejection.status)) {
      shared_->oversized_requests.fetch_add(1, std::memory_order_relaxed);
    } else {
      shared_->malformed_requests.fetch_add(1, std::memory_order_relaxed);
    }
    parser_.reset();
    Respond(ErrorResponse(rejection.status, rejection.reason), /*head_request=*/false, /*version=*/11,
            /*keep_alive=*/false);
  }

  void OnRequestComplete() {
    HttpRequest request = std::move(request_);
    request_ = HttpRequest();
    request.body = std::move(parser_->get().body());
    parser_.reset();
    request.peer = peer_;
    shared_->requests.fetch_add(1, std::memory_order_relaxed);
    ++requests_served_;
    const bool keep_alive =
        request_keep_alive_ && requests_served_ < shared_->options.max_requests_per_connection && !shared_->Stopping();
    RestoreReadLimit();
    const StreamingHandler* streaming_handler = shared_->router.FindStreamingHandler(request);
    if (streaming_handler != nullptr) return StartStream(std::move(request), *streaming_handler, keep_alive);
    HttpResponse response;
    try {
      response = shared_->router.Dispatch(request);
    } catch (...) {  // Dispatch catches the handler's exceptions; this is for its own (allocation)
      response = ErrorResponse(500, "internal server error");
    }
    Respond(std::move(response), request.method == "HEAD", static_cast<unsigned>(request.version), keep_alive);
  }

  void Respond(HttpResponse response, bool head_request, unsigned version, bool keep_alive) {
    int status = 500;
    try {
      BuildWireResponse(std::move(response), head_request, version, keep_alive, wire_response_);
      status = static_cast<int>(wire_response_.result_int());
    } catch (...) {
      BuildWireResponse(ErrorResponse(500, "internal server error"), false, version, false, wire_response_);
      keep_alive = false;
    }
    if (mode_ == Mode::kServe) {
      shared_->CountResponse(status);
      stream_.expires_after(shared_->write_timeout);
    } else {
      // A refusal is a courtesy: it must not hold resources for long.
      stream_.expires_after(std::min<SteadyClock::duration>(shared_->write_timeout, kRefusalWriteTimeout));
    }
    if (head_request) {
      serializer_.emplace(wire_response_);
      bhttp::async_write_header(stream_, *serializer_,
                                beast::bind_front_handler(&Connection::OnWritten, shared_from_this(), keep_alive));
    } else {
      bhttp::async_write(stream_, wire_response_,
                         beast::bind_front_handler(&Connection::OnWritten, shared_from_this(), keep_alive));
    }
  }

  void OnWritten(bool keep_alive, beast::error_code error, size_t /*bytes*/) {
    serializer_.reset();
    wire_response_ = {};
    if (shared_->Stopping()) return Close();
    if (error) {
      if (error == beast::error::timeout) shared_->connections_timed_out.fetch_add(1, std::memory_order_relaxed);
      return Close();
    }
    if (!keep_alive) return LingerAndClose();
    WaitForRequest();
  }

  void LingerAndClose() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    buffer_.clear();
    stream_.expires_after(kLingerTime);
    ReadAndDiscard();
  }

  void ReadAndDiscard() {
    stream_.async_read_some(buffer_.prepare(kReadChunk),
                            beast::bind_front_handler(&Connection::OnLingerRead, shared_from_this()));
  }

  void OnLingerRead(beast::error_code error, size_t bytes) {
    lingered_bytes_ += bytes;
    if (error || lingered_bytes_ >= kLingerBytes || shared_->Stopping()) return Close();
    ReadAndDiscard();  // what was read is never committed to the buffer: discarded
  }

  void Close() { stream_.close(); }

  // ---- Streamed responses -------------------------------------------------------------------------

  // What follows once the read pending when a stream ended completes.
  enum class AfterStream { kClose, kNextRequest, kLinger };

  bool IsOpenStream(const std::shared_ptr<StreamCore>& core) const {
    return active_stream_.has_value() && active_stream_->core == core;
  }

  size_t NormalReadLimit() const { return shared_->options.max_header_bytes + kReadBufferSlack; }
  size_t StreamReadLimit() const {
    return shared_->options.max_header_bytes + std::max(shared_->options.max_body_bytes, kStreamReadSlack);
  }
  // Back to the usual bound on the read buffer once what a stream let in beyond it was consumed.
  void RestoreReadLimit() {
    if (buffer_.size() <= NormalReadLimit()) buffer_.max_size(NormalReadLimit());
  }

  static std::string SerializeHead(const bhttp::response<bhttp::string_body>& wire) {
    std::ostringstream head;
    head << wire.base();
    return std::move(head).str();
  }

  // Hands `request` to its streaming handler. The connection keeps reading meanwhile (to notice a
  // client that goes away) and is kept alive by self_while_streaming_ until the response ends.
  void StartStream(HttpRequest request, const StreamingHandler& handler, bool keep_alive) {
    const bool head_request = request.method == "HEAD";
    const auto version = static_cast<unsigned>(request.version);
    std::shared_ptr<StreamCore> core;
    std::shared_ptr<ResponseStream> handle;
    try {
      core = std::make_shared<StreamCore>(shared_, weak_from_this());
      handle = std::make_shared<StreamHandle>(core);
      active_stream_.emplace();
      shared_->open_streams.fetch_add(1, std::memory_order_relaxed);
    } catch (...) {  // allocation failure
      return Respond(ErrorResponse(500, "internal server error"), head_request, version, /*keep_alive=*/false);
    }
    ActiveStream& active = *active_stream_;
    active.core = core;
    active.head_request = head_request;
    active.version = version;
    active.keep_alive = keep_alive;
    self_while_streaming_ = shared_from_this();
    after_stream_ = AfterStream::kClose;
    buffer_.max_size(std::max(NormalReadLimit(), StreamReadLimit()));
    ReadWhileStreaming();
    try {
      handler(std::move(request), handle);
    } catch (...) {
      // Before the response began: 500. After: the connection closes (Respond is then ignored).
      try {
        handle->Respond(ErrorResponse(500, "internal server error"));
      } catch (...) {
      }
      handle->Abort();
    }
    // When the handler kept no reference, the handle's destruction ends the response it left open.
  }

  void ReadWhileStreaming() {
    const size_t limit = StreamReadLimit();
    if (buffer_.size() >= limit) return;  // full: the client waits (TCP flow control) until the end
    try {
      const net::mutable_buffer room = buffer_.prepare(std::min(kReadChunk, limit - buffer_.size()));
      stream_read_in_flight_ = true;
      // On the socket itself, not the tcp_stream: this read has no deadline, and the stream's
      // write deadlines must not apply to it.
      stream_.socket().async_read_some(
          room, beast::bind_front_handler(&Connection::OnReadWhileStreaming, shared_from_this()));
    } catch (...) {  // allocation failure
      stream_read_in_flight_ = false;
      StreamLost();
    }
  }

  void OnReadWhileStreaming(beast::error_code error, size_t bytes) {
    stream_read_in_flight_ = false;
    if (!error) buffer_.commit(bytes);
    if (!active_stream_.has_value()) {
      // The response ended while this read was pending (and it was cancelled, or completed first).
      if (shared_->Stopping() || (error && error != net::error::operation_aborted)) return Close();
      switch (after_stream_) {
        case AfterStream::kNextRequest:
          return WaitForRequest();
        case AfterStream::kLinger:
          return LingerAndClose();
        case AfterStream::kClose:
          return Close();
      }
      return Close();
    }
    if (shared_->Stopping()) return StreamLost();
    if (error) {
      // EOF (the client closed), a reset, or the socket closed by a write timeout. A write in
      // flight completes first, so that its callbacks tell the truth.
      if (stream_write_in_flight_) {
        active_stream_->peer_gone = true;
        return;
      }
      return StreamLost();
    }
    ReadWhileStreaming();
  }

  // Writes everything queued, as one gather write; at most one write is in flight.
  void PumpStreamWrites() {
    if (stream_write_in_flight_ || !active_stream_.has_value()) return;
    ActiveStream& active = *active_stream_;
    if (active.queue.empty()) {
      if (active.end_queued) CompleteStream();
      return;
    }
    size_t total = 0;
    try {
      stream_writing_.clear();
      stream_write_buffers_.clear();
      while (!active.queue.empty()) {
        stream_writing_.push_back(std::move(active.queue.front()));
        active.queue.pop_front();
      }
      for (const StreamPiece& piece : stream_writing_) {
        for (absl::string_view part :
             {absl::string_view(piece.framing), absl::string_view(piece.payload), piece.trailer}) {
          if (part.empty()) continue;
          stream_write_buffers_.emplace_back(part.data(), part.size());
          total += part.size();
        }
      }
    } catch (...) {  // allocation failure
      return StreamLost();
    }
    stream_write_in_flight_ = true;
    if (total == 0) {
      // Only callbacks (discarded pieces): complete without touching the socket.
      net::post(stream_.get_executor(), beast::bind_front_handler(&Connection::OnStreamWritten, shared_from_this(),
                                                                  beast::error_code(), size_t{0}));
      return;
    }
    stream_.expires_after(shared_->write_timeout);
    net::async_write(stream_, stream_write_buffers_,
                     beast::bind_front_handler(&Connection::OnStreamWritten, shared_from_this()));
  }

  void OnStreamWritten(beast::error_code error, size_t /*bytes*/) {
    stream_write_in_flight_ = false;
    std::vector<StreamPiece> written = std::move(stream_writing_);
    stream_writing_.clear();
    stream_write_buffers_.clear();
    if (error == beast::error::timeout) shared_->connections_timed_out.fetch_add(1, std::memory_order_relaxed);
    // The write completed before the close, or was cancelled by it: its callbacks tell which.
    ActiveStream* const stream = active_stream_.has_value() ? &*active_stream_
                                 : lost_stream_.has_value() ? &*lost_stream_
                                                            : nullptr;
    if (stream == nullptr) return Close();
    const std::shared_ptr<StreamCore> core = stream->core;
    for (StreamPiece& piece : written) {
      core->Unqueue(piece.payload.size());
      RunWrittenCallback(piece.written, !error);
    }
    written.clear();
    // The stream was lost while this write was in flight: the rest of its end is due now.
    if (!active_stream_.has_value()) return EndLostStream();
    if (error || active_stream_->peer_gone || shared_->Stopping()) return StreamLost();
    PumpStreamWrites();
  }

  // The response ended as the handler asked (Finish or Respond, all written): on to the next
  // request, or linger and close.
  void CompleteStream() {
    const std::shared_ptr<Connection> self = std::move(self_while_streaming_);
    self_while_streaming_.reset();
    after_stream_ = active_stream_->close_after_end ? AfterStream::kLinger : AfterStream::kNextRequest;
    active_stream_.reset();
    shared_->open_streams.fetch_sub(1, std::memory_order_relaxed);
    if (stream_read_in_flight_) {
      // OnReadWhileStreaming goes on from here, once the read returns (cancelled, or with bytes
      // that then stay buffered for the next request).
      beast::error_code ignored;
      stream_.socket().cancel(ignored);
      return;
    }
    if (after_stream_ == AfterStream::kLinger) return LingerAndClose();
    WaitForRequest();
  }

  // The response ended otherwise (the client went away, a write failed or timed out, Abort, Stop):
  // the connection closes; the callbacks of what was not written report false, then OnClosed runs.
  // The callbacks run in order: those of a write in flight (once it completes: the close cancels
  // it, unless it had completed already), then false for the queued pieces, then OnClosed.
  void StreamLost() {
    if (!active_stream_.has_value()) return Close();
    const std::shared_ptr<Connection> self = std::move(self_while_streaming_);
    self_while_streaming_.reset();
    lost_stream_ = std::move(active_stream_);
    active_stream_.reset();
    shared_->open_streams.fetch_sub(1, std::memory_order_relaxed);
    after_stream_ = AfterStream::kClose;
    Close();
    lost_on_closed_ = lost_stream_->core->Closed();
    if (!stream_write_in_flight_) EndLostStream();  // else OnStreamWritten calls it
  }

  void EndLostStream() {
    if (!lost_stream_.has_value()) return;
    ActiveStream lost = std::move(*lost_stream_);
    lost_stream_.reset();
    const std::function<void()> on_closed = std::move(lost_on_closed_);
    lost_on_closed_ = nullptr;
    for (StreamPiece& piece : lost.queue) {
      lost.core->Unqueue(piece.payload.size());
      RunWrittenCallback(piece.written, false);
    }
    lost.queue.clear();
    RunStreamCallback(on_closed);
  }

  beast::tcp_stream stream_;
  const std::shared_ptr<ServerShared> shared_;
  const Mode mode_;
  uint64_t id_ = 0;
  bool registered_ = false;
  std::string peer_;
  beast::flat_buffer buffer_;
  std::optional<RequestParser> parser_;
  HttpRequest request_;              // the request being read, from its head (RequestFromHead)
  bool request_keep_alive_ = false;  // what its head asks for
  SteadyClock::time_point request_deadline_;
  int requests_served_ = 0;
  bhttp::response<bhttp::string_body> wire_response_;
  std::optional<bhttp::response_serializer<bhttp::string_body>> serializer_;
  size_t lingered_bytes_ = 0;

  std::optional<ActiveStream> active_stream_;
  // A stream that ended abnormally while a write was in flight, and its OnClosed callback: both
  // wait for that write's completion (EndLostStream).
  std::optional<ActiveStream> lost_stream_;
  std::function<void()> lost_on_closed_;
  std::vector<StreamPiece> stream_writing_;  // the write in flight (its buffers point into it)
  std::vector<net::const_buffer> stream_write_buffers_;
  bool stream_write_in_flight_ = false;
  bool stream_read_in_flight_ = false;
  AfterStream after_stream_ = AfterStream::kClose;
  // Set while a stream is open: the handler's calls may be the connection's only future, so it
  // must not vanish while no operation is pending. Cleared when the stream ends (Stop ends it too).
  std::shared_ptr<Connection> self_while_streaming_;
};

// ---- StreamCore (needs Connection) ---------------------------------------------------------------------

// No user callback (which may hold the last reference to a StreamHandle, whose destruction calls
// back into its core) is ever destroyed while `mu_` is held: what a call cannot use is moved to a
// local declared before the lock, and released after it.

template <typename MakeApply>
bool StreamCore::PostToConnection(MakeApply make_apply) {
  absl::ReaderMutexLock gate(&shared_->post_mu);
  if (!shared_->accepting_posts) return false;
  std::shared_ptr<Connection> connection = connection_.lock();
  if (connection == nullptr) return false;
  try {
    const auto executor = connection->executor();
    net::post(executor, [connection = std::move(connection), core = shared_from_this(),
                         apply = make_apply()]() mutable { apply(*connection, core); });
  } catch (...) {  // allocation failure: the call is lost
    return false;
  }
  return true;
}

void StreamCore::PostCallback(std::function<void()> callback) {
  if (!callback) return;
  absl::ReaderMutexLock gate(&shared_->post_mu);
  if (!shared_->accepting_posts) return;
  try {
    net::post(shared_->io_executor, [callback = std::move(callback)] { RunStreamCallback(callback); });
  } catch (...) {  // allocation failure: the callback is lost
  }
}

void StreamCore::Respond(HttpResponse response) {
  absl::MutexLock lock(&mu_);
  if (phase_ != Phase::kFresh) return;
  phase_ = Phase::kEnded;
  completed_ = true;
  done_.store(true, std::memory_order_release);
  PostToConnection([&response] {
    return [response = std::move(response)](Connection& connection, const std::shared_ptr<StreamCore>& core) mutable {
      connection.StreamRespond(core, std::move(response));
    };
  });
}

void StreamCore::Begin(int status, std::string content_type, std::vector<std::pair<std::string, std::string>> headers) {
  absl::MutexLock lock(&mu_);
  if (phase_ != Phase::kFresh) return;
  phase_ = Phase::kBegun;
  PostToConnection([&] {
    return [status, content_type = std::move(content_type), headers = std::move(headers)](
               Connection& connection, const std::shared_ptr<StreamCore>& core) mutable {
      connection.StreamBegin(core, status, std::move(content_type), std::move(headers));
    };
  });
}

void StreamCore::Write(std::string bytes, std::function<void(bool)> written) {
  std::function<void(bool)> not_written;  // released after the lock
  {
    absl::MutexLock lock(&mu_);
    if (phase_ == Phase::kBegun) {
      const size_t size = bytes.size();
      queued_bytes_.fetch_add(size, std::memory_order_acq_rel);
      const bool posted = PostToConnection([&] {
        return [bytes = std::move(bytes), written = std::move(written)](
                   Connection& connection, const std::shared_ptr<StreamCore>& core) mutable {
          connection.StreamWrite(core, std::move(bytes), std::move(written));
        };
      });
      if (posted) return;
      Unqueue(size);
    }
    not_written = std::move(written);
  }
  if (not_written) PostCallback([not_written = std::move(not_written)] { not_written(false); });
}

void StreamCore::Finish() {
  absl::MutexLock lock(&mu_);
  if (phase_ != Phase::kBegun) return;
  phase_ = Phase::kEnded;
  completed_ = true;
  done_.store(true, std::memory_order_release);
  PostToConnection([] {
    return [](Connection& connection, const std::shared_ptr<StreamCore>& core) { connection.StreamFinish(core); };
  });
}

void StreamCore::Abort() {
  absl::MutexLock lock(&mu_);
  if (phase_ == Phase::kEnded) return;
  phase_ = Phase::kEnded;
  done_.store(true, std::memory_order_release);
  PostToConnection([] {
    return [](Connection& connection, const std::shared_ptr<StreamCore>& core) { connection.StreamAbort(core); };
  });
}

void StreamCore::OnClosed(std::function<void()> callback) {
  std::function<void()> released;  // the replaced callback, or one that can never run; after the lock
  bool run_now = false;
  {
    absl::MutexLock lock(&mu_);
    if (completed_) {
      released = std::move(callback);
    } else if (closed_) {
      run_now = true;
    } else {
      released = std::exchange(on_closed_, std::move(callback));
    }
  }
  if (run_now) PostCallback(std::move(callback));
}

void StreamCore::Abandon() {
  bool fresh = false;
  {
    absl::MutexLock lock(&mu_);
    if (phase_ == Phase::kEnded) return;
    fresh = phase_ == Phase::kFresh;
  }
  if (fresh) {
    try {
      Respond(ErrorResponse(500, "internal server error"));
    } catch (...) {  // allocation failure: close instead
    }
  }
  Abort();  // ignored when Respond was accepted
}

std::function<void()> StreamCore::Closed() {
  std::function<void()> callback;  // declared before the lock: released after it
  bool completed = false;
  {
    absl::MutexLock lock(&mu_);
    phase_ = Phase::kEnded;
    closed_ = true;
    done_.store(true, std::memory_order_release);
    callback = std::exchange(on_closed_, nullptr);
    completed = completed_;
  }
  if (completed) return nullptr;  // `callback` is released here, without the lock
  return callback;
}

// The server whose io thread this is (null on other threads): Stop from inside a handler must not
// join its own thread.
thread_local const void* current_io_thread_owner = nullptr;

}  // namespace

// ---- ValidateHttpServerOptions ----------------------------------------------------------------------

absl::Status ValidateHttpServerOptions(const HttpServerOptions& options) {
  if (absl::StatusOr<ListenAddress> listen = ParseListenAddress(options.listen); !listen.ok()) {
    return listen.status();
  }
  if (options.threads < 1 || options.threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("HttpServerOptions.threads must be in [1, 256], got ", options.threads));
  }
  if (options.max_connections < 1 || options.max_connections > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrCat("HttpServerOptions.max_connections must be in [1, 1000000], got ", options.max_connections));
  }
  if (options.max_header_bytes < 64 || options.max_header_bytes > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("HttpServerOptions.max_header_bytes must be in [64, ",
                                                   kMaxHeaderBytes, "], got ", options.max_header_bytes));
  }
  if (options.max_body_bytes > (size_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("HttpServerOptions.max_body_bytes must be at most 1073741824, got ", options.max_body_bytes));
  }
  const std::pair<absl::string_view, absl::Duration> timeouts[] = {
      {"request_timeout", options.request_timeout},
      {"idle_timeout", options.idle_timeout},
      {"write_timeout", options.write_timeout},
  };
  for (const auto& [name, timeout] : timeouts) {
    if (timeout <= absl::ZeroDuration() || timeout > kMaxTimeout) {
      return absl::InvalidArgumentError(absl::StrCat(
          "HttpServerOptions.", name, " must be > 0 and at most a year, got ", absl::FormatDuration(timeout)));
    }
  }
  if (options.max_requests_per_connection < 1) {
    return absl::InvalidArgumentError(absl::StrCat("HttpServerOptions.max_requests_per_connection must be >= 1, got ",
                                                   options.max_requests_per_connection));
  }
  return absl::OkStatus();
}

// ---- HttpRequest --------------------------------------------------------------------------------------

std::optional<absl::string_view> HttpRequest::Header(absl::string_view name) const {
  for (const auto& [header_name, value] : headers) {
    if (absl::EqualsIgnoreCase(header_name, name)) return absl::string_view(value);
  }
  return std::nullopt;
}

// ---- HttpRouter ---------------------------------------------------------------------------------------

namespace {

bool Contains(const std::vector<std::string>& methods, absl::string_view method) {
  return std::find(methods.begin(), methods.end(), method) != methods.end();
}

// The route's methods, then HEAD (with GET) and OPTIONS when the route does not list them.
std::vector<std::string> AllowedMethods(const std::vector<std::string>& methods) {
  std::vector<std::string> allowed = methods;
  if (Contains(allowed, "GET") && !Contains(allowed, "HEAD")) allowed.push_back("HEAD");
  if (!Contains(allowed, "OPTIONS")) allowed.push_back("OPTIONS");
  return allowed;
}

HttpResponse CallHandler(const HttpHandler& handler, const HttpRequest& request) {
  HttpResponse response;
  try {
    response = handler(request);
  } catch (...) {
    return ErrorResponse(500, "internal server error");
  }
  if (response.status < 200 || response.status > 599) {
    return ErrorResponse(500, "handler returned an invalid status");
  }
  return response;
}

HttpResponse NoContentWithAllow(std::string allow) {
  HttpResponse response;
  response.status = 204;
  response.content_type.clear();
  response.headers.emplace_back("Allow", std::move(allow));
  return response;
}

}  // namespace

namespace {

// The methods without repeats, in their first order.
std::vector<std::string> UniqueMethods(std::vector<std::string> methods) {
  std::vector<std::string> unique;
  for (std::string& method : methods) {
    if (!Contains(unique, method)) unique.push_back(std::move(method));
  }
  return unique;
}

// Whether `method` reaches the route's handler: one of its methods, or HEAD on a GET route.
bool ReachesHandler(const std::vector<std::string>& methods, absl::string_view method) {
  return Contains(methods, method) || (method == "HEAD" && Contains(methods, "GET"));
}

}  // namespace

void HttpRouter::Handle(std::string path, std::vector<std::string> methods, HttpHandler handler) {
  Route route;
  route.methods = UniqueMethods(std::move(methods));
  route.allow = absl::StrJoin(AllowedMethods(route.methods), ", ");
  route.handler = std::move(handler);
  routes_.insert_or_assign(std::move(path), std::move(route));
}

void HttpRouter::HandleStreaming(std::string path, std::vector<std::string> methods, StreamingHandler handler) {
  Route route;
  route.methods = UniqueMethods(std::move(methods));
  route.allow = absl::StrJoin(AllowedMethods(route.methods), ", ");
  route.streaming_handler = std::move(handler);
  routes_.insert_or_assign(std::move(path), std::move(route));
}

const StreamingHandler* HttpRouter::FindStreamingHandler(const HttpRequest& request) const {
  const auto it = routes_.find(request.path);
  if (it == routes_.end() || !it->second.streaming_handler) return nullptr;
  return ReachesHandler(it->second.methods, request.method) ? &it->second.streaming_handler : nullptr;
}

std::string HttpRouter::AllowHeader(absl::string_view path) const {
  const auto it = routes_.find(path);
  return it == routes_.end() ? std::string() : it->second.allow;
}

HttpResponse HttpRouter::Dispatch(const HttpRequest& request) const {
  if (request.path == "*") {
    if (request.method != "OPTIONS") return ErrorResponse(400, "the asterisk target is only allowed with OPTIONS");
    std::vector<std::string> every;
    for (const auto& [path, route] : routes_) {
      for (const std::string& method : AllowedMethods(route.methods)) {
        if (!Contains(every, method)) every.push_back(method);
      }
    }
    if (!Contains(every, "OPTIONS")) every.push_back("OPTIONS");
    return NoContentWithAllow(absl::StrJoin(every, ", "));
  }
  const auto it = routes_.find(request.path);
  if (it == routes_.end()) return ErrorResponse(404, "not found");
  const Route& route = it->second;
  if (route.streaming_handler && ReachesHandler(route.methods, request.method)) {
    return ErrorResponse(500, "internal server error");  // only the server streams
  }
  if (Contains(route.methods, request.method)) return CallHandler(route.handler, request);
  if (request.method == "HEAD" && Contains(route.methods, "GET")) {
    HttpResponse response = CallHandler(route.handler, request);
    if (!response.head_content_length.has_value()) response.head_content_length = response.body.size();
    response.body.clear();
    return response;
  }
  if (request.method == "OPTIONS") return NoContentWithAllow(route.allow);
  HttpResponse response = ErrorResponse(405, "method not allowed");
  response.headers.emplace_back("Allow", route.allow);
  return response;
}

// ---- ParseHttpRequest -----------------------------------------------------------------------------------

namespace {

absl::StatusOr<HttpRequest> ParseHttpRequestOrThrow(absl::string_view bytes, const HttpServerOptions& limits) {
  RequestParser parser;
  ConfigureParser(parser, limits.max_header_bytes, limits.max_body_bytes);
  const absl::Status incomplete = absl::InvalidArgumentError("incomplete request");
  beast::error_code error;
  size_t offset = 0;
  // The head, without eager parsing, so that `offset` ends up at its end.
  while (!parser.is_header_done()) {
    const absl::string_view rest = bytes.substr(offset);
    const size_t used = parser.put(net::const_buffer(rest.data(), rest.size()), error);
    offset += used;
    if (error == bhttp::error::need_more) {
      if (used == 0) return incomplete;  // every byte was offered: the head does not end
      continue;
    }
    if (error) return RejectionStatus(RejectionForParseError(error, StartLineParsed(parser), bytes.substr(offset)));
    if (used == 0 && !parser.is_header_done()) return absl::InvalidArgumentError("malformed request");
  }
  if (offset > limits.max_header_bytes) {
    return RejectionStatus(Rejection{431, "request header fields too large"});
  }
  if (std::optional<Rejection> rejection = CheckRequestHead(parser)) return RejectionStatus(*rejection);
  HttpRequest request = RequestFromHead(parser.get());
  parser.eager(true);
  while (!parser.is_done()) {
    const absl::string_view rest = bytes.substr(offset);
    if (rest.empty()) return incomplete;
    const size_t used = parser.put(net::const_buffer(rest.data(), rest.size()), error);
    offset += used;
    if (error == bhttp::error::need_more) {
      if (used == 0) return incomplete;
      continue;
    }
    if (error) return RejectionStatus(RejectionForParseError(error, /*start_line_parsed=*/true, bytes.substr(offset)));
    if (used == 0 && !parser.is_done()) return absl::InvalidArgumentError("malformed request");
  }
  request.body = std::move(parser.get().body());
  return request;
}

}  // namespace

absl::StatusOr<HttpRequest> ParseHttpRequest(absl::string_view bytes, const HttpServerOptions& limits) {
  try {
    return ParseHttpRequestOrThrow(bytes, limits);
  } catch (const std::length_error&) {  // Beast: a field of 64 KiB or more (limits above the server's)
    return RejectionStatus(Rejection{431, "request header field too large"});
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory");
  }
}

// ---- HttpServer ------------------------------------------------------------------------------------------

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options, HttpRouter router)
      : io_context_(options.threads),
        shared_(std::make_shared<ServerShared>(std::move(options), std::move(router), io_context_.get_executor())),
        acceptor_(io_context_),
        accept_retry_timer_(io_context_) {}

  ~Impl() { Stop(); }

  absl::Status Start() {
    absl::MutexLock lock(&lifecycle_mu_);
    if (state_ == State::kRunning) return absl::FailedPreconditionError("HttpServer::Start: already started");
    if (state_ == State::kStopped) return absl::FailedPreconditionError("HttpServer::Start: the server was stopped");
    const std::string& listen = shared_->options.listen;
    absl::StatusOr<ListenAddress> address = ParseListenAddress(listen);
    if (!address.ok()) return address.status();

    std::vector<tcp::endpoint> endpoints;
    beast::error_code error;
    const net::ip::address literal = net::ip::make_address(address->host, error);
    if (!error) {
      endpoints.emplace_back(literal, address->port);
    } else {
      tcp::resolver resolver(io_context_);
      const tcp::resolver::results_type results = resolver.resolve(
          address->host, std::to_string(address->port), tcp::resolver::passive | tcp::resolver::numeric_service, error);
      if (error) {
        return absl::UnavailableError(
            absl::StrCat("HTTP listen address ", listen, ": cannot resolve the host (", error.message(), ")"));
      }
      for (const auto& entry : results) endpoints.push_back(entry.endpoint());
      if (endpoints.empty()) {
        return absl::UnavailableError(absl::StrCat("HTTP listen address ", listen, ": the host has no address"));
      }
    }
    beast::error_code bind_error;
    for (const tcp::endpoint& endpoint : endpoints) {
      bind_error = Listen(endpoint);
      if (!bind_error) break;
    }
    if (bind_error) return BindErrorStatus(listen, bind_error);
    port_.store(acceptor_.local_endpoint(error).port(), std::memory_order_release);

    work_.emplace(io_context_.get_executor());
    DoAccept();
    for (int i = 0; i < shared_->options.threads; ++i) threads_.emplace_back([this] { RunIoThread(); });
    state_ = State::kRunning;
    return absl::OkStatus();
  }

  int port() const { return port_.load(std::memory_order_acquire); }

  void Stop() {
    shared_->stopping.store(true, std::memory_order_release);
    if (current_io_thread_owner == this) {
      // Inside a handler: joining would wait for this very thread. The io threads return once their
      // handlers do; the next Stop from outside (or the destructor) joins them and closes the rest.
      io_context_.stop();
      return;
    }
    absl::MutexLock lock(&lifecycle_mu_);
    if (state_ == State::kStopped && threads_.empty()) return;
    state_ = State::kStopped;
    work_.reset();
    io_context_.stop();
    for (std::thread& thread : threads_) thread.join();
    threads_.clear();
    {
      // From here on, streamed responses' calls from other threads post nothing (this io_context
      // may be destroyed soon); what they posted before is drained below.
      absl::MutexLock gate(&shared_->post_mu);
      shared_->accepting_posts = false;
    }

    // No io thread runs from here on: the sockets may be closed from this thread.
    beast::error_code ignored;
    acceptor_.close(ignored);
    accept_retry_timer_.cancel();
    std::vector<std::shared_ptr<Connection>> live;
    {
      absl::MutexLock connections_lock(&shared_->mu);
      for (const auto& [id, connection] : shared_->connections) {
        if (std::shared_ptr<Connection> alive = connection.lock()) live.push_back(std::move(alive));
      }
    }
    for (const std::shared_ptr<Connection>& connection : live) connection->CloseFromStop();
    live.clear();
    // Run the cancelled operations' handlers (each sees `stopping` and returns), which releases the
    // connections; streamed responses end here, running their callbacks on this thread (which
    // counts as an io thread meanwhile, so that a callback calling Stop does not deadlock). Every
    // operation was cancelled, so this ends; the bound is a safety net.
    const void* const previous_owner = current_io_thread_owner;
    current_io_thread_owner = this;
    for (int round = 0; round < 1000; ++round) {
      size_t ran = 0;
      io_context_.restart();  // also after a callback's Stop stopped it
      try {
        ran = io_context_.poll();
      } catch (...) {
        ran = 1;  // a handler threw; keep draining
      }
      if (ran == 0) break;
    }
    current_io_thread_owner = previous_owner;
  }

  HttpServerStats stats() const {
    HttpServerStats stats;
    const ServerShared& s = *shared_;
    stats.connections_accepted = s.connections_accepted.load(std::memory_order_relaxed);
    stats.connections_refused = s.connections_refused.load(std::memory_order_relaxed);
    stats.connections_timed_out = s.connections_timed_out.load(std::memory_order_relaxed);
    stats.requests = s.requests.load(std::memory_order_relaxed);
    stats.responses_2xx = s.responses_2xx.load(std::memory_order_relaxed);
    stats.responses_4xx = s.responses_4xx.load(std::memory_order_relaxed);
    stats.responses_5xx = s.responses_5xx.load(std::memory_order_relaxed);
    stats.malformed_requests = s.malformed_requests.load(std::memory_order_relaxed);
    stats.oversized_requests = s.oversized_requests.load(std::memory_order_relaxed);
    stats.open_connections = s.open_connections.load(std::memory_order_relaxed);
    stats.open_streams = s.open_streams.load(std::memory_order_relaxed);
    return stats;
  }

 private:
  enum class State { kCreated, kRunning, kStopped };

  beast::error_code Listen(const tcp::endpoint& endpoint) {
    beast::error_code error;
    if (acceptor_.is_open()) acceptor_.close(error);
    acceptor_.open(endpoint.protocol(), error);
    if (error) return error;
    // Lets a restarted daemon bind while old connections linger in TIME_WAIT; on Linux it does not
    // allow two listeners on one port.
    acceptor_.set_option(net::socket_base::reuse_address(true), error);
    if (!error) acceptor_.bind(endpoint, error);
    if (!error) acceptor_.listen(net::socket_base::max_listen_connections, error);
    if (error) {
      beast::error_code ignored;
      acceptor_.close(ignored);
    }
    return error;
  }

  static absl::Status BindErrorStatus(const std::string& listen, const beast::error_code& error) {
    if (error == net::error::address_in_use) {
      return absl::UnavailableError(absl::StrCat("HTTP listen address ", listen, " is already in use"));
    }
    if (error == boost::system::errc::address_not_available) {
      return absl::UnavailableError(absl::StrCat("HTTP listen address ", listen, " is not an address of this machine"));
    }
    if (error == net::error::access_denied) {
      return absl::UnavailableError(
          absl::StrCat("HTTP listen address ", listen, ": permission denied (ports below 1024 need privileges)"));
    }
    return absl::UnavailableError(absl::StrCat("cannot listen on HTTP address ", listen, ": ", error.message()));
  }

  void RunIoThread() {
    current_io_thread_owner = this;
    for (;;) {
      try {
        io_context_.run();
        break;
      } catch (...) {
        // A completion handler threw (only allocation failures can): the connection it belonged to
        // is released with it; the others keep being served.
      }
    }
    current_io_thread_owner = nullptr;
  }

  // The accept chain: one accept outstanding at a time, so the acceptor and its retry timer are
  // only ever used by one handler at a time.
  void DoAccept() {
    acceptor_.async_accept(net::make_strand(io_context_), beast::bind_front_handler(&Impl::OnAccept, this));
  }

  void OnAccept(beast::error_code error, tcp::socket socket) {
    if (shared_->Stopping() || error == net::error::operation_aborted) return;
    if (error) {
      if (error == net::error::no_descriptors || error == net::error::no_buffer_space ||
          error == net::error::no_memory) {
        // Retrying at once would spin while the process is out of descriptors.
        accept_retry_timer_.expires_after(kAcceptRetryDelay);
        accept_retry_timer_.async_wait([this](beast::error_code wait_error) {
          if (!wait_error && !shared_->Stopping()) DoAccept();
        });
        return;
      }
      return DoAccept();  // e.g. the peer reset before accept: try the next one
    }
    try {
      if (shared_->open_connections.load(std::memory_order_relaxed) >= shared_->options.max_connections) {
        shared_->connections_refused.fetch_add(1, std::memory_order_relaxed);
        if (shared_->refusals_in_flight.load(std::memory_order_relaxed) < kMaxRefusalsInFlight) {
          std::make_shared<Connection>(std::move(socket), shared_, Connection::Mode::kRefuse)->Start();
        } else {
          beast::error_code ignored;
          socket.close(ignored);
        }
      } else {
        shared_->connections_accepted.fetch_add(1, std::memory_order_relaxed);
        std::make_shared<Connection>(std::move(socket), shared_, Connection::Mode::kServe)->Start();
      }
    } catch (...) {
      // Out of memory for this connection: it is dropped (its socket closes with it).
    }
    DoAccept();
  }

  // Declared first so that it is destroyed last: sockets and timers below, and connections owned
  // by its pending handlers, must go before it.
  net::io_context io_context_;
  const std::shared_ptr<ServerShared> shared_;
  tcp::acceptor acceptor_;
  net::steady_timer accept_retry_timer_;
  std::atomic<int> port_{0};

  absl::Mutex lifecycle_mu_;
  State state_ ABSL_GUARDED_BY(lifecycle_mu_) = State::kCreated;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(lifecycle_mu_);
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work_ ABSL_GUARDED_BY(lifecycle_mu_);
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Create(HttpServerOptions options, HttpRouter router) {
  if (absl::Status valid = ValidateHttpServerOptions(options); !valid.ok()) return valid;
  return std::unique_ptr<HttpServer>(new HttpServer(std::make_unique<Impl>(std::move(options), std::move(router))));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() = default;

absl::Status HttpServer::Start() { return impl_->Start(); }

int HttpServer::port() const { return impl_->port(); }

void HttpServer::Stop() { impl_->Stop(); }

HttpServerStats HttpServer::stats() const { return impl_->stats(); }

}  // namespace eldr::http
