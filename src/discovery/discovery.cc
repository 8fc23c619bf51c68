#include "eldr/discovery/discovery.h"

#include <algorithm>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace eldr::discovery {
namespace {

// errors_total kinds beyond the watcher's own (WatchErrorKind).
constexpr int kAnnotationErrorIndex = kNumWatchErrorKinds;
constexpr int kSinkErrorIndex = kNumWatchErrorKinds + 1;
constexpr int kNumErrorKinds = kNumWatchErrorKinds + 2;
// The reconciler thread wakes at least this often (sync-age gauge, lost wakeups).
constexpr absl::Duration kMaxReconcilerSleep = absl::Seconds(1);

struct Metrics {
  std::array<prometheus::Gauge*, 3> workers{};
  std::array<prometheus::Counter*, kNumWatchRestartReasons> restarts{};
  std::array<prometheus::Counter*, kNumErrorKinds> errors{};
  std::array<prometheus::Counter*, kNumPoolActions> changes{};
  prometheus::Gauge* sync_age = nullptr;
  prometheus::Gauge* synced = nullptr;
};

std::unique_ptr<Metrics> BuildMetrics(prometheus::Registry* registry, const std::string& role) {
  if (registry == nullptr) return nullptr;
  auto metrics = std::make_unique<Metrics>();
  auto& workers = prometheus::BuildGauge()
                      .Name("eldr_discovery_workers")
                      .Help("Workers discovered from Kubernetes pods (the desired pool), by state.")
                      .Register(*registry);
  for (DiscoveredWorker::State state :
       {DiscoveredWorker::State::kReady, DiscoveredWorker::State::kNotReady, DiscoveredWorker::State::kTerminating}) {
    metrics->workers[static_cast<int>(state)] =
        &workers.Add({{"role", role}, {"state", std::string(WorkerStateLabel(state))}});
  }
  auto& restarts = prometheus::BuildCounter()
                       .Name("eldr_discovery_watch_restarts_total")
                       .Help(
                           "Pod watches restarted, by reason: closed (ended by the server), gone (resourceVersion "
                           "too old: relist), error (connection or HTTP error), silence (nothing received for "
                           "the silence timeout), parse (an invalid event).")
                       .Register(*registry);
  for (int i = 0; i < kNumWatchRestartReasons; ++i) {
    metrics->restarts[i] =
        &restarts.Add({{"role", role}, {"reason", std::string(WatchRestartReasonLabel(WatchRestartReason(i)))}});
  }
  auto& errors = prometheus::BuildCounter()
                     .Name("eldr_discovery_errors_total")
                     .Help(
                         "Discovery errors, by kind: unreachable (API server transport), http (an HTTP error "
                         "status), auth (401/403 or an unreadable token), parse (an invalid list or event), "
                         "annotation (an eldr.io/ annotation ignored, or a running pod whose port does not resolve), "
                         "sink (a pool change that failed).")
                     .Register(*registry);
  for (int i = 0; i < kNumWatchErrorKinds; ++i) {
    metrics->errors[i] = &errors.Add({{"role", role}, {"kind", std::string(WatchErrorKindLabel(WatchErrorKind(i)))}});
  }
  metrics->errors[kAnnotationErrorIndex] = &errors.Add({{"role", role}, {"kind", "annotation"}});
  metrics->errors[kSinkErrorIndex] = &errors.Add({{"role", role}, {"kind", "sink"}});
  auto& changes = prometheus::BuildCounter()
                      .Name("eldr_discovery_pool_changes_total")
                      .Help("Pool changes applied from discovery, by action (upsert, drain, remove).")
                      .Register(*registry);
  for (int i = 0; i < kNumPoolActions; ++i) {
    metrics->changes[i] = &changes.Add({{"role", role}, {"action", std::string(PoolActionLabel(PoolAction(i)))}});
  }
  metrics->sync_age = &prometheus::BuildGauge()
                           .Name("eldr_discovery_last_sync_age_seconds")
                           .Help(
                               "Seconds since the pod view was last confirmed by the API server (a list, an event "
                               "or a bookmark); since the start before the first.")
                           .Register(*registry)
                           .Add({{"role", role}});
  metrics->synced = &prometheus::BuildGauge()
                         .Name("eldr_discovery_synced")
                         .Help("1 while the pod view is in sync with the API server (listed, and watching).")
                         .Register(*registry)
                         .Add({{"role", role}});
  return metrics;
}

class KubernetesDiscoveryImpl final : public KubernetesDiscovery, public PodWatcherObserver {
 public:
  KubernetesDiscoveryImpl(KubernetesDiscoveryOptions options, PoolSink* sink, std::unique_ptr<KubeClient> client,
                          std::unique_ptr<Metrics> metrics)
      : options_(std::move(options)), sink_(sink), client_(std::move(client)), metrics_(std::move(metrics)) {}

