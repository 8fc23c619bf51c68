#include "eldr/loadsignals/load_scraper.h"

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "eldr/core/router.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "loadsignals/fake_metrics_server.h"

namespace eldr {
namespace {

using testing::FakeLoad;
using testing::FakeMetricsServer;
using ::testing::HasSubstr;

// Polls `done` every few milliseconds for up to `limit`.
bool WaitUntil(const std::function<bool()>& done, absl::Duration limit = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return done();
}

// A pool of fake workers, each with its own metrics endpoint, and a Router over them.
class ScrapedPool {
 public:
  explicit ScrapedPool(int workers, PolicyKind policy = PolicyKind::kJsq, absl::Duration staleness = absl::Seconds(5)) {
    std::vector<WorkerSpec> specs;
    for (int i = 0; i < workers; ++i) {
      auto server = FakeMetricsServer::Start("test-model");
      EXPECT_TRUE(server.ok()) << server.status();
      servers_.push_back(std::move(*server));
      specs.push_back({absl::StrCat("w", i), absl::StrCat("10.0.0.", i, ":8000")});
    }
    RouterOptions options;
    options.policy = policy;
    options.load.snapshot_staleness = staleness;
    auto router = Router::Create(options, specs);
    EXPECT_TRUE(router.ok()) << router.status();
    router_ = std::move(*router);
  }

  std::vector<ScrapeTarget> Targets() const {
    std::vector<ScrapeTarget> targets;
    for (size_t i = 0; i < servers_.size(); ++i) targets.push_back({absl::StrCat("w", i), servers_[i]->url()});
    return targets;
  }

  std::unique_ptr<LoadScraper> MakeScraper(LoadScraperOptions options = {}) {
    options.engine.model_name = "test-model";
    auto scraper = LoadScraper::Create(router_.get(), options, Targets());
    EXPECT_TRUE(scraper.ok()) << scraper.status();
    return scraper.ok() ? std::move(*scraper) : nullptr;
  }

  FakeMetricsServer& server(int i) { return *servers_[i]; }
  Router& router() { return *router_; }

  WorkerStatus Status(const std::string& id) {
    for (const WorkerStatus& status : router_->GetState(absl::Now()).workers) {
      if (status.spec.id == id) return status;
    }
    ADD_FAILURE() << "no worker " << id;
    return {};
  }

  // Routes `n` requests without a signature and completes each at once: the choice then depends
  // on the reported loads only. Returns how often each worker was chosen.
  std::map<std::string, int> RouteAndComplete(int n, const SignatureInput* signature = nullptr) {
    std::map<std::string, int> chosen;
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<RouteResult> result = router_->Route(signature);
      EXPECT_TRUE(result.ok()) << result.status();
      if (!result.ok()) continue;
      ++chosen[result->worker_id];
      EXPECT_TRUE(router_->Complete(result->lease_id).ok());
    }
    return chosen;
  }

