// ClusterState: several replicas on one real redis-server. One leader, one generation, fencing of a
// stale leader, leader change when the leader dies, fail-static over a Redis restart that loses
// everything, shared load and its expiry, the shared window, and callers never blocked by Redis.
// The measured figures are printed as "[figure] ..." lines.
#include "eldr/cluster/cluster_state.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "cluster/redis_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::cluster {
namespace {

using testing::RedisServer;
using testing::TestArtifact;
using testing::WaitFor;

void Figure(const std::string& what, absl::Duration d) {
  std::printf("[figure] %s: %.3f ms\n", what.c_str(), absl::ToDoubleMilliseconds(d));
  std::fflush(stdout);
}

// One replica plus what its callbacks saw.
struct Replica {
  std::unique_ptr<ClusterState> state;
  mutable absl::Mutex mu;
  std::vector<uint64_t> installed ABSL_GUARDED_BY(mu);
  CentroidArtifact last ABSL_GUARDED_BY(mu);
  std::vector<WindowEntry> window ABSL_GUARDED_BY(mu);
  std::vector<WorkerLeases> leases ABSL_GUARDED_BY(mu);
  std::atomic<int> role_changes{0};

  uint64_t installed_generation() const { return state->status().installed_generation; }
  bool leader() const { return state->role() == ClusterRole::kLeader; }
  void SetLeases(std::vector<WorkerLeases> value) {
    absl::MutexLock lock(&mu);
    leases = std::move(value);
  }
  CentroidArtifact Last() const {
    absl::MutexLock lock(&mu);
    return last;
  }
  size_t WindowSize() const {
    absl::MutexLock lock(&mu);
    return window.size();
  }
};

class ClusterStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = RedisServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override {
    for (auto& replica : replicas_) replica->state->StopWithoutCleanup();
  }

  ClusterOptions Options(const std::string& id, absl::Duration lease) {
    ClusterOptions options;
    options.redis.address = server_->address();
    options.redis.connect_timeout = absl::Milliseconds(300);
    options.redis.command_timeout = absl::Milliseconds(300);
    options.redis.min_backoff = absl::Milliseconds(20);
    options.redis.max_backoff = absl::Milliseconds(300);
    options.cluster_name = "test";
    options.replica_id = id;
    options.leader_lease = lease;
    options.load_interval = absl::Milliseconds(50);
    options.load_ttl = absl::Milliseconds(500);
    return options;
  }

  Replica* Add(const std::string& id, absl::Duration lease = absl::Seconds(1),
               std::function<void(ClusterOptions&)> tweak = nullptr) {
    auto replica = std::make_unique<Replica>();
    Replica* r = replica.get();
    ClusterOptions options = Options(id, lease);
    options.on_centroids = [r](const CentroidArtifact& artifact, uint64_t generation) {
      absl::MutexLock lock(&r->mu);
      r->installed.push_back(generation);
      r->last = artifact;
      return absl::OkStatus();
    };
    options.on_role_change = [r](ClusterRole, uint64_t) { r->role_changes.fetch_add(1); };
    options.on_window_entries = [r](std::vector<WindowEntry> entries) {
      absl::MutexLock lock(&r->mu);
      for (WindowEntry& entry : entries) r->window.push_back(std::move(entry));
    };
    options.local_leases = [r] {
      absl::MutexLock lock(&r->mu);
      return r->leases;
    };
    if (tweak) tweak(options);
    absl::StatusOr<std::unique_ptr<ClusterState>> state = ClusterState::Create(options);
    EXPECT_TRUE(state.ok()) << state.status();
    r->state = *std::move(state);
    EXPECT_TRUE(r->state->Start().ok());
    replicas_.push_back(std::move(replica));
    return r;
  }