  ~KubernetesDiscoveryImpl() override { Stop(); }

  // Second stage of Create: the parts that point back at this object.
  absl::Status Init() {
    ReconcilerOptions reconciler = options_.reconciler;
    reconciler.on_change = [this, user = options_.reconciler.on_change](PoolAction action, const std::string& id,
                                                                        const absl::Status& result) {
      OnPoolChange(action, id, result);
      if (user) user(action, id, result);
    };
    reconciler_ = std::make_unique<PoolReconciler>(sink_, std::move(reconciler));
    absl::StatusOr<std::unique_ptr<PodWatcher>> watcher = PodWatcher::Create(client_.get(), options_.watcher, this);
    if (!watcher.ok()) return watcher.status();
    watcher_ = std::move(*watcher);
    return absl::OkStatus();
  }

  absl::Status Start() override {
    absl::MutexLock control(&control_mu_);
    if (reconciler_thread_.joinable()) return absl::FailedPreconditionError("discovery is already started");
    {
      absl::MutexLock lock(&mu_);
      stopping_ = false;
      started_at_ = absl::Now();
      started_ = true;
    }
    reconciler_thread_ = std::thread([this] { ReconcileLoop(); });
    absl::Status started = watcher_->Start();
    if (!started.ok()) {
      StopReconcilerLocked();
      return started;
    }
    Log(LogSeverity::kInfo,
        absl::StrCat("watching pods in namespace ", options_.watcher.namespace_, " with selector \"",
                     options_.watcher.label_selector, "\" on ", options_.api.server));
    return absl::OkStatus();
  }

  void Stop() override {
    absl::MutexLock control(&control_mu_);
    if (!reconciler_thread_.joinable()) return;
    watcher_->Stop();
    StopReconcilerLocked();
  }

  DiscoveryStatus Status() const override {
    DiscoveryStatus status;
    status.watcher = watcher_->stats();
    status.synced = status.watcher.synced;
    status.last_sync = status.watcher.last_sync;
    status.resource_version = status.watcher.resource_version;
    absl::MutexLock lock(&mu_);
    status.started = started_;
    status.workers = workers_;
    status.pods = pods_;
    status.applied = applied_;
    status.reconciler = reconciler_stats_;
    status.pending = reconciler_stats_.pending;
    // The watcher's own record is updated before its observer hears of the error.
    status.last_error = last_error_.empty() ? status.watcher.last_error : last_error_;
    return status;
  }

  // PodWatcherObserver, on the watcher thread.
  void OnSnapshot(const PodSnapshot& snapshot) override {
    std::vector<DiscoveredWorker> desired;
    desired.reserve(snapshot.pods.size());
    std::array<int64_t, 3> counts{};
    std::map<std::string, std::vector<std::string>> problems;  // pod name -> its problems
    for (const PodInfo& pod : snapshot.pods) {
      absl::StatusOr<DiscoveredWorker> worker = WorkerFromPod(pod, options_.mapping);
      if (!worker.ok()) {
        // Pending pods and pods without an IP are routine; a running pod that is no worker is a
        // configuration problem worth a line.
        if (!pod.ip.empty() && (pod.phase == "Running" || pod.phase == "Unknown")) {
          problems[pod.name].push_back(std::string(worker.status().message()));
        }
        continue;
      }
      ++counts[static_cast<int>(worker->state)];
      if (!worker->annotation_problems.empty()) problems[pod.name] = std::move(worker->annotation_problems);
      desired.push_back(std::move(*worker));
    }
    // Each problem is counted and logged when it appears, not again at every event.
    std::vector<std::string> fresh;
    for (const auto& [name, list] : problems) {
      auto it = reported_problems_.find(name);
      for (const std::string& problem : list) {
        if (it != reported_problems_.end() &&
            std::find(it->second.begin(), it->second.end(), problem) != it->second.end()) {
          continue;
        }
        fresh.push_back(absl::StrCat("pod ", name, ": ", problem));
      }
    }
    reported_problems_ = std::move(problems);
    for (const std::string& line : fresh) Log(LogSeverity::kWarning, line);
    const int64_t fresh_annotation = static_cast<int64_t>(fresh.size());
    if (metrics_ != nullptr) {
      for (int i = 0; i < 3; ++i) metrics_->workers[i]->Set(static_cast<double>(counts[i]));
      if (fresh_annotation > 0)
        metrics_->errors[kAnnotationErrorIndex]->Increment(static_cast<double>(fresh_annotation));
    }
    if (snapshot.from_list) {
      Log(LogSeverity::kInfo,
          absl::StrCat("listed ", snapshot.pods.size(), " pods at resourceVersion ", snapshot.resource_version, ": ",
                       counts[0], " ready, ", counts[1], " not ready, ", counts[2], " terminating"));
    }
    UpdateSyncGauges();
    absl::MutexLock lock(&mu_);
    workers_ = counts;
    pods_ = snapshot.pods.size();
    pending_desired_ = std::move(desired);
  }

