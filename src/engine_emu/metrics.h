// The Prometheus series of an engine emulator: the vLLM gauges eldr-router's load scraper reads
// (vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc, label
// model_name), and eldr_emu_* counters of its own.
//
//   eldr_emu_requests_total{role,outcome}      requests answered or ended, by outcome:
//                                              ok, invalid (400/404), rejected (429),
//                                              kv_failed (503: KV pull failed), aborted
//   eldr_emu_requests_aborted_total{role}      clients that went away before the end
//   eldr_emu_prefills_total, eldr_emu_prefill_tokens_total       prefills run (both roles)
//   eldr_emu_decode_steps_total                decode steps run
//   eldr_emu_decode_step_batch_total           sum over steps of the batch size
//   eldr_emu_decode_step_distinct_experts_total  sum over steps of the distinct experts summed
//                                              over layers (mean per step: divide by the steps)
//   eldr_emu_decode_step_seconds_total         sum of the steps' durations (scaled)
//   eldr_emu_generated_tokens_total            tokens sent to clients by decode steps
//   eldr_emu_kv_held_requests                  prefill: requests whose KV is held now
//   eldr_emu_kv_freed_total{reason}            prefill: held KV freed, reason pulled or timeout
//   eldr_emu_kv_pulls_total{outcome}           prefill: kv_pull calls served: ok, not_found,
//                                              mismatch, invalid
//   eldr_emu_kv_transfers_total{outcome}       decode: KV pulls made: ok, failed
//
// Thread-safety: every method may be called from any thread (prometheus-cpp's metrics are atomic).
#ifndef ELDR_ENGINE_EMU_METRICS_H_
#define ELDR_ENGINE_EMU_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "engine_emu/request.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace eldr::engine_emu {

enum class RequestOutcome { kOk, kInvalid, kRejected, kKvFailed, kAborted };
enum class KvFreeReason { kPulled, kTimeout };
enum class KvPullOutcome { kOk, kNotFound, kMismatch, kInvalid };

class EmuMetrics {
 public:
  EmuMetrics(EngineRole role, const std::string& model);
  EmuMetrics(const EmuMetrics&) = delete;
  EmuMetrics& operator=(const EmuMetrics&) = delete;

  void SetRunning(int64_t requests) { running_->Set(static_cast<double>(requests)); }
  void SetWaiting(int64_t requests) { waiting_->Set(static_cast<double>(requests)); }
  // A fraction in [0, 1] (clamped).
  void SetKvUsage(double fraction);
  void SetKvHeld(int64_t requests) { kv_held_->Set(static_cast<double>(requests)); }

  // An aborted request counts in both requests_total{outcome="aborted"} and requests_aborted_total.
  void CountRequest(RequestOutcome outcome);
  void CountPrefill(int prompt_tokens);
  void CountStep(int batch, int64_t distinct_experts_all_layers, double duration_us);
  void CountGeneratedTokens(int64_t tokens) { generated_tokens_->Increment(static_cast<double>(tokens)); }
  void CountKvFreed(KvFreeReason reason);
  void CountKvPull(KvPullOutcome outcome);
  void CountKvTransfer(bool ok) { (ok ? kv_transfer_ok_ : kv_transfer_failed_)->Increment(); }

  // Every series in Prometheus text format (version 0.0.4).
  std::string Serialize() const;

  // The registry, for a caller that adds series of its own.
  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Gauge* running_;
  prometheus::Gauge* waiting_;
  prometheus::Gauge* kv_usage_;
  prometheus::Gauge* kv_held_;
  prometheus::Counter* requests_[5];
  prometheus::Counter* aborted_;
  prometheus::Counter* prefills_;
  prometheus::Counter* prefill_tokens_;
  prometheus::Counter* steps_;
  prometheus::Counter* step_batch_;
  prometheus::Counter* step_distinct_;
  prometheus::Counter* step_seconds_;
  prometheus::Counter* generated_tokens_;
  prometheus::Counter* kv_freed_pulled_;
  prometheus::Counter* kv_freed_timeout_;
  prometheus::Counter* kv_pulls_[4];
  prometheus::Counter* kv_transfer_ok_;
  prometheus::Counter* kv_transfer_failed_;
};

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_METRICS_H_
