// ClusterStore's scripts against a real redis-server: the fenced lease, generations that never go
// back (also over a wiped Redis), the window stream, the load hashes and their expiry.
#include "eldr/cluster/cluster_store.h"

#include "cluster/redis_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::cluster {
namespace {

using testing::RedisServer;

class ClusterStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = RedisServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    RedisConnectionOptions options;
    options.address = server_->address();
    options.min_backoff = absl::Milliseconds(10);
    options.max_backoff = absl::Milliseconds(50);
    conn_ = *RedisConnection::Create(options);
    store_ = std::make_unique<ClusterStore>(conn_.get(), ClusterKeys("pool-a"));
  }

  std::unique_ptr<RedisServer> server_;
  std::unique_ptr<RedisConnection> conn_;
  std::unique_ptr<ClusterStore> store_;
};

TEST(ClusterKeysTest, HashTaggedNamesAndValidation) {
  ClusterKeys keys("pool-a");
  EXPECT_EQ(keys.prefix(), "eldr:{pool-a}");
  EXPECT_EQ(keys.leader(), "eldr:{pool-a}:leader");
  EXPECT_EQ(keys.leases("r1"), "eldr:{pool-a}:leases:r1");
  EXPECT_TRUE(ValidateClusterName("pool_a.1-x").ok());
  EXPECT_FALSE(ValidateClusterName("").ok());
  EXPECT_FALSE(ValidateClusterName("a}b").ok());
  EXPECT_FALSE(ValidateClusterName("a:b").ok());
  EXPECT_TRUE(ValidateReplicaId("router-7f9c.default@node/1").ok());
  EXPECT_FALSE(ValidateReplicaId("a|b").ok());
  EXPECT_FALSE(ValidateReplicaId("#gen").ok());
  EXPECT_FALSE(ValidateReplicaId("").ok());
}

TEST_F(ClusterStoreTest, LeaseIsExclusiveRenewableAndFenced) {
  absl::StatusOr<LeaderAcquisition> a = store_->TryAcquireLeader("a", absl::Seconds(5), 0);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->acquired);
  EXPECT_EQ(a->fence, 1u);
  EXPECT_EQ(a->holder, "a");

  absl::StatusOr<LeaderAcquisition> b = store_->TryAcquireLeader("b", absl::Seconds(5), 0);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->acquired);
  EXPECT_EQ(b->holder, "a");
  EXPECT_EQ(b->fence, 1u);
  EXPECT_GT(b->remaining, absl::Seconds(4));

  EXPECT_TRUE(*store_->RenewLeader("a", 1, absl::Seconds(5)));
  EXPECT_FALSE(*store_->RenewLeader("b", 1, absl::Seconds(5)));
  EXPECT_FALSE(*store_->RenewLeader("a", 2, absl::Seconds(5)));  // not this acquisition

  // a publishes; after its lease is gone and b took over, a's fence is stale.
  const std::string data = *EncodeCentroidArtifact(testing::TestArtifact());
  absl::StatusOr<PublishResult> first = store_->PublishCentroids(data, 1, 0, "a");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->fenced);
  EXPECT_EQ(first->generation, 1u);

  EXPECT_FALSE(*store_->ReleaseLeader("b", 1));
  EXPECT_TRUE(*store_->ReleaseLeader("a", 1));
  b = store_->TryAcquireLeader("b", absl::Seconds(5), 0);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->acquired);
  EXPECT_EQ(b->fence, 2u);

  absl::StatusOr<PublishResult> stale = store_->PublishCentroids(data, 1, 0, "a");
  ASSERT_TRUE(stale.ok());
  EXPECT_TRUE(stale->fenced);
  EXPECT_EQ(stale->current_fence, 2u);
  EXPECT_EQ(*store_->CentroidGeneration(), 1u);  // nothing written

  absl::StatusOr<PublishResult> second = store_->PublishCentroids(data, 2, 0, "b");
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->generation, 2u);
  absl::StatusOr<std::optional<StoredCentroids>> stored = store_->FetchCentroids();
  ASSERT_TRUE(stored.ok() && stored->has_value());
  EXPECT_EQ((*stored)->generation, 2u);
  EXPECT_EQ((*stored)->fence, 2u);
  EXPECT_EQ((*stored)->publisher, "b");
  EXPECT_EQ((*stored)->data, data);
  EXPECT_LT(absl::Now() - (*stored)->published_at, absl::Seconds(5));

  absl::StatusOr<LeaderInfo> info = store_->ReadLeader();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->holder, "b");
  EXPECT_EQ(info->holder_fence, 2u);
  EXPECT_EQ(info->fence, 2u);

  EXPECT_EQ(store_->PublishCentroids(data, 0, 0, "x").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClusterStoreTest, LeaseExpires) {
  ASSERT_TRUE(store_->TryAcquireLeader("a", absl::Milliseconds(100), 0)->acquired);
  EXPECT_FALSE(store_->TryAcquireLeader("b", absl::Milliseconds(100), 0)->acquired);
  absl::SleepFor(absl::Milliseconds(150));
  EXPECT_FALSE(*store_->RenewLeader("a", 1, absl::Milliseconds(100)));
  absl::StatusOr<LeaderAcquisition> b = store_->TryAcquireLeader("b", absl::Milliseconds(100), 0);
  EXPECT_TRUE(b->acquired);
  EXPECT_EQ(b->fence, 2u);
}