  void OnWatchRestart(WatchRestartReason reason, const absl::Status& cause) override {
    if (metrics_ != nullptr) metrics_->restarts[static_cast<int>(reason)]->Increment();
    UpdateSyncGauges();
    const LogSeverity severity = reason == WatchRestartReason::kClosed || reason == WatchRestartReason::kGone
                                     ? LogSeverity::kInfo
                                     : LogSeverity::kWarning;
    // Errors and parse failures were logged by OnError already.
    const bool with_cause = reason == WatchRestartReason::kGone || reason == WatchRestartReason::kSilence;
    Log(severity, absl::StrCat("pod watch restarted (", WatchRestartReasonLabel(reason), ")",
                               with_cause && !cause.ok() ? absl::StrCat(": ", cause.message()) : ""));
    if (reason == WatchRestartReason::kSilence) SetLastError(std::string(cause.message()));
  }

  void OnError(WatchErrorKind kind, const absl::Status& status) override {
    SetLastError(std::string(status.message()));
    if (metrics_ != nullptr) metrics_->errors[static_cast<int>(kind)]->Increment();
    UpdateSyncGauges();
    Log(LogSeverity::kError,
        absl::StrCat("Kubernetes API error (", WatchErrorKindLabel(kind), "): ", status.message()));
  }

 private:
  void Log(LogSeverity severity, const std::string& message) const {
    if (options_.log) options_.log(severity, absl::StrCat("discovery[", options_.role, "]: ", message));
  }

  // On the reconciler thread.
  void OnPoolChange(PoolAction action, const std::string& id, const absl::Status& result) {
    if (result.ok()) {
      if (metrics_ != nullptr) metrics_->changes[static_cast<int>(action)]->Increment();
      Log(LogSeverity::kInfo, absl::StrCat("pool ", PoolActionLabel(action), " ", id));
      return;
    }
    const std::string message =
        absl::StrCat("pool ", PoolActionLabel(action), " ", id, " failed (retried): ", result.message());
    SetLastError(message);
    if (metrics_ != nullptr) metrics_->errors[kSinkErrorIndex]->Increment();
    Log(LogSeverity::kWarning, message);
  }

  void SetLastError(std::string message) {
    absl::MutexLock lock(&mu_);
    last_error_ = std::move(message);
  }

  void StopReconcilerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(control_mu_) {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (reconciler_thread_.joinable()) reconciler_thread_.join();
    absl::MutexLock lock(&mu_);
    started_ = false;
  }

  // The synced and sync-age gauges from the watcher's figures: at every watcher event, and at
  // least every second from the reconciler thread.
  void UpdateSyncGauges() {
    if (metrics_ == nullptr) return;
    const PodWatcherStats watcher = watcher_->stats();
    absl::Time started_at;
    {
      absl::MutexLock lock(&mu_);
      started_at = started_at_;
    }
    metrics_->synced->Set(watcher.synced ? 1 : 0);
    metrics_->sync_age->Set(std::max(0.0, absl::ToDoubleSeconds(absl::Now() - watcher.last_sync.value_or(started_at))));
  }

