#include "eldr/core/policy.h"

#include <map>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace eldr {
namespace {

std::vector<WorkerLoadView> Loads(const std::vector<double>& loads) {
  std::vector<WorkerLoadView> views;
  for (double load : loads) {
    WorkerLoadView view;
    view.load = load;
    views.push_back(view);
  }
  return views;
}

PolicyDecision PickEldr(RoutingPolicy& policy, const std::vector<WorkerLoadView>& workers,
                        const std::vector<WorkerScore>& scores, double tau, double max_load_gap = 0) {
  PolicyInput input;
  input.workers = workers;
  input.candidates = scores;
  input.tau = tau;
  input.max_load_gap = max_load_gap;
  return policy.Pick(input);
}

TEST(PolicyNamesTest, ParseAndName) {
  for (PolicyKind kind :
       {PolicyKind::kEldr, PolicyKind::kRoundRobin, PolicyKind::kRandom, PolicyKind::kJsq, PolicyKind::kP2c}) {
    EXPECT_EQ(*ParsePolicyKind(PolicyKindName(kind)), kind);
    EXPECT_EQ(MakePolicy(kind, 1)->kind(), kind);
  }
  EXPECT_EQ(PolicyKindName(PolicyKind::kRoundRobin), "rr");
  EXPECT_FALSE(ParsePolicyKind("least_loaded").ok());
  EXPECT_EQ(FallbackReasonLabel(FallbackReason::kNone), "");
  EXPECT_EQ(FallbackReasonLabel(FallbackReason::kOverload), "overload");
  EXPECT_EQ(FallbackReasonLabel(FallbackReason::kNoEligibleCentroid), "no_eligible_centroid");
  EXPECT_EQ(FallbackReasonLabel(FallbackReason::kAllUnhealthy), "all_unhealthy");
}

// ---- eldr ----------------------------------------------------------------------------------------

TEST(EldrPolicyTest, BandThenLeastLoaded) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  // Scores 0.90, 0.85, 0.70, 0.88; tau 0.1 -> band {0, 1, 3}; worker 1 is least loaded in it,
  // worker 2 is even less loaded but outside the band.
  const auto workers = Loads({5, 2, 0, 3});
  const std::vector<WorkerScore> scores = {{0, 0.90f}, {1, 0.85f}, {2, 0.70f}, {3, 0.88f}};
  const PolicyDecision d = PickEldr(*policy, workers, scores, 0.1);
  EXPECT_EQ(d.worker, 1);
  EXPECT_EQ(d.band_size, 3);
  EXPECT_FLOAT_EQ(d.best_similarity, 0.90f);
  EXPECT_EQ(d.fallback, FallbackReason::kNone);
  EXPECT_EQ(d.used, PolicyKind::kEldr);
}

TEST(EldrPolicyTest, TauZeroIsPureLocality) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  const auto workers = Loads({100, 0, 0});
  const std::vector<WorkerScore> scores = {{0, 0.91f}, {1, 0.90f}, {2, 0.2f}};
  const PolicyDecision d = PickEldr(*policy, workers, scores, 0.0);
  EXPECT_EQ(d.worker, 0);
  EXPECT_EQ(d.band_size, 1);
}

TEST(EldrPolicyTest, TauOneIsPureLoadBalance) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  const auto workers = Loads({4, 9, 1, 7});
  const std::vector<WorkerScore> scores = {{0, 0.99f}, {1, 0.5f}, {2, 0.0f}, {3, 0.3f}};
  const PolicyDecision d = PickEldr(*policy, workers, scores, 1.0);
  EXPECT_EQ(d.worker, 2);
  EXPECT_EQ(d.band_size, 4);
}

TEST(EldrPolicyTest, CapacityWeightsDivideLoad) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  auto workers = Loads({6, 4});
  workers[0].capacity = 3;  // 6 / 3 = 2 < 4 / 1
  const std::vector<WorkerScore> scores = {{0, 0.8f}, {1, 0.8f}};
  EXPECT_EQ(PickEldr(*policy, workers, scores, 0.1).worker, 0);
  workers[0].capacity = 1;
  EXPECT_EQ(PickEldr(*policy, workers, scores, 0.1).worker, 1);
}