 private:
  std::vector<std::unique_ptr<FakeMetricsServer>> servers_;
  std::unique_ptr<Router> router_;
};

WorkerScrapeStats StatsOf(const LoadScraper& scraper, const std::string& id) {
  for (const WorkerScrapeStats& stats : scraper.Stats()) {
    if (stats.worker_id == id) return stats;
  }
  ADD_FAILURE() << "no scrape stats for " << id;
  return {};
}

TEST(LoadScraperTest, ScrapedLoadsDriveJsqChoices) {
  ScrapedPool pool(3);
  pool.server(0).SetLoad({8, 4, 0.6});
  pool.server(1).SetLoad({1, 0, 0.1});
  pool.server(2).SetLoad({5, 0, 0.3}, /*engines=*/2);
  auto scraper = pool.MakeScraper();
  const absl::Time before = absl::Now();
  ASSERT_TRUE(scraper->ScrapeOnce().ok());

  const WorkerStatus w0 = pool.Status("w0");
  ASSERT_TRUE(w0.load.snapshot.has_value());
  EXPECT_DOUBLE_EQ(w0.load.snapshot->running, 8);
  EXPECT_DOUBLE_EQ(w0.load.snapshot->waiting, 4);
  EXPECT_DOUBLE_EQ(w0.load.snapshot->kv_usage, 0.6);
  // Stamped with the time the request went out, not when the answer came back.
  EXPECT_GE(w0.load.snapshot->taken_at, before);
  EXPECT_LE(w0.load.snapshot->taken_at, absl::Now());
  EXPECT_DOUBLE_EQ(pool.Status("w2").load.snapshot->running, 5);  // two engines summed

  // w1 is by far the least loaded: every request goes there.
  EXPECT_EQ(pool.RouteAndComplete(10), (std::map<std::string, int>{{"w1", 10}}));

  pool.server(1).SetLoad({30, 10, 0.9});
  pool.server(2).SetLoad({0, 0, 0});
  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  EXPECT_EQ(pool.RouteAndComplete(10), (std::map<std::string, int>{{"w2", 10}}));

  const WorkerScrapeStats stats = StatsOf(*scraper, "w1");
  EXPECT_EQ(stats.successes, 2);
  EXPECT_EQ(stats.errors(), 0);
  ASSERT_TRUE(stats.last_load.has_value());
  EXPECT_DOUBLE_EQ(stats.last_load->running, 30);
  EXPECT_TRUE(stats.last_success.has_value());
}

TEST(LoadScraperTest, ScrapedLoadsPickTheLeastLoadedWorkerOfTheLocalityBand) {
  ScrapedPool pool(3, PolicyKind::kEldr);
  // w0 and w1 have nearly the same centroid (both in the band of a request along e0); w2 points
  // elsewhere and must never be picked for such a request, however idle it is.
  CentroidArtifact artifact;
  artifact.spec.layers = 1;
  artifact.spec.experts = 4;
  artifact.spec.variant = SignatureVariant::kCount;
  artifact.k = 3;
  const float c = 0.995f, s = std::sqrt(1.0f - 0.995f * 0.995f);
  artifact.centroids = {1, 0, 0, 0, c, s, 0, 0, 0, 0, 1, 0};
  artifact.workers = {"w0", "w1", "w2"};
  ASSERT_TRUE(pool.router().InstallCentroids(artifact).ok());
  const std::vector<int32_t> counts = {12, 0, 0, 0};
  const SignatureInput signature = CountsInt32{1, 4, counts};

  pool.server(0).SetLoad({6, 2, 0.5});
  pool.server(1).SetLoad({1, 0, 0.1});
  pool.server(2).SetLoad({0, 0, 0});
  auto scraper = pool.MakeScraper();
  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  EXPECT_EQ(pool.RouteAndComplete(8, &signature), (std::map<std::string, int>{{"w1", 8}}));

  pool.server(0).SetLoad({0, 0, 0});
  pool.server(1).SetLoad({9, 3, 0.7});
  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  EXPECT_EQ(pool.RouteAndComplete(8, &signature), (std::map<std::string, int>{{"w0", 8}}));
}

TEST(LoadScraperTest, DeadWorkerIsTakenOutAndBroughtBack) {
  ScrapedPool pool(2);
  pool.server(0).SetLoad({0, 0, 0});
  pool.server(1).SetLoad({20, 0, 0.5});
  LoadScraperOptions options;
  options.interval = absl::Milliseconds(20);
  options.timeout = absl::Milliseconds(300);
  options.unhealthy_after_failures = 3;
  absl::Mutex events_mu;
  std::vector<std::string> events;
  options.on_health_change = [&](const std::string& worker, bool healthy, const std::string& reason) {
    absl::MutexLock lock(&events_mu);
    events.push_back(absl::StrCat(worker, healthy ? " healthy" : " unhealthy", reason.empty() ? "" : ": error"));
  };
  auto scraper = pool.MakeScraper(options);
  ASSERT_TRUE(scraper->Start().ok());
  ASSERT_TRUE(
      WaitUntil([&] { return StatsOf(*scraper, "w1").successes >= 1 && StatsOf(*scraper, "w0").successes >= 1; }));
  EXPECT_EQ(pool.RouteAndComplete(5), (std::map<std::string, int>{{"w0", 5}}));

  ASSERT_TRUE(pool.server(0).SetMode(FakeMetricsServer::Mode::kDown).ok());
  ASSERT_TRUE(WaitUntil([&] { return !pool.Status("w0").healthy; }));
  const WorkerScrapeStats down = StatsOf(*scraper, "w0");
  EXPECT_FALSE(down.healthy);
  EXPECT_GE(down.consecutive_failures, 3);
  EXPECT_GE(down.transport_errors, 3);
  EXPECT_EQ(down.unhealthy_transitions, 1);
  EXPECT_FALSE(down.last_error.empty());
  // The idle-looking but dead worker gets nothing; the loaded healthy one gets everything.
  EXPECT_EQ(pool.RouteAndComplete(5), (std::map<std::string, int>{{"w1", 5}}));

  ASSERT_TRUE(pool.server(0).SetMode(FakeMetricsServer::Mode::kServe).ok());
  ASSERT_TRUE(WaitUntil([&] { return pool.Status("w0").healthy; }));
  EXPECT_TRUE(StatsOf(*scraper, "w0").healthy);
  EXPECT_EQ(StatsOf(*scraper, "w0").consecutive_failures, 0);
  EXPECT_TRUE(StatsOf(*scraper, "w0").last_error.empty());
  EXPECT_EQ(pool.RouteAndComplete(5), (std::map<std::string, int>{{"w0", 5}}));
  scraper->Stop();
  absl::MutexLock lock(&events_mu);
  EXPECT_EQ(events, (std::vector<std::string>{"w0 unhealthy: error", "w0 healthy"}));
}

TEST(LoadScraperTest, ScrapesEveryWorkerAtTheConfiguredInterval) {
  ScrapedPool pool(2);
  LoadScraperOptions options;
  options.interval = absl::Milliseconds(40);
  auto scraper = pool.MakeScraper(options);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(scraper->Start().ok());
  absl::SleepFor(absl::Milliseconds(800));
  const std::vector<WorkerScrapeStats> stats = scraper->Stats();
  const double elapsed_intervals = (absl::Now() - start) / options.interval;
  scraper->Stop();
  for (const WorkerScrapeStats& worker : stats) {
    // Never faster than the interval allows; not much slower either (a loaded machine may delay
    // some wakeups, hence the slack; a scraper that sleeps on a stale wait does a third of them).
    EXPECT_LE(worker.successes, elapsed_intervals + 1) << worker.worker_id;
    EXPECT_GE(worker.successes, elapsed_intervals * 0.5) << worker.worker_id;
  }
}

TEST(LoadScraperTest, HangingWorkerTimesOutAndOthersKeepTheirCadence) {
  ScrapedPool pool(2);
  LoadScraperOptions options;
  options.interval = absl::Milliseconds(20);
  options.timeout = absl::Milliseconds(150);
  options.unhealthy_after_failures = 2;
  auto scraper = pool.MakeScraper(options);
  ASSERT_TRUE(pool.server(0).SetMode(FakeMetricsServer::Mode::kHang).ok());
  ASSERT_TRUE(scraper->Start().ok());
  ASSERT_TRUE(WaitUntil([&] { return !pool.Status("w0").healthy; }));
  const WorkerScrapeStats hung = StatsOf(*scraper, "w0");
  EXPECT_GE(hung.transport_errors, 2);
  EXPECT_THAT(hung.last_error, HasSubstr("imed out"));
  // At least two 150 ms timeouts passed; at a 20 ms interval the healthy worker was scraped ~15
  // times meanwhile. Were it held up by the hanging one, it would have had about 2.
  EXPECT_GE(StatsOf(*scraper, "w1").successes, 6);
  EXPECT_TRUE(pool.Status("w1").healthy);
  ASSERT_TRUE(pool.server(0).SetMode(FakeMetricsServer::Mode::kServe).ok());
  ASSERT_TRUE(WaitUntil([&] { return pool.Status("w0").healthy; }));
  scraper->Stop();
}

TEST(LoadScraperTest, MalformedPagesAndHttpErrorsAreCountedPerWorker) {
  ScrapedPool pool(3);
  LoadScraperOptions options;
  options.unhealthy_after_failures = 2;
  auto scraper = pool.MakeScraper(options);
  ASSERT_TRUE(pool.server(0).SetMode(FakeMetricsServer::Mode::kMalformed).ok());
  ASSERT_TRUE(pool.server(1).SetMode(FakeMetricsServer::Mode::kHttpError).ok());
  ASSERT_TRUE(scraper->ScrapeOnce().ok());

  WorkerScrapeStats malformed = StatsOf(*scraper, "w0");
  EXPECT_EQ(malformed.malformed_pages, 1);
  EXPECT_EQ(malformed.http_errors + malformed.transport_errors + malformed.successes, 0);
  EXPECT_THAT(malformed.last_error, HasSubstr("line 2"));
  EXPECT_TRUE(malformed.healthy);  // one failure is below the threshold
  const WorkerScrapeStats http = StatsOf(*scraper, "w1");
  EXPECT_EQ(http.http_errors, 1);
  EXPECT_THAT(http.last_error, HasSubstr("503"));
  EXPECT_EQ(StatsOf(*scraper, "w2").successes, 1);
  EXPECT_EQ(StatsOf(*scraper, "w2").errors(), 0);

  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  EXPECT_EQ(StatsOf(*scraper, "w0").malformed_pages, 2);
  EXPECT_FALSE(pool.Status("w0").healthy);
  EXPECT_FALSE(pool.Status("w1").healthy);
  EXPECT_TRUE(pool.Status("w2").healthy);

  // A page without the served model's series is an error too, not a zero load.
  pool.server(2).SetPage(testing::VllmMetricsPage({1, 1, 0}, "another-model"));
  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  EXPECT_EQ(StatsOf(*scraper, "w2").malformed_pages, 1);
  EXPECT_THAT(StatsOf(*scraper, "w2").last_error, HasSubstr("\"another-model\""));
}

TEST(LoadScraperTest, OversizedPageIsRejected) {
  ScrapedPool pool(1);
  LoadScraperOptions options;
  options.max_page_bytes = 512;  // a vLLM page is several kilobytes
  auto scraper = pool.MakeScraper(options);
  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  EXPECT_EQ(StatsOf(*scraper, "w0").malformed_pages, 1);
  EXPECT_THAT(StatsOf(*scraper, "w0").last_error, HasSubstr("page larger than 512 bytes"));
}

TEST(LoadScraperTest, EveryWorkerUnhealthyFailsOpen) {
  ScrapedPool pool(2);
  LoadScraperOptions options;
  options.unhealthy_after_failures = 1;
  auto scraper = pool.MakeScraper(options);
  ASSERT_TRUE(pool.server(0).SetMode(FakeMetricsServer::Mode::kDown).ok());
  ASSERT_TRUE(pool.server(1).SetMode(FakeMetricsServer::Mode::kHttpError).ok());
  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  ASSERT_FALSE(pool.Status("w0").healthy);
  ASSERT_FALSE(pool.Status("w1").healthy);

  // Routes still succeed, spread by the router's own lease count, and say they failed open.
  std::map<std::string, int> chosen;
  std::vector<uint64_t> leases;
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<RouteResult> result = pool.router().Route(nullptr);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->fallback, FallbackReason::kAllUnhealthy);
    ++chosen[result->worker_id];
    leases.push_back(result->lease_id);
  }
  EXPECT_EQ(chosen, (std::map<std::string, int>{{"w0", 3}, {"w1", 3}}));
  for (uint64_t lease : leases) ASSERT_TRUE(pool.router().Complete(lease).ok());

  // One worker recovers: it alone is routable again, and nothing fails open any more.
  ASSERT_TRUE(pool.server(1).SetMode(FakeMetricsServer::Mode::kServe).ok());
  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  absl::StatusOr<RouteResult> result = pool.router().Route(nullptr);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->worker_id, "w1");
  EXPECT_EQ(result->fallback, FallbackReason::kNone);
}

