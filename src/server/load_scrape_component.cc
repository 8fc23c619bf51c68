#include "server/load_scrape_component.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "eldr/metrics/prometheus.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/logging.h"

namespace eldr::server {

using metrics::AddSample;
using metrics::MetricFamily;
using metrics::MetricLabel;
using metrics::MetricLabels;
using metrics::SingleSample;
namespace {

absl::Status BadSetting(absl::string_view key, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("setting '", key, "': ", why));
}

// Per-worker scrape figures, read from the scraper at every /metrics request.
class ScrapeCollector : public prometheus::Collectable {
 public:
  explicit ScrapeCollector(std::shared_ptr<const LoadScraper> scraper) : scraper_(std::move(scraper)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    auto scrapes = MetricFamily("eldr_scrapes_total", "Successful scrapes of a decode worker's metrics endpoint.",
                                MetricType::Counter);
    auto errors = MetricFamily("eldr_scrape_errors_total",
                               "Failed scrapes by kind: transport (refused, timeout, ...), http (status other than "
                               "200), malformed (unparsable page or missing load gauges).",
                               MetricType::Counter);
    auto rejected =
        MetricFamily("eldr_scrape_rejected_reports_total",
                     "Scraped load snapshots the router refused (e.g. worker not in the pool).", MetricType::Counter);
    auto transitions =
        MetricFamily("eldr_scrape_unhealthy_transitions_total",
                     "Times a worker was marked unhealthy after consecutive failed scrapes.", MetricType::Counter);
    auto healthy = MetricFamily("eldr_scrape_healthy", "0 while failed scrapes hold the worker unhealthy, else 1.",
                                MetricType::Gauge);
    auto age =
        MetricFamily("eldr_scrape_last_success_age_seconds",
                     "Seconds since the last successful scrape started; -1 before the first.", MetricType::Gauge);
    auto duration =
        MetricFamily("eldr_scrape_duration_seconds", "Duration of the last completed scrape.", MetricType::Gauge);
    const absl::Time now = absl::Now();
    for (const WorkerScrapeStats& stats : scraper_->Stats()) {
      const std::string& worker = stats.worker_id;
      AddSample(&scrapes, static_cast<double>(stats.successes),
                {MetricLabel("worker", worker), MetricLabel("outcome", "ok")});
      AddSample(&errors, static_cast<double>(stats.transport_errors),
                {MetricLabel("worker", worker), MetricLabel("kind", "transport")});
      AddSample(&errors, static_cast<double>(stats.http_errors),
                {MetricLabel("worker", worker), MetricLabel("kind", "http")});
      AddSample(&errors, static_cast<double>(stats.malformed_pages),
                {MetricLabel("worker", worker), MetricLabel("kind", "malformed")});
      AddSample(&rejected, static_cast<double>(stats.rejected_reports), {MetricLabel("worker", worker)});
      AddSample(&transitions, static_cast<double>(stats.unhealthy_transitions), {MetricLabel("worker", worker)});
      AddSample(&healthy, stats.healthy ? 1 : 0, {MetricLabel("worker", worker)});
      AddSample(&age, stats.last_success.has_value() ? absl::ToDoubleSeconds(now - *stats.last_success) : -1,
                {MetricLabel("worker", worker)});
      AddSample(&duration, absl::ToDoubleSeconds(stats.last_duration), {MetricLabel("worker", worker)});
    }
    return {std::move(scrapes), std::move(errors), std::move(rejected), std::move(transitions),
            std::move(healthy), std::move(age),    std::move(duration)};
  }

 private:
  std::shared_ptr<const LoadScraper> scraper_;
};

// Follows the pool through the router's announcements (no polling): a worker added to or removed
// from the pool is added to or removed from the scraped targets when it has a configured URL.
class LoadScrapeComponent final : public BackgroundComponent, public RouterObserver {
 public:
  // `pool_urls`: also scrape every pool worker's own metrics_url (discovered pools).
  LoadScrapeComponent(Router* router, ServerMetrics* metrics, LoadScraperOptions options,
                      std::vector<ScrapeTarget> configured, bool pool_urls)
      : router_(router),
        metrics_(metrics),
        options_(std::move(options)),
        configured_(std::move(configured)),
        pool_urls_(pool_urls) {}
  ~LoadScrapeComponent() override { Stop(); }

  std::string name() const override { return "load_scraper"; }

  absl::Status Start() override {
    if (configured_.empty() && !pool_urls_) return absl::OkStatus();
    options_.on_health_change = [](const std::string& worker, bool healthy, const std::string& reason) {
      if (healthy) {
        ELDR_LOG(Info, "worker_healthy").With("worker", worker);
      } else {
        ELDR_LOG(Warning, "worker_unhealthy").With("worker", worker).With("error", reason);
      }
    };
    absl::StatusOr<std::unique_ptr<LoadScraper>> scraper = LoadScraper::Create(router_, options_, PoolTargets());
    if (!scraper.ok()) return scraper.status();
    scraper_ = std::shared_ptr<LoadScraper>(std::move(*scraper));
    metrics_->AddCollectable(std::make_shared<ScrapeCollector>(scraper_));
    absl::Status started = scraper_->Start();
    if (!started.ok()) return started;
    router_->AddObserver(this);
    subscribed_ = true;
    ELDR_LOG(Info, "load_scraper_started")
        .With("targets", static_cast<int64_t>(configured_.size()))
        .With("pool_urls", pool_urls_)
        .With("interval", options_.interval)
        .With("timeout", options_.timeout)
        .With("unhealthy_after_failures", static_cast<int64_t>(options_.unhealthy_after_failures));
    return absl::OkStatus();
  }

