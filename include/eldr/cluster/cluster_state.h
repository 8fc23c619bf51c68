// Router replicas that agree, through Redis (or Valkey): one fenced refit leader, the centroid
// generation every replica installs, a shared refit window and the pool-wide lease counts.
// docs/cluster.md describes the design; cluster_store.h the keys and scripts.
//
// A ClusterState runs two threads of its own, each with its own Redis connection:
//  - "control": every `tick` it renews (leader) or tries to take (follower) the leader lease;
//    runs a queued publication; publishes this replica's leases (from `local_leases`) and reads
//    the others' every `load_interval`; checks the published centroid generation every
//    `centroid_check_interval` (and at once on an announcement) and, when it is newer than the
//    installed one, fetches, verifies and hands it to `on_centroids`; flushes appended window
//    signatures; and, as leader, reads the window the others appended and hands it to
//    `on_window_entries`.
//  - "subscriber": SUBSCRIBE <p>:centroids:announce and <p>:leader:announce; an announcement of a
//    newer generation, or of a released lease, wakes the control thread. The periodic check (and
//    the followers' periodic acquisition attempts) are the fallback when announcements are lost.
//
// Leadership: the lease lasts `leader_lease` and is renewed every `renew_interval`. A follower
// retries when the holder's lease should have run out (and at least every renew_interval), so a
// dead leader is replaced within about one lease (bound: lease + a few ms, under two leases), and
// one that stops cleanly (Stop releases the lease and announces it) within milliseconds. A leader that cannot renew
// steps down by itself when its lease, counted from the moment it sent the last successful renewal, has run out;
// whatever it still tries to publish is refused by the fencing script (counted in publishes_fenced) and makes it step
// down too.
//
// Generations: a replica installs only generations newer than the one it installed, never an
// older one. When Redis comes back empty (restarted without persistence), the leader (old or new)
// publishes its current set again with a generation above every generation it or its peers
// installed (it learns theirs from their load hashes, and a follower that serves a newer
// generation than Redis knows raises the counter itself), so the followers install it and move
// on. A new leader that finds nothing published at all publishes `local_centroids`.
//
// Fail-static: nothing here is on a routing path. Redis unreachable, slow or empty: the replica
// keeps its centroids, its role bookkeeping is the only thing that changes (a leader steps down
// when its lease runs out), errors are counted by kind (status()), and the threads retry with
// backoff. Every public method returns after at most a mutex hold (no Redis I/O on the caller's
// thread), except Start (spawns threads) and Stop (joins them: bounded, see Stop).
//
// Callbacks run on the control thread with no lock of this object held; they may call any method
// of this object except Stop and the destructor. They should be quick (on_centroids installs a
// centroid set: building an index is fine), since the lease is renewed from the same thread.
#ifndef ELDR_CLUSTER_CLUSTER_STATE_H_
#define ELDR_CLUSTER_CLUSTER_STATE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "eldr/cluster/cluster_store.h"
#include "eldr/cluster/codec.h"
#include "eldr/cluster/redis_connection.h"
#include "eldr/core/centroid_artifact.h"

namespace eldr::cluster {

enum class ClusterRole { kFollower, kLeader };
absl::string_view ClusterRoleLabel(ClusterRole role);  // "follower", "leader"

enum class ClusterLogSeverity { kInfo, kWarning, kError };

struct ClusterOptions {
  // The server, credentials, database and timeouts. client_name defaults to
  // "eldr-router:<replica_id>" (when it fits the allowed characters).
  RedisConnectionOptions redis;
  // The key prefix (ValidateClusterName): pools that share one Redis use different names.
  std::string cluster_name = "default";
  // This replica's identity (ValidateReplicaId); required. The daemon uses the pod or host name.
  std::string replica_id;

  // The leader lease, and how often the leader renews it (zero: leader_lease / 3).
  absl::Duration leader_lease = absl::Seconds(3);
  absl::Duration renew_interval = absl::ZeroDuration();
  // false: this replica never leads (follows only).
  bool leader_eligible = true;

