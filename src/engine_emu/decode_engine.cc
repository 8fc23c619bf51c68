#include "engine_emu/decode_engine.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace eldr::engine_emu {
namespace {

// "host:port", with an IPv6 address in brackets.
std::string Origin(const RemotePrefill& remote) {
  if (absl::StrContains(remote.host, ':')) return absl::StrCat("[", remote.host, "]:", remote.port);
  return absl::StrCat(remote.host, ":", remote.port);
}

}  // namespace

absl::Status ValidateDecodeEngineOptions(const DecodeEngineOptions& options) {
  if (absl::Status engine = ValidateEngineOptions(options.engine); !engine.ok()) return engine;
  if (options.max_batch < 1 || options.max_batch > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("--max_batch must be in [1, 1048576], got ", options.max_batch));
  }
  return absl::OkStatus();
}

DecodeEngine::Request::Request(uint64_t handle_in, EngineRequest request_in,
                               std::shared_ptr<http::ResponseStream> stream_in, const std::string& model)
    : handle(handle_in),
      request(std::move(request_in)),
      stream(std::move(stream_in)),
      format(request.api, request.id, request.created, model) {}

DecodeEngine::DecodeEngine(DecodeEngineOptions options, EngineClock* clock, EmuMetrics* metrics, KvPuller* puller)
    : options_(std::move(options)),
      clock_(clock),
      metrics_(metrics),
      puller_(puller),
      counter_(options_.engine.catalog->layers(), options_.engine.catalog->experts(),
               options_.engine.catalog->top_k()) {
  batch_.reserve(options_.max_batch);
  PublishGauges();
}

void DecodeEngine::Submit(uint64_t handle, EngineRequest request, std::shared_ptr<http::ResponseStream> stream) {
  if (requests_.contains(handle)) {
    stream->Respond(ErrorResponse(absl::InternalError("duplicate request handle"), request.id));
    return;
  }
  if (waiting() >= options_.engine.max_waiting) {
    metrics_->CountRequest(RequestOutcome::kRejected);
    stream->Respond(ErrorResponse(absl::ResourceExhaustedError(absl::StrCat(
                                      "the decode queue is full (", options_.engine.max_waiting, " requests waiting)")),
                                  request.id));
    return;
  }
  auto owned = std::make_unique<Request>(handle, std::move(request), std::move(stream), options_.engine.model);
  Request& r = *owned;
  const sim::SimRequest& trace = options_.engine.catalog->request(r.request.trace_index);
  r.prompt_tokens = trace.prompt_tokens;
  if (r.request.max_tokens.has_value()) {
    r.limit = *r.request.max_tokens;
    r.finish = FinishReason::kLength;
  } else {
    r.limit = trace.decode_steps;
    r.finish = FinishReason::kStop;
  }
  requests_.emplace(handle, std::move(owned));
  const double now_us = clock_->NowUs();
  if (r.request.remote_prefill.has_value()) {
    if (puller_ == nullptr) {
      OnKvPulled(handle, absl::UnavailableError("this engine has no KV transfer client"));
      return;
    }
    puller_->Pull(*r.request.remote_prefill, [this, handle](absl::Status status) { OnKvPulled(handle, status); });
  } else {
    // A whole request: this engine prefills it itself first.
    metrics_->CountPrefill(r.prompt_tokens);
    clock_->RunAt(now_us + sim::PrefillUs(options_.engine.cost, r.prompt_tokens) * options_.engine.time_scale,
                  [this, handle] { OnKvReady(handle); });
  }
  PublishGauges();
}

void DecodeEngine::OnKvPulled(uint64_t handle, const absl::Status& status) {
  const auto it = requests_.find(handle);
  if (it == requests_.end()) return;  // aborted meanwhile
  Request& r = *it->second;
  metrics_->CountKvTransfer(status.ok());
  if (!status.ok()) {
    r.stream->Respond(
        ErrorResponse(absl::UnavailableError(absl::StrCat("KV transfer from ", Origin(*r.request.remote_prefill),
                                                          " failed: ", status.message())),
                      r.request.id));
    metrics_->CountRequest(RequestOutcome::kKvFailed);
    requests_.erase(it);
    PublishGauges();
    return;
  }
  clock_->RunAt(clock_->NowUs() + options_.engine.cost.kv_transfer_us * options_.engine.time_scale,
                [this, handle] { OnKvReady(handle); });
}

