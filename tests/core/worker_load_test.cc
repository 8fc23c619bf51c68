// Load accounting: WorkerLoadAccount directly, and the Router's leases (ids, expiry, the live-lease
// limit, reports) through its public API.
#include "eldr/core/worker_load.h"

#include <atomic>
#include <limits>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "eldr/core/errors.h"
#include "eldr/core/router.h"
#include "gtest/gtest.h"

namespace eldr {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1700000000);
constexpr absl::Duration kStaleness = absl::Seconds(5);

LoadSnapshot Snapshot(double running, double waiting, absl::Time at) {
  LoadSnapshot s;
  s.running = running;
  s.waiting = waiting;
  s.kv_usage = 0.5;
  s.taken_at = at;
  return s;
}

TEST(WorkerLoadAccountTest, EffectiveLoadIsSnapshotPlusLeasesAfterIt) {
  WorkerLoadAccount account;
  const auto before = account.OnAcquire(kT0, 1);  // counted in the report
  ASSERT_TRUE(account.OnReport(Snapshot(3, 2, kT0 + absl::Seconds(1))));
  const auto after1 = account.OnAcquire(kT0 + absl::Seconds(2), 2);  // not yet in a report
  (void)account.OnAcquire(kT0 + absl::Seconds(3), 3);
  const absl::Time now = kT0 + absl::Seconds(4);
  const WorkerLoad load = account.Describe(now, kStaleness);
  EXPECT_EQ(load.leases, 3);
  EXPECT_EQ(load.leases_since_snapshot, 2);
  EXPECT_TRUE(load.snapshot_fresh);
  EXPECT_DOUBLE_EQ(load.effective, 3 + 2 + 2);
  // Releasing a lease from before the snapshot does not change the effective load (the report
  // still counts it); releasing one after it does.
  account.OnRelease(before);
  EXPECT_DOUBLE_EQ(account.Effective(now, kStaleness), 7);
  account.OnRelease(after1);
  EXPECT_DOUBLE_EQ(account.Effective(now, kStaleness), 6);
  // A newer snapshot absorbs the leases before it.
  ASSERT_TRUE(account.OnReport(Snapshot(1, 0, kT0 + absl::Seconds(5))));
  EXPECT_DOUBLE_EQ(account.Effective(kT0 + absl::Seconds(6), kStaleness), 1);
}

TEST(WorkerLoadAccountTest, StaleSnapshotFallsBackToLeases) {
  WorkerLoadAccount account;
  ASSERT_TRUE(account.OnReport(Snapshot(40, 10, kT0)));
  (void)account.OnAcquire(kT0 + absl::Seconds(1), 1);
  (void)account.OnAcquire(kT0 + absl::Seconds(2), 2);
  EXPECT_DOUBLE_EQ(account.Effective(kT0 + absl::Seconds(5), kStaleness), 52);
  // Five seconds old is the limit; older is stale: the router's own count, never "idle".
  const absl::Time late = kT0 + absl::Seconds(6);
  EXPECT_DOUBLE_EQ(account.Effective(late, kStaleness), 2);
  const WorkerLoad load = account.Describe(late, kStaleness);
  EXPECT_FALSE(load.snapshot_fresh);
  ASSERT_TRUE(load.snapshot.has_value());
  EXPECT_DOUBLE_EQ(load.snapshot->running, 40);
  EXPECT_EQ(load.leases_since_snapshot, 0);
}

TEST(WorkerLoadAccountTest, OlderSnapshotsAreIgnored) {
  WorkerLoadAccount account;
  EXPECT_TRUE(account.OnReport(Snapshot(5, 0, kT0 + absl::Seconds(2))));
  EXPECT_FALSE(account.OnReport(Snapshot(50, 0, kT0 + absl::Seconds(1))));  // reordered
  EXPECT_FALSE(account.OnReport(Snapshot(50, 0, kT0 + absl::Seconds(2))));  // same time
  EXPECT_DOUBLE_EQ(account.Effective(kT0 + absl::Seconds(3), kStaleness), 5);
}

