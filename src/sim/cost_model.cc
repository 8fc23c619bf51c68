#include "sim/cost_model.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace eldr::sim {

absl::Status ValidateCostModel(const CostModelOptions& options) {
  const struct {
    const char* name;
    double value;
  } constants[] = {
      {"t_fixed_us", options.t_fixed_us},
      {"t_token_us", options.t_token_us},
      {"t_expert_us", options.t_expert_us},
      {"prefill_fixed_us", options.prefill_fixed_us},
      {"prefill_token_us", options.prefill_token_us},
      {"kv_transfer_us", options.kv_transfer_us},
  };
  for (const auto& c : constants) {
    if (!std::isfinite(c.value) || c.value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cost model: ", c.name, " must be a finite number >= 0, got ", c.value));
    }
  }
  return absl::OkStatus();
}

double DecodeStepUs(const CostModelOptions& options, int batch, int64_t distinct_experts_all_layers) {
  return options.t_fixed_us + options.t_token_us * batch +
         options.t_expert_us * static_cast<double>(distinct_experts_all_layers);
}

double PrefillUs(const CostModelOptions& options, int prompt_tokens) {
  return options.prefill_fixed_us + options.prefill_token_us * prompt_tokens;
}

}  // namespace eldr::sim
