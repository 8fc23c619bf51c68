// Router replicas in the simulator: one replica is the plain path bit for bit; the traffic splits
// 1/R per replica; shared load gives every replica the pool's leases at each sync (and nothing at
// all is shared without it); refit is one driver for the pool or one per replica; and without
// shared state the overload guard goes blind, which a small workload with uneven zones shows.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "eldr/calib/calibration.h"
#include "gtest/gtest.h"
#include "sim/experiment.h"
#include "sim/routing_backend.h"
#include "sim/sim_refit.h"
#include "sim/simulator.h"
#include "sim/workload.h"

namespace eldr::sim {
namespace {

// Forwards to an in-process router and counts what replica syncs ask of it.
class CountingBackend final : public RoutingBackend {
 public:
  explicit CountingBackend(std::unique_ptr<RoutingBackend> inner) : inner_(std::move(inner)) {}

  std::string Describe() const override { return inner_->Describe(); }
  PolicyKind policy() const override { return inner_->policy(); }
  double tau() const override { return inner_->tau(); }
  const std::vector<std::string>& worker_ids() const override { return inner_->worker_ids(); }
  void StartRun() override { inner_->StartRun(); }
  absl::StatusOr<RouteDecision> Route(const RouteCall& call, double now_us) override {
    ++routes;
    return inner_->Route(call, now_us);
  }
  absl::Status Complete(uint64_t lease_id, int64_t output_tokens, double now_us) override {
    return inner_->Complete(lease_id, output_tokens, now_us);
  }
  absl::Status InstallCentroids(const CentroidArtifact& artifact) override {
    ++installs;
    return inner_->InstallCentroids(artifact);
  }
  absl::StatusOr<RouterState> GetState(double now_us) override { return inner_->GetState(now_us); }
  absl::Status SetPeerLeases(const absl::flat_hash_map<std::string, PeerLeaseCount>& peers) override {
    ++peer_lease_updates;
    return inner_->SetPeerLeases(peers);
  }

  int routes = 0;
  int installs = 0;
  int peer_lease_updates = 0;

