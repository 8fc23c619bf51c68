#include "server/cluster_component.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "eldr/metrics/prometheus.h"
#include "eldr/refit/refit.h"
#include "prometheus/collectable.h"
#include "server/logging.h"

namespace eldr::server {

using cluster::ClusterOptions;
using cluster::ClusterRole;
using cluster::ClusterState;
using cluster::ClusterStatus;
using metrics::AddSample;
using metrics::MetricFamily;
using metrics::MetricLabel;
using metrics::SingleSample;

namespace {

// Exposes ClusterState::status() at scrape time. Detach() before the state is destroyed.
class ClusterStatusCollector : public prometheus::Collectable {
 public:
  void Attach(const ClusterState* state) {
    absl::MutexLock lock(&mu_);
    state_ = state;
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    absl::MutexLock lock(&mu_);
    if (state_ == nullptr) return {};
    const ClusterStatus status = state_->status();
    using prometheus::MetricType;
    auto role =
        MetricFamily("eldr_cluster_role", "This replica's cluster role: 1 for the current one.", MetricType::Gauge);
    const bool leader = status.role == ClusterRole::kLeader;
    AddSample(&role, leader ? 1 : 0, {MetricLabel("role", "leader")});
    AddSample(&role, leader ? 0 : 1, {MetricLabel("role", "follower")});
    auto generation = MetricFamily("eldr_cluster_centroid_generation",
                                   "Cluster centroid generation: the one Redis holds (published) and the one this "
                                   "replica serves (installed).",
                                   MetricType::Gauge);
    AddSample(&generation, static_cast<double>(status.published_generation), {MetricLabel("kind", "published")});
    AddSample(&generation, static_cast<double>(status.installed_generation), {MetricLabel("kind", "installed")});
    auto errors = MetricFamily("eldr_cluster_redis_errors_total", "Failed exchanges with the cluster's Redis, by kind.",
                               MetricType::Counter);
    for (int kind = 0; kind < cluster::kRedisErrorKinds; ++kind) {
      AddSample(
          &errors, static_cast<double>(status.redis_errors[kind]),
          {MetricLabel("kind", std::string(cluster::RedisErrorKindLabel(static_cast<cluster::RedisErrorKind>(kind))))});
    }
    auto publications = MetricFamily(
        "eldr_cluster_publications_total",
        "Centroid publications of this replica as leader, by outcome (stored: new generation; republished: a set "
        "Redis had lost; fenced: refused because a newer leader exists; coalesced: replaced by a newer one before it "
        "was sent; failed: Redis errors, retried).",
        MetricType::Counter);
    const std::pair<const char*, uint64_t> publication_outcomes[] = {{"stored", status.publishes - status.republishes},
                                                                     {"republished", status.republishes},
                                                                     {"fenced", status.publishes_fenced},
                                                                     {"coalesced", status.publishes_coalesced},
                                                                     {"failed", status.publish_failures}};
    for (const auto& outcome : publication_outcomes) {
      AddSample(&publications, static_cast<double>(outcome.second), {MetricLabel("outcome", outcome.first)});
    }
    auto installs = MetricFamily("eldr_cluster_installs_total",
                                 "Published centroid generations this replica fetched, by outcome (ok: in service; "
                                 "refused: the router refused it, retried; corrupt: failed to decode).",
                                 MetricType::Counter);
    AddSample(&installs, static_cast<double>(status.installs), {MetricLabel("outcome", "ok")});
    AddSample(&installs, static_cast<double>(status.install_failures), {MetricLabel("outcome", "refused")});
    AddSample(&installs, static_cast<double>(status.corrupt_sets), {MetricLabel("outcome", "corrupt")});
    auto window = MetricFamily("eldr_cluster_window_signatures_total",
                               "Signatures of the shared refit window: appended by this replica, dropped (queue "
                               "full or Redis errors), delivered to this replica's refitter as leader.",
                               MetricType::Counter);
    AddSample(&window, static_cast<double>(status.window_appended), {MetricLabel("outcome", "appended")});
    AddSample(&window, static_cast<double>(status.window_dropped), {MetricLabel("outcome", "dropped")});
    AddSample(&window, static_cast<double>(status.window_delivered), {MetricLabel("outcome", "delivered")});
    return {
        std::move(role),
        std::move(publications),
        std::move(installs),
        std::move(window),
        SingleSample("eldr_cluster_leader_acquisitions_total", "Times this replica became the cluster's leader.",
                     MetricType::Counter, static_cast<double>(status.leader_acquisitions)),
        SingleSample("eldr_cluster_redis_reconnects_total",
                     "Connections to the cluster's Redis made after each connection's first one.", MetricType::Counter,
                     static_cast<double>(status.reconnects)),
        SingleSample("eldr_cluster_fencing_generation",
                     "The leader's fencing generation (on a follower: the highest one seen).", MetricType::Gauge,
                     static_cast<double>(status.fencing_generation)),
        std::move(generation),
        std::move(errors),
        SingleSample("eldr_cluster_redis_up", "1 when the last exchange with the cluster's Redis succeeded.",
                     MetricType::Gauge, status.redis_ok ? 1 : 0),
        SingleSample("eldr_cluster_peers", "Other router replicas of the cluster with a live load publication.",
                     MetricType::Gauge, static_cast<double>(status.peers.size())),
        SingleSample("eldr_cluster_window_length", "Entries of the shared refit window stream (-1: not read yet).",
                     MetricType::Gauge, static_cast<double>(status.window_length)),
    };
  }

