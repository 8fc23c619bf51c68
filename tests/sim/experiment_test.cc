// The experiment driver's pieces: policy and rate lists, work-weighted calibration data, capacity
// and default rates, and a whole small experiment (every policy on the same arrivals).
#include "sim/experiment.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "eldr/core/signature.h"
#include "gtest/gtest.h"
#include "sim/workload.h"

namespace eldr::sim {
namespace {

TEST(ExperimentTest, ParsesPolicyLists) {
  absl::StatusOr<std::vector<PolicySpec>> policies = ParsePolicies("rr, jsq,eldr_refit,eldr");
  ASSERT_TRUE(policies.ok()) << policies.status();
  ASSERT_EQ(policies->size(), 4u);
  EXPECT_EQ((*policies)[0].kind, PolicyKind::kRoundRobin);
  EXPECT_EQ((*policies)[1].kind, PolicyKind::kJsq);
  EXPECT_EQ((*policies)[2].kind, PolicyKind::kEldr);
  EXPECT_TRUE((*policies)[2].refit);
  EXPECT_FALSE((*policies)[3].refit);
  EXPECT_EQ(ParsePolicies("rr,rr").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParsePolicies("least_loaded").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParsePolicies(",").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExperimentTest, ParsesRateLists) {
  absl::StatusOr<std::vector<double>> rates = ParseRates("10, 2.5,100");
  ASSERT_TRUE(rates.ok());
  EXPECT_EQ(*rates, (std::vector<double>{10, 2.5, 100}));
  for (const char* bad : {"", "0", "-3", "x", "5,nan", "inf"}) {
    EXPECT_EQ(ParseRates(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

absl::StatusOr<Workload> Small() {
  SyntheticOptions synthetic;
  synthetic.layers = 8;
  synthetic.experts = 32;
  synthetic.top_k = 4;
  synthetic.domains = 2;
  synthetic.topics_per_domain = 2;
  synthetic.requests = 300;
  synthetic.calibration_requests = 64;
  synthetic.prompt_tokens_mean = 48;
  synthetic.output_tokens_mean = 24;
  return GenerateSyntheticWorkload(synthetic);
}

TEST(ExperimentTest, CapacityAndDefaultRates) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok());
  ClusterOptions cluster;
  cluster.decoders = 4;
  cluster.max_batch = 16;
  const CapacityEstimate capacity = EstimateCapacity(*workload, cluster, 1);
  EXPECT_EQ(capacity.batch, 16);
  EXPECT_GT(capacity.mixed_distinct, 4);  // more than one token's top-4
  EXPECT_LE(capacity.mixed_distinct, 32);
  EXPECT_NEAR(capacity.requests_per_s, 4 * 16 / (capacity.step_ms / 1e3) / capacity.mean_decode_steps, 1e-6);
  const std::vector<double> rates = DefaultRates(capacity);
  ASSERT_EQ(rates.size(), 3u);
  EXPECT_NEAR(rates[0], 0.30 * capacity.requests_per_s, 0.05 * capacity.requests_per_s);
  EXPECT_NEAR(rates[2], 0.80 * capacity.requests_per_s, 0.05 * capacity.requests_per_s);
  EXPECT_LT(rates[0], rates[1]);
  EXPECT_LT(rates[1], rates[2]);

  // A tight KV budget bounds the batch below max_batch.
  cluster.kv_budget_tokens = 200;
  EXPECT_LT(EstimateCapacity(*workload, cluster, 1).batch, 16);
}

TEST(ExperimentTest, EveryPolicyRunsOnTheSameArrivals) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok());
  ExperimentOptions options;
  options.cluster.decoders = 4;
  options.policies = *ParsePolicies("rr,random,jsq,p2c,eldr,eldr_refit");
  options.rates = {30};
  options.requests = 300;
  options.refit.interval_s = 1;
  options.refit.window_s = 5;
  options.refit.min_signatures_per_centroid = 4;
  absl::StatusOr<ExperimentResult> result = RunExperiment(*workload, options);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->cells.size(), 6u);
  const std::vector<RequestRecord>& reference = result->cells[0].run.requests;
  for (const ExperimentCell& cell : result->cells) {
    ASSERT_EQ(cell.run.requests.size(), reference.size()) << cell.policy.name;
    std::set<int> workers;
    for (size_t i = 0; i < reference.size(); ++i) {
      EXPECT_EQ(cell.run.requests[i].pool_index, reference[i].pool_index);
      EXPECT_EQ(cell.run.requests[i].arrival_us, reference[i].arrival_us);
      EXPECT_GE(cell.run.requests[i].finish_us, cell.run.requests[i].first_token_us);
      workers.insert(cell.run.requests[i].worker);
    }
    EXPECT_EQ(workers.size(), 4u) << cell.policy.name << " left a worker idle";
  }
  // rr cycles through the workers in the order requests are routed (when their prefill ends).
  ASSERT_EQ(result->cells[0].policy.name, "rr");
  std::vector<RequestRecord> by_route = result->cells[0].run.requests;
  std::stable_sort(by_route.begin(), by_route.end(),
                   [](const RequestRecord& a, const RequestRecord& b) { return a.routed_us < b.routed_us; });
  for (size_t i = 0; i < by_route.size(); ++i) {
    ASSERT_EQ(by_route[i].worker, static_cast<int>(i % 4)) << "route " << i;
  }
  EXPECT_GT(result->cells[5].run.refits, 0);
  EXPECT_EQ(result->cells[4].run.refits, 0);
  EXPECT_GT(result->cells[4].run.metrics.mean_similarity, 0.5);
  EXPECT_EQ(result->calibration_requests, 64);
  EXPECT_GE(result->calibration_points, 64);
}

// The synthetic prompts' gate-probability sums: per layer they sum to the prompt's tokens (each
// token's softmax over all experts sums to 1), and eldr routes on them with variant gate_prob.
TEST(ExperimentTest, GateProbRoutesOnTheSyntheticGateSums) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok());
  for (const SimRequest& request : workload->pool) {
    ASSERT_EQ(request.prompt_gate_sums.size(), static_cast<size_t>(8 * 32));
    for (int l = 0; l < 8; ++l) {
      double sum = 0;
      for (int e = 0; e < 32; ++e) {
        const float v = request.prompt_gate_sums[l * 32 + e];
        EXPECT_GT(v, 0.0f);  // a softmax gives every expert some probability
        sum += v;
      }
      EXPECT_NEAR(sum, request.prompt_tokens, 1e-3 * request.prompt_tokens);
    }
  }
  ASSERT_EQ(workload->calibration.gate_prob_sums.size(), workload->calibration.prefill_counts.size());

  ExperimentOptions options;
  options.cluster.decoders = 4;
  options.cluster.gate_prob_signatures = true;
  options.variant = SignatureVariant::kGateProb;
  options.policies = *ParsePolicies("jsq,eldr,eldr_refit");
  options.rates = {30};
  options.requests = 300;
  options.refit.interval_s = 1;
  options.refit.window_s = 5;
  options.refit.min_signatures_per_centroid = 4;
  options.refit.min_experts_gain = -1;  // stationary traffic: the locality bound would refuse every refit
  absl::StatusOr<ExperimentResult> result = RunExperiment(*workload, options);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->cells.size(), 3u);
  EXPECT_EQ(result->calibration.mask_steps.size(), 8u) << "gate_prob runs the layer search";
  EXPECT_GT(result->cells[1].run.metrics.mean_similarity, 0.5);
  EXPECT_TRUE(result->cells[1].run.fallbacks.empty()) << "every request has a gate signature";
  EXPECT_GT(result->cells[2].run.refits, 0);
}

}  // namespace
}  // namespace eldr::sim