  int Leaders() const {
    int n = 0;
    for (const auto& replica : replicas_) n += replica->leader() ? 1 : 0;
    return n;
  }
  Replica* Leader() const {
    for (const auto& replica : replicas_) {
      if (replica->leader()) return replica.get();
    }
    return nullptr;
  }
  // Publishes `artifact` from the current leader; returns once Redis holds a generation above `after`.
  uint64_t PublishFromLeader(const CentroidArtifact& artifact, uint64_t after) {
    Replica* leader = Leader();
    EXPECT_NE(leader, nullptr);
    if (leader == nullptr) return 0;
    EXPECT_TRUE(leader->state->Publish(artifact, leader->state->status().fencing_generation).ok());
    EXPECT_TRUE(WaitFor([&] { return leader->installed_generation() > after; }, absl::Seconds(2)));
    return leader->installed_generation();
  }
  // How many connections Redis has subscribed to the centroid announcements (PUBSUB NUMSUB); -1
  // when it cannot say. A replica subscribes on a thread of its own and signals nothing when done
  // (ClusterState's RunSubscriber), so this is the only way to know that an announcement
  // published now reaches it.
  int64_t AnnouncementSubscribers() {
    if (admin_ == nullptr) {
      RedisConnectionOptions options;
      options.address = server_->address();
      absl::StatusOr<std::unique_ptr<RedisConnection>> admin = RedisConnection::Create(options);
      if (!admin.ok()) return -1;
      admin_ = *std::move(admin);
    }
    absl::StatusOr<RedisReply> reply = admin_->Command({"PUBSUB", "NUMSUB", ClusterKeys("test").centroids_announce()});
    if (!reply.ok() || reply->type != RedisReply::Type::kArray || reply->elements.size() != 2 ||
        reply->elements[1].type != RedisReply::Type::kInteger) {
      return -1;
    }
    return reply->elements[1].integer;
  }
  bool AllInstalled(uint64_t generation) const {
    for (const auto& replica : replicas_) {
      if (replica->installed_generation() != generation) return false;
    }
    return true;
  }

  std::unique_ptr<RedisServer> server_;
  std::unique_ptr<RedisConnection> admin_;  // AnnouncementSubscribers' own
  std::vector<std::unique_ptr<Replica>> replicas_;
};

TEST(ClusterOptionsTest, Validation) {
  ClusterOptions options;
  EXPECT_FALSE(ValidateClusterOptions(options).ok());  // no replica id
  options.replica_id = "r1";
  EXPECT_TRUE(ValidateClusterOptions(options).ok());
  options.renew_interval = absl::Seconds(5);
  EXPECT_FALSE(ValidateClusterOptions(options).ok());
  options.renew_interval = absl::ZeroDuration();
  options.cluster_name = "a{b}";
  EXPECT_FALSE(ValidateClusterOptions(options).ok());
  options.cluster_name = "ok";
  options.load_ttl = absl::Milliseconds(50);
  EXPECT_FALSE(ValidateClusterOptions(options).ok());
  options.load_ttl = absl::ZeroDuration();
  EXPECT_TRUE(ClusterState::Create(options).ok());
  EXPECT_EQ(ClusterRoleLabel(ClusterRole::kLeader), "leader");
}

TEST_F(ClusterStateTest, ThreeReplicasOneLeaderOneGeneration) {
  Replica* a = Add("a");
  Replica* b = Add("b");
  Replica* c = Add("c");
  ASSERT_TRUE(WaitFor([&] { return Leaders() == 1; }, absl::Seconds(2)));
  Replica* leader = Leader();
  const uint64_t fence = leader->state->status().fencing_generation;
  EXPECT_EQ(fence, 1u);
  // Every replica sees the leader and its fencing generation.
  ASSERT_TRUE(WaitFor(
      [&] {
        for (Replica* r : {a, b, c}) {
          const ClusterStatus status = r->state->status();
          if (status.fencing_generation != fence || status.leader_id != leader->state->options().replica_id) {
            return false;
          }
        }
        return true;
      },
      absl::Seconds(2)));
  EXPECT_EQ(Leaders(), 1);

  // A follower cannot publish.
  Replica* follower = leader == a ? b : a;
  EXPECT_EQ(follower->state->Publish(TestArtifact(), fence).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(leader->state->Publish(TestArtifact(), fence + 1).code(), absl::StatusCode::kFailedPrecondition);

  // Every replica subscribed before the publication: a follower subscribed after it would install
  // the set through its on-subscribe check and never count an announcement.
  ASSERT_TRUE(WaitFor([&] { return AnnouncementSubscribers() == 3; }, absl::Seconds(2)))
      << AnnouncementSubscribers() << " subscribed";
  const absl::Time start = absl::Now();
  ASSERT_TRUE(leader->state->Publish(TestArtifact(3, 1), fence).ok());
  ASSERT_TRUE(WaitFor([&] { return AllInstalled(1); }, absl::Seconds(1)));
  Figure("convergence after a publication (3 replicas)", absl::Now() - start);
  for (Replica* r : {a, b, c}) {
    if (r == leader) continue;
    EXPECT_EQ(r->Last().centroids, TestArtifact(3, 1).centroids);
    EXPECT_EQ(r->Last().workers, TestArtifact(3, 1).workers);
    // Counted by the subscriber thread, which may read the message after the control thread
    // installed the set by another way (a periodic check, a peer's generation).
    EXPECT_TRUE(WaitFor([&] { return r->state->status().announcements >= 1u; }, absl::Seconds(1)))
        << r->state->options().replica_id;
  }
  // A second publication moves everyone on again.
  const absl::Time second = absl::Now();
  ASSERT_TRUE(leader->state->Publish(TestArtifact(3, 2), fence).ok());
  ASSERT_TRUE(WaitFor([&] { return AllInstalled(2); }, absl::Seconds(1)));
  Figure("convergence after a second publication", absl::Now() - second);
  EXPECT_EQ(leader->state->status().publishes, 2u);
  EXPECT_EQ(leader->state->status().redis_errors[static_cast<int>(RedisErrorKind::kScript)], 0);
  // Peers see each other (and each other's installed generation).
  ASSERT_TRUE(WaitFor([&] { return a->state->status().peers.size() == 2; }, absl::Seconds(1)));
  EXPECT_EQ(a->state->PeerCount(), 2);
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const PeerStatus& peer : a->state->status().peers) {
          if (peer.installed_generation != 2) return false;
        }
        return true;
      },
      absl::Seconds(1)));
}

