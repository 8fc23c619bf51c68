// Drift scenarios, the oracle, per-phase figures and the independence of every policy's run from
// the others: each scenario's change happens at its arrival, the phases split the measured
// requests, the oracle never leaves its domain's group, and eldr's results do not depend on which
// other policies ran, or in which order.
#include "sim/drift.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "sim/experiment.h"
#include "sim/routing_backend.h"
#include "sim/workload.h"

namespace eldr::sim {
namespace {

constexpr int kDecoders = 4;

absl::StatusOr<Workload> Small(uint64_t seed = 3) {
  SyntheticOptions synthetic;
  synthetic.layers = 8;
  synthetic.experts = 32;
  synthetic.top_k = 4;
  synthetic.domains = 2;
  synthetic.topics_per_domain = 2;
  synthetic.requests = 400;
  synthetic.calibration_requests = 96;
  synthetic.prompt_tokens_mean = 48;
  synthetic.output_tokens_mean = 24;
  synthetic.seed = seed;
  return GenerateSyntheticWorkload(synthetic);
}

ExperimentOptions Options(const std::string& policies, DriftScenario scenario = DriftScenario::kNone) {
  ExperimentOptions options;
  options.cluster.decoders = kDecoders;
  options.policies = *ParsePolicies(policies);
  options.rates = {40, 80};
  options.requests = 400;
  options.max_inflight = 16;
  options.refit.interval_s = 1;
  options.refit.window_s = 4;
  options.refit.min_signatures_per_centroid = 4;
  options.drift.scenario = scenario;
  return options;
}

const ExperimentCell* Find(const ExperimentResult& result, const std::string& policy, double rate) {
  for (const ExperimentCell& cell : result.cells) {
    if (cell.policy.name == policy && cell.rate == rate) return &cell;
  }
  return nullptr;
}

// Every route of `cell` as (worker, finish time, similarity), to compare runs decision by decision.
std::vector<std::tuple<int, double, float>> Decisions(const ExperimentCell& cell) {
  std::vector<std::tuple<int, double, float>> out;
  for (const RequestRecord& record : cell.run.requests)
    out.emplace_back(record.worker, record.finish_us, record.similarity);
  return out;
}

TEST(PolicyIndependenceTest, EldrIsTheSameWithAndWithoutEldrRefitAndInAnyOrder) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok()) << workload.status();
  absl::StatusOr<ExperimentResult> with_refit = RunExperiment(*workload, Options("jsq,eldr,eldr_refit,p2c"));
  absl::StatusOr<ExperimentResult> without = RunExperiment(*workload, Options("eldr,jsq"));
  absl::StatusOr<ExperimentResult> reordered = RunExperiment(*workload, Options("eldr_refit,p2c,eldr"));
  ASSERT_TRUE(with_refit.ok()) << with_refit.status();
  ASSERT_TRUE(without.ok()) << without.status();
  ASSERT_TRUE(reordered.ok()) << reordered.status();
  for (double rate : {40.0, 80.0}) {
    const ExperimentCell* a = Find(*with_refit, "eldr", rate);
    const ExperimentCell* b = Find(*without, "eldr", rate);
    const ExperimentCell* c = Find(*reordered, "eldr", rate);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(Decisions(*a), Decisions(*b)) << "rate " << rate;
    EXPECT_EQ(Decisions(*a), Decisions(*c)) << "rate " << rate;
    EXPECT_EQ(a->run.metrics.tpot_p50_ms, b->run.metrics.tpot_p50_ms);
    EXPECT_EQ(a->run.metrics.tpot_p99_ms, c->run.metrics.tpot_p99_ms);
    EXPECT_EQ(a->run.fallbacks, b->run.fallbacks);
    // And so is every other policy's.
    EXPECT_EQ(Decisions(*Find(*with_refit, "jsq", rate)), Decisions(*Find(*without, "jsq", rate)));
    EXPECT_EQ(Decisions(*Find(*with_refit, "eldr_refit", rate)), Decisions(*Find(*reordered, "eldr_refit", rate)));
    EXPECT_EQ(Decisions(*Find(*with_refit, "p2c", rate)), Decisions(*Find(*reordered, "p2c", rate)));
  }
  // eldr_refit did refit, so its routes differ from eldr's: the equality above is not trivial.
  EXPECT_GT(Find(*with_refit, "eldr_refit", 80)->run.refits, 0);
  EXPECT_NE(Decisions(*Find(*with_refit, "eldr_refit", 80)), Decisions(*Find(*with_refit, "eldr", 80)));
}

