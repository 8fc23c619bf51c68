#include "server/refit_component.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "eldr/refit/refit.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/logging.h"

namespace eldr::server {
namespace {

constexpr absl::Duration kWatchPeriod = absl::Milliseconds(250);

// Whether signatures made under `a` are comparable with those made under `b` (the refitter's
// window is only meaningful within one transform).
bool SameTransform(const SignatureSpec& a, const SignatureSpec& b) {
  if (a.layers != b.layers || a.experts != b.experts || a.variant != b.variant) return false;
  if (a.EffectiveMask() != b.EffectiveMask() || a.idf.size() != b.idf.size()) return false;
  for (size_t i = 0; i < a.idf.size(); ++i) {
    if (std::abs(a.idf[i] - b.idf[i]) > 1e-6f * std::max(1.0f, std::abs(a.idf[i]))) return false;
  }
  return true;
}

// Exposes the refitter's stats at scrape time. Detach() before the refitter is destroyed; a
// detached collector exports nothing.
class RefitStatsCollector : public prometheus::Collectable {
 public:
  void Attach(const OnlineRefitter* refitter) {
    absl::MutexLock lock(&mu_);
    refitter_ = refitter;
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    absl::MutexLock lock(&mu_);
    if (refitter_ == nullptr) return {};
    const RefitStats stats = refitter_->stats();
    using prometheus::MetricType;
    return {
        Metric("eldr_refits_started_total", "Online refits started.", MetricType::Counter,
               static_cast<double>(stats.refits_started)),
        Metric("eldr_refits_completed_total", "Online refits fitted and installed.", MetricType::Counter,
               static_cast<double>(stats.refits_completed)),
        Metric("eldr_refits_failed_total", "Online refits that failed (fit or install error).",
               MetricType::Counter, static_cast<double>(stats.refits_failed)),
        Metric("eldr_refits_skipped_total", "Online refits skipped (too few window signatures).",
               MetricType::Counter, static_cast<double>(stats.refits_skipped)),
        Metric("eldr_refit_last_duration_seconds", "Wall time of the last completed refit.", MetricType::Gauge,
               stats.last_fit_seconds),
        Metric("eldr_refit_window_signatures", "Signatures in the refit window now.", MetricType::Gauge,
               static_cast<double>(stats.window_signatures)),
        Metric("eldr_refit_signatures_sampled_out_total",
               "Routed signatures not admitted to the refit window (its even sample of the window was full).",
               MetricType::Counter, static_cast<double>(stats.signatures_sampled_out)),
    };
  }

 private:
  static prometheus::MetricFamily Metric(std::string name, std::string help, prometheus::MetricType type,
                                         double value) {
    prometheus::MetricFamily family;
    family.name = std::move(name);
    family.help = std::move(help);
    family.type = type;
    prometheus::ClientMetric metric;
    if (type == prometheus::MetricType::Counter) {
      metric.counter.value = value;
    } else {
      metric.gauge.value = value;
    }
    family.metric.push_back(std::move(metric));
    return family;
  }

  mutable absl::Mutex mu_;
  const OnlineRefitter* refitter_ ABSL_GUARDED_BY(mu_) = nullptr;
};

class RefitComponent : public BackgroundComponent {
 public:
  RefitComponent(const ComponentContext& context, std::shared_ptr<RefitObserverSlot> slot)
      : context_(context), slot_(std::move(slot)), collector_(std::make_shared<RefitStatsCollector>()) {
    context_.metrics->AddCollectable(collector_);
  }
  ~RefitComponent() override { Stop(); }

  std::string name() const override { return "refit"; }

  absl::Status Start() override {
    const ServerOptions& options = *context_.options;
    if (!options.state_dir.empty()) InstallPersistedCentroids(options);

    RefitOptions refit_options;
    refit_options.window = absl::Seconds(options.refit_window_s);
    refit_options.interval = absl::Seconds(options.refit_interval_s);
    refit_options.state_dir = options.state_dir;
    refit_options.seed = options.seed;
    auto refitter = OnlineRefitter::Create(std::move(refit_options), context_.router);
    if (!refitter.ok()) return refitter.status();
    refitter_ = *std::move(refitter);

    const RouterState state = context_.router->GetState(absl::Now());
    for (const WorkerStatus& w : state.workers) {
      if (w.state == WorkerState::kActive) active_.insert(w.spec.id);
    }
    seen_generation_ = state.centroid_generation;
    if (auto current = context_.router->CurrentCentroids(); current.ok()) spec_in_service_ = current->spec;

    slot_->Attach(refitter_.get());
    collector_->Attach(refitter_.get());
    refitter_->Start();
    watcher_ = std::thread([this] { Watch(); });
    ELDR_LOG(Info, "refit_started")
        .With("window_s", options.refit_window_s)
        .With("interval_s", options.refit_interval_s)
        .With("state_dir", options.state_dir);
    return absl::OkStatus();
  }

