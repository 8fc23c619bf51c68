// The shared state of a pool of router replicas in Redis: its keys, and the synchronous operations
// on them (one round trip each, atomic where it matters: Lua scripts). The ClusterState facade
// (cluster_state.h) runs these on its background threads; tools and tests may call them directly.
//
// Keys, all under the prefix eldr:{<cluster_name>} (the braces are a Redis Cluster hash tag: every
// key of one pool hashes to one slot, so the multi-key scripts below also run on a Redis Cluster):
//   <p>:leader                 string "<replica_id>|<fence>", PX lease: the refit leader's lease
//   <p>:fence                  integer: the fencing generation, incremented by every acquisition
//   <p>:centroids:gen          integer: the last published centroid generation
//   <p>:centroids              hash {gen, fence, by, at_ms, data}: the published set (data: codec.h)
//   <p>:centroids:announce     pub/sub channel: the generation of each publication
//   <p>:leader:announce        pub/sub channel: "released <replica_id>|<fence>" when a leader
//                              releases its lease (followers try at once, not at their next retry)
//   <p>:window                 stream of sampled signatures {r: replica, c: client, e: codec.h
//                              signature}, trimmed with MAXLEN ~ (the shared refit window)
//   <p>:leases:<replica_id>    hash {<worker>: "<live>,<since_snapshot>", #gen, #role, #at},
//                              PX load_ttl: one replica's live leases, gone when it stops renewing
//   <p>:replicas               sorted set <replica_id> -> server time (ms) of its last load
//                              publication (members older than the stale bound are removed)
//
// Fencing: PublishCentroids runs a script that writes only when the caller's fencing generation is
// the current value of <p>:fence, so a leader that lost its lease (paused, partitioned) and has
// not noticed yet cannot overwrite what its successor wrote. Generations never go backwards, even
// over a Redis restart that lost everything: acquisition and publication take a floor (the highest
// fence / generation the caller has seen) and continue above it.
//
// Thread-safety: a ClusterStore is used by one thread at a time, like its connection.
#ifndef ELDR_CLUSTER_CLUSTER_STORE_H_
#define ELDR_CLUSTER_CLUSTER_STORE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "eldr/cluster/codec.h"
#include "eldr/cluster/redis_connection.h"

namespace eldr::cluster {

// 1 to 64 of letters, digits and . _ - (no braces or colons: the name sits in a hash tag).
absl::Status ValidateClusterName(absl::string_view name);
// 1 to 253 of letters, digits and . _ - : @ / + (a host or pod name); no '|' (the lease value's
// separator) and no '#' (the load hash's meta fields).
absl::Status ValidateReplicaId(absl::string_view id);

class ClusterKeys {
 public:
  explicit ClusterKeys(absl::string_view cluster_name);
  const std::string& prefix() const { return prefix_; }  // eldr:{<cluster_name>}
  std::string leader() const { return prefix_ + ":leader"; }
  std::string fence() const { return prefix_ + ":fence"; }
  std::string centroids_gen() const { return prefix_ + ":centroids:gen"; }
  std::string centroids() const { return prefix_ + ":centroids"; }
  std::string centroids_announce() const { return prefix_ + ":centroids:announce"; }
  std::string leader_announce() const { return prefix_ + ":leader:announce"; }
  std::string window() const { return prefix_ + ":window"; }
  std::string replicas() const { return prefix_ + ":replicas"; }
  std::string leases(absl::string_view replica_id) const;

 private:
  std::string prefix_;
};

// What an acquisition attempt found.
struct LeaderAcquisition {
  bool acquired = false;
  uint64_t fence = 0;  // acquired: ours; otherwise the current value of <p>:fence
  std::string holder;  // the replica holding the lease (ours when acquired)
  // Of the holder's lease (acquired: the full lease; 0 when under a millisecond is left;
  // infinite for a lease key without expiry, which only a person can have written).
  absl::Duration remaining;
};

struct LeaderInfo {
  std::string holder;  // empty: no leader
  uint64_t holder_fence = 0;
  uint64_t fence = 0;  // <p>:fence
  absl::Duration remaining;
};

struct PublishResult {
  bool fenced = false;      // refused: the caller's fence is not the current one
  uint64_t generation = 0;  // the new generation (0 when fenced)
  uint64_t current_fence = 0;
};

struct StoredCentroids {
  uint64_t generation = 0;
  uint64_t fence = 0;     // of the leader that published it
  std::string publisher;  // its replica id
  absl::Time published_at;
  std::string data;  // EncodeCentroidArtifact
};

// One entry of the shared window.
struct WindowEntry {
  std::string id;       // the stream id ("<ms>-<seq>")
  std::string replica;  // who appended it
  absl::Time at;        // from the stream id (the server's clock)
  WindowSignature signature;
};

struct WindowBatch {
  std::vector<WindowEntry> entries;  // in stream order
  std::string last_id;               // pass as `after_id` to continue; unchanged when nothing new
  int64_t undecodable = 0;           // entries skipped (bad fields or encoding)
};

// One worker's lease figures as a replica publishes them.
struct WorkerLeases {
  std::string worker_id;
  int64_t live = 0;  // leases live now
  // Of those, the leases acquired after the replica's last fresh load snapshot of the worker
  // (WorkerLoad::leases_since_snapshot): what a reader holding a fresh snapshot of its own adds,
  // since the worker's report already counts the older ones. 0 when not tracked.
  int64_t since_snapshot = 0;
};

struct ReplicaLoad {
  std::vector<WorkerLeases> workers;
  uint64_t installed_generation = 0;  // the centroid generation the replica serves
  bool leader = false;
};

struct PeerLoad {
  std::string replica_id;
  absl::Time published_at;  // the server's clock at its last publication
  ReplicaLoad load;
};

class ClusterStore {
 public:
  // `connection` must outlive the store.
  ClusterStore(RedisConnection* connection, ClusterKeys keys);
  const ClusterKeys& keys() const { return keys_; }

