#include "eldr/core/load_tracker.h"

#include <atomic>
#include <limits>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace eldr {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1700000000);

LoadSnapshot Snapshot(double running, double waiting, absl::Time at) {
  LoadSnapshot s;
  s.running = running;
  s.waiting = waiting;
  s.kv_usage = 0.5;
  s.taken_at = at;
  return s;
}

LoadTrackerOptions Options(absl::Duration ttl, absl::Duration staleness) {
  LoadTrackerOptions options;
  options.lease_ttl = ttl;
  options.snapshot_staleness = staleness;
  return options;
}

TEST(LoadTrackerTest, LeasesCountAndReleaseOnce) {
  LoadTracker tracker;
  tracker.AddWorker("a");
  tracker.AddWorker("a");  // idempotent
  tracker.AddWorker("b");
  const uint64_t l1 = *tracker.Acquire("a", kT0);
  const uint64_t l2 = *tracker.Acquire("a", kT0);
  const uint64_t l3 = *tracker.Acquire("b", kT0);
  EXPECT_NE(l1, l2);
  EXPECT_NE(l2, l3);
  EXPECT_EQ(tracker.live_leases(), 3);
  EXPECT_EQ(tracker.EffectiveLoads({"a", "b", "unknown"}, kT0), (std::vector<double>{2, 1, 0}));

  absl::StatusOr<std::string> released = tracker.Release(l1);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, "a");
  const absl::StatusOr<std::string> again = tracker.Release(l1);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);  // never a double release
  EXPECT_EQ(tracker.Release(987654).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tracker.EffectiveLoads({"a"}, kT0)[0], 1);
  EXPECT_EQ(tracker.Acquire("nobody", kT0).status().code(), absl::StatusCode::kNotFound);
}

TEST(LoadTrackerTest, LeaseIdsAreNeverReused) {
  LoadTracker tracker;
  tracker.AddWorker("a");
  std::set<uint64_t> ids;
  for (int i = 0; i < 1000; ++i) {
    const uint64_t id = *tracker.Acquire("a", kT0);
    EXPECT_TRUE(ids.insert(id).second);
    ASSERT_TRUE(tracker.Release(id).ok());
  }
}

