#include "engine_emu/service.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"

namespace eldr::engine_emu {
namespace {

// Bodies of kv_pull answers and of the answers of other engines are small JSON objects.
constexpr size_t kMaxKvPullAnswerBytes = 64 * 1024;

// A short reason from a kv_pull answer that is not 200: its status and vLLM error message.
std::string DescribeFailedPull(const http::FetchedResponse& response) {
  std::string reason = absl::StrCat("HTTP ", response.head.status);
  const nlohmann::json body = nlohmann::json::parse(response.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_object()) {
    const auto message = body.find("message");
    if (message != body.end() && message->is_string()) {
      absl::StrAppend(&reason, ": ", message->get_ref<const std::string&>());
    }
  }
  return reason;
}

}  // namespace

// Pulls KV with POST /eldr_emu/kv_pull on the prefill engine; completions are posted to the loop.
class EmuService::HttpKvPuller : public KvPuller {
 public:
  HttpKvPuller(http::HttpClient* client, EngineLoop* loop, absl::Duration timeout)
      : client_(client), loop_(loop), timeout_(timeout) {}

  void Pull(const RemotePrefill& remote, std::function<void(absl::Status)> done) override {
    nlohmann::json body;
    body["remote_engine_id"] = remote.engine_id;
    body["remote_request_id"] = remote.request_id;
    body["remote_block_ids"] = remote.block_ids;
    http::ClientRequest request;
    request.method = "POST";
    request.host = remote.host;
    request.port = remote.port;
    request.target = "/eldr_emu/kv_pull";
    request.headers.emplace_back("Content-Type", "application/json");
    request.body = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    request.connect_timeout = std::min(timeout_, absl::Seconds(5));
    request.total_timeout = timeout_;
    EngineLoop* loop = loop_;
    http::Fetch(*client_, std::move(request), kMaxKvPullAnswerBytes,
                [loop, done = std::move(done)](absl::StatusOr<http::FetchedResponse> response) mutable {
                  absl::Status status;
                  if (!response.ok()) {
                    status = absl::UnavailableError(response.status().message());
                  } else if (response->head.status != 200) {
                    status = absl::UnavailableError(DescribeFailedPull(*response));
                  }
                  loop->Post([done = std::move(done), status] { done(status); });
                });
  }

 private:
  http::HttpClient* const client_;
  EngineLoop* const loop_;
  const absl::Duration timeout_;
};

absl::Status ValidateEmuServiceOptions(const EmuServiceOptions& options) {
  if (absl::Status engine = ValidateEngineOptions(options.engine); !engine.ok()) return engine;
  if (options.threads < 1 || options.threads > 256) {
    return absl::InvalidArgumentError(absl::StrCat("--threads must be in [1, 256], got ", options.threads));
  }
  if (options.role == EngineRole::kDecode) {
    DecodeEngineOptions decode;
    decode.engine = options.engine;
    decode.max_batch = options.max_batch;
    if (absl::Status s = ValidateDecodeEngineOptions(decode); !s.ok()) return s;
  }
  if (options.kv_hold_timeout <= absl::ZeroDuration() || options.kv_hold_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_hold_timeout must be a finite duration > 0, got ",
                                                   absl::FormatDuration(options.kv_hold_timeout)));
  }
  if (options.kv_pull_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("EmuServiceOptions.kv_pull_timeout must be > 0");
  }
  if (options.advertise_host.empty()) return absl::InvalidArgumentError("--advertise_host must not be empty");
  return absl::OkStatus();
}

std::string RandomHexId() {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  return absl::StrFormat("%016x%016x", generator(), generator());
}

