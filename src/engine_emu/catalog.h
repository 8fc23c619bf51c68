// Which trace request a request names, and what each trace request brings: the workload every
// engine emulator loads (the same split as eldr-sim), plus the per-request values an emulator
// sends often, computed once (the base64 counts payload of every prompt).
//
// A prompt names its trace request with the marker `eldr-trace:<N>` (decimal, anywhere in the
// text, taken modulo the evaluation pool's size); a prompt without a marker maps to
// FNV-1a-64(prompt text) modulo the pool size. See docs/engine-emulator.md.
//
// Thread-safety: a TraceCatalog is immutable once created; every method may be called from any
// thread. The free functions are pure.
#ifndef ELDR_ENGINE_EMU_CATALOG_H_
#define ELDR_ENGINE_EMU_CATALOG_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "eldr/common/stable_hash.h"  // Fnv1a64
#include "sim/workload.h"

namespace eldr::engine_emu {

// The N of the first `eldr-trace:<N>` in `text` (at least one decimal digit right after the
// colon; an occurrence without one is skipped), modulo `pool_size`, computed digit by digit so
// that any number of digits is fine. nullopt when `text` holds no marker. `pool_size` >= 1.
std::optional<int> ParseTraceMarker(absl::string_view text, int pool_size);

// ParseTraceMarker, else Fnv1a64(text) % pool_size. `pool_size` >= 1.
int TraceIndexForPrompt(absl::string_view text, int pool_size);

// Standard base64 (with padding) of `counts` as little-endian int16, row-major, every value
// clipped to [0, 32767] (the router's int16_le wire format saturates; a count is never negative).
std::string EncodeCountsBase64(absl::Span<const int16_t> counts);

// Standard base64 of the stand-in gate-probability sums of `counts`: count / top_k per cell, as
// little-endian float32, row-major. The bundled traces record which experts each token chose but
// not the router's probabilities, so each of a token's top_k choices is given 1 / top_k (the sums
// of a row then total the prompt's tokens). top_k >= 1.
std::string EncodeGateProbSumsBase64(absl::Span<const int16_t> counts, int top_k);

class TraceCatalog {
 public:
  // Takes the workload (e.g. from sim::LoadTraceWorkload). INVALID_ARGUMENT when it cannot be
  // served: an empty pool, a geometry out of range (layers, top_k >= 1; 1 <= experts <= 256), a
  // request without decode steps, without decode experts, or whose prompt counts are not
  // layers * experts values.
  static absl::StatusOr<std::shared_ptr<const TraceCatalog>> Create(sim::Workload workload);

  const sim::Workload& workload() const { return workload_; }
  int size() const { return static_cast<int>(workload_.pool.size()); }
  int layers() const { return workload_.layers; }
  int experts() const { return workload_.experts; }
  int top_k() const { return workload_.top_k; }

  // 0 <= index < size().
  const sim::SimRequest& request(int index) const { return workload_.pool[index]; }
  // EncodeCountsBase64 of request(index).prompt_counts.
  const std::string& counts_base64(int index) const { return counts_base64_[index]; }
  // EncodeGateProbSumsBase64 of request(index).prompt_counts and top_k().
  const std::string& gate_prob_sums_base64(int index) const { return gate_prob_sums_base64_[index]; }
  // The layers * top_k expert ids of the token of the `step`-th decode step (0-based) of trace
  // request `index`, cyclically beyond its decode steps. `step` >= 0.
  const uint8_t* DecodeExperts(int index, int64_t step) const;

  // TraceIndexForPrompt(prompt_text, size()).
  int IndexForPrompt(absl::string_view prompt_text) const { return TraceIndexForPrompt(prompt_text, size()); }

 private:
  explicit TraceCatalog(sim::Workload workload);

  sim::Workload workload_;
  std::vector<std::string> counts_base64_;
  std::vector<std::string> gate_prob_sums_base64_;
};

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_CATALOG_H_
