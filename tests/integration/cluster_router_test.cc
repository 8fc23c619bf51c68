// Real eldr-router processes sharing one real redis-server (--cluster_redis), a fresh one per test:
//  - three replicas: exactly one leads, a centroid set reloaded on the leader reaches the other two
//    (same routing decision for the same signature everywhere), and when the leader is killed
//    another one takes over within two lease periods;
//  - the followers' routed signatures reach the leader's refit window (shared stream);
//  - refit is leader-only: followers skip their periodic refits and install the leader's sets;
//  - shared load: one replica's leases count in another's effective load until it dies.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cluster/delay_proxy.h"
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

// Each test has a fresh redis-server of its own (`redis_`) and starts its replicas with
// StartReplicas.
class ClusterRouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto redis = cluster::testing::RedisServer::Start();
    ASSERT_TRUE(redis.ok()) << redis.status();
    redis_ = *std::move(redis);
  }

  // The flags of replica r<i> of cluster `name`, in `dir`, on `redis_address` (default: redis_).
  std::vector<std::string> ReplicaArgs(const TempDir& dir, int i, const std::string& name,
                                       const std::vector<std::string>& extra_args = {},
                                       const std::string& redis_address = "") {
    std::vector<std::string> args = StandardArgs(dir);
    args.push_back("--cluster_redis=" + (redis_address.empty() ? redis_->address() : redis_address));
    args.push_back("--cluster_name=" + name);
    args.push_back(absl::StrCat("--replica_id=r", i));
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    return args;
  }

  // `count` replicas r0.. (ReplicaArgs), each in a folder of its own (dirs_); records a test
  // failure (and returns fewer) when one does not start.
  std::vector<std::unique_ptr<RouterProcess>>& StartReplicas(int count, const std::string& name,
                                                             const std::vector<std::string>& extra_args = {},
                                                             const std::string& redis_address = "") {
    for (int i = 0; i < count; ++i) {
      dirs_.push_back(std::make_unique<TempDir>());
      std::unique_ptr<RouterProcess> router =
          MustStart(*dirs_.back(), ReplicaArgs(*dirs_.back(), i, name, extra_args, redis_address));
      if (router == nullptr) {
        ADD_FAILURE() << "replica " << i << " did not start";
        break;
      }
      routers_.push_back(std::move(router));
    }
    return routers_;
  }

  std::unique_ptr<cluster::testing::RedisServer> redis_;
  std::vector<std::unique_ptr<TempDir>> dirs_;
  std::vector<std::unique_ptr<RouterProcess>> routers_;
};

// RouterAdmin.ReloadCentroids with the artifact `json` on `router`; its status.
grpc::Status ReloadJson(const RouterProcess& router, const std::string& json) {
  eldr::v1::ReloadCentroidsRequest reload;
  reload.set_artifact_json(json);
  eldr::v1::ReloadCentroidsResponse reloaded;
  auto ctx = Ctx(absl::Seconds(10));
  return router.AdminStub()->ReloadCentroids(ctx.get(), reload, &reloaded);
}

double MetricOr(const RouterProcess& router, const std::string& name,
                const std::map<std::string, std::string>& labels = {}, double otherwise = -1) {
  absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(router.metrics_port());
  return metrics.ok() ? metrics->Value(name, labels).value_or(otherwise) : otherwise;
}

// Every live replica serves the published generation (> 0), and all the same one.
bool OneGeneration(const std::vector<std::unique_ptr<RouterProcess>>& routers, double* generation = nullptr) {
  double seen = -1;
  for (const auto& router : routers) {
    if (router == nullptr) continue;
    const double installed = MetricOr(*router, "eldr_cluster_centroid_generation", {{"kind", "installed"}});
    const double published = MetricOr(*router, "eldr_cluster_centroid_generation", {{"kind", "published"}});
    if (installed <= 0 || installed != published) return false;
    if (seen >= 0 && installed != seen) return false;
    seen = installed;
  }
  if (generation != nullptr) *generation = seen;
  return seen > 0;
}