TEST(WorkerLoadAccountTest, OutOfOrderAcquisitionTimesAreCountedCorrectly) {
  WorkerLoadAccount account;
  ASSERT_TRUE(account.OnReport(Snapshot(0, 0, kT0 + absl::Milliseconds(10))));
  // Threads read their clocks before taking the lock, so times can arrive out of order.
  const auto late = account.OnAcquire(kT0 + absl::Milliseconds(30), 1);
  const auto early = account.OnAcquire(kT0 + absl::Milliseconds(5), 2);
  const auto mid = account.OnAcquire(kT0 + absl::Milliseconds(20), 3);
  const absl::Time now = kT0 + absl::Milliseconds(40);
  EXPECT_EQ(account.Describe(now, kStaleness).leases_since_snapshot, 2);
  EXPECT_EQ(account.Oldest()->second, 2u);
  account.OnRelease(mid);
  account.OnRelease(early);
  EXPECT_EQ(account.Describe(now, kStaleness).leases_since_snapshot, 1);
  account.OnRelease(late);
  EXPECT_EQ(account.Describe(now, kStaleness).leases_since_snapshot, 0);
  EXPECT_EQ(account.leases(), 0);
}

// The incremental cursor against a brute-force count, over a random interleaving of acquisitions,
// releases and reports (time mostly increasing, sometimes out of order).
TEST(WorkerLoadAccountTest, CountAfterSnapshotMatchesBruteForce) {
  WorkerLoadAccount account;
  std::vector<std::pair<WorkerLoadAccount::LeaseHandle, absl::Time>> live;
  absl::Time snapshot_time = absl::InfinitePast();
  uint64_t next_id = 1;
  uint64_t state = 12345;
  auto rand = [&state] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return state >> 33;
  };
  for (int step = 0; step < 20000; ++step) {
    const absl::Time now = kT0 + absl::Milliseconds(step);
    const uint64_t action = rand() % 10;
    if (action < 5) {
      const absl::Time at = now - absl::Milliseconds(static_cast<int64_t>(rand() % 20));
      live.emplace_back(account.OnAcquire(at, next_id++), at);
    } else if (action < 8 && !live.empty()) {
      const size_t i = rand() % live.size();
      account.OnRelease(live[i].first);
      live[i] = live.back();
      live.pop_back();
    } else {
      const absl::Time at = now - absl::Milliseconds(static_cast<int64_t>(rand() % 30));
      if (account.OnReport(Snapshot(1, 0, at))) snapshot_time = at;
    }
    int64_t expected = 0;
    for (const auto& lease : live) expected += lease.second > snapshot_time ? 1 : 0;
    const WorkerLoad load = account.Describe(snapshot_time + absl::Milliseconds(1), absl::Hours(1));
    if (load.snapshot_fresh) ASSERT_EQ(load.leases_since_snapshot, expected) << "step " << step;
    ASSERT_EQ(load.leases, static_cast<int64_t>(live.size()));
  }
}

TEST(LoadSnapshotTest, ValidationNamesFieldAndReason) {
  EXPECT_TRUE(ValidateLoadSnapshot(Snapshot(1, 1, kT0)).ok());
  const absl::Status negative = ValidateLoadSnapshot(Snapshot(-1, 0, kT0));
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RejectReasonOf(negative), RejectReason::kNegativeCount);
  EXPECT_NE(negative.message().find("running"), absl::string_view::npos);
  EXPECT_EQ(RejectReasonOf(ValidateLoadSnapshot(Snapshot(std::numeric_limits<double>::quiet_NaN(), 0, kT0))),
            RejectReason::kNonFinite);
  EXPECT_EQ(RejectReasonOf(ValidateLoadSnapshot(Snapshot(0, std::numeric_limits<double>::infinity(), kT0))),
            RejectReason::kNonFinite);
  // Values that would overflow sums of loads are refused, not clamped.
  const absl::Status huge = ValidateLoadSnapshot(Snapshot(1.7e308, 1.7e308, kT0));
  EXPECT_EQ(RejectReasonOf(huge), RejectReason::kOutOfRange);
  EXPECT_TRUE(ValidateLoadSnapshot(Snapshot(kMaxReportedRequests, kMaxReportedRequests, kT0)).ok());
  LoadSnapshot bad_kv = Snapshot(0, 0, kT0);
  bad_kv.kv_usage = -0.1;
  EXPECT_EQ(RejectReasonOf(ValidateLoadSnapshot(bad_kv)), RejectReason::kNegativeCount);
  bad_kv.kv_usage = 1.5;
  EXPECT_EQ(RejectReasonOf(ValidateLoadSnapshot(bad_kv)), RejectReason::kOutOfRange);
  EXPECT_EQ(ValidateLoadSnapshot(Snapshot(0, 0, absl::InfinitePast())).code(), absl::StatusCode::kInvalidArgument);
}

