#include "eldr/http/http_client.h"

#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iterator>
#include <limits>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace eldr::http {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = net::ip::tcp;
using SteadyClock = std::chrono::steady_clock;
using ResponseParser = bhttp::response_parser<bhttp::buffer_body>;

constexpr int kMaxThreads = 256;
constexpr int kMaxIdlePerOrigin = 100000;
constexpr size_t kMinHeaderBytes = 64;
constexpr size_t kMaxHeaderBytes = 1 << 20;
constexpr uint64_t kMaxBodyBytes = uint64_t{64} << 30;

// Reads start small (a server-sent event is a few hundred bytes, and thousands of streams may be
// open at once) and double while reads fill them, up to kMaxReadBytes (bulk bodies).
constexpr size_t kMinReadBytes = 4 * 1024;
constexpr size_t kMaxReadBytes = 64 * 1024;
// Body pieces are de-chunked into a per-thread scratch buffer of this size (see IoWorker::scratch):
// one piece is at most this long.
constexpr size_t kScratchBytes = 64 * 1024;
// The read buffer may hold the whole head plus this much: chunk-size lines and a chunked body's
// trailer (which Beast does not bound) longer than it fail the call instead of growing the buffer.
constexpr size_t kReadBufferSlack = 64 * 1024;
// Interim (1xx) responses skipped before a final one, at most.
constexpr int kMaxInterimResponses = 32;
// Durations beyond this are treated as infinite (steady_clock arithmetic must not overflow).
constexpr absl::Duration kForever = absl::Hours(24 * 365 * 100);

constexpr SteadyClock::time_point kNever = SteadyClock::time_point::max();

// Which call a thread's code runs for: FetchAndWait refuses to block an io thread of its client.
thread_local const void* current_io_client = nullptr;

bool IsTokenChar(char c) {
  if (absl::ascii_isalnum(static_cast<unsigned char>(c))) return true;
  return absl::string_view("!#$%&'*+-.^_`|~").find(c) != absl::string_view::npos;
}

bool IsToken(absl::string_view text) { return !text.empty() && std::all_of(text.begin(), text.end(), IsTokenChar); }

bool IsSendableFieldValue(absl::string_view value) {
  return value.find_first_of(absl::string_view("\r\n\0", 3)) == absl::string_view::npos;
}

bool IsOriginFormTarget(absl::string_view target) {
  if (target.empty() || target.front() != '/') return false;
  return std::all_of(target.begin(), target.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return byte > 0x20 && byte < 0x7f && byte != '#';
  });
}

bool IsHostNameChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
}

// The client sends these itself (Transfer-Encoding too: the body always goes with Content-Length,
// and a second framing field would make the request ambiguous).
bool IsClientOwnedField(absl::string_view name) {
  return absl::EqualsIgnoreCase(name, "host") || absl::EqualsIgnoreCase(name, "content-length") ||
         absl::EqualsIgnoreCase(name, "connection") || absl::EqualsIgnoreCase(name, "transfer-encoding");
}

absl::Status CheckTimeout(absl::Duration timeout, absl::string_view name) {
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientRequest.", name, " must be > 0 (InfiniteDuration disables it), got ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const ClientRequest& request) {
  if (!IsToken(request.method)) {
    return absl::InvalidArgumentError("ClientRequest.method must be an HTTP token (e.g. GET, POST)");
  }
  if (request.host.empty()) return absl::InvalidArgumentError("ClientRequest.host is empty");
  if (request.host.find(':') != std::string::npos) {
    beast::error_code error;
    net::ip::make_address_v6(request.host, error);
    if (error) {
      return absl::InvalidArgumentError(
          "ClientRequest.host holds ':' but is not an IPv6 address (IPv6 goes without brackets)");
    }
  } else if (request.host.size() > 253 || !std::all_of(request.host.begin(), request.host.end(), IsHostNameChar)) {
    return absl::InvalidArgumentError("ClientRequest.host is not a host name or an IP address");
  }
  if (request.port < 1 || request.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("ClientRequest.port must be in [1, 65535], got ", request.port));
  }
  if (!IsOriginFormTarget(request.target) && !(request.target == "*" && request.method == "OPTIONS")) {
    return absl::InvalidArgumentError(
        "ClientRequest.target must be origin-form (\"/path?query\": visible ASCII, no '#'), or \"*\" with OPTIONS");
  }
  for (const auto& [name, value] : request.headers) {
    if (!IsToken(name)) {
      return absl::InvalidArgumentError("ClientRequest.headers holds a field name that is not an HTTP token");
    }
    if (!IsSendableFieldValue(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ClientRequest.headers: the value of field ", name, " holds CR, LF or NUL"));
    }
  }
  for (const auto& [timeout, name] :
       {std::pair{request.connect_timeout, "connect_timeout"},
        std::pair{request.first_byte_timeout, "first_byte_timeout"}, std::pair{request.idle_timeout, "idle_timeout"},
        std::pair{request.total_timeout, "total_timeout"}}) {
    if (absl::Status status = CheckTimeout(timeout, name); !status.ok()) return status;
  }
  return absl::OkStatus();
}

