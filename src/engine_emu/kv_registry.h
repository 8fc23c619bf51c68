// The KV a prefill engine emulator holds for decode engines to pull (vLLM's NIXL flow: the
// prefill keeps a finished request's KV blocks until the decode engine has read them, or a
// timeout passes). Nothing is stored but the bookkeeping: fresh block ids per request, the
// deadline, and who may pull.
//
// Time is the caller's (microseconds on any monotonic clock, e.g. EngineClock::NowUs), passed to
// every call, so tests drive it. A hold whose deadline passed is never pulled, even before
// ExpireDue has freed it.
//
// Thread-safety: thread-safe (one mutex); kv_pull calls arrive on HTTP threads while the prefill
// engine holds and expires on its own.
#ifndef ELDR_ENGINE_EMU_KV_REGISTRY_H_
#define ELDR_ENGINE_EMU_KV_REGISTRY_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine_emu/metrics.h"

namespace eldr::engine_emu {

struct KvRegistryOptions {
  // The engine's id (--engine_id): a pull naming another engine is refused.
  std::string engine_id;
  // Held KV is freed this long after the prefill ended (--kv_hold_timeout). > 0.
  double hold_timeout_us = 30e6;
  // Tokens per KV block (vLLM's default block size): a prompt of P tokens holds ceil(P / 16) blocks.
  int block_tokens = 16;
  // The KV capacity vllm:kv_cache_usage_perc is relative to, in tokens (held blocks count whole);
  // the simulator's KV budget of one engine (sim::ClusterOptions::kv_budget_tokens).
  int64_t capacity_tokens = 150000;
};

class KvRegistry {
 public:
  // `metrics` (may be null; else it must outlive the registry) gets the freed counts and the
  // eldr_emu_kv_held_requests and vllm:kv_cache_usage_perc gauges.
  KvRegistry(KvRegistryOptions options, EmuMetrics* metrics);
  KvRegistry(const KvRegistry&) = delete;
  KvRegistry& operator=(const KvRegistry&) = delete;

  const std::string& engine_id() const { return options_.engine_id; }
  double hold_timeout_us() const { return options_.hold_timeout_us; }

  // Holds the KV of request `request_id` (a prompt of `prompt_tokens` >= 0 tokens) until it is
  // pulled or `now_us` + hold_timeout_us. Returns its ceil(prompt_tokens / block_tokens) block
  // ids, integers never handed out before. One request id may be held several times (clients
  // reuse X-Request-Id): each hold is pulled on its own, by its block ids.
  std::vector<int64_t> Hold(const std::string& request_id, int prompt_tokens, double now_us);

  // One kv_pull. OK: the number of blocks, and the hold is freed (counted "pulled"). NOT_FOUND
  // when no KV of `request_id` is held (never prefilled here, already pulled, or its deadline
  // passed). FAILED_PRECONDITION when `engine_id` is not this engine's, or `block_ids` are not the
  // blocks of a hold of `request_id` (the hold stays). Frees what is due first (ExpireDue).
  absl::StatusOr<int> Pull(absl::string_view engine_id, absl::string_view request_id,
                           absl::Span<const int64_t> block_ids, double now_us);

  // Frees every hold whose deadline is at or before `now_us` (counted "timeout"); returns how
  // many.
  int ExpireDue(double now_us);

  // The earliest deadline of a hold (possibly of one already pulled: a hint for a timer), or
  // nullopt when nothing is held.
  std::optional<double> NextDeadline() const;

  int64_t held_requests() const;
  int64_t held_blocks() const;

 private:
  struct HeldKv {
    uint64_t seq = 0;
    std::vector<int64_t> blocks;
    double deadline_us = 0;
  };
  struct Deadline {
    double deadline_us;
    std::string request_id;
    uint64_t seq;
  };

  int ExpireDueLocked(double now_us) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(const std::string& request_id, uint64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const KvRegistryOptions options_;
  EmuMetrics* const metrics_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::vector<HeldKv>> held_ ABSL_GUARDED_BY(mu_);
  // Every hold in order of its deadline (Hold is called with non-decreasing times); entries of
  // holds already pulled are skipped when they come due.
  std::deque<Deadline> deadlines_ ABSL_GUARDED_BY(mu_);
  int64_t next_block_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t held_requests_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t held_blocks_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_KV_REGISTRY_H_
