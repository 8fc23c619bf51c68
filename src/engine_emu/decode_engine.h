// The decode role of the engine emulator (docs/engine-emulator.md, "Decode role"): continuous
// batching with the simulator's cost model on the real experts of the traces.
//
// A request first gets its KV: with kv_transfer_params.do_remote_prefill it is pulled from the
// prefill engine (KvPuller), then kv_transfer_us (scaled) passes; a failed pull answers 503
// "KV transfer from <host:port> failed: <why>" before any byte of the answer. Without, it is
// prefilled locally for PrefillUs(prompt_tokens) (scaled). These run concurrently, per request.
// Then the request waits, in the order its KV became ready, for a place in the batch.
//
// The step loop: at each step boundary the requests that ended or went away leave the batch and
// waiting requests are admitted in order up to max_batch; the step then lasts
//   DecodeStepUs(batch, sum over layers of the distinct experts of the batch's current tokens)
//   * time_scale
// where a request's k-th step (k from 1) uses the experts of decode step k - 1 (0-based) of its
// trace request, cyclically; and at its end every request of the batch gets one token, ` t<N>_<k>`.
// A request ends after max_tokens tokens (finish_reason "length"), or, without max_tokens, after
// its trace request's decode steps ("stop"). An idle engine starts a step as soon as a request is
// ready. Steps follow each other at their planned times (see EngineOptions::max_catch_up_us).
//
// Streamed answers (stream: true) send the head (text/event-stream) when the request's KV is
// ready, then one event per token; the last token's event, the usage event (with
// stream_options.include_usage) and `data: [DONE]` go in one write, then the stream finishes.
// Other answers are sent whole when the request ends.
//
// Aborts: a request whose client went away (Abort, or its stream found done at a step boundary)
// leaves the batch at the next step boundary without that step's token; a request still pulling,
// prefilling or waiting leaves at once. Either is counted aborted.
//
// Thread-safety: thread-compatible; every call on the engine's thread (see engine.h).
#ifndef ELDR_ENGINE_EMU_DECODE_ENGINE_H_
#define ELDR_ENGINE_EMU_DECODE_ENGINE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "engine_emu/engine.h"
#include "engine_emu/openai_format.h"
#include "sim/distinct_experts.h"

namespace eldr::engine_emu {

// Pulls a request's KV from its prefill engine (POST /eldr_emu/kv_pull).
class KvPuller {
 public:
  virtual ~KvPuller() = default;
  // Starts the pull of `remote`'s KV; `done` runs once, on the engine's thread and never inside
  // this call, with OK, or an error whose message says why (shown to the client after "KV
  // transfer from <host:port> failed: ").
  virtual void Pull(const RemotePrefill& remote, std::function<void(absl::Status)> done) = 0;
};

// One decode step, as it started.
struct DecodeStep {
  double start_us = 0;
  double duration_us = 0;
  int batch = 0;
  int64_t distinct_experts = 0;  // summed over layers
};

struct DecodeEngineOptions {
  EngineOptions engine;
  // Requests per step at most (--max_batch). >= 1.
  int max_batch = 64;
  // Called at the start of every step (tests, logs); may be empty. Runs on the engine's thread.
  std::function<void(const DecodeStep&)> on_step;
};

// OK, or INVALID_ARGUMENT naming the offending field.
absl::Status ValidateDecodeEngineOptions(const DecodeEngineOptions& options);

class DecodeEngine : public Engine {
 public:
  // `clock`, `metrics` and `puller` must outlive the engine; `puller` may be null (then every
  // request with do_remote_prefill fails 503). ValidateDecodeEngineOptions must accept `options`
  // (checked by the caller).
  DecodeEngine(DecodeEngineOptions options, EngineClock* clock, EmuMetrics* metrics, KvPuller* puller);
  DecodeEngine(const DecodeEngine&) = delete;
  DecodeEngine& operator=(const DecodeEngine&) = delete;

  void Submit(uint64_t handle, EngineRequest request, std::shared_ptr<http::ResponseStream> stream) override;
  void Abort(uint64_t handle) override;
  int64_t running() const override { return static_cast<int64_t>(batch_.size()); }
  int64_t waiting() const override { return static_cast<int64_t>(requests_.size() - batch_.size()); }

  // Whether a step is in progress.
  bool stepping() const { return stepping_; }

 private:
  enum class State { kGettingKv, kWaiting, kRunning };

  struct Request {
    Request(uint64_t handle, EngineRequest request, std::shared_ptr<http::ResponseStream> stream,
            const std::string& model);
    uint64_t handle;
    EngineRequest request;
    std::shared_ptr<http::ResponseStream> stream;
    AnswerFormatter format;
    State state = State::kGettingKv;
    bool aborted = false;
    int prompt_tokens = 0;
    int limit = 0;  // tokens to generate
    FinishReason finish = FinishReason::kStop;
    int generated = 0;
    std::string text;  // non-streamed: the tokens so far
  };

  void OnKvPulled(uint64_t handle, const absl::Status& status);
  void OnKvReady(uint64_t handle);
  // Admits waiting requests and starts a step at `start_us`; leaves the engine idle when the
  // batch stays empty.
  void StartStep(double start_us);
  void EndStep();
  // Emits the next token of `r`; true when it was the last.
  bool EmitToken(Request& r);
  void PublishGauges();

  DecodeEngineOptions options_;
  EngineClock* const clock_;
  EmuMetrics* const metrics_;
  KvPuller* const puller_;
  sim::DistinctExpertCounter counter_;

  absl::flat_hash_map<uint64_t, std::unique_ptr<Request>> requests_;
  std::deque<Request*> waiting_;
  std::vector<Request*> batch_;
  bool stepping_ = false;
  double step_end_us_ = 0;
  int64_t kv_tokens_ = 0;  // prompt + generated tokens of the batch, at the last step start
};

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_DECODE_ENGINE_H_