// `now + duration`, kNever for infinite or absurdly long durations.
SteadyClock::time_point DeadlineAfter(SteadyClock::time_point now, absl::Duration duration) {
  if (duration >= kForever) return kNever;
  return now + std::chrono::duration_cast<SteadyClock::duration>(absl::ToChronoNanoseconds(duration));
}

std::string Origin(const ClientRequest& request) { return absl::StrCat(request.host, ":", request.port); }

std::string HostField(const ClientRequest& request) {
  const bool v6 = request.host.find(':') != std::string::npos;
  std::string host = v6 ? absl::StrCat("[", request.host, "]") : request.host;
  if (request.port != 80) absl::StrAppend(&host, ":", request.port);
  return host;
}

// The request head on the wire (the body is written after it, as given).
std::string SerializeHead(const ClientRequest& request, bool keep_alive) {
  std::string head =
      absl::StrCat(request.method, " ", request.target, " HTTP/1.1\r\nHost: ", HostField(request), "\r\n");
  for (const auto& [name, value] : request.headers) {
    if (IsClientOwnedField(name)) continue;
    absl::StrAppend(&head, name, ": ", absl::StripAsciiWhitespace(value), "\r\n");
  }
  const bool wants_length = request.method == "POST" || request.method == "PUT" || request.method == "PATCH";
  if (!request.body.empty() || wants_length) absl::StrAppend(&head, "Content-Length: ", request.body.size(), "\r\n");
  if (!keep_alive) absl::StrAppend(&head, "Connection: close\r\n");
  head += "\r\n";
  return head;
}

// The connection went away under the request (the server closed or reset it).
bool IsConnectionLoss(const beast::error_code& error) {
  return error == net::error::eof || error == net::error::connection_reset || error == net::error::broken_pipe ||
         error == net::error::connection_aborted || error == net::error::not_connected;
}

std::string Describe(const beast::error_code& error) {
  return error == net::error::eof ? std::string("the server closed the connection") : error.message();
}

absl::string_view View(beast::string_view text) { return absl::string_view(text.data(), text.size()); }

class ClientImpl;

// ---- Connections -----------------------------------------------------------------------------------

// One TCP connection. Owned by the call that uses it, or by its worker's idle pool in between.
struct Connection {
  explicit Connection(net::io_context& context) : socket(context), idle_timer(context) {}

  tcp::socket socket;
  net::steady_timer idle_timer;  // closes it after idle_connection_timeout in the pool
  std::string origin;
  // While pooled: its place in the pool, and an epoch that the pool's watchers compare to tell
  // whether the connection is still the idle one they watch.
  bool pooled = false;
  uint64_t idle_epoch = 0;
  std::list<std::shared_ptr<Connection>>::iterator position;
};

void CloseSocket(tcp::socket& socket) {
  beast::error_code ignored;
  if (socket.is_open()) socket.close(ignored);
}

class CallImpl;

// One io thread: its io_context, its idle connections, the calls running on it. Everything here
// but the constructor's arguments is touched only by that thread.
//
// Why one io_context per thread rather than one shared by all: a call, its connection and its
// timers then live on one thread, so a call's steps and callbacks are serialised without strands
// or locks on the hot path, and each thread polls its own descriptors (no contention on one
// reactor). Calls are spread round-robin; a call to an origin prefers a thread that holds an idle
// connection to it (ClientImpl::PickWorker), so keep-alive reuse works across threads.
struct IoWorker {
  IoWorker(ClientImpl* client_in, int index_in)
      : client(client_in),
        index(index_in),
        work(net::make_work_guard(context)),
        scratch(std::make_unique<char[]>(kScratchBytes)) {}

  // Takes the most recently pooled live connection to `origin`, or nullptr.
  std::shared_ptr<Connection> TakeIdle(const std::string& origin);
  // Pools `connection` (idle, fully read) unless the pool is full or the client stops; closes it then.
  void ReturnIdle(std::shared_ptr<Connection> connection);
  // Removes a pooled connection from the pool (does not close it).
  void RemoveIdle(const std::shared_ptr<Connection>& connection);
  // Closes every idle connection and cancels every call (the client is being destroyed).
  void CancelEverything();

  ClientImpl* const client;
  const int index;
  net::io_context context;
  net::executor_work_guard<net::io_context::executor_type> work;
  std::thread thread;
  // Body pieces are de-chunked here and handed to on_body before the next parse: one buffer per
  // thread instead of one per call keeps thousands of open streams cheap.
  std::unique_ptr<char[]> scratch;
  std::unordered_map<std::string, std::list<std::shared_ptr<Connection>>> idle;
  std::unordered_set<CallImpl*> calls;
};

// ---- The client --------------------------------------------------------------------------------------

class ClientImpl final : public HttpClient {
 public:
  explicit ClientImpl(HttpClientOptions options);
  ~ClientImpl() override;

  std::shared_ptr<ClientCall> Start(ClientRequest request, ClientCallbacks callbacks) override;
  int64_t active_calls() const override { return active_calls_.load(std::memory_order_relaxed); }
  int64_t idle_connections() const override { return idle_connections_.load(std::memory_order_relaxed); }

  const HttpClientOptions& options() const { return options_; }
  bool stopping() const { return stopping_.load(std::memory_order_acquire); }
  void CallEnded() { active_calls_.fetch_sub(1, std::memory_order_relaxed); }