void DecodeEngine::OnKvReady(uint64_t handle) {
  const auto it = requests_.find(handle);
  if (it == requests_.end()) return;  // aborted meanwhile
  Request& r = *it->second;
  if (r.stream->done()) {
    metrics_->CountRequest(RequestOutcome::kAborted);
    requests_.erase(it);
    PublishGauges();
    return;
  }
  if (r.request.stream) {
    r.stream->Begin(200, "text/event-stream", {{"X-Request-Id", r.request.id}, {"Cache-Control", "no-cache"}});
    if (r.request.api == ApiKind::kChat) {
      std::string role;
      r.format.AppendRoleEvent(&role);
      r.stream->Write(std::move(role));
    }
  }
  r.state = State::kWaiting;
  waiting_.push_back(&r);
  if (!stepping_) StartStep(clock_->NowUs());
  PublishGauges();
}

void DecodeEngine::StartStep(double start_us) {
  while (static_cast<int>(batch_.size()) < options_.max_batch && !waiting_.empty()) {
    Request* r = waiting_.front();
    waiting_.pop_front();
    r->state = State::kRunning;
    batch_.push_back(r);
  }
  if (batch_.empty()) {
    stepping_ = false;
    kv_tokens_ = 0;
    PublishGauges();
    return;
  }
  const TraceCatalog& catalog = *options_.engine.catalog;
  counter_.Reset();
  kv_tokens_ = 0;
  for (const Request* r : batch_) {
    // The k-th step of a request (k = generated + 1) uses the experts of its trace's decode step k - 1.
    counter_.AddToken(catalog.DecodeExperts(r->request.trace_index, r->generated));
    kv_tokens_ += r->prompt_tokens + r->generated;
  }
  DecodeStep step;
  step.start_us = start_us;
  step.batch = static_cast<int>(batch_.size());
  step.distinct_experts = counter_.DistinctAllLayers();
  step.duration_us =
      sim::DecodeStepUs(options_.engine.cost, step.batch, step.distinct_experts) * options_.engine.time_scale;
  stepping_ = true;
  step_end_us_ = start_us + step.duration_us;
  metrics_->CountStep(step.batch, step.distinct_experts, step.duration_us);
  if (options_.on_step) options_.on_step(step);
  clock_->RunAt(step_end_us_, [this] { EndStep(); });
  PublishGauges();
}

void DecodeEngine::EndStep() {
  const double now_us = clock_->NowUs();
  size_t kept = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < batch_.size(); ++i) {
    Request* r = batch_[i];
    // The client went away during the step: its token is not generated.
    if (r->aborted || r->stream->done()) {
      metrics_->CountRequest(RequestOutcome::kAborted);
      requests_.erase(r->handle);
      continue;
    }
    ++tokens;
    if (EmitToken(*r)) {
      metrics_->CountRequest(RequestOutcome::kOk);
      requests_.erase(r->handle);
      continue;
    }
    batch_[kept++] = r;
  }
  batch_.resize(kept);
  metrics_->CountGeneratedTokens(tokens);
  stepping_ = false;
  StartStep(internal::NextStartUs(step_end_us_, now_us, options_.engine.max_catch_up_us));
}

bool DecodeEngine::EmitToken(Request& r) {
  ++r.generated;
  const bool last = r.generated >= r.limit;
  if (r.request.stream) {
    std::string token;  // " t<N>_<k>" fits the small-string buffer: no allocation
    AppendTokenText(r.request.trace_index, r.generated, &token);
    std::string chunk;
    chunk.reserve(last ? 512 : 192);
    r.format.AppendTokenEvent(token, last, r.finish, &chunk);
    if (last) {
      if (r.request.include_usage) r.format.AppendUsageEvent(r.prompt_tokens, r.generated, &chunk);
      AnswerFormatter::AppendDoneEvent(&chunk);
    }
    r.stream->Write(std::move(chunk));
    if (last) r.stream->Finish();
  } else {
    AppendTokenText(r.request.trace_index, r.generated, &r.text);
    if (last) {
      r.stream->Respond(
          JsonResponse(200, r.format.WholeAnswer(r.text, r.finish, r.prompt_tokens, r.generated), r.request.id));
    }
  }
  return last;
}

void DecodeEngine::Abort(uint64_t handle) {
  const auto it = requests_.find(handle);
  if (it == requests_.end()) return;
  Request& r = *it->second;
  if (r.state == State::kRunning) {
    r.aborted = true;  // leaves the batch at the next step boundary
    return;
  }
  if (r.state == State::kWaiting) {
    const auto w = std::find(waiting_.begin(), waiting_.end(), &r);
    if (w != waiting_.end()) waiting_.erase(w);
  }
  // kGettingKv: the pending pull or timer finds nothing when it completes.
  metrics_->CountRequest(RequestOutcome::kAborted);
  requests_.erase(it);
  PublishGauges();
}

void DecodeEngine::PublishGauges() {
  metrics_->SetRunning(running());
  metrics_->SetWaiting(waiting());
  metrics_->SetKvUsage(static_cast<double>(kv_tokens_) / static_cast<double>(options_.engine.kv_capacity_tokens));
}

}  // namespace eldr::engine_emu
