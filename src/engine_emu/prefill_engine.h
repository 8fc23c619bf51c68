// The prefill role of the engine emulator (docs/engine-emulator.md, "Prefill role").
//
// Prefills run one at a time in arrival order; each takes PrefillUs(prompt_tokens) of the cost
// model, scaled by time_scale. When one ends, its KV is held in the KvRegistry (block ids, hold
// timeout) and the request is answered with one token (" t<N>_0") and the kv_transfer_params a
// decode engine pulls with, the prompt's expert counts under the selected signature key.
//
// Aborts: a queued request whose client went away leaves the queue at once; the one being
// prefilled runs to its end (a prefill cannot be interrupted) and is then dropped without holding
// its KV. Either is counted aborted.
//
// Thread-safety: thread-compatible; every call on the engine's thread (see engine.h).
#ifndef ELDR_ENGINE_EMU_PREFILL_ENGINE_H_
#define ELDR_ENGINE_EMU_PREFILL_ENGINE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>

#include "engine_emu/engine.h"
#include "engine_emu/kv_registry.h"
#include "engine_emu/openai_format.h"

namespace eldr::engine_emu {

struct PrefillEngineOptions {
  EngineOptions engine;
  // remote_host of the answers (--advertise_host).
  std::string advertise_host = "127.0.0.1";
  // remote_port of the answers: the port the engine's HTTP server listens on (set_advertise_port
  // once it is known).
  int advertise_port = 0;
  // What carries the counts (--signature_key).
  SignatureKey signature_key = SignatureKey::kEldrExpertCounts;
  // Also attach stand-in gate-probability sums (--gate_prob_sums; catalog.h).
  bool gate_prob_sums = false;
};

class PrefillEngine : public Engine {
 public:
  // `clock`, `metrics` and `kv` must outlive the engine. ValidateEngineOptions must accept
  // options.engine (checked by the caller).
  PrefillEngine(PrefillEngineOptions options, EngineClock* clock, EmuMetrics* metrics, KvRegistry* kv);
  PrefillEngine(const PrefillEngine&) = delete;
  PrefillEngine& operator=(const PrefillEngine&) = delete;

  void set_advertise_port(int port) { options_.advertise_port = port; }

  void Submit(uint64_t handle, EngineRequest request, std::shared_ptr<http::ResponseStream> stream) override;
  void Abort(uint64_t handle) override;
  int64_t running() const override { return current_.has_value() ? 1 : 0; }
  int64_t waiting() const override { return static_cast<int64_t>(queue_.size()); }

 private:
  struct Job {
    uint64_t handle = 0;
    EngineRequest request;
    std::shared_ptr<http::ResponseStream> stream;
    bool aborted = false;
  };

  // Starts the next queued prefill at `start_us`, if any.
  void StartNext(double start_us);
  void FinishCurrent();
  void PublishGauges();

  PrefillEngineOptions options_;
  EngineClock* const clock_;
  EmuMetrics* const metrics_;
  KvRegistry* const kv_;

  std::deque<Job> queue_;
  std::optional<Job> current_;
  double current_end_us_ = 0;
};

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_PREFILL_ENGINE_H_