TEST(EldrPolicyTest, IneligibleCandidatesDoNotSetTheBest) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  auto workers = Loads({0, 3, 1});
  workers[0].eligible = false;  // best score but draining
  const std::vector<WorkerScore> scores = {{0, 0.99f}, {1, 0.60f}, {2, 0.45f}};
  const PolicyDecision d = PickEldr(*policy, workers, scores, 0.1);
  EXPECT_EQ(d.worker, 1);
  EXPECT_FLOAT_EQ(d.best_similarity, 0.60f);
  EXPECT_EQ(d.band_size, 1);
}

TEST(EldrPolicyTest, BandMemberAtLimitLeavesTheBand) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  auto workers = Loads({1, 3, 0});
  workers[0].max_inflight = 1;  // at its limit
  const std::vector<WorkerScore> scores = {{0, 0.9f}, {1, 0.85f}, {2, 0.1f}};
  const PolicyDecision d = PickEldr(*policy, workers, scores, 0.1);
  EXPECT_EQ(d.worker, 1);
  EXPECT_EQ(d.fallback, FallbackReason::kNone);
  EXPECT_EQ(d.band_size, 2);
}

TEST(EldrPolicyTest, OverloadSpillsToLeastLoadedOverall) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  auto workers = Loads({4, 4, 6, 5});
  workers[0].max_inflight = 4;
  workers[1].max_inflight = 4;
  const std::vector<WorkerScore> scores = {{0, 0.9f}, {1, 0.88f}, {2, 0.1f}, {3, 0.2f}};
  const PolicyDecision d = PickEldr(*policy, workers, scores, 0.1);
  EXPECT_EQ(d.fallback, FallbackReason::kOverload);
  EXPECT_EQ(d.used, PolicyKind::kJsq);
  EXPECT_EQ(d.worker, 3);  // least loaded below its limit (5 < 6)
  EXPECT_EQ(d.band_size, 2);
  // Everyone at the limit: the request still goes to the least loaded.
  workers[2].max_inflight = 6;
  workers[3].max_inflight = 5;
  workers[0].load = 7;
  workers[0].max_inflight = 4;
  const PolicyDecision all = PickEldr(*policy, workers, scores, 0.1);
  EXPECT_EQ(all.fallback, FallbackReason::kOverload);
  EXPECT_EQ(all.worker, 1);
}

TEST(EldrPolicyTest, LoadGapSpillsOnlyBeyondTheGap) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  // Worker 0 holds the locality; worker 3 is the lightest of the pool.
  auto workers = Loads({12, 20, 9, 4});
  const std::vector<WorkerScore> scores = {{0, 0.9f}, {1, 0.85f}, {2, 0.3f}, {3, 0.2f}};
  const PolicyDecision off = PickEldr(*policy, workers, scores, 0.1, /*max_load_gap=*/0);
  EXPECT_EQ(off.worker, 0);
  EXPECT_EQ(off.fallback, FallbackReason::kNone);
  // 12 - 4 = 8: not more than a gap of 8, the band keeps it.
  const PolicyDecision within = PickEldr(*policy, workers, scores, 0.1, 8);
  EXPECT_EQ(within.worker, 0);
  EXPECT_EQ(within.fallback, FallbackReason::kNone);
  EXPECT_EQ(within.used, PolicyKind::kEldr);
  // A gap of 7 is exceeded: the lightest worker takes it, reported as a jsq decision.
  const PolicyDecision beyond = PickEldr(*policy, workers, scores, 0.1, 7);
  EXPECT_EQ(beyond.worker, 3);
  EXPECT_EQ(beyond.fallback, FallbackReason::kLoadGap);
  EXPECT_EQ(beyond.used, PolicyKind::kJsq);
  EXPECT_EQ(beyond.band_size, 2);
  EXPECT_FLOAT_EQ(beyond.best_similarity, 0.9f);
  EXPECT_EQ(FallbackReasonLabel(FallbackReason::kLoadGap), "load_gap");
  // Loads are compared per unit of capacity, and a worker at its limit is not "the lightest".
  workers[3].max_inflight = 4;
  const PolicyDecision limited = PickEldr(*policy, workers, scores, 0.1, 2);
  EXPECT_EQ(limited.worker, 2);  // 9 is the lightest below its limit; 12 - 9 > 2
  workers[0].capacity = 2;       // 12 / 2 = 6, now itself the lightest below its limit
  const PolicyDecision weighted = PickEldr(*policy, workers, scores, 0.1, 2);
  EXPECT_EQ(weighted.worker, 0);
  EXPECT_EQ(weighted.fallback, FallbackReason::kNone);
}

