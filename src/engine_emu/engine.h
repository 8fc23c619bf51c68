// The engine emulators' common ground: the clock they run on, the options both roles share, and
// the interface the HTTP front end drives (Engine).
//
// An engine is a single-threaded state machine: every call (Submit, Abort, and the callbacks it
// scheduled on its EngineClock) runs on one thread, the engine's, and never concurrently. The
// real binary runs it on an asio io_context of its own (EngineLoop), so HTTP threads hand it work
// by posting; tests run it on a manual clock and advance time by explicit calls, so every
// duration is checked exactly.
//
// Answers go to an http::ResponseStream (thread-safe; see include/eldr/http/http_server.h): the
// engine writes whole answers with Respond, or Begin / Write / Finish for streamed ones.
#ifndef ELDR_ENGINE_EMU_ENGINE_H_
#define ELDR_ENGINE_EMU_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "eldr/http/http_server.h"
#include "engine_emu/catalog.h"
#include "engine_emu/metrics.h"
#include "engine_emu/request.h"
#include "sim/cost_model.h"

namespace eldr::engine_emu {

// Time and timers of an engine.
class EngineClock {
 public:
  virtual ~EngineClock() = default;
  // Microseconds on a monotonic clock (any origin). Callable from any thread.
  virtual double NowUs() const = 0;
  // Runs `callback` once on the engine's thread, at `at_us` or later (as soon as possible when
  // `at_us` is past), never inside this call. Callable on the engine's thread. Callbacks still
  // pending when the clock is destroyed never run.
  virtual void RunAt(double at_us, std::function<void()> callback) = 0;
};

// What both roles share.
struct EngineOptions {
  // The workload; required (the engines' constructors and EmuService::Create need it;
  // ValidateEngineOptions does not look at it, so flags can be checked before it is loaded).
  std::shared_ptr<const TraceCatalog> catalog;
  // The cost model (ValidateCostModel must accept it).
  sim::CostModelOptions cost;
  // Multiplies every simulated duration (prefill, KV transfer, decode step). > 0 and finite.
  double time_scale = 1;
  // The served model name, in every answer.
  std::string model = "deepseek-v2-lite-esft";
  // Queued requests at most (prefill: waiting for their turn; decode: pulling KV, prefilling
  // locally, or waiting for a place in the batch); a request beyond it is answered 429. >= 1.
  int max_waiting = 1024;
  // The KV capacity vllm:kv_cache_usage_perc is relative to, in tokens (the simulator's KV budget
  // of one engine, sim::ClusterOptions::kv_budget_tokens). >= 1.
  int64_t kv_capacity_tokens = 150000;
  // When a scheduled step or prefill end is handled late (a busy thread, a late timer), the next
  // one still starts at the planned time so that timer lateness does not add up, unless the
  // engine is more than this far behind (then it starts now: no burst of back-to-back steps).
  double max_catch_up_us = 2000;
};

// OK, or INVALID_ARGUMENT naming the offending field.
absl::Status ValidateEngineOptions(const EngineOptions& options);

class Engine {
 public:
  virtual ~Engine() = default;

  // Takes a validated request (ParseEngineRequest, with its id and created set) and the stream
  // its answer goes to. `handle` names the request for Abort; unique per engine (a repeated one
  // is answered 500). Answers 429 at once when the queue is full.
  virtual void Submit(uint64_t handle, EngineRequest request, std::shared_ptr<http::ResponseStream> stream) = 0;

  // The client of `handle` went away: the request is dropped (counted aborted) as soon as the
  // role allows (see the roles). Unknown or finished handles are ignored.
  virtual void Abort(uint64_t handle) = 0;

  // Requests being executed (prefill: 0 or 1; decode: the batch) and queued now.
  virtual int64_t running() const = 0;
  virtual int64_t waiting() const = 0;
};

namespace internal {
// The start of the next step (or prefill) planned for `planned_us`, given the clock's `now_us`:
// the planned time unless more than `max_catch_up_us` behind it.
inline double NextStartUs(double planned_us, double now_us, double max_catch_up_us) {
  return now_us - planned_us > max_catch_up_us ? now_us : planned_us;
}
}  // namespace internal

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_ENGINE_H_