EmuService::EmuService(EmuServiceOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<EmuService>> EmuService::Create(EmuServiceOptions options) {
  if (absl::Status s = ValidateEmuServiceOptions(options); !s.ok()) return s;
  if (options.engine.catalog == nullptr) return absl::InvalidArgumentError("EmuServiceOptions: no catalog");
  std::unique_ptr<EmuService> service(new EmuService(std::move(options)));
  EmuService& s = *service;
  const EmuServiceOptions& o = s.options_;
  if (o.engine_id.empty()) {
    const std::string hex = RandomHexId();
    s.engine_id_ = absl::StrCat(hex.substr(0, 8), "-", hex.substr(8, 4), "-", hex.substr(12, 4), "-", hex.substr(16, 4),
                                "-", hex.substr(20, 12));
  } else {
    s.engine_id_ = o.engine_id;
  }
  s.parser_options_.role = o.role;
  s.parser_options_.model = o.engine.model;
  s.started_unix_s_ = absl::ToUnixSeconds(absl::Now());
  s.metrics_ = std::make_unique<EmuMetrics>(o.role, o.engine.model);

  if (o.role == EngineRole::kPrefill) {
    KvRegistryOptions kv;
    kv.engine_id = s.engine_id_;
    kv.hold_timeout_us = absl::ToDoubleMicroseconds(o.kv_hold_timeout);
    kv.capacity_tokens = o.engine.kv_capacity_tokens;
    s.registry_ = std::make_unique<KvRegistry>(std::move(kv), s.metrics_.get());
    PrefillEngineOptions prefill;
    prefill.engine = o.engine;
    prefill.advertise_host = o.advertise_host;
    prefill.signature_key = o.signature_key;
    prefill.gate_prob_sums = o.gate_prob_sums;
    auto engine = std::make_unique<PrefillEngine>(std::move(prefill), &s.loop_, s.metrics_.get(), s.registry_.get());
    s.prefill_ = engine.get();
    s.engine_ = std::move(engine);
  } else {
    http::HttpClientOptions client_options;
    client_options.threads = 1;
    absl::StatusOr<std::unique_ptr<http::HttpClient>> client = http::HttpClient::Create(client_options);
    if (!client.ok()) return client.status();
    s.client_ = *std::move(client);
    s.puller_ = std::make_unique<HttpKvPuller>(s.client_.get(), &s.loop_, o.kv_pull_timeout);
    DecodeEngineOptions decode;
    decode.engine = o.engine;
    decode.max_batch = o.max_batch;
    s.engine_ = std::make_unique<DecodeEngine>(std::move(decode), &s.loop_, s.metrics_.get(), s.puller_.get());
  }

  http::HttpServerOptions server_options;
  server_options.listen = o.listen;
  server_options.threads = o.threads;
  server_options.max_connections = o.max_connections;
  server_options.max_body_bytes = o.max_body_bytes;
  absl::StatusOr<std::unique_ptr<http::HttpServer>> server =
      http::HttpServer::Create(std::move(server_options), s.MakeRouter());
  if (!server.ok()) return server.status();
  s.server_ = *std::move(server);
  return service;
}

EmuService::~EmuService() { Stop(); }

http::HttpRouter EmuService::MakeRouter() {
  http::HttpRouter router;
  router.HandleStreaming("/v1/completions", {"POST"},
                         [this](http::HttpRequest request, std::shared_ptr<http::ResponseStream> stream) {
                           ServeGenerate(ApiKind::kCompletions, std::move(request), std::move(stream));
                         });
  router.HandleStreaming("/v1/chat/completions", {"POST"},
                         [this](http::HttpRequest request, std::shared_ptr<http::ResponseStream> stream) {
                           ServeGenerate(ApiKind::kChat, std::move(request), std::move(stream));
                         });
  router.Handle("/v1/models", {"GET"}, [this](const http::HttpRequest&) { return ServeModels(); });
  router.Handle("/health", {"GET"}, [](const http::HttpRequest&) {
    http::HttpResponse response;
    response.content_type.clear();  // vLLM's liveness answer: 200, nothing else
    return response;
  });
  router.Handle("/metrics", {"GET"}, [this](const http::HttpRequest&) {
    http::HttpResponse response;
    response.content_type = "text/plain; version=0.0.4; charset=utf-8";
    response.body = metrics_->Serialize();
    return response;
  });
  if (options_.role == EngineRole::kPrefill) {
    router.Handle("/eldr_emu/kv_pull", {"POST"},
                  [this](const http::HttpRequest& request) { return ServeKvPull(request); });
  }
  return router;
}

void EmuService::ServeGenerate(ApiKind api, http::HttpRequest request, std::shared_ptr<http::ResponseStream> stream) {
  const std::optional<absl::string_view> header = request.Header("X-Request-Id");
  std::string id = header.has_value() && !header->empty() ? std::string(*header) : RandomHexId();
  absl::StatusOr<EngineRequest> parsed =
      ParseEngineRequest(parser_options_, *options_.engine.catalog, api, request.body);
  if (!parsed.ok()) {
    metrics_->CountRequest(RequestOutcome::kInvalid);
    stream->Respond(ErrorResponse(parsed.status(), id));
    return;
  }
  parsed->id = std::move(id);
  parsed->created = absl::ToUnixSeconds(absl::Now());
  const uint64_t handle = next_handle_.fetch_add(1, std::memory_order_relaxed);
  // Set before the engine can answer (the stream's contract). Should the client go away before
  // the Submit below reached the engine, the Abort finds nothing; the engine then notices the
  // stream is done at the request's next step.
  Engine* engine = engine_.get();
  EngineLoop* loop = &loop_;
  stream->OnClosed([engine, loop, handle] { loop->Post([engine, handle] { engine->Abort(handle); }); });
  loop_.Post([engine, handle, parsed = *std::move(parsed), stream = std::move(stream)]() mutable {
    engine->Submit(handle, std::move(parsed), std::move(stream));
  });
}

http::HttpResponse EmuService::ServeKvPull(const http::HttpRequest& request) {
  const nlohmann::json body = nlohmann::json::parse(request.body, nullptr, /*allow_exceptions=*/false);
  auto invalid = [this](absl::string_view message) {
    metrics_->CountKvPull(KvPullOutcome::kInvalid);
    return ErrorResponse(absl::InvalidArgumentError(message), "");
  };
  if (!body.is_object()) return invalid("the kv_pull body must be a JSON object");
  const auto engine_id = body.find("remote_engine_id");
  const auto request_id = body.find("remote_request_id");
  const auto blocks = body.find("remote_block_ids");
  if (engine_id == body.end() || !engine_id->is_string() || request_id == body.end() || !request_id->is_string() ||
      blocks == body.end() || !blocks->is_array()) {
    return invalid("kv_pull needs remote_engine_id and remote_request_id (strings) and remote_block_ids (integers)");
  }
  std::vector<int64_t> block_ids;
  block_ids.reserve(blocks->size());
  for (const nlohmann::json& block : *blocks) {
    if (!block.is_number_integer()) return invalid("remote_block_ids must be an array of integers");
    block_ids.push_back(block.get<int64_t>());
  }
  absl::StatusOr<int> pulled = registry_->Pull(engine_id->get_ref<const std::string&>(),
                                               request_id->get_ref<const std::string&>(), block_ids, loop_.NowUs());
  if (!pulled.ok()) {
    metrics_->CountKvPull(absl::IsNotFound(pulled.status()) ? KvPullOutcome::kNotFound : KvPullOutcome::kMismatch);
    return ErrorResponse(pulled.status(), "");
  }
  metrics_->CountKvPull(KvPullOutcome::kOk);
  return JsonResponse(200, absl::StrCat("{\"blocks\":", *pulled, "}"), "");
}

http::HttpResponse EmuService::ServeModels() const {
  nlohmann::ordered_json model;
  model["id"] = options_.engine.model;
  model["object"] = "model";
  model["created"] = started_unix_s_;
  model["owned_by"] = "eldr-engine-emu";
  model["root"] = options_.engine.model;
  model["max_model_len"] = parser_options_.max_model_len;
  nlohmann::ordered_json list;
  list["object"] = "list";
  list["data"] = nlohmann::ordered_json::array({std::move(model)});
  return JsonResponse(200, list.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace), "");
}

absl::Status EmuService::Start() {
  if (absl::Status s = server_->Start(); !s.ok()) return s;
  // The loop's thread starts after the port is known, so no request is prefilled before the
  // engine can advertise it (requests that arrived meanwhile wait in the loop's queue).
  if (prefill_ != nullptr) prefill_->set_advertise_port(server_->port());
  loop_.Start();
  return absl::OkStatus();
}

void EmuService::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (server_ != nullptr) server_->Stop();
  loop_.Stop();
  client_.reset();
}

int EmuService::port() const { return server_ != nullptr ? server_->port() : 0; }

}  // namespace eldr::engine_emu