 private:
  mutable absl::Mutex mu_;
  const ClusterState* state_ ABSL_GUARDED_BY(mu_) = nullptr;
};

void LogFromCluster(cluster::ClusterLogSeverity severity, const std::string& message) {
  switch (severity) {
    case cluster::ClusterLogSeverity::kInfo:
      ELDR_LOG(Info, "cluster").With("message", message);
      break;
    case cluster::ClusterLogSeverity::kWarning:
      ELDR_LOG_LIMITED(Warning, "cluster", "cluster/warning").With("message", message);
      break;
    case cluster::ClusterLogSeverity::kError:
      ELDR_LOG_LIMITED(Error, "cluster", "cluster/error").With("message", message);
      break;
  }
}

class ClusterComponent : public BackgroundComponent, public RouterObserver {
 public:
  ClusterComponent(const ComponentContext& context, std::shared_ptr<RefitGate> refit_gate)
      : context_(context), refit_gate_(std::move(refit_gate)), collector_(std::make_shared<ClusterStatusCollector>()) {
    // A follower until the lease says otherwise: no refit before the first role change.
    if (refit_gate_ != nullptr) refit_gate_->open.store(false, std::memory_order_release);
    context_.metrics->AddCollectable(collector_);
  }
  ~ClusterComponent() override { Stop(); }

  absl::Status Init(ClusterOptions options) {
    Router* const router = context_.router;
    const std::string state_dir = context_.options->refit.state_dir;
    options.on_centroids = [router, state_dir](const CentroidArtifact& artifact, uint64_t generation) -> absl::Status {
      absl::StatusOr<uint64_t> installed = router->InstallCentroids(artifact, CentroidSource::kCluster);
      if (!installed.ok()) return installed.status();
      ELDR_LOG(Info, "cluster_centroids_installed")
          .With("cluster_generation", generation)
          .With("router_generation", *installed)
          .With("rows", artifact.k);
      if (!state_dir.empty()) {
        // A restarted follower then starts on the cluster's set (OnlineRefitter::LoadStartupCentroids).
        const absl::Status saved = SaveCentroidArtifact(artifact, OnlineRefitter::StatePath(state_dir));
        if (!saved.ok()) {
          ELDR_LOG_LIMITED(Warning, "cluster_centroids_not_persisted", "cluster_centroids_not_persisted")
              .With("state_dir", state_dir)
              .With("code", saved);
        }
      }
      return absl::OkStatus();
    };
    options.on_role_change = [this](ClusterRole role, uint64_t fence) {
      const bool leader = role == ClusterRole::kLeader;
      if (refit_gate_ != nullptr) refit_gate_->open.store(leader, std::memory_order_release);
      ELDR_LOG(Info, "cluster_role").With("role", cluster::ClusterRoleLabel(role)).With("fencing_generation", fence);
    };
    options.local_leases = [router] {
      const RouterState state = router->GetState(absl::Now());
      std::vector<cluster::WorkerLeases> leases;
      leases.reserve(state.workers.size());
      for (const WorkerStatus& worker : state.workers) {
        cluster::WorkerLeases entry;
        entry.worker_id = worker.spec.id;
        entry.live = worker.load.leases;  // own leases only: peer leases are never re-published
        entry.since_snapshot = worker.load.leases_since_snapshot;
        leases.push_back(std::move(entry));
      }
      return leases;
    };
    options.local_centroids = [router] { return router->CurrentCentroids(); };
    options.log = LogFromCluster;
    load_interval_ = options.load_interval;
    // The shared refit window: only when this replica runs a refitter (every replica of a pool
    // should have the same refit settings). Routed signatures are sampled at the refit window's
    // own admission rate (max_window_signatures per window) divided by the number of replicas
    // (this one and the peers with a live load hash), so the stream carries about what one
    // refitter's window admits, from the whole pool: each replica's Redis traffic shrinks as the
    // pool grows, and the stream (trimmed to max_window_signatures) spans the whole window.
    const RefitOptions& refit = context_.options->refit;
    if (RefitEnabled(*context_.options) && refit_gate_ != nullptr && refit.max_window_signatures > 0) {
      sample_interval_ns_ = absl::ToInt64Nanoseconds(refit.window / refit.max_window_signatures);
      if (sample_interval_ns_ < 1) sample_interval_ns_ = 1;
      options.window_max_entries = refit.max_window_signatures;
      options.on_window_entries = [this](std::vector<cluster::WindowEntry> entries) {
        const int dim = dim_.load(std::memory_order_acquire);
        for (const cluster::WindowEntry& entry : entries) {
          // Another transform's signature (a replica not on our set yet) would restart the window.
          if (static_cast<int>(entry.signature.signature.size()) != dim) continue;
          refit_gate_->Observe(entry.signature.signature, entry.signature.client);
        }
      };
    }
    if (absl::StatusOr<CentroidArtifact> current = router->CurrentCentroids(); current.ok()) {
      dim_.store(current->spec.dim(), std::memory_order_release);
    }
    absl::StatusOr<std::unique_ptr<ClusterState>> state = ClusterState::Create(std::move(options));
    if (!state.ok()) return state.status();
    state_ = *std::move(state);
    return absl::OkStatus();
  }