  // The periodic check of the published generation (the fallback to announcements).
  absl::Duration centroid_check_interval = absl::Seconds(1);

  // Shared load: this replica's leases are published every load_interval, and the others' read
  // at the same pace. Its hash expires load_ttl after the last publication (so a replica that dies
  // stops counting in the others' load within load_ttl); zero: 10 x load_interval, at least 1 s,
  // so a live replica survives nine lost publications in a row. Members of the replica set older
  // than 10 x load_ttl are removed.
  absl::Duration load_interval = absl::Milliseconds(100);
  absl::Duration load_ttl = absl::ZeroDuration();

  // Shared window: the stream is trimmed to about this many entries (MAXLEN ~); at most
  // max_pending_signatures appended signatures wait for the next flush (more are dropped, counted);
  // the leader reads at most window_read_batch entries per read, four reads per tick.
  int64_t window_max_entries = 4096;
  int max_pending_signatures = 1024;
  int window_read_batch = 512;

  // The control thread's longest sleep between two rounds of work.
  absl::Duration tick = absl::Milliseconds(50);

  // A newer centroid set to install: decoded and validated. Return OK when it is in service; an
  // error is counted (install_failures) and the same generation is retried at the next periodic
  // check (the pool may catch up with the set's workers). Empty: sets are only tracked.
  std::function<absl::Status(const CentroidArtifact& artifact, uint64_t generation)> on_centroids;
  // This replica became leader (with its fencing generation) or follower again.
  std::function<void(ClusterRole role, uint64_t fencing_generation)> on_role_change;
  // This replica's live leases per worker, called every load_interval. Empty: none published.
  std::function<std::vector<WorkerLeases>()> local_leases;
  // Leader only: window entries the other replicas appended (own entries are skipped), in stream
  // order. At leadership start the whole retained stream is delivered. Empty: not read.
  std::function<void(std::vector<WindowEntry> entries)> on_window_entries;
  // The centroids in service, for a new leader that finds nothing published (a fresh Redis): it
  // publishes them as the first generation. Empty: a leader publishes only what Publish gets.
  std::function<absl::StatusOr<CentroidArtifact>()> local_centroids;
  // One line per notable event (role changes, fenced publications, Redis lost and back, corrupt
  // sets, install failures). Empty: none.
  std::function<void(ClusterLogSeverity severity, const std::string& message)> log;
};

// INVALID_ARGUMENT naming the field.
absl::Status ValidateClusterOptions(const ClusterOptions& options);

struct PeerStatus {
  std::string replica_id;
  bool leader = false;
  uint64_t installed_generation = 0;
  absl::Duration age;  // since its last load publication (the server's clock)
  int64_t live_leases = 0;
};

// A snapshot for metrics and health pages. Counters are monotonic while the object lives.
struct ClusterStatus {
  bool started = false;
  bool redis_ok = false;  // the last exchange with Redis succeeded
  ClusterRole role = ClusterRole::kFollower;
  std::string leader_id;  // as last seen; empty: none known
  // Leader: its own fencing generation; follower: the highest value of <p>:fence seen.
  uint64_t fencing_generation = 0;
  // The generation of the set Redis holds (0: none), and the one this replica serves; the
  // difference is the replica's lag.
  uint64_t published_generation = 0;
  uint64_t installed_generation = 0;
  uint64_t leader_acquisitions = 0;  // times this replica became leader
  uint64_t publishes = 0;            // publications stored, re-publications included
  uint64_t republishes = 0;          // of which re-publications of a set Redis had lost
  // Publications refused by the fencing script, or dropped because the replica had stepped down
  // since it queued them.
  uint64_t publishes_fenced = 0;
  uint64_t publishes_coalesced = 0;  // replaced in the queue by a newer Publish
  uint64_t publish_failures = 0;     // Redis errors (retried)
  uint64_t installs = 0;             // sets handed to on_centroids successfully
  uint64_t install_failures = 0;     // sets on_centroids refused (retried at periodic checks)
  uint64_t corrupt_sets = 0;         // fetched sets that failed to decode (never retried)
  uint64_t announcements = 0;        // generation announcements received
  // Failures by RedisErrorKind, both connections; backoff refusals are not counted.
  std::array<int64_t, kRedisErrorKinds> redis_errors{};
  int64_t noscript_fallbacks = 0;
  int64_t reconnects = 0;         // connections made after each connection's first one
  std::vector<PeerStatus> peers;  // the other replicas with a live load hash
  int64_t window_length = -1;     // XLEN of the shared window (-1: not read yet)
  uint64_t window_appended = 0;
  uint64_t window_dropped = 0;    // appended signatures dropped (queue full or Redis errors)
  uint64_t window_delivered = 0;  // leader: entries handed to on_window_entries
  std::string last_error;         // the last Redis error; kept after recovery
  absl::Time last_ok = absl::InfinitePast();
};

class ClusterState {
 public:
  // INVALID_ARGUMENT for bad options. Connects to nothing yet.
  static absl::StatusOr<std::unique_ptr<ClusterState>> Create(ClusterOptions options);
  // Stops (Stop()) first.
  ~ClusterState();
  ClusterState(const ClusterState&) = delete;
  ClusterState& operator=(const ClusterState&) = delete;

