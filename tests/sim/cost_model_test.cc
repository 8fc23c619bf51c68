// The cost model on hand-computed steps, the published facts its defaults reproduce, and a whole
// simulation of two requests on one decode worker whose every event time is computed by hand.
#include "sim/cost_model.h"

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "sim/routing_backend.h"
#include "sim/simulator.h"
#include "sim/workload.h"

namespace eldr::sim {
namespace {

TEST(CostModelTest, DecodeStepIsFixedPlusTokensPlusDistinctExperts) {
  CostModelOptions cost;
  cost.t_fixed_us = 1000;
  cost.t_token_us = 10;
  cost.t_expert_us = 2;
  EXPECT_DOUBLE_EQ(DecodeStepUs(cost, 3, 7), 1000 + 3 * 10 + 7 * 2);
  EXPECT_DOUBLE_EQ(DecodeStepUs(cost, 64, 48 * 128), 1000 + 640 + 2 * 6144);
  EXPECT_DOUBLE_EQ(DecodeStepUs(cost, 0, 0), 1000);
}

TEST(CostModelTest, PrefillGrowsWithPromptTokens) {
  CostModelOptions cost;
  cost.prefill_fixed_us = 5000;
  cost.prefill_token_us = 50;
  EXPECT_DOUBLE_EQ(PrefillUs(cost, 0), 5000);
  EXPECT_DOUBLE_EQ(PrefillUs(cost, 512), 5000 + 512 * 50);
}

TEST(CostModelTest, ValidationNamesTheBadConstant) {
  CostModelOptions cost;
  EXPECT_TRUE(ValidateCostModel(cost).ok());
  cost.t_expert_us = -1;
  absl::Status status = ValidateCostModel(cost);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("t_expert_us"), absl::string_view::npos) << status;
  cost = CostModelOptions();
  cost.t_fixed_us = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(ValidateCostModel(cost).message().find("t_fixed_us"), absl::string_view::npos);
}

// One MoE layer of Qwen3-30B-A3B (48 layers) at batch 64: the token-proportional MoE compute of
// one layer is t_token * 64 / 48; 128 active experts must be ~4.7x slower than 16.
TEST(CostModelTest, DefaultsReproduceTheMoeLayerMeasurement) {
  const CostModelOptions cost;
  const double per_layer_tokens = cost.t_token_us * 64 / 48;
  const double ratio = (per_layer_tokens + 128 * cost.t_expert_us) / (per_layer_tokens + 16 * cost.t_expert_us);
  EXPECT_NEAR(ratio, 4.7, 0.05);
}

// At the reference operating point (batch 32, 95 distinct experts per layer, 48 layers: what the
// load balancers reach on the synthetic 48x128 workload at moderate load), 22% fewer distinct
// experts must cut the step by about 10%.
TEST(CostModelTest, DefaultsMakeWeightLoadingAboutHalfAStep) {
  const CostModelOptions cost;
  const int64_t distinct = 48 * 95;
  const double before = DecodeStepUs(cost, 32, distinct);
  const double after = DecodeStepUs(cost, 32, std::llround(distinct * 0.78));
  EXPECT_NEAR(1 - after / before, 0.10, 0.005);
}

// Two requests, one prefill server, one decode worker, one layer of 4 experts, top-1:
//   A arrives at 0, prefill 0..100, routed at 100, decodes experts [0], [1].
//   B arrives at 0, waits for the prefill server, prefill 100..200, decodes experts [1], [2].
//   step 1 (A alone, {0}):          100 .. 100 + 1000 + 10 + 100 = 1210   A's first token
//   B joins at the step boundary:  step 2 (A {1}, B {1}) = 1000 + 20 + 100: 1210 .. 2330
//                                   A finishes, B's first token
//   step 3 (B alone, {2}):          2330 .. 3440                          B finishes
TEST(SimulatorTest, HandComputedTwoRequestRun) {
  Workload workload;
  workload.layers = 1;
  workload.experts = 4;
  workload.top_k = 1;
  workload.domains = {"only"};
  workload.generated_tokens = {{0, 1}, {1, 2}};
  for (int r = 0; r < 2; ++r) {
    SimRequest request;
    request.prompt_tokens = 1;
    request.decode_steps = 2;
    request.prompt_counts = {1, 0, 0, 0};
    request.decode_topk = workload.generated_tokens[r].data();
    workload.pool.push_back(request);
  }
  const std::vector<Arrival> arrivals = {{0.0, 0}, {0.0, 1}};

  ClusterOptions cluster;
  cluster.decoders = 1;
  cluster.prefill_workers = 1;
  cluster.max_batch = 8;
  cluster.warmup_fraction = 0;
  cluster.cooldown_fraction = 0;
  cluster.cost.t_fixed_us = 1000;
  cluster.cost.t_token_us = 10;
  cluster.cost.t_expert_us = 100;
  cluster.cost.prefill_fixed_us = 100;
  cluster.cost.prefill_token_us = 0;
  cluster.cost.kv_transfer_us = 0;

  absl::StatusOr<std::unique_ptr<RoutingBackend>> backend = MakeInProcessBackend(PolicyKind::kJsq, 0.1, 1, 1, 0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  absl::StatusOr<RunResult> run = SimulateRun(workload, arrivals, cluster, backend->get(), nullptr);
  ASSERT_TRUE(run.ok()) << run.status();

  const RequestRecord& a = run->requests[0];
  const RequestRecord& b = run->requests[1];
  EXPECT_DOUBLE_EQ(a.routed_us, 100);
  EXPECT_DOUBLE_EQ(b.routed_us, 200);
  EXPECT_DOUBLE_EQ(a.first_token_us, 1210);
  EXPECT_DOUBLE_EQ(a.finish_us, 2330);
  EXPECT_DOUBLE_EQ(b.first_token_us, 2330);
  EXPECT_DOUBLE_EQ(b.finish_us, 3440);

  const RunMetrics& m = run->metrics;
  EXPECT_EQ(m.measured_requests, 2);
  // TPOT: A (2330 - 1210) / 1 = 1.12 ms, B (3440 - 2330) / 1 = 1.11 ms; TTFT 1.21 and 2.33 ms.
  ASSERT_EQ(m.tpot_ms.size(), 2u);
  EXPECT_DOUBLE_EQ(m.tpot_ms[0], 1.12);
  EXPECT_DOUBLE_EQ(m.tpot_ms[1], 1.11);
  EXPECT_DOUBLE_EQ(m.tpot_p50_ms, 1.115);
  EXPECT_DOUBLE_EQ(m.ttft_p50_ms, (1.21 + 2.33) / 2);
  // The reference's TTFT ends with prefill: 0.1 and 0.2 ms.
  EXPECT_DOUBLE_EQ(m.ttft_prefill_p50_ms, (0.1 + 0.2) / 2);
  EXPECT_DOUBLE_EQ(m.ttft_prefill_p99_ms, 0.1 + 0.99 * (0.2 - 0.1));
  // The measured window is the span of the measured arrivals (both at 0): the step starting at
  // 100 falls outside it, so no step is averaged; the run is still complete.
  EXPECT_DOUBLE_EQ(run->simulated_seconds, 3440e-6);
}

// The same pipeline with a KV budget that fits one request at a time: B waits for A's release.
TEST(SimulatorTest, KvBudgetSerialisesRequests) {
  Workload workload;
  workload.layers = 1;
  workload.experts = 4;
  workload.top_k = 1;
  workload.domains = {"only"};
  workload.generated_tokens = {{0, 1}, {1, 2}};
  for (int r = 0; r < 2; ++r) {
    SimRequest request;
    request.prompt_tokens = 1;
    request.decode_steps = 2;
    request.prompt_counts = {1, 0, 0, 0};
    request.decode_topk = workload.generated_tokens[r].data();
    workload.pool.push_back(request);
  }
  ClusterOptions cluster;
  cluster.decoders = 1;
  cluster.prefill_workers = 2;
  cluster.kv_budget_tokens = 3;  // one request reserves prompt + decode = 3 tokens
  cluster.warmup_fraction = 0;
  cluster.cooldown_fraction = 0;
  cluster.cost.t_fixed_us = 1000;
  cluster.cost.t_token_us = 0;
  cluster.cost.t_expert_us = 0;
  cluster.cost.prefill_fixed_us = 100;
  cluster.cost.prefill_token_us = 0;
  cluster.cost.kv_transfer_us = 0;
  absl::StatusOr<std::unique_ptr<RoutingBackend>> backend = MakeInProcessBackend(PolicyKind::kRoundRobin, 0.1, 1, 1, 0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  absl::StatusOr<RunResult> run = SimulateRun(workload, {{0.0, 0}, {0.0, 1}}, cluster, backend->get(), nullptr);
  ASSERT_TRUE(run.ok()) << run.status();
  // Both prefills end at 100; A runs 100..1100..2100, then B 2100..3100..4100.
  EXPECT_DOUBLE_EQ(run->requests[0].finish_us, 2100);
  EXPECT_DOUBLE_EQ(run->requests[1].first_token_us, 3100);
  EXPECT_DOUBLE_EQ(run->requests[1].finish_us, 4100);
}

TEST(SimulatorTest, PercentileInterpolatesLikeNumpy) {
  EXPECT_DOUBLE_EQ(Percentile({}, 50), 0);
  EXPECT_DOUBLE_EQ(Percentile({3, 1, 2}, 50), 2);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4}, 50), 2.5);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 90), 9.1);
  EXPECT_DOUBLE_EQ(Percentile({5}, 99), 5);
}

}  // namespace
}  // namespace eldr::sim
