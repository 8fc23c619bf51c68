#include "engine_emu/prefill_engine.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace eldr::engine_emu {

PrefillEngine::PrefillEngine(PrefillEngineOptions options, EngineClock* clock, EmuMetrics* metrics, KvRegistry* kv)
    : options_(std::move(options)), clock_(clock), metrics_(metrics), kv_(kv) {
  PublishGauges();
}

void PrefillEngine::Submit(uint64_t handle, EngineRequest request, std::shared_ptr<http::ResponseStream> stream) {
  const bool duplicate = (current_.has_value() && current_->handle == handle) ||
                         std::any_of(queue_.begin(), queue_.end(), [&](const Job& j) { return j.handle == handle; });
  if (duplicate) {
    stream->Respond(ErrorResponse(absl::InternalError("duplicate request handle"), request.id));
    return;
  }
  if (static_cast<int64_t>(queue_.size()) >= options_.engine.max_waiting) {
    metrics_->CountRequest(RequestOutcome::kRejected);
    stream->Respond(
        ErrorResponse(absl::ResourceExhaustedError(absl::StrCat("the prefill queue is full (",
                                                                options_.engine.max_waiting, " requests waiting)")),
                      request.id));
    return;
  }
  queue_.push_back(Job{handle, std::move(request), std::move(stream), false});
  if (!current_.has_value()) StartNext(clock_->NowUs());
  PublishGauges();
}

void PrefillEngine::Abort(uint64_t handle) {
  if (current_.has_value() && current_->handle == handle) {
    current_->aborted = true;  // dropped when its prefill ends
    return;
  }
  const auto it = std::find_if(queue_.begin(), queue_.end(), [&](const Job& j) { return j.handle == handle; });
  if (it == queue_.end()) return;
  queue_.erase(it);
  metrics_->CountRequest(RequestOutcome::kAborted);
  PublishGauges();
}

void PrefillEngine::StartNext(double start_us) {
  if (queue_.empty()) return;
  current_ = std::move(queue_.front());
  queue_.pop_front();
  const int prompt_tokens = options_.engine.catalog->request(current_->request.trace_index).prompt_tokens;
  current_end_us_ = start_us + sim::PrefillUs(options_.engine.cost, prompt_tokens) * options_.engine.time_scale;
  clock_->RunAt(current_end_us_, [this] { FinishCurrent(); });
}

void PrefillEngine::FinishCurrent() {
  Job job = *std::move(current_);
  current_.reset();
  const TraceCatalog& catalog = *options_.engine.catalog;
  const int index = job.request.trace_index;
  const int prompt_tokens = catalog.request(index).prompt_tokens;
  metrics_->CountPrefill(prompt_tokens);
  const double now_us = clock_->NowUs();
  if (job.aborted || job.stream->done()) {
    metrics_->CountRequest(RequestOutcome::kAborted);
  } else {
    PrefillKvParams kv;
    kv.engine_id = kv_->engine_id();
    kv.request_id = job.request.id;
    kv.block_ids = kv_->Hold(job.request.id, prompt_tokens, now_us);
    kv.host = options_.advertise_host;
    kv.port = options_.advertise_port;
    kv.signature_key = options_.signature_key;
    kv.layers = catalog.layers();
    kv.experts = catalog.experts();
    kv.counts_base64 = catalog.counts_base64(index);
    if (options_.gate_prob_sums) kv.gate_prob_sums_base64 = catalog.gate_prob_sums_base64(index);
    // One timer per hold, at its deadline; the registry frees whatever is due then.
    clock_->RunAt(now_us + kv_->hold_timeout_us(), [this] { kv_->ExpireDue(clock_->NowUs()); });
    const AnswerFormatter format(job.request.api, job.request.id, job.request.created, options_.engine.model);
    std::string text;
    AppendTokenText(index, 0, &text);
    job.stream->Respond(JsonResponse(200,
                                     format.WholeAnswer(text, FinishReason::kLength, prompt_tokens,
                                                        /*completion_tokens=*/1, &kv),
                                     job.request.id));
    metrics_->CountRequest(RequestOutcome::kOk);
  }
  StartNext(internal::NextStartUs(current_end_us_, now_us, options_.engine.max_catch_up_us));
  PublishGauges();
}

void PrefillEngine::PublishGauges() {
  metrics_->SetRunning(running());
  metrics_->SetWaiting(waiting());
}

}  // namespace eldr::engine_emu
