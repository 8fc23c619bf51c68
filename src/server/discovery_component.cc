#include "server/discovery_component.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "eldr/core/signature.h"
#include "server/centroid_loader.h"
#include "server/logging.h"
#include "server/refit_component.h"

namespace eldr::server {
namespace {

// Applies the discovery's pool changes to the Router. A worker that is already gone (removed by an
// earlier change) is not an error: the pool is where the discovery wants it.
class RouterPoolSink final : public discovery::PoolSink {
 public:
  explicit RouterPoolSink(Router* router) : router_(router) {}

  absl::Status Upsert(const WorkerSpec& spec) override { return router_->UpsertWorker(spec).status(); }
  absl::Status Drain(const std::string& id) override { return IgnoreGone(router_->DrainWorker(id).status()); }
  absl::Status Remove(const std::string& id) override { return IgnoreGone(router_->RemoveWorker(id).status()); }

 private:
  static absl::Status IgnoreGone(absl::Status status) { return absl::IsNotFound(status) ? absl::OkStatus() : status; }

  Router* const router_;
};

void LogDiscoveryLine(discovery::LogSeverity severity, const std::string& message) {
  switch (severity) {
    case discovery::LogSeverity::kInfo:
      ELDR_LOG(Info, "discovery").With("role", "decode").With("message", message);
      return;
    case discovery::LogSeverity::kWarning:
      ELDR_LOG_LIMITED(Warning, "discovery_warning", "discovery").With("role", "decode").With("message", message);
      return;
    case discovery::LogSeverity::kError:
      ELDR_LOG_LIMITED(Error, "discovery_error", "discovery").With("role", "decode").With("message", message);
      return;
  }
}

// The component: the discovery, its sink, and a thread that fits the centroids to the pool after
// pool changes (never on the observer's calling thread: an install from inside an announcement
// would wait for the announcement to end).
class DiscoveryComponent final : public BackgroundComponent, public RouterObserver {
 public:
  DiscoveryComponent(const ComponentContext& context, discovery::KubernetesDiscoveryOptions options)
      : router_(context.router),
        metrics_(context.metrics),
        loader_(context.loader),
        centroids_path_(context.options->centroids),
        max_artifact_bytes_(static_cast<size_t>(context.options->max_artifact_bytes)),
        refit_enabled_(RefitEnabled(*context.options)),
        options_(std::move(options)),
        sink_(context.router) {}
  ~DiscoveryComponent() override { Stop(); }

  std::string name() const override { return "discovery"; }

  absl::Status Start() override {
    ELDR_ASSIGN_OR_RETURN(discovery_, discovery::KubernetesDiscovery::Create(options_, &sink_, &metrics_->registry()));
    router_->AddObserver(this);
    subscribed_ = true;
    fitter_ = std::thread([this] { FitLoop(); });
    const absl::Status started = discovery_->Start();
    if (!started.ok()) {
      Stop();
      return started;
    }
    ELDR_LOG(Info, "discovery_started")
        .With("role", "decode")
        .With("server", options_.api.server)
        .With("namespace", options_.namespace_)
        .With("selector", options_.label_selector)
        .With("port", options_.mapping.port)
        .With("settle", options_.reconciler.settle);
    return absl::OkStatus();
  }

  void Stop() override {
    // The discovery first: no pool change is applied after this.
    if (discovery_ != nullptr) discovery_->Stop();
    if (subscribed_) {
      router_->RemoveObserver(this);
      subscribed_ = false;
    }
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (fitter_.joinable()) fitter_.join();
  }

  void OnPoolChanged(const PoolChange& change) override {
    if (change.kind == PoolChangeKind::kUpdated && change.state == WorkerState::kActive) {
      // Only joins, drains and leaves move rows; an address or capacity update does not.
      return;
    }
    absl::MutexLock lock(&mu_);
    pool_changed_ = true;
  }

 private:
  void FitLoop() {
    while (true) {
      bool changed = false;
      {
        absl::MutexLock lock(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(
                                 +[](DiscoveryComponent* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
                                   return self->stopping_ || self->pool_changed_;
                                 },
                                 this),
                             absl::Milliseconds(100));
        if (stopping_) return;
        changed = pool_changed_;
        pool_changed_ = false;
      }
      if (changed || initial_deferred_) FitCentroids();
    }
  }