TEST_F(ClusterStateTest, LeaderDeathHandsOverWithinTwoLeases) {
  const absl::Duration lease = absl::Seconds(3);  // the default
  Add("a", lease);
  Add("b", lease);
  Add("c", lease);
  ASSERT_TRUE(WaitFor([&] { return Leaders() == 1; }, absl::Seconds(2)));
  const uint64_t generation = PublishFromLeader(TestArtifact(), 0);
  ASSERT_TRUE(WaitFor([&] { return AllInstalled(generation); }, absl::Seconds(1)));
  Replica* old_leader = Leader();
  const uint64_t old_fence = old_leader->state->status().fencing_generation;

  // A crash: no release. The others wait for the lease to run out.
  old_leader->state->StopWithoutCleanup();
  const absl::Time died = absl::Now();
  Replica* next = nullptr;
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const auto& r : replicas_) {
          if (r.get() != old_leader && r->leader()) next = r.get();
        }
        return next != nullptr;
      },
      2 * lease));
  const absl::Duration handover = absl::Now() - died;
  Figure("leader change after a crash (lease 3 s)", handover);
  EXPECT_LT(handover, 2 * lease);
  const uint64_t new_fence = next->state->status().fencing_generation;
  EXPECT_GT(new_fence, old_fence);
  // The new leader's publications move the generation on for the survivors.
  ASSERT_TRUE(next->state->Publish(TestArtifact(3, 4), new_fence).ok());
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const auto& r : replicas_) {
          if (r.get() != old_leader && r->installed_generation() != generation + 1) return false;
        }
        return true;
      },
      absl::Seconds(1)));

  // A clean stop releases the lease and announces it: the next leader takes over at once.
  const absl::Time stopped = absl::Now();
  next->state->Stop();
  Replica* third = nullptr;
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const auto& r : replicas_) {
          if (r.get() != old_leader && r.get() != next && r->leader()) third = r.get();
        }
        return third != nullptr;
      },
      absl::Milliseconds(500)));
  Figure("leader change after a clean stop (lease 3 s)", absl::Now() - stopped);
  EXPECT_GT(third->state->status().fencing_generation, new_fence);
}

