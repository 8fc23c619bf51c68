// The simulator's timing model of a prefill/decode-disaggregated MoE pool.
//
// A decode step of a continuous-batching worker is memory-bound: besides a per-step cost and a
// per-token cost, it loads the weights of every distinct expert that the batch's tokens choose, at
// every MoE layer:
//
//   t_step = t_fixed + t_token * batch + sum over layers of t_expert * distinct_experts(layer)
//
// Prefill is compute-bound and grows with the prompt: t_prefill = prefill_fixed + prefill_token *
// prompt_tokens; the KV handoff to the decode worker adds kv_transfer.
//
// The defaults and where each comes from are documented in docs/evaluation.md ("Cost model"): one
// MoE layer of Qwen3-30B-A3B at batch 64 is 4.7x slower with 128 active experts than with 16, and
// cutting the distinct experts per step by 22% cuts TPOT by about 10% (weight loading is about half
// of a step at the reference operating point).
#ifndef ELDR_SIM_COST_MODEL_H_
#define ELDR_SIM_COST_MODEL_H_

#include <cstdint>

#include "absl/status/status.h"

namespace eldr::sim {

struct CostModelOptions {
  // Decode step, microseconds.
  // Per step regardless of batch: attention over the KV cache, dense layers, sampling, launches
  // and communication. Chosen so that weight loading is ~45% of a step at the reference point
  // (batch 32, 95 distinct experts of 128 per layer, 48 layers): 0.22 * 0.45 = 0.10.
  double t_fixed_us = 14600;
  // Per token in the batch: the token-proportional MoE compute. 48 layers * 14.27 expert loads
  // per layer at batch 64 / 64 tokens, so one MoE layer is 4.7x slower with 128 experts than 16.
  double t_token_us = 30;
  // Per distinct expert per layer: one Qwen3-30B-A3B expert (3 x 2048 x 768 bf16 = 9.4 MB) read at
  // H100 HBM bandwidth (3.35 TB/s).
  double t_expert_us = 2.8;

  // Prefill, microseconds: fixed launch cost plus per prompt token (~20k prompt tokens/s for a
  // 3B-active MoE on one H100).
  double prefill_fixed_us = 5000;
  double prefill_token_us = 50;
  // KV cache handoff from the prefill to the decode worker (RDMA), microseconds.
  double kv_transfer_us = 2000;
};

// OK when every constant is finite and >= 0; the message names the bad one.
absl::Status ValidateCostModel(const CostModelOptions& options);

// Duration of one decode step of `batch` tokens whose distinct experts, summed over layers, are
// `distinct_experts_all_layers`.
double DecodeStepUs(const CostModelOptions& options, int batch, int64_t distinct_experts_all_layers);

// Duration of the prefill of a prompt of `prompt_tokens` tokens.
double PrefillUs(const CostModelOptions& options, int prompt_tokens);

}  // namespace eldr::sim

#endif  // ELDR_SIM_COST_MODEL_H_
