#include "eldr/core/router.h"

#include <atomic>
#include <cmath>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "eldr/core/errors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 2;
constexpr int kExperts = 4;
const absl::Time kT0 = absl::FromUnixSeconds(1700000000);

WorkerSpec Worker(const std::string& id, double capacity = 1, int64_t max_inflight = 0) {
  WorkerSpec spec;
  spec.id = id;
  spec.address = absl::StrCat(id, ".decode:8000");
  spec.capacity = capacity;
  spec.max_inflight = max_inflight;
  return spec;
}

// Row i is hot on expert i in both layers (count variant, all layers, dim 8).
CentroidArtifact Artifact(int k, std::vector<std::string> workers = {}) {
  CentroidArtifact artifact;
  artifact.spec.layers = kLayers;
  artifact.spec.experts = kExperts;
  artifact.spec.variant = SignatureVariant::kCount;
  artifact.k = k;
  artifact.centroids.assign(static_cast<size_t>(k) * kLayers * kExperts, 0.f);
  for (int r = 0; r < k; ++r) {
    const int expert = r % kExperts;
    artifact.centroids[r * 8 + expert] = static_cast<float>(M_SQRT1_2);
    artifact.centroids[r * 8 + 4 + expert] = static_cast<float>(M_SQRT1_2);
  }
  artifact.workers = std::move(workers);
  artifact.model = "test";
  return artifact;
}

// Counts that choose `expert` in both layers, plus a little of the next expert.
std::vector<int32_t> Counts(int expert, int32_t hot = 10, int32_t side = 1) {
  std::vector<int32_t> counts(kLayers * kExperts, 0);
  for (int l = 0; l < kLayers; ++l) {
    counts[l * kExperts + expert] = hot;
    counts[l * kExperts + (expert + 1) % kExperts] += side;
  }
  return counts;
}

std::unique_ptr<Router> MakeRouter(std::vector<WorkerSpec> workers, RouterOptions options = {}) {
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Create(std::move(options), std::move(workers));
  EXPECT_TRUE(router.ok()) << router.status();
  return *std::move(router);
}