TEST_F(ClusterStateTest, StaleLeaderCannotPublishOverItsSuccessor) {
  Add("a");
  Add("b");
  Add("c");
  ASSERT_TRUE(WaitFor([&] { return Leaders() == 1; }, absl::Seconds(2)));
  const uint64_t first = PublishFromLeader(TestArtifact(3, 0), 0);
  ASSERT_TRUE(WaitFor([&] { return AllInstalled(first); }, absl::Seconds(1)));

  Replica* stale = Leader();
  const uint64_t stale_fence = stale->state->status().fencing_generation;
  stale->state->PauseForTesting(true);  // as SIGSTOP: no renewals
  const absl::Time paused = absl::Now();
  Replica* successor = nullptr;
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const auto& r : replicas_) {
          if (r.get() != stale && r->leader()) successor = r.get();
        }
        return successor != nullptr;
      },
      absl::Seconds(3)));
  Figure("leader change after a pause (lease 1 s)", absl::Now() - paused);
  const uint64_t successor_fence = successor->state->status().fencing_generation;
  EXPECT_GT(successor_fence, stale_fence);
  ASSERT_TRUE(successor->state->Publish(TestArtifact(3, 1), successor_fence).ok());
  ASSERT_TRUE(WaitFor([&] { return successor->installed_generation() == first + 1; }, absl::Seconds(1)));

  // The paused replica still believes it leads: its Publish is queued, and runs when it resumes.
  EXPECT_TRUE(stale->leader());
  ASSERT_TRUE(stale->state->Publish(TestArtifact(3, 2), stale_fence).ok());
  stale->state->PauseForTesting(false);
  ASSERT_TRUE(WaitFor([&] { return stale->state->status().publishes_fenced >= 1; }, absl::Seconds(2)));
  ASSERT_TRUE(WaitFor([&] { return !stale->leader(); }, absl::Seconds(1)));
  // Everyone, the stale replica included, serves the successor's set.
  ASSERT_TRUE(WaitFor([&] { return AllInstalled(first + 1); }, absl::Seconds(2)));
  for (const auto& r : replicas_) {
    if (r.get() == successor) continue;
    EXPECT_EQ(r->Last().centroids, TestArtifact(3, 1).centroids);
  }
  EXPECT_EQ(Leaders(), 1);
  EXPECT_EQ(stale->state->status().publishes, 1u);  // only the one before the pause
}

TEST_F(ClusterStateTest, RedisRestartedEmptyIsFailStaticThenRecovers) {
  Add("a");
  Add("b");
  Add("c");
  ASSERT_TRUE(WaitFor([&] { return Leaders() == 1; }, absl::Seconds(2)));
  const uint64_t first = PublishFromLeader(TestArtifact(3, 3), 0);
  ASSERT_TRUE(WaitFor([&] { return AllInstalled(first); }, absl::Seconds(1)));

  server_->Kill();
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const auto& r : replicas_) {
          const ClusterStatus status = r->state->status();
          if (status.redis_ok || status.redis_errors[static_cast<int>(RedisErrorKind::kUnreachable)] == 0) {
            return false;
          }
        }
        return true;
      },
      absl::Seconds(2)));
  // The leader steps down by itself at its lease's end (the last renewal before the kill + 1 s),
  // at its control thread's next round: wait for that rather than for a fixed time.
  EXPECT_TRUE(WaitFor([&] { return Leaders() == 0; }, absl::Seconds(3)));
  for (const auto& r : replicas_) {
    EXPECT_EQ(r->installed_generation(), first);  // last state kept
    EXPECT_FALSE(r->state->status().last_error.empty());
  }

  const absl::Time restart = absl::Now();
  ASSERT_TRUE(server_->Restart().ok());
  // A leader again; it re-publishes the set above every generation seen; everyone installs it.
  ASSERT_TRUE(WaitFor([&] { return Leaders() == 1 && AllInstalled(first + 1); }, absl::Seconds(5)));
  Figure("recovery after an empty Redis restart (leader + republished generation everywhere)", absl::Now() - restart);
  Replica* leader = Leader();
  EXPECT_EQ(leader->state->status().republishes, 1u);
  for (const auto& r : replicas_) {
    EXPECT_TRUE(r->state->status().redis_ok);
    EXPECT_EQ(r->Last().centroids.empty() ? TestArtifact(3, 3).centroids : r->Last().centroids,
              TestArtifact(3, 3).centroids);
  }
  // The fence moved on too (the new acquisition continues above the old fence).
  EXPECT_GE(leader->state->status().fencing_generation, 2u);
}

