#include "eldr/proxy/proxy.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "boost/asio/executor_work_guard.hpp"
#include "boost/asio/io_context.hpp"
#include "boost/asio/post.hpp"
#include "boost/asio/steady_timer.hpp"
#include "common/status_macros.h"
#include "eldr/http/sse.h"
#include "eldr/metrics/prometheus.h"
#include "eldr/openai/errors.h"
#include "eldr/proxy/openai_protocol.h"
#include "eldr/proxy/request_id.h"
#include "eldr/proxy/stream_accounting.h"
#include "proxy_metrics.h"
#include "router_client.h"

namespace eldr::proxy {
namespace {

namespace asio = boost::asio;

constexpr size_t kMaxEngineAnswerBytes = 64 << 20;  // a prefill answer or a /v1/models list
constexpr size_t kMaxErrorBodyBytes = 64 << 10;     // an engine's error answer passed through
constexpr size_t kMaxNonStreamedBytes = 64 << 20;   // a non-streamed decode answer (for its usage)

struct HostPort {
  std::string host;
  int port = 0;
};

// "host:port", "[v6]:port". INVALID_ARGUMENT naming `what`.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, absl::string_view what) {
  const size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 || colon + 1 == text.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", text, "' is not host:port"));
  }
  HostPort out;
  absl::string_view host = text.substr(0, colon);
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') {
      return absl::InvalidArgumentError(absl::StrCat(what, " '", text, "' has a malformed [IPv6] host"));
    }
    host = host.substr(1, host.size() - 2);
  }
  out.host = std::string(host);
  if (!absl::SimpleAtoi(text.substr(colon + 1), &out.port) || out.port < 1 || out.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", text, "' has no port in 1..65535"));
  }
  return out;
}

http::HttpResponse JsonError(int status, absl::string_view message) {
  http::HttpResponse response;
  response.status = status;
  response.content_type = "application/json";
  response.body = openai::ErrorBody(status, message);
  return response;
}