  bool HasWork() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || pending_desired_.has_value(); }

  void ReconcileLoop() {
    absl::Time next_deadline = absl::InfiniteFuture();
    while (true) {
      std::optional<std::vector<DiscoveredWorker>> desired;
      {
        absl::MutexLock lock(&mu_);
        const absl::Time wake = std::min(next_deadline, absl::Now() + kMaxReconcilerSleep);
        mu_.AwaitWithDeadline(absl::Condition(this, &KubernetesDiscoveryImpl::HasWork), wake);
        if (stopping_) return;
        desired = std::move(pending_desired_);
        pending_desired_.reset();
      }
      const absl::Time now = absl::Now();
      if (desired.has_value()) {
        reconciler_->Update(*desired, now);
      } else if (now >= next_deadline) {
        reconciler_->Tick(now);
      }
      next_deadline = reconciler_->NextDeadline();
      const ReconcilerStats stats = reconciler_->stats();
      UpdateSyncGauges();
      absl::MutexLock lock(&mu_);
      reconciler_stats_ = stats;
      applied_ = reconciler_->applied().size();
    }
  }

  const KubernetesDiscoveryOptions options_;
  PoolSink* const sink_;
  const std::unique_ptr<KubeClient> client_;
  const std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<PoolReconciler> reconciler_;  // the reconciler thread's
  std::unique_ptr<PodWatcher> watcher_;
  std::map<std::string, std::vector<std::string>> reported_problems_;  // the watcher thread's

  absl::Mutex control_mu_;
  std::thread reconciler_thread_ ABSL_GUARDED_BY(control_mu_);

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time started_at_ ABSL_GUARDED_BY(mu_);
  std::optional<std::vector<DiscoveredWorker>> pending_desired_ ABSL_GUARDED_BY(mu_);
  std::array<int64_t, 3> workers_ ABSL_GUARDED_BY(mu_){};
  size_t pods_ ABSL_GUARDED_BY(mu_) = 0;
  size_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  ReconcilerStats reconciler_stats_ ABSL_GUARDED_BY(mu_);
  std::string last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::string_view LogSeverityName(LogSeverity severity) {
  switch (severity) {
    case LogSeverity::kInfo:
      return "info";
    case LogSeverity::kWarning:
      return "warning";
    case LogSeverity::kError:
      return "error";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<KubernetesDiscovery>> KubernetesDiscovery::Create(KubernetesDiscoveryOptions options,
                                                                                 PoolSink* sink,
                                                                                 prometheus::Registry* registry) {
  if (sink == nullptr) return absl::InvalidArgumentError("discovery needs a pool sink");
  if (options.role.empty()) return absl::InvalidArgumentError("discovery needs a role (its metrics label)");
  absl::Status valid = ValidateKubeApiConfig(options.api);
  if (!valid.ok()) return valid;
  valid = ValidateMappingOptions(options.mapping);
  if (!valid.ok()) return valid;
  if (!options.namespace_.empty()) options.watcher.namespace_ = options.namespace_;
  if (options.watcher.namespace_.empty()) options.watcher.namespace_ = options.api.namespace_;
  if (options.watcher.namespace_.empty()) {
    return absl::InvalidArgumentError("discovery needs a namespace (none given, and the API config names none)");
  }
  if (!options.label_selector.empty()) options.watcher.label_selector = options.label_selector;
  if (options.watcher.label_selector.empty()) {
    return absl::InvalidArgumentError("discovery needs a label selector naming the worker pods");
  }
  valid = ValidatePodWatcherOptions(options.watcher);
  if (!valid.ok()) return valid;
  if (options.reconciler.retry_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("reconciler retry_interval must be > 0");
  }
  if (options.reconciler.settle < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("reconciler settle must be >= 0");
  }
  absl::StatusOr<std::unique_ptr<KubeClient>> client = KubeClient::Create(options.api, options.client);
  if (!client.ok()) return client.status();
  std::unique_ptr<Metrics> metrics = BuildMetrics(registry, options.role);
  auto discovery =
      std::make_unique<KubernetesDiscoveryImpl>(std::move(options), sink, std::move(*client), std::move(metrics));
  valid = discovery->Init();
  if (!valid.ok()) return valid;
  return std::unique_ptr<KubernetesDiscovery>(std::move(discovery));
}

}  // namespace eldr::discovery
