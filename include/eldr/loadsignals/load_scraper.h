// Scrapes decode workers' Prometheus endpoints (vLLM, SGLang) and feeds their load to a Router.
//
// Every target (worker id + metrics URL) is scraped on its own cadence by one background thread
// that drives all transfers concurrently (libcurl multi interface, one reused easy handle and
// keep-alive connection per worker), so a slow or dead worker never delays the others. Each
// successful scrape becomes a LoadSnapshot passed to Router::ReportLoad, stamped with the time the
// request was sent: the worker measured its load at some point during the transfer, and stamping
// the earliest possible moment means a request routed during the scrape is counted as "since the
// snapshot" (possibly twice, never zero times), so a worker is never made to look idler than it is.
//
// Health: a scrape fails on a transport error (refused, reset, timeout), an HTTP status other than
// 200, or a page that is malformed or lacks the engine's load gauges; failures are counted per
// worker and kind. After `unhealthy_after_failures` consecutive failures the worker is marked
// unhealthy (Router::SetWorkerHealthy(id, false): no new routes; the router fails open when every
// worker is unhealthy) and the first successful scrape marks it healthy again. The scraper only
// holds a worker unhealthy while it scrapes it: removing a target, or Stop(), restores the health
// of the workers it had marked. Stale snapshots need nothing from the scraper: the router ignores
// snapshots older than its staleness limit and uses its own lease count.
//
// Thread-safety: every method may be called from any thread. Router calls are made with the
// scraper's lock held, which orders them against target removal (a removed target's last
// in-flight scrape can never mark it unhealthy again); the Router must not call back into the
// scraper.
#ifndef ELDR_LOADSIGNALS_LOAD_SCRAPER_H_
#define ELDR_LOADSIGNALS_LOAD_SCRAPER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "eldr/core/router.h"
#include "eldr/loadsignals/prom_text.h"

namespace eldr {

struct ScrapeTarget {
  std::string worker_id;  // the Router's worker id (non-empty)
  std::string url;        // http:// or https:// URL of its Prometheus text page, e.g. http://10.0.0.7:8000/metrics
};

struct LoadScraperOptions {
  // Time between the starts of two scrapes of one worker. A scrape that takes longer delays the
  // next one of the same worker (never two at once per worker), not those of other workers.
  absl::Duration interval = absl::Milliseconds(100);
  // Whole-transfer limit (connect + response). A timeout is a failed scrape.
  absl::Duration timeout = absl::Seconds(1);
  // Consecutive failed scrapes after which the worker is marked unhealthy; 0 never marks it.
  int unhealthy_after_failures = 3;
  // Which engine's gauges to read and which model's series to sum (see prom_text.h).
  EngineLoadOptions engine;
  // A page larger than this fails the scrape (a malformed page).
  size_t max_page_bytes = 8 << 20;
  // Sent as the User-Agent header.
  std::string user_agent = "eldr-router";
  // Called when the scraper marks a worker unhealthy (with the last failure's message) or healthy
  // again (with an empty message), on the scraper's thread with no scraper lock held; not for the
  // restorations done by RemoveTarget, SetTargets and Stop. May be empty.
  std::function<void(const std::string& worker_id, bool healthy, const std::string& reason)> on_health_change;
};

// Checks the options: interval and timeout > 0, unhealthy_after_failures >= 0, max_page_bytes > 0.
absl::Status ValidateLoadScraperOptions(const LoadScraperOptions& options);
// Checks a target list: non-empty distinct worker ids, http(s) URLs.
absl::Status ValidateScrapeTargets(const std::vector<ScrapeTarget>& targets);

// Parses "id=url,id=url,..." (the --worker_metrics flag syntax). Empty text: no targets.
absl::StatusOr<std::vector<ScrapeTarget>> ParseScrapeTargets(absl::string_view text);

// Per-worker scrape figures. Counters only grow while the target exists.
struct WorkerScrapeStats {
  std::string worker_id;
  std::string url;
  int64_t successes = 0;
  int64_t transport_errors = 0;  // refused, reset, timed out, DNS, TLS
  int64_t http_errors = 0;       // a status other than 200
  int64_t malformed_pages = 0;   // unparsable text, missing gauges, bad values, page too large
  int64_t rejected_reports = 0;  // the Router refused the snapshot (e.g. worker not in its pool)
  int consecutive_failures = 0;
  bool healthy = true;                // false while this scraper holds the worker unhealthy
  int64_t unhealthy_transitions = 0;  // times it was marked unhealthy
  std::optional<absl::Time> last_success;
  std::optional<EngineLoad> last_load;  // the last successfully scraped load
  std::string last_error;               // the last failure's message; empty after a success
  absl::Duration last_duration;         // of the last completed scrape

  int64_t errors() const { return transport_errors + http_errors + malformed_pages; }
};

class LoadScraper {
 public:
  // `router` must outlive the scraper. INVALID_ARGUMENT for bad options or targets.
  static absl::StatusOr<std::unique_ptr<LoadScraper>> Create(Router* router, LoadScraperOptions options,
                                                             std::vector<ScrapeTarget> targets);
  // Stops (see Stop) first.
  virtual ~LoadScraper() = default;

  // Starts the background thread; the first scrape of every target begins at once.
  // FAILED_PRECONDITION when already started.
  virtual absl::Status Start() = 0;
  // Stops the thread (in-flight transfers are abandoned), and marks healthy again every worker
  // this scraper had marked unhealthy. Idempotent; the scraper may be started again afterwards.
  virtual void Stop() = 0;

  // Replaces the whole target list. Targets whose worker id stays keep their figures (a changed
  // URL takes effect from the next scrape); removed ones are forgotten after their health is
  // restored. INVALID_ARGUMENT (and nothing changes) for an invalid list.
  virtual absl::Status SetTargets(std::vector<ScrapeTarget> targets) = 0;
  // Adds a target or changes the URL of an existing one.
  virtual absl::Status UpsertTarget(ScrapeTarget target) = 0;
  // Forgets a target, restoring its health. NOT_FOUND when there is no such target.
  virtual absl::Status RemoveTarget(const std::string& worker_id) = 0;

  // One round, synchronously on the calling thread: every target scraped once (concurrently),
  // results applied exactly as the background thread would. Returns when all finished.
  // FAILED_PRECONDITION while the background thread runs. For tools and tests.
  virtual absl::Status ScrapeOnce() = 0;

  // Figures of every target, in worker id order.
  virtual std::vector<WorkerScrapeStats> Stats() const = 0;
  virtual const LoadScraperOptions& options() const = 0;
};

}  // namespace eldr

#endif  // ELDR_LOADSIGNALS_LOAD_SCRAPER_H_