  // Whether the first install should wait: the pods of the first list join one at a time, and
  // rows handed out before the last one joined would leave it without a row (with refit on, until
  // refit places it from traffic). So it waits until every ready pod discovered is active in the
  // pool, or kInitialWait after the first one joined (a pod the router refuses must not hold the
  // centroids back for ever).
  bool DeferInitialInstall(size_t active) {
    static constexpr absl::Duration kInitialWait = absl::Seconds(5);
    const absl::Time now = absl::Now();
    if (first_active_at_ == absl::InfiniteFuture()) first_active_at_ = now;
    const discovery::DiscoveryStatus status = discovery_->Status();
    const int64_t ready = status.workers[static_cast<size_t>(discovery::DiscoveredWorker::State::kReady)];
    const bool complete = status.synced && static_cast<int64_t>(active) >= ready;
    initial_deferred_ = !complete && now - first_active_at_ < kInitialWait;
    return initial_deferred_;
  }

  // After a pool change: the first centroids once a worker is active; later (without refit) rows
  // for the workers that joined, from the rows that are free.
  void FitCentroids() {
    if (centroids_path_.empty()) return;
    const RouterState state = router_->GetState(absl::Now());
    std::vector<std::string> active;
    std::vector<std::string> all;
    for (const WorkerStatus& worker : state.workers) {
      all.push_back(worker.spec.id);
      if (worker.state == WorkerState::kActive) active.push_back(worker.spec.id);
    }
    if (active.empty()) return;
    absl::StatusOr<CentroidArtifact> current = router_->CurrentCentroids();
    if (!current.ok()) {
      if (DeferInitialInstall(active.size())) return;
      // The configured file, fitted to the pool by the loader (fit_rows_to_pool). Logged and
      // counted by the server's observer like every install; a failure is retried at the next
      // pool change.
      loader_->ReloadConfigured(CentroidSource::kStartup);
      return;
    }
    if (refit_enabled_) return;  // refit's elastic pool places joining and leaving workers
    absl::StatusOr<CentroidArtifact> configured = LoadCentroidArtifact(centroids_path_, max_artifact_bytes_);
    if (!configured.ok()) {
      ELDR_LOG_LIMITED(Warning, "discovery_centroids_unreadable", "discovery_centroids")
          .With("path", centroids_path_)
          .With("code", configured.status());
      return;
    }
    std::optional<CentroidArtifact> fitted = RefitRowsToPool(*current, *configured, all, active);
    if (!fitted.has_value()) return;
    absl::StatusOr<uint64_t> installed = router_->InstallCentroids(*fitted, CentroidSource::kDiscovery);
    (void)installed;  // logged and counted by the server's observer, either way
  }