 private:
  std::unique_ptr<RoutingBackend> inner_;
};

std::unique_ptr<CountingBackend> Replica(PolicyKind policy, uint64_t seed, int workers, int64_t max_inflight = 0) {
  absl::StatusOr<std::unique_ptr<RoutingBackend>> backend =
      MakeInProcessBackend(policy, 0.1, seed, workers, max_inflight);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return std::make_unique<CountingBackend>(*std::move(backend));
}

// `count` replicas of `policy` (seeds 0x5eed + r) over `workers` workers, owned here, and the
// routers view of them a replicated run takes.
struct ReplicaSet {
  std::vector<std::unique_ptr<CountingBackend>> owned;
  ReplicaRouters routers;
};
ReplicaSet MakeReplicas(PolicyKind policy, int count, int workers, int64_t max_inflight = 0) {
  ReplicaSet set;
  for (int r = 0; r < count; ++r) {
    set.owned.push_back(Replica(policy, 0x5eed + r, workers, max_inflight));
    set.routers.replicas.push_back(set.owned.back().get());
  }
  return set;
}

SyntheticOptions SmallOptions(uint64_t seed) {
  SyntheticOptions synthetic;
  synthetic.layers = 8;
  synthetic.experts = 32;
  synthetic.top_k = 4;
  synthetic.domains = 2;
  synthetic.topics_per_domain = 2;
  synthetic.requests = 400;
  synthetic.calibration_requests = 96;
  synthetic.prompt_tokens_mean = 48;
  synthetic.output_tokens_mean = 40;
  synthetic.seed = seed;
  return synthetic;
}

ClusterOptions SmallCluster() {
  ClusterOptions cluster;
  cluster.decoders = 4;
  cluster.max_batch = 16;
  return cluster;
}

// Every measured figure and every request's fate.
void ExpectSameRun(const RunResult& a, const RunResult& b) {
  ASSERT_EQ(a.requests.size(), b.requests.size());
  for (size_t i = 0; i < a.requests.size(); ++i) {
    EXPECT_EQ(a.requests[i].worker, b.requests[i].worker) << "request " << i;
    EXPECT_EQ(a.requests[i].first_token_us, b.requests[i].first_token_us) << "request " << i;
    EXPECT_EQ(a.requests[i].finish_us, b.requests[i].finish_us) << "request " << i;
  }
  EXPECT_EQ(a.metrics.tpot_ms, b.metrics.tpot_ms);
  EXPECT_EQ(a.metrics.load_imbalance, b.metrics.load_imbalance);
  EXPECT_EQ(a.metrics.distinct_experts_per_layer, b.metrics.distinct_experts_per_layer);
  EXPECT_EQ(a.refits, b.refits);
  EXPECT_EQ(a.fallbacks, b.fallbacks);
}

TEST(ReplicasTest, ParsesReplicaCountsAndExpandsSetups) {
  absl::StatusOr<std::vector<int>> counts = ParseReplicaCounts("1, 3,16");
  ASSERT_TRUE(counts.ok()) << counts.status();
  EXPECT_EQ(*counts, (std::vector<int>{1, 3, 16}));
  for (const char* bad : {"", "0", "-2", "x", "3,3", "2000"}) {
    EXPECT_EQ(ParseReplicaCounts(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  absl::StatusOr<std::vector<ReplicaSetup>> both = ExpandReplicaSetups({1, 3}, "");
  ASSERT_TRUE(both.ok());
  ASSERT_EQ(both->size(), 3u);
  EXPECT_EQ(ReplicaSetupLabel((*both)[0]), "1 router");
  EXPECT_EQ(ReplicaSetupLabel((*both)[1]), "3 replicas, shared state");
  EXPECT_EQ(ReplicaSetupLabel((*both)[2]), "3 replicas, no shared state");
  EXPECT_EQ(CellLabel("jsq", (*both)[0]), "jsq");
  EXPECT_EQ(CellLabel("jsq", (*both)[2]), "jsq R3 unshared");
  EXPECT_EQ(ExpandReplicaSetups({3}, "off")->size(), 1u);
  EXPECT_FALSE(ExpandReplicaSetups({3}, "off")->front().shared_state);
  EXPECT_TRUE(ExpandReplicaSetups({3}, "on")->front().shared_state);
  EXPECT_EQ(ExpandReplicaSetups({3}, "sometimes").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseReplicaAssignment("random").value(), ReplicaAssignment::kRandom);
  EXPECT_EQ(ParseReplicaAssignment("hash").status().code(), absl::StatusCode::kInvalidArgument);
}

// One replica through SimulateReplicatedRun (shared load asked for, which one replica has nobody
// to share with) is SimulateRun, with and without refit.
TEST(ReplicasTest, OneReplicaIsThePlainPath) {
  absl::StatusOr<Workload> workload = GenerateSyntheticWorkload(SmallOptions(1));
  ASSERT_TRUE(workload.ok()) << workload.status();
  const ClusterOptions cluster = SmallCluster();
  const std::vector<Arrival> arrivals = MakeArrivals(*workload, 60, 400, 1);
  CalibrationOptions calibration;
  calibration.clusters = cluster.decoders;
  absl::StatusOr<CalibrationResult> calibrated = Calibrate(workload->calibration, calibration);
  ASSERT_TRUE(calibrated.ok()) << calibrated.status();
  CentroidArtifact centroids = calibrated->artifact;
  SimRefitOptions refit_options;
  refit_options.interval_s = 1;
  refit_options.window_s = 3;
  refit_options.min_signatures_per_centroid = 4;

  for (PolicyKind kind : {PolicyKind::kJsq, PolicyKind::kP2c, PolicyKind::kEldr}) {
    for (bool refit : {false, true}) {
      if (refit && kind != PolicyKind::kEldr) continue;
      SCOPED_TRACE(absl::StrCat(PolicyKindName(kind), refit ? " with refit" : ""));
      std::unique_ptr<CountingBackend> plain = Replica(kind, 0x5eed, cluster.decoders, 16);
      std::unique_ptr<CountingBackend> replicated = Replica(kind, 0x5eed, cluster.decoders, 16);
      centroids.workers = plain->worker_ids();
      std::unique_ptr<SimRefitDriver> plain_refit, replicated_refit;
      if (kind == PolicyKind::kEldr) {
        ASSERT_TRUE(plain->InstallCentroids(centroids).ok());
        ASSERT_TRUE(replicated->InstallCentroids(centroids).ok());
        if (refit) {
          plain_refit = *SimRefitDriver::Create(centroids, refit_options);
          replicated_refit = *SimRefitDriver::Create(centroids, refit_options);
        }
      }
      absl::StatusOr<RunResult> a = SimulateRun(*workload, arrivals, cluster, plain.get(), plain_refit.get());
      ASSERT_TRUE(a.ok()) << a.status();
      ReplicaRouters routers;
      routers.replicas = {replicated.get()};
      if (replicated_refit != nullptr) routers.refits = {replicated_refit.get()};
      ReplicaOptions replica;
      replica.shared_load = true;
      absl::StatusOr<RunResult> b = SimulateReplicatedRun(*workload, arrivals, cluster, routers, replica);
      ASSERT_TRUE(b.ok()) << b.status();
      ExpectSameRun(*a, *b);
      EXPECT_EQ(b->routes_per_replica, std::vector<int>{400});
      EXPECT_EQ(b->replica_syncs, 0);
      EXPECT_EQ(replicated->peer_lease_updates, 0);
      if (refit) EXPECT_GT(b->refits, 0);
    }
  }
}

// In an experiment, the one-router cells are the same whether replicated setups run beside them
// or not (every setup has routers of its own).
TEST(ReplicasTest, OneRouterCellsDoNotDependOnTheOtherSetups) {
  absl::StatusOr<Workload> workload = GenerateSyntheticWorkload(SmallOptions(2));
  ASSERT_TRUE(workload.ok()) << workload.status();
  ExperimentOptions options;
  options.cluster = SmallCluster();
  options.policies = *ParsePolicies("rr,jsq,eldr,eldr_refit");
  options.rates = {40, 80};
  options.requests = 400;
  options.max_inflight = 16;
  options.refit.interval_s = 1;
  options.refit.window_s = 3;
  options.refit.min_signatures_per_centroid = 4;
  absl::StatusOr<ExperimentResult> alone = RunExperiment(*workload, options);
  ASSERT_TRUE(alone.ok()) << alone.status();
  options.setups = *ExpandReplicaSetups({3, 1}, "both");
  absl::StatusOr<ExperimentResult> beside = RunExperiment(*workload, options);
  ASSERT_TRUE(beside.ok()) << beside.status();
  ASSERT_EQ(alone->cells.size(), 2u * 4);
  ASSERT_EQ(beside->cells.size(), 2u * 3 * 4);
  size_t next = 0;
  for (const ExperimentCell& cell : beside->cells) {
    if (cell.setup.replicas != 1) continue;
    ASSERT_LT(next, alone->cells.size());
    const ExperimentCell& reference = alone->cells[next++];
    SCOPED_TRACE(absl::StrCat(cell.policy.name, " at ", cell.rate));
    EXPECT_EQ(cell.policy.name, reference.policy.name);
    EXPECT_EQ(cell.rate, reference.rate);
    ExpectSameRun(cell.run, reference.run);
  }
  EXPECT_EQ(next, alone->cells.size());
}

TEST(ReplicasTest, TrafficSplitsOneOverRPerReplica) {
  absl::StatusOr<Workload> workload = GenerateSyntheticWorkload(SmallOptions(3));
  ASSERT_TRUE(workload.ok()) << workload.status();
  const ClusterOptions cluster = SmallCluster();
  const std::vector<Arrival> arrivals = MakeArrivals(*workload, 60, 400, 3);
  for (ReplicaAssignment assignment : {ReplicaAssignment::kModulo, ReplicaAssignment::kRandom}) {
    SCOPED_TRACE(ReplicaAssignmentName(assignment));
    ReplicaSet set = MakeReplicas(PolicyKind::kRoundRobin, 3, cluster.decoders);
    std::vector<std::unique_ptr<CountingBackend>>& owned = set.owned;
    ReplicaRouters& routers = set.routers;
    ReplicaOptions replica;
    replica.assignment = assignment;
    replica.assignment_seed = 3;
    absl::StatusOr<RunResult> run = SimulateReplicatedRun(*workload, arrivals, cluster, routers, replica);
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_EQ(run->routes_per_replica.size(), 3u);
    std::vector<int> counted(3, 0);
    for (size_t i = 0; i < run->requests.size(); ++i) {
      const int r = run->requests[i].replica;
      ASSERT_GE(r, 0);
      ASSERT_LT(r, 3);
      ++counted[r];
      if (assignment == ReplicaAssignment::kModulo) EXPECT_EQ(r, static_cast<int>(i % 3));
    }
    EXPECT_EQ(counted, run->routes_per_replica);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(owned[r]->routes, run->routes_per_replica[r]);
      if (assignment == ReplicaAssignment::kModulo) {
        EXPECT_GE(run->routes_per_replica[r], 133);
        EXPECT_LE(run->routes_per_replica[r], 134);
      } else {
        // 400 arrivals, p = 1/3: mean 133.3, standard deviation 9.4; 5 deviations either way.
        EXPECT_NEAR(run->routes_per_replica[r], 133.3, 47);
      }
      // Nothing is shared without shared load.
      EXPECT_EQ(owned[r]->peer_lease_updates, 0);
    }
    EXPECT_EQ(run->replica_syncs, 0);
  }
}

// Hands routes to three routers directly, then one sync: every replica's effective load on every
// worker is the pool's lease count there (its own plus the others'), and its peer leases the
// others'.
TEST(ReplicasTest, SyncGivesEveryReplicaTheOthersLeases) {
  ReplicaSet set = MakeReplicas(PolicyKind::kRoundRobin, 3, 4);
  std::vector<std::unique_ptr<CountingBackend>>& owned = set.owned;
  std::vector<RoutingBackend*>& replicas = set.routers.replicas;
  for (RoutingBackend* replica : replicas) replica->StartRun();
  const std::vector<int16_t> counts(2 * 4, 1);
  RouteCall call;
  call.layers = 2;
  call.experts = 4;
  call.prompt_counts = counts;
  call.prompt_tokens = 1;
  // Replica r routes r + 2 requests (round robin from worker 0), replica 1 completes one of them.
  std::vector<int> pool(4, 0);
  uint64_t lease_to_complete = 0;
  int worker_to_complete = -1;
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < r + 2; ++i) {
      absl::StatusOr<RouteDecision> decision = replicas[r]->Route(call, 1000);
      ASSERT_TRUE(decision.ok()) << decision.status();
      ++pool[decision->worker];
      if (r == 1 && i == 0) {
        lease_to_complete = decision->lease_id;
        worker_to_complete = decision->worker;
      }
    }
  }
  ASSERT_TRUE(replicas[1]->Complete(lease_to_complete, 1, 2000).ok());
  --pool[worker_to_complete];
  ASSERT_TRUE(SyncReplicaLeases(replicas, 3000).ok());
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(owned[r]->peer_lease_updates, 1);
    absl::StatusOr<RouterState> state = replicas[r]->GetState(3000);
    ASSERT_TRUE(state.ok());
    ASSERT_EQ(state->workers.size(), 4u);
    for (int w = 0; w < 4; ++w) {
      const WorkerLoad& load = state->workers[w].load;
      EXPECT_EQ(load.effective, pool[w]) << "replica " << r << " worker " << w;
      EXPECT_EQ(load.peer_leases, pool[w] - load.leases) << "replica " << r << " worker " << w;
    }
  }
}

// A whole run of three jsq replicas with shared load: at every sync instant every replica sees the
// pool's leases on every worker; the syncs stop once every arrival is routed.
TEST(ReplicasTest, SharedLoadAppliesThePoolsLeasesAtEverySync) {
  absl::StatusOr<Workload> workload = GenerateSyntheticWorkload(SmallOptions(4));
  ASSERT_TRUE(workload.ok()) << workload.status();
  const ClusterOptions cluster = SmallCluster();
  const std::vector<Arrival> arrivals = MakeArrivals(*workload, 120, 400, 4);
  ReplicaSet set = MakeReplicas(PolicyKind::kJsq, 3, cluster.decoders);
  std::vector<std::unique_ptr<CountingBackend>>& owned = set.owned;
  ReplicaRouters& routers = set.routers;
  ReplicaOptions replica;
  replica.shared_load = true;
  replica.sync_period_ms = 50;
  int syncs = 0, syncs_with_leases = 0;
  double last_sync_us = 0;
  replica.on_sync = [&](double now_us, int synced, absl::Span<const int> pool_leases) {
    EXPECT_EQ(synced, -1);
    ++syncs;
    last_sync_us = now_us;
    EXPECT_NEAR(now_us, syncs * 50e3, 1e-6);
    int total = 0;
    for (int leases : pool_leases) total += leases;
    if (total > 0) ++syncs_with_leases;
    for (int r = 0; r < 3; ++r) {
      absl::StatusOr<RouterState> state = routers.replicas[r]->GetState(now_us);
      ASSERT_TRUE(state.ok());
      ASSERT_EQ(state->workers.size(), pool_leases.size());
      for (size_t w = 0; w < pool_leases.size(); ++w) {
        ASSERT_EQ(state->workers[w].load.effective, pool_leases[w])
            << "replica " << r << " worker " << w << " at " << now_us << " us";
      }
    }
  };
  absl::StatusOr<RunResult> run = SimulateReplicatedRun(*workload, arrivals, cluster, routers, replica);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->replica_syncs, syncs);
  EXPECT_GT(syncs_with_leases, syncs / 2);
  for (const std::unique_ptr<CountingBackend>& backend : owned) EXPECT_EQ(backend->peer_lease_updates, syncs);
  double last_route_us = 0;
  for (const RequestRecord& record : run->requests) last_route_us = std::max(last_route_us, record.routed_us);
  EXPECT_GE(last_sync_us, last_route_us);         // syncs went on while routes remained
  EXPECT_LE(last_sync_us, last_route_us + 50e3);  // and stopped after the last one
}