absl::string_view EndpointLabel(Endpoint endpoint) {
  return endpoint == Endpoint::kCompletions ? "completions" : "chat";
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

http::HttpServerOptions ProxyOptions::DefaultServerOptions() {
  http::HttpServerOptions options;
  options.listen = "0.0.0.0:8000";
  options.threads = 2;
  options.max_connections = 20000;
  options.max_body_bytes = 8 << 20;
  options.request_timeout = absl::Seconds(60);
  options.write_timeout = absl::Seconds(60);
  options.idle_timeout = absl::Minutes(10);
  return options;
}

http::HttpClientOptions ProxyOptions::DefaultClientOptions() {
  http::HttpClientOptions options;
  options.threads = 2;
  options.max_idle_per_origin = 4096;
  return options;
}

absl::Status ValidateProxyOptions(const ProxyOptions& options) {
  if (absl::Status status = http::ValidateHttpServerOptions(options.server); !status.ok()) return status;
  if (absl::Status status = http::ValidateHttpClientOptions(options.client); !status.ok()) return status;
  if (absl::Status status = ValidatePrefillPickerOptions(options.prefill_picker); !status.ok()) return status;
  if (absl::Status status = ValidateAbSplitOptions(options.ab); !status.ok()) return status;
  if (options.prefill_discovery.has_value() && !options.prefill.empty()) {
    return absl::InvalidArgumentError("ProxyOptions.prefill: a static list cannot be mixed with prefill_discovery");
  }
  if (options.decode_discovery.has_value() && !options.decode.empty()) {
    return absl::InvalidArgumentError("ProxyOptions.decode: a static list cannot be mixed with decode_discovery");
  }
  if (options.prefill.empty() && !options.prefill_discovery.has_value()) {
    return absl::InvalidArgumentError("ProxyOptions.prefill: at least one instance (or prefill_discovery)");
  }
  for (const std::string& instance : options.prefill) {
    if (absl::StatusOr<HostPort> parsed = ParseHostPort(instance, "ProxyOptions.prefill"); !parsed.ok()) {
      return parsed.status();
    }
  }
  for (const std::string& worker : options.decode) {
    if (absl::StatusOr<HostPort> parsed = ParseHostPort(worker, "ProxyOptions.decode"); !parsed.ok()) {
      return parsed.status();
    }
  }
  if (options.router.target.empty() && options.decode.empty() && !options.decode_discovery.has_value()) {
    return absl::InvalidArgumentError(
        "ProxyOptions: without a router target, the decode list must not be empty (or use decode_discovery)");
  }
  if (options.ab.baseline_fraction > 0 && options.router.target.empty()) {
    return absl::InvalidArgumentError("ProxyOptions.ab: an A/B split needs eldr-router (router.target)");
  }
  for (const auto& [name, value] : {std::pair<const char*, absl::Duration>{"connect_timeout", options.connect_timeout},
                                    {"prefill_timeout", options.prefill_timeout},
                                    {"first_token_timeout", options.first_token_timeout},
                                    {"stream_idle_timeout", options.stream_idle_timeout},
                                    {"request_timeout", options.request_timeout},
                                    {"shutdown_grace", options.shutdown_grace},
                                    {"router.route_timeout", options.router.route_timeout},
                                    {"router.complete_timeout", options.router.complete_timeout}}) {
    if (value <= absl::ZeroDuration() && std::string(name) != "shutdown_grace") {
      return absl::InvalidArgumentError(absl::StrCat("ProxyOptions.", name, " must be > 0"));
    }
    if (value < absl::ZeroDuration()) return absl::InvalidArgumentError(absl::StrCat("ProxyOptions.", name, " < 0"));
  }
  if (options.router.streams < 1 || options.router.streams > 64) {
    return absl::InvalidArgumentError("ProxyOptions.router.streams must be in [1, 64]");
  }
  if (options.retry_backoff < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ProxyOptions.retry_backoff must be >= 0");
  }
  if (options.prefill_attempts < 1 || options.prefill_attempts > 16) {
    return absl::InvalidArgumentError("ProxyOptions.prefill_attempts must be in [1, 16]");
  }
  if (options.decode_attempts < 1 || options.decode_attempts > 16) {
    return absl::InvalidArgumentError("ProxyOptions.decode_attempts must be in [1, 16]");
  }
  if (options.max_request_bytes < 1024 || options.max_request_bytes > (size_t{1} << 30)) {
    return absl::InvalidArgumentError("ProxyOptions.max_request_bytes must be in [1 KiB, 1 GiB]");
  }
  if (options.max_in_flight < 1 || options.max_in_flight > 10000000) {
    return absl::InvalidArgumentError("ProxyOptions.max_in_flight must be in [1, 10000000]");
  }
  if (options.max_buffered_bytes_per_stream < (size_t{64} << 10)) {
    return absl::InvalidArgumentError("ProxyOptions.max_buffered_bytes_per_stream must be >= 64 KiB");
  }
  return absl::OkStatus();
}

namespace {

class ProxyImpl;

// A list of engine addresses kept equal to the discovered pods (prefill instances, or the static
// decode fallback list): an upserted pod (re)joins, a drained or removed one leaves at once.
// Called by the discovery's reconciler thread only; `on_change` gets the addresses in pod-name
// order after every change.
class AddressListSink final : public discovery::PoolSink {
 public:
  using OnChange = std::function<absl::Status(std::vector<std::string> addresses)>;
  explicit AddressListSink(OnChange on_change) : on_change_(std::move(on_change)) {}

  absl::Status Upsert(const WorkerSpec& spec) override {
    auto [it, added] = addresses_.try_emplace(spec.id, spec.address);
    if (!added && it->second == spec.address) return absl::OkStatus();
    it->second = spec.address;
    return Publish();
  }
  absl::Status Drain(const std::string& id) override { return Remove(id); }
  absl::Status Remove(const std::string& id) override {
    if (addresses_.erase(id) == 0) return absl::OkStatus();
    return Publish();
  }

 private:
  absl::Status Publish() {
    std::vector<std::string> addresses;
    addresses.reserve(addresses_.size());
    for (const auto& [id, address] : addresses_) addresses.push_back(address);
    return on_change_(std::move(addresses));
  }

  const OnChange on_change_;
  std::map<std::string, std::string> addresses_;  // pod name -> address
};

// Runs the steps given to Run one at a time, in order, on whichever thread calls Run: the first
// caller runs its step at once and then every step queued meanwhile; a caller that finds a step
// running (another thread, or a step calling Run itself) only queues. So a call's state needs no
// lock, steps never interleave, a step may trigger a callback that runs synchronously, and the
// common case (one event at a time) costs no thread hop: a piece of a decode answer is passed on by
// the HTTP client's io thread itself.
class SerialExecutor {
 public:
  template <typename Step>
  void Run(Step&& step) {
    {
      absl::MutexLock lock(&mu_);
      if (running_) {
        queue_.emplace_back(std::forward<Step>(step));
        return;
      }
      running_ = true;
    }
    // The common case: nothing queued, run the step here without wrapping it in a std::function.
    step();
    Drain();
  }

 private:
  void Drain() {
    while (true) {
      std::function<void()> next;
      {
        absl::MutexLock lock(&mu_);
        if (queue_.empty()) {
          running_ = false;
          return;
        }
        next = std::move(queue_.front());
        queue_.pop_front();
      }
      next();
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
};

// One client request, from its arrival to its last byte. Every step runs on the call's
// SerialExecutor: callbacks from the HTTP server, the HTTP client, gRPC and timers all go through
// it.
class ProxyCall : public std::enable_shared_from_this<ProxyCall> {
 public:
  ProxyCall(ProxyImpl* proxy, Endpoint endpoint, http::HttpRequest request,
            std::shared_ptr<http::ResponseStream> stream);
  ~ProxyCall();

  void Start();

 private:
  // Runs `step` on the call's executor. The callers hold a reference to the call (their
  // callbacks capture one), which keeps it alive while the step runs or waits.
  template <typename Step>
  void Post(Step step) {
    executor_.Run(std::move(step));
  }

  void SendPrefill();
  void OnPrefillAnswer(absl::StatusOr<http::FetchedResponse> answer, const std::string& instance);
  void RetryPrefillOrFail(const std::string& instance, int status, std::string message);
  void Route();
  void OnRouted(absl::StatusOr<eldr::v1::RouteResponse> routed);
  void RouteStatically(absl::string_view why);
  void SendDecode();
  void OnDecodeHead(const http::ClientResponseHead& head);
  void OnDecodeBody(std::string piece);
  void OnDecodeDone(const http::ClientResult& result);
  void OnClientGone();

  // Ends the request with an error answer (before anything was sent to the client).
  void FailBeforeAnswer(int status, absl::string_view message, RequestOutcome outcome);
  // Releases the lease once (Complete with the tokens so far).
  void CompleteLease();
  void RecordLatencies();

  ProxyImpl* const proxy_;
  SerialExecutor executor_;
  const Endpoint endpoint_;
  http::HttpRequest request_;
  const std::shared_ptr<http::ResponseStream> stream_;
  const absl::Time arrived_;
  absl::Time deadline_;

  ClientRequest client_;
  std::string request_id_;
  bool baseline_ = false;
  bool ended_ = false;  // the client's response ended (or the client left)
  std::vector<std::pair<std::string, std::string>> upstream_headers_;

  // Prefill phase.
  PrefillLease prefill_lease_;
  std::vector<std::string> prefill_tried_;
  int prefill_attempts_ = 0;
  PrefillResult prefill_;
  std::optional<Signature> signature_;  // what Route sends (dropped after a refusal)

  // Decode phase.
  std::vector<std::string> decode_tried_;  // worker ids (or addresses for static picks)
  int decode_attempts_ = 0;
  uint64_t lease_id_ = 0;
  bool lease_open_ = false;
  std::string worker_id_;
  HostPort worker_;
  std::string policy_label_ = "none";
  std::string decision_label_ = "none";
  std::shared_ptr<http::ClientCall> upstream_;
  int decode_status_ = 0;
  bool began_ = false;  // the answer's head went to the client
  std::string error_body_;
  std::string non_streamed_body_;
  http::SseParser sse_;
  DecodeStreamObserver observer_;
  absl::Time first_token_at_ = absl::InfinitePast();
  absl::Time last_token_at_ = absl::InfinitePast();
};

class ProxyImpl final : public Proxy {
 public:
  explicit ProxyImpl(ProxyOptions options) : options_(std::move(options)), work_(asio::make_work_guard(io_)) {}
  ~ProxyImpl() override { Shutdown(absl::ZeroDuration()); }

  absl::Status Init();
  absl::Status Start() override;
  int port() const override { return server_ != nullptr ? server_->port() : 0; }
  int metrics_port() const override { return metrics_server_ != nullptr ? metrics_server_->port() : 0; }
  void Shutdown(absl::Duration grace) override;
  ProxyStats stats() const override;
  std::string MetricsText() const override { return metrics_.RenderText(); }

  // ---- For ProxyCall ----
  const ProxyOptions& options() const { return options_; }
  asio::io_context& io() { return io_; }
  http::HttpClient& client() { return *client_; }
  RouterClient* router() { return router_.get(); }
  PrefillPicker& picker() { return *picker_; }
  const AbSplitter& splitter() const { return *splitter_; }
  ProxyMetrics& metrics() { return metrics_; }
  // The next decode worker of the static list not in `tried`; nullopt when none is left.
  std::optional<std::string> NextStaticWorker(const std::vector<std::string>& tried);
  void CallStarted();
  void CallEnded();
  void Count(uint64_t ProxyStats::*field, uint64_t n = 1) {
    absl::MutexLock lock(&stats_mu_);
    stats_.*field += n;
  }

 private:
  void HandleCompletions(Endpoint endpoint, http::HttpRequest request, std::shared_ptr<http::ResponseStream> stream);
  void HandleModels(std::shared_ptr<http::ResponseStream> stream, size_t engine);
  bool Ready();
  void AddOpsRoutes(http::HttpRouter& routes);

  // The engine lists in use: the static ones, or what discovery found.
  std::vector<std::string> DecodeList() const;
  std::vector<std::string> PrefillList() const;
  absl::Status StartDiscovery();

  const ProxyOptions options_;
  ProxyMetrics metrics_;
  std::shared_ptr<metrics::HttpServerCollector> http_collector_;
  std::unique_ptr<http::HttpClient> client_;
  std::unique_ptr<RouterClient> router_;
  std::unique_ptr<PrefillPicker> picker_;
  std::optional<AbSplitter> splitter_;
  mutable absl::Mutex lists_mu_;
  std::vector<std::string> prefill_list_ ABSL_GUARDED_BY(lists_mu_);
  std::vector<std::string> decode_list_ ABSL_GUARDED_BY(lists_mu_);
  // Discovery feeds the lists (and the picker) through the sinks; destroyed before them.
  std::unique_ptr<AddressListSink> prefill_sink_;
  std::unique_ptr<AddressListSink> decode_sink_;
  std::unique_ptr<discovery::KubernetesDiscovery> prefill_discovery_;
  std::unique_ptr<discovery::KubernetesDiscovery> decode_discovery_;
  std::unique_ptr<http::HttpServer> server_;
  std::unique_ptr<http::HttpServer> metrics_server_;

  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> static_cursor_{0};

  mutable absl::Mutex stats_mu_;
  ProxyStats stats_ ABSL_GUARDED_BY(stats_mu_);

  mutable absl::Mutex calls_mu_;
  int64_t calls_ ABSL_GUARDED_BY(calls_mu_) = 0;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;

  // Last, so destroyed first: handlers still queued hold calls, whose destructors use the members
  // above.
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::vector<std::thread> io_threads_;
};

// ---- ProxyCall ----------------------------------------------------------------------------------

ProxyCall::ProxyCall(ProxyImpl* proxy, Endpoint endpoint, http::HttpRequest request,
                     std::shared_ptr<http::ResponseStream> stream)
    : proxy_(proxy),
      endpoint_(endpoint),
      request_(std::move(request)),
      stream_(std::move(stream)),
      arrived_(absl::Now()) {
  proxy_->CallStarted();
}

ProxyCall::~ProxyCall() {
  // Whatever path ended the call, its lease is released exactly once.
  if (lease_open_) CompleteLease();
  proxy_->CallEnded();
}

void ProxyCall::Start() {
  Post([this, self = shared_from_this()] {
    const ProxyOptions& options = proxy_->options();
    deadline_ = arrived_ + options.request_timeout;
    std::weak_ptr<ProxyCall> weak = weak_from_this();
    stream_->OnClosed([weak] {
      if (std::shared_ptr<ProxyCall> call = weak.lock()) call->Post([call] { call->OnClientGone(); });
    });
    proxy_->Count(&ProxyStats::requests);
    absl::StatusOr<ClientRequest> parsed = ParseClientRequest(endpoint_, request_.body, options.max_request_bytes);
    if (!parsed.ok()) {
      const int status = absl::IsResourceExhausted(parsed.status()) ? 413 : 400;
      FailBeforeAnswer(status, parsed.status().message(), RequestOutcome::kClientError);
      return;
    }
    client_ = *std::move(parsed);
    if (std::optional<absl::string_view> id = request_.Header("X-Request-Id"); id && ValidateRequestId(*id).ok()) {
      request_id_ = std::string(*id);
    } else {
      request_id_ = NewRequestId();
    }
    baseline_ = proxy_->splitter().UseBaseline(request_id_);
    upstream_headers_ = {{"Content-Type", "application/json"}, {"X-Request-Id", request_id_}};
    // The engines may require the client's API key (vLLM --api-key).
    if (std::optional<absl::string_view> auth = request_.Header("Authorization")) {
      upstream_headers_.emplace_back("Authorization", std::string(*auth));
    }
    request_.body.clear();
    request_.body.shrink_to_fit();
    SendPrefill();
  });
}

void ProxyCall::SendPrefill() {
  if (ended_) return;
  absl::StatusOr<PrefillLease> lease = proxy_->picker().Pick(client_.prompt_key, prefill_tried_);
  if (!lease.ok()) {
    FailBeforeAnswer(503, absl::StrCat("no prefill instance can take the request: ", lease.status().message()),
                     RequestOutcome::kUpstreamError);
    return;
  }
  prefill_lease_ = *std::move(lease);
  ++prefill_attempts_;
  const std::string instance = prefill_lease_.id();
  absl::StatusOr<HostPort> target = ParseHostPort(instance, "prefill instance");
  if (!target.ok()) {  // validated at startup; discovery may add others
    RetryPrefillOrFail(instance, 502, std::string(target.status().message()));
    return;
  }
  const ProxyOptions& options = proxy_->options();
  http::ClientRequest call;
  call.method = "POST";
  call.host = target->host;
  call.port = target->port;
  call.target = std::string(EndpointPath(endpoint_));
  call.headers = upstream_headers_;
  call.body = MakePrefillBody(client_);
  call.connect_timeout = options.connect_timeout;
  call.first_byte_timeout = options.prefill_timeout;
  call.total_timeout = std::min(options.prefill_timeout, std::max(deadline_ - absl::Now(), absl::Milliseconds(1)));
  upstream_ = http::Fetch(proxy_->client(), std::move(call), kMaxEngineAnswerBytes,
                          [self = shared_from_this(), instance](absl::StatusOr<http::FetchedResponse> answer) mutable {
                            self->Post([self, instance, answer = std::move(answer)]() mutable {
                              self->OnPrefillAnswer(std::move(answer), instance);
                            });
                          });
}

void ProxyCall::OnPrefillAnswer(absl::StatusOr<http::FetchedResponse> answer, const std::string& instance) {
  prefill_lease_.Release();
  upstream_.reset();
  if (ended_) return;
  if (!answer.ok()) {
    const bool timeout = absl::IsDeadlineExceeded(answer.status());
    proxy_->metrics().RecordUpstreamError("prefill", timeout                                ? "timeout"
                                                     : absl::IsUnavailable(answer.status()) ? "connect"
                                                                                            : "malformed");
    RetryPrefillOrFail(instance, timeout ? 504 : 502,
                       absl::StrCat("prefill instance ", instance, ": ", answer.status().message()));
    return;
  }
  const int status = answer->head.status;
  if (status >= 500) {
    proxy_->metrics().RecordUpstreamError("prefill", "http_5xx");
    RetryPrefillOrFail(instance, 502, absl::StrCat("prefill instance ", instance, " answered ", status));
    return;
  }
  if (status != 200) {
    // The engine refused the request itself (400, 404 model, 429 overload): the client's answer.
    proxy_->metrics().RecordUpstreamError("prefill", "http_4xx");
    http::HttpResponse response;
    response.status = status >= 200 && status <= 599 ? status : 502;
    response.content_type = std::string(answer->head.Header("Content-Type").value_or("application/json"));
    response.body = answer->body.size() <= kMaxErrorBodyBytes ? std::move(answer->body)
                                                              : answer->body.substr(0, kMaxErrorBodyBytes);
    if (std::optional<absl::string_view> retry = answer->head.Header("Retry-After")) {
      response.headers.emplace_back("Retry-After", std::string(*retry));
    }
    response.headers.emplace_back("X-Request-Id", request_id_);
    ended_ = true;
    proxy_->metrics().RecordRequest(EndpointLabel(endpoint_), RequestOutcome::kClientError);
    proxy_->Count(&ProxyStats::client_errors);
    stream_->Respond(std::move(response));  // counted first: a client that got it finds it counted
    return;
  }
  absl::StatusOr<PrefillResult> parsed = ParsePrefillResponse(answer->body);
  if (!parsed.ok()) {
    proxy_->metrics().RecordUpstreamError("prefill", "malformed");
    FailBeforeAnswer(502, absl::StrCat("prefill instance ", instance, ": ", parsed.status().message()),
                     RequestOutcome::kUpstreamError);
    return;
  }
  prefill_ = *std::move(parsed);
  signature_ = prefill_.signature;
  if (signature_.has_value()) {
    proxy_->metrics().RecordSignature(signature_->source);
  } else {
    proxy_->metrics().RecordSignature(prefill_.signature_problem.empty() ? "none" : "invalid");
  }
  Route();
}

void ProxyCall::RetryPrefillOrFail(const std::string& instance, int status, std::string message) {
  prefill_tried_.push_back(instance);
  const ProxyOptions& options = proxy_->options();
  if (prefill_attempts_ >= options.prefill_attempts || absl::Now() >= deadline_) {
    FailBeforeAnswer(status, message, RequestOutcome::kUpstreamError);
    return;
  }
  proxy_->metrics().RecordPrefillRetry();
  proxy_->Count(&ProxyStats::prefill_retries);
  const absl::Duration backoff = options.retry_backoff * (int64_t{1} << (prefill_attempts_ - 1));
  auto timer = std::make_shared<asio::steady_timer>(proxy_->io(), absl::ToChronoNanoseconds(backoff));
  timer->async_wait([self = shared_from_this(), timer](const boost::system::error_code&) {
    self->Post([self] { self->SendPrefill(); });
  });
}

void ProxyCall::Route() {
  if (ended_) return;
  RouterClient* router = proxy_->router();
  if (router == nullptr) {
    RouteStatically("no router configured");
    return;
  }
  eldr::v1::RouteRequest route;
  route.set_request_id(request_id_);
  route.set_prompt_tokens(prefill_.prompt_tokens);
  if (signature_.has_value()) {
    if (proxy_->options().route_with_gate_prob_sums && !signature_->float32_le.empty()) {
      eldr::v1::GateProbSums* sums = route.mutable_gate_prob_sums();
      sums->set_layers(signature_->layers);
      sums->set_experts(signature_->experts);
      sums->set_float32_le(signature_->float32_le);
    } else if (!signature_->int16_le.empty()) {
      eldr::v1::ExpertCounts* counts = route.mutable_counts();
      counts->set_layers(signature_->layers);
      counts->set_experts(signature_->experts);
      counts->set_int16_le(signature_->int16_le);
    }
  }
  for (const std::string& tried : decode_tried_) route.add_exclude_workers(tried);
  if (baseline_) route.set_policy(proxy_->splitter().baseline_policy());
  router->Route(route, [self = shared_from_this()](absl::StatusOr<eldr::v1::RouteResponse> routed) mutable {
    self->Post([self, routed = std::move(routed)]() mutable { self->OnRouted(std::move(routed)); });
  });
}

void ProxyCall::OnRouted(absl::StatusOr<eldr::v1::RouteResponse> routed) {
  proxy_->metrics().RecordRouterCall("route", absl::StatusCodeToString(routed.status().code()));
  if (ended_) {
    // The client left while the router decided: release the lease it just took.
    if (routed.ok() && routed->lease_id() != 0 && proxy_->router() != nullptr) {
      proxy_->router()->Complete(routed->lease_id(), 0);
    }
    return;
  }
  if (!routed.ok()) {
    proxy_->Count(&ProxyStats::router_failures);
    if (absl::IsInvalidArgument(routed.status()) && signature_.has_value()) {
      // The router refused the signature (geometry, values): route on load rather than fail.
      proxy_->metrics().RecordSignature("refused");
      signature_.reset();
      Route();
      return;
    }
    RouteStatically(routed.status().message());
    return;
  }
  absl::StatusOr<HostPort> address = ParseHostPort(routed->address(), "decode worker address");
  lease_id_ = routed->lease_id();
  lease_open_ = lease_id_ != 0;
  worker_id_ = routed->worker_id();
  if (!address.ok()) {
    CompleteLease();
    decode_tried_.push_back(worker_id_);
    FailBeforeAnswer(502, address.status().message(), RequestOutcome::kUpstreamError);
    return;
  }
  worker_ = *std::move(address);
  policy_label_ = routed->policy();
  decision_label_ = baseline_                            ? "baseline"
                    : !routed->fallback_reason().empty() ? "fallback"
                    : routed->policy() == "eldr"         ? "locality"
                                                         : "load";
  SendDecode();
}

void ProxyCall::RouteStatically(absl::string_view why) {
  std::optional<std::string> worker = proxy_->NextStaticWorker(decode_tried_);
  if (!worker.has_value()) {
    FailBeforeAnswer(503, absl::StrCat("no decode worker can take the request: ", why), RequestOutcome::kUpstreamError);
    return;
  }
  proxy_->metrics().RecordStaticRoute();
  proxy_->Count(&ProxyStats::static_routes);
  absl::StatusOr<HostPort> address = ParseHostPort(*worker, "decode worker");
  if (!address.ok()) {
    FailBeforeAnswer(502, address.status().message(), RequestOutcome::kUpstreamError);
    return;
  }
  worker_ = *std::move(address);
  worker_id_ = *worker;
  lease_open_ = false;
  policy_label_ = "static";
  decision_label_ = "static";
  SendDecode();
}

void ProxyCall::SendDecode() {
  if (ended_) return;
  ++decode_attempts_;
  const ProxyOptions& options = proxy_->options();
  const absl::Duration left = std::max(deadline_ - absl::Now(), absl::Milliseconds(1));
  http::ClientRequest call;
  call.method = "POST";
  call.host = worker_.host;
  call.port = worker_.port;
  call.target = std::string(EndpointPath(endpoint_));
  call.headers = upstream_headers_;
  call.body = MakeDecodeBody(client_, prefill_.kv_transfer_params);
  call.connect_timeout = options.connect_timeout;
  // A streamed answer's head comes at once; a non-streamed one only when the answer is complete.
  call.first_byte_timeout = client_.stream ? std::min(options.first_token_timeout, left) : left;
  call.idle_timeout = client_.stream ? options.stream_idle_timeout : absl::InfiniteDuration();
  call.total_timeout = left;
  decode_status_ = 0;
  auto self = shared_from_this();
  http::ClientCallbacks callbacks;
  callbacks.on_head = [self](const http::ClientResponseHead& head) {
    self->Post([self, head] { self->OnDecodeHead(head); });
  };
  callbacks.on_body = [self](absl::string_view piece) {
    self->Post([self, piece = std::string(piece)]() mutable { self->OnDecodeBody(std::move(piece)); });
  };
  callbacks.on_done = [self](const http::ClientResult& result) {
    self->Post([self, result] { self->OnDecodeDone(result); });
  };
  upstream_ = proxy_->client().Start(std::move(call), std::move(callbacks));
}

void ProxyCall::OnDecodeHead(const http::ClientResponseHead& head) {
  if (ended_) return;
  decode_status_ = head.status;
  if (head.status != 200) return;  // collected and passed through at the end
  began_ = true;
  std::vector<std::pair<std::string, std::string>> headers = {{"X-Request-Id", request_id_},
                                                              {"Cache-Control", "no-cache"}};
  stream_->Begin(
      200, std::string(head.Header("Content-Type").value_or(client_.stream ? "text/event-stream" : "application/json")),
      std::move(headers));
}

void ProxyCall::OnDecodeBody(std::string piece) {
  if (ended_) return;
  if (decode_status_ != 200) {
    if (error_body_.size() < kMaxErrorBodyBytes) error_body_.append(piece, 0, kMaxErrorBodyBytes - error_body_.size());
    return;
  }
  if (client_.stream) {
    const absl::Time now = absl::Now();
    const absl::Status parsed = sse_.Feed(piece, [&](const http::SseEvent& event) {
      const DecodeEventInfo info = observer_.OnEvent(event);
      if (info.token) {
        if (info.first_token) first_token_at_ = now;
        last_token_at_ = now;
      }
    });
    if (!parsed.ok()) proxy_->metrics().RecordUpstreamError("decode", "malformed");
  } else if (non_streamed_body_.size() + piece.size() <= kMaxNonStreamedBytes) {
    non_streamed_body_.append(piece);
  }
  stream_->Write(std::move(piece));
  if (stream_->queued_bytes() > proxy_->options().max_buffered_bytes_per_stream) {
    // The client reads slower than the engine writes: cut it rather than buffer without bound.
    proxy_->metrics().RecordUpstreamError("decode", "slow_client");
    stream_->Abort();
    OnClientGone();
  }
}

void ProxyCall::OnDecodeDone(const http::ClientResult& result) {
  upstream_.reset();
  if (ended_) return;
  const ProxyOptions& options = proxy_->options();
  if (result.status.ok()) {
    // Every ending counts the call before the client can see its end: a client that got its
    // answer and scrapes finds it counted.
    if (decode_status_ == 200) {
      ended_ = true;
      RecordLatencies();
      proxy_->metrics().RecordRequest(EndpointLabel(endpoint_), RequestOutcome::kOk);
      proxy_->Count(&ProxyStats::completed);
      stream_->Finish();
      CompleteLease();
      return;
    }
    // The worker refused (e.g. 503: the KV could not be pulled; 429): its answer is the client's.
    proxy_->metrics().RecordUpstreamError("decode", decode_status_ >= 500 ? "http_5xx" : "http_4xx");
    http::HttpResponse response;
    response.status = decode_status_ >= 200 && decode_status_ <= 599 ? decode_status_ : 502;
    response.content_type = "application/json";
    response.body = std::move(error_body_);
    response.headers.emplace_back("X-Request-Id", request_id_);
    ended_ = true;
    proxy_->metrics().RecordRequest(EndpointLabel(endpoint_),
                                    decode_status_ >= 500 ? RequestOutcome::kUpstreamError : RequestOutcome::kOk);
    proxy_->Count(decode_status_ >= 500 ? &ProxyStats::upstream_errors : &ProxyStats::completed);
    stream_->Respond(std::move(response));
    CompleteLease();
    return;
  }
  if (absl::IsCancelled(result.status)) return;  // we cancelled it: the client left
  if (!result.head_received) {
    CompleteLease();
    if (absl::IsUnavailable(result.status)) {
      // Nothing reached the worker's answer: the KV is still held by the prefill, so another
      // worker can take the request.
      proxy_->metrics().RecordUpstreamError("decode", "connect");
      decode_tried_.push_back(worker_id_);
      if (decode_attempts_ < options.decode_attempts && absl::Now() < deadline_) {
        proxy_->metrics().RecordDecodeReroute();
        proxy_->Count(&ProxyStats::decode_reroutes);
        if (policy_label_ == "static") {
          RouteStatically(result.status.message());
        } else {
          Route();
        }
        return;
      }
      FailBeforeAnswer(502, absl::StrCat("decode worker ", worker_id_, ": ", result.status.message()),
                       RequestOutcome::kUpstreamError);
      return;
    }
    proxy_->metrics().RecordUpstreamError("decode", absl::IsDeadlineExceeded(result.status) ? "timeout" : "malformed");
    FailBeforeAnswer(absl::IsDeadlineExceeded(result.status) ? 504 : 502,
                     absl::StrCat("decode worker ", worker_id_, ": ", result.status.message()),
                     RequestOutcome::kUpstreamError);
    return;
  }
  // The answer broke after its head: say so in the stream, or cut a non-streamed answer.
  proxy_->metrics().RecordUpstreamError("decode", absl::IsDeadlineExceeded(result.status) ? "timeout" : "mid_stream");
  ended_ = true;
  RecordLatencies();
  proxy_->metrics().RecordRequest(EndpointLabel(endpoint_), RequestOutcome::kUpstreamError);
  proxy_->Count(&ProxyStats::upstream_errors);
  if (began_ && client_.stream) {
    stream_->Write(
        openai::SseErrorEvent(absl::StrCat("the decode worker's answer broke off: ", result.status.message()),
                              openai::ErrorTypeForStatus(502), 502));
    stream_->Finish();
  } else if (began_) {
    stream_->Abort();
  } else {
    stream_->Respond(JsonError(502, absl::StrCat("decode worker ", worker_id_, ": ", result.status.message())));
  }
  CompleteLease();
}

void ProxyCall::OnClientGone() {
  if (ended_) return;
  ended_ = true;
  if (upstream_ != nullptr) {
    upstream_->Cancel();  // the engine sees the connection close and aborts the request
    upstream_.reset();
  }
  prefill_lease_.Release();
  CompleteLease();
  proxy_->metrics().RecordRequest(EndpointLabel(endpoint_), RequestOutcome::kClientGone);
  proxy_->Count(&ProxyStats::client_gone);
}

void ProxyCall::FailBeforeAnswer(int status, absl::string_view message, RequestOutcome outcome) {
  if (ended_) return;
  ended_ = true;
  http::HttpResponse response = JsonError(status, message);
  if (!request_id_.empty()) response.headers.emplace_back("X-Request-Id", request_id_);
  proxy_->metrics().RecordRequest(EndpointLabel(endpoint_), outcome);  // counted first, as in OnDecodeDone
  proxy_->Count(outcome == RequestOutcome::kUpstreamError ? &ProxyStats::upstream_errors : &ProxyStats::client_errors);
  stream_->Respond(std::move(response));
  CompleteLease();
}

void ProxyCall::CompleteLease() {
  if (!lease_open_) return;
  lease_open_ = false;
  if (proxy_->router() == nullptr) return;  // shutting down: the router expires the lease
  int64_t tokens = observer_.output_tokens();
  if (!client_.stream && !non_streamed_body_.empty()) {
    if (absl::StatusOr<ResponseTokens> counted = OutputTokensOfResponse(non_streamed_body_); counted.ok()) {
      tokens = counted->output_tokens;
    }
  }
  proxy_->Count(&ProxyStats::leases_completed);
  ProxyMetrics* metrics = &proxy_->metrics();
  proxy_->router()->Complete(lease_id_, tokens, [metrics](absl::Status status) {
    metrics->RecordRouterCall("complete", absl::StatusCodeToString(status.code()));
  });
}

void ProxyCall::RecordLatencies() {
  const absl::Time now = absl::Now();
  double ttft = -1;
  double tpot = -1;
  int64_t tokens = observer_.output_tokens();
  if (client_.stream && first_token_at_ != absl::InfinitePast()) {
    ttft = Seconds(first_token_at_ - arrived_);
    if (observer_.token_events() >= 2) {
      tpot = Seconds(last_token_at_ - first_token_at_) / static_cast<double>(observer_.token_events() - 1);
    }
  }
  if (!client_.stream) {
    if (absl::StatusOr<ResponseTokens> counted = OutputTokensOfResponse(non_streamed_body_); counted.ok()) {
      tokens = counted->output_tokens;
    }
  }
  proxy_->metrics().RecordLatency(policy_label_, decision_label_, ttft, tpot, Seconds(now - arrived_), tokens);
}

// ---- ProxyImpl ----------------------------------------------------------------------------------

absl::Status ProxyImpl::Init() {
  if (!options_.router.target.empty()) {
    absl::StatusOr<std::unique_ptr<RouterClient>> router = RouterClient::Create(options_.router, &metrics_);
    if (!router.ok()) return router.status();
    router_ = *std::move(router);
  }
  absl::StatusOr<std::unique_ptr<http::HttpClient>> client = http::HttpClient::Create(options_.client);
  if (!client.ok()) return client.status();
  client_ = *std::move(client);
  absl::StatusOr<std::unique_ptr<PrefillPicker>> picker =
      PrefillPicker::Create(options_.prefill_picker, options_.prefill);
  if (!picker.ok()) return picker.status();
  picker_ = *std::move(picker);
  {
    absl::MutexLock lock(&lists_mu_);
    prefill_list_ = options_.prefill;
    decode_list_ = options_.decode;
  }
  if (options_.prefill_discovery.has_value()) {
    prefill_sink_ = std::make_unique<AddressListSink>([this](std::vector<std::string> addresses) {
      ELDR_RETURN_IF_ERROR(picker_->SetInstances(addresses));
      absl::MutexLock lock(&lists_mu_);
      prefill_list_ = std::move(addresses);
      return absl::OkStatus();
    });
    discovery::KubernetesDiscoveryOptions discovery_options = *options_.prefill_discovery;
    discovery_options.role = "prefill";
    ELDR_ASSIGN_OR_RETURN(prefill_discovery_,
                          discovery::KubernetesDiscovery::Create(std::move(discovery_options), prefill_sink_.get(),
                                                                 &metrics_.registry()));
  }
  if (options_.decode_discovery.has_value()) {
    decode_sink_ = std::make_unique<AddressListSink>([this](std::vector<std::string> addresses) {
      absl::MutexLock lock(&lists_mu_);
      decode_list_ = std::move(addresses);
      return absl::OkStatus();
    });
    discovery::KubernetesDiscoveryOptions discovery_options = *options_.decode_discovery;
    discovery_options.role = "decode";
    ELDR_ASSIGN_OR_RETURN(
        decode_discovery_,
        discovery::KubernetesDiscovery::Create(std::move(discovery_options), decode_sink_.get(), &metrics_.registry()));
  }
  absl::StatusOr<AbSplitter> splitter = AbSplitter::Create(options_.ab);
  if (!splitter.ok()) return splitter.status();
  splitter_ = *std::move(splitter);

  // Scrape-time families: prefill in-flight counts, the front end's HTTP counters, process_*.
  class PrefillLoads final : public prometheus::Collectable {
   public:
    explicit PrefillLoads(const PrefillPicker* picker) : picker_(picker) {}
    std::vector<prometheus::MetricFamily> Collect() const override {
      auto family = metrics::MetricFamily("eldr_proxy_prefill_in_flight",
                                          "Requests in flight on each prefill instance (prefill phase).",
                                          prometheus::MetricType::Gauge);
      for (const PrefillInstanceLoad& load : picker_->Loads()) {
        metrics::AddSample(&family, static_cast<double>(load.in_flight), {metrics::MetricLabel("instance", load.id)});
      }
      return {std::move(family)};
    }

   private:
    const PrefillPicker* picker_;
  };
  metrics_.AddCollectable(std::make_shared<PrefillLoads>(picker_.get()));
  http_collector_ = std::make_shared<metrics::HttpServerCollector>("eldr_proxy_http", "the proxy's front end");
  metrics_.AddCollectable(http_collector_);
  metrics_.AddCollectable(metrics::NewProcessCollector());
  return absl::OkStatus();
}

void ProxyImpl::AddOpsRoutes(http::HttpRouter& routes) {
  routes.Handle("/metrics", {"GET"}, [this](const http::HttpRequest&) {
    http::HttpResponse response;
    response.content_type = metrics::kPrometheusTextType;
    response.body = metrics_.RenderText();
    return response;
  });
  routes.Handle("/health", {"GET"}, [](const http::HttpRequest&) {
    http::HttpResponse response;
    response.body = "ok\n";
    return response;
  });
  routes.Handle("/readyz", {"GET"}, [this](const http::HttpRequest&) {
    http::HttpResponse response;
    const bool ready = Ready();
    response.status = ready ? 200 : 503;
    response.body = ready                  ? "ready\n"
                    : draining_.load()     ? "draining\n"
                    : picker_->size() == 0 ? "no prefill instance (discovery has found none yet)\n"
                                           : "eldr-router is not reachable\n";
    return response;
  });
}

bool ProxyImpl::Ready() {
  if (draining_.load()) return false;
  if (picker_->size() == 0) return false;  // discovery found no prefill pod yet
  // Without a reachable router the proxy still serves (fail static) when it has a decode list.
  return router_ == nullptr || router_->Reachable() || !DecodeList().empty();
}

std::vector<std::string> ProxyImpl::DecodeList() const {
  absl::MutexLock lock(&lists_mu_);
  return decode_list_;
}

std::vector<std::string> ProxyImpl::PrefillList() const {
  absl::MutexLock lock(&lists_mu_);
  return prefill_list_;
}

absl::Status ProxyImpl::StartDiscovery() {
  if (prefill_discovery_ != nullptr) ELDR_RETURN_IF_ERROR(prefill_discovery_->Start());
  if (decode_discovery_ != nullptr) ELDR_RETURN_IF_ERROR(decode_discovery_->Start());
  return absl::OkStatus();
}

absl::Status ProxyImpl::Start() {
  ELDR_RETURN_IF_ERROR(StartDiscovery());
  for (int i = 0; i < std::max(1, options_.server.threads); ++i) {
    io_threads_.emplace_back([this] { io_.run(); });
  }
  http::HttpRouter routes;
  routes.HandleStreaming("/v1/completions", {"POST"},
                         [this](http::HttpRequest request, std::shared_ptr<http::ResponseStream> stream) {
                           HandleCompletions(Endpoint::kCompletions, std::move(request), std::move(stream));
                         });
  routes.HandleStreaming("/v1/chat/completions", {"POST"},
                         [this](http::HttpRequest request, std::shared_ptr<http::ResponseStream> stream) {
                           HandleCompletions(Endpoint::kChatCompletions, std::move(request), std::move(stream));
                         });
  routes.HandleStreaming(
      "/v1/models", {"GET"},
      [this](http::HttpRequest, std::shared_ptr<http::ResponseStream> stream) { HandleModels(std::move(stream), 0); });
  AddOpsRoutes(routes);
  http::HttpServerOptions server_options = options_.server;
  server_options.max_body_bytes = std::min(server_options.max_body_bytes, options_.max_request_bytes);
  absl::StatusOr<std::unique_ptr<http::HttpServer>> server =
      http::HttpServer::Create(server_options, std::move(routes));
  if (!server.ok()) return server.status();
  server_ = *std::move(server);
  if (absl::Status started = server_->Start(); !started.ok()) return started;
  http_collector_->Attach(server_.get());
  if (!options_.metrics_listen.empty()) {
    http::HttpRouter ops;
    AddOpsRoutes(ops);
    http::HttpServerOptions ops_options;
    ops_options.listen = options_.metrics_listen;
    ops_options.max_connections = 64;
    absl::StatusOr<std::unique_ptr<http::HttpServer>> ops_server =
        http::HttpServer::Create(ops_options, std::move(ops));
    if (!ops_server.ok()) return ops_server.status();
    metrics_server_ = *std::move(ops_server);
    if (absl::Status started = metrics_server_->Start(); !started.ok()) return started;
  }
  return absl::OkStatus();
}

void ProxyImpl::HandleCompletions(Endpoint endpoint, http::HttpRequest request,
                                  std::shared_ptr<http::ResponseStream> stream) {
  if (draining_.load()) {
    // Counted before the answer, as every call is.
    metrics_.RecordRequest(EndpointLabel(endpoint), RequestOutcome::kOverloaded);
    Count(&ProxyStats::client_errors);
    stream->Respond(JsonError(503, "the proxy is shutting down"));
    return;
  }
  {
    absl::MutexLock lock(&calls_mu_);
    if (calls_ >= options_.max_in_flight) {
      metrics_.RecordRequest(EndpointLabel(endpoint), RequestOutcome::kOverloaded);
      Count(&ProxyStats::client_errors);
      stream->Respond(JsonError(503, absl::StrCat("the proxy holds ", calls_, " requests, its limit")));
      return;
    }
  }
  auto call = std::make_shared<ProxyCall>(this, endpoint, std::move(request), std::move(stream));
  call->Start();
}

void ProxyImpl::HandleModels(std::shared_ptr<http::ResponseStream> stream, size_t engine) {
  // The decode workers first (they serve the answers), then the prefill instances.
  std::vector<std::string> engines = DecodeList();
  const std::vector<std::string> prefill = PrefillList();
  engines.insert(engines.end(), prefill.begin(), prefill.end());
  if (engine >= engines.size()) {
    stream->Respond(JsonError(503, "no engine answered /v1/models"));
    return;
  }
  absl::StatusOr<HostPort> target = ParseHostPort(engines[engine], "engine");
  if (!target.ok()) {
    HandleModels(std::move(stream), engine + 1);
    return;
  }
  http::ClientRequest call;
  call.host = target->host;
  call.port = target->port;
  call.target = "/v1/models";
  call.connect_timeout = options_.connect_timeout;
  call.total_timeout = absl::Seconds(10);
  http::Fetch(*client_, std::move(call), kMaxEngineAnswerBytes,
              [this, stream, engine](absl::StatusOr<http::FetchedResponse> answer) {
                if (!answer.ok() || answer->head.status != 200) {
                  asio::post(io_, [this, stream, engine] { HandleModels(stream, engine + 1); });
                  return;
                }
                http::HttpResponse response;
                response.content_type = "application/json";
                response.body = std::move(answer->body);
                stream->Respond(std::move(response));
              });
}

std::optional<std::string> ProxyImpl::NextStaticWorker(const std::vector<std::string>& tried) {
  const std::vector<std::string> decode = DecodeList();
  const size_t n = decode.size();
  for (size_t i = 0; i < n; ++i) {
    const std::string& worker = decode[static_cursor_.fetch_add(1) % n];
    if (std::find(tried.begin(), tried.end(), worker) == tried.end()) return worker;
  }
  return std::nullopt;
}

void ProxyImpl::CallStarted() {
  absl::MutexLock lock(&calls_mu_);
  ++calls_;
  metrics_.SetInFlight(calls_);
}

void ProxyImpl::CallEnded() {
  absl::MutexLock lock(&calls_mu_);
  --calls_;
  metrics_.SetInFlight(calls_);
}

void ProxyImpl::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  draining_.store(true);
  const absl::Time grace_deadline = absl::Now() + grace;
  if (prefill_discovery_ != nullptr) prefill_discovery_->Stop();
  if (decode_discovery_ != nullptr) decode_discovery_->Stop();
  {
    // Requests in flight get `grace` to finish.
    absl::MutexLock lock(&calls_mu_);
    calls_mu_.AwaitWithDeadline(absl::Condition(
                                    +[](int64_t* calls) { return *calls == 0; }, &calls_),
                                grace_deadline);
  }
  // A call ends when its answer is queued: let the server hand the last pieces (the final chunk)
  // to the sockets before it closes them, within what is left of the grace.
  if (server_ != nullptr) {
    while (server_->stats().open_streams > 0 && absl::Now() < grace_deadline) absl::SleepFor(absl::Milliseconds(2));
  }
  // Cuts what is left: each cut response's OnClosed posts its call's cleanup (cancel the engine
  // call, complete the lease) onto io_, which still runs.
  if (metrics_server_ != nullptr) metrics_server_->Stop();
  if (server_ != nullptr) server_->Stop();
  {
    absl::MutexLock lock(&calls_mu_);
    calls_mu_.AwaitWithTimeout(absl::Condition(
                                   +[](int64_t* calls) { return *calls == 0; }, &calls_),
                               absl::Seconds(5));
  }
  if (http_collector_ != nullptr) http_collector_->Attach(nullptr);
  client_.reset();  // cancels what still runs; its callbacks post into io_
  work_.reset();
  io_.stop();
  for (std::thread& thread : io_threads_) {
    if (thread.joinable()) thread.join();
  }
  io_threads_.clear();
  router_.reset();  // waits for the Complete calls in flight
}

ProxyStats ProxyImpl::stats() const {
  ProxyStats out;
  {
    absl::MutexLock lock(&stats_mu_);
    out = stats_;
  }
  absl::MutexLock lock(&calls_mu_);
  out.in_flight = calls_;
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Proxy>> Proxy::Create(ProxyOptions options) {
  if (absl::Status valid = ValidateProxyOptions(options); !valid.ok()) return valid;
  auto proxy = std::make_unique<ProxyImpl>(std::move(options));
  if (absl::Status init = proxy->Init(); !init.ok()) return init;
  return std::unique_ptr<Proxy>(std::move(proxy));
}

}  // namespace eldr::proxy