  // --- Leader lease -----------------------------------------------------------------------------
  // SET <p>:leader NX PX lease; on success INCR <p>:fence (kept above `fence_floor`) and store
  // "<replica_id>|<fence>" as the value, all in one script.
  absl::StatusOr<LeaderAcquisition> TryAcquireLeader(absl::string_view replica_id, absl::Duration lease,
                                                     uint64_t fence_floor);
  // Extends the lease to `lease` from now if it is still "<replica_id>|<fence>"; false when it is
  // not (expired, taken over).
  absl::StatusOr<bool> RenewLeader(absl::string_view replica_id, uint64_t fence, absl::Duration lease);
  // Deletes the lease if it is still ours and announces it on <p>:leader:announce; false when it
  // was not ours.
  absl::StatusOr<bool> ReleaseLeader(absl::string_view replica_id, uint64_t fence);
  absl::StatusOr<LeaderInfo> ReadLeader();

  // --- Centroids --------------------------------------------------------------------------------
  // Stores `encoded` as the next generation (above max(<p>:centroids:gen, generation_floor)) and
  // announces it, if `fence` is the current fencing generation. INVALID_ARGUMENT for fence 0.
  absl::StatusOr<PublishResult> PublishCentroids(absl::string_view encoded, uint64_t fence, uint64_t generation_floor,
                                                 absl::string_view replica_id);
  // <p>:centroids:gen (0 when missing).
  absl::StatusOr<uint64_t> CentroidGeneration();
  // The counter and the generation of the stored set, in one round trip (both 0 when missing).
  // They differ only when a replica raised the counter (RaiseGenerationFloor) above a set that
  // Redis lost or never had.
  struct Generations {
    uint64_t counter = 0;
    uint64_t stored = 0;
  };
  absl::StatusOr<Generations> ReadGenerations();
  // Raises <p>:centroids:gen to `floor` if it is below (never lowers it); returns the counter.
  // A replica that serves a newer generation than Redis knows (Redis restarted empty) calls it,
  // so that the leader's next publication goes above what that replica would otherwise refuse.
  absl::StatusOr<uint64_t> RaiseGenerationFloor(uint64_t floor);
  // The stored set; nullopt when none.
  absl::StatusOr<std::optional<StoredCentroids>> FetchCentroids();

  // --- Shared refit window ----------------------------------------------------------------------
  // XADD <p>:window MAXLEN ~ max_entries * r <replica> c <client> e <encoded>, pipelined. An entry
  // that cannot be encoded fails the call before anything is sent (INVALID_ARGUMENT).
  absl::Status AppendWindow(absl::string_view replica_id, absl::Span<const WindowSignature> entries,
                            int64_t max_entries);
  // Up to `max_count` entries after `after_id` ("0-0": from the start), oldest first.
  absl::StatusOr<WindowBatch> ReadWindow(absl::string_view after_id, int64_t max_count);
  absl::StatusOr<int64_t> WindowLength();

  // --- Shared load ------------------------------------------------------------------------------
  // Replaces the replica's load hash (DEL + HSET + PEXPIRE ttl) and refreshes its member of
  // <p>:replicas, removing members older than `stale_after`, in one script. Returns the server's
  // clock at the publication (peers' ages are measured on it, not on clocks of other hosts).
  absl::StatusOr<absl::Time> PublishLoad(absl::string_view replica_id, const ReplicaLoad& load, absl::Duration ttl,
                                         absl::Duration stale_after);
  // Every replica with a live load hash (expired ones are absent), self included.
  absl::StatusOr<std::vector<PeerLoad>> ReadLoads();
  // Deletes the replica's load hash and set member (a clean stop).
  absl::Status DeleteLoad(absl::string_view replica_id);

 private:
  absl::Status Shape(absl::string_view what);  // a kProtocol error, counted

  RedisConnection* const connection_;
  const ClusterKeys keys_;
};

}  // namespace eldr::cluster

#endif  // ELDR_CLUSTER_CLUSTER_STORE_H_