TEST(EldrPolicyTest, LoadGapDrawsNoRandomNumberWhenItDoesNotSpill) {
  // Equal loads in the band: ties are drawn. With a gap that never triggers, the draws, hence the
  // decisions, are those of the policy without the gap.
  const auto workers = Loads({3, 3, 3, 3});
  const std::vector<WorkerScore> scores = {{0, 0.9f}, {1, 0.9f}, {2, 0.9f}, {3, 0.1f}};
  auto with_gap = MakePolicy(PolicyKind::kEldr, 9);
  auto without = MakePolicy(PolicyKind::kEldr, 9);
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(PickEldr(*with_gap, workers, scores, 0.1, 8).worker, PickEldr(*without, workers, scores, 0.1).worker);
  }
}

TEST(EldrPolicyTest, NoScoresFallsBackToJsqWithCallersReason) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  const auto workers = Loads({3, 1, 2});
  for (FallbackReason reason :
       {FallbackReason::kNoSignature, FallbackReason::kZeroSignature, FallbackReason::kNoCentroids}) {
    PolicyInput input;
    input.workers = workers;
    input.no_scores_reason = reason;
    const PolicyDecision d = policy->Pick(input);
    EXPECT_EQ(d.worker, 1);
    EXPECT_EQ(d.fallback, reason);
    EXPECT_EQ(d.used, PolicyKind::kJsq);
    EXPECT_EQ(d.band_size, 0);
    EXPECT_EQ(d.best_similarity, 0.f);
  }
}

TEST(EldrPolicyTest, NoEligibleCandidateFallsBack) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  auto workers = Loads({0, 5, 2});
  workers[0].eligible = false;
  const std::vector<WorkerScore> scores = {{0, 0.9f}};
  const PolicyDecision d = PickEldr(*policy, workers, scores, 0.1);
  EXPECT_EQ(d.fallback, FallbackReason::kNoEligibleCentroid);
  EXPECT_EQ(d.worker, 2);
}

TEST(EldrPolicyTest, TiesAreRandomButReproducibleForASeed) {
  const auto workers = Loads({1, 1, 1, 1});
  const std::vector<WorkerScore> scores = {{0, 0.5f}, {1, 0.5f}, {2, 0.5f}, {3, 0.5f}};
  auto run = [&](uint64_t seed) {
    auto policy = MakePolicy(PolicyKind::kEldr, seed);
    std::vector<int> picks;
    for (int i = 0; i < 400; ++i) picks.push_back(PickEldr(*policy, workers, scores, 0.0).worker);
    return picks;
  };
  const std::vector<int> a = run(42);
  EXPECT_EQ(a, run(42));
  EXPECT_NE(a, run(43));
  std::map<int, int> histogram;
  for (int w : a) ++histogram[w];
  ASSERT_EQ(histogram.size(), 4u);
  for (const auto& [worker, count] : histogram) EXPECT_GT(count, 60) << worker;  // ~100 each
}

