// The live A/B split of eldr-proxy: a fixed fraction of requests is routed by a load-only baseline
// policy instead of ELDR's, so that TTFT and TPOT of both arms are measured on the same traffic.
//
// The arm is a function of the request id: u = StableUnitInterval(request_id, seed) in [0, 1);
// the request is a baseline one when u < baseline_fraction. A retried request (same id) stays in
// its arm, every proxy replica with the same seed puts an id in the same arm, and over many ids
// the baseline share converges to the fraction.
//
// Thread-safety: AbSplitter is immutable after Create; every method may run concurrently.
#ifndef ELDR_PROXY_AB_SPLIT_H_
#define ELDR_PROXY_AB_SPLIT_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace eldr::proxy {

struct AbSplitOptions {
  // Share of requests in the baseline arm, finite, [0, 1]. 0 (default): no split, every request
  // is ELDR's; 1: every request is the baseline's.
  double baseline_fraction = 0;
  // The baseline's policy, one of eldr-router's load-only policies: "rr", "random", "jsq", "p2c".
  std::string baseline_policy = "jsq";
  // Hash seed of the split (change it to reshuffle which ids fall in which arm).
  uint64_t seed = 0;
};

// OK, or INVALID_ARGUMENT naming the field ("AbSplitOptions.baseline_fraction must be in [0, 1],
// got 1.5").
absl::Status ValidateAbSplitOptions(const AbSplitOptions& options);

class AbSplitter {
 public:
  // INVALID_ARGUMENT for bad options (ValidateAbSplitOptions).
  static absl::StatusOr<AbSplitter> Create(AbSplitOptions options);

  // Whether the request `request_id` belongs to the baseline arm. Deterministic per id and seed.
  bool UseBaseline(absl::string_view request_id) const;

  // The arm's label for metrics: baseline_policy() for the baseline arm, "eldr" otherwise.
  absl::string_view ArmLabel(bool baseline) const;

  double baseline_fraction() const { return options_.baseline_fraction; }
  const std::string& baseline_policy() const { return options_.baseline_policy; }
  const AbSplitOptions& options() const { return options_; }

 private:
  explicit AbSplitter(AbSplitOptions options) : options_(std::move(options)) {}

  AbSplitOptions options_;
};

}  // namespace eldr::proxy

#endif  // ELDR_PROXY_AB_SPLIT_H_