  std::string name() const override { return "cluster"; }

  absl::Status Start() override {
    context_.router->AddObserver(this);
    observing_ = true;
    if (absl::Status started = state_->Start(); !started.ok()) {
      context_.router->RemoveObserver(this);
      observing_ = false;
      return started;
    }
    collector_->Attach(state_.get());
    peer_thread_ = std::thread([this] { FeedPeerLeases(); });
    const ClusterOptions& options = state_->options();
    ELDR_LOG(Info, "cluster_started")
        .With("redis", options.redis.address)
        .With("cluster_name", options.cluster_name)
        .With("replica_id", options.replica_id)
        .With("leader_lease", options.leader_lease);
    return absl::OkStatus();
  }

  void Stop() override {
    if (state_ == nullptr) return;
    if (observing_) {
      context_.router->RemoveObserver(this);
      observing_ = false;
    }
    {
      absl::MutexLock lock(&stop_mu_);
      stopping_ = true;
    }
    if (peer_thread_.joinable()) peer_thread_.join();
    collector_->Attach(nullptr);
    state_->Stop();  // releases the lease and deletes this replica's load hash
    context_.router->SetPeerLeases({});
    // The gate stays closed: the refit component stops after this one, and a replica shutting
    // down must not fit (and persist) a set of its own meanwhile.
    if (refit_gate_ != nullptr) refit_gate_->open.store(false, std::memory_order_release);
    state_.reset();
  }

  // RouterObserver: a set installed from anything but the cluster is published when we lead.
  void OnCentroidsInstalled(const CentroidInstall& install) override {
    dim_.store(install.dim, std::memory_order_release);
    if (install.source == CentroidSource::kCluster) return;
    ClusterState* const state = state_.get();
    if (state == nullptr) return;
    const ClusterStatus status = state->status();
    if (status.role != ClusterRole::kLeader) {
      ELDR_LOG(Info, "cluster_local_install_on_follower")
          .With("source", CentroidSourceLabel(install.source))
          .With("generation", install.generation)
          .With("note", "served here only, until the leader publishes the next generation");
      return;
    }
    absl::StatusOr<CentroidArtifact> current = context_.router->CurrentCentroids();
    if (!current.ok()) return;
    const absl::Status queued = state->Publish(*current, status.fencing_generation);
    if (!queued.ok()) {
      ELDR_LOG_LIMITED(Warning, "cluster_publish_refused", "cluster_publish_refused")
          .With("source", CentroidSourceLabel(install.source))
          .With("code", queued);
      return;
    }
    ELDR_LOG(Info, "cluster_publish_queued")
        .With("source", CentroidSourceLabel(install.source))
        .With("router_generation", install.generation)
        .With("fencing_generation", status.fencing_generation);
  }

  // RouterObserver, on the routing threads: a sample of the routed signatures goes to the shared
  // window (one atomic load for the others; AppendSignatures is a mutex hold, no Redis I/O).
  void OnSignatureRouted(const RoutedSignature& routed) override {
    if (sample_interval_ns_ == 0) return;
    const int64_t now = absl::ToUnixNanos(routed.at);
    int64_t next = next_sample_ns_.load(std::memory_order_relaxed);
    if (now < next) return;
    const int64_t interval = sample_interval_ns_ * replicas_.load(std::memory_order_relaxed);
    if (!next_sample_ns_.compare_exchange_strong(next, now + interval, std::memory_order_relaxed)) return;
    ClusterState* const state = state_.get();
    if (state == nullptr) return;
    cluster::WindowSignature entry;
    const absl::Span<const float> signature = routed.signature();  // built for the sampled ones only
    entry.signature.assign(signature.begin(), signature.end());
    entry.client = std::string(routed.client);
    state->AppendSignatures(absl::MakeConstSpan(&entry, 1));
  }