// ---- The Router's leases ----------------------------------------------------------------------

WorkerSpec Worker(const std::string& id) {
  WorkerSpec spec;
  spec.id = id;
  spec.address = absl::StrCat(id, ".decode:8000");
  return spec;
}

std::unique_ptr<Router> JsqRouter(std::vector<std::string> ids, absl::Duration ttl = absl::Minutes(10),
                                  int64_t max_live_leases = 1'000'000) {
  RouterOptions options;
  options.policy = PolicyKind::kJsq;
  options.load.lease_ttl = ttl;
  options.load.snapshot_staleness = kStaleness;
  options.max_live_leases = max_live_leases;
  std::vector<WorkerSpec> workers;
  for (const std::string& id : ids) workers.push_back(Worker(id));
  auto router = Router::Create(options, workers);
  EXPECT_TRUE(router.ok()) << router.status();
  return *std::move(router);
}

const WorkerStatus& Status(const RouterState& state, const std::string& id) {
  for (const WorkerStatus& w : state.workers) {
    if (w.spec.id == id) return w;
  }
  static const WorkerStatus none;
  ADD_FAILURE() << "no worker " << id;
  return none;
}

TEST(RouterLeaseTest, LeasesCountAndReleaseOnce) {
  auto router = JsqRouter({"a"});
  const uint64_t l1 = router->Route(nullptr, kT0)->lease_id;
  const uint64_t l2 = router->Route(nullptr, kT0)->lease_id;
  EXPECT_NE(l1, l2);
  EXPECT_EQ(router->GetState(kT0).live_leases, 2);
  absl::StatusOr<std::string> released = router->Complete(l1);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, "a");
  EXPECT_EQ(router->Complete(l1).status().code(), absl::StatusCode::kNotFound);  // never a double release
  EXPECT_EQ(router->Complete(987654).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Status(router->GetState(kT0), "a").load.leases, 1);
}

TEST(RouterLeaseTest, LeaseIdsAreRandomNonZeroAndNeverCollide) {
  auto router = JsqRouter({"a", "b"});
  std::set<uint64_t> ids;
  int high_bit = 0;
  for (int i = 0; i < 4000; ++i) {
    const uint64_t id = router->Route(nullptr, kT0)->lease_id;
    EXPECT_NE(id, 0u);
    EXPECT_TRUE(ids.insert(id).second);
    high_bit += (id >> 63) & 1;
    if (i % 2 == 0) ASSERT_TRUE(router->Complete(id).ok());
  }
  // Sequential ids (1, 2, 3 ...) would never set the top bit; random ones set it about half the time.
  EXPECT_GT(high_bit, 1700);
  EXPECT_LT(high_bit, 2300);
  // A second router (a restart, another replica) draws other ids.
  auto other = JsqRouter({"a"});
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(ids.count(other->Route(nullptr, kT0)->lease_id));
}

TEST(RouterLeaseTest, LeasesExpireAfterTtl) {
  auto router = JsqRouter({"a"}, absl::Seconds(30));
  const uint64_t old_lease = router->Route(nullptr, kT0)->lease_id;
  const uint64_t young_lease = router->Route(nullptr, kT0 + absl::Seconds(20))->lease_id;
  EXPECT_EQ(router->ExpireLeases(kT0 + absl::Seconds(30)), 0);  // exactly the TTL: still live
  EXPECT_EQ(router->ExpireLeases(kT0 + absl::Seconds(31)), 1);
  const RouterState state = router->GetState(kT0 + absl::Seconds(31));
  EXPECT_EQ(state.live_leases, 1);
  EXPECT_EQ(state.leases_expired_total, 1);
  EXPECT_EQ(router->Complete(old_lease).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(router->Complete(young_lease).ok());
}

TEST(RouterLeaseTest, ExpiryOfManyLeasesReleasesAllOfThemInOrder) {
  auto router = JsqRouter({"a", "b", "c"}, absl::Seconds(10));
  std::vector<uint64_t> young;
  for (int i = 0; i < 5000; ++i) (void)router->Route(nullptr, kT0 + absl::Microseconds(i));
  for (int i = 0; i < 300; ++i) young.push_back(router->Route(nullptr, kT0 + absl::Seconds(5))->lease_id);
  EXPECT_EQ(router->ExpireLeases(kT0 + absl::Seconds(12)), 5000);
  EXPECT_EQ(router->GetState(kT0).live_leases, 300);
  for (uint64_t id : young) EXPECT_TRUE(router->Complete(id).ok());
  for (const WorkerStatus& w : router->GetState(kT0).workers) EXPECT_EQ(w.load.leases, 0);
}

TEST(RouterLeaseTest, LiveLeaseLimitEvictsTheOldestAndCountsIt) {
  auto router = JsqRouter({"a", "b"}, absl::Minutes(10), /*max_live_leases=*/100);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 150; ++i) ids.push_back(router->Route(nullptr, kT0 + absl::Milliseconds(i))->lease_id);
  const RouterState state = router->GetState(kT0);
  EXPECT_EQ(state.live_leases, 100);
  EXPECT_EQ(state.leases_evicted_total, 50);
  // The first 50 went; the newest 100 are live.
  for (int i = 0; i < 50; ++i) EXPECT_EQ(router->Complete(ids[i]).status().code(), absl::StatusCode::kNotFound);
  for (int i = 50; i < 150; ++i) EXPECT_TRUE(router->Complete(ids[i]).ok()) << i;
}

