// Router replicas that agree, inside the daemon: a BackgroundComponent owning an
// eldr::cluster::ClusterState (include/eldr/cluster/cluster_state.h, docs/cluster.md) when
// --cluster_redis is set. Nothing of it is on a routing path: Redis I/O runs on the ClusterState's
// threads, and a Route only ever reads the peer lease counts the component stored in the Router.
//
// What it wires:
//  - Centroids: a generation the cluster's leader published is installed through the one door,
//    InstallCentroids(artifact, CentroidSource::kCluster), and (with --state_dir) persisted there
//    too, so a restarted follower starts from the cluster's set. The component observes the
//    router: an install from any other source (admin ReloadCentroids, SIGHUP, file watch, refit,
//    discovery) on the leader is published (Publish(CurrentCentroids(), fence)), so every replica
//    installs it. Installs with source kCluster are never published again (no echo). A new leader
//    that finds Redis empty publishes the router's current set (local_centroids).
//    On a follower, a local install (e.g. an admin reload sent to a follower) stays local until the
//    leader publishes the next generation; it is logged (cluster_local_install_on_follower).
//  - Refit, leader-only: the component shares a RefitGate with the refit component and keeps it
//    open only while this replica leads (closed from construction on, so a follower never refits,
//    not even once before the first role change). The refitter asks the gate before each refit and
//    again right before its install (RefitOptions::may_refit) and records a skip otherwise.
//    Chosen over the alternatives because it is the least invasive that never lets a follower
//    serve its own fit: stopping/restarting the refitter's thread on role changes would not cover
//    pool-change refits (they run from the refitter's router observer) and restart its timers;
//    dropping a follower's refit installs after the fact (re-installing the cluster generation)
//    would let it serve its own zones for the length of a round trip, churn generations and
//    confuse the drift anchors. With the gate, the leader's refit is an ordinary kRefit install,
//    which the observer above publishes.
//  - Shared refit window (when refit runs): every replica appends a sample of its routed
//    signatures (at the refit window's admission rate, --refit_max_window_signatures per
//    --refit_window; one atomic load per route otherwise) with AppendSignatures; the leader hands
//    the others' entries (on_window_entries) to its refitter's window through the RefitGate, so it
//    fits on the whole pool's traffic. Entries of another dimension than the transform in service
//    are dropped (they would restart the window). Decode work is not known here (sent as 0); the
//    refitter stamps entries when it receives them.
//  - Shared load: local_leases reports this replica's live leases per worker and how many of them
//    came after its last fresh snapshot (WorkerLoad::leases, leases_since_snapshot; peer leases are
//    never included, so counts cannot echo between replicas). Every load interval (100 ms) a thread
//    of the component hands OthersLeaseCounts() to Router::SetPeerLeases, whose rule avoids double
//    counting: with a fresh snapshot a worker adds the peers' since_snapshot only, without one
//    their live leases. Redis lost for longer than the load TTL: the counts go empty (own leases
//    only). Stop clears them.
//
// Settings: --cluster_redis, --cluster_redis_password_file, --cluster_redis_db, --cluster_name,
// --replica_id (default $POD_NAME, else the host name). Invalid ones fail RouterServer::Create.
//
// Metrics (read from ClusterState::status() at scrape time):
//   eldr_cluster_role{role="leader"|"follower"}           1 for the current role, 0 for the other
//   eldr_cluster_fencing_generation                        the leader's fence, or the highest seen
//   eldr_cluster_centroid_generation{kind="published"|"installed"}  (the difference is the lag)
//   eldr_cluster_redis_errors_total{kind}                  unreachable, timeout, protocol, reply, auth, script
//   eldr_cluster_redis_up                                  1 when the last exchange with Redis succeeded
//   eldr_cluster_peers                                     other replicas with a live load hash
//   eldr_cluster_window_length                             XLEN of the shared window (-1: not read yet)
//   eldr_cluster_publications_total{outcome}               stored, republished, fenced, coalesced, failed
//   eldr_cluster_installs_total{outcome}                   ok, refused, corrupt
//   eldr_cluster_window_signatures_total{outcome}          appended, dropped, delivered
//   eldr_cluster_leader_acquisitions_total, eldr_cluster_redis_reconnects_total
#ifndef ELDR_SERVER_CLUSTER_COMPONENT_H_
#define ELDR_SERVER_CLUSTER_COMPONENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "eldr/cluster/cluster_state.h"
#include "server/config.h"
#include "server/refit_component.h"
#include "server/server.h"

namespace eldr::server {

// The ClusterOptions for `options` (without callbacks): address, password file, database, name and
// replica id, resolved as above. INVALID_ARGUMENT naming the setting.
absl::StatusOr<cluster::ClusterOptions> ClusterOptionsFromSettings(const ServerOptions& options);

// --replica_id, else $POD_NAME, else the host name ("eldr-router" when even that is unknown).
std::string DefaultReplicaId(const ServerOptions& options);

// For ServerExtensions::components: the cluster component, or none when --cluster_redis is empty.
// `refit_gate` (may be null) is the one given to RefitComponentFactory.
ComponentFactory ClusterComponentFactory(std::shared_ptr<RefitGate> refit_gate);

}  // namespace eldr::server

#endif  // ELDR_SERVER_CLUSTER_COMPONENT_H_
