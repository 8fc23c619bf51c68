// Real expert-routing traces in NumPy .npy form (data/esft-routing): per domain, a [tokens][L][k]
// uint8 array of chosen expert ids and an int64 offsets array splitting it into sequences.
//
// Also the minimal .npy reader (format 1.0/2.0, little-endian, C order) used for them.
#ifndef ELDR_TRACE_TRACE_H_
#define ELDR_TRACE_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace eldr {

// A parsed .npy array. `dtype` is the descr string, e.g. "|u1", "<i8", "<f4", "<i2", "<i4".
struct NpyArray {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  // raw little-endian element bytes, C order
  int64_t elements() const;
};

// Errors name the file and what is wrong (bad magic, unsupported dtype/order, truncated data).
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);
absl::StatusOr<NpyArray> ParseNpy(absl::Span<const uint8_t> bytes, const std::string& name_for_errors);

// One request: its tokens' expert choices, row-major [tokens][layers][top_k].
struct TraceSequence {
  int domain = 0;           // index into ExpertTrace::domains
  int index_in_domain = 0;  // sequence number within its domain file
  int tokens = 0;
  std::vector<uint8_t> topk;  // tokens * layers * top_k expert ids
};

struct ExpertTrace {
  int layers = 0;
  int experts = 0;  // number of routed experts (ids are < experts)
  int top_k = 0;
  std::vector<std::string> domains;      // file stems, sorted ("intent", "law", ...)
  std::vector<TraceSequence> sequences;  // all domains, in domain then file order
};

// Loads every `<domain>_topk.npy` + `<domain>_offsets.npy` pair of `dir`. `experts` is the number of
// routed experts (ids must be below it; 64 for the bundled DeepSeek-V2-Lite traces).
absl::StatusOr<ExpertTrace> LoadExpertTrace(const std::string& dir, int experts = 64);

// Adds tokens [begin, end) of `seq` to counts [layers][experts] (row-major int32). The range is
// clamped to [0, seq.tokens); nothing is added when counts.size() != layers * experts.
void AccumulateCounts(const ExpertTrace& trace, const TraceSequence& seq, int begin, int end,
                      absl::Span<int32_t> counts);

// The prompt part of a sequence under a prefill fraction: max(1, min(tokens - 1, round(f * tokens))),
// rounding half to even like Python's round(); a non-finite fraction counts as 0.
int PrefillTokens(int tokens, double prefill_fraction);

}  // namespace eldr

#endif  // ELDR_TRACE_TRACE_H_