TEST_F(ClusterStoreTest, FloorsKeepGenerationsMonotonicOverAWipe) {
  ASSERT_TRUE(store_->TryAcquireLeader("a", absl::Seconds(5), 0)->acquired);
  const std::string data = *EncodeCentroidArtifact(testing::TestArtifact());
  for (int i = 0; i < 3; ++i) ASSERT_FALSE(store_->PublishCentroids(data, 1, 0, "a")->fenced);
  EXPECT_EQ(*store_->CentroidGeneration(), 3u);
  ASSERT_TRUE(conn_->Command({"FLUSHALL"}).ok());  // as a restart without persistence
  EXPECT_EQ(*store_->CentroidGeneration(), 0u);
  EXPECT_FALSE(store_->FetchCentroids()->has_value());
  // The next acquisition continues above the highest fence the caller saw, the next publication
  // above the highest generation.
  absl::StatusOr<LeaderAcquisition> again = store_->TryAcquireLeader("b", absl::Seconds(5), 1);
  ASSERT_TRUE(again->acquired);
  EXPECT_EQ(again->fence, 2u);
  // a (fence 1) is refused although the fence key restarted.
  EXPECT_TRUE(store_->PublishCentroids(data, 1, 3, "a")->fenced);
  absl::StatusOr<PublishResult> next = store_->PublishCentroids(data, 2, 3, "b");
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->generation, 4u);
}

TEST_F(ClusterStoreTest, GenerationFloorIsRaisedNeverLowered) {
  EXPECT_EQ(store_->ReadGenerations()->counter, 0u);
  EXPECT_EQ(*store_->RaiseGenerationFloor(5), 5u);
  EXPECT_EQ(*store_->RaiseGenerationFloor(3), 5u);
  absl::StatusOr<ClusterStore::Generations> generations = store_->ReadGenerations();
  ASSERT_TRUE(generations.ok()) << generations.status();
  EXPECT_EQ(generations->counter, 5u);
  EXPECT_EQ(generations->stored, 0u);
  ASSERT_TRUE(store_->TryAcquireLeader("a", absl::Seconds(5), 0)->acquired);
  EXPECT_EQ(store_->PublishCentroids("x", 1, 0, "a")->generation, 6u);
  generations = store_->ReadGenerations();
  EXPECT_EQ(generations->counter, 6u);
  EXPECT_EQ(generations->stored, 6u);
}

TEST_F(ClusterStoreTest, PublicationIsAnnounced) {
  RedisConnectionOptions options;
  options.address = server_->address();
  auto sub = *RedisConnection::Create(options);
  ASSERT_TRUE(sub->Command({"SUBSCRIBE", store_->keys().centroids_announce()}).ok());
  ASSERT_TRUE(store_->TryAcquireLeader("a", absl::Seconds(5), 0)->acquired);
  ASSERT_FALSE(store_->PublishCentroids("x", 1, 41, "a")->fenced);
  absl::StatusOr<std::optional<RedisReply>> message = sub->ReadPush(absl::Seconds(1));
  ASSERT_TRUE(message.ok() && message->has_value());
  EXPECT_EQ((*message)->elements[2].str, "42");
}