TEST(DomainGroupsTest, ApportionsWorkersByWorkShare) {
  using Groups = std::vector<std::vector<int>>;
  EXPECT_EQ(DomainGroups({1, 1, 1, 1}, 4), (Groups{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(DomainGroups({1, 1}, 4), (Groups{{0, 1}, {2, 3}}));
  // 3 : 1 on four workers: 3/1, 3/2, then 3/3 ties 1/1 (the lower domain wins), then 1/1 > 3/4.
  EXPECT_EQ(DomainGroups({3, 1}, 4), (Groups{{0, 1, 2}, {3}}));
  // A zero share gets no group.
  EXPECT_EQ(DomainGroups({0, 2, 1}, 3), (Groups{{}, {0, 1}, {2}}));
  // Work shares of mix_shift's first phase on the real traces: law takes three workers (0.61 / 3 =
  // 0.20 per worker > summary's 0.18 when the third is given), summary the fourth; intent joins
  // the block with less work per worker (summary's 0.18 < 0.20), then translation law's (0.20 <
  // 0.33).
  EXPECT_EQ(DomainGroups({0.156, 0.61, 0.176, 0.056}, 4), (Groups{{3}, {0, 1, 2}, {3}, {0, 1, 2}}));
  // Fewer workers than domains: the two largest are seated, the others share.
  EXPECT_EQ(DomainGroups({4, 3, 2, 1}, 2), (Groups{{0}, {1}, {1}, {0}}));
  EXPECT_EQ(DomainGroups({0, 0}, 3), (Groups{{}, {}}));
}

// The decode work per domain of arrivals [begin, end).
std::vector<double> WorkShares(const Workload& workload, const std::vector<Arrival>& arrivals, int begin, int end) {
  std::vector<double> shares(workload.domains.size(), 0);
  for (int i = begin; i < end; ++i) {
    const SimRequest& request = workload.pool[arrivals[i].request];
    shares[request.domain] += request.decode_steps;
  }
  return shares;
}

TEST(OracleTest, NeverRoutesOutsideItsDomainsGroup) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok());
  for (DriftScenario scenario : {DriftScenario::kNone, DriftScenario::kMixShift}) {
    ExperimentOptions options = Options("oracle,jsq", scenario);
    absl::StatusOr<ExperimentResult> result = RunExperiment(*workload, options);
    ASSERT_TRUE(result.ok()) << result.status();
    for (double rate : options.rates) {
      const std::vector<Arrival> arrivals =
          MakeDriftArrivals(*workload, result->drift, rate, options.requests, options.seed);
      const int change = scenario == DriftScenario::kNone ? options.requests : result->drift.change_arrival;
      const double change_us = change < options.requests ? arrivals[change].time_us : 1e300;
      const std::vector<std::vector<int>> before = DomainGroups(WorkShares(*workload, arrivals, 0, change), kDecoders);
      const std::vector<std::vector<int>> after =
          DomainGroups(WorkShares(*workload, arrivals, change, options.requests), kDecoders);
      const ExperimentCell* oracle = Find(*result, "oracle", rate);
      ASSERT_NE(oracle, nullptr);
      std::set<int> used;
      for (const RequestRecord& record : oracle->run.requests) {
        const int domain = workload->pool[record.pool_index].domain;
        const std::vector<int>& group = (record.routed_us < change_us ? before : after)[domain];
        ASSERT_FALSE(group.empty());
        EXPECT_NE(std::find(group.begin(), group.end(), record.worker), group.end())
            << "request of domain " << domain << " routed to worker " << record.worker;
        used.insert(record.worker);
      }
      EXPECT_EQ(used.size(), static_cast<size_t>(kDecoders));
      // Not a load balancer: it is compared with them.
      EXPECT_TRUE(oracle->policy.oracle);
    }
  }
  // The oracle is one router.
  ExperimentOptions replicated = Options("oracle");
  replicated.setups = {ReplicaSetup{3, true}};
  EXPECT_EQ(RunExperiment(*workload, replicated).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DriftTest, MixShiftSwapsTheDominantDomainsAtTheChange) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok());
  DriftOptions drift;
  drift.scenario = DriftScenario::kMixShift;
  drift.change_fraction = 0.5;
  drift.dominant_share = 0.9;
  absl::StatusOr<DriftPlan> plan = PlanDrift(*workload, drift, 2000, kDecoders, ClusterOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->change_arrival, 1000);
  ASSERT_EQ(plan->phase_domain_shares.size(), 2u);
  EXPECT_NEAR(plan->phase_domain_shares[0][0], 0.9, 1e-12);
  EXPECT_NEAR(plan->phase_domain_shares[0][1], 0.1, 1e-12);
  EXPECT_NEAR(plan->phase_domain_shares[1][0], 0.1, 1e-12);
  EXPECT_NEAR(plan->phase_domain_shares[1][1], 0.9, 1e-12);
  const std::vector<Arrival> arrivals = MakeDriftArrivals(*workload, *plan, 50, 2000, 1);
  int first_before = 0, first_after = 0;
  for (int i = 0; i < 2000; ++i) {
    const bool first_domain = workload->pool[arrivals[i].request].domain == 0;
    (i < 1000 ? first_before : first_after) += first_domain ? 1 : 0;
  }
  EXPECT_NEAR(first_before, 900, 60);
  EXPECT_NEAR(first_after, 100, 60);
  // The synthetic pool is used without replacement while a domain has unused requests.
  std::map<int, int> uses;
  for (int i = 0; i < 150; ++i) ++uses[arrivals[i].request];  // ~135 of domain 0's ~200
  for (const auto& [request, count] : uses) EXPECT_EQ(count, 1) << request;
  // Each phase's rate offers the pool's decode work per second: the gaps scale by the phase's mix.
  for (int phase = 0; phase < 2; ++phase) {
    double decode = 0, pool_decode = 0;
    for (int d = 0; d < 2; ++d) {
      double sum = 0;
      int n = 0;
      for (const SimRequest& request : workload->pool) {
        if (request.domain != d) continue;
        sum += request.decode_steps;
        ++n;
      }
      decode += plan->phase_domain_shares[phase][d] * sum / n;
      pool_decode += sum;
    }
    EXPECT_NEAR(plan->phase_rate_scale[phase], pool_decode / workload->pool.size() / decode, 1e-9);
  }
  // Deterministic, and the same as the undrifted sequence without a mix scenario.
  EXPECT_EQ(MakeDriftArrivals(*workload, *plan, 50, 2000, 1)[1234].request, arrivals[1234].request);
  DriftPlan none;
  const std::vector<Arrival> plain = MakeDriftArrivals(*workload, none, 50, 300, 1);
  const std::vector<Arrival> reference = MakeArrivals(*workload, 50, 300, 1);
  for (int i = 0; i < 300; ++i) {
    EXPECT_EQ(plain[i].request, reference[i].request);
    EXPECT_EQ(plain[i].time_us, reference[i].time_us);
  }
}

