#include "eldr/proxy/ab_split.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "eldr/common/stable_hash.h"

namespace eldr::proxy {

absl::Status ValidateAbSplitOptions(const AbSplitOptions& options) {
  if (!std::isfinite(options.baseline_fraction) || options.baseline_fraction < 0 || options.baseline_fraction > 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("AbSplitOptions.baseline_fraction must be in [0, 1], got %g", options.baseline_fraction));
  }
  const std::string& policy = options.baseline_policy;
  if (policy != "rr" && policy != "random" && policy != "jsq" && policy != "p2c") {
    return absl::InvalidArgumentError(
        absl::StrCat("AbSplitOptions.baseline_policy must be one of rr, random, jsq, "
                     "p2c (eldr-router's load-only policies), got \"",
                     policy, "\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<AbSplitter> AbSplitter::Create(AbSplitOptions options) {
  if (absl::Status status = ValidateAbSplitOptions(options); !status.ok()) return status;
  return AbSplitter(std::move(options));
}

bool AbSplitter::UseBaseline(absl::string_view request_id) const {
  if (options_.baseline_fraction <= 0) return false;
  return StableUnitInterval(request_id, options_.seed) < options_.baseline_fraction;
}

absl::string_view AbSplitter::ArmLabel(bool baseline) const {
  return baseline ? absl::string_view(options_.baseline_policy) : absl::string_view("eldr");
}

}  // namespace eldr::proxy