  // The idle-connection count of each origin over all threads (max_idle_per_origin is a limit for
  // the whole client), and which threads hold them.
  bool ReserveIdleSlot(const std::string& origin, int worker);
  void ReleaseIdleSlot(const std::string& origin, int worker);

 private:
  struct OriginIdle {
    int64_t total = 0;
    std::vector<int32_t> per_worker;
  };

  IoWorker* PickWorker(const std::string& origin);

  const HttpClientOptions options_;
  std::vector<std::shared_ptr<IoWorker>> workers_;
  std::atomic<uint64_t> next_worker_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> active_calls_{0};
  std::atomic<int64_t> idle_connections_{0};

  absl::Mutex idle_mu_;
  std::unordered_map<std::string, OriginIdle> idle_by_origin_ ABSL_GUARDED_BY(idle_mu_);
};

// ---- A call ------------------------------------------------------------------------------------------

class CallImpl final : public ClientCall, public std::enable_shared_from_this<CallImpl> {
 public:
  CallImpl(ClientImpl* client, std::shared_ptr<IoWorker> worker, ClientRequest request, ClientCallbacks callbacks)
      : client_(client),
        worker_(std::move(worker)),
        request_(std::move(request)),
        callbacks_(std::move(callbacks)),
        origin_(Origin(request_)),
        timer_(worker_->context),
        buffer_(client_->options().max_response_header_bytes + kReadBufferSlack) {}

  void Cancel() override {
    if (done_.load(std::memory_order_acquire)) return;
    if (worker_->context.get_executor().running_in_this_thread()) {
      CancelOnThread();
      return;
    }
    net::post(worker_->context, [self = shared_from_this()] { self->CancelOnThread(); });
  }

  // On the worker's thread: registers the call and starts its coroutine.
  void Begin() {
    worker_->calls.insert(this);
    if (client_->stopping()) cancelled_ = true;
    net::co_spawn(worker_->context, Run(shared_from_this()), net::detached);
  }

  void CancelOnThread() {
    if (ended_ || cancelled_) return;
    cancelled_ = true;
    Interrupt();
  }

 private:
  static net::awaitable<void> Run(std::shared_ptr<CallImpl> self);
  net::awaitable<absl::Status> Execute();
  net::awaitable<absl::Status> Connect();
  // One exchange on connection_. Sets *stale when the connection was a reused one that failed
  // before any byte of the response (the request was never processed: retry on a new one).
  net::awaitable<absl::Status> Exchange(bool reused, bool* stale);
  void Finish(absl::Status status);

  // CANCELLED or DEADLINE_EXCEEDED when Cancel or a deadline interrupted the call, else OK.
  absl::Status Interruption() const;
  // Stops whatever the call waits for (resolve, connect, write, read); the coroutine then sees
  // Interruption().
  void Interrupt() {
    if (resolver_) resolver_->cancel();
    if (resolve_signal_) resolve_signal_->cancel();
    if (connection_) CloseSocket(connection_->socket);
  }

  // Deadlines: one timer for the earliest of the total deadline and the current phase's deadline.
  // Pushing a deadline later (idle_timeout after each piece) does not touch the timer: when it fires
  // it re-reads the deadlines and waits again if none has passed.
  void SetPhaseDeadline(SteadyClock::time_point deadline, const char* name) {
    phase_deadline_ = deadline;
    phase_name_ = name;
    ArmTimer();
  }
  void ArmTimer();
  void OnTimer(const beast::error_code& error);
  void Expire(std::string what) {
    if (ended_ || !expired_.empty()) return;
    expired_ = std::move(what);
    Interrupt();
  }

  absl::Status DeliverHead(const ResponseParser& parser);
  std::string Context() const {
    return absl::StrCat(request_.method, " http://", HostField(request_), request_.target);
  }

  ClientImpl* const client_;
  const std::shared_ptr<IoWorker> worker_;
  const ClientRequest request_;
  ClientCallbacks callbacks_;
  const std::string origin_;

  // Everything below is touched only on the worker's thread.
  std::atomic<bool> done_{false};  // also read by Cancel from any thread
  bool ended_ = false;
  bool cancelled_ = false;
  std::string expired_;  // the deadline that passed, with its value, for the message
  ClientResult result_;

  net::steady_timer timer_;
  bool timer_armed_ = false;
  SteadyClock::time_point timer_target_ = kNever;
  SteadyClock::time_point total_deadline_ = kNever;
  SteadyClock::time_point phase_deadline_ = kNever;
  const char* phase_name_ = "";

  std::shared_ptr<tcp::resolver> resolver_;
  std::optional<net::steady_timer> resolve_signal_;  // see Connect
  uint64_t resolve_generation_ = 0;
  std::shared_ptr<Connection> connection_;
  beast::flat_buffer buffer_;
  size_t read_bytes_ = kMinReadBytes;
};

void CallImpl::ArmTimer() {
  const SteadyClock::time_point next = std::min(total_deadline_, phase_deadline_);
  if (next == kNever || ended_) return;
  if (timer_armed_ && timer_target_ <= next) return;
  timer_armed_ = true;
  timer_target_ = next;
  timer_.expires_at(next);
  timer_.async_wait([self = shared_from_this()](const beast::error_code& error) { self->OnTimer(error); });
}