// --drift_calibration=before: eldr is calibrated on the split subsampled to the mix before the
// change (the operator calibrated on the traffic of the day, which then shifted).
TEST(DriftTest, MixShiftCanCalibrateOnTheMixBeforeTheChange) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok());
  const std::vector<int>& labels = workload->calibration.labels;
  const int first = static_cast<int>(std::count(labels.begin(), labels.end(), 0));
  const int second = static_cast<int>(std::count(labels.begin(), labels.end(), 1));
  ASSERT_GT(first, 20);
  ASSERT_GT(second, 20);

  // The largest subset in proportion 9 : 1: every request of the first domain, a ninth as many of
  // the second (its first ones, in order).
  const CalibrationData subset = WithDomainShares(workload->calibration, {0.9, 0.1});
  const int kept_second = static_cast<int>(std::floor(first / 0.9 * 0.1 + 1e-9));
  EXPECT_EQ(subset.n, first + kept_second);
  EXPECT_EQ(std::count(subset.labels.begin(), subset.labels.end(), 0), first);
  EXPECT_EQ(std::count(subset.labels.begin(), subset.labels.end(), 1), kept_second);
  // The other way round the second domain limits it.
  const CalibrationData reversed = WithDomainShares(workload->calibration, {0.1, 0.9});
  EXPECT_EQ(std::count(reversed.labels.begin(), reversed.labels.end(), 1), second);
  // No shares: the data as it is.
  EXPECT_EQ(WithDomainShares(workload->calibration, {}).n, workload->calibration.n);

  ExperimentOptions options = Options("jsq,eldr", DriftScenario::kMixShift);
  options.drift.calibrate_before = true;
  absl::StatusOr<ExperimentResult> result = RunExperiment(*workload, options);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->drift.calibration_domain_shares.size(), 2u);
  EXPECT_NEAR(result->drift.calibration_domain_shares[0], 0.9, 1e-12);  // the phase before's mix
  EXPECT_EQ(result->calibration_requests, first + kept_second);
  // Without it, the whole split.
  options.drift.calibrate_before = false;
  result = RunExperiment(*workload, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->drift.calibration_domain_shares.empty());
  EXPECT_EQ(result->calibration_requests, workload->calibration.n);
  // Only a mix shift has a mix before the change.
  DriftOptions other;
  other.scenario = DriftScenario::kNewDomain;
  other.calibrate_before = true;
  EXPECT_EQ(PlanDrift(*workload, other, 400, kDecoders, ClusterOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DriftTest, NewDomainIsUnseenByTheCalibrationAndArrivesAtTheChange) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok());
  ExperimentOptions options = Options("jsq,eldr,eldr_refit", DriftScenario::kNewDomain);
  absl::StatusOr<ExperimentResult> result = RunExperiment(*workload, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->drift.excluded_domain, 1);  // the last domain by default
  const int calibrated_without =
      static_cast<int>(std::count(workload->calibration.labels.begin(), workload->calibration.labels.end(), 0));
  EXPECT_EQ(result->calibration_requests, calibrated_without);
  EXPECT_LT(result->calibration_requests, workload->calibration.n);
  const int change = result->drift.change_arrival;
  EXPECT_EQ(change, 200);
  for (const ExperimentCell& cell : result->cells) {
    int new_before = 0, new_after = 0;
    for (int i = 0; i < static_cast<int>(cell.run.requests.size()); ++i) {
      const bool fresh = workload->pool[cell.run.requests[i].pool_index].domain == 1;
      (i < change ? new_before : new_after) += fresh ? 1 : 0;
    }
    EXPECT_EQ(new_before, 0) << cell.policy.name;
    EXPECT_GT(new_after, 50) << cell.policy.name;
  }
  // A named domain, and a name the workload does not have.
  DriftOptions named;
  named.scenario = DriftScenario::kNewDomain;
  named.new_domain = "domain0";
  absl::StatusOr<DriftPlan> plan = PlanDrift(*workload, named, 400, kDecoders, ClusterOptions());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->excluded_domain, 0);
  named.new_domain = "domain7";
  EXPECT_EQ(PlanDrift(*workload, named, 400, kDecoders, ClusterOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The change must leave measured arrivals on both sides.
  named.new_domain.clear();
  named.change_fraction = 0.2;  // inside the warm-up (0.25)
  EXPECT_EQ(PlanDrift(*workload, named, 400, kDecoders, ClusterOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DriftTest, PoolChangeAddsAndDrainsAWorkerAtTheChange) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok());
  ExperimentOptions options = Options("jsq,eldr,eldr_refit,oracle", DriftScenario::kPoolChange);
  options.rates = {80};
  absl::StatusOr<ExperimentResult> result = RunExperiment(*workload, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->drift.add_worker, "decode-4");
  EXPECT_EQ(result->drift.drain_worker, "decode-0");
  // The arrivals are the undrifted ones.
  const std::vector<Arrival> plain = MakeArrivals(*workload, 80, options.requests, options.seed);
  const int change = result->drift.change_arrival;
  const double change_us = plain[change].time_us;
  std::map<std::string, int> routes_to_new;
  for (const ExperimentCell& cell : result->cells) {
    ASSERT_EQ(cell.run.requests.size(), plain.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      const RequestRecord& record = cell.run.requests[i];
      EXPECT_EQ(record.pool_index, plain[i].request);
      if (record.routed_us < change_us) {
        EXPECT_NE(record.worker, kDecoders) << cell.policy.name << ": the new worker before it joined";
      } else {
        EXPECT_NE(record.worker, 0) << cell.policy.name << ": the drained worker after the change";
      }
      if (record.worker == kDecoders) ++routes_to_new[cell.policy.name];
      EXPECT_GT(record.finish_us, 0) << "request " << i << " never finished";
    }
  }
  EXPECT_GT(routes_to_new["jsq"], 20);
  EXPECT_GT(routes_to_new["oracle"], 20);
  // eldr_refit refits for the new pool: the new worker gets a centroid and its zone's traffic.
  EXPECT_GT(routes_to_new["eldr_refit"], 20);
  // Static eldr keeps its centroids: the worker without one gets only what the core gives it,
  // the overload guard's spills.
  const ExperimentCell* eldr = Find(*result, "eldr", 80);
  ASSERT_NE(eldr, nullptr);
  const auto spills = eldr->run.fallbacks.find("overload");
  EXPECT_LE(routes_to_new["eldr"], spills == eldr->run.fallbacks.end() ? 0 : spills->second);
  EXPECT_LT(routes_to_new["eldr"], routes_to_new["eldr_refit"]);
}

TEST(DriftTest, PhasesSplitTheMeasuredRequestsAtTheChange) {
  absl::StatusOr<Workload> workload = Small();
  ASSERT_TRUE(workload.ok());
  for (DriftScenario scenario : {DriftScenario::kMixShift, DriftScenario::kPoolChange}) {
    ExperimentOptions options = Options("jsq,eldr", scenario);
    options.rates = {60};
    absl::StatusOr<ExperimentResult> result = RunExperiment(*workload, options);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->drift.phase_labels, (std::vector<std::string>{"before", "after"}));
    for (const ExperimentCell& cell : result->cells) {
      ASSERT_EQ(cell.run.phases.size(), 2u);
      const PhaseResult& before = cell.run.phases[0];
      const PhaseResult& after = cell.run.phases[1];
      EXPECT_EQ(before.first_arrival, 0);
      EXPECT_EQ(before.end_arrival, 200);
      EXPECT_EQ(after.first_arrival, 200);
      EXPECT_EQ(after.end_arrival, 400);
      EXPECT_DOUBLE_EQ(before.end_s, after.start_s);
      EXPECT_DOUBLE_EQ(after.start_s * 1e6, cell.run.requests[200].arrival_us);
      // Measured: arrivals 100 (warm-up 25%) to 360 (cool-down 10%).
      EXPECT_EQ(before.metrics.measured_requests, 100);
      EXPECT_EQ(after.metrics.measured_requests, 160);
      EXPECT_EQ(before.metrics.measured_requests + after.metrics.measured_requests, cell.run.metrics.measured_requests);
      EXPECT_GT(before.metrics.tpot_p50_ms, 0);
      EXPECT_GT(after.metrics.distinct_experts_per_layer, 0);
      EXPECT_GE(after.metrics.load_imbalance, 1.0);
    }
  }
  // Without drift there are no phases.
  absl::StatusOr<ExperimentResult> plain = RunExperiment(*workload, Options("jsq"));
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->cells.front().run.phases.empty());
}

TEST(DriftTest, ParsesScenarioNames) {
  for (DriftScenario scenario :
       {DriftScenario::kNone, DriftScenario::kMixShift, DriftScenario::kNewDomain, DriftScenario::kPoolChange}) {
    absl::StatusOr<DriftScenario> parsed = ParseDriftScenario(DriftScenarioName(scenario));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, scenario);
  }
  EXPECT_EQ(ParseDriftScenario("sideways").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace eldr::sim