// Staggered syncs: replica r syncs at (k + r / 3) periods, and at that instant it (only it) sees
// the pool's leases.
TEST(ReplicasTest, StaggeredSyncsRefreshOneReplicaAtATime) {
  absl::StatusOr<Workload> workload = GenerateSyntheticWorkload(SmallOptions(4));
  ASSERT_TRUE(workload.ok()) << workload.status();
  const ClusterOptions cluster = SmallCluster();
  const std::vector<Arrival> arrivals = MakeArrivals(*workload, 120, 400, 4);
  ReplicaSet set = MakeReplicas(PolicyKind::kJsq, 3, cluster.decoders);
  std::vector<std::unique_ptr<CountingBackend>>& owned = set.owned;
  ReplicaRouters& routers = set.routers;
  ReplicaOptions replica;
  replica.shared_load = true;
  replica.sync_period_ms = 60;
  replica.staggered_sync = true;
  std::vector<int> syncs(3, 0);
  replica.on_sync = [&](double now_us, int synced, absl::Span<const int> pool_leases) {
    ASSERT_GE(synced, 0);
    ASSERT_LT(synced, 3);
    ++syncs[synced];
    EXPECT_NEAR(now_us, (syncs[synced] + synced / 3.0) * 60e3, 1e-6) << "replica " << synced;
    absl::StatusOr<RouterState> state = routers.replicas[synced]->GetState(now_us);
    ASSERT_TRUE(state.ok());
    for (size_t w = 0; w < pool_leases.size(); ++w) {
      ASSERT_EQ(state->workers[w].load.effective, pool_leases[w]) << "replica " << synced << " worker " << w;
    }
  };
  absl::StatusOr<RunResult> run = SimulateReplicatedRun(*workload, arrivals, cluster, routers, replica);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->replica_syncs, syncs[0] + syncs[1] + syncs[2]);
  for (int r = 0; r < 3; ++r) {
    EXPECT_GT(syncs[r], 10);
    EXPECT_LE(std::abs(syncs[r] - syncs[0]), 1);
    EXPECT_EQ(owned[r]->peer_lease_updates, syncs[r]);
  }
}