TEST_F(ClusterStoreTest, WindowAppendReadAndTrim) {
  std::vector<WindowSignature> batch(30);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].signature.assign(64, 0.0f);
    batch[i].signature[i] = 1.0f;
    batch[i].decode_work = static_cast<double>(i);
    batch[i].client = i % 2 ? "odd" : "";
  }
  ASSERT_TRUE(store_->AppendWindow("r1", batch, 1000).ok());
  ASSERT_TRUE(store_->AppendWindow("r2", absl::MakeConstSpan(batch).subspan(0, 5), 1000).ok());
  EXPECT_EQ(*store_->WindowLength(), 35);

  // A foreign entry in the stream is skipped, not fatal.
  ASSERT_TRUE(conn_->Command({"XADD", store_->keys().window(), "*", "r", "x", "e", "garbage"}).ok());

  std::vector<WindowEntry> all;
  std::string cursor = "0-0";
  int64_t undecodable = 0;
  while (true) {
    absl::StatusOr<WindowBatch> page = store_->ReadWindow(cursor, 8);
    ASSERT_TRUE(page.ok()) << page.status();
    undecodable += page->undecodable;
    if (page->entries.empty() && page->undecodable == 0) break;
    cursor = page->last_id;
    for (WindowEntry& entry : page->entries) all.push_back(std::move(entry));
  }
  ASSERT_EQ(all.size(), 35u);
  EXPECT_EQ(undecodable, 1);
  EXPECT_EQ(all[0].replica, "r1");
  EXPECT_EQ(all[29].signature.decode_work, 29.0);
  EXPECT_EQ(all[29].signature.client, "odd");
  EXPECT_EQ(all[29].signature.signature[29], 1.0f);
  EXPECT_EQ(all[30].replica, "r2");
  EXPECT_LT(absl::Now() - all[0].at, absl::Seconds(10));

  // MAXLEN ~ trims (approximately: whole radix-tree nodes of 100 entries by default).
  std::vector<WindowSignature> many(300, batch[0]);
  ASSERT_TRUE(store_->AppendWindow("r1", many, 50).ok());
  EXPECT_LT(*store_->WindowLength(), 250);
}

TEST_F(ClusterStoreTest, LoadHashesAndExpiry) {
  ReplicaLoad a;
  a.workers = {{"w0", 3, 2}, {"w1", 0, 0}};
  a.installed_generation = 7;
  a.leader = true;
  ReplicaLoad b;
  b.workers = {{"w0", 1, 1}};
  absl::StatusOr<absl::Time> at = store_->PublishLoad("a", a, absl::Milliseconds(300), absl::Seconds(3));
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_LT(absl::AbsDuration(*at - absl::Now()), absl::Seconds(5));
  ASSERT_TRUE(store_->PublishLoad("b", b, absl::Seconds(10), absl::Seconds(30)).ok());

  absl::StatusOr<std::vector<PeerLoad>> peers = store_->ReadLoads();
  ASSERT_TRUE(peers.ok()) << peers.status();
  ASSERT_EQ(peers->size(), 2u);
  const PeerLoad& pa = (*peers)[0].replica_id == "a" ? (*peers)[0] : (*peers)[1];
  EXPECT_TRUE(pa.load.leader);
  EXPECT_EQ(pa.load.installed_generation, 7u);
  ASSERT_EQ(pa.load.workers.size(), 2u);

  // Re-publishing replaces the hash (a worker that is gone disappears).
  a.workers = {{"w0", 2, 1}};
  ASSERT_TRUE(store_->PublishLoad("a", a, absl::Milliseconds(300), absl::Seconds(3)).ok());
  peers = store_->ReadLoads();
  for (const PeerLoad& peer : *peers) {
    if (peer.replica_id != "a") continue;
    ASSERT_EQ(peer.load.workers.size(), 1u);
    EXPECT_EQ(peer.load.workers[0].live, 2);
    EXPECT_EQ(peer.load.workers[0].since_snapshot, 1);
  }

  // a stops publishing: its hash expires and it is no longer read.
  absl::SleepFor(absl::Milliseconds(400));
  peers = store_->ReadLoads();
  ASSERT_EQ(peers->size(), 1u);
  EXPECT_EQ((*peers)[0].replica_id, "b");

  ASSERT_TRUE(store_->DeleteLoad("b").ok());
  EXPECT_TRUE(store_->ReadLoads()->empty());
}

TEST_F(ClusterStoreTest, ManyWorkersInOneHash) {
  ReplicaLoad load;
  for (int i = 0; i < 2500; ++i) load.workers.push_back({absl::StrCat("worker-", i), i, i});
  ASSERT_TRUE(store_->PublishLoad("a", load, absl::Seconds(5), absl::Seconds(50)).ok());
  absl::StatusOr<std::vector<PeerLoad>> peers = store_->ReadLoads();
  ASSERT_TRUE(peers.ok());
  ASSERT_EQ(peers->size(), 1u);
  EXPECT_EQ((*peers)[0].load.workers.size(), 2500u);
}

}  // namespace
}  // namespace eldr::cluster