 private:
  // Every load interval: the other replicas' lease counts into the router's effective load.
  void FeedPeerLeases() {
    absl::MutexLock lock(&stop_mu_);
    while (!stopping_) {
      stop_mu_.Unlock();
      absl::flat_hash_map<std::string, PeerLeaseCount> peers;
      for (const auto& [worker, count] : state_->OthersLeaseCounts()) {
        peers[worker] = PeerLeaseCount{count.live, count.since_snapshot};
      }
      context_.router->SetPeerLeases(peers);
      replicas_.store(1 + state_->PeerCount(), std::memory_order_relaxed);
      stop_mu_.Lock();
      stop_mu_.AwaitWithTimeout(absl::Condition(&stopping_), load_interval_);
    }
  }

  const ComponentContext context_;
  const std::shared_ptr<RefitGate> refit_gate_;
  const std::shared_ptr<ClusterStatusCollector> collector_;
  std::unique_ptr<ClusterState> state_;
  absl::Duration load_interval_ = absl::Milliseconds(100);
  int64_t sample_interval_ns_ = 0;  // 0: no shared window
  std::atomic<int64_t> next_sample_ns_{0};
  std::atomic<int> replicas_{1};  // this one and the peers seen (the shared window's sampling divisor)
  std::atomic<int> dim_{0};       // the dimension of the transform in service
  bool observing_ = false;
  std::thread peer_thread_;
  absl::Mutex stop_mu_;
  bool stopping_ ABSL_GUARDED_BY(stop_mu_) = false;
};

}  // namespace

std::string DefaultReplicaId(const ServerOptions& options) {
  if (!options.cluster.replica_id.empty()) return options.cluster.replica_id;
  if (const char* pod = std::getenv("POD_NAME"); pod != nullptr && pod[0] != '\0') return pod;
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) == 0 && host[0] != '\0') return host;
  return "eldr-router";
}

absl::StatusOr<ClusterOptions> ClusterOptionsFromSettings(const ServerOptions& options) {
  const ClusterSettings& settings = options.cluster;
  ClusterOptions cluster_options;
  cluster_options.redis.address = settings.redis;
  cluster_options.redis.password_file = settings.redis_password_file;
  cluster_options.redis.db = settings.redis_db;
  cluster_options.cluster_name = settings.cluster_name;
  cluster_options.replica_id = DefaultReplicaId(options);
  cluster_options.leader_lease = settings.leader_lease;
  cluster_options.leader_eligible = settings.leader_eligible;
  cluster_options.load_interval = settings.load_interval;
  cluster_options.centroid_check_interval = settings.centroid_check_interval;
  cluster_options.redis.command_timeout = settings.redis_timeout;
  cluster_options.redis.connect_timeout = settings.redis_timeout;
  if (absl::Status parsed = cluster::ParseRedisAddress(settings.redis).status(); !parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("setting 'cluster_redis': ", parsed.message()));
  }
  if (absl::Status name = cluster::ValidateClusterName(settings.cluster_name); !name.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("setting 'cluster_name': ", name.message()));
  }
  if (absl::Status id = cluster::ValidateReplicaId(cluster_options.replica_id); !id.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("setting 'replica_id' ('", cluster_options.replica_id, "', from ",
                     settings.replica_id.empty() ? "$POD_NAME or the host name" : "the setting", "): ", id.message()));
  }
  if (absl::Status valid = cluster::ValidateClusterOptions(cluster_options); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cluster settings: ", valid.message()));
  }
  return cluster_options;
}

ComponentFactory ClusterComponentFactory(std::shared_ptr<RefitGate> refit_gate) {
  return [refit_gate](const ComponentContext& context) -> absl::StatusOr<std::unique_ptr<BackgroundComponent>> {
    if (context.options->cluster.redis.empty()) return std::unique_ptr<BackgroundComponent>();
    absl::StatusOr<ClusterOptions> options = ClusterOptionsFromSettings(*context.options);
    if (!options.ok()) return options.status();
    auto component = std::make_unique<ClusterComponent>(context, refit_gate);
    if (absl::Status init = component->Init(*std::move(options)); !init.ok()) return init;
    return std::unique_ptr<BackgroundComponent>(std::move(component));
  };
}

}  // namespace eldr::server