void CallImpl::OnTimer(const beast::error_code& error) {
  if (error == net::error::operation_aborted || ended_) return;
  timer_armed_ = false;
  const SteadyClock::time_point now = SteadyClock::now();
  if (now >= total_deadline_) {
    Expire(absl::StrCat("total_timeout (", absl::FormatDuration(request_.total_timeout), ")"));
  } else if (now >= phase_deadline_) {
    absl::Duration value = absl::ZeroDuration();
    const absl::string_view name = phase_name_;
    if (name == "connect_timeout") value = request_.connect_timeout;
    if (name == "first_byte_timeout") value = request_.first_byte_timeout;
    if (name == "idle_timeout") value = request_.idle_timeout;
    Expire(absl::StrCat(name, " (", absl::FormatDuration(value), ")"));
  } else {
    ArmTimer();
  }
}

absl::Status CallImpl::Interruption() const {
  if (cancelled_) return absl::CancelledError(absl::StrCat("HTTP call cancelled: ", Context()));
  if (!expired_.empty()) {
    return absl::DeadlineExceededError(absl::StrCat("HTTP call deadline passed: ", expired_, ": ", Context()));
  }
  return absl::OkStatus();
}

net::awaitable<void> CallImpl::Run(std::shared_ptr<CallImpl> self) {
  absl::Status status;
  try {
    status = co_await self->Execute();
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("HTTP call failed unexpectedly (", e.what(), "): ", self->Context()));
  } catch (...) {
    status = absl::InternalError(absl::StrCat("HTTP call failed unexpectedly: ", self->Context()));
  }
  self->Finish(std::move(status));
}

net::awaitable<absl::Status> CallImpl::Execute() {
  if (absl::Status status = Interruption(); !status.ok()) co_return status;
  if (absl::Status status = ValidateRequest(request_); !status.ok()) co_return status;
  total_deadline_ = DeadlineAfter(SteadyClock::now(), request_.total_timeout);
  ArmTimer();
  for (int attempt = 0;; ++attempt) {
    // The retry after a stale pooled connection always opens a new one.
    if (attempt == 0) connection_ = worker_->TakeIdle(origin_);
    const bool reused = connection_ != nullptr;
    result_.connection_reused = reused;
    if (!reused) {
      absl::Status status = co_await Connect();
      if (!status.ok()) co_return status;
    }
    bool stale = false;
    absl::Status status = co_await Exchange(reused, &stale);
    if (stale && attempt == 0) {
      CloseSocket(connection_->socket);
      connection_.reset();
      buffer_.clear();
      continue;
    }
    co_return status;
  }
}

net::awaitable<absl::Status> CallImpl::Connect() {
  SetPhaseDeadline(DeadlineAfter(SteadyClock::now(), request_.connect_timeout), "connect_timeout");
  connection_ = std::make_shared<Connection>(worker_->context);
  connection_->origin = origin_;
  beast::error_code error;
  std::vector<tcp::endpoint> endpoints;
  const net::ip::address literal = net::ip::make_address(request_.host, error);
  if (!error) {
    endpoints.emplace_back(literal, static_cast<uint16_t>(request_.port));
  } else {
    // The lookup runs on asio's resolver thread and cannot be interrupted there (getaddrinfo), so
    // the call waits on a signal timer instead: the lookup's handler fires it, and so do Cancel
    // and the deadlines, which then end the call at once while the lookup finishes on its own.
    struct Lookup {
      bool done = false;
      beast::error_code error;
      tcp::resolver::results_type results;
    };
    auto lookup = std::make_shared<Lookup>();
    resolver_ = std::make_shared<tcp::resolver>(worker_->context);
    resolve_signal_.emplace(worker_->context, kNever);
    const uint64_t generation = ++resolve_generation_;
    resolver_->async_resolve(request_.host, std::to_string(request_.port), tcp::resolver::numeric_service,
                             [self = shared_from_this(), resolver = resolver_, lookup, generation](
                                 const beast::error_code& lookup_error, tcp::resolver::results_type results) {
                               lookup->done = true;
                               lookup->error = lookup_error;
                               lookup->results = std::move(results);
                               if (self->resolve_generation_ == generation && self->resolve_signal_)
                                 self->resolve_signal_->cancel();
                             });
    beast::error_code ignored;
    co_await resolve_signal_->async_wait(net::redirect_error(net::use_awaitable, ignored));
    resolve_signal_.reset();
    resolver_.reset();
    if (absl::Status status = Interruption(); !status.ok()) co_return status;
    if (!lookup->done) co_return absl::InternalError(absl::StrCat("resolving ", request_.host, ": interrupted"));
    const tcp::resolver::results_type& results = lookup->results;
    error = lookup->error;
    if (error) {
      co_return absl::UnavailableError(absl::StrCat("resolving ", request_.host, ": ", error.message()));
    }
    for (const auto& entry : results) endpoints.push_back(entry.endpoint());
    if (endpoints.empty()) {
      co_return absl::UnavailableError(absl::StrCat("resolving ", request_.host, ": no address"));
    }
  }
  std::string failures;
  for (const tcp::endpoint& endpoint : endpoints) {
    error = {};
    connection_->socket.open(endpoint.protocol(), error);
    if (!error) {
      co_await connection_->socket.async_connect(endpoint, net::redirect_error(net::use_awaitable, error));
    }
    if (absl::Status status = Interruption(); !status.ok()) co_return status;
    if (!error) {
      beast::error_code ignored;
      connection_->socket.set_option(tcp::no_delay(true), ignored);
      SetPhaseDeadline(kNever, "");
      co_return absl::OkStatus();
    }
    CloseSocket(connection_->socket);
    const std::string address = endpoint.address().is_v6() ? absl::StrCat("[", endpoint.address().to_string(), "]")
                                                           : endpoint.address().to_string();
    if (endpoints.size() == 1) {
      failures = error.message();
    } else {
      absl::StrAppend(&failures, failures.empty() ? "" : "; ", address, ":", endpoint.port(), ": ", error.message());
    }
  }
  co_return absl::UnavailableError(absl::StrCat("connecting to ", origin_, ": ", failures));
}