TEST(LoadScraperTest, StaleSnapshotFallsBackToLeaseCount) {
  ScrapedPool pool(2, PolicyKind::kJsq, /*staleness=*/absl::Milliseconds(200));
  pool.server(0).SetLoad({50, 0, 0.9});
  pool.server(1).SetLoad({0, 0, 0});
  LoadScraperOptions options;
  options.unhealthy_after_failures = 0;  // never mark unhealthy: only staleness is at work
  auto scraper = pool.MakeScraper(options);
  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  EXPECT_DOUBLE_EQ(pool.Status("w0").load.effective, 50);
  ASSERT_TRUE(pool.server(0).SetMode(FakeMetricsServer::Mode::kDown).ok());
  ASSERT_TRUE(pool.server(1).SetMode(FakeMetricsServer::Mode::kDown).ok());
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(scraper->ScrapeOnce().ok());
  EXPECT_TRUE(pool.Status("w0").healthy);
  EXPECT_EQ(StatsOf(*scraper, "w0").transport_errors, 1);
  // The 50 running requests are too old to trust: the router's own count (no leases) applies.
  EXPECT_FALSE(pool.Status("w0").load.snapshot_fresh);
  EXPECT_DOUBLE_EQ(pool.Status("w0").load.effective, 0);
}

TEST(LoadScraperTest, TargetsChangeAtRuntimeAndRemovalRestoresHealth) {
  ScrapedPool pool(3);
  LoadScraperOptions options;
  options.interval = absl::Milliseconds(20);
  options.unhealthy_after_failures = 2;
  auto all = pool.Targets();
  auto scraper = LoadScraper::Create(&pool.router(), options, {all[0]});
  ASSERT_TRUE(scraper.ok()) << scraper.status();
  ASSERT_TRUE((*scraper)->Start().ok());
  ASSERT_TRUE((*scraper)->UpsertTarget(all[1]).ok());
  ASSERT_TRUE(WaitUntil([&] { return StatsOf(**scraper, "w1").successes >= 2; }));
  ASSERT_EQ((*scraper)->Stats().size(), 2u);

  // w1 dies and is marked unhealthy; dropping its target gives it back to the router healthy.
  ASSERT_TRUE(pool.server(1).SetMode(FakeMetricsServer::Mode::kDown).ok());
  ASSERT_TRUE(WaitUntil([&] { return !pool.Status("w1").healthy; }));
  ASSERT_TRUE((*scraper)->RemoveTarget("w1").ok());
  EXPECT_TRUE(pool.Status("w1").healthy);
  absl::SleepFor(absl::Milliseconds(100));  // a scrape that was in flight must not re-mark it
  EXPECT_TRUE(pool.Status("w1").healthy);
  EXPECT_EQ((*scraper)->RemoveTarget("w1").code(), absl::StatusCode::kNotFound);

  // Replace the list: w0 stays (keeps its figures), w2 arrives.
  const int64_t w0_before = StatsOf(**scraper, "w0").successes;
  ASSERT_TRUE((*scraper)->SetTargets({all[0], all[2]}).ok());
  ASSERT_TRUE(WaitUntil([&] { return StatsOf(**scraper, "w2").successes >= 1; }));
  EXPECT_GE(StatsOf(**scraper, "w0").successes, w0_before);
  const auto stats = (*scraper)->Stats();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].worker_id, "w0");
  EXPECT_EQ(stats[1].worker_id, "w2");

  // Stop gives back every worker it holds unhealthy.
  ASSERT_TRUE(pool.server(2).SetMode(FakeMetricsServer::Mode::kDown).ok());
  ASSERT_TRUE(WaitUntil([&] { return !pool.Status("w2").healthy; }));
  (*scraper)->Stop();
  EXPECT_TRUE(pool.Status("w2").healthy);
  EXPECT_EQ((*scraper)->Start().code(), absl::StatusCode::kOk);  // restartable
  EXPECT_EQ((*scraper)->Start().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*scraper)->ScrapeOnce().code(), absl::StatusCode::kFailedPrecondition);
  (*scraper)->Stop();
}

