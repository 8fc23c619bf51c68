#include "engine_emu/engine.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace eldr::engine_emu {

absl::Status ValidateEngineOptions(const EngineOptions& options) {
  if (absl::Status cost = sim::ValidateCostModel(options.cost); !cost.ok()) return cost;
  if (!std::isfinite(options.time_scale) || options.time_scale <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--time_scale must be a finite number > 0, got ", options.time_scale));
  }
  if (options.model.empty()) return absl::InvalidArgumentError("--model must not be empty");
  if (options.max_waiting < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max_waiting must be >= 1, got ", options.max_waiting));
  }
  if (options.kv_capacity_tokens < 1) {
    return absl::InvalidArgumentError("EngineOptions.kv_capacity_tokens must be >= 1");
  }
  if (!std::isfinite(options.max_catch_up_us) || options.max_catch_up_us < 0) {
    return absl::InvalidArgumentError("EngineOptions.max_catch_up_us must be a finite number >= 0");
  }
  return absl::OkStatus();
}

}  // namespace eldr::engine_emu
