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
    auto refused = MetricFamily("eldr_refits_refused_total",
                                "Fitted refits the install guard refused (the centroids in service stayed), by reason: "
                                "imbalance (--refit_max_imbalance_increase), locality "
                                "(--refit_max_locality_decrease, --refit_min_experts_gain) or churn "
                                "(--refit_max_churn).",
                                MetricType::Counter);
    AddSample(&refused, static_cast<double>(stats.refits_refused_imbalance), {MetricLabel("reason", "imbalance")});
    AddSample(&refused, static_cast<double>(stats.refits_refused_churn), {MetricLabel("reason", "churn")});
    AddSample(&refused, static_cast<double>(stats.refits_refused_locality), {MetricLabel("reason", "locality")});
    auto weights = MetricFamily("eldr_refit_signature_weights_total",
                                "Signatures that joined the refit window, by where their decode-work weight came from: "
                                "output_tokens (Complete reported them), hold_time (lease hold time times the decode "
                                "rate), default (lease expired or evicted: --refit_default_output_tokens), unleased "
                                "(no lease: the cluster's shared window).",
                                MetricType::Counter);
    AddSample(&weights, static_cast<double>(stats.weights_output_tokens), {MetricLabel("source", "output_tokens")});
    AddSample(&weights, static_cast<double>(stats.weights_hold_time), {MetricLabel("source", "hold_time")});
    AddSample(&weights, static_cast<double>(stats.weights_default), {MetricLabel("source", "default")});
    AddSample(&weights, static_cast<double>(stats.weights_unleased), {MetricLabel("source", "unleased")});
    std::vector<prometheus::MetricFamily> families = {
        std::move(refused),
        std::move(weights),
        SingleSample("eldr_refits_churn_limited_total",
                     "Refits installed with their movement limited (a half, a quarter or an eighth of the fit) so "
                     "that at most --refit_max_churn of the window changes worker.",
                     MetricType::Counter, static_cast<double>(stats.refits_churn_limited)),
        SingleSample("eldr_refit_window_weight",
                     "Summed decode-work weight (output tokens or their estimate) of the refit window's signatures.",
                     MetricType::Gauge, stats.window_weight),
        SingleSample("eldr_refit_pending_signatures",
                     "Signatures admitted to the refit window that wait for their request to complete.",
                     MetricType::Gauge, static_cast<double>(stats.pending_signatures)),
        SingleSample("eldr_refit_pending_bytes", "Bytes the pending signatures hold (at most --refit_pending_bytes).",
                     MetricType::Gauge, static_cast<double>(stats.pending_bytes)),
        SingleSample("eldr_refit_pending_dropped_total",
                     "Pending signatures dropped: the pending bound (--refit_max_pending_signatures, "
                     "--refit_pending_bytes), a transform change, or an unmeasured end with "
                     "--refit_default_output_tokens=0.",
                     MetricType::Counter, static_cast<double>(stats.pending_dropped)),
        SingleSample("eldr_refit_decode_tokens_per_second",
                     "Decode rate per request the hold-time weight uses (measured on leases that reported output "
                     "tokens, else --refit_default_tokens_per_second).",
                     MetricType::Gauge, stats.decode_tokens_per_second),
    };
    if (stats.guarded) {
      auto imbalance =
          MetricFamily("eldr_refit_predicted_imbalance",
                       "Last guarded refit: predicted work imbalance on the window (max over mean of the "
                       "zones' weight per capacity; 1 = balanced) of the set in service and the candidate.",
                       MetricType::Gauge);
      AddSample(&imbalance, stats.current_prediction.imbalance, {MetricLabel("set", "current")});
      AddSample(&imbalance, stats.candidate_prediction.imbalance, {MetricLabel("set", "candidate")});
      auto locality = MetricFamily("eldr_refit_predicted_locality",
                                   "Last guarded refit: predicted locality on the window (weighted mean best cosine "
                                   "similarity) of the set in service and the candidate.",
                                   MetricType::Gauge);
      AddSample(&locality, stats.current_prediction.locality, {MetricLabel("set", "current")});
      AddSample(&locality, stats.candidate_prediction.locality, {MetricLabel("set", "candidate")});
      auto experts = MetricFamily("eldr_refit_predicted_experts",
                                  "Last guarded refit: predicted distinct experts per layer that one decode step "
                                  "loads, averaged over the zones by work, of the set in service and the candidate "
                                  "(the locality bound, --refit_min_experts_gain).",
                                  MetricType::Gauge);
      AddSample(&experts, stats.current_prediction.experts_per_step, {MetricLabel("set", "current")});
      AddSample(&experts, stats.candidate_prediction.experts_per_step, {MetricLabel("set", "candidate")});
      families.push_back(std::move(imbalance));
      families.push_back(std::move(locality));
      families.push_back(std::move(experts));
      families.push_back(SingleSample("eldr_refit_churn_ratio",
                                      "Last guarded refit: fraction of the window's signatures whose nearest worker "
                                      "the candidate changes (bounded by --refit_max_churn except on pool changes).",
                                      MetricType::Gauge, stats.last_churn));
    }
    std::vector<prometheus::MetricFamily> base = {
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
    for (auto& family : families) base.push_back(std::move(family));
    return base;
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
          .With("window_weight", outcome.window_weight)
          .With("imbalance_current", outcome.current.imbalance)
          .With("imbalance_candidate", outcome.candidate.imbalance)
          .With("locality_current", outcome.current.locality)
          .With("locality_candidate", outcome.candidate.locality)
          .With("experts_current", outcome.current.experts_per_step)
          .With("experts_candidate", outcome.candidate.experts_per_step)
          .With("churn", outcome.churn)
          .With("movement_fraction", outcome.movement_fraction)
          .With("note", outcome.reason);
      break;
    case RefitOutcome::Kind::kRefused:
      ELDR_LOG_LIMITED(Info, "refit_refused", "refit_refused")
          .With("refusal", RefitRefusalLabel(outcome.refusal))
          .With("imbalance_current", outcome.current.imbalance)
          .With("imbalance_candidate", outcome.candidate.imbalance)
          .With("locality_current", outcome.current.locality)
          .With("locality_candidate", outcome.candidate.locality)
          .With("experts_current", outcome.current.experts_per_step)
          .With("experts_candidate", outcome.candidate.experts_per_step)
          .With("churn", outcome.churn)
          .With("pool_change", outcome.pool_change)
          .With("reason", outcome.reason);
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
        .With("max_imbalance_increase", options.refit.max_imbalance_increase)
        .With("max_locality_decrease", options.refit.max_locality_decrease)
        .With("min_experts_gain", options.refit.min_experts_gain)
        .With("expert_picks", options.refit.expert_picks)
        .With("max_churn", options.refit.max_churn)
        .With("default_output_tokens", options.refit.default_output_tokens)
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