TEST(LoadScraperTest, SnapshotsOfWorkersTheRouterDoesNotKnowAreCountedAsRejected) {
  ScrapedPool pool(1);
  auto extra = FakeMetricsServer::Start("test-model");
  ASSERT_TRUE(extra.ok());
  LoadScraperOptions options;
  options.engine.model_name = "test-model";
  auto scraper = LoadScraper::Create(&pool.router(), options, {{"ghost", (*extra)->url()}});
  ASSERT_TRUE(scraper.ok());
  ASSERT_TRUE((*scraper)->ScrapeOnce().ok());
  const WorkerScrapeStats stats = StatsOf(**scraper, "ghost");
  EXPECT_EQ(stats.successes, 1);
  EXPECT_EQ(stats.rejected_reports, 1);
  EXPECT_THAT(stats.last_error, HasSubstr("unknown worker"));
}

TEST(LoadScraperTest, ValidatesOptionsAndTargets) {
  ScrapedPool pool(1);
  LoadScraperOptions options;
  options.interval = absl::ZeroDuration();
  EXPECT_EQ(LoadScraper::Create(&pool.router(), options, {}).status().code(), absl::StatusCode::kInvalidArgument);
  options = {};
  options.timeout = -absl::Seconds(1);
  EXPECT_EQ(LoadScraper::Create(&pool.router(), options, {}).status().code(), absl::StatusCode::kInvalidArgument);
  options = {};
  options.unhealthy_after_failures = -1;
  EXPECT_EQ(LoadScraper::Create(&pool.router(), options, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadScraper::Create(nullptr, {}, {}).status().code(), absl::StatusCode::kInvalidArgument);

  EXPECT_THAT(ValidateScrapeTargets({{"w0", "ftp://x/metrics"}}).message(), HasSubstr("http:// or https://"));
  EXPECT_THAT(ValidateScrapeTargets({{"", "http://x/metrics"}}).message(), HasSubstr("empty worker id"));
  EXPECT_THAT(ValidateScrapeTargets({{"a", "http://x/m"}, {"a", "http://y/m"}}).message(),
              HasSubstr("two scrape targets for worker \"a\""));
  EXPECT_THAT(ValidateScrapeTargets({{"a", "http://x/m y"}}).message(), HasSubstr("whitespace"));

  auto scraper = LoadScraper::Create(&pool.router(), {}, {});
  ASSERT_TRUE(scraper.ok());
  EXPECT_EQ((*scraper)->UpsertTarget({"w0", "file:///etc/passwd"}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*scraper)->Stats().empty());
}

TEST(LoadScraperTest, ParsesTheFlagSyntax) {
  absl::StatusOr<std::vector<ScrapeTarget>> targets =
      ParseScrapeTargets(" w0=http://10.0.0.1:8000/metrics, w1 = https://h:9/m ,");
  ASSERT_TRUE(targets.ok()) << targets.status();
  ASSERT_EQ(targets->size(), 2u);
  EXPECT_EQ((*targets)[0].worker_id, "w0");
  EXPECT_EQ((*targets)[0].url, "http://10.0.0.1:8000/metrics");
  EXPECT_EQ((*targets)[1].worker_id, "w1");
  EXPECT_EQ((*targets)[1].url, "https://h:9/m");
  EXPECT_TRUE(ParseScrapeTargets("")->empty());
  EXPECT_THAT(ParseScrapeTargets("w0").status().message(), HasSubstr("not of the form id=url"));
  EXPECT_FALSE(ParseScrapeTargets("w0=http://a/m,w0=http://b/m").ok());
}

}  // namespace
}  // namespace eldr