TEST_F(ClusterStateTest, SharedLoadVisibleThenGoneWhenAReplicaDies) {
  Replica* a = Add("a");
  Replica* b = Add("b");
  Replica* c = Add("c");
  ASSERT_TRUE(WaitFor([&] { return b->state->status().peers.size() == 2; }, absl::Seconds(2)));

  absl::Time start = absl::Now();
  a->SetLeases({{"w0", 3, 3}, {"w1", 1, 1}});
  c->SetLeases({{"w0", 2, 2}});
  ASSERT_TRUE(WaitFor(
      [&] {
        std::map<std::string, int64_t> others = b->state->OthersLeases();
        return others["w0"] == 5 && others["w1"] == 1;
      },
      absl::Milliseconds(200)));
  Figure("a replica's leases visible to another", absl::Now() - start);
  EXPECT_EQ(b->state->OthersLeaseCounts()["w0"].since_snapshot, 5);
  // Its own are not "others".
  EXPECT_TRUE(WaitFor([&] { return a->state->OthersLeases()["w0"] == 2; }, absl::Milliseconds(200)));

  // a dies without cleanup: its leases stop counting once its hash expires (load_ttl 500 ms).
  a->state->StopWithoutCleanup();
  start = absl::Now();
  ASSERT_TRUE(WaitFor([&] { return b->state->OthersLeases()["w0"] == 2; }, absl::Milliseconds(800)));
  const absl::Duration expired = absl::Now() - start;
  Figure("a dead replica's leases gone (load_ttl 500 ms)", expired);
  EXPECT_GE(expired, absl::Milliseconds(300));

  // c stops cleanly: gone at once.
  c->state->Stop();
  start = absl::Now();
  ASSERT_TRUE(WaitFor([&] { return b->state->OthersLeases().empty(); }, absl::Milliseconds(200)));
  Figure("a stopped replica's leases gone", absl::Now() - start);
}

TEST_F(ClusterStateTest, HungRedisNeverBlocksCallers) {
  Replica* a = Add("a");
  Replica* b = Add("b");
  ASSERT_TRUE(WaitFor([&] { return Leaders() == 1; }, absl::Seconds(2)));
  a->SetLeases({{"w0", 1, 1}});
  ASSERT_TRUE(WaitFor([&] { return b->state->OthersLeases()["w0"] == 1; }, absl::Seconds(1)));
  Replica* leader = Leader();
  const uint64_t fence = leader->state->status().fencing_generation;
  const CentroidArtifact artifact = TestArtifact();
  WindowSignature signature;
  signature.signature.assign(32, 0.0f);
  signature.signature[0] = 1.0f;

  // Two threads call the facade in a loop while Redis is slow (DEBUG SLEEP), then hung (SIGSTOP:
  // the kernel still accepts connections, nothing answers, every command runs into its 300 ms
  // deadline). A call that
  // waited for Redis would take at least that long; the bound below is half of it, so that a
  // loaded machine's scheduling delays do not fail the test (p99 and worst are printed).
  std::atomic<bool> done{false};
  auto hammer = [&](Replica* r, std::vector<int64_t>* samples) {
    while (!done.load()) {
      const absl::Time t0 = absl::Now();
      r->state->status();
      r->state->OthersLeases();
      r->state->PeerLoads();
      r->state->role();
      r->state->AppendSignatures({&signature, 1});
      if (r == leader) r->state->Publish(artifact, fence).IgnoreError();
      samples->push_back(absl::ToInt64Nanoseconds(absl::Now() - t0));
      absl::SleepFor(absl::Microseconds(50));
    }
  };
  std::vector<int64_t> samples_a;
  std::vector<int64_t> samples_b;
  std::thread t1(hammer, a, &samples_a);
  std::thread t2(hammer, b, &samples_b);
  absl::SleepFor(absl::Milliseconds(200));
  // Slow first: DEBUG SLEEP 0.2 over and over, every command waits up to 200 ms.
  RedisConnectionOptions slow_options;
  slow_options.address = server_->address();
  slow_options.command_timeout = absl::Seconds(2);
  auto slow = *RedisConnection::Create(slow_options);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(slow->Command({"DEBUG", "SLEEP", "0.2"}).ok());
  // Then hung.
  server_->Pause();
  absl::SleepFor(absl::Milliseconds(1500));
  server_->Resume();
  absl::SleepFor(absl::Milliseconds(200));
  done.store(true);
  t1.join();
  t2.join();
  std::vector<int64_t> samples = samples_a;
  samples.insert(samples.end(), samples_b.begin(), samples_b.end());
  ASSERT_FALSE(samples.empty());
  std::sort(samples.begin(), samples.end());
  Figure("facade calls while Redis slow/hung, p50", absl::Nanoseconds(samples[samples.size() / 2]));
  Figure("facade calls while Redis slow/hung, p99", absl::Nanoseconds(samples[samples.size() * 99 / 100]));
  Figure("facade calls while Redis slow/hung, worst", absl::Nanoseconds(samples.back()));
  EXPECT_LT(absl::Nanoseconds(samples.back()), absl::Milliseconds(150));
  EXPECT_GT(a->state->status().redis_errors[static_cast<int>(RedisErrorKind::kTimeout)] +
                b->state->status().redis_errors[static_cast<int>(RedisErrorKind::kTimeout)],
            0);
  // And it recovers.
  ASSERT_TRUE(WaitFor([&] { return a->state->status().redis_ok && b->state->status().redis_ok; }, absl::Seconds(3)));
  // Stop is bounded even with Redis hung.
  server_->Pause();
  const absl::Time stop = absl::Now();
  a->state->Stop();
  Figure("Stop with Redis hung (command_timeout 300 ms)", absl::Now() - stop);
  EXPECT_LT(absl::Now() - stop, absl::Seconds(2));
  server_->Resume();
}