TEST(EldrPolicyTest, NoEligibleWorkerAtAll) {
  auto policy = MakePolicy(PolicyKind::kEldr, 1);
  auto workers = Loads({0, 0});
  workers[0].eligible = workers[1].eligible = false;
  const std::vector<WorkerScore> scores = {{0, 0.9f}};
  EXPECT_EQ(PickEldr(*policy, workers, scores, 0.1).worker, -1);
}

// ---- Baselines ----------------------------------------------------------------------------------

TEST(RoundRobinPolicyTest, CyclesAndSkipsIneligible) {
  auto policy = MakePolicy(PolicyKind::kRoundRobin, 1);
  auto workers = Loads({0, 0, 0, 0});
  workers[2].eligible = false;
  PolicyInput input;
  input.workers = workers;
  std::vector<int> picks;
  for (int i = 0; i < 7; ++i) picks.push_back(policy->Pick(input).worker);
  EXPECT_EQ(picks, (std::vector<int>{0, 1, 3, 0, 1, 3, 0}));
  EXPECT_EQ(policy->Pick(input).used, PolicyKind::kRoundRobin);
  for (auto& w : workers) w.eligible = false;
  EXPECT_EQ(policy->Pick(input).worker, -1);
}

TEST(RandomPolicyTest, UniformOverEligibleAndSeeded) {
  auto workers = Loads({0, 0, 0, 0});
  workers[1].eligible = false;
  PolicyInput input;
  input.workers = workers;
  auto policy = MakePolicy(PolicyKind::kRandom, 7);
  auto again = MakePolicy(PolicyKind::kRandom, 7);
  std::map<int, int> histogram;
  for (int i = 0; i < 3000; ++i) {
    const int w = policy->Pick(input).worker;
    EXPECT_EQ(w, again->Pick(input).worker);
    ++histogram[w];
  }
  EXPECT_EQ(histogram.count(1), 0u);
  for (int w : {0, 2, 3}) EXPECT_NEAR(histogram[w], 1000, 150) << w;
}

TEST(JsqPolicyTest, LeastLoadPerCapacityWithRandomTies) {
  auto policy = MakePolicy(PolicyKind::kJsq, 3);
  auto workers = Loads({3, 2, 2, 5});
  workers[3].capacity = 4;  // 1.25 per capacity
  PolicyInput input;
  input.workers = workers;
  EXPECT_EQ(policy->Pick(input).worker, 3);
  workers[3].capacity = 1;
  std::set<int> seen;
  for (int i = 0; i < 200; ++i) seen.insert(policy->Pick(input).worker);
  EXPECT_EQ(seen, (std::set<int>{1, 2}));
  workers[1].eligible = false;
  EXPECT_EQ(policy->Pick(input).worker, 2);
}

TEST(P2cPolicyTest, TwoDistinctCandidatesLessLoadedWins) {
  // With four workers of distinct loads, p2c never picks the most loaded one (it would need to be
  // drawn twice), and picks the least loaded one exactly when it is drawn: 1/2 of the time.
  auto workers = Loads({0, 1, 2, 3});
  PolicyInput input;
  input.workers = workers;
  auto policy = MakePolicy(PolicyKind::kP2c, 5);
  std::map<int, int> histogram;
  const int n = 6000;
  for (int i = 0; i < n; ++i) ++histogram[policy->Pick(input).worker];
  EXPECT_EQ(histogram[3], 0);
  EXPECT_NEAR(histogram[0], n / 2, 300);
  EXPECT_NEAR(histogram[1], n / 3, 300);
  EXPECT_NEAR(histogram[2], n / 6, 300);
}

TEST(P2cPolicyTest, RespectsEligibilityAndCapacity) {
  auto workers = Loads({0, 8, 9});
  workers[0].eligible = false;
  workers[2].capacity = 3;  // 3 per capacity < 8
  PolicyInput input;
  input.workers = workers;
  auto policy = MakePolicy(PolicyKind::kP2c, 5);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(policy->Pick(input).worker, 2);
  workers[1].eligible = false;
  EXPECT_EQ(policy->Pick(input).worker, 2);  // a single eligible worker
  workers[2].eligible = false;
  EXPECT_EQ(policy->Pick(input).worker, -1);
}

