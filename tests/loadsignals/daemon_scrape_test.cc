// The real eldr-router daemon scraping fake vLLM workers (real HTTP servers on loopback serving the
// real text format): the numbers they publish change the daemon's choices; a worker whose
// endpoint dies is taken out and brought back; every worker unhealthy fails open; errors are
// counted per worker on /metrics.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "eldr/v1/router.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "integration/router_harness.h"
#include "loadsignals/fake_metrics_server.h"

namespace eldr::testing {
namespace {

using ::testing::HasSubstr;

bool WaitUntil(const std::function<bool()>& done, absl::Duration limit = absl::Seconds(15)) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return done();
}

// A daemon (policy jsq: the choice depends on load alone) over fake workers w0..w<n-1>.
class ScrapingDaemon {
 public:
  explicit ScrapingDaemon(int workers, std::vector<std::string> extra_args = {}) {
    std::vector<std::string> metrics;
    for (int i = 0; i < workers; ++i) {
      auto server = FakeMetricsServer::Start("served-model");
      EXPECT_TRUE(server.ok()) << server.status();
      metrics.push_back(absl::StrCat("w", i, "=", (*server)->url()));
      servers_.push_back(std::move(*server));
    }
    std::vector<std::string> args = {
        "--workers=" + WorkerFlag(workers), "--policy=jsq",           "--worker_metrics=" + absl::StrJoin(metrics, ","),
        "--scrape_interval=20ms",           "--scrape_timeout=300ms", "--unhealthy_after_failures=2",
        "--scrape_model_name=served-model"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    auto process = RouterProcess::Start(dir_, args);
    EXPECT_TRUE(process.ok()) << process.status();
    if (process.ok()) process_ = std::move(*process);
  }

  bool started() const { return process_ != nullptr; }
  FakeMetricsServer& worker(int i) { return *servers_[i]; }
  RouterProcess& process() { return *process_; }

  std::map<std::string, v1::WorkerState> Workers() {
    v1::ListWorkersResponse response;
    grpc::Status status = process_->AdminStub()->ListWorkers(Ctx().get(), v1::ListWorkersRequest(), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    std::map<std::string, v1::WorkerState> by_id;
    for (const v1::WorkerState& w : response.workers()) by_id[w.worker().id()] = w;
    return by_id;
  }

  // Waits until every worker's reported load is `expected[i]` (running + waiting).
  bool WaitForReportedLoads(const std::vector<double>& expected) {
    return WaitUntil([&] {
      auto workers = Workers();
      for (size_t i = 0; i < expected.size(); ++i) {
        const v1::WorkerState& w = workers[absl::StrCat("w", i)];
        if (w.report_age_seconds() < 0 || w.reported_load() != expected[i]) return false;
      }
      return true;
    });
  }

  // Routes `n` requests without a signature, completing each; returns the choices and checks
  // the fallback reason of each.
  std::map<std::string, int> Route(int n, const std::string& want_fallback = "") {
    std::map<std::string, int> chosen;
    auto stub = process_->RouterStub();
    for (int i = 0; i < n; ++i) {
      v1::RouteRequest request;
      request.set_request_id(absl::StrCat("r", i));
      v1::RouteResponse response;
      grpc::Status status = stub->Route(Ctx().get(), request, &response);
      EXPECT_TRUE(status.ok()) << status.error_message();
      if (!status.ok()) continue;
      ++chosen[response.worker_id()];
      EXPECT_EQ(response.fallback_reason(), want_fallback);
      v1::CompleteRequest complete;
      complete.set_lease_id(response.lease_id());
      v1::CompleteResponse done;
      EXPECT_TRUE(stub->Complete(Ctx().get(), complete, &done).ok());
    }
    return chosen;
  }

  std::optional<double> Metric(const std::string& name, const std::map<std::string, std::string>& labels) {
    auto metrics = ScrapeMetrics(process_->metrics_port());
    EXPECT_TRUE(metrics.ok()) << metrics.status();
    return metrics.ok() ? metrics->Value(name, labels) : std::nullopt;
  }

 private:
  TempDir dir_;
  std::vector<std::unique_ptr<FakeMetricsServer>> servers_;
  std::unique_ptr<RouterProcess> process_;
};

TEST(DaemonScrapeTest, ScrapedNumbersChangeTheDaemonsChoices) {
  ScrapingDaemon daemon(3);
  ASSERT_TRUE(daemon.started());
  daemon.worker(0).SetLoad({8, 4, 0.5});
  daemon.worker(1).SetLoad({0, 1, 0.1});
  daemon.worker(2).SetLoad({5, 0, 0.3}, /*engines=*/2);
  ASSERT_TRUE(daemon.WaitForReportedLoads({12, 1, 5})) << daemon.process().Log();
  auto workers = daemon.Workers();
  EXPECT_DOUBLE_EQ(workers["w0"].reported_kv_usage(), 0.5);
  EXPECT_LT(workers["w0"].report_age_seconds(), 2.0);
  EXPECT_EQ(daemon.Route(6), (std::map<std::string, int>{{"w1", 6}}));

  daemon.worker(1).SetLoad({40, 0, 0.9});
  daemon.worker(2).SetLoad({0, 0, 0});
  ASSERT_TRUE(daemon.WaitForReportedLoads({12, 40, 0}));
  EXPECT_EQ(daemon.Route(6), (std::map<std::string, int>{{"w2", 6}}));

  EXPECT_GT(daemon.Metric("eldr_scrapes_total", {{"worker", "w1"}, {"outcome", "ok"}}).value_or(0), 1);
  EXPECT_EQ(daemon.Metric("eldr_scrape_errors_total", {{"worker", "w1"}, {"kind", "transport"}}), 0);
}

TEST(DaemonScrapeTest, DeadWorkerIsTakenOutAndBroughtBack) {
  ScrapingDaemon daemon(3);
  ASSERT_TRUE(daemon.started());
  daemon.worker(0).SetLoad({10, 0, 0});
  daemon.worker(1).SetLoad({10, 0, 0});
  daemon.worker(2).SetLoad({0, 0, 0});
  ASSERT_TRUE(daemon.WaitForReportedLoads({10, 10, 0}));
  EXPECT_EQ(daemon.Route(4), (std::map<std::string, int>{{"w2", 4}}));

  // w2's endpoint dies: it looked the idlest, but it gets nothing any more.
  ASSERT_TRUE(daemon.worker(2).SetMode(FakeMetricsServer::Mode::kDown).ok());
  ASSERT_TRUE(WaitUntil([&] { return !daemon.Workers()["w2"].healthy(); })) << daemon.process().Log();
  std::map<std::string, int> without_w2 = daemon.Route(8);
  EXPECT_EQ(without_w2.count("w2"), 0u);
  EXPECT_EQ(without_w2["w0"] + without_w2["w1"], 8);
  EXPECT_GE(daemon.Metric("eldr_scrape_errors_total", {{"worker", "w2"}, {"kind", "transport"}}).value_or(0), 2);
  EXPECT_EQ(daemon.Metric("eldr_scrape_healthy", {{"worker", "w2"}}), 0);
  EXPECT_EQ(daemon.Metric("eldr_worker_healthy", {{"worker", "w2"}}), 0);
  EXPECT_EQ(daemon.Metric("eldr_scrape_unhealthy_transitions_total", {{"worker", "w2"}}), 1);
  // Logged after the health flip, outside the scraper's lock (LoadScraper's ApplyResult calls
  // on_health_change last): the log may lag what ListWorkers shows.
  EXPECT_TRUE(WaitUntil([&] { return absl::StrContains(daemon.process().Log(), "worker_unhealthy"); }))
      << daemon.process().Log();

  // It comes back, idle: it is healthy again and takes the traffic.
  ASSERT_TRUE(daemon.worker(2).SetMode(FakeMetricsServer::Mode::kServe).ok());
  ASSERT_TRUE(WaitUntil([&] { return daemon.Workers()["w2"].healthy(); }));
  EXPECT_EQ(daemon.Route(4), (std::map<std::string, int>{{"w2", 4}}));
  EXPECT_EQ(daemon.Metric("eldr_scrape_healthy", {{"worker", "w2"}}), 1);
  EXPECT_TRUE(WaitUntil([&] { return absl::StrContains(daemon.process().Log(), "worker_healthy"); }))
      << daemon.process().Log();  // logged after the flip, as above
}

TEST(DaemonScrapeTest, EveryWorkerUnhealthyFailsOpenAndIsCounted) {
  ScrapingDaemon daemon(2);
  ASSERT_TRUE(daemon.started());
  ASSERT_TRUE(daemon.worker(0).SetMode(FakeMetricsServer::Mode::kHttpError).ok());
  ASSERT_TRUE(daemon.worker(1).SetMode(FakeMetricsServer::Mode::kMalformed).ok());
  ASSERT_TRUE(WaitUntil([&] {
    auto workers = daemon.Workers();
    return !workers["w0"].healthy() && !workers["w1"].healthy();
  }));
  const double before = daemon.Metric("eldr_fallback_total", {{"reason", "all_unhealthy"}}).value_or(-1);
  std::map<std::string, int> chosen = daemon.Route(6, "all_unhealthy");
  EXPECT_EQ(chosen["w0"] + chosen["w1"], 6);
  EXPECT_EQ(daemon.Metric("eldr_fallback_total", {{"reason", "all_unhealthy"}}), before + 6);
  EXPECT_GE(daemon.Metric("eldr_scrape_errors_total", {{"worker", "w0"}, {"kind", "http"}}).value_or(0), 2);
  EXPECT_GE(daemon.Metric("eldr_scrape_errors_total", {{"worker", "w1"}, {"kind", "malformed"}}).value_or(0), 2);
}

// Under policy eldr, scraped health gates the locality band: the nearest worker gets the request
// while healthy, the next one when it is not, and with every worker unhealthy the route fails open
// back to locality (counted as all_unhealthy).
TEST(DaemonScrapeTest, ScrapedHealthGatesTheLocalityBandUnderPolicyEldr) {
  TempDir artifacts;
  const std::string centroids = artifacts.File("centroids.json");
  WriteTextFile(centroids, ArtifactJson({0, 1}));
  ScrapingDaemon daemon(2, {"--policy=eldr", "--centroids=" + centroids});
  ASSERT_TRUE(daemon.started());
  daemon.worker(0).SetLoad({0, 0, 0});
  daemon.worker(1).SetLoad({0, 0, 0});
  ASSERT_TRUE(daemon.WaitForReportedLoads({0, 0})) << daemon.process().Log();
  auto stub = daemon.process().RouterStub();
  auto route_block_1 = [&](v1::RouteResponse* response) {
    grpc::Status status = stub->Route(Ctx().get(), BlockRequest(1), response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    v1::CompleteRequest complete;
    complete.set_lease_id(response->lease_id());
    v1::CompleteResponse done;
    EXPECT_TRUE(stub->Complete(Ctx().get(), complete, &done).ok());
  };
  v1::RouteResponse response;
  route_block_1(&response);
  EXPECT_EQ(response.worker_id(), "w1");
  EXPECT_EQ(response.policy(), "eldr");
  EXPECT_EQ(response.fallback_reason(), "");

  ASSERT_TRUE(daemon.worker(1).SetMode(FakeMetricsServer::Mode::kDown).ok());
  ASSERT_TRUE(WaitUntil([&] { return !daemon.Workers()["w1"].healthy(); })) << daemon.process().Log();
  route_block_1(&response);
  EXPECT_EQ(response.worker_id(), "w0");  // the nearest worker is out: the band holds only w0

  ASSERT_TRUE(daemon.worker(0).SetMode(FakeMetricsServer::Mode::kDown).ok());
  ASSERT_TRUE(WaitUntil([&] { return !daemon.Workers()["w0"].healthy(); })) << daemon.process().Log();
  route_block_1(&response);
  EXPECT_EQ(response.worker_id(), "w1");  // fail open: locality decides again
  EXPECT_EQ(response.fallback_reason(), "all_unhealthy");
  EXPECT_EQ(daemon.Metric("eldr_fallback_total", {{"reason", "all_unhealthy"}}), 1);
}

TEST(DaemonScrapeTest, WorkersFileMetricsUrlsAndAdminRemoval) {
  TempDir dir;
  auto w0 = FakeMetricsServer::Start("m");
  auto w1 = FakeMetricsServer::Start("m");
  ASSERT_TRUE(w0.ok() && w1.ok());
  (*w0)->SetLoad({3, 0, 0});
  (*w1)->SetLoad({7, 0, 0});
  const std::string workers_file = dir.File("workers.json");
  WriteTextFile(workers_file, absl::StrCat(R"({"workers": [
    {"id": "w0", "address": "10.0.0.1:8000", "metrics_url": ")",
                                           (*w0)->url(), R"("},
    {"id": "w1", "address": "10.0.0.2:8000", "metrics_url": ")",
                                           (*w1)->url(), R"("}]})"));
  auto process = RouterProcess::Start(dir, {"--workers=" + workers_file, "--policy=jsq", "--scrape_interval=20ms"});
  ASSERT_TRUE(process.ok()) << process.status();
  auto admin = (*process)->AdminStub();
  auto reported = [&](const std::string& id) {
    v1::ListWorkersResponse response;
    EXPECT_TRUE(admin->ListWorkers(Ctx().get(), v1::ListWorkersRequest(), &response).ok());
    for (const auto& w : response.workers()) {
      if (w.worker().id() == id) return w.report_age_seconds() >= 0 ? w.reported_load() : -1.0;
    }
    return -2.0;
  };
  ASSERT_TRUE(WaitUntil([&] { return reported("w0") == 3 && reported("w1") == 7; }));

  // Removed over the admin API: no longer scraped (its series leave /metrics). Added back: scraped again.
  v1::RemoveWorkerRequest remove;
  remove.set_worker_id("w1");
  v1::RemoveWorkerResponse removed;
  ASSERT_TRUE(admin->RemoveWorker(Ctx().get(), remove, &removed).ok());
  ASSERT_TRUE(WaitUntil([&] {
    auto metrics = ScrapeMetrics((*process)->metrics_port());
    return metrics.ok() && !metrics->Value("eldr_scrapes_total", {{"worker", "w1"}}).has_value() &&
           metrics->Value("eldr_scrapes_total", {{"worker", "w0"}}).has_value();
  }));
  v1::UpsertWorkerRequest upsert;
  upsert.mutable_worker()->set_id("w1");
  upsert.mutable_worker()->set_address("10.0.0.2:8000");
  v1::UpsertWorkerResponse upserted;
  ASSERT_TRUE(admin->UpsertWorker(Ctx().get(), upsert, &upserted).ok());
  ASSERT_TRUE(WaitUntil([&] { return reported("w1") == 7; }));
}

TEST(DaemonScrapeTest, BadScrapeSettingsStopTheDaemonWithAClearMessage) {
  TempDir dir;
  auto unknown = RouterProcess::Start(
      dir, {"--workers=" + WorkerFlag(2), "--worker_metrics=w7=http://127.0.0.1:1/metrics"}, absl::Seconds(10));
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("worker_metrics"));
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("'w7' is not one of the workers"));

  auto bad_scheme = RouterProcess::Start(dir, {"--workers=" + WorkerFlag(2), "--worker_metrics=w0=ftp://h/metrics"},
                                         absl::Seconds(10));
  ASSERT_FALSE(bad_scheme.ok());
  EXPECT_THAT(std::string(bad_scheme.status().message()), HasSubstr("http:// or https://"));

  auto bad_interval =
      RouterProcess::Start(dir, {"--workers=" + WorkerFlag(2), "--scrape_interval_ms=0"}, absl::Seconds(10));
  ASSERT_FALSE(bad_interval.ok());
  EXPECT_THAT(std::string(bad_interval.status().message()), HasSubstr("scrape_interval"));
}

}  // namespace
}  // namespace eldr::testing