TEST_F(ClusterStateTest, LeaderReadsTheOthersWindow) {
  Replica* a = Add("a");
  ASSERT_TRUE(WaitFor([&] { return a->leader(); }, absl::Seconds(2)));
  Replica* b = Add("b");
  std::vector<WindowSignature> batch(10);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].signature.assign(32, 0.0f);
    batch[i].signature[i] = 1.0f;
    batch[i].decode_work = 100.0 + i;
    batch[i].client = "proxy-1";
  }
  b->state->AppendSignatures(batch);
  a->state->AppendSignatures(batch);  // the leader's own: not delivered back to it
  ASSERT_TRUE(WaitFor([&] { return a->WindowSize() == 10; }, absl::Seconds(1)));
  ASSERT_TRUE(WaitFor([&] { return a->state->status().window_length == 20; }, absl::Seconds(2)));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(a->WindowSize(), 10u);
  EXPECT_EQ(b->WindowSize(), 0u);  // followers do not read the window
  absl::MutexLock lock(&a->mu);
  EXPECT_EQ(a->window[3].replica, "b");
  EXPECT_EQ(a->window[3].signature.decode_work, 103.0);
  EXPECT_EQ(a->window[3].signature.client, "proxy-1");
  EXPECT_EQ(a->window[3].signature.signature[3], 1.0f);
  EXPECT_EQ(b->state->status().window_appended, 10u);
}

TEST_F(ClusterStateTest, NewLeaderSeedsAnEmptyRedisWithItsCentroids) {
  Replica* a = Add("a", absl::Seconds(1), [](ClusterOptions& options) {
    options.local_centroids = [] { return absl::StatusOr<CentroidArtifact>(TestArtifact(3, 5)); };
  });
  ASSERT_TRUE(WaitFor([&] { return a->leader() && a->installed_generation() == 1; }, absl::Seconds(2)));
  Replica* b = Add("b");
  ASSERT_TRUE(WaitFor([&] { return b->installed_generation() == 1; }, absl::Seconds(2)));
  EXPECT_EQ(b->Last().centroids, TestArtifact(3, 5).centroids);
}

TEST_F(ClusterStateTest, FreshLeaderAfterAWipeDoesNotStrandFollowersAhead) {
  Replica* a = Add("a");
  ASSERT_TRUE(WaitFor([&] { return a->leader(); }, absl::Seconds(2)));
  Replica* b = Add("b", absl::Seconds(1), [](ClusterOptions& options) { options.leader_eligible = false; });
  uint64_t generation = 0;
  for (int i = 0; i < 3; ++i) generation = PublishFromLeader(TestArtifact(3, i), generation);
  ASSERT_TRUE(WaitFor([&] { return b->installed_generation() == 3; }, absl::Seconds(1)));

  // The leader dies and Redis loses everything; a fresh replica that knows nothing but its own
  // startup centroids takes over. b serves generation 3 and must get something newer.
  a->state->StopWithoutCleanup();
  RedisConnectionOptions admin_options;
  admin_options.address = server_->address();
  auto admin = *RedisConnection::Create(admin_options);
  ASSERT_TRUE(admin->Command({"FLUSHALL"}).ok());
  Replica* c = Add("c", absl::Seconds(1), [](ClusterOptions& options) {
    options.local_centroids = [] { return absl::StatusOr<CentroidArtifact>(TestArtifact(3, 7)); };
  });
  ASSERT_TRUE(WaitFor([&] { return c->leader(); }, absl::Seconds(2)));
  ASSERT_TRUE(WaitFor([&] { return b->installed_generation() > 3; }, absl::Seconds(3)));
  EXPECT_EQ(b->Last().centroids, TestArtifact(3, 7).centroids);
  EXPECT_EQ(c->installed_generation(), b->installed_generation());
}

