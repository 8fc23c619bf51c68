// Internal: indices of the statistics array (uint64 each) kept by both backends, in the order of
// eldr_capture_stats' counters. Free of other includes so that nvcc and g++ share it.
#ifndef ELDR_CUDA_CAPTURE_STATS_H_
#define ELDR_CUDA_CAPTURE_STATS_H_

namespace eldr::capture::internal {

enum StatIndex : int {
  kStatRecorded = 0,
  kStatPadding,
  kStatBadSlots,
  kStatBadExpertIds,
  kStatBadRequests,
  kStatBadBlockIds,
  kStatDuplicateSlots,
  kStatSaturatedAdds,
  kStatSaturatedOutputs,
  kStatBlockResets,
  kStatBadGateProbs,
  kNumStats,
};

// Fraction bits of the direct-mode gate accumulators (64-bit: exact up to 2^39 summed probability).
inline constexpr int kDirectGateFractionBits = 24;
// The most fraction bits of a per-block gate accumulator: float32's 24-bit significand.
inline constexpr int kMaxGateFractionBits = 24;

}  // namespace eldr::capture::internal

#endif  // ELDR_CUDA_CAPTURE_STATS_H_