TEST(RouterCreateTest, ValidatesTheLoadGap) {
  for (double gap : {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    RouterOptions options;
    options.max_load_gap = gap;
    const absl::Status status = Router::Create(options, {Worker("a")}).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << gap;
    EXPECT_THAT(std::string(status.message()), HasSubstr("max_load_gap")) << gap;
  }
  RouterOptions options;
  options.max_load_gap = 8;
  EXPECT_TRUE(Router::Create(options, {Worker("a")}).ok());
}

TEST(RouterCreateTest, ValidatesOptionsAndWorkers) {
  RouterOptions options;
  options.tau = 1.5;
  EXPECT_EQ(Router::Create(options, {}).status().code(), absl::StatusCode::kInvalidArgument);
  options.tau = std::nan("");
  EXPECT_EQ(Router::Create(options, {}).status().code(), absl::StatusCode::kInvalidArgument);
  options = {};
  options.load.lease_ttl = absl::ZeroDuration();
  EXPECT_EQ(Router::Create(options, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(Router::Create({}, {Worker("a"), Worker("a")}).status().message()),
              HasSubstr("duplicate worker id 'a'"));
  EXPECT_EQ(Router::Create({}, {Worker("")}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Router::Create({}, {Worker("a", 0)}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Router::Create({}, {Worker("a", 1, -1)}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Router::Create({}, {}).ok());
}

TEST(RouterTest, FallsBackWithoutCentroidsOrSignature) {
  auto router = MakeRouter({Worker("a"), Worker("b")});
  const std::vector<int32_t> counts = Counts(1);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  absl::StatusOr<RouteResult> no_centroids = router->Route(&input, kT0);
  ASSERT_TRUE(no_centroids.ok()) << no_centroids.status();
  EXPECT_EQ(no_centroids->fallback, FallbackReason::kNoCentroids);
  EXPECT_EQ(no_centroids->policy, PolicyKind::kJsq);
  EXPECT_EQ(no_centroids->centroid_generation, 0u);
  // jsq: the other worker is now less loaded.
  absl::StatusOr<RouteResult> no_signature = router->Route(nullptr, kT0);
  ASSERT_TRUE(no_signature.ok());
  EXPECT_EQ(no_signature->fallback, FallbackReason::kNoSignature);
  EXPECT_NE(no_signature->worker_id, no_centroids->worker_id);
  EXPECT_EQ(router->CurrentCentroids().status().code(), absl::StatusCode::kNotFound);
}

TEST(RouterTest, RoutesToTheClosestCentroid) {
  auto router = MakeRouter({Worker("a"), Worker("b"), Worker("c")});
  ASSERT_TRUE(router->InstallCentroids(Artifact(3)).ok());
  for (int expert = 0; expert < 3; ++expert) {
    const std::vector<int32_t> counts = Counts(expert);
    const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
    absl::StatusOr<RouteResult> result = router->Route(&input, kT0);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->worker_id, std::string(1, static_cast<char>('a' + expert)));
    EXPECT_EQ(result->address, result->worker_id + ".decode:8000");
    EXPECT_NEAR(result->similarity, 10.0 / std::sqrt(101.0), 1e-3);
    EXPECT_EQ(result->policy, PolicyKind::kEldr);
    EXPECT_EQ(result->fallback, FallbackReason::kNone);
    EXPECT_EQ(result->centroid_generation, 1u);
    EXPECT_EQ(result->band_size, 1);
    EXPECT_TRUE(router->Complete(result->lease_id).ok());
  }
  // The same bytes as int16 little-endian, as the reference engine sends them.
  const std::vector<int32_t> counts = Counts(2);
  std::string bytes;
  for (int32_t c : counts) {
    bytes.push_back(static_cast<char>(c & 0xff));
    bytes.push_back(static_cast<char>((c >> 8) & 0xff));
  }
  const SignatureInput input16 = CountsInt16Le{kLayers, kExperts, bytes};
  EXPECT_EQ(router->Route(&input16, kT0)->worker_id, "c");
}

TEST(RouterTest, ZeroSignatureFallsBackAndBadInputIsRejected) {
  auto router = MakeRouter({Worker("a"), Worker("b")});
  ASSERT_TRUE(router->InstallCentroids(Artifact(2)).ok());
  const std::vector<int32_t> zeros(8, 0);
  const SignatureInput zero = CountsInt32{kLayers, kExperts, zeros};
  absl::StatusOr<RouteResult> result = router->Route(&zero, kT0);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->fallback, FallbackReason::kZeroSignature);
  EXPECT_EQ(result->policy, PolicyKind::kJsq);

  const std::vector<int32_t> wrong(9, 1);
  const SignatureInput geometry = CountsInt32{3, 3, wrong};
  const absl::Status status = router->Route(&geometry, kT0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RejectReasonOf(status), RejectReason::kGeometry);
  std::vector<int32_t> negative = Counts(0);
  negative[3] = -2;
  const SignatureInput neg = CountsInt32{kLayers, kExperts, negative};
  EXPECT_EQ(RejectReasonOf(router->Route(&neg, kT0).status()), RejectReason::kNegativeCount);
  // Rejected requests take no lease.
  EXPECT_EQ(router->GetState(kT0).live_leases, 1);
}

TEST(RouterTest, InstallMapsRowsOrFailsClearly) {
  auto router = MakeRouter({Worker("a"), Worker("b")});
  absl::Status mismatch = router->InstallCentroids(Artifact(3)).status();
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(mismatch.message()), HasSubstr("k = 3 unnamed rows but the router has 2"));
  absl::Status unknown = router->InstallCentroids(Artifact(2, {"a", "zz"})).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(RejectReasonOf(unknown), RejectReason::kUnknownWorker);
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("zz"));
  CentroidArtifact invalid = Artifact(2);
  invalid.centroids[0] = 3.f;
  EXPECT_EQ(router->InstallCentroids(invalid).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(router->GetState(kT0).centroid_generation, 0u);

  // Named rows in any order: row 0 belongs to b.
  ASSERT_TRUE(router->InstallCentroids(Artifact(2, {"b", "a"})).ok());
  const std::vector<int32_t> counts = Counts(0);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  EXPECT_EQ(router->Route(&input, kT0)->worker_id, "b");
  // Unnamed rows follow insertion order; CurrentCentroids reports the names.
  ASSERT_TRUE(router->InstallCentroids(Artifact(2)).ok());
  EXPECT_EQ(router->Route(&input, kT0)->worker_id, "a");
  absl::StatusOr<CentroidArtifact> current = router->CurrentCentroids();
  ASSERT_TRUE(current.ok());
  EXPECT_EQ(current->workers, (std::vector<std::string>{"a", "b"}));
  const RouterState state = router->GetState(kT0);
  EXPECT_EQ(state.centroid_generation, 2u);  // failed installs do not consume a generation
  EXPECT_EQ(state.centroid_rows, 2);
  EXPECT_FALSE(state.index_kind.empty());
  // A failed install leaves the set in service.
  EXPECT_FALSE(router->InstallCentroids(Artifact(5)).ok());
  EXPECT_EQ(router->GetState(kT0).centroid_generation, 2u);
  EXPECT_EQ(router->Route(&input, kT0)->worker_id, "a");
}

TEST(RouterTest, WorkerTableChangesRemapRows) {
  auto router = MakeRouter({Worker("a"), Worker("b"), Worker("c")});
  ASSERT_TRUE(router->InstallCentroids(Artifact(3)).ok());
  const std::vector<int32_t> for_b = Counts(1);
  const SignatureInput input = CountsInt32{kLayers, kExperts, for_b};
  absl::StatusOr<RouteResult> first = router->Route(&input, kT0);
  ASSERT_EQ(first->worker_id, "b");

  // Removing a (index 0) shifts b and c; b keeps its centroid.
  ASSERT_TRUE(router->RemoveWorker("a").ok());
  EXPECT_EQ(router->Route(&input, kT0)->worker_id, "b");
  // Removing b drops its leases and its locality: b's requests fall back.
  ASSERT_TRUE(router->RemoveWorker("b").ok());
  // A request that was in flight on b completes late: answered with b, once, and counted.
  absl::StatusOr<std::string> late = router->Complete(first->lease_id);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(*late, "b");
  EXPECT_EQ(router->Complete(first->lease_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(router->GetState(kT0).completes_after_removal_total, 1);
  absl::StatusOr<RouteResult> orphan = router->Route(&input, kT0);
  ASSERT_TRUE(orphan.ok());
  EXPECT_EQ(orphan->worker_id, "c");  // the only candidate left with a centroid
  // A new worker has no centroid until b (named in the set) comes back.
  ASSERT_TRUE(router->UpsertWorker(Worker("d")).ok());
  RouterState state = router->GetState(kT0);
  ASSERT_EQ(state.workers.size(), 2u);
  EXPECT_EQ(state.workers[0].spec.id, "c");
  EXPECT_TRUE(state.workers[0].has_centroid);
  EXPECT_FALSE(state.workers[1].has_centroid);
  ASSERT_TRUE(router->UpsertWorker(Worker("b")).ok());
  state = router->GetState(kT0);
  EXPECT_TRUE(state.workers[2].has_centroid);
  EXPECT_EQ(router->Route(&input, kT0)->worker_id, "b");
  EXPECT_EQ(router->RemoveWorker("nobody").status().code(), absl::StatusCode::kNotFound);
}

TEST(RouterTest, NoCandidateWithCentroidFallsBack) {
  auto router = MakeRouter({Worker("a"), Worker("b")});
  ASSERT_TRUE(router->InstallCentroids(Artifact(1, {"a"})).ok());
  ASSERT_TRUE(router->DrainWorker("a").ok());
  const std::vector<int32_t> counts = Counts(0);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  absl::StatusOr<RouteResult> result = router->Route(&input, kT0);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->worker_id, "b");
  EXPECT_EQ(result->fallback, FallbackReason::kNoEligibleCentroid);
  EXPECT_EQ(result->policy, PolicyKind::kJsq);
}

TEST(RouterTest, DrainingAndHealth) {
  auto router = MakeRouter({Worker("a"), Worker("b")});
  ASSERT_TRUE(router->InstallCentroids(Artifact(2)).ok());
  const std::vector<int32_t> counts = Counts(0);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  absl::StatusOr<RouteResult> leased = router->Route(&input, kT0);
  ASSERT_EQ(leased->worker_id, "a");
  ASSERT_TRUE(router->DrainWorker("a").ok());
  EXPECT_EQ(router->Route(&input, kT0)->worker_id, "b");
  EXPECT_TRUE(router->Complete(leased->lease_id).ok());  // its leases finish normally
  ASSERT_TRUE(router->DrainWorker("b").ok());
  EXPECT_EQ(router->Route(&input, kT0).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(router->UpsertWorker(Worker("a")).ok());  // active again
  EXPECT_EQ(router->Route(&input, kT0)->worker_id, "a");
  EXPECT_EQ(router->GetState(kT0).workers[1].state, WorkerState::kDraining);

  ASSERT_TRUE(router->UpsertWorker(Worker("b")).ok());
  ASSERT_TRUE(router->SetWorkerHealthy("a", false).ok());
  absl::StatusOr<RouteResult> healthy_only = router->Route(&input, kT0);
  EXPECT_EQ(healthy_only->worker_id, "b");
  EXPECT_EQ(healthy_only->fallback, FallbackReason::kNone);
  ASSERT_TRUE(router->SetWorkerHealthy("b", false).ok());
  absl::StatusOr<RouteResult> fail_open = router->Route(&input, kT0);
  ASSERT_TRUE(fail_open.ok());
  EXPECT_EQ(fail_open->worker_id, "a");
  EXPECT_EQ(fail_open->fallback, FallbackReason::kAllUnhealthy);
  EXPECT_EQ(router->SetWorkerHealthy("zz", true).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(router->DrainWorker("zz").status().code(), absl::StatusCode::kNotFound);

  auto empty = MakeRouter({});
  EXPECT_EQ(empty->Route(nullptr, kT0).status().code(), absl::StatusCode::kUnavailable);
}

TEST(RouterTest, LoadReportsAndCapacityDriveTheBand) {
  RouterOptions options;
  options.tau = 1.0;  // every worker in the band: pure load balance
  auto router = MakeRouter({Worker("a"), Worker("b"), Worker("c", 4)}, options);
  ASSERT_TRUE(router->InstallCentroids(Artifact(3)).ok());
  ASSERT_TRUE(router->ReportLoad("a", {.running = 1, .waiting = 0, .kv_usage = 0.1, .taken_at = kT0}, kT0).ok());
  ASSERT_TRUE(router->ReportLoad("b", {.running = 0, .waiting = 0, .kv_usage = 0.1, .taken_at = kT0}, kT0).ok());
  ASSERT_TRUE(router->ReportLoad("c", {.running = 6, .waiting = 2, .kv_usage = 0.9, .taken_at = kT0}, kT0).ok());
  const std::vector<int32_t> counts = Counts(0);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  const absl::Time now = kT0 + absl::Seconds(1);
  // b (0) < a (1) < c (8 / 4 = 2).
  absl::StatusOr<RouteResult> r = router->Route(&input, now);
  EXPECT_EQ(r->worker_id, "b");
  EXPECT_EQ(r->band_size, 3);
  // b reports 5 running after that lease was taken: b = 5 + 1 lease since, a = 1, c = 2.
  ASSERT_TRUE(router->ReportLoad("b", {.running = 5, .taken_at = kT0 + absl::Milliseconds(500)}, now).ok());
  EXPECT_EQ(router->Route(&input, now)->worker_id, "a");
  const RouterState state = router->GetState(now);
  EXPECT_DOUBLE_EQ(state.workers[2].load.effective, 8);
  EXPECT_TRUE(state.workers[2].load.snapshot_fresh);
  EXPECT_EQ(router->ReportLoad("a", {.running = -1, .taken_at = kT0}, now).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(router->ReportLoad("x", {.running = 1, .taken_at = kT0}, now).code(), absl::StatusCode::kNotFound);
}

TEST(RouterTest, PeerLeasesJoinEffectiveLoadWithoutDoubleCounting) {
  RouterOptions options;
  options.tau = 1.0;  // pure load balance
  auto router = MakeRouter({Worker("a"), Worker("b")}, options);
  ASSERT_TRUE(router->InstallCentroids(Artifact(2)).ok());
  const std::vector<int32_t> counts = Counts(0);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  const absl::Time now = kT0 + absl::Seconds(1);
  // No snapshot: the peers' live leases count (a = 3 from peers, b = 0).
  router->SetPeerLeases({{"a", {.live = 3, .since_snapshot = 1}}, {"nobody", {.live = 9}}});
  RouterState state = router->GetState(now);
  EXPECT_EQ(state.workers[0].load.peer_leases, 3);
  EXPECT_DOUBLE_EQ(state.workers[0].load.effective, 3);
  EXPECT_EQ(state.workers[1].load.peer_leases, 0);
  EXPECT_EQ(router->Route(&input, now)->worker_id, "b");
  // A fresh snapshot of a already counts the peers' older leases: only their since_snapshot adds.
  ASSERT_TRUE(router->ReportLoad("a", {.running = 0, .taken_at = now}, now).ok());
  state = router->GetState(now);
  EXPECT_EQ(state.workers[0].load.peer_leases, 1);
  EXPECT_DOUBLE_EQ(state.workers[0].load.effective, 1);
  // b: 1 own lease; a: 0 + 1 from peers: a tie broken either way; make b heavier via peers.
  router->SetPeerLeases({{"a", {.live = 3, .since_snapshot = 1}}, {"b", {.live = 4, .since_snapshot = 4}}});
  EXPECT_EQ(router->Route(&input, now)->worker_id, "a");
  // Own lease counts never include the peers' (what a replica publishes).
  state = router->GetState(now);
  EXPECT_EQ(state.workers[1].load.leases, 1);
  EXPECT_DOUBLE_EQ(state.workers[1].load.effective, 5);
  // Cleared: own leases only; negative counts are clamped.
  router->SetPeerLeases({{"b", {.live = -7, .since_snapshot = -7}}});
  state = router->GetState(now);
  EXPECT_EQ(state.workers[0].load.peer_leases, 0);
  EXPECT_EQ(state.workers[1].load.peer_leases, 0);
  EXPECT_DOUBLE_EQ(state.workers[1].load.effective, 1);
}

TEST(RouterTest, OverloadGuardSpills) {
  RouterOptions options;
  options.tau = 0.0;
  auto router = MakeRouter({Worker("a", 1, 2), Worker("b")}, options);
  ASSERT_TRUE(router->InstallCentroids(Artifact(2)).ok());
  const std::vector<int32_t> counts = Counts(0);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  EXPECT_EQ(router->Route(&input, kT0)->worker_id, "a");
  EXPECT_EQ(router->Route(&input, kT0)->worker_id, "a");
  absl::StatusOr<RouteResult> spilled = router->Route(&input, kT0);
  EXPECT_EQ(spilled->worker_id, "b");
  EXPECT_EQ(spilled->fallback, FallbackReason::kOverload);
}

TEST(RouterTest, TheRouterRemembersABoundedNumberOfRemovedLeases) {
  auto router = MakeRouter({Worker("a"), Worker("b")}, RouterOptions{.policy = PolicyKind::kRoundRobin});
  std::vector<uint64_t> on_a;
  int64_t on_b = 0;
  for (size_t i = 0; on_a.size() < kRemovedLeasesRemembered + 10; ++i) {
    // Distinct times: removal drops (and remembers) a worker's leases oldest first.
    absl::StatusOr<RouteResult> routed = router->Route(nullptr, kT0 + absl::Microseconds(i));
    ASSERT_TRUE(routed.ok()) << routed.status();
    if (routed->worker_id == "a") {
      on_a.push_back(routed->lease_id);
    } else {
      ++on_b;
    }
  }
  ASSERT_TRUE(router->RemoveWorker("a").ok());
  // The oldest ten were forgotten (NOT_FOUND, as for any unknown lease); the rest answer "a" once.
  for (size_t i = 0; i < on_a.size(); ++i) {
    absl::StatusOr<std::string> done = router->Complete(on_a[i]);
    if (i < 10) {
      EXPECT_EQ(done.status().code(), absl::StatusCode::kNotFound) << i;
    } else {
      ASSERT_TRUE(done.ok()) << i << ": " << done.status();
      EXPECT_EQ(*done, "a");
    }
  }
  EXPECT_EQ(router->GetState(kT0).completes_after_removal_total, static_cast<int64_t>(kRemovedLeasesRemembered));
  EXPECT_EQ(router->Complete(on_a.back()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(router->GetState(kT0).live_leases, on_b);  // b's leases were never touched
}

TEST(RouterTest, LeasesExpireAndCompleteOnce) {
  RouterOptions options;
  options.load.lease_ttl = absl::Seconds(10);
  auto router = MakeRouter({Worker("a")}, options);
  absl::StatusOr<RouteResult> first = router->Route(nullptr, kT0);
  absl::StatusOr<RouteResult> second = router->Route(nullptr, kT0 + absl::Seconds(8));
  EXPECT_NE(first->lease_id, second->lease_id);
  EXPECT_EQ(router->ExpireLeases(kT0 + absl::Seconds(11)), 1);
  EXPECT_EQ(router->Complete(first->lease_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(router->Complete(second->lease_id).ok());
  EXPECT_EQ(router->Complete(second->lease_id).status().code(), absl::StatusCode::kNotFound);
  const RouterState state = router->GetState(kT0 + absl::Seconds(12));
  EXPECT_EQ(state.live_leases, 0);
  EXPECT_EQ(state.leases_expired_total, 1);
  EXPECT_EQ(state.workers[0].load.leases, 0);
}

// Records what a RouterObserver is told.
class RecordingObserver : public RouterObserver {
 public:
  void OnSignatureRouted(const RoutedSignature& routed) override {
    std::lock_guard<std::mutex> lock(mu);
    const absl::Span<const float> signature = routed.signature();
    signatures.emplace_back(std::vector<float>(signature.begin(), signature.end()), std::string(routed.worker_id));
    clients.emplace_back(routed.client);
    leases.push_back(routed.lease_id);
  }
  void OnPoolChanged(const PoolChange& change) override {
    std::lock_guard<std::mutex> lock(mu);
    pool.push_back(change);
  }
  void OnCentroidsInstalled(const CentroidInstall& install) override {
    std::lock_guard<std::mutex> lock(mu);
    installs.push_back(install);
  }
  void OnCentroidsRejected(CentroidSource source, const absl::Status& status) override {
    std::lock_guard<std::mutex> lock(mu);
    rejections.emplace_back(source, status);
  }

  std::mutex mu;
  std::vector<std::pair<std::vector<float>, std::string>> signatures;
  std::vector<std::string> clients;
  std::vector<uint64_t> leases;
  std::vector<PoolChange> pool;
  std::vector<CentroidInstall> installs;
  std::vector<std::pair<CentroidSource, absl::Status>> rejections;
};

TEST(RouterTest, OnSignatureSeesAcceptedSignaturesOnly) {
  RecordingObserver observer;
  auto router = MakeRouter({Worker("a"), Worker("b")});
  router->AddObserver(&observer);
  ASSERT_TRUE(router->InstallCentroids(Artifact(2)).ok());
  const std::vector<int32_t> counts = Counts(1, 3, 4);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  ASSERT_TRUE(router->Route(&input, kT0).ok());
  ASSERT_TRUE(router->Route(nullptr, kT0).ok());
  const std::vector<int32_t> zeros(8, 0);
  const SignatureInput zero = CountsInt32{kLayers, kExperts, zeros};
  ASSERT_TRUE(router->Route(&zero, kT0).ok());
  const auto& seen = observer.signatures;
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].second, "b");
  ASSERT_EQ(seen[0].first.size(), 8u);
  EXPECT_NEAR(seen[0].first[1], 3 / std::sqrt(50.0), 1e-6);  // unit-norm transformed vector
  // The client of a RouteInput reaches the observer.
  ASSERT_TRUE(router->Route(RouteInput{&input, kT0, "ipv4:10.1.2.3"}).ok());
  ASSERT_EQ(observer.clients.size(), 2u);
  EXPECT_EQ(observer.clients[1], "ipv4:10.1.2.3");
  router->RemoveObserver(&observer);
  ASSERT_TRUE(router->Route(&input, kT0).ok());
  EXPECT_EQ(observer.signatures.size(), 2u);
}

// Hears lease ends; reads the router inside the callback, which would deadlock if the router
// held its routing lock while telling observers.
class LeaseEndObserver : public RouterObserver {
 public:
  explicit LeaseEndObserver(Router* router) : router_(router) {}
  void OnLeaseEnded(const LeaseEnd& ended) override {
    const int64_t live = router_->GetState(kT0).live_leases;
    std::lock_guard<std::mutex> lock(mu);
    ends.push_back(ended);
    live_during.push_back(live);
  }
  Router* const router_;
  std::mutex mu;
  std::vector<LeaseEnd> ends;
  std::vector<int64_t> live_during;
};

TEST(RouterTest, ObserversHearEveryLeaseEndWithItsTokensAndHoldTime) {
  RouterOptions options;
  options.max_live_leases = 3;
  auto router = MakeRouter({Worker("a"), Worker("b")}, options);
  LeaseEndObserver observer(router.get());
  router->AddObserver(&observer);

  // Complete: output tokens and the time from route to complete.
  absl::StatusOr<RouteResult> first = router->Route(nullptr, kT0);
  ASSERT_TRUE(first.ok());
  CompleteInput complete;
  complete.lease_id = first->lease_id;
  complete.output_tokens = 321;
  complete.now = kT0 + absl::Milliseconds(1500);
  ASSERT_TRUE(router->Complete(complete).ok());
  ASSERT_EQ(observer.ends.size(), 1u);
  EXPECT_EQ(observer.ends[0].lease_id, first->lease_id);
  EXPECT_EQ(observer.ends[0].worker_id, first->worker_id);
  EXPECT_EQ(observer.ends[0].kind, LeaseEndKind::kCompleted);
  EXPECT_FALSE(observer.ends[0].expired);
  EXPECT_EQ(observer.ends[0].output_tokens, 321);
  EXPECT_EQ(observer.ends[0].held, absl::Milliseconds(1500));
  EXPECT_EQ(observer.live_during[0], 0);  // told after the release, without the routing lock
  // A second Complete of the same lease, or negative tokens, tell nobody.
  EXPECT_EQ(router->Complete(complete).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<RouteResult> second = router->Route(nullptr, kT0);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(router->Complete(second->lease_id, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(observer.ends.size(), 1u);
  // The old form still works: no tokens reported.
  ASSERT_TRUE(router->Complete(second->lease_id).ok());
  ASSERT_EQ(observer.ends.size(), 2u);
  EXPECT_EQ(observer.ends[1].output_tokens, 0);
  EXPECT_EQ(observer.ends[1].kind, LeaseEndKind::kCompleted);

  // Eviction at the live-lease limit (3): the fourth route releases the oldest.
  std::vector<uint64_t> leases;
  for (int i = 0; i < 4; ++i) leases.push_back(router->Route(nullptr, kT0 + absl::Seconds(i)).value().lease_id);
  ASSERT_EQ(observer.ends.size(), 3u);
  EXPECT_EQ(observer.ends[2].lease_id, leases[0]);
  EXPECT_EQ(observer.ends[2].kind, LeaseEndKind::kEvicted);
  EXPECT_TRUE(observer.ends[2].expired);
  EXPECT_EQ(observer.ends[2].output_tokens, 0);
  EXPECT_EQ(observer.ends[2].held, absl::Seconds(3));

  // Expiry: the leases older than the TTL, each told with its hold time to `now`.
  const absl::Time later = kT0 + options.load.lease_ttl + absl::Seconds(2) + absl::Milliseconds(500);
  EXPECT_EQ(router->ExpireLeases(later), 2);  // routed at kT0 + 1 s and + 2 s
  ASSERT_EQ(observer.ends.size(), 5u);
  for (int i = 3; i < 5; ++i) {
    EXPECT_EQ(observer.ends[i].kind, LeaseEndKind::kExpired);
    EXPECT_TRUE(observer.ends[i].expired);
    EXPECT_GE(observer.ends[i].held, options.load.lease_ttl);
  }

  // Removal drops the rest.
  RouterState state = router->GetState(later);
  ASSERT_EQ(state.live_leases, 1);
  std::string holder;
  for (const WorkerStatus& w : state.workers) {
    if (w.load.leases > 0) holder = w.spec.id;
  }
  ASSERT_TRUE(router->RemoveWorker(holder).ok());
  ASSERT_EQ(observer.ends.size(), 6u);
  EXPECT_EQ(observer.ends[5].lease_id, leases[3]);
  EXPECT_EQ(observer.ends[5].kind, LeaseEndKind::kWorkerRemoved);
  EXPECT_EQ(observer.ends[5].worker_id, holder);
  EXPECT_EQ(LeaseEndKindLabel(LeaseEndKind::kWorkerRemoved), "worker_removed");

  router->RemoveObserver(&observer);
  absl::StatusOr<RouteResult> unheard = router->Route(nullptr, kT0);
  ASSERT_TRUE(unheard.ok());
  ASSERT_TRUE(router->Complete(unheard->lease_id, 5).ok());
  EXPECT_EQ(observer.ends.size(), 6u);
}

TEST(RouterTest, ObserversHearEveryChangeInOrderAndMutationsSayWhatTheyDid) {
  RecordingObserver observer;
  auto router = MakeRouter({Worker("a"), Worker("b")});
  router->AddObserver(&observer);
  absl::StatusOr<uint64_t> first = router->InstallCentroids(Artifact(2), CentroidSource::kStartup);
  ASSERT_TRUE(first.ok());
  absl::StatusOr<PoolChange> created = router->UpsertWorker(Worker("c"));
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(created->kind, PoolChangeKind::kAdded);
  absl::StatusOr<PoolChange> updated = router->UpsertWorker(Worker("c", 2));
  ASSERT_TRUE(updated.ok());
  EXPECT_EQ(updated->kind, PoolChangeKind::kUpdated);
  const uint64_t lease = router->Route(nullptr, kT0)->lease_id;
  absl::StatusOr<PoolChange> drained = router->DrainWorker("c");
  ASSERT_TRUE(drained.ok());
  ASSERT_TRUE(router->SetWorkerHealthy("a", false).ok());
  ASSERT_TRUE(router->SetWorkerHealthy("a", false).ok());  // no change: not announced
  ASSERT_TRUE(router->SetWorkerHealthy("a", true).ok());
  const absl::StatusOr<uint64_t> refused = router->InstallCentroids(Artifact(5), CentroidSource::kAdmin);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<uint64_t> second = router->InstallCentroids(Artifact(2, {"b", "a"}), CentroidSource::kRefit);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, *first + 1);
  absl::StatusOr<PoolChange> removed = router->RemoveWorker("b");
  ASSERT_TRUE(removed.ok());
  (void)lease;

  std::vector<std::string> kinds;
  for (const PoolChange& change : observer.pool) {
    kinds.push_back(absl::StrCat(PoolChangeKindLabel(change.kind), ":", change.spec.id));
  }
  EXPECT_EQ(kinds, (std::vector<std::string>{"added:c", "updated:c", "draining:c", "health_changed:a",
                                             "health_changed:a", "removed:b"}));
  EXPECT_FALSE(observer.pool[3].healthy);
  EXPECT_TRUE(observer.pool[4].healthy);
  ASSERT_EQ(observer.installs.size(), 2u);
  EXPECT_EQ(observer.installs[0].source, CentroidSource::kStartup);
  EXPECT_EQ(observer.installs[0].generation, *first);
  EXPECT_TRUE(observer.installs[0].transform_changed);
  EXPECT_EQ(observer.installs[1].source, CentroidSource::kRefit);
  EXPECT_FALSE(observer.installs[1].transform_changed);
  EXPECT_EQ(observer.installs[1].workers, (std::vector<std::string>{"b", "a"}));
  ASSERT_EQ(observer.rejections.size(), 1u);
  EXPECT_EQ(observer.rejections[0].first, CentroidSource::kAdmin);
  EXPECT_EQ(observer.rejections[0].second.code(), absl::StatusCode::kFailedPrecondition);
  router->RemoveObserver(&observer);
}

// A callback may mutate the router: its own change is delivered after the current one.
TEST(RouterTest, ObserverCallbacksMayMutateTheRouter) {
  struct Reactor : RecordingObserver {
    Router* router = nullptr;
    void OnPoolChanged(const PoolChange& change) override {
      RecordingObserver::OnPoolChanged(change);
      if (change.kind == PoolChangeKind::kAdded && change.spec.id == "c") (void)router->DrainWorker("c");
    }
  } reactor;
  auto router = MakeRouter({Worker("a")});
  reactor.router = router.get();
  router->AddObserver(&reactor);
  ASSERT_TRUE(router->UpsertWorker(Worker("c")).ok());
  ASSERT_EQ(reactor.pool.size(), 2u);
  EXPECT_EQ(reactor.pool[0].kind, PoolChangeKind::kAdded);
  EXPECT_EQ(reactor.pool[1].kind, PoolChangeKind::kDraining);
  router->RemoveObserver(&reactor);
}

TEST(RouterTest, BaselinePoliciesStillValidateSignatures) {
  RouterOptions options;
  options.policy = PolicyKind::kRoundRobin;
  auto router = MakeRouter({Worker("a"), Worker("b"), Worker("c")}, options);
  ASSERT_TRUE(router->InstallCentroids(Artifact(3)).ok());
  const std::vector<int32_t> counts = Counts(0);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  std::vector<std::string> picks;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<RouteResult> result = router->Route(&input, kT0);
    ASSERT_TRUE(result.ok());
    EXPECT_EQ(result->policy, PolicyKind::kRoundRobin);
    EXPECT_EQ(result->fallback, FallbackReason::kNone);
    EXPECT_EQ(result->band_size, 0);
    picks.push_back(result->worker_id);
  }
  EXPECT_EQ(picks, (std::vector<std::string>{"a", "b", "c", "a"}));
  const std::vector<int32_t> wrong(3, 1);
  const SignatureInput bad = CountsInt32{1, 3, wrong};
  EXPECT_EQ(router->Route(&bad, kT0).status().code(), absl::StatusCode::kInvalidArgument);
}

// Many threads route and complete while centroids are swapped and the worker table changes.
// Counts without their geometry (0 x 0, the reference's bare `eldr_sig` bytes) take the
// calibrated one; a wrong length is still refused.
TEST(RouterTest, CountsWithoutGeometryUseTheCalibratedOne) {
  auto router = MakeRouter({Worker("a"), Worker("b"), Worker("c")});
  ASSERT_TRUE(router->InstallCentroids(Artifact(3)).ok());
  const std::vector<int32_t> counts = Counts(1);
  std::string bytes;
  for (int32_t c : counts) {
    bytes.push_back(static_cast<char>(c & 0xff));
    bytes.push_back(static_cast<char>((c >> 8) & 0xff));
  }
  const SignatureInput bare = CountsInt16Le{0, 0, bytes};
  absl::StatusOr<RouteResult> routed = router->Route(&bare, kT0);
  ASSERT_TRUE(routed.ok()) << routed.status();
  EXPECT_EQ(routed->worker_id, "b");
  EXPECT_EQ(routed->fallback, FallbackReason::kNone);
  const SignatureInput bare32 = CountsInt32{0, 0, counts};
  EXPECT_EQ(router->Route(&bare32, kT0)->worker_id, "b");
  const std::string short_bytes = bytes.substr(0, bytes.size() - 2);
  const SignatureInput wrong = CountsInt16Le{0, 0, short_bytes};
  EXPECT_EQ(RejectReasonOf(router->Route(&wrong, kT0).status()), RejectReason::kGeometry);
  const SignatureInput half = CountsInt16Le{kLayers, 0, bytes};  // one of the two 0 is a mismatch
  EXPECT_EQ(RejectReasonOf(router->Route(&half, kT0).status()), RejectReason::kGeometry);
}

// A caller that could not reach a worker re-routes without it; the locality pick moves to the
// next best worker, and excluding every worker is UNAVAILABLE.
TEST(RouterTest, ExcludedWorkersAreNeverPicked) {
  auto router = MakeRouter({Worker("a"), Worker("b"), Worker("c")});
  ASSERT_TRUE(router->InstallCentroids(Artifact(3)).ok());
  const std::vector<int32_t> counts = Counts(1);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  RouteInput route{&input, kT0};
  EXPECT_EQ(router->Route(route)->worker_id, "b");
  const std::vector<std::string> not_b = {"b", "no-such-worker"};
  route.exclude_workers = not_b;
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<RouteResult> routed = router->Route(route);
    ASSERT_TRUE(routed.ok()) << routed.status();
    EXPECT_NE(routed->worker_id, "b");
  }
  const std::vector<std::string> everyone = {"a", "b", "c"};
  route.exclude_workers = everyone;
  const absl::Status none = router->Route(route).status();
  EXPECT_EQ(none.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(none.message()), HasSubstr("excluded"));
  // A long list goes through the set path and behaves the same.
  std::vector<std::string> long_list;
  for (int i = 0; i < 50; ++i) long_list.push_back(absl::StrCat("other-", i));
  long_list.push_back("a");
  long_list.push_back("c");
  route.exclude_workers = long_list;
  EXPECT_EQ(router->Route(route)->worker_id, "b");
  std::vector<std::string> too_many(kMaxExcludedWorkers + 1, "x");
  route.exclude_workers = too_many;
  EXPECT_EQ(router->Route(route).status().code(), absl::StatusCode::kInvalidArgument);
}

// When the healthy workers are excluded, the route fails open over the unhealthy rest.
TEST(RouterTest, ExclusionFailsOpenOverUnhealthyWorkers) {
  auto router = MakeRouter({Worker("a"), Worker("b")});
  ASSERT_TRUE(router->SetWorkerHealthy("b", false).ok());
  const std::vector<std::string> not_a = {"a"};
  RouteInput route{nullptr, kT0};
  route.exclude_workers = not_a;
  absl::StatusOr<RouteResult> routed = router->Route(route);
  ASSERT_TRUE(routed.ok()) << routed.status();
  EXPECT_EQ(routed->worker_id, "b");
  EXPECT_EQ(routed->fallback, FallbackReason::kAllUnhealthy);
}

// A route may ask for another policy (the baseline arm of an A/B split); the leases are shared.
TEST(RouterTest, ARouteMayAskForAnotherPolicy) {
  auto router = MakeRouter({Worker("a"), Worker("b"), Worker("c")});
  ASSERT_TRUE(router->InstallCentroids(Artifact(3)).ok());
  const std::vector<int32_t> counts = Counts(0);
  const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
  RouteInput baseline{&input, kT0};
  baseline.policy = PolicyKind::kRoundRobin;
  std::map<std::string, int> picks;
  for (int i = 0; i < 30; ++i) {
    absl::StatusOr<RouteResult> routed = router->Route(baseline);
    ASSERT_TRUE(routed.ok());
    EXPECT_EQ(routed->policy, PolicyKind::kRoundRobin);
    EXPECT_EQ(routed->band_size, 0);
    ++picks[routed->worker_id];
  }
  EXPECT_EQ(picks, (std::map<std::string, int>{{"a", 10}, {"b", 10}, {"c", 10}}));
  EXPECT_EQ(router->GetState(kT0).live_leases, 30);
  // The configured policy still decides the others: locality to a.
  absl::StatusOr<RouteResult> eldr = router->Route(RouteInput{&input, kT0});
  ASSERT_TRUE(eldr.ok());
  EXPECT_EQ(eldr->policy, PolicyKind::kEldr);
  EXPECT_EQ(eldr->worker_id, "a");
}

TEST(RouterConcurrencyTest, RouteCompleteSwapAndChurn) {
  RouterOptions options;
  struct Counter : RouterObserver {
    std::atomic<int64_t> callbacks{0};
    void OnSignatureRouted(const RoutedSignature&) override { callbacks++; }
  } counter;
  std::atomic<int64_t>& callbacks = counter.callbacks;
  auto router = MakeRouter({Worker("a"), Worker("b"), Worker("c"), Worker("d")}, options);
  router->AddObserver(&counter);
  ASSERT_TRUE(router->InstallCentroids(Artifact(4)).ok());

  std::atomic<bool> stop{false};
  std::atomic<int64_t> routes{0}, attempts{0}, errors{0}, lost_to_removal{0};
  std::atomic<int64_t> swaps{0}, churns{0};
  // Routers keep going until the swapper and the churner have run a while alongside them.
  constexpr int kMinRoutesPerThread = 2000;
  constexpr int kMinBackgroundRounds = 30;
  auto keep_routing = [&](int i) {
    if (i < kMinRoutesPerThread) return true;
    return (swaps.load() < kMinBackgroundRounds || churns.load() < kMinBackgroundRounds) &&
           i < 100 * kMinRoutesPerThread;
  };
  std::mutex error_mu;
  std::string first_error;
  auto record_error = [&](const absl::Status& status) {
    errors++;
    std::lock_guard<std::mutex> lock(error_mu);
    if (first_error.empty()) first_error = status.ToString();
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::vector<uint64_t> held;
      std::vector<std::string> held_by;
      for (int i = 0; keep_routing(i); ++i) {
        attempts++;
        // Requests do not arrive back to back on every thread; without pauses, 8 spinning threads
        // on a small machine starve the lock's other users and the test measures the scheduler.
        if (i % 16 == 0) std::this_thread::yield();
        const std::vector<int32_t> counts = Counts((t + i) % kExperts, 5 + i % 7, i % 3);
        const SignatureInput input = CountsInt32{kLayers, kExperts, counts};
        absl::StatusOr<RouteResult> result = router->Route(i % 10 == 0 ? nullptr : &input, absl::Now());
        if (!result.ok()) {
          record_error(result.status());
          continue;
        }
        routes++;
        held.push_back(result->lease_id);
        held_by.push_back(result->worker_id);
        // Keep a few requests in flight so loads are non-trivial.
        if (held.size() > 3) {
          const absl::Status done = router->Complete(held.front()).status();
          if (!done.ok()) {
            // Only a removed worker's leases may vanish.
            if (done.code() == absl::StatusCode::kNotFound && held_by.front() == "extra") {
              lost_to_removal++;
            } else {
              record_error(done);
            }
          }
          held.erase(held.begin());
          held_by.erase(held_by.begin());
        }
      }
      for (size_t j = 0; j < held.size(); ++j) {
        const absl::Status done = router->Complete(held[j]).status();
        if (!done.ok() && !(done.code() == absl::StatusCode::kNotFound && held_by[j] == "extra")) {
          record_error(done);
        }
      }
    });
  }
  threads.emplace_back([&] {  // centroid swaps: named and unnamed artifacts, rows permuted
    int i = 0;
    while (!stop.load()) {
      const absl::Status status = i % 2 == 0 ? router->InstallCentroids(Artifact(4, {"d", "c", "b", "a"})).status()
                                             : router->InstallCentroids(Artifact(4, {"a", "b", "c", "d"})).status();
      if (!status.ok()) record_error(status);
      ++i;
      swaps++;
      std::this_thread::yield();
    }
  });
  threads.emplace_back([&] {  // worker churn, load reports, health flaps, expiry
    int i = 0;
    while (!stop.load()) {
      absl::Status status = router->UpsertWorker(Worker("extra", 1 + i % 3)).status();
      if (status.ok() && i % 3 == 0) status = router->DrainWorker("extra").status();
      if (status.ok()) {
        status = router->ReportLoad("b", {.running = static_cast<double>(i % 5), .taken_at = absl::Now()}, absl::Now());
      }
      if (status.ok()) status = router->SetWorkerHealthy("c", i % 4 != 0);
      if (status.ok() && i % 2 == 1) status = router->RemoveWorker("extra").status();
      if (!status.ok()) record_error(status);
      (void)router->ExpireLeases(absl::Now());
      (void)router->GetState(absl::Now());
      ++i;
      churns++;
      std::this_thread::yield();
    }
  });
  for (int t = 0; t < 8; ++t) threads[t].join();
  stop.store(true);
  threads[8].join();
  threads[9].join();

  EXPECT_EQ(errors.load(), 0) << first_error;
  EXPECT_EQ(routes.load(), attempts.load());
  EXPECT_GE(routes.load(), 8 * kMinRoutesPerThread);
  EXPECT_GE(swaps.load(), kMinBackgroundRounds);
  EXPECT_GE(churns.load(), kMinBackgroundRounds);
  const RouterState state = router->GetState(absl::Now());
  EXPECT_EQ(state.live_leases, 0);
  for (const WorkerStatus& worker : state.workers) EXPECT_EQ(worker.load.leases, 0) << worker.spec.id;
  EXPECT_GT(state.centroid_generation, 1u);
  EXPECT_GT(callbacks.load(), 0);
  std::cout << "routes " << routes.load() << ", centroid swaps " << swaps.load() << ", worker churn rounds "
            << churns.load() << ", leases lost to removal " << lost_to_removal.load() << "\n";
}

}  // namespace
}  // namespace eldr