absl::Status CallImpl::DeliverHead(const ResponseParser& parser) {
  const auto& message = parser.get();
  ClientResponseHead head;
  head.status = static_cast<int>(message.result_int());
  head.version = static_cast<int>(message.version());
  if (head.version != 10 && head.version != 11) {
    return absl::InternalError(absl::StrCat("malformed response: HTTP version ", head.version / 10, ".",
                                            head.version % 10, " is not 1.0 or 1.1: ", Context()));
  }
  head.headers.reserve(std::distance(message.begin(), message.end()));
  for (const auto& field : message) {
    head.headers.emplace_back(std::string(View(field.name_string())),
                              std::string(absl::StripAsciiWhitespace(View(field.value()))));
  }
  result_.head_received = true;
  if (callbacks_.on_head) callbacks_.on_head(head);
  return absl::OkStatus();
}

net::awaitable<absl::Status> CallImpl::Exchange(bool reused, bool* stale) {
  const HttpClientOptions& options = client_->options();
  tcp::socket& socket = connection_->socket;
  beast::error_code error;

  // Write phase: bounded by the total deadline only.
  SetPhaseDeadline(kNever, "");
  const std::string head = SerializeHead(request_, options.max_idle_per_origin > 0);
  const std::array<net::const_buffer, 2> request_buffers = {net::buffer(head), net::buffer(request_.body)};
  co_await net::async_write(socket, request_buffers, net::redirect_error(net::use_awaitable, error));
  if (absl::Status status = Interruption(); !status.ok()) co_return status;
  if (error) {
    *stale = reused && IsConnectionLoss(error);
    co_return absl::UnavailableError(absl::StrCat("writing the request failed (", Describe(error), "): ", Context()));
  }

  SetPhaseDeadline(DeadlineAfter(SteadyClock::now(), request_.first_byte_timeout), "first_byte_timeout");
  auto configure = [&](ResponseParser& parser) {
    parser.header_limit(static_cast<std::uint32_t>(options.max_response_header_bytes));
    parser.body_limit(options.max_response_body_bytes);
    parser.eager(true);
    if (request_.method == "HEAD") parser.skip(true);
  };
  std::optional<ResponseParser> parser;
  parser.emplace();
  configure(*parser);
  int interim_responses = 0;
  bool head_delivered = false;
  bool any_byte = false;
  char* const scratch = worker_->scratch.get();

  for (;;) {
    // Parse what is buffered, handing out each piece of body as it is de-chunked.
    while (buffer_.size() > 0 && !parser->is_done()) {
      auto& body = parser->get().body();
      body.data = scratch;
      body.size = kScratchBytes;
      error = {};
      size_t used = 0;
      try {
        used = parser->put(buffer_.data(), error);
      } catch (const std::exception& e) {
        // Beast throws for a field longer than it can store (64 KiB).
        co_return absl::InternalError(absl::StrCat("malformed response (", e.what(), "): ", Context()));
      }
      buffer_.consume(used);
      if (error == bhttp::error::header_limit) {
        co_return absl::InternalError(absl::StrCat("response head exceeds max_response_header_bytes (",
                                                   options.max_response_header_bytes, "): ", Context()));
      }
      if (!head_delivered && parser->is_header_done()) {
        const int status = static_cast<int>(parser->get().result_int());
        if (status / 100 == 1 && status != 101 && !error) {
          // An interim response: skip it, the final one follows on the same connection.
          if (++interim_responses > kMaxInterimResponses) {
            co_return absl::InternalError(absl::StrCat("malformed response: more than ", kMaxInterimResponses,
                                                       " interim (1xx) responses: ", Context()));
          }
          parser.emplace();
          configure(*parser);
          continue;
        }
        if (absl::Status status = DeliverHead(*parser); !status.ok()) co_return status;
        head_delivered = true;
        if (absl::Status status = Interruption(); !status.ok()) co_return status;
        // Beast reports a Content-Length above the body limit only when the body is not in the
        // same buffer as the head (its eager parse overwrites the error), so check it here, before
        // any of that body is handed out.
        const boost::optional<std::uint64_t> length = parser->content_length();
        const bool has_body = request_.method != "HEAD" && status != 204 && status != 304 && status / 100 != 1;
        if (has_body && length && *length > options.max_response_body_bytes) {
          co_return absl::InternalError(absl::StrCat("response body exceeds max_response_body_bytes (",
                                                     options.max_response_body_bytes, "): ", Context()));
        }
        SetPhaseDeadline(DeadlineAfter(SteadyClock::now(), request_.idle_timeout), "idle_timeout");
      }
      const size_t piece = kScratchBytes - parser->get().body().size;
      if (piece > 0) {
        result_.body_bytes += piece;
        if (callbacks_.on_body) callbacks_.on_body(absl::string_view(scratch, piece));
        if (absl::Status status = Interruption(); !status.ok()) co_return status;
        phase_deadline_ = DeadlineAfter(SteadyClock::now(), request_.idle_timeout);
        ArmTimer();
      }
      if (error == bhttp::error::need_buffer) continue;
      if (error == bhttp::error::need_more) break;
      if (error == bhttp::error::body_limit) {
        co_return absl::InternalError(absl::StrCat("response body exceeds max_response_body_bytes (",
                                                   options.max_response_body_bytes, "): ", Context()));
      }
      if (error) {
        co_return absl::InternalError(absl::StrCat("malformed response (", error.message(), "): ", Context()));
      }
      if (used == 0) break;
    }

    if (parser->is_done()) {
      const auto& message = parser->get();
      const bool reusable = message.result_int() != 101 && message.keep_alive() && !parser->need_eof() &&
                            buffer_.size() == 0 && options.max_idle_per_origin > 0;
      if (reusable) {
        worker_->ReturnIdle(std::move(connection_));
        connection_.reset();
      }
      co_return absl::OkStatus();
    }

    // Read more.
    const size_t room = buffer_.max_size() - buffer_.size();
    if (room == 0) {
      co_return absl::InternalError(absl::StrCat(head_delivered
                                                     ? "malformed response: a chunk header or the trailer is too long"
                                                     : "response head exceeds max_response_header_bytes",
                                                 " (", options.max_response_header_bytes, "): ", Context()));
    }
    const size_t want = std::min(read_bytes_, room);
    error = {};
    const size_t got =
        co_await socket.async_read_some(buffer_.prepare(want), net::redirect_error(net::use_awaitable, error));
    if (absl::Status status = Interruption(); !status.ok()) co_return status;
    if (error == net::error::eof && parser->got_some()) {
      // The end of a body delimited by the connection's close, or a truncated response.
      parser->put_eof(error);
      if (!error) {
        if (!head_delivered) {
          if (absl::Status status = DeliverHead(*parser); !status.ok()) co_return status;
        }
        co_return absl::OkStatus();
      }
      if (!parser->is_header_done()) {
        co_return absl::UnavailableError(
            absl::StrCat("the server closed the connection in the middle of the response head: ", Context()));
      }
      co_return absl::InternalError(
          absl::StrCat("the server closed the connection in the middle of the response body: ", Context()));
    }
    if (error) {
      if (!head_delivered) {
        *stale = reused && !any_byte && IsConnectionLoss(error);
        co_return absl::UnavailableError(
            absl::StrCat("the connection failed before the response head (", Describe(error), "): ", Context()));
      }
      co_return absl::InternalError(absl::StrCat("the connection failed in the middle of the response body (",
                                                 Describe(error), "): ", Context()));
    }
    buffer_.commit(got);
    any_byte = any_byte || got > 0;
    if (got == want && read_bytes_ < kMaxReadBytes) read_bytes_ *= 2;
  }
}