  Router* const router_;
  ServerMetrics* const metrics_;
  CentroidLoader* const loader_;
  const std::string centroids_path_;
  const size_t max_artifact_bytes_;
  const bool refit_enabled_;
  const discovery::KubernetesDiscoveryOptions options_;
  RouterPoolSink sink_;
  std::unique_ptr<discovery::KubernetesDiscovery> discovery_;
  bool subscribed_ = false;
  std::thread fitter_;
  // The fitter thread's own (see DeferInitialInstall).
  bool initial_deferred_ = false;
  absl::Time first_active_at_ = absl::InfiniteFuture();

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool pool_changed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

absl::StatusOr<discovery::KubernetesDiscoveryOptions> KubernetesDiscoveryOptionsFrom(const ServerOptions& options) {
  const DiscoverySettings& settings = options.discovery;
  discovery::KubernetesDiscoveryOptions out;
  absl::StatusOr<discovery::KubeApiConfig> api =
      discovery::ResolveKubeApiConfig(settings.kubeconfig, settings.kube_context);
  if (!api.ok()) {
    return absl::Status(api.status().code(), absl::StrCat("discovery=kubernetes: ", api.status().message()));
  }
  out.api = *std::move(api);
  out.namespace_ = settings.kube_namespace;
  if (out.namespace_.empty()) out.namespace_ = out.api.namespace_.empty() ? "default" : out.api.namespace_;
  out.label_selector = std::string(absl::StripAsciiWhitespace(settings.decode_selector));
  out.mapping.port = settings.worker_port;
  out.mapping.metrics_port = settings.worker_metrics_port.empty() ? settings.worker_port : settings.worker_metrics_port;
  out.mapping.metrics_path = settings.worker_metrics_path;
  out.reconciler.settle = settings.settle;
  out.role = "decode";
  out.log = LogDiscoveryLine;
  return out;
}

std::optional<CentroidArtifact> RefitRowsToPool(const CentroidArtifact& current, const CentroidArtifact& configured,
                                                const std::vector<std::string>& pool,
                                                const std::vector<std::string>& takers) {
  if (!SameTransform(current.spec, configured.spec) || current.dim() != configured.dim()) return std::nullopt;
  const absl::flat_hash_set<std::string> in_pool(pool.begin(), pool.end());
  const size_t dim = static_cast<size_t>(current.dim());
  CentroidArtifact fitted = current;
  fitted.workers.clear();
  fitted.centroids.clear();
  absl::flat_hash_set<std::string> with_row;
  bool changed = false;
  for (int row = 0; row < current.k; ++row) {
    const std::string& owner = row < static_cast<int>(current.workers.size()) ? current.workers[row] : "";
    if (owner.empty() || !in_pool.contains(owner)) {
      changed = true;  // its worker left: the row is free again
      continue;
    }
    with_row.insert(owner);
    fitted.workers.push_back(owner);
    fitted.centroids.insert(fitted.centroids.end(), current.centroids.begin() + row * dim,
                            current.centroids.begin() + (row + 1) * dim);
  }
  // A configured row is free when no kept row holds the same centroid.
  auto held = [&fitted, dim](absl::Span<const float> row) {
    for (size_t kept = 0; kept < fitted.workers.size(); ++kept) {
      if (std::equal(row.begin(), row.end(), fitted.centroids.begin() + kept * dim)) return true;
    }
    return false;
  };
  std::vector<int> free_rows;
  for (int row = 0; row < configured.k; ++row) {
    if (!held(configured.row(row))) free_rows.push_back(row);
  }
  // A taker first gets the free row the configured artifact names after it (a StatefulSet pod
  // back under its name), then the others take the remaining free rows in order.
  std::vector<bool> taken(free_rows.size(), false);
  auto give = [&](const std::string& worker, size_t free_index) {
    taken[free_index] = true;
    with_row.insert(worker);
    const absl::Span<const float> row = configured.row(free_rows[free_index]);
    fitted.workers.push_back(worker);
    fitted.centroids.insert(fitted.centroids.end(), row.begin(), row.end());
    changed = true;
  };
  for (const std::string& worker : takers) {
    if (with_row.contains(worker)) continue;
    for (size_t i = 0; i < free_rows.size(); ++i) {
      const int row = free_rows[i];
      if (!taken[i] && row < static_cast<int>(configured.workers.size()) && configured.workers[row] == worker) {
        give(worker, i);
        break;
      }
    }
  }
  size_t next_free = 0;
  for (const std::string& worker : takers) {
    if (with_row.contains(worker)) continue;
    while (next_free < free_rows.size() && taken[next_free]) ++next_free;
    if (next_free == free_rows.size()) break;
    give(worker, next_free);
  }
  if (!changed || fitted.workers.empty()) return std::nullopt;
  fitted.k = static_cast<int>(fitted.workers.size());
  return fitted;
}

ComponentFactory DiscoveryComponentFactory() {
  return [](const ComponentContext& context) -> absl::StatusOr<std::unique_ptr<BackgroundComponent>> {
    if (context.options->discovery.mode != DiscoveryMode::kKubernetes) return nullptr;
    ELDR_ASSIGN_OR_RETURN(discovery::KubernetesDiscoveryOptions options,
                          KubernetesDiscoveryOptionsFrom(*context.options));
    return std::unique_ptr<BackgroundComponent>(new DiscoveryComponent(context, std::move(options)));
  };
}

}  // namespace eldr::server
