#include "server/refit_component.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "eldr/metrics/prometheus.h"
#include "eldr/refit/refit.h"
#include "prometheus/collectable.h"
#include "server/logging.h"

namespace eldr::server {

using metrics::AddSample;
using metrics::MetricFamily;
using metrics::MetricLabel;
using metrics::MetricLabels;
using metrics::SingleSample;
namespace {

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
    auto bounded = MetricFamily("eldr_refit_rows_bounded_total",
                                "Centroid rows a refit moved less than fitted: by the per-refit bound "
                                "(--refit_max_step) or the total-drift bound (--refit_max_drift).",
                                MetricType::Counter);
    AddSample(&bounded, static_cast<double>(stats.rows_step_bounded), {MetricLabel("bound", "step")});
    AddSample(&bounded, static_cast<double>(stats.rows_drift_bounded), {MetricLabel("bound", "drift")});
    return {
        SingleSample("eldr_refits_started_total", "Online refits started.", MetricType::Counter,
                     static_cast<double>(stats.refits_started)),
        SingleSample("eldr_refits_completed_total", "Online refits fitted and installed.", MetricType::Counter,
                     static_cast<double>(stats.refits_completed)),
        SingleSample("eldr_refits_failed_total", "Online refits that failed (fit or install error).",
                     MetricType::Counter, static_cast<double>(stats.refits_failed)),
        SingleSample("eldr_refits_skipped_total", "Online refits skipped (too few window signatures, replaced).",
                     MetricType::Counter, static_cast<double>(stats.refits_skipped)),
        SingleSample("eldr_refit_last_duration_seconds", "Wall time of the last completed refit.", MetricType::Gauge,
                     stats.last_fit_seconds),
        SingleSample("eldr_refit_window_signatures", "Signatures in the refit window now.", MetricType::Gauge,
                     static_cast<double>(stats.window_signatures)),
        SingleSample("eldr_refit_window_bytes",
                     "Bytes of the refit window's storage now (at most --refit_window_bytes).", MetricType::Gauge,
                     static_cast<double>(stats.window_bytes)),
        SingleSample("eldr_refit_window_capacity_signatures",
                     "Signatures the refit window admits per --refit_window now: --refit_max_window_signatures, or "
                     "fewer when --refit_window_bytes holds fewer of the window's mean size.",
                     MetricType::Gauge, static_cast<double>(stats.window_capacity)),
        SingleSample("eldr_refit_window_clients", "Clients with signatures admitted to the refit window lately.",
                     MetricType::Gauge, static_cast<double>(stats.window_clients)),
        SingleSample("eldr_refit_signatures_sampled_out_total",
                     "Routed signatures not admitted to the refit window (its even sample of the window was full).",
                     MetricType::Counter, static_cast<double>(stats.signatures_sampled_out)),
        SingleSample("eldr_refit_signatures_client_limited_total",
                     "Routed signatures not admitted to the refit window because their client had used its share.",
                     MetricType::Counter, static_cast<double>(stats.signatures_client_limited)),
        std::move(bounded),
    };
  }

 private:
  mutable absl::Mutex mu_;
  const OnlineRefitter* refitter_ ABSL_GUARDED_BY(mu_) = nullptr;
};

void LogRefit(const RefitOutcome& outcome) {
  switch (outcome.kind) {
    case RefitOutcome::Kind::kInstalled:
      ELDR_LOG(Info, "refit_installed")
          .With("generation", outcome.generation)
          .With("rows", outcome.rows)
          .With("window_signatures", outcome.window_signatures)
          .With("rows_step_bounded", outcome.rows_step_bounded)
          .With("rows_drift_bounded", outcome.rows_drift_bounded)
          .With("seconds", outcome.seconds)
          .With("pool_change", outcome.pool_change)
          .With("note", outcome.reason);
      break;
    case RefitOutcome::Kind::kFailed:
      ELDR_LOG_LIMITED(Warning, "refit_failed", "refit_failed").With("error", outcome.reason);
      break;
    case RefitOutcome::Kind::kSkipped:
      ELDR_LOG(Debug, "refit_skipped").With("reason", outcome.reason).With("pool_change", outcome.pool_change);
      break;
  }
}

