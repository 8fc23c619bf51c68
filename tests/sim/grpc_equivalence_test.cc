// In-process and gRPC modes make identical decisions for the same seed: the same cells run
// against eldr::Router in this process and through a real eldr-router daemon (started on a free
// loopback port with the same policy, tau, tie-breaking seed and overload guard, fresh for each
// daemon policy), and every request must land on the same worker with the same timings.
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sim/experiment.h"
#include "sim/workload.h"
#include "testing/process.h"

namespace eldr::sim {
namespace {

constexpr int kDecoders = 4;
constexpr int kMaxInflight = 10;  // low enough that the overload guard fires at the higher rate

ExperimentOptions Options() {
  ExperimentOptions options;
  options.cluster.decoders = kDecoders;
  options.policies = *ParsePolicies("eldr,eldr_refit,jsq");
  options.rates = {20, 60};
  options.requests = 400;
  options.tau = 0.1;
  options.seed = 11;
  options.router_seed = 0x5eed;  // eldr-router's default --seed
  options.max_inflight = kMaxInflight;
  options.refit.interval_s = 2;  // several refits per run
  options.refit.window_s = 10;
  options.refit.min_signatures_per_centroid = 4;
  options.refit.min_experts_gain = -1;  // stationary traffic: the locality bound would refuse every refit
  return options;
}

absl::StatusOr<Workload> SmallWorkload() {
  SyntheticOptions synthetic;
  synthetic.layers = 12;
  synthetic.experts = 64;
  synthetic.top_k = 4;
  synthetic.domains = 2;
  synthetic.topics_per_domain = 2;
  synthetic.requests = 400;
  synthetic.calibration_requests = 96;
  synthetic.prompt_tokens_mean = 64;
  synthetic.output_tokens_mean = 40;
  synthetic.seed = 11;
  return GenerateSyntheticWorkload(synthetic);
}

// Starts a fresh eldr-router with the test's workers and runs `policies` at 60 req/s through it.
// A daemon is one router for its whole life, so its first cell starts from the state an
// in-process cell starts from (every in-process cell has a router of its own): each daemon policy
// gets a daemon of its own here.
void ExpectSameAsTheDaemon(const Workload& workload, const ExperimentResult& local, const std::string& policies,
                           int* eldr_cells, int* guarded_routes) {
  const ::eldr::testing::TempDir temp;
  const std::string dir = temp.path();
  nlohmann::json workers;
  for (int i = 0; i < kDecoders; ++i) {
    workers["workers"].push_back({{"id", "sim-" + std::to_string(i)},
                                  {"address", "127.0.0.1:" + std::to_string(9000 + i)},
                                  {"max_inflight", kMaxInflight}});
  }
  std::ofstream(dir + "/workers.json") << workers.dump();
  // The in-process routers' settings: no refit of the daemon's own (its default, every 10 s, could
  // install new centroids in the middle of a cell; eldr_refit's refits are the simulator's, sent
  // over RouterAdmin), and RouterOptions' default of no load-gap guard (eldr-router's is 4).
  absl::StatusOr<::eldr::testing::RouterChild> daemon =
      ::eldr::testing::StartRouter(temp, {"--workers=" + dir + "/workers.json", "--policy=eldr", "--tau=0.1",
                                          "--refit_interval=0", "--eldr_max_load_gap=0"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();

  ExperimentOptions remote_options = Options();
  remote_options.policies = *ParsePolicies(policies);
  remote_options.rates = {60};
  remote_options.grpc_target = "127.0.0.1:" + std::to_string(daemon->ports.grpc);
  remote_options.grpc_admin_target = "127.0.0.1:" + std::to_string(daemon->ports.admin);
  absl::StatusOr<ExperimentResult> remote = RunExperiment(workload, remote_options);
  ASSERT_TRUE(remote.ok()) << remote.status() << "\n" << daemon->process->Log();

  for (const ExperimentCell& b : remote->cells) {
    const ExperimentCell* found = nullptr;
    for (const ExperimentCell& cell : local.cells) {
      if (cell.policy.name == b.policy.name && cell.rate == b.rate) found = &cell;
    }
    ASSERT_NE(found, nullptr) << b.policy.name;
    const ExperimentCell& a = *found;
    if (a.policy.kind == PolicyKind::kEldr) {
      ++*eldr_cells;
      EXPECT_NE(b.backend.find("grpc://"), std::string::npos) << b.backend;
      EXPECT_EQ(a.backend.find("grpc://"), std::string::npos) << a.backend;
      auto overload = b.run.fallbacks.find("overload");
      if (overload != b.run.fallbacks.end()) *guarded_routes += overload->second;
    }
    if (a.policy.refit) {
      EXPECT_GT(a.run.refits, 0);
      EXPECT_EQ(a.run.refits, b.run.refits);
    }
    ASSERT_EQ(a.run.requests.size(), b.run.requests.size());
    int differing = 0;
    for (size_t i = 0; i < a.run.requests.size(); ++i) {
      if (a.run.requests[i].worker != b.run.requests[i].worker) ++differing;
      EXPECT_DOUBLE_EQ(a.run.requests[i].finish_us, b.run.requests[i].finish_us);
    }
    EXPECT_EQ(differing, 0) << a.policy.name << " at rate " << a.rate;
    EXPECT_EQ(a.run.fallbacks, b.run.fallbacks) << a.policy.name;
    EXPECT_DOUBLE_EQ(a.run.metrics.tpot_p50_ms, b.run.metrics.tpot_p50_ms);
    EXPECT_DOUBLE_EQ(a.run.metrics.tpot_p99_ms, b.run.metrics.tpot_p99_ms);
  }
}

TEST(GrpcEquivalenceTest, DaemonMakesTheSameDecisionsAsTheLibrary) {
  absl::StatusOr<Workload> workload = SmallWorkload();
  ASSERT_TRUE(workload.ok()) << workload.status();

  // In process, every cell has its own router: the rate-60 cells are those of a run at 60 alone.
  absl::StatusOr<ExperimentResult> local = RunExperiment(*workload, Options());
  ASSERT_TRUE(local.ok()) << local.status();

  int eldr_cells = 0, guarded_routes = 0;
  ExpectSameAsTheDaemon(*workload, *local, "eldr,jsq", &eldr_cells, &guarded_routes);
  ExpectSameAsTheDaemon(*workload, *local, "eldr_refit", &eldr_cells, &guarded_routes);
  EXPECT_EQ(eldr_cells, 2);
  // The comparison covered the overload guard's spill path too.
  EXPECT_GT(guarded_routes, 0);
}

}  // namespace
}  // namespace eldr::sim