TEST_F(ClusterStateTest, PeriodicCheckInstallsWithoutAnnouncement) {
  Replica* a = Add("a");
  ASSERT_TRUE(WaitFor([&] { return a->leader(); }, absl::Seconds(2)));
  Replica* b = Add("b");
  ASSERT_TRUE(WaitFor([&] { return b->state->status().redis_ok; }, absl::Seconds(1)));
  absl::SleepFor(absl::Milliseconds(100));
  // A set stored the way the publication script stores it, but not announced.
  RedisConnectionOptions admin_options;
  admin_options.address = server_->address();
  auto admin = *RedisConnection::Create(admin_options);
  ClusterKeys keys("test");
  const absl::Time start = absl::Now();
  ASSERT_TRUE(admin
                  ->Command({"HSET", keys.centroids(), "gen", "1", "fence", "1", "by", "a", "at_ms", "0", "data",
                             *EncodeCentroidArtifact(TestArtifact(3, 6))})
                  .ok());
  ASSERT_TRUE(admin->Command({"SET", keys.centroids_gen(), "1"}).ok());
  ASSERT_TRUE(WaitFor([&] { return b->installed_generation() == 1; }, absl::Milliseconds(1500)));
  Figure("install through the periodic check (interval 1 s)", absl::Now() - start);
  EXPECT_EQ(b->state->status().announcements, 0u);
  EXPECT_EQ(b->Last().centroids, TestArtifact(3, 6).centroids);
}

TEST_F(ClusterStateTest, CorruptOrRefusedSetsAreNotInstalled) {
  std::atomic<bool> refuse{false};
  Replica* a = Add("a");
  ASSERT_TRUE(WaitFor([&] { return a->leader(); }, absl::Seconds(2)));
  Replica* b = Add("b", absl::Seconds(1), [&](ClusterOptions& options) {
    auto inner = options.on_centroids;
    options.on_centroids = [inner, &refuse](const CentroidArtifact& artifact, uint64_t generation) {
      if (refuse.load()) return absl::FailedPreconditionError("unknown worker");
      return inner(artifact, generation);
    };
  });
  const uint64_t first = PublishFromLeader(TestArtifact(), 0);
  ASSERT_TRUE(WaitFor([&] { return b->installed_generation() == first; }, absl::Seconds(1)));

  // Garbage under a newer generation, announced: refused with a reason, never retried.
  RedisConnectionOptions options;
  options.address = server_->address();
  auto admin = *RedisConnection::Create(options);
  ClusterKeys keys("test");
  ASSERT_TRUE(
      admin->Command({"HSET", keys.centroids(), "gen", "9", "data", "garbage", "fence", "1", "by", "x", "at_ms", "0"})
          .ok());
  ASSERT_TRUE(admin->Command({"SET", keys.centroids_gen(), "9"}).ok());
  ASSERT_TRUE(admin->Command({"PUBLISH", keys.centroids_announce(), "9"}).ok());
  ASSERT_TRUE(WaitFor([&] { return b->state->status().corrupt_sets == 1; }, absl::Seconds(2)));
  EXPECT_EQ(b->installed_generation(), first);
  absl::SleepFor(absl::Milliseconds(1100));  // a periodic check does not retry it
  EXPECT_EQ(b->state->status().corrupt_sets, 1u);

  // A set the router refuses: counted, retried at the periodic check, installed once accepted.
  refuse.store(true);
  const uint64_t next = PublishFromLeader(TestArtifact(3, 1), 9);
  ASSERT_TRUE(WaitFor([&] { return b->state->status().install_failures >= 1; }, absl::Seconds(1)));
  EXPECT_EQ(b->installed_generation(), first);
  refuse.store(false);
  ASSERT_TRUE(WaitFor([&] { return b->installed_generation() == next; }, absl::Seconds(2)));
}

}  // namespace
}  // namespace eldr::cluster