  void Stop() override {
    if (refitter_ == nullptr) return;
    stop_.Notify();
    if (watcher_.joinable()) watcher_.join();
    slot_->Attach(nullptr);
    collector_->Attach(nullptr);
    refitter_->Stop();
    refitter_.reset();
  }

 private:
  void InstallPersistedCentroids(const ServerOptions& options) {
    std::vector<std::string> worker_ids;
    for (const WorkerStatus& w : context_.router->GetState(absl::Now()).workers) worker_ids.push_back(w.spec.id);
    auto startup = OnlineRefitter::LoadStartupCentroids(options.state_dir, options.centroids, worker_ids);
    if (!startup.ok()) {
      ELDR_LOG(Info, "refit_state_not_loaded").With("state_dir", options.state_dir).With("code", startup.status());
      return;
    }
    if (!startup->from_state) {
      ELDR_LOG(Info, "refit_state_not_loaded")
          .With("state_dir", options.state_dir)
          .With("note", startup->note.empty() ? std::string("no persisted state") : startup->note);
      return;
    }
    auto generation = context_.install_centroids(startup->artifact);
    if (!generation.ok()) {
      ELDR_LOG(Warning, "refit_state_rejected").With("state_dir", options.state_dir).With("code", generation.status());
      return;
    }
    ELDR_LOG(Info, "refit_state_loaded")
        .With("path", OnlineRefitter::StatePath(options.state_dir))
        .With("generation", *generation)
        .With("rows", startup->artifact.k);
  }

  // Reconciles the refitter with pool changes and reloads made through the admin API or SIGHUP.
  void Watch() {
    while (!stop_.WaitForNotificationWithTimeout(kWatchPeriod)) {
      const RouterState state = context_.router->GetState(absl::Now());
      absl::flat_hash_set<std::string> active;
      for (const WorkerStatus& w : state.workers) {
        if (w.state == WorkerState::kActive) active.insert(w.spec.id);
      }
      for (const std::string& id : active) {
        if (active_.contains(id)) continue;
        if (absl::Status s = refitter_->OnWorkerAdded(id); !s.ok()) {
          ELDR_LOG(Warning, "refit_worker_added_failed").With("worker", id).With("code", s);
        } else {
          ELDR_LOG(Info, "refit_worker_added").With("worker", id);
        }
      }
      for (const std::string& id : active_) {
        if (active.contains(id)) continue;
        if (absl::Status s = refitter_->OnWorkerRemoved(id); !s.ok()) {
          ELDR_LOG(Warning, "refit_worker_removed_failed").With("worker", id).With("code", s);
        } else {
          ELDR_LOG(Info, "refit_worker_removed").With("worker", id);
        }
      }
      active_ = std::move(active);

      // A generation newer than both the last one seen and the refitter's own last install came
      // from a reload; when it changed the transform, the window's signatures are not comparable
      // with the new centroids any more.
      const uint64_t generation = context_.router->GetState(absl::Now()).centroid_generation;
      if (generation > seen_generation_ && generation > refitter_->stats().centroid_generation) {
        auto current = context_.router->CurrentCentroids();
        if (current.ok()) {
          if (spec_in_service_.has_value() && !SameTransform(*spec_in_service_, current->spec)) {
            refitter_->ResetWindow();
            ELDR_LOG(Info, "refit_window_reset").With("generation", generation);
          }
          spec_in_service_ = current->spec;
        }
      }
      seen_generation_ = generation;
    }
  }

  const ComponentContext context_;
  const std::shared_ptr<RefitObserverSlot> slot_;
  const std::shared_ptr<RefitStatsCollector> collector_;
  std::unique_ptr<OnlineRefitter> refitter_;
  std::thread watcher_;
  absl::Notification stop_;
  // Touched only by Start (before the watcher runs) and the watcher thread.
  absl::flat_hash_set<std::string> active_;
  uint64_t seen_generation_ = 0;
  std::optional<SignatureSpec> spec_in_service_;  // transform of the centroids last seen
};

}  // namespace

bool RefitEnabled(const ServerOptions& options) {
  return options.refit_interval_s > 0 || !options.state_dir.empty();
}

void AddRefitComponent(const ServerOptions& options, ServerExtensions* extensions) {
  if (!RefitEnabled(options)) return;
  auto slot = std::make_shared<RefitObserverSlot>();
  extensions->on_signature = slot->Callback();
  extensions->components.push_back(
      [slot](const ComponentContext& context) -> absl::StatusOr<std::unique_ptr<BackgroundComponent>> {
        return std::make_unique<RefitComponent>(context, slot);
      });
}

}  // namespace eldr::server