  // Starts both threads; returns at once, also when Redis is unreachable (they retry).
  // FAILED_PRECONDITION when already started.
  absl::Status Start();
  // Stops the threads and cleans up: releases the lease when leader and deletes this replica's
  // load hash, so the others stop counting its leases at once. Returns within about
  // 2 x command_timeout + tick, even with Redis hung. Idempotent.
  void Stop();
  // Stops the threads like a crash would: no release, no cleanup (the lease and the load hash run
  // out by themselves). For a process that must exit at once, and for tests.
  void StopWithoutCleanup();

  // Queues `artifact` for publication as the next generation under `fencing_generation` (the one
  // status() reports for this leader). A newer Publish replaces a queued one. The control thread
  // encodes and stores it; the outcome shows in status() (publishes, publishes_fenced, ...).
  // FAILED_PRECONDITION when this replica is not the leader (as it knows) or the fence is not
  // its own; INVALID_ARGUMENT for an invalid artifact.
  absl::Status Publish(const CentroidArtifact& artifact, uint64_t fencing_generation);

  // Queues sampled signatures for the shared window (flushed every load_interval). Signatures
  // beyond max_pending_signatures are dropped (counted). Never fails.
  void AppendSignatures(absl::Span<const WindowSignature> entries);

  // The other replicas' live leases, summed per worker (replicas whose hash expired are absent).
  // When Redis cannot be read for longer than load_ttl, empty: the replica counts its own only.
  std::map<std::string, int64_t> OthersLeases() const;
  // The same, with the leases the others acquired after their last fresh snapshot of each
  // worker (see WorkerLeases::since_snapshot).
  struct LeaseCount {
    int64_t live = 0;
    int64_t since_snapshot = 0;
  };
  std::map<std::string, LeaseCount> OthersLeaseCounts() const;
  // The other replicas' last published loads, and how many they are (without the copy).
  std::vector<PeerLoad> PeerLoads() const;
  int PeerCount() const;

  ClusterRole role() const;
  ClusterStatus status() const;
  const ClusterOptions& options() const;

  // Test hook: while paused the control thread does nothing at all (as if the process were
  // SIGSTOPped: no renewals, no publications); it resumes where it was.
  void PauseForTesting(bool paused);

  class Impl;

 private:
  explicit ClusterState(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace eldr::cluster

#endif  // ELDR_CLUSTER_CLUSTER_STATE_H_