// Shared refit: one driver sees every replica's routes, the leader (replica 0) installs each set
// at once and the followers after the lag; unshared: each replica's driver sees only its routes
// and installs into its replica only.
TEST(ReplicasTest, RefitIsOneDriverForThePoolOrOnePerReplica) {
  absl::StatusOr<Workload> workload = GenerateSyntheticWorkload(SmallOptions(5));
  ASSERT_TRUE(workload.ok()) << workload.status();
  const ClusterOptions cluster = SmallCluster();
  const std::vector<Arrival> arrivals = MakeArrivals(*workload, 80, 400, 5);
  CalibrationOptions calibration;
  calibration.clusters = cluster.decoders;
  absl::StatusOr<CalibrationResult> calibrated = Calibrate(workload->calibration, calibration);
  ASSERT_TRUE(calibrated.ok()) << calibrated.status();
  SimRefitOptions refit_options;
  refit_options.interval_s = 1;
  refit_options.window_s = 3;
  refit_options.min_signatures_per_centroid = 4;
  refit_options.min_experts_gain = -1;  // stationary traffic: the locality bound would refuse every refit

  for (bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "shared" : "unshared");
    std::vector<std::unique_ptr<CountingBackend>> owned;
    std::vector<std::unique_ptr<SimRefitDriver>> drivers;
    ReplicaRouters routers;
    for (int r = 0; r < 3; ++r) {
      owned.push_back(Replica(PolicyKind::kEldr, 0x5eed + r, cluster.decoders, 16));
      CentroidArtifact named = calibrated->artifact;
      named.workers = owned.back()->worker_ids();
      ASSERT_TRUE(owned.back()->InstallCentroids(named).ok());
      owned.back()->installs = 0;
      routers.replicas.push_back(owned.back().get());
      if (shared && r > 0) continue;
      drivers.push_back(*SimRefitDriver::Create(named, refit_options));
      routers.refits.push_back(drivers.back().get());
    }
    ReplicaOptions replica;
    replica.shared_load = shared;
    replica.install_lag_ms = 100;
    absl::StatusOr<RunResult> run = SimulateReplicatedRun(*workload, arrivals, cluster, routers, replica);
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_GT(run->refits, 0);
    if (shared) {
      for (const std::unique_ptr<CountingBackend>& backend : owned) EXPECT_EQ(backend->installs, run->refits);
    } else {
      int installs = 0;
      for (int r = 0; r < 3; ++r) {
        EXPECT_EQ(owned[r]->installs, drivers[r]->refits()) << "replica " << r;
        installs += owned[r]->installs;
      }
      EXPECT_EQ(installs, run->refits);
    }
  }
  // A driver count that is neither one nor one per replica is refused.
  ReplicaSet set = MakeReplicas(PolicyKind::kEldr, 3, cluster.decoders);
  ReplicaRouters& routers = set.routers;
  CentroidArtifact named = calibrated->artifact;
  named.workers = set.owned[0]->worker_ids();
  std::unique_ptr<SimRefitDriver> first = *SimRefitDriver::Create(named, refit_options);
  std::unique_ptr<SimRefitDriver> second = *SimRefitDriver::Create(named, refit_options);
  routers.refits = {first.get(), second.get()};
  EXPECT_EQ(SimulateReplicatedRun(*workload, arrivals, cluster, routers, ReplicaOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Without shared state a replica's overload guard sees only its own leases: on a pool whose zones
// are uneven (3 domains on 4 workers) at heavy load, eldr's spills to less loaded workers mostly
// stop and the load imbalance grows. Checked on seeds 1-6 (imbalance shared 1.18-1.32, unshared
// 1.53-1.69; spills 55-90 against 0-2); the test asserts the direction only, on three of them.
TEST(ReplicasTest, WithoutSharedStateTheOverloadGuardIsBlind) {
  for (uint64_t seed : {1, 2, 3}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    SyntheticOptions synthetic = SmallOptions(seed);
    synthetic.domains = 3;
    synthetic.topics_per_domain = 1;
    absl::StatusOr<Workload> workload = GenerateSyntheticWorkload(synthetic);
    ASSERT_TRUE(workload.ok()) << workload.status();
    ExperimentOptions options;
    options.cluster = SmallCluster();
    options.max_inflight = options.cluster.max_batch;
    options.policies = *ParsePolicies("eldr");
    options.rates = {0.8 * EstimateCapacity(*workload, options.cluster, seed).requests_per_s};
    options.requests = 400;
    options.seed = seed;
    options.setups = *ExpandReplicaSetups({3}, "both");
    absl::StatusOr<ExperimentResult> result = RunExperiment(*workload, options);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->cells.size(), 2u);
    const ExperimentCell& shared = result->cells[0];
    const ExperimentCell& unshared = result->cells[1];
    ASSERT_TRUE(shared.setup.shared_state);
    ASSERT_FALSE(unshared.setup.shared_state);
    EXPECT_GT(shared.run.replica_syncs, 0);
    EXPECT_EQ(unshared.run.replica_syncs, 0);
    EXPECT_LT(shared.run.metrics.load_imbalance, unshared.run.metrics.load_imbalance);
    const auto spills = [](const ExperimentCell& cell) {
      const auto it = cell.run.fallbacks.find("overload");
      return it == cell.run.fallbacks.end() ? 0 : it->second;
    };
    EXPECT_GT(spills(shared), spills(unshared));
  }
}

}  // namespace
}  // namespace eldr::sim
