// Multi-seed reporting: seed lists, and the aggregation's means, standard errors and differences
// from the best load balancer checked against a computation by hand on three small seeds.
#include "sim/seeds.h"

#include <cmath>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace eldr::sim {
namespace {

TEST(SeedsTest, ParsesSeedLists) {
  EXPECT_EQ(*ParseSeeds("1-6"), (std::vector<uint64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(*ParseSeeds("3, 1,2"), (std::vector<uint64_t>{3, 1, 2}));
  EXPECT_EQ(*ParseSeeds("1-3,7"), (std::vector<uint64_t>{1, 2, 3, 7}));
  EXPECT_EQ(*ParseSeeds("5"), (std::vector<uint64_t>{5}));
  for (const char* bad : {"", ",", "3-1", "1,1", "1-3,2", "x", "1-", "-2", "1-2000"}) {
    EXPECT_EQ(ParseSeeds(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(SeedsTest, MeanAndStandardError) {
  const MeanSe three = MeanAndStandardError({9, 10, 11});
  EXPECT_EQ(three.n, 3);
  EXPECT_DOUBLE_EQ(three.mean, 10);
  EXPECT_NEAR(three.se, 1 / std::sqrt(3.0), 1e-12);  // sd 1 (n - 1), over sqrt(3)
  const MeanSe one = MeanAndStandardError({4});
  EXPECT_DOUBLE_EQ(one.mean, 4);
  EXPECT_DOUBLE_EQ(one.se, 0);
  EXPECT_EQ(MeanAndStandardError({}).n, 0);
}

ExperimentCell Cell(const std::string& policy, double p50, double p99, double ttft_p50) {
  ExperimentCell cell;
  cell.rate = 10;
  cell.policy = ParsePolicies(policy)->front();
  cell.run.metrics.tpot_p50_ms = p50;
  cell.run.metrics.tpot_p99_ms = p99;
  cell.run.metrics.ttft_p50_ms = ttft_p50;
  // One phase, "after", with figures of its own.
  PhaseResult after;
  after.metrics.tpot_p50_ms = 2 * p50;
  after.metrics.tpot_p99_ms = 2 * p99;
  cell.run.phases.push_back(after);
  return cell;
}

ExperimentResult SeedRun(std::vector<ExperimentCell> cells) {
  ExperimentResult run;
  run.rates = {10};
  run.setups = {ReplicaSetup{}};
  run.drift.scenario = DriftScenario::kMixShift;
  run.drift.phase_labels = {"after"};
  run.cells = std::move(cells);
  return run;
}

// Three seeds, by hand:
//            rr p50 / p99    jsq p50 / p99    eldr p50 / p99
//   seed 1   10 / 20         12 / 19          9 / 19
//   seed 2   10 / 21         10.5 / 22        10 / 21
//   seed 3   10 / 20         11 / 20          11 / 22
// best LB p50: 10, 10, 10 -> eldr vs best: -10%, 0%, +10%: mean 0, SE 10 / sqrt(3)
// best LB p99: 19, 21, 20 -> eldr vs best: 0%, 0%, +10%: mean 10/3, SE sd(0,0,10) / sqrt(3)
//   = sqrt(((10/3)^2 * 2 + (20/3)^2) / 2) / sqrt(3) = 10 / 3 (sd 5.7735...)
// eldr p50: mean 10, SE 1 / sqrt(3); rr p99: 20.333..., SE sqrt(1/3) / sqrt(3) = 1/3.
TEST(SeedsTest, AggregatesLikeTheHandComputation) {
  std::vector<ExperimentResult> runs = {
      SeedRun({Cell("rr", 10, 20, 40), Cell("jsq", 12, 19, 41), Cell("eldr", 9, 19, 39)}),
      SeedRun({Cell("rr", 10, 21, 40), Cell("jsq", 10.5, 22, 42), Cell("eldr", 10, 21, 39)}),
      SeedRun({Cell("rr", 10, 20, 40), Cell("jsq", 11, 20, 43), Cell("eldr", 11, 22, 39)}),
  };
  absl::StatusOr<std::vector<AggregateCell>> cells = AggregateSeeds(runs);
  ASSERT_TRUE(cells.ok()) << cells.status();
  // Whole run: rr, jsq, eldr, best LB; then the phase: the same four.
  ASSERT_EQ(cells->size(), 8u);
  const AggregateCell& rr = (*cells)[0];
  const AggregateCell& jsq = (*cells)[1];
  const AggregateCell& eldr = (*cells)[2];
  const AggregateCell& best = (*cells)[3];
  EXPECT_EQ(rr.policy.name, "rr");
  EXPECT_EQ(rr.phase, -1);
  EXPECT_FALSE(rr.has_versus);
  EXPECT_NEAR(rr.tpot_p99.mean, 61.0 / 3, 1e-12);
  EXPECT_NEAR(rr.tpot_p99.se, 1.0 / 3, 1e-12);
  EXPECT_NEAR(jsq.ttft_p50.mean, 42, 1e-12);
  EXPECT_NEAR(jsq.ttft_p50.se, 1 / std::sqrt(3.0), 1e-12);
  EXPECT_EQ(eldr.tpot_p50.n, 3);
  EXPECT_NEAR(eldr.tpot_p50.mean, 10, 1e-12);
  EXPECT_NEAR(eldr.tpot_p50.se, 1 / std::sqrt(3.0), 1e-12);
  ASSERT_TRUE(eldr.has_versus);
  EXPECT_NEAR(eldr.p50_vs_best_pct.mean, 0, 1e-9);
  EXPECT_NEAR(eldr.p50_vs_best_pct.se, 10 / std::sqrt(3.0), 1e-9);
  // p99: 19 / 19, 21 / 21, 22 / 20.
  EXPECT_NEAR(eldr.p99_vs_best_pct.mean, 10.0 / 3, 1e-9);
  EXPECT_NEAR(eldr.p99_vs_best_pct.se, 10.0 / 3, 1e-9);
  EXPECT_TRUE(best.best_baseline);
  EXPECT_NEAR(best.tpot_p50.mean, 10, 1e-12);
  EXPECT_NEAR(best.tpot_p50.se, 0, 1e-12);
  EXPECT_NEAR(best.tpot_p99.mean, 20, 1e-12);
  EXPECT_NEAR(best.tpot_p99.se, 1 / std::sqrt(3.0), 1e-12);
  // The phase doubles every figure: the ratios to the best stay, the means double.
  const AggregateCell& phase_eldr = (*cells)[6];
  EXPECT_EQ(phase_eldr.phase, 0);
  EXPECT_EQ(phase_eldr.policy.name, "eldr");
  EXPECT_NEAR(phase_eldr.tpot_p50.mean, 20, 1e-12);
  EXPECT_NEAR(phase_eldr.p99_vs_best_pct.mean, 10.0 / 3, 1e-9);

  // Outputs carry the aggregate.
  MultiSeedResult multi;
  multi.seeds = {1, 2, 3};
  multi.runs = runs;
  multi.cells = *cells;
  const nlohmann::json json = SeedsToJson(multi);
  EXPECT_EQ(json["seeds"], nlohmann::json({1, 2, 3}));
  ASSERT_EQ(json["aggregate"].size(), 8u);
  EXPECT_EQ(json["aggregate"][2]["policy"], "eldr");
  EXPECT_EQ(json["aggregate"][2]["phase"], "all");
  EXPECT_NEAR(json["aggregate"][2]["p99_vs_best_lb_pct_mean"].get<double>(), 10.0 / 3, 1e-9);
  EXPECT_EQ(json["aggregate"][6]["phase"], "after");
  EXPECT_EQ(json["runs"].size(), 3u);
  const std::string csv = FormatSeedsCsv(multi);
  EXPECT_NE(csv.find("rate_rps,policy,replicas,shared_state,phase,seeds,tpot_p50_ms_mean,tpot_p50_ms_se"),
            std::string::npos);
  EXPECT_NE(csv.find("\n10,eldr,1,0,all,3,10.0000,0.5774,"), std::string::npos) << csv;
  const std::string table = FormatSeedsTable(multi);
  EXPECT_NE(table.find("over the 3 seeds"), std::string::npos);
  EXPECT_NE(table.find("+3.3 ± 3.3%"), std::string::npos) << table;
  EXPECT_NE(table.find("-- phase after"), std::string::npos);

  // Runs with different cells cannot be aggregated.
  runs[2].cells.pop_back();
  EXPECT_EQ(AggregateSeeds(runs).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace eldr::sim