TEST(RouterLeaseTest, ReportsAreValidatedAndFutureTimesClamped) {
  auto router = JsqRouter({"a"});
  EXPECT_EQ(router->ReportLoad("b", Snapshot(1, 1, kT0), kT0).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(RejectReasonOf(router->ReportLoad("b", Snapshot(1, 1, kT0), kT0)), RejectReason::kUnknownWorker);
  EXPECT_EQ(router->ReportLoad("a", Snapshot(-1, 0, kT0), kT0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(Status(router->GetState(kT0), "a").load.snapshot.has_value());
  // A snapshot from an hour in the future (clock skew) counts as taken now: a lease acquired a
  // second later is on top of it, and the snapshot goes stale on time.
  ASSERT_TRUE(router->ReportLoad("a", Snapshot(4, 0, kT0 + absl::Hours(1)), kT0).ok());
  (void)router->Route(nullptr, kT0 + absl::Seconds(1));
  EXPECT_DOUBLE_EQ(Status(router->GetState(kT0 + absl::Seconds(2)), "a").load.effective, 5);
  EXPECT_DOUBLE_EQ(Status(router->GetState(kT0 + absl::Seconds(6)), "a").load.effective, 1);
}

TEST(RouterLeaseTest, RemoveWorkerDropsItsLeasesAndSaysHowMany) {
  auto router = JsqRouter({"a", "b"});
  std::vector<uint64_t> on_a, on_b;
  for (int i = 0; i < 6; ++i) {
    const RouteResult r = *router->Route(nullptr, kT0);
    (r.worker_id == "a" ? on_a : on_b).push_back(r.lease_id);
  }
  absl::StatusOr<PoolChange> removed = router->RemoveWorker("a");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(removed->kind, PoolChangeKind::kRemoved);
  EXPECT_EQ(removed->inflight, static_cast<int64_t>(on_a.size()));
  EXPECT_EQ(router->RemoveWorker("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(router->GetState(kT0).live_leases, static_cast<int64_t>(on_b.size()));
  // A's requests complete late: answered with a once (nothing is released twice), then NOT_FOUND.
  for (uint64_t id : on_a) EXPECT_EQ(router->Complete(id).value_or(""), "a");
  for (uint64_t id : on_a) EXPECT_EQ(router->Complete(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(router->GetState(kT0).live_leases, static_cast<int64_t>(on_b.size()));
  EXPECT_EQ(router->GetState(kT0).completes_after_removal_total, static_cast<int64_t>(on_a.size()));
  for (uint64_t id : on_b) EXPECT_TRUE(router->Complete(id).ok());
}

TEST(RouterLeaseTest, ConcurrentRouteCompleteLeavesNothing) {
  auto router = JsqRouter({"a", "b", "c"});
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        absl::StatusOr<RouteResult> r = router->Route(nullptr, absl::Now());
        if (!r.ok() || !router->Complete(r->lease_id).ok()) errors.fetch_add(1);
        if (i % 100 == 0) {
          (void)router->ReportLoad(t % 2 == 0 ? "a" : "b", Snapshot(1, 0, absl::Now()), absl::Now());
          (void)router->ExpireLeases(absl::Now());
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(errors.load(), 0);
  const RouterState state = router->GetState(absl::Now());
  EXPECT_EQ(state.live_leases, 0);
  for (const WorkerStatus& w : state.workers) EXPECT_EQ(w.load.leases, 0);
}

}  // namespace
}  // namespace eldr
