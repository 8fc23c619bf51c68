// eldr-router with --discovery=kubernetes against the stand-in API server (tests/discovery/
// fake_kube_apiserver.py: HTTPS with its own CA, a bearer token, list + watch of pods, faults): the
// real daemon, reached through a kubeconfig, keeps its pool equal to the ready decode pods while
// pods come, go, flap and are replaced, while the watch drops, the API server goes away, answers
// garbage or rotates its token, and no Route fails meanwhile. Convergence times are printed.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "discovery/fake_kube.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "integration/router_harness.h"

namespace eldr::testing {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

// Decode pods listen on 127.0.0.1:<8100 + i> (distinct addresses, nothing behind them: the router
// only hands the address out; scraping failures do not mark workers unhealthy in these tests).
json DecodePod(const std::string& name, int port, bool ready = true) {
  return json{{"name", name},
              {"ip", "127.0.0.1"},
              {"labels", {{"app", "decode"}}},
              {"ready", ready},
              {"ports", json::array({{{"name", "http"}, {"containerPort", port}}})}};
}

std::vector<std::string> DiscoveryArgs(const std::string& kubeconfig) {
  return {"--discovery=kubernetes", "--kubeconfig=" + kubeconfig, "--decode_selector=app=decode",
          "--worker_port=http",     "--discovery_settle=200ms",   "--unhealthy_after_failures=0",
          "--scrape_interval=1s"};
}

// Worker id -> (address, state) of the daemon's pool.
std::map<std::string, std::pair<std::string, std::string>> Pool(const RouterProcess& router) {
  std::map<std::string, std::pair<std::string, std::string>> pool;
  const eldr::v1::GetStateResponse state = State(router);
  for (const eldr::v1::WorkerState& w : state.workers()) pool[w.worker().id()] = {w.worker().address(), w.state()};
  return pool;
}

std::set<std::string> Active(const RouterProcess& router) {
  std::set<std::string> active;
  for (const auto& [id, entry] : Pool(router)) {
    if (entry.second == "active") active.insert(id);
  }
  return active;
}

// Polls until `done` holds; the time it took, or nullopt after `timeout` (a test failure).
template <typename Done>
std::optional<absl::Duration> Converge(const std::string& what, Done done, absl::Duration timeout = absl::Seconds(15)) {
  const absl::Time start = absl::Now();
  while (absl::Now() - start < timeout) {
    if (done()) {
      const absl::Duration took = absl::Now() - start;
      std::printf("[converged] %-58s %8.1f ms\n", what.c_str(), absl::ToDoubleMilliseconds(took));
      return took;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  ADD_FAILURE() << what << ": not converged within " << timeout;
  return std::nullopt;
}

class DiscoveryRouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<FakeKube>> kube = FakeKube::Start(dir_, FakeKubeOptions{dir_.path() + "/tls"});
    ASSERT_TRUE(kube.ok()) << kube.status();
    kube_ = *std::move(kube);
    kubeconfig_ = dir_.path() + "/kubeconfig";
    ASSERT_TRUE(kube_->WriteKubeconfig(kubeconfig_).ok());
  }

  TempDir dir_;
  std::unique_ptr<FakeKube> kube_;
  std::string kubeconfig_;
};

TEST_F(DiscoveryRouterTest, ThePoolFollowsThePodsAndNoRouteFails) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-" + std::to_string(i), 8100 + i)).ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-starting", 8190, /*ready=*/false)).ok());
  ASSERT_TRUE(kube_
                  ->CreatePod(json{
                      {"name", "prefill-0"}, {"ip", "127.0.0.1"}, {"ready", true}, {"labels", {{"app", "prefill"}}}})
                  .ok());
  // Four unnamed rows (blocks 0..3): fitted to the pods once they are known.
  WriteTextFile(dir_.path() + "/centroids.json", ArtifactJson({0, 1, 2, 3}));
  std::vector<std::string> args = DiscoveryArgs(kubeconfig_);
  args.push_back("--centroids=" + dir_.path() + "/centroids.json");
  args.push_back("--refit_interval=0");
  std::unique_ptr<RouterProcess> router = MustStart(dir_, args);
  ASSERT_NE(router, nullptr);

  const std::set<std::string> first = {"decode-0", "decode-1", "decode-2"};
  ASSERT_TRUE(Converge("initial list: 3 ready decode pods", [&] { return Active(*router) == first; }));
  auto pool = Pool(*router);
  EXPECT_EQ(pool.size(), 3u) << "the not-ready and the prefill pod stay out";
  EXPECT_EQ(pool["decode-1"].first, "127.0.0.1:8101");
  // The rows went to the pods in pool order: block i -> decode-i.
  ASSERT_TRUE(Converge("centroids fitted to the pods", [&] {
    const eldr::v1::GetStateResponse state = State(*router);
    int with_row = 0;
    for (const auto& w : state.workers()) with_row += w.has_centroid();
    return with_row == 3;
  }));
  for (int block = 0; block < 3; ++block)
    EXPECT_EQ(RouteAndComplete(*router, block), "decode-" + std::to_string(block));

  RouteTraffic loop({router.get()}, absl::Milliseconds(2));

  // A new ready pod joins and takes the free row (block 3).
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-3", 8103)).ok());
  ASSERT_TRUE(Converge("pod added (ready) -> active", [&] { return Active(*router).count("decode-3") == 1; }));
  ASSERT_TRUE(
      Converge("new pod takes the free centroid row", [&] { return RouteAndComplete(*router, 3) == "decode-3"; }));

  // The starting pod becomes ready.
  ASSERT_TRUE(kube_->PatchPod("decode-starting", {{"ready", true}}).ok());
  ASSERT_TRUE(Converge("pod becomes ready -> active", [&] { return Active(*router).count("decode-starting") == 1; }));

  // Not ready: drained at once; ready again: active after the settle time.
  ASSERT_TRUE(kube_->PatchPod("decode-1", {{"ready", false}}).ok());
  ASSERT_TRUE(Converge("pod not ready -> draining", [&] { return Pool(*router)["decode-1"].second == "draining"; }));
  for (int i = 0; i < 20; ++i) EXPECT_NE(RouteAndComplete(*router, 1), "decode-1");
  ASSERT_TRUE(kube_->PatchPod("decode-1", {{"ready", true}}).ok());
  ASSERT_TRUE(Converge("pod ready again -> active", [&] { return Pool(*router)["decode-1"].second == "active"; }));

  // Terminating: drained; deleted: removed.
  ASSERT_TRUE(kube_->TerminatePod("decode-2").ok());
  ASSERT_TRUE(Converge("pod terminating -> draining", [&] { return Pool(*router)["decode-2"].second == "draining"; }));
  ASSERT_TRUE(kube_->DeletePod("decode-2").ok());
  ASSERT_TRUE(Converge("pod deleted -> removed", [&] { return Pool(*router).count("decode-2") == 0; }));

  // Replaced (same name, new uid and IP, like a StatefulSet pod): the new address is in service.
  const std::string old_address = Pool(*router)["decode-0"].first;
  ASSERT_TRUE(kube_->ReplacePod("decode-0").ok());
  ASSERT_TRUE(Converge("pod replaced (new IP) -> new address", [&] {
    auto now = Pool(*router);
    return now.count("decode-0") == 1 && now["decode-0"].first != old_address && now["decode-0"].second == "active";
  }));

  // The watch drops mid-stream: it resumes, and a change made afterwards arrives.
  ASSERT_TRUE(kube_->Faults({{"drop_watches", true}}).ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-4", 8104)).ok());
  ASSERT_TRUE(Converge("after a dropped watch: pod added", [&] { return Active(*router).count("decode-4") == 1; }));

  // The API server goes away for a while: the pool stays; changes made meanwhile arrive after.
  const std::set<std::string> before_outage = Active(*router);
  ASSERT_TRUE(kube_->Faults({{"down", true}}).ok());
  ASSERT_TRUE(kube_->DeletePod("decode-3").ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-5", 8105)).ok());
  absl::SleepFor(absl::Seconds(2));
  EXPECT_EQ(Active(*router), before_outage) << "an unreachable API server must not change the pool";
  ASSERT_TRUE(kube_->Faults({{"down", false}}).ok());
  ASSERT_TRUE(Converge("API server back after 2 s: changes applied", [&] {
    const std::set<std::string> active = Active(*router);
    return active.count("decode-5") == 1 && Pool(*router).count("decode-3") == 0;
  }));

  // Garbage: a change the watch never delivers (stalled), the history compacted past it and the
  // watch dropped: resuming gets 410 Gone, so the watcher lists again, and the lists are not JSON.
  // The pool stays as it was until the answers make sense again, then the change arrives.
  const std::set<std::string> before_garbage = Active(*router);
  ASSERT_TRUE(kube_->Faults({{"stall_watches", true}}).ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-6", 8106)).ok());
  ASSERT_TRUE(
      kube_->Faults({{"compact", true}, {"garbage", "list"}, {"drop_watches", true}, {"stall_watches", false}}).ok());
  absl::SleepFor(absl::Seconds(2));
  EXPECT_EQ(Active(*router), before_garbage) << "garbage from the API server must not change the pool";
  ASSERT_TRUE(kube_->Faults({{"garbage", "off"}}).ok());
  ASSERT_TRUE(
      Converge("after 410 + garbage lists: the missed pod", [&] { return Active(*router).count("decode-6") == 1; }));

  // The token rotates (the server accepts only the new one from now on; the router's kubeconfig
  // names the same token file, as a projected service-account token would be).
  ASSERT_TRUE(kube_->WriteToken("token-rotated").ok());
  ASSERT_TRUE(kube_->Faults({{"drop_watches", true}}).ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-7", 8107)).ok());
  ASSERT_TRUE(Converge("after token rotation: pod added", [&] { return Active(*router).count("decode-7") == 1; }));

  loop.Stop();
  EXPECT_EQ(loop.failures(), 0) << "last error: " << loop.last_error();
  EXPECT_GT(loop.routes(), 100);
  std::printf("[routes] %lld routes while the pool changed, %lld failed\n", static_cast<long long>(loop.routes()),
              static_cast<long long>(loop.failures()));

  // The pool belongs to discovery: the admin API refuses to change it.
  eldr::v1::UpsertWorkerRequest upsert;
  upsert.mutable_worker()->set_id("manual");
  upsert.mutable_worker()->set_address("127.0.0.1:9999");
  eldr::v1::UpsertWorkerResponse upserted;
  grpc::Status refused = router->AdminStub()->UpsertWorker(Ctx().get(), upsert, &upserted);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("discovered from Kubernetes"));
  eldr::v1::RemoveWorkerRequest remove;
  remove.set_worker_id("decode-4");
  eldr::v1::RemoveWorkerResponse removed;
  EXPECT_EQ(router->AdminStub()->RemoveWorker(Ctx().get(), remove, &removed).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  // What the operator sees.
  absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(router->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  for (const char* family :
       {"eldr_discovery_errors_total", "eldr_discovery_watch_restarts_total", "eldr_completes_after_removal_total"}) {
    for (const Sample& sample : metrics->samples[family]) {
      std::string labels;
      for (const auto& [key, value] : sample.labels) absl::StrAppend(&labels, key, "=", value, " ");
      std::printf("[metrics] %s{%s} %g\n", family, labels.c_str(), sample.value);
    }
  }
  EXPECT_EQ(metrics->Value("eldr_discovery_synced", {{"role", "decode"}}), 1);
  EXPECT_EQ(metrics->Value("eldr_discovery_workers", {{"role", "decode"}, {"state", "ready"}}),
            static_cast<double>(Active(*router).size()));
  EXPECT_GT(metrics->Value("eldr_discovery_errors_total", {{"role", "decode"}, {"kind", "unreachable"}}).value_or(0),
            0);
  EXPECT_GT(metrics->Value("eldr_discovery_errors_total", {{"role", "decode"}, {"kind", "parse"}}).value_or(0), 0);
  EXPECT_GT(metrics->Value("eldr_discovery_watch_restarts_total", {{"role", "decode"}, {"reason", "gone"}}).value_or(0),
            0);
  EXPECT_GT(metrics->Value("eldr_discovery_pool_changes_total", {{"role", "decode"}, {"action", "drain"}}).value_or(0),
            0);
  EXPECT_LT(metrics->Value("eldr_discovery_last_sync_age_seconds", {{"role", "decode"}}).value_or(1e9), 10);
  EXPECT_GT(metrics->Value("eldr_centroid_reloads_total", {{"source", "discovery"}, {"outcome", "ok"}}).value_or(0), 0);
}

TEST_F(DiscoveryRouterTest, AThousandPodsJoinThePool) {
  json pods = json::array();
  for (int i = 0; i < 1000; ++i) {
    json pod = DecodePod(absl::StrCat("decode-", i), 20000 + i);
    pods.push_back(pod);
  }
  ASSERT_TRUE(kube_->Call("POST", "/pods/bulk", {{"pods", pods}}).ok());
  std::vector<std::string> args = DiscoveryArgs(kubeconfig_);
  args.push_back("--policy=jsq");
  std::unique_ptr<RouterProcess> router = MustStart(dir_, args);
  ASSERT_NE(router, nullptr);
  ASSERT_TRUE(Converge(
      "1,000 pods listed -> 1,000 active workers", [&] { return Active(*router).size() == 1000; }, absl::Seconds(60)));
  RouteTraffic loop({router.get()}, absl::Milliseconds(2));
  // A tenth of them goes away at once, and as many new ones come.
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(kube_->DeletePod(absl::StrCat("decode-", i)).ok());
  json more = json::array();
  for (int i = 1000; i < 1100; ++i) more.push_back(DecodePod(absl::StrCat("decode-", i), 20000 + i));
  ASSERT_TRUE(kube_->Call("POST", "/pods/bulk", {{"pods", more}}).ok());
  ASSERT_TRUE(Converge(
      "100 deleted + 100 added among 1,000",
      [&] {
        const std::set<std::string> active = Active(*router);
        return active.size() == 1000 && active.count("decode-0") == 0 && active.count("decode-1099") == 1;
      },
      absl::Seconds(60)));
  loop.Stop();
  EXPECT_EQ(loop.failures(), 0) << loop.last_error();
}

TEST_F(DiscoveryRouterTest, AnUnreachableApiServerLeavesTheRouterUpAndNotReady) {
  discovery::KubeApiConfig api = kube_->ApiConfig();
  absl::StatusOr<eldr::testing::ReservedLoopbackPort> dead = eldr::testing::ReservedLoopbackPort::Create();
  ASSERT_TRUE(dead.ok()) << dead.status();
  const std::string unused = absl::StrCat("https://", dead->address());
  const std::string path = dir_.path() + "/kubeconfig-unreachable";
  WriteTextFile(path, absl::StrCat("apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: x\n"
                                   "  cluster:\n    server: ",
                                   unused, "\n    certificate-authority: ", api.ca_file,
                                   "\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: c\n  context:\n"
                                   "    cluster: x\n    user: u\n"));
  std::vector<std::string> args = DiscoveryArgs(path);
  args.push_back("--policy=jsq");
  std::unique_ptr<RouterProcess> router = MustStart(dir_, args);
  ASSERT_NE(router, nullptr);
  ASSERT_TRUE(Converge("unreachable API server counted", [&] {
    absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(router->metrics_port());
    return metrics.ok() &&
           metrics->Value("eldr_discovery_errors_total", {{"role", "decode"}, {"kind", "unreachable"}}).value_or(0) > 0;
  }));
  EXPECT_TRUE(Pool(*router).empty());
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(router->HealthStub()->Check(Ctx().get(), request, &response).ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // A Route is answered (no worker: UNAVAILABLE), the daemon stays up.
  eldr::v1::RouteResponse routed;
  EXPECT_EQ(router->RouterStub()->Route(Ctx().get(), BlockRequest(0), &routed).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_FALSE(router->WaitForExit(absl::Milliseconds(200)).has_value());
}

TEST_F(DiscoveryRouterTest, ConfigurationMistakesFailAtStartWithTheReason) {
  struct Case {
    std::vector<std::string> extra;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--workers=w0=10.0.0.1:8000"}, "cannot be mixed with discovery=kubernetes"},
      {{"--decode_selector="}, "decode_selector"},
      {{"--kubeconfig=" + dir_.path() + "/missing"}, "kubeconfig"},
      {{"--worker_metrics_path=metrics"}, "worker_metrics_path"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = DiscoveryArgs(kubeconfig_);
    for (const std::string& extra : c.extra) args.push_back(extra);
    absl::StatusOr<std::unique_ptr<RouterProcess>> router = RouterProcess::Start(dir_, args, absl::Seconds(10));
    EXPECT_FALSE(router.ok()) << c.says;
    if (!router.ok()) EXPECT_THAT(std::string(router.status().message()), HasSubstr(c.says));
  }
}

}  // namespace
}  // namespace eldr::testing