TEST(LoadTrackerTest, LeasesExpireAfterTtl) {
  LoadTracker tracker(Options(absl::Seconds(30), absl::Seconds(5)));
  tracker.AddWorker("a");
  const uint64_t old_lease = *tracker.Acquire("a", kT0);
  const uint64_t young_lease = *tracker.Acquire("a", kT0 + absl::Seconds(20));
  EXPECT_EQ(tracker.ExpireLeases(kT0 + absl::Seconds(30)), 0);  // exactly the TTL: still live
  EXPECT_EQ(tracker.ExpireLeases(kT0 + absl::Seconds(31)), 1);
  EXPECT_EQ(tracker.live_leases(), 1);
  EXPECT_EQ(tracker.expired_total(), 1);
  EXPECT_EQ(tracker.Release(old_lease).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(tracker.Release(young_lease).ok());
  EXPECT_EQ(tracker.EffectiveLoads({"a"}, kT0 + absl::Seconds(31))[0], 0);
}

TEST(LoadTrackerTest, EffectiveLoadIsSnapshotPlusLeasesAfterIt) {
  LoadTracker tracker(Options(absl::Minutes(10), absl::Seconds(5)));
  tracker.AddWorker("a");
  const uint64_t before = *tracker.Acquire("a", kT0);                     // counted in the report
  ASSERT_TRUE(tracker.Report("a", Snapshot(3, 2, kT0 + absl::Seconds(1))).ok());
  const uint64_t after1 = *tracker.Acquire("a", kT0 + absl::Seconds(2));  // not yet in a report
  (void)*tracker.Acquire("a", kT0 + absl::Seconds(3));
  const absl::Time now = kT0 + absl::Seconds(4);
  absl::StatusOr<WorkerLoad> load = tracker.Get("a", now);
  ASSERT_TRUE(load.ok());
  EXPECT_EQ(load->leases, 3);
  EXPECT_EQ(load->leases_since_snapshot, 2);
  EXPECT_TRUE(load->snapshot_fresh);
  EXPECT_DOUBLE_EQ(load->effective, 3 + 2 + 2);
  // Releasing a lease from before the snapshot does not change the effective load (the report
  // still counts it); releasing one after it does.
  ASSERT_TRUE(tracker.Release(before).ok());
  EXPECT_DOUBLE_EQ(tracker.EffectiveLoads({"a"}, now)[0], 7);
  ASSERT_TRUE(tracker.Release(after1).ok());
  EXPECT_DOUBLE_EQ(tracker.EffectiveLoads({"a"}, now)[0], 6);
  // A newer snapshot absorbs the leases before it.
  ASSERT_TRUE(tracker.Report("a", Snapshot(1, 0, kT0 + absl::Seconds(5))).ok());
  EXPECT_DOUBLE_EQ(tracker.EffectiveLoads({"a"}, kT0 + absl::Seconds(6))[0], 1);
}

TEST(LoadTrackerTest, StaleSnapshotFallsBackToLeases) {
  LoadTracker tracker(Options(absl::Minutes(10), absl::Seconds(5)));
  tracker.AddWorker("a");
  ASSERT_TRUE(tracker.Report("a", Snapshot(40, 10, kT0)).ok());
  (void)*tracker.Acquire("a", kT0 + absl::Seconds(1));
  (void)*tracker.Acquire("a", kT0 + absl::Seconds(2));
  EXPECT_DOUBLE_EQ(tracker.EffectiveLoads({"a"}, kT0 + absl::Seconds(5))[0], 52);
  // Five seconds old is the limit; older is stale: the router's own count, never "idle".
  const absl::Time late = kT0 + absl::Seconds(6);
  EXPECT_DOUBLE_EQ(tracker.EffectiveLoads({"a"}, late)[0], 2);
  const WorkerLoad load = *tracker.Get("a", late);
  EXPECT_FALSE(load.snapshot_fresh);
  ASSERT_TRUE(load.snapshot.has_value());
  EXPECT_DOUBLE_EQ(load.snapshot->running, 40);
  EXPECT_EQ(load.leases_since_snapshot, 0);
}

TEST(LoadTrackerTest, OlderSnapshotsAreIgnored) {
  LoadTracker tracker;
  tracker.AddWorker("a");
  ASSERT_TRUE(tracker.Report("a", Snapshot(5, 0, kT0 + absl::Seconds(2))).ok());
  ASSERT_TRUE(tracker.Report("a", Snapshot(50, 0, kT0 + absl::Seconds(1))).ok());  // reordered
  EXPECT_DOUBLE_EQ(tracker.EffectiveLoads({"a"}, kT0 + absl::Seconds(3))[0], 5);
}

TEST(LoadTrackerTest, ReportValidation) {
  LoadTracker tracker;
  tracker.AddWorker("a");
  EXPECT_EQ(tracker.Report("b", Snapshot(1, 1, kT0)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tracker.Report("a", Snapshot(-1, 0, kT0)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tracker.Report("a", Snapshot(std::numeric_limits<double>::quiet_NaN(), 0, kT0)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tracker.Report("a", Snapshot(0, std::numeric_limits<double>::infinity(), kT0)).code(),
            absl::StatusCode::kInvalidArgument);
  LoadSnapshot bad_kv = Snapshot(0, 0, kT0);
  bad_kv.kv_usage = -0.1;
  EXPECT_EQ(tracker.Report("a", bad_kv).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tracker.Report("a", Snapshot(0, 0, absl::InfinitePast())).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(tracker.Get("a", kT0)->snapshot.has_value());
}

TEST(LoadTrackerTest, RemoveWorkerDropsItsLeases) {
  LoadTracker tracker;
  tracker.AddWorker("a");
  tracker.AddWorker("b");
  const uint64_t a1 = *tracker.Acquire("a", kT0);
  (void)*tracker.Acquire("a", kT0);
  const uint64_t b1 = *tracker.Acquire("b", kT0);
  EXPECT_EQ(tracker.RemoveWorker("a"), 2);
  EXPECT_EQ(tracker.RemoveWorker("a"), 0);
  EXPECT_EQ(tracker.live_leases(), 1);
  EXPECT_EQ(tracker.Release(a1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(tracker.Release(b1).ok());
  EXPECT_EQ(tracker.Get("a", kT0).status().code(), absl::StatusCode::kNotFound);
}

TEST(LoadTrackerTest, OutOfOrderAcquisitionTimesAreCountedCorrectly) {
  LoadTracker tracker;
  tracker.AddWorker("a");
  ASSERT_TRUE(tracker.Report("a", Snapshot(0, 0, kT0 + absl::Milliseconds(10))).ok());
  // Threads read their clocks before taking the lock, so times can arrive out of order.
  const uint64_t late = *tracker.Acquire("a", kT0 + absl::Milliseconds(30));
  const uint64_t early = *tracker.Acquire("a", kT0 + absl::Milliseconds(5));
  const uint64_t mid = *tracker.Acquire("a", kT0 + absl::Milliseconds(20));
  const absl::Time now = kT0 + absl::Milliseconds(40);
  EXPECT_EQ(tracker.Get("a", now)->leases_since_snapshot, 2);
  ASSERT_TRUE(tracker.Release(mid).ok());
  ASSERT_TRUE(tracker.Release(early).ok());
  EXPECT_EQ(tracker.Get("a", now)->leases_since_snapshot, 1);
  ASSERT_TRUE(tracker.Release(late).ok());
  EXPECT_EQ(tracker.Get("a", now)->leases_since_snapshot, 0);
  EXPECT_EQ(tracker.Get("a", now)->leases, 0);
}

TEST(LoadTrackerTest, ConcurrentAcquireReleaseLeavesNothing) {
  LoadTracker tracker;
  for (const char* w : {"a", "b", "c"}) tracker.AddWorker(w);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const std::string worker = t % 2 == 0 ? "a" : (t == 1 ? "b" : "c");
      for (int i = 0; i < 2000; ++i) {
        absl::StatusOr<uint64_t> id = tracker.Acquire(worker, absl::Now());
        if (!id.ok() || !tracker.Release(*id).ok()) errors.fetch_add(1);
        if (i % 100 == 0) {
          (void)tracker.Report(worker, Snapshot(1, 0, absl::Now()));
          (void)tracker.EffectiveLoads({"a", "b", "c"}, absl::Now());
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(tracker.live_leases(), 0);
  for (const char* w : {"a", "b", "c"}) EXPECT_EQ(tracker.Get(w, absl::Now())->leases, 0);
}

}  // namespace
}  // namespace eldr
