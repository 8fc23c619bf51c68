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
  kNumStats,
};

}  // namespace eldr::capture::internal

#endif  // ELDR_CUDA_CAPTURE_STATS_H_