  void Stop() override {
    if (subscribed_) {
      router_->RemoveObserver(this);
      subscribed_ = false;
    }
    // Also hands back the health of every worker the scraper held unhealthy.
    if (scraper_ != nullptr) scraper_->Stop();
  }

  void OnPoolChanged(const PoolChange& change) override {
    // Health changes are the scraper's own doing (it calls the router with its lock held).
    // A discovered worker's URL can change with its pod (kUpdated).
    const bool url_may_change = pool_urls_ && change.kind == PoolChangeKind::kUpdated;
    if (change.kind != PoolChangeKind::kAdded && change.kind != PoolChangeKind::kRemoved && !url_may_change) return;
    absl::Status updated = scraper_->SetTargets(PoolTargets());
    if (!updated.ok()) ELDR_LOG(Error, "load_scraper_targets").With("code", updated);
  }

 private:
  // The configured targets whose worker is in the Router's pool now.
  std::vector<ScrapeTarget> PoolTargets() const {
    const std::vector<WorkerStatus> workers = router_->GetState(absl::Now()).workers;
    absl::flat_hash_set<std::string> pool;
    for (const WorkerStatus& worker : workers) pool.insert(worker.spec.id);
    std::vector<ScrapeTarget> targets;
    for (const ScrapeTarget& target : configured_) {
      if (pool.contains(target.worker_id)) targets.push_back(target);
    }
    if (pool_urls_) {
      // Discovered workers bring their URL (WorkerSpec::metrics_url, from the pod); one the scraper
      // cannot use is left out (and said so) rather than failing the whole list.
      for (const WorkerStatus& worker : workers) {
        if (worker.spec.metrics_url.empty()) continue;
        ScrapeTarget target{worker.spec.id, worker.spec.metrics_url};
        if (absl::Status valid = ValidateScrapeTargets({target}); !valid.ok()) {
          ELDR_LOG_LIMITED(Warning, "load_scraper_target_refused", "load_scraper_target_refused")
              .With("worker", target.worker_id)
              .With("code", valid);
          continue;
        }
        targets.push_back(std::move(target));
      }
    }
    return targets;
  }

  Router* const router_;
  ServerMetrics* const metrics_;
  LoadScraperOptions options_;
  const std::vector<ScrapeTarget> configured_;
  const bool pool_urls_;
  std::shared_ptr<LoadScraper> scraper_;
  bool subscribed_ = false;
};

}  // namespace

absl::StatusOr<std::vector<ScrapeTarget>> ScrapeTargetsFromOptions(const ServerOptions& options) {
  absl::flat_hash_map<std::string, std::string> url_of;
  for (const WorkerSpec& worker : options.workers) {
    if (!worker.metrics_url.empty()) url_of[worker.id] = worker.metrics_url;
  }
  absl::StatusOr<std::vector<ScrapeTarget>> overrides = ParseScrapeTargets(options.worker_metrics);
  if (!overrides.ok()) return BadSetting("worker_metrics", overrides.status().message());
  for (const ScrapeTarget& target : *overrides) {
    const bool known = std::any_of(options.workers.begin(), options.workers.end(),
                                   [&](const WorkerSpec& w) { return w.id == target.worker_id; });
    if (!known) {
      return BadSetting("worker_metrics", absl::StrCat("'", target.worker_id, "' is not one of the workers"));
    }
    url_of[target.worker_id] = target.url;
  }
  std::vector<ScrapeTarget> targets;
  for (const WorkerSpec& worker : options.workers) {
    auto it = url_of.find(worker.id);
    if (it != url_of.end()) targets.push_back({worker.id, it->second});
  }
  absl::Status valid = ValidateScrapeTargets(targets);
  if (!valid.ok()) return BadSetting("worker_metrics", valid.message());
  return targets;
}

ComponentFactory LoadScrapeComponentFactory() {
  return [](const ComponentContext& context) -> absl::StatusOr<std::unique_ptr<BackgroundComponent>> {
    absl::StatusOr<std::vector<ScrapeTarget>> targets = ScrapeTargetsFromOptions(*context.options);
    if (!targets.ok()) return targets.status();
    // ValidateServerOptions checked the ranges; this is the scraper's own word on the result.
    if (absl::Status valid = ValidateLoadScraperOptions(context.options->scrape); !valid.ok()) {
      return BadSetting("scrape_*", valid.message());
    }
    return std::unique_ptr<BackgroundComponent>(
        new LoadScrapeComponent(context.router, context.metrics, context.options->scrape, *std::move(targets),
                                /*pool_urls=*/context.options->discovery.mode == DiscoveryMode::kKubernetes));
  };
}

}  // namespace eldr::server
