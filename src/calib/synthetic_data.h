// Synthetic clustered expert counts for benchmarks and tests (not part of the public API).
#ifndef ELDR_CALIB_SYNTHETIC_DATA_H_
#define ELDR_CALIB_SYNTHETIC_DATA_H_

#include <cstdint>

#include "eldr/calib/calibration.h"

namespace eldr {

struct SyntheticDataOptions {
  int requests = 1000;
  int layers = 26;
  int experts = 64;
  int domains = 16;            // latent clusters; labels are the domain of each request
  int hot_experts = 8;         // per domain and layer, experts with a high base count
  bool decode_counts = false;  // also draw decode counts from the same domain profile
  uint64_t seed = 1;
};

// Each domain has, per layer, `hot_experts` experts with base count 4..7 and the rest 0; a request
// draws a domain uniformly, and each of its counts is the base plus uniform noise in 0..3 (decode
// counts: a second, independent draw). Cheap enough for 100,000 x 6,144 counts.
CalibrationData MakeSyntheticCalibrationData(const SyntheticDataOptions& options);

}  // namespace eldr

#endif  // ELDR_CALIB_SYNTHETIC_DATA_H_
