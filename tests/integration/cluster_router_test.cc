// Real eldr-router processes sharing one real redis-server (--cluster_redis), a fresh one per test:
//  - three replicas: exactly one leads, a centroid set reloaded on the leader reaches the other two
//    (same routing decision for the same signature everywhere), and when the leader is killed
//    another one takes over within two lease periods;
//  - the followers' routed signatures reach the leader's refit window (shared stream);
//  - refit is leader-only: followers skip their periodic refits and install the leader's sets;
//  - shared load: one replica's leases count in another's effective load until it dies.
#include <signal.h>

#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cluster/redis_server.h"
#include "gtest/gtest.h"
#include "router_harness.h"

namespace eldr::testing {
namespace {

constexpr absl::Duration kLease = absl::Seconds(3);  // ClusterOptions' default leader lease

// 1 / 0 for the leader role; nullopt when the metrics cannot be read.
std::optional<bool> IsLeader(const RouterProcess& router) {
  absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(router.metrics_port());
  if (!metrics.ok()) return std::nullopt;
  std::optional<double> leader = metrics->Value("eldr_cluster_role", {{"role", "leader"}});
  if (!leader.has_value()) return std::nullopt;
  return *leader == 1;
}

// The indices of `routers` (non-null ones) that report the leader role.
std::vector<int> Leaders(const std::vector<std::unique_ptr<RouterProcess>>& routers) {
  std::vector<int> leaders;
  for (int i = 0; i < static_cast<int>(routers.size()); ++i) {
    if (routers[i] == nullptr) continue;
    if (IsLeader(*routers[i]).value_or(false)) leaders.push_back(i);
  }
  return leaders;
}

// Routes BlockRequest(block) and completes the lease; "" on failure.
std::string RouteBlock(const RouterProcess& router, int block) {
  auto stub = router.RouterStub();
  eldr::v1::RouteResponse response;
  auto ctx = Ctx(absl::Seconds(5));
  if (!stub->Route(ctx.get(), BlockRequest(block), &response).ok()) return "";
  eldr::v1::CompleteRequest complete;
  complete.set_lease_id(response.lease_id());
  eldr::v1::CompleteResponse completed;
  auto complete_ctx = Ctx(absl::Seconds(5));
  (void)stub->Complete(complete_ctx.get(), complete, &completed);
  return response.worker_id();
}

template <typename F>
bool Eventually(F condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (condition()) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

TEST(ClusterRouterTest, OneLeaderSharedCentroidsAndTakeover) {
  auto redis = cluster::testing::RedisServer::Start();
  ASSERT_TRUE(redis.ok()) << redis.status();

  std::vector<std::unique_ptr<TempDir>> dirs;
  std::vector<std::unique_ptr<RouterProcess>> routers;
  for (int i = 0; i < 3; ++i) {
    dirs.push_back(std::make_unique<TempDir>());
    std::vector<std::string> args = StandardArgs(*dirs.back());
    args.push_back("--cluster_redis=" + (*redis)->address());
    args.push_back("--cluster_name=it");
    args.push_back(absl::StrCat("--replica_id=r", i));
    routers.push_back(MustStart(*dirs.back(), args));
    ASSERT_NE(routers.back(), nullptr);
  }

  // Exactly one leader, and it stays one.
  ASSERT_TRUE(Eventually([&] { return Leaders(routers).size() == 1; }, 2 * kLease + absl::Seconds(2)))
      << routers[0]->Log();
  absl::SleepFor(absl::Milliseconds(500));
  const std::vector<int> leaders = Leaders(routers);
  ASSERT_EQ(leaders.size(), 1u);
  const int leader = leaders[0];

  // Before: row i is block i, so block 1 goes to w1 everywhere.
  for (const auto& router : routers) EXPECT_EQ(RouteBlock(*router, 1), "w1");

  // Reload on the leader: w0 now owns block 1, w1 block 2, ... The others follow.
  eldr::v1::ReloadCentroidsRequest reload;
  reload.set_artifact_json(ArtifactJson({1, 2, 3, 0}, {"w0", "w1", "w2", "w3"}));
  eldr::v1::ReloadCentroidsResponse reloaded;
  {
    auto ctx = Ctx();
    grpc::Status status = routers[leader]->AdminStub()->ReloadCentroids(ctx.get(), reload, &reloaded);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_EQ(RouteBlock(*routers[leader], 1), "w0");
  for (int i = 0; i < 3; ++i) {
    if (i == leader) continue;
    EXPECT_TRUE(Eventually([&] { return RouteBlock(*routers[i], 1) == "w0"; }, absl::Seconds(3)))
        << "replica " << i << " did not install the leader's set\n"
        << routers[i]->Log();
    absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(routers[i]->metrics_port());
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_GE(metrics->Value("eldr_centroid_reloads_total", {{"source", "cluster"}, {"outcome", "ok"}}).value_or(0), 1);
    EXPECT_EQ(metrics->Value("eldr_cluster_centroid_generation", {{"kind", "installed"}}),
              metrics->Value("eldr_cluster_centroid_generation", {{"kind", "published"}}));
    EXPECT_EQ(metrics->Value("eldr_cluster_peers").value_or(0), 2);
  }

  // Kill the leader (no release): another one leads within two lease periods.
  const absl::Time killed = absl::Now();
  routers[leader]->Signal(SIGKILL);
  ASSERT_TRUE(routers[leader]->WaitForExit(absl::Seconds(5)).has_value());
  routers[leader].reset();
  ASSERT_TRUE(Eventually([&] { return Leaders(routers).size() == 1; }, 2 * kLease))
      << "no new leader within two lease periods";
  const absl::Duration takeover = absl::Now() - killed;
  EXPECT_LT(takeover, 2 * kLease);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(Leaders(routers).size(), 1u);
  // The survivors still route alike.
  for (const auto& router : routers) {
    if (router != nullptr) EXPECT_EQ(RouteBlock(*router, 1), "w0");
  }
  std::cerr << "takeover after " << absl::FormatDuration(takeover) << "\n";
}

// With refit on, the leader's refit window fills with the signatures routed by the followers
// (the leader itself routes nothing), through the shared stream.
TEST(ClusterRouterTest, FollowersTrafficReachesTheLeadersRefitWindow) {
  auto redis = cluster::testing::RedisServer::Start();
  ASSERT_TRUE(redis.ok()) << redis.status();
  std::vector<std::unique_ptr<TempDir>> dirs;
  std::vector<std::unique_ptr<RouterProcess>> routers;
  for (int i = 0; i < 3; ++i) {
    dirs.push_back(std::make_unique<TempDir>());
    std::vector<std::string> args = StandardArgs(*dirs.back());
    args.push_back("--cluster_redis=" + (*redis)->address());
    args.push_back("--cluster_name=window");
    args.push_back(absl::StrCat("--replica_id=r", i));
    args.push_back("--refit_interval=1h");  // refit on (its window fills), no periodic refit in the test
    args.push_back("--refit_window=10s");
    routers.push_back(MustStart(*dirs.back(), args));
    ASSERT_NE(routers.back(), nullptr);
  }
  ASSERT_TRUE(Eventually([&] { return Leaders(routers).size() == 1; }, 2 * kLease + absl::Seconds(2)));
  const int leader = Leaders(routers)[0];
  for (int n = 0; n < 200; ++n) {
    const int i = (leader + 1 + n % 2) % 3;  // the two followers
    ASSERT_FALSE(RouteBlock(*routers[i], n % 4).empty());
  }
  double leader_window = 0;
  EXPECT_TRUE(Eventually(
      [&] {
        absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(routers[leader]->metrics_port());
        if (!metrics.ok()) return false;
        leader_window = metrics->Value("eldr_refit_window_signatures").value_or(0);
        return leader_window > 0 && metrics->Value("eldr_cluster_window_length").value_or(0) > 0;
      },
      absl::Seconds(3)))
      << "leader's refit window: " << leader_window << "\n"
      << routers[leader]->Log();
  // A follower's refitter stays idle: its own window is not fed from the stream.
  absl::StatusOr<ParsedMetrics> follower = ScrapeMetrics(routers[(leader + 1) % 3]->metrics_port());
  ASSERT_TRUE(follower.ok());
  EXPECT_EQ(follower->Value("eldr_cluster_role", {{"role", "follower"}}), 1);
}

// Refit is leader-only: with periodic refit on every replica and traffic through the followers
// only, the leader refits on their signatures and publishes; the followers never complete a refit
// of their own and install the leader's sets (source cluster).
TEST(ClusterRouterTest, OnlyTheLeaderRefitsAndTheFollowersInstallItsSets) {
  auto redis = cluster::testing::RedisServer::Start();
  ASSERT_TRUE(redis.ok()) << redis.status();
  std::vector<std::unique_ptr<TempDir>> dirs;
  std::vector<std::unique_ptr<RouterProcess>> routers;
  for (int i = 0; i < 3; ++i) {
    dirs.push_back(std::make_unique<TempDir>());
    std::vector<std::string> args = StandardArgs(*dirs.back());
    args.push_back("--cluster_redis=" + (*redis)->address());
    args.push_back("--cluster_name=refit");
    args.push_back(absl::StrCat("--replica_id=r", i));
    args.push_back("--refit_interval=1s");
    args.push_back("--refit_window=30s");
    routers.push_back(MustStart(*dirs.back(), args));
    ASSERT_NE(routers.back(), nullptr);
  }
  ASSERT_TRUE(Eventually([&] { return Leaders(routers).size() == 1; }, 2 * kLease + absl::Seconds(2)));
  const int leader = Leaders(routers)[0];
  for (int n = 0; n < 400; ++n) {
    const int i = (leader + 1 + n % 2) % 3;
    ASSERT_FALSE(RouteBlock(*routers[i], n % 4).empty());
  }
  auto value = [&](int i, const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(routers[i]->metrics_port());
    return metrics.ok() ? metrics->Value(name, labels).value_or(-1) : -1;
  };
  EXPECT_TRUE(Eventually([&] { return value(leader, "eldr_refits_completed_total") >= 1; }, absl::Seconds(8)))
      << routers[leader]->Log();
  for (int i = 0; i < 3; ++i) {
    if (i == leader) continue;
    // The leader's refit reaches every follower.
    EXPECT_TRUE(Eventually(
        [&] {
          return value(i, "eldr_cluster_centroid_generation", {{"kind", "installed"}}) ==
                     value(leader, "eldr_cluster_centroid_generation", {{"kind", "installed"}}) &&
                 value(i, "eldr_centroid_reloads_total", {{"source", "cluster"}, {"outcome", "ok"}}) >= 1;
        },
        absl::Seconds(3)))
        << routers[i]->Log();
    EXPECT_EQ(value(i, "eldr_refits_completed_total"), 0) << "follower " << i << " refitted";
    // Its periodic refits run, and are skipped.
    EXPECT_TRUE(Eventually([&] { return value(i, "eldr_refits_skipped_total") >= 1; }, absl::Seconds(3)));
    EXPECT_EQ(value(i, "eldr_refits_completed_total"), 0) << "follower " << i << " refitted";
    EXPECT_EQ(value(i, "eldr_centroid_reloads_total", {{"source", "refit"}, {"outcome", "ok"}}), 0)
        << "follower " << i << " installed a refit of its own";
  }
}

// Shared load: leases held on one replica count in another's effective load (no snapshot: the
// peers' live leases), and stop counting once the holder is killed (its load hash expires).
TEST(ClusterRouterTest, PeersLeasesCountInEffectiveLoadUntilTheyDie) {
  auto redis = cluster::testing::RedisServer::Start();
  ASSERT_TRUE(redis.ok()) << redis.status();
  std::vector<std::unique_ptr<TempDir>> dirs;
  std::vector<std::unique_ptr<RouterProcess>> routers;
  for (int i = 0; i < 2; ++i) {
    dirs.push_back(std::make_unique<TempDir>());
    std::vector<std::string> args = StandardArgs(*dirs.back());
    args.push_back("--cluster_redis=" + (*redis)->address());
    args.push_back("--cluster_name=load");
    args.push_back(absl::StrCat("--replica_id=r", i));
    routers.push_back(MustStart(*dirs.back(), args));
    ASSERT_NE(routers.back(), nullptr);
  }
  // Five leases on w2, held by replica 0 (never completed).
  auto stub = routers[0]->RouterStub();
  for (int n = 0; n < 5; ++n) {
    eldr::v1::RouteResponse response;
    auto ctx = Ctx();
    ASSERT_TRUE(stub->Route(ctx.get(), BlockRequest(2), &response).ok());
    ASSERT_EQ(response.worker_id(), "w2");
  }
  auto effective = [&](int i, const std::string& worker) {
    const eldr::v1::GetStateResponse state = State(*routers[i]);
    const eldr::v1::WorkerState* w = FindWorker(state, worker);
    return w == nullptr ? -1.0 : w->effective_load();
  };
  EXPECT_TRUE(Eventually([&] { return effective(1, "w2") == 5; }, absl::Seconds(2)))
      << "replica 1 sees w2 at " << effective(1, "w2");
  EXPECT_EQ(effective(1, "w1"), 0);
  EXPECT_EQ(State(*routers[1]).live_leases(), 0);  // its own leases: none
  routers[0]->Signal(SIGKILL);
  ASSERT_TRUE(routers[0]->WaitForExit(absl::Seconds(5)).has_value());
  routers[0].reset();
  // The load TTL (10 x 100 ms, at least 1 s) after its last publication, its leases are gone.
  EXPECT_TRUE(Eventually([&] { return effective(1, "w2") == 0; }, absl::Seconds(3)))
      << "replica 1 still sees w2 at " << effective(1, "w2");
}

}  // namespace
}  // namespace eldr::testing