class RefitComponent : public BackgroundComponent {
 public:
  RefitComponent(const ComponentContext& context, std::shared_ptr<RefitGate> gate)
      : context_(context), gate_(std::move(gate)), collector_(std::make_shared<RefitStatsCollector>()) {
    context_.metrics->AddCollectable(collector_);
  }
  ~RefitComponent() override { Stop(); }

  std::string name() const override { return "refit"; }

  absl::Status Start() override {
    const ServerOptions& options = *context_.options;
    RefitOptions refit_options = options.refit;
    refit_options.on_refit = LogRefit;
    if (gate_ != nullptr) {
      refit_options.may_refit = [gate = gate_] { return gate->open.load(std::memory_order_acquire); };
    }
    absl::StatusOr<std::unique_ptr<OnlineRefitter>> refitter =
        OnlineRefitter::Create(std::move(refit_options), context_.router);
    if (!refitter.ok()) return refitter.status();
    refitter_ = *std::move(refitter);
    // After the refitter exists: the configured artifact is its anchor, the state continues it.
    if (!options.refit.state_dir.empty()) InstallPersistedCentroids(options);
    collector_->Attach(refitter_.get());
    if (gate_ != nullptr) {
      gate_->SetObserver([refitter = refitter_.get()](absl::Span<const float> signature, absl::string_view client) {
        refitter->Observe(signature, client);
      });
    }
    refitter_->Start();
    ELDR_LOG(Info, "refit_started")
        .With("window", options.refit.window)
        .With("interval", options.refit.interval)
        .With("window_signatures", options.refit.max_window_signatures)
        .With("window_bytes", options.refit.max_window_bytes)
        .With("max_step", options.refit.max_step_distance)
        .With("max_drift", options.refit.max_drift_distance)
        .With("state_dir", options.refit.state_dir);
    return absl::OkStatus();
  }

  void Stop() override {
    if (refitter_ == nullptr) return;
    if (gate_ != nullptr) gate_->SetObserver(nullptr);
    collector_->Attach(nullptr);
    refitter_->Stop();
    refitter_.reset();  // unsubscribes from the router
  }

 private:
  void InstallPersistedCentroids(const ServerOptions& options) {
    std::vector<std::string> worker_ids;
    for (const WorkerStatus& w : context_.router->GetState(absl::Now()).workers) worker_ids.push_back(w.spec.id);
    auto startup = OnlineRefitter::LoadStartupCentroids(options.refit.state_dir, options.centroids, worker_ids);
    if (!startup.ok()) {
      ELDR_LOG(Warning, "refit_state_not_loaded")
          .With("state_dir", options.refit.state_dir)
          .With("code", startup.status());
      return;
    }
    if (!startup->from_state) {
      if (startup->note.empty()) {
        ELDR_LOG(Info, "refit_state_not_loaded")
            .With("state_dir", options.refit.state_dir)
            .With("note", "no persisted state");
      } else {  // a state exists but is unusable (corrupt, another calibration): worth a warning
        ELDR_LOG(Warning, "refit_state_not_loaded")
            .With("state_dir", options.refit.state_dir)
            .With("note", startup->note);
      }
      return;
    }
    // Logged and counted by the server's observer (source state_dir), like every install.
    (void)context_.router->InstallCentroids(startup->artifact, CentroidSource::kStateDir);
  }

  const ComponentContext context_;
  const std::shared_ptr<RefitGate> gate_;
  const std::shared_ptr<RefitStatsCollector> collector_;
  std::unique_ptr<OnlineRefitter> refitter_;
};

}  // namespace

bool RefitEnabled(const ServerOptions& options) {
  return options.refit.interval > absl::ZeroDuration() || !options.refit.state_dir.empty();
}

ComponentFactory RefitComponentFactory(std::shared_ptr<RefitGate> gate) {
  return [gate](const ComponentContext& context) -> absl::StatusOr<std::unique_ptr<BackgroundComponent>> {
    if (!RefitEnabled(*context.options)) return std::unique_ptr<BackgroundComponent>();
    return std::unique_ptr<BackgroundComponent>(new RefitComponent(context, gate));
  };
}

}  // namespace eldr::server