TEST_F(ClusterRouterTest, OneLeaderSharedCentroidsAndTakeover) {
  std::vector<std::unique_ptr<RouterProcess>>& routers = StartReplicas(3, "it");
  ASSERT_EQ(routers.size(), 3u);

  // Exactly one leader, and it stays one.
  ASSERT_TRUE(PollUntil([&] { return Leaders(routers).size() == 1; }, 2 * kLease + absl::Seconds(2)))
      << routers[0]->Log();
  absl::SleepFor(absl::Milliseconds(500));
  const std::vector<int> leaders = Leaders(routers);
  ASSERT_EQ(leaders.size(), 1u);
  const int leader = leaders[0];

  // Before: row i is block i, so block 1 goes to w1 everywhere.
  for (const auto& router : routers) EXPECT_EQ(RouteAndComplete(*router, 1), "w1");

  // Reload on the leader: w0 now owns block 1, w1 block 2, ... The others follow.
  const std::string shifted = ArtifactJson({1, 2, 3, 0}, {"w0", "w1", "w2", "w3"});
  {
    grpc::Status status = ReloadJson(*routers[leader], shifted);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_EQ(RouteAndComplete(*routers[leader], 1), "w0");
  for (int i = 0; i < 3; ++i) {
    if (i == leader) continue;
    // A follower notes the published generation before it installs the set, and the installed
    // one after the install returned (cluster_state.cc, CheckCentroids and Install): its routes
    // change in between. So wait (bounded) for all of it: the route, the install counted by
    // source and both generations equal.
    std::optional<ParsedMetrics> last;
    const bool installed = PollUntil(
        [&] {
          if (RouteAndComplete(*routers[i], 1) != "w0") return false;
          absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(routers[i]->metrics_port());
          if (!metrics.ok()) return false;
          last = *std::move(metrics);
          return last->Value("eldr_centroid_reloads_total", {{"source", "cluster"}, {"outcome", "ok"}}).value_or(0) >=
                     1 &&
                 last->Value("eldr_cluster_centroid_generation", {{"kind", "installed"}}) ==
                     last->Value("eldr_cluster_centroid_generation", {{"kind", "published"}}) &&
                 last->Value("eldr_cluster_peers").value_or(0) == 2;
        },
        absl::Seconds(3));
    EXPECT_TRUE(installed) << "replica " << i << " did not install the leader's set\n" << routers[i]->Log();
    ASSERT_TRUE(last.has_value()) << "replica " << i << " was never scraped after it routed to w0";
    // What the last scrape said, each on its own (so a failure says which one lagged).
    EXPECT_GE(last->Value("eldr_centroid_reloads_total", {{"source", "cluster"}, {"outcome", "ok"}}).value_or(0), 1);
    EXPECT_EQ(last->Value("eldr_cluster_centroid_generation", {{"kind", "installed"}}),
              last->Value("eldr_cluster_centroid_generation", {{"kind", "published"}}));
    EXPECT_EQ(last->Value("eldr_cluster_peers").value_or(0), 2);
  }

  // Kill the leader (no release): another one leads within two lease periods.
  const absl::Time killed = absl::Now();
  routers[leader]->Signal(SIGKILL);
  ASSERT_TRUE(routers[leader]->WaitForExit(absl::Seconds(5)).has_value());
  routers[leader].reset();
  ASSERT_TRUE(PollUntil([&] { return Leaders(routers).size() == 1; }, 2 * kLease))
      << "no new leader within two lease periods";
  const absl::Duration takeover = absl::Now() - killed;
  EXPECT_LT(takeover, 2 * kLease);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(Leaders(routers).size(), 1u);
  // The survivors still route alike.
  for (const auto& router : routers) {
    if (router != nullptr) EXPECT_EQ(RouteAndComplete(*router, 1), "w0");
  }
  std::cerr << "takeover after " << absl::FormatDuration(takeover) << "\n";
}

// With refit on, the leader's refit window fills with the signatures routed by the followers
// (the leader itself routes nothing), through the shared stream.
TEST_F(ClusterRouterTest, FollowersTrafficReachesTheLeadersRefitWindow) {
  // refit on (its window fills), no periodic refit in the test
  std::vector<std::unique_ptr<RouterProcess>>& routers =
      StartReplicas(3, "window", {"--refit_interval=1h", "--refit_window=10s"});
  ASSERT_EQ(routers.size(), 3u);
  ASSERT_TRUE(PollUntil([&] { return Leaders(routers).size() == 1; }, 2 * kLease + absl::Seconds(2)));
  const int leader = Leaders(routers)[0];
  for (int n = 0; n < 200; ++n) {
    const int i = (leader + 1 + n % 2) % 3;  // the two followers
    ASSERT_FALSE(RouteAndComplete(*routers[i], n % 4).empty());
  }
  double leader_window = 0;
  EXPECT_TRUE(PollUntil(
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
TEST_F(ClusterRouterTest, OnlyTheLeaderRefitsAndTheFollowersInstallItsSets) {
  // The routes below come in a burst of a second or so: sample every one of them for the shared
  // window (the default samples about 136 a second over the pool at this window).
  // The locality bound is off: this traffic comes from the calibration's own mix, so a refit
  // saves no experts per step and would be refused; the leader-only mechanics are tested here.
  std::vector<std::unique_ptr<RouterProcess>>& routers =
      StartReplicas(3, "refit",
                    {"--refit_interval=1s", "--refit_window=30s", "--refit_max_window_signatures=1000000",
                     "--refit_min_experts_gain=-1"});
  ASSERT_EQ(routers.size(), 3u);
  ASSERT_TRUE(PollUntil([&] { return Leaders(routers).size() == 1; }, 2 * kLease + absl::Seconds(2)));
  const int leader = Leaders(routers)[0];
  for (int n = 0; n < 400; ++n) {
    const int i = (leader + 1 + n % 2) % 3;
    ASSERT_FALSE(RouteAndComplete(*routers[i], n % 4).empty());
  }
  auto value = [&](int i, const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(routers[i]->metrics_port());
    return metrics.ok() ? metrics->Value(name, labels).value_or(-1) : -1;
  };
  EXPECT_TRUE(PollUntil([&] { return value(leader, "eldr_refits_completed_total") >= 1; }, absl::Seconds(8)))
      << routers[leader]->Log();
  for (int i = 0; i < 3; ++i) {
    if (i == leader) continue;
    // The leader's refit reaches every follower.
    EXPECT_TRUE(PollUntil(
        [&] {
          return value(i, "eldr_cluster_centroid_generation", {{"kind", "installed"}}) ==
                     value(leader, "eldr_cluster_centroid_generation", {{"kind", "installed"}}) &&
                 value(i, "eldr_centroid_reloads_total", {{"source", "cluster"}, {"outcome", "ok"}}) >= 1;
        },
        absl::Seconds(3)))
        << routers[i]->Log();
    EXPECT_EQ(value(i, "eldr_refits_completed_total"), 0) << "follower " << i << " refitted";
    // Its periodic refits run, and are skipped.
    EXPECT_TRUE(PollUntil([&] { return value(i, "eldr_refits_skipped_total") >= 1; }, absl::Seconds(3)));
    EXPECT_EQ(value(i, "eldr_refits_completed_total"), 0) << "follower " << i << " refitted";
    EXPECT_EQ(value(i, "eldr_centroid_reloads_total", {{"source", "refit"}, {"outcome", "ok"}}), 0)
        << "follower " << i << " installed a refit of its own";
  }
}

// Shared load: leases held on one replica count in another's effective load (no snapshot: the
// peers' live leases), and stop counting once the holder is killed (its load hash expires).
TEST_F(ClusterRouterTest, PeersLeasesCountInEffectiveLoadUntilTheyDie) {
  std::vector<std::unique_ptr<RouterProcess>>& routers = StartReplicas(2, "load");
  ASSERT_EQ(routers.size(), 2u);
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
  EXPECT_TRUE(PollUntil([&] { return effective(1, "w2") == 5; }, absl::Seconds(2)))
      << "replica 1 sees w2 at " << effective(1, "w2");
  {
    const eldr::v1::GetStateResponse state = State(*routers[1]);
    ASSERT_NE(FindWorker(state, "w2"), nullptr);
    EXPECT_EQ(FindWorker(state, "w2")->peer_leases(), 5);
    EXPECT_EQ(FindWorker(state, "w2")->inflight(), 0);
  }
  EXPECT_EQ(effective(1, "w1"), 0);
  EXPECT_EQ(State(*routers[1]).live_leases(), 0);  // its own leases: none
  routers[0]->Signal(SIGKILL);
  ASSERT_TRUE(routers[0]->WaitForExit(absl::Seconds(5)).has_value());
  routers[0].reset();
  // The load TTL (10 x 100 ms, at least 1 s) after its last publication, its leases are gone.
  EXPECT_TRUE(PollUntil([&] { return effective(1, "w2") == 0; }, absl::Seconds(3)))
      << "replica 1 still sees w2 at " << effective(1, "w2");
}

// Fencing: a leader frozen (SIGSTOP) past its lease is replaced; when it thaws (SIGCONT), with an
// admin reload racing its first moments, nothing it publishes reaches the others: they keep the
// new leader's set, and the thawed one steps down and installs that set too. (Two guards stop it:
// it steps down when its lease clock has run out before it publishes anything, which is what
// happens here; a publication sent in the instant before that check is refused by the fencing
// script, which tests/cluster/cluster_state_test.cc provokes with PauseForTesting.)
TEST_F(ClusterRouterTest, AFrozenLeaderThawedNeverPublishesOverTheNewOne) {
  std::vector<std::unique_ptr<RouterProcess>>& routers = StartReplicas(3, "fence");
  ASSERT_EQ(routers.size(), 3u);
  ASSERT_TRUE(
      PollUntil([&] { return Leaders(routers).size() == 1 && OneGeneration(routers); }, 2 * kLease + absl::Seconds(3)));
  const int old_leader = Leaders(routers)[0];
  const double old_fence = MetricOr(*routers[old_leader], "eldr_cluster_fencing_generation");

  routers[old_leader]->Signal(SIGSTOP);
  const absl::Time frozen = absl::Now();
  int new_leader = -1;
  ASSERT_TRUE(PollUntil(
      [&] {
        for (int i = 0; i < 3; ++i) {
          if (i != old_leader && IsLeader(*routers[i]).value_or(false)) new_leader = i;
        }
        return new_leader >= 0;
      },
      2 * kLease + absl::Seconds(1)))
      << "no replica took over from the frozen leader";
  std::cerr << "takeover from a frozen leader after " << absl::FormatDuration(absl::Now() - frozen) << "\n";
  EXPECT_GT(MetricOr(*routers[new_leader], "eldr_cluster_fencing_generation"), old_fence);

  // The new leader's set: block 1 -> w0. Every live replica installs it.
  const double taken_over_at =
      MetricOr(*routers[new_leader], "eldr_cluster_centroid_generation", {{"kind", "installed"}});
  const std::string shifted = ArtifactJson({1, 2, 3, 0}, {"w0", "w1", "w2", "w3"});
  {
    grpc::Status status = ReloadJson(*routers[new_leader], shifted);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  const int bystander = 3 - old_leader - new_leader;
  // The new leader notes its generation once Redis acknowledged the publication, which the
  // bystander may already have fetched and installed (cluster_state.cc, StoreCentroids): wait
  // (bounded) until both report the same one, newer than the one the new leader served before.
  double generation = -1;
  ASSERT_TRUE(PollUntil(
      [&] {
        if (RouteAndComplete(*routers[bystander], 1) != "w0") return false;
        generation = MetricOr(*routers[new_leader], "eldr_cluster_centroid_generation", {{"kind", "installed"}});
        return generation > taken_over_at &&
               MetricOr(*routers[bystander], "eldr_cluster_centroid_generation", {{"kind", "installed"}}) == generation;
      },
      absl::Seconds(3)))
      << "the new leader's generation " << generation << "\n"
      << routers[bystander]->Log();

  // Still frozen well past its lease. An admin reload (block 1 -> w3) is queued to it before it
  // thaws, so it reaches the old leader in its first moments awake, racing its own lease check.
  absl::SleepFor(std::max(absl::ZeroDuration(), kLease + absl::Seconds(1) - (absl::Now() - frozen)));
  std::thread stale_reload([&] {
    (void)ReloadJson(*routers[old_leader], ArtifactJson({3, 0, 1, 2}, {"w0", "w1", "w2", "w3"}));
  });
  absl::SleepFor(absl::Milliseconds(200));
  routers[old_leader]->Signal(SIGCONT);
  stale_reload.join();

  // The thawed one is a follower, and the others never serve its set.
  EXPECT_TRUE(
      PollUntil([&] { return IsLeader(*routers[old_leader]) == std::optional<bool>(false); }, absl::Seconds(2)));
  const absl::Time watch_until = absl::Now() + absl::Seconds(2);
  while (absl::Now() < watch_until) {
    ASSERT_EQ(RouteAndComplete(*routers[new_leader], 1), "w0");
    ASSERT_EQ(RouteAndComplete(*routers[bystander], 1), "w0");
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(IsLeader(*routers[new_leader]).value_or(false));
  std::cerr << "the thawed leader's publications fenced: "
            << MetricOr(*routers[old_leader], "eldr_cluster_publications_total", {{"outcome", "fenced"}})
            << ", stored: "
            << MetricOr(*routers[old_leader], "eldr_cluster_publications_total", {{"outcome", "stored"}}) << "\n";
  EXPECT_EQ(MetricOr(*routers[new_leader], "eldr_cluster_centroid_generation", {{"kind", "published"}}), generation)
      << "the published generation moved: the stale leader published";
  // Its stale reload stays local at most until the cluster's next generation; the new leader
  // publishes one, and the thawed replica installs it like every other.
  {
    grpc::Status status = ReloadJson(*routers[new_leader], shifted);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_TRUE(PollUntil([&] { return RouteAndComplete(*routers[old_leader], 1) == "w0" && OneGeneration(routers); },
                        absl::Seconds(3)))
      << routers[old_leader]->Log();
  EXPECT_GT(MetricOr(*routers[old_leader], "eldr_cluster_centroid_generation", {{"kind", "installed"}}), generation);
}

// Redis killed under traffic and restarted empty: not one route fails, every replica notices the
// outage (redis_up 0, errors counted), and afterwards the cluster has one leader again and every
// replica serves one generation, re-published above the ones they served.
TEST_F(ClusterRouterTest, RedisKilledUnderTrafficAndRestartedEmpty) {
  std::vector<std::unique_ptr<RouterProcess>>& routers = StartReplicas(3, "outage");
  ASSERT_EQ(routers.size(), 3u);
  double before = 0;
  ASSERT_TRUE(PollUntil([&] { return Leaders(routers).size() == 1 && OneGeneration(routers, &before); },
                        2 * kLease + absl::Seconds(3)));

  RouteTraffic traffic({routers[0].get(), routers[1].get(), routers[2].get()});
  absl::SleepFor(absl::Milliseconds(500));
  redis_->Kill();
  EXPECT_TRUE(PollUntil(
      [&] {
        for (const auto& router : routers) {
          if (MetricOr(*router, "eldr_cluster_redis_up") != 0) return false;
        }
        return true;
      },
      absl::Seconds(3)))
      << "a replica did not notice the outage";
  absl::SleepFor(kLease);  // long enough for the leader's lease to run out
  const int64_t routes_during_outage = traffic.routes();
  ASSERT_TRUE(redis_->Restart().ok());
  double after = 0;
  EXPECT_TRUE(PollUntil([&] { return Leaders(routers).size() == 1 && OneGeneration(routers, &after); },
                        2 * kLease + absl::Seconds(3)))
      << routers[0]->Log();
  EXPECT_GT(after, before) << "the set re-published after the restart must be a newer generation";
  EXPECT_TRUE(PollUntil(
      [&] {
        for (const auto& router : routers) {
          if (MetricOr(*router, "eldr_cluster_peers") != 2) return false;
        }
        return true;
      },
      absl::Seconds(3)));
  absl::SleepFor(absl::Milliseconds(300));
  traffic.Stop();
  EXPECT_EQ(traffic.failures(), 0) << "of " << traffic.routes() << " routes";
  EXPECT_GT(routes_during_outage, 100);
  for (const auto& router : routers) {
    EXPECT_GT(MetricOr(*router, "eldr_cluster_redis_errors_total", {{"kind", "unreachable"}}, 0), 0);
    EXPECT_EQ(MetricOr(*router, "eldr_cluster_redis_up"), 1);
    EXPECT_EQ(RouteAndComplete(*router, 1), "w1");  // the same set as before the outage, everywhere
  }
  std::cerr << traffic.routes() << " routes, " << traffic.failures() << " failed, generation " << before << " -> "
            << after << "\n";
}

// A slow Redis (every reply held 300 ms, then 1.5 s: past the command timeout) does not move
// Route latency: routes never wait for Redis.
TEST_F(ClusterRouterTest, SlowRedisDoesNotMoveRouteLatency) {
  auto proxy = cluster::testing::DelayProxy::Start(redis_->port(), absl::ZeroDuration());
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  std::vector<std::unique_ptr<RouterProcess>>& routers = StartReplicas(2, "slow", {}, (*proxy)->address());
  ASSERT_EQ(routers.size(), 2u);
  ASSERT_TRUE(
      PollUntil([&] { return Leaders(routers).size() == 1 && OneGeneration(routers); }, 2 * kLease + absl::Seconds(3)));
  RouteTraffic traffic({routers[0].get(), routers[1].get()});
  absl::SleepFor(absl::Seconds(2));
  const double fast_p99 = traffic.TakePercentileUs(0.99);
  (*proxy)->set_reply_delay(absl::Milliseconds(300));
  absl::SleepFor(absl::Seconds(2));
  const double slow_p99 = traffic.TakePercentileUs(0.99);
  (*proxy)->set_reply_delay(absl::Milliseconds(1500));
  absl::SleepFor(absl::Seconds(3));
  const double timeout_p99 = traffic.TakePercentileUs(0.99);
  traffic.Stop();
  std::cerr << "Route p99: Redis direct " << fast_p99 << " us, replies +300 ms " << slow_p99 << " us, +1.5 s "
            << timeout_p99 << " us (" << traffic.routes() << " routes)\n";
  EXPECT_EQ(traffic.failures(), 0);
  // A route that waited for one Redis reply would take 300 ms or more: the bound is far below it
  // and generous for a loaded 2-core machine.
  EXPECT_LT(slow_p99, fast_p99 + 50'000);
  EXPECT_LT(timeout_p99, fast_p99 + 50'000);
  for (const auto& router : routers) {
    EXPECT_GT(MetricOr(*router, "eldr_cluster_redis_errors_total", {{"kind", "timeout"}}, 0), 0)
        << "1.5 s replies should exceed the 1 s command timeout";
  }
}

// With --state_dir, a follower persists the sets it installs from the cluster: restarted while
// Redis is gone, it starts on the cluster's last set, not on its --centroids file.
TEST_F(ClusterRouterTest, AFollowerRestartsOnTheClustersSetFromItsStateDir) {
  // Each replica's state folder inside its own folder; no periodic refit during the test.
  auto args_of = [&](int i) {
    return ReplicaArgs(*dirs_[i], i, "state", {"--state_dir=" + dirs_[i]->path() + "/state", "--refit_interval=1h"});
  };
  std::vector<std::unique_ptr<RouterProcess>>& routers = routers_;
  for (int i = 0; i < 2; ++i) {
    dirs_.push_back(std::make_unique<TempDir>());
    routers.push_back(MustStart(*dirs_[i], args_of(i)));
    ASSERT_NE(routers[i], nullptr);
  }
  ASSERT_TRUE(
      PollUntil([&] { return Leaders(routers).size() == 1 && OneGeneration(routers); }, 2 * kLease + absl::Seconds(3)));
  const int leader = Leaders(routers)[0];
  const int follower = 1 - leader;
  const std::string shifted = ArtifactJson({1, 2, 3, 0}, {"w0", "w1", "w2", "w3"});
  {
    grpc::Status status = ReloadJson(*routers[leader], shifted);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  ASSERT_TRUE(PollUntil([&] { return RouteAndComplete(*routers[follower], 1) == "w0"; }, absl::Seconds(3)));

  // Redis goes away, and the follower restarts.
  redis_->Kill();
  routers[follower]->Signal(SIGTERM);
  ASSERT_TRUE(routers[follower]->WaitForExit(absl::Seconds(10)).has_value());
  routers[follower] = MustStart(*dirs_[follower], args_of(follower));
  ASSERT_NE(routers[follower], nullptr);
  EXPECT_EQ(RouteAndComplete(*routers[follower], 1), "w0") << routers[follower]->Log();
  EXPECT_EQ(MetricOr(*routers[follower], "eldr_centroid_reloads_total", {{"source", "state_dir"}, {"outcome", "ok"}}),
            1);
  EXPECT_EQ(MetricOr(*routers[follower], "eldr_cluster_redis_up"), 0);
}

}  // namespace
}  // namespace eldr::testing