TEST(P2cPolicyTest, ReproducibleForASeed) {
  const auto workers = Loads({1, 1, 2, 2, 3});
  PolicyInput input;
  input.workers = workers;
  auto a = MakePolicy(PolicyKind::kP2c, 99);
  auto b = MakePolicy(PolicyKind::kP2c, 99);
  for (int i = 0; i < 500; ++i) EXPECT_EQ(a->Pick(input).worker, b->Pick(input).worker);
}

// ---- tie break ---------------------------------------------------------------------------------

TEST(TieBreakTest, NamesParseAndPrint) {
  EXPECT_EQ(*ParseTieBreak("random"), TieBreak::kRandom);
  EXPECT_EQ(*ParseTieBreak("lowest_index"), TieBreak::kLowestIndex);
  EXPECT_EQ(TieBreakName(TieBreak::kLowestIndex), "lowest_index");
  EXPECT_EQ(TieBreakName(TieBreak::kRandom), "random");
  EXPECT_EQ(ParseTieBreak("first").status().code(), absl::StatusCode::kInvalidArgument);
}

// lowest_index: among equally loaded band members the lowest worker index wins, whatever order
// the candidates come in (the reference's np.argmin over the band in worker order); random
// spreads the same ties over every tied member.
TEST(TieBreakTest, LowestIndexInTheBandWhateverTheCandidateOrder) {
  const auto workers = Loads({2, 1, 1, 1, 0});
  // Band {1, 2, 3} (worker 4 is idle but far): loads tie at 1.
  const std::vector<WorkerScore> scores = {{3, 0.95f}, {2, 0.93f}, {1, 0.90f}, {0, 0.92f}, {4, 0.1f}};
  auto lowest = MakePolicy(PolicyKind::kEldr, 7, TieBreak::kLowestIndex);
  std::set<int> random_picks;
  auto random = MakePolicy(PolicyKind::kEldr, 7, TieBreak::kRandom);
  for (int n = 0; n < 200; ++n) {
    EXPECT_EQ(PickEldr(*lowest, workers, scores, 0.1).worker, 1);
    random_picks.insert(PickEldr(*random, workers, scores, 0.1).worker);
  }
  EXPECT_EQ(random_picks, (std::set<int>{1, 2, 3}));
}

TEST(TieBreakTest, LowestIndexInJsqSpillAndP2c) {
  const auto workers = Loads({3, 1, 5, 1, 1});
  PolicyInput input;
  input.workers = workers;
  auto jsq = MakePolicy(PolicyKind::kJsq, 3, TieBreak::kLowestIndex);
  for (int n = 0; n < 50; ++n) EXPECT_EQ(jsq->Pick(input).worker, 1);
  // p2c: of two tied draws, the lower index.
  const auto tied = Loads({1, 1});
  PolicyInput pair;
  pair.workers = tied;
  auto p2c = MakePolicy(PolicyKind::kP2c, 3, TieBreak::kLowestIndex);
  for (int n = 0; n < 50; ++n) EXPECT_EQ(p2c->Pick(pair).worker, 0);
  // Spill (every band member at its limit): the least loaded overall, lowest index among ties.
  std::vector<WorkerLoadView> limited = Loads({4, 2, 2, 4});
  limited[0].max_inflight = 4;
  limited[3].max_inflight = 4;
  auto eldr = MakePolicy(PolicyKind::kEldr, 3, TieBreak::kLowestIndex);
  const std::vector<WorkerScore> band = {{3, 0.9f}, {0, 0.9f}, {2, 0.1f}, {1, 0.1f}};
  for (int n = 0; n < 50; ++n) {
    const PolicyDecision d = PickEldr(*eldr, limited, band, 0.05);
    EXPECT_EQ(d.fallback, FallbackReason::kOverload);
    EXPECT_EQ(d.worker, 1);
  }
}

}  // namespace
}  // namespace eldr
