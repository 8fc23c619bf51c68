// The pool_change drift scenario through a real eldr-router: the gRPC backend changes the daemon's
// pool with RouterAdmin UpsertWorker / DrainWorker / RemoveWorker. The daemon (static pool from
// --workers, its own refit off, lowest-index tie-breaking so that no generator state carries over
// from one cell to the next) must make the decisions the in-process router makes, cell by cell:
// the added worker gets routes only after it joins, the drained one none after the change, and
// every cell reports its two phases. Between cells and at the end the daemon's pool is restored.
// Admin errors come back as the RPC's status code and message, and the daemon serves on.
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "eldr/v1/router.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sim/experiment.h"
#include "sim/routing_backend.h"
#include "sim/workload.h"
#include "testing/process.h"

namespace eldr::sim {
namespace {

using ::testing::HasSubstr;

constexpr int kDecoders = 4;
constexpr int kMaxInflight = 16;

absl::StatusOr<Workload> SmallWorkload() {
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
  synthetic.seed = 3;
  return GenerateSyntheticWorkload(synthetic);
}

ExperimentOptions Options() {
  ExperimentOptions options;
  options.cluster.decoders = kDecoders;
  options.policies = *ParsePolicies("eldr,eldr_refit");
  options.rates = {40, 80};
  options.requests = 400;
  options.max_inflight = kMaxInflight;
  options.tie_break = TieBreak::kLowestIndex;
  options.refit.interval_s = 1;
  options.refit.window_s = 4;
  options.refit.min_signatures_per_centroid = 4;
  options.drift.scenario = DriftScenario::kPoolChange;
  return options;
}

// eldr-router over "sim-0" .. "sim-3" (not the simulator's "decode-*": the backend must follow the
// daemon's names), with the in-process routers' settings and no refit of its own.
absl::StatusOr<::eldr::testing::RouterChild> StartDaemon(const ::eldr::testing::TempDir& temp) {
  nlohmann::json workers;
  for (int i = 0; i < kDecoders; ++i) {
    workers["workers"].push_back({{"id", "sim-" + std::to_string(i)},
                                  {"address", "127.0.0.1:" + std::to_string(9000 + i)},
                                  {"max_inflight", kMaxInflight}});
  }
  const std::string path = temp.path() + "/workers.json";
  std::ofstream(path) << workers.dump();
  return ::eldr::testing::StartRouter(
      temp, {"--workers=" + path, "--policy=eldr", "--tau=0.1", "--tie_break=lowest_index", "--refit_interval=0",
             // The library's routers it is compared with use RouterOptions' default: no load-gap guard.
             "--eldr_max_load_gap=0"});
}

std::string Target(int port) { return "127.0.0.1:" + std::to_string(port); }

// The daemon's workers as "id:state".
std::set<std::string> DaemonPool(int admin_port) {
  auto admin =
      eldr::v1::RouterAdmin::NewStub(grpc::CreateChannel(Target(admin_port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  eldr::v1::ListWorkersResponse response;
  const grpc::Status status = admin->ListWorkers(&context, {}, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  std::set<std::string> pool;
  for (const eldr::v1::WorkerState& worker : response.workers()) {
    pool.insert(worker.worker().id() + ":" + worker.state());
  }
  return pool;
}

const std::set<std::string> kStartingPool = {"sim-0:active", "sim-1:active", "sim-2:active", "sim-3:active"};

TEST(GrpcPoolChangeTest, DaemonChangesItsPoolAsTheLibraryDoes) {
  absl::StatusOr<Workload> workload = SmallWorkload();
  ASSERT_TRUE(workload.ok()) << workload.status();
  absl::StatusOr<ExperimentResult> local = RunExperiment(*workload, Options());
  ASSERT_TRUE(local.ok()) << local.status();

  const ::eldr::testing::TempDir temp;
  absl::StatusOr<::eldr::testing::RouterChild> daemon = StartDaemon(temp);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ExperimentOptions remote_options = Options();
  remote_options.grpc_target = Target(daemon->ports.grpc);
  remote_options.grpc_admin_target = Target(daemon->ports.admin);
  // Four cells on one daemon: each after the first starts from the pool the previous one changed.
  absl::StatusOr<ExperimentResult> remote = RunExperiment(*workload, remote_options);
  ASSERT_TRUE(remote.ok()) << remote.status() << "\n" << daemon->process->Log();
  ASSERT_EQ(remote->cells.size(), 4u);
  ASSERT_EQ(local->cells.size(), 4u);
  // The invocation leaves the daemon's pool as it found it.
  EXPECT_EQ(DaemonPool(daemon->ports.admin), kStartingPool);

  const int change = remote->drift.change_arrival;
  for (size_t c = 0; c < remote->cells.size(); ++c) {
    const ExperimentCell& b = remote->cells[c];
    const ExperimentCell& a = local->cells[c];
    SCOPED_TRACE(b.policy.name + " at rate " + std::to_string(b.rate));
    ASSERT_EQ(a.policy.name, b.policy.name);
    EXPECT_THAT(b.backend, HasSubstr("grpc://"));
    ASSERT_EQ(b.run.phases.size(), 2u);
    EXPECT_EQ(b.run.phases[1].first_arrival, change);
    EXPECT_GT(b.run.phases[0].metrics.tpot_p50_ms, 0);
    EXPECT_GT(b.run.phases[1].metrics.tpot_p50_ms, 0);

    const double change_us = b.run.requests[change].arrival_us;
    int to_new = 0, to_drained_after = 0, to_new_before = 0;
    for (const RequestRecord& record : b.run.requests) {
      if (record.worker == kDecoders) ++to_new;
      if (record.worker == kDecoders && record.routed_us < change_us) ++to_new_before;
      if (record.worker == 0 && record.routed_us >= change_us) ++to_drained_after;
      EXPECT_GT(record.finish_us, 0);
    }
    EXPECT_EQ(to_new_before, 0);
    EXPECT_EQ(to_drained_after, 0);
    // eldr_refit's driver reconciles the rows with the new pool and installs them in the daemon:
    // the new worker gets its zone's traffic. Static eldr keeps a centroid-less new worker, so it
    // gets only the overload guard's spills (possibly none).
    if (b.policy.refit) {
      EXPECT_GT(to_new, 20);
      EXPECT_GT(b.run.refits, 0);
      EXPECT_EQ(a.run.refits, b.run.refits);
    }

    // Decision by decision the daemon is the library.
    ASSERT_EQ(a.run.requests.size(), b.run.requests.size());
    int differing = 0;
    for (size_t i = 0; i < a.run.requests.size(); ++i) {
      if (a.run.requests[i].worker != b.run.requests[i].worker) ++differing;
      EXPECT_DOUBLE_EQ(a.run.requests[i].finish_us, b.run.requests[i].finish_us);
    }
    EXPECT_EQ(differing, 0);
    EXPECT_EQ(a.run.fallbacks, b.run.fallbacks);
    EXPECT_DOUBLE_EQ(a.run.phases[1].metrics.tpot_p99_ms, b.run.phases[1].metrics.tpot_p99_ms);
  }
}

// --pace holds the daemon's cells to the wall clock (so that its own timers see the simulated
// timeline) without changing a decision; the in-process cells are not held back.
TEST(GrpcPoolChangeTest, PacedDaemonCellsTakeTheirWallTimeAndDecideTheSame) {
  absl::StatusOr<Workload> workload = SmallWorkload();
  ASSERT_TRUE(workload.ok()) << workload.status();
  ExperimentOptions options = Options();
  options.policies = *ParsePolicies("eldr,jsq");
  options.rates = {80};
  absl::StatusOr<ExperimentResult> local = RunExperiment(*workload, options);
  ASSERT_TRUE(local.ok()) << local.status();

  const ::eldr::testing::TempDir temp;
  absl::StatusOr<::eldr::testing::RouterChild> daemon = StartDaemon(temp);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  constexpr double kPace = 10;
  options.grpc_target = Target(daemon->ports.grpc);
  options.grpc_admin_target = Target(daemon->ports.admin);
  options.daemon_pace = kPace;
  std::vector<double> cell_wall_s;
  options.log = [&cell_wall_s](const std::string& line) {
    // "rate 80 req/s, eldr       TPOT p50 ... ms  (0.6 s)"
    const size_t open = line.rfind('(');
    if (line.rfind("rate ", 0) == 0 && open != std::string::npos)
      cell_wall_s.push_back(std::stod(line.substr(open + 1)));
  };
  absl::StatusOr<ExperimentResult> paced = RunExperiment(*workload, options);
  ASSERT_TRUE(paced.ok()) << paced.status() << "\n" << daemon->process->Log();
  ASSERT_EQ(paced->cells.size(), 2u);
  ASSERT_EQ(cell_wall_s.size(), 2u);
  for (size_t c = 0; c < paced->cells.size(); ++c) {
    const ExperimentCell& a = local->cells[c];
    const ExperimentCell& b = paced->cells[c];
    SCOPED_TRACE(b.policy.name);
    ASSERT_EQ(a.run.requests.size(), b.run.requests.size());
    for (size_t i = 0; i < a.run.requests.size(); ++i) {
      ASSERT_EQ(a.run.requests[i].worker, b.run.requests[i].worker) << "request " << i;
    }
  }
  // eldr (the daemon's): at least its simulated time / pace (the log rounds to 0.1 s); jsq ran
  // in-process, unpaced.
  const double simulated_s = paced->cells[0].run.simulated_seconds;
  ASSERT_GT(simulated_s, 3);
  EXPECT_GE(cell_wall_s[0], simulated_s / kPace - 0.06);
  EXPECT_LT(cell_wall_s[1], simulated_s / kPace / 2);
}

// eldr-sim as users run it: --drift=pool_change with --router reports both phases of the cell the
// daemon served, and the daemon's pool is back as it was afterwards.
TEST(GrpcPoolChangeTest, EldrSimRunsPoolChangeThroughTheDaemon) {
  const ::eldr::testing::TempDir temp;
  absl::StatusOr<::eldr::testing::RouterChild> daemon = StartDaemon(temp);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const ::eldr::testing::ProcessResult run = ::eldr::testing::RunProcess(
      ::eldr::testing::BinaryPath("eldr-sim"),
      {"--synthetic=8x32x4", "--domains=2", "--topics_per_domain=2", "--requests=400", "--calibration_requests=96",
       "--prompt_tokens_mean=48", "--output_tokens_mean=24", "--rates=80", "--policies=eldr,jsq",
       "--tie_break=lowest_index", "--max_inflight=16", "--drift=pool_change", "--quiet", "--json",
       "--router=grpc://" + Target(daemon->ports.grpc), "--router_admin=grpc://" + Target(daemon->ports.admin)},
      absl::Seconds(120));
  ASSERT_EQ(run.exit_code, 0) << run.stderr_text << "\n" << daemon->process->Log();
  const nlohmann::json json = nlohmann::json::parse(run.stdout_text);
  EXPECT_EQ(json["drift"]["scenario"], "pool_change");
  ASSERT_EQ(json["results"].size(), 2u);
  for (const nlohmann::json& result : json["results"]) {
    SCOPED_TRACE(result["policy"].get<std::string>());
    if (result["policy"] == "eldr") EXPECT_THAT(result["router"].get<std::string>(), HasSubstr("grpc://"));
    ASSERT_EQ(result["phases"].size(), 2u);
    EXPECT_EQ(result["phases"][0]["phase"], "before");
    EXPECT_EQ(result["phases"][1]["phase"], "after");
    EXPECT_GT(result["phases"][1]["measured_requests"].get<int>(), 0);
    EXPECT_GT(result["phases"][1]["tpot_p50_ms"].get<double>(), 0);
  }
  EXPECT_EQ(DaemonPool(daemon->ports.admin), kStartingPool);
}

TEST(GrpcPoolChangeTest, AdminErrorsCarryTheRpcMessageAndTheDaemonServesOn) {
  const ::eldr::testing::TempDir temp;
  absl::StatusOr<::eldr::testing::RouterChild> daemon = StartDaemon(temp);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string admin = Target(daemon->ports.admin);
  absl::StatusOr<DaemonInfo> info = QueryDaemon(Target(daemon->ports.grpc), admin, 10);
  ASSERT_TRUE(info.ok()) << info.status();
  absl::StatusOr<std::unique_ptr<RoutingBackend>> backend = MakeGrpcBackend(*info, 10);
  ASSERT_TRUE(backend.ok()) << backend.status();
  RoutingBackend& pool = **backend;

  const absl::Status removed = pool.RemoveWorker("no-such-worker");
  EXPECT_EQ(removed.code(), absl::StatusCode::kNotFound) << removed;
  EXPECT_THAT(removed.message(), HasSubstr("RemoveWorker at " + admin + " failed: "));
  EXPECT_THAT(removed.message(), HasSubstr("no-such-worker"));
  const absl::Status drained = pool.DrainWorker("no-such-worker");
  EXPECT_EQ(drained.code(), absl::StatusCode::kNotFound) << drained;
  EXPECT_THAT(drained.message(), HasSubstr("DrainWorker at " + admin + " failed: "));
  // The daemon validates the id: its reason comes back.
  const absl::StatusOr<int> bad = pool.AddWorker("bad id with spaces");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("UpsertWorker at " + admin + " failed: "));
  EXPECT_EQ(pool.AddWorker("sim-1").status().code(), absl::StatusCode::kAlreadyExists);
  // Nothing failed changed the pool.
  EXPECT_EQ(pool.worker_ids().size(), static_cast<size_t>(kDecoders));
  EXPECT_EQ(DaemonPool(daemon->ports.admin), kStartingPool);

  // A change that works: the added worker takes the next index; the removed one keeps its own.
  const absl::StatusOr<int> added = pool.AddWorker("decode-4");
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(*added, kDecoders);
  ASSERT_TRUE(pool.DrainWorker("sim-0").ok());
  EXPECT_EQ(DaemonPool(daemon->ports.admin), (std::set<std::string>{"sim-0:draining", "sim-1:active", "sim-2:active",
                                                                    "sim-3:active", "decode-4:active"}));
  ASSERT_TRUE(pool.RemoveWorker("sim-0").ok());
  EXPECT_EQ(pool.worker_ids().size(), static_cast<size_t>(kDecoders + 1));
  EXPECT_EQ(pool.worker_ids()[0], "sim-0");
  // Removing it again is the daemon's NOT_FOUND, not a crash on either side.
  EXPECT_EQ(pool.RemoveWorker("sim-0").code(), absl::StatusCode::kNotFound);

  ASSERT_TRUE(pool.RestorePool().ok());
  EXPECT_EQ(pool.worker_ids(), info->worker_ids);
  EXPECT_EQ(DaemonPool(daemon->ports.admin), kStartingPool);
  EXPECT_TRUE(daemon->process->Running()) << daemon->process->Log();
}

}  // namespace
}  // namespace eldr::sim
