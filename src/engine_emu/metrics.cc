#include "engine_emu/metrics.h"

#include <algorithm>
#include <cmath>

#include "prometheus/family.h"
#include "prometheus/text_serializer.h"

namespace eldr::engine_emu {
namespace {

prometheus::Counter* SingleCounter(prometheus::Registry& registry, const std::string& name, const std::string& help,
                                   const prometheus::Labels& labels = {}) {
  return &prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add(labels);
}

}  // namespace

EmuMetrics::EmuMetrics(EngineRole role, const std::string& model)
    : registry_(std::make_shared<prometheus::Registry>()) {
  const prometheus::Labels model_label = {{"model_name", model}};
  running_ = &prometheus::BuildGauge()
                  .Name("vllm:num_requests_running")
                  .Help("Number of requests in model execution batches.")
                  .Register(*registry_)
                  .Add(model_label);
  waiting_ = &prometheus::BuildGauge()
                  .Name("vllm:num_requests_waiting")
                  .Help("Number of requests waiting to be processed.")
                  .Register(*registry_)
                  .Add(model_label);
  kv_usage_ = &prometheus::BuildGauge()
                   .Name("vllm:kv_cache_usage_perc")
                   .Help("KV-cache usage. 1 means 100 percent usage.")
                   .Register(*registry_)
                   .Add(model_label);
  kv_held_ = &prometheus::BuildGauge()
                  .Name("eldr_emu_kv_held_requests")
                  .Help("Prefill: requests whose KV is held for a decode engine to pull.")
                  .Register(*registry_)
                  .Add({});

  const std::string role_name(RoleName(role));
  auto& requests = prometheus::BuildCounter()
                       .Name("eldr_emu_requests_total")
                       .Help("Requests answered or ended, by outcome.")
                       .Register(*registry_);
  const char* outcomes[] = {"ok", "invalid", "rejected", "kv_failed", "aborted"};
  for (int i = 0; i < 5; ++i) requests_[i] = &requests.Add({{"role", role_name}, {"outcome", outcomes[i]}});
  aborted_ = SingleCounter(*registry_, "eldr_emu_requests_aborted_total",
                           "Requests whose client went away before their end.", {{"role", role_name}});
  prefills_ = SingleCounter(*registry_, "eldr_emu_prefills_total", "Prefills run.");
  prefill_tokens_ = SingleCounter(*registry_, "eldr_emu_prefill_tokens_total", "Prompt tokens prefilled.");
  steps_ = SingleCounter(*registry_, "eldr_emu_decode_steps_total", "Decode steps run.");
  step_batch_ = SingleCounter(*registry_, "eldr_emu_decode_step_batch_total", "Sum over decode steps of the batch.");
  step_distinct_ = SingleCounter(*registry_, "eldr_emu_decode_step_distinct_experts_total",
                                 "Sum over decode steps of the distinct experts of the batch, summed over layers.");
  step_seconds_ = SingleCounter(*registry_, "eldr_emu_decode_step_seconds_total",
                                "Sum of the decode steps' durations (after --time_scale), seconds.");
  generated_tokens_ =
      SingleCounter(*registry_, "eldr_emu_generated_tokens_total", "Tokens sent to clients by decode steps.");
  auto& freed = prometheus::BuildCounter()
                    .Name("eldr_emu_kv_freed_total")
                    .Help("Prefill: held KV freed, by reason.")
                    .Register(*registry_);
  kv_freed_pulled_ = &freed.Add({{"reason", "pulled"}});
  kv_freed_timeout_ = &freed.Add({{"reason", "timeout"}});
  auto& pulls = prometheus::BuildCounter()
                    .Name("eldr_emu_kv_pulls_total")
                    .Help("Prefill: kv_pull calls served, by outcome.")
                    .Register(*registry_);
  const char* pull_outcomes[] = {"ok", "not_found", "mismatch", "invalid"};
  for (int i = 0; i < 4; ++i) kv_pulls_[i] = &pulls.Add({{"outcome", pull_outcomes[i]}});
  auto& transfers = prometheus::BuildCounter()
                        .Name("eldr_emu_kv_transfers_total")
                        .Help("Decode: KV pulls from prefill engines, by outcome.")
                        .Register(*registry_);
  kv_transfer_ok_ = &transfers.Add({{"outcome", "ok"}});
  kv_transfer_failed_ = &transfers.Add({{"outcome", "failed"}});
}

void EmuMetrics::SetKvUsage(double fraction) {
  kv_usage_->Set(std::isfinite(fraction) ? std::clamp(fraction, 0.0, 1.0) : 0.0);
}

void EmuMetrics::CountRequest(RequestOutcome outcome) {
  requests_[static_cast<int>(outcome)]->Increment();
  if (outcome == RequestOutcome::kAborted) aborted_->Increment();
}

void EmuMetrics::CountPrefill(int prompt_tokens) {
  prefills_->Increment();
  prefill_tokens_->Increment(static_cast<double>(std::max(prompt_tokens, 0)));
}

void EmuMetrics::CountStep(int batch, int64_t distinct_experts_all_layers, double duration_us) {
  steps_->Increment();
  step_batch_->Increment(static_cast<double>(batch));
  step_distinct_->Increment(static_cast<double>(distinct_experts_all_layers));
  step_seconds_->Increment(std::max(duration_us, 0.0) * 1e-6);
}

void EmuMetrics::CountKvFreed(KvFreeReason reason) {
  (reason == KvFreeReason::kPulled ? kv_freed_pulled_ : kv_freed_timeout_)->Increment();
}

void EmuMetrics::CountKvPull(KvPullOutcome outcome) { kv_pulls_[static_cast<int>(outcome)]->Increment(); }

std::string EmuMetrics::Serialize() const { return prometheus::TextSerializer().Serialize(registry_->Collect()); }

}  // namespace eldr::engine_emu