void CallImpl::Finish(absl::Status status) {
  ended_ = true;
  timer_armed_ = false;
  timer_.cancel();
  resolver_.reset();
  resolve_signal_.reset();
  if (connection_) {
    CloseSocket(connection_->socket);
    connection_.reset();
  }
  buffer_ = beast::flat_buffer(0);
  worker_->calls.erase(this);
  result_.status = std::move(status);
  done_.store(true, std::memory_order_release);
  client_->CallEnded();
  // The callbacks go once the call ended (they may hold the call itself, e.g. Fetch's state).
  ClientCallbacks callbacks = std::move(callbacks_);
  callbacks_ = {};
  if (callbacks.on_done) {
    try {
      callbacks.on_done(result_);
    } catch (...) {
      // Nothing to report it to: the call is over, and an io thread must not unwind.
    }
  }
}

// ---- IoWorker ----------------------------------------------------------------------------------------

// Whether a pooled socket still looks usable: no end-of-stream or unsolicited bytes have arrived.
bool LooksAlive(tcp::socket& socket) {
  char byte;
  const ssize_t got = ::recv(socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

std::shared_ptr<Connection> IoWorker::TakeIdle(const std::string& origin) {
  const auto it = idle.find(origin);
  if (it == idle.end()) return nullptr;
  while (!it->second.empty()) {
    std::shared_ptr<Connection> connection = it->second.back();
    RemoveIdle(connection);
    if (connection->socket.is_open() && LooksAlive(connection->socket)) return connection;
    CloseSocket(connection->socket);
  }
  return nullptr;
}

void IoWorker::RemoveIdle(const std::shared_ptr<Connection>& connection) {
  if (!connection->pooled) return;
  connection->pooled = false;
  ++connection->idle_epoch;
  beast::error_code ignored;
  connection->socket.cancel(ignored);
  connection->idle_timer.cancel();
  const auto it = idle.find(connection->origin);
  it->second.erase(connection->position);
  if (it->second.empty()) idle.erase(it);
  client->ReleaseIdleSlot(connection->origin, index);
}

void IoWorker::ReturnIdle(std::shared_ptr<Connection> connection) {
  if (client->stopping() || !client->ReserveIdleSlot(connection->origin, index)) {
    CloseSocket(connection->socket);
    return;
  }
  std::list<std::shared_ptr<Connection>>& list = idle[connection->origin];
  list.push_back(connection);
  connection->position = std::prev(list.end());
  connection->pooled = true;
  const uint64_t epoch = ++connection->idle_epoch;
  auto drop = [this, connection, epoch](const beast::error_code&) {
    if (!connection->pooled || connection->idle_epoch != epoch) return;
    RemoveIdle(connection);
    CloseSocket(connection->socket);
  };
  // The server closing an idle connection (or sending unsolicited bytes) makes it readable: drop it.
  connection->socket.async_wait(tcp::socket::wait_read, drop);
  const absl::Duration timeout = client->options().idle_connection_timeout;
  if (timeout < kForever) {
    connection->idle_timer.expires_after(
        std::chrono::duration_cast<SteadyClock::duration>(absl::ToChronoNanoseconds(timeout)));
    connection->idle_timer.async_wait([drop](const beast::error_code& error) {
      if (error != net::error::operation_aborted) drop(error);
    });
  }
}

void IoWorker::CancelEverything() {
  while (!idle.empty()) {
    std::list<std::shared_ptr<Connection>>& list = idle.begin()->second;
    std::shared_ptr<Connection> connection = list.back();
    RemoveIdle(connection);
    CloseSocket(connection->socket);
  }
  // Cancelling does not end a call at once (its coroutine resumes later), so iterating is safe.
  for (CallImpl* call : calls) call->CancelOnThread();
}

// ---- ClientImpl --------------------------------------------------------------------------------------

ClientImpl::ClientImpl(HttpClientOptions options) : options_(std::move(options)) {
  workers_.reserve(options_.threads);
  for (int i = 0; i < options_.threads; ++i) workers_.push_back(std::make_shared<IoWorker>(this, i));
  for (const std::shared_ptr<IoWorker>& worker : workers_) {
    worker->thread = std::thread([this, context = &worker->context] {
      current_io_client = static_cast<const HttpClient*>(this);
      for (;;) {
        try {
          context->run();
          return;
        } catch (...) {
          // Every handler of this file catches its own failures; keep serving whatever else threw.
        }
      }
    });
  }
}

ClientImpl::~ClientImpl() {
  if (current_io_client == static_cast<const HttpClient*>(this)) {
    std::fprintf(stderr, "eldr::http::HttpClient destroyed on one of its own io threads (it would deadlock)\n");
    std::abort();
  }
  stopping_.store(true, std::memory_order_release);
  for (const std::shared_ptr<IoWorker>& worker : workers_) {
    net::post(worker->context, [worker = worker.get()] { worker->CancelEverything(); });
    worker->work.reset();
  }
  for (const std::shared_ptr<IoWorker>& worker : workers_) worker->thread.join();
}

IoWorker* ClientImpl::PickWorker(const std::string& origin) {
  if (workers_.size() == 1) return workers_[0].get();
  {
    absl::MutexLock lock(&idle_mu_);
    const auto it = idle_by_origin_.find(origin);
    if (it != idle_by_origin_.end()) {
      const std::vector<int32_t>& per_worker = it->second.per_worker;
      const size_t start = next_worker_.load(std::memory_order_relaxed) % per_worker.size();
      for (size_t i = 0; i < per_worker.size(); ++i) {
        const size_t candidate = (start + i) % per_worker.size();
        if (per_worker[candidate] > 0) return workers_[candidate].get();
      }
    }
  }
  return workers_[next_worker_.fetch_add(1, std::memory_order_relaxed) % workers_.size()].get();
}

bool ClientImpl::ReserveIdleSlot(const std::string& origin, int worker) {
  absl::MutexLock lock(&idle_mu_);
  OriginIdle& entry = idle_by_origin_[origin];
  if (entry.total >= options_.max_idle_per_origin) {
    if (entry.total == 0) idle_by_origin_.erase(origin);
    return false;
  }
  if (entry.per_worker.empty()) entry.per_worker.assign(workers_.size(), 0);
  ++entry.total;
  ++entry.per_worker[worker];
  idle_connections_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void ClientImpl::ReleaseIdleSlot(const std::string& origin, int worker) {
  absl::MutexLock lock(&idle_mu_);
  const auto it = idle_by_origin_.find(origin);
  if (it == idle_by_origin_.end()) return;
  --it->second.total;
  --it->second.per_worker[worker];
  idle_connections_.fetch_sub(1, std::memory_order_relaxed);
  if (it->second.total == 0) idle_by_origin_.erase(it);
}

std::shared_ptr<ClientCall> ClientImpl::Start(ClientRequest request, ClientCallbacks callbacks) {
  IoWorker* const worker = PickWorker(Origin(request));
  auto call = std::make_shared<CallImpl>(this, workers_[worker->index], std::move(request), std::move(callbacks));
  active_calls_.fetch_add(1, std::memory_order_relaxed);
  net::post(worker->context, [call] { call->Begin(); });
  return call;
}

}  // namespace

std::optional<absl::string_view> ClientResponseHead::Header(absl::string_view name) const {
  for (const auto& [field, value] : headers) {
    if (absl::EqualsIgnoreCase(field, name)) return absl::string_view(value);
  }
  return std::nullopt;
}

absl::Status ValidateHttpClientOptions(const HttpClientOptions& options) {
  if (options.threads < 1 || options.threads > kMaxThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("HttpClientOptions.threads must be in [1, ", kMaxThreads, "], got ", options.threads));
  }
  if (options.max_idle_per_origin < 0 || options.max_idle_per_origin > kMaxIdlePerOrigin) {
    return absl::InvalidArgumentError(absl::StrCat("HttpClientOptions.max_idle_per_origin must be in [0, ",
                                                   kMaxIdlePerOrigin, "], got ", options.max_idle_per_origin));
  }
  if (options.idle_connection_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("HttpClientOptions.idle_connection_timeout must be > 0, got ",
                                                   absl::FormatDuration(options.idle_connection_timeout)));
  }
  if (options.max_response_header_bytes < kMinHeaderBytes || options.max_response_header_bytes > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("HttpClientOptions.max_response_header_bytes must be in [",
                                                   kMinHeaderBytes, ", ", kMaxHeaderBytes, "], got ",
                                                   options.max_response_header_bytes));
  }
  if (options.max_response_body_bytes > kMaxBodyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("HttpClientOptions.max_response_body_bytes must be in [0, ",
                                                   kMaxBodyBytes, "], got ", options.max_response_body_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HttpClient>> HttpClient::Create(HttpClientOptions options) {
  if (absl::Status status = ValidateHttpClientOptions(options); !status.ok()) return status;
  return std::unique_ptr<HttpClient>(new ClientImpl(std::move(options)));
}

// ---- Fetch -------------------------------------------------------------------------------------------

namespace {

// What Fetch collects. The callbacks run on an io thread one at a time; `call` is set by the
// thread that called Fetch, possibly after the first piece already arrived, hence the lock.
struct FetchState {
  size_t max_body_bytes = 0;
  std::function<void(absl::StatusOr<FetchedResponse>)> done;
  FetchedResponse response;
  absl::Mutex mu;
  bool overflow ABSL_GUARDED_BY(mu) = false;
  bool ended ABSL_GUARDED_BY(mu) = false;
  std::shared_ptr<ClientCall> call ABSL_GUARDED_BY(mu);
};

}  // namespace

std::shared_ptr<ClientCall> Fetch(HttpClient& client, ClientRequest request, size_t max_body_bytes,
                                  std::function<void(absl::StatusOr<FetchedResponse>)> done) {
  auto state = std::make_shared<FetchState>();
  state->max_body_bytes = max_body_bytes;
  state->done = std::move(done);
  ClientCallbacks callbacks;
  callbacks.on_head = [state](const ClientResponseHead& head) { state->response.head = head; };
  callbacks.on_body = [state](absl::string_view piece) {
    std::shared_ptr<ClientCall> cancel;
    {
      absl::MutexLock lock(&state->mu);
      if (state->overflow) return;
      if (state->response.body.size() + piece.size() <= state->max_body_bytes) {
        state->response.body.append(piece.data(), piece.size());
        return;
      }
      state->overflow = true;
      state->response.body.clear();
      cancel = state->call;
    }
    if (cancel) cancel->Cancel();
  };
  callbacks.on_done = [state](const ClientResult& result) {
    bool overflow;
    {
      absl::MutexLock lock(&state->mu);
      overflow = state->overflow;
      state->ended = true;
      state->call.reset();
    }
    auto done = std::move(state->done);
    if (!done) return;
    if (overflow) {
      done(absl::InternalError(
          absl::StrCat("response body exceeds the fetch limit of ", state->max_body_bytes, " bytes")));
    } else if (!result.status.ok()) {
      done(result.status);
    } else {
      done(std::move(state->response));
    }
  };
  std::shared_ptr<ClientCall> call = client.Start(std::move(request), std::move(callbacks));
  bool cancel_now;
  {
    absl::MutexLock lock(&state->mu);
    cancel_now = state->overflow;
    // Kept only while the call runs (on_done resets it); a call that already ended must not be
    // held by its own state.
    if (!cancel_now && !state->ended) state->call = call;
  }
  if (cancel_now) call->Cancel();
  return call;
}

absl::StatusOr<FetchedResponse> FetchAndWait(HttpClient& client, ClientRequest request, size_t max_body_bytes) {
  if (current_io_client == &client) {
    return absl::FailedPreconditionError("FetchAndWait called on an io thread of its own client (it would deadlock)");
  }
  absl::Notification finished;
  absl::StatusOr<FetchedResponse> outcome = absl::UnknownError("unset");
  Fetch(client, std::move(request), max_body_bytes, [&](absl::StatusOr<FetchedResponse> response) {
    outcome = std::move(response);
    finished.Notify();
  });
  finished.WaitForNotification();
  return outcome;
}

}  // namespace eldr::http
