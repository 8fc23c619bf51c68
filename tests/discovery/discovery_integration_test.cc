// KubernetesDiscovery end to end against the stand-in API server (fake_kube_apiserver.py: HTTPS
// with its own CA, bearer token file, list/watch with bookmarks, faults), feeding a recording
// sink. Convergence times (from the control call to the sink call) are printed as
// "[ convergence ] ...". The Slow* test makes 1,000 pods.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "discovery/fake_kube.h"
#include "eldr/common/file.h"
#include "eldr/discovery/discovery.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"

namespace eldr::discovery {
namespace {

using eldr::testing::FakeKube;
using eldr::testing::FakeKubeOptions;
using eldr::testing::TempDir;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// The pool as the sink was told, and every call with its time.
class RecordingSink : public PoolSink {
 public:
  struct Worker {
    WorkerSpec spec;
    bool draining = false;
  };
  struct Call {
    std::string action;
    std::string id;
    std::string address;
    absl::Time at;
  };

  absl::Status Upsert(const WorkerSpec& spec) override {
    absl::MutexLock lock(&mu_);
    if (failures_left_ > 0) {
      --failures_left_;
      return absl::UnavailableError("sink refused (test)");
    }
    pool_[spec.id] = Worker{spec, false};
    calls_.push_back({"upsert", spec.id, spec.address, absl::Now()});
    return absl::OkStatus();
  }
  absl::Status Drain(const std::string& id) override {
    absl::MutexLock lock(&mu_);
    if (failures_left_ > 0) {
      --failures_left_;
      return absl::UnavailableError("sink refused (test)");
    }
    auto it = pool_.find(id);
    if (it == pool_.end()) return absl::NotFoundError(id);
    it->second.draining = true;
    calls_.push_back({"drain", id, "", absl::Now()});
    return absl::OkStatus();
  }
  absl::Status Remove(const std::string& id) override {
    absl::MutexLock lock(&mu_);
    if (failures_left_ > 0) {
      --failures_left_;
      return absl::UnavailableError("sink refused (test)");
    }
    if (pool_.erase(id) == 0) return absl::NotFoundError(id);
    calls_.push_back({"remove", id, "", absl::Now()});
    return absl::OkStatus();
  }

  void FailNext(int calls) {
    absl::MutexLock lock(&mu_);
    failures_left_ = calls;
  }

  std::map<std::string, Worker> Pool() const {
    absl::MutexLock lock(&mu_);
    return pool_;
  }
  std::vector<Call> Calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  int Count(const std::string& action) const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(
        std::count_if(calls_.begin(), calls_.end(), [&](const Call& c) { return c.action == action; }));
  }
  // The time of the first `action` on `id` at or after `since`.
  std::optional<absl::Time> FirstCall(const std::string& action, const std::string& id, absl::Time since) const {
    absl::MutexLock lock(&mu_);
    for (const Call& call : calls_) {
      if (call.action == action && call.id == id && call.at >= since) return call.at;
    }
    return std::nullopt;
  }

  bool WaitFor(const std::function<bool(const std::map<std::string, Worker>&)>& done,
               absl::Duration timeout = absl::Seconds(10)) const {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      if (done(Pool())) return true;
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, Worker> pool_ ABSL_GUARDED_BY(mu_);
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
  int failures_left_ ABSL_GUARDED_BY(mu_) = 0;
};

bool WaitUntil(const std::function<bool()>& done, absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

Json DecodePod(const std::string& name, bool ready = true) {
  return {{"name", name}, {"labels", {{"app", "decode"}}}, {"ready", ready}};
}

bool Routable(const std::map<std::string, RecordingSink::Worker>& pool, const std::string& id) {
  auto it = pool.find(id);
  return it != pool.end() && !it->second.draining;
}

class DiscoveryIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FakeKubeOptions options;
    options.tls_dir = dir_.File("tls");
    auto kube = FakeKube::Start(dir_, options);
    ASSERT_TRUE(kube.ok()) << kube.status();
    kube_ = std::move(*kube);
  }

  void TearDown() override {
    if (discovery_ != nullptr) discovery_->Stop();
    if (HasFailure()) {
      absl::MutexLock lock(&log_mu_);
      std::fprintf(stderr, "--- discovery log ---\n%s\n--- fake kube-apiserver log ---\n%s\n",
                   absl::StrJoin(logs_, "\n").c_str(), kube_ != nullptr ? kube_->process().Log().c_str() : "");
    }
  }

  KubernetesDiscoveryOptions Options() {
    KubernetesDiscoveryOptions options;
    options.api = kube_->ApiConfig();
    options.label_selector = "app=decode";
    options.mapping.port = "http";
    options.watcher.backoff.initial = absl::Milliseconds(100);
    options.watcher.backoff.max = absl::Seconds(1);
    options.watcher.silence_timeout = absl::Seconds(10);
    options.reconciler.settle = absl::Milliseconds(100);
    options.reconciler.retry_interval = absl::Milliseconds(100);
    options.role = "decode";
    options.log = [this](LogSeverity severity, const std::string& message) {
      absl::MutexLock lock(&log_mu_);
      logs_.push_back(absl::StrCat(absl::FormatTime("%H:%M:%E3S", absl::Now(), absl::LocalTimeZone()), " ",
                                   LogSeverityName(severity), " ", message));
    };
    return options;
  }

  void StartDiscovery(KubernetesDiscoveryOptions options) {
    auto discovery = KubernetesDiscovery::Create(std::move(options), &sink_, &registry_);
    ASSERT_TRUE(discovery.ok()) << discovery.status();
    discovery_ = std::move(*discovery);
    ASSERT_TRUE(discovery_->Start().ok());
  }
  void StartDiscovery() { StartDiscovery(Options()); }

  // Listed, and the watch is open on the server (so that faults reach it).
  void WaitSynced() {
    ASSERT_TRUE(WaitUntil([&] { return discovery_->Status().synced; })) << discovery_->Status().last_error;
    ASSERT_TRUE(WaitUntil([&] { return Stats()["open_watches"].get<int64_t>() >= 1; }));
  }

  // The value of series `name{role="decode", <labels>}`, or -1 when absent.
  double Metric(const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    for (const prometheus::MetricFamily& family : registry_.Collect()) {
      if (family.name != name) continue;
      for (const prometheus::ClientMetric& metric : family.metric) {
        std::map<std::string, std::string> have;
        for (const auto& label : metric.label) have[label.name] = label.value;
        if (have["role"] != "decode") continue;
        bool match = true;
        for (const auto& [key, value] : labels) match = match && have[key] == value;
        if (!match) continue;
        return family.type == prometheus::MetricType::Counter ? metric.counter.value : metric.gauge.value;
      }
    }
    return -1;
  }

  Json Stats() {
    auto stats = kube_->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : Json::object();
  }

  bool LogContains(const std::string& text) {
    absl::MutexLock lock(&log_mu_);
    return std::any_of(logs_.begin(), logs_.end(),
                       [&](const std::string& line) { return absl::StrContains(line, text); });
  }

  static void Report(const std::string& what, absl::Duration took) {
    std::printf("[ convergence ] %-44s %7.1f ms\n", what.c_str(), absl::ToDoubleMilliseconds(took));
  }

  TempDir dir_;
  std::unique_ptr<FakeKube> kube_;
  RecordingSink sink_;
  prometheus::Registry registry_;
  std::unique_ptr<KubernetesDiscovery> discovery_;
  absl::Mutex log_mu_;
  std::vector<std::string> logs_ ABSL_GUARDED_BY(log_mu_);
};

TEST_F(DiscoveryIntegrationTest, PodLifecycle) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-1", /*ready=*/false)).ok());
  ASSERT_TRUE(kube_->CreatePod({{"name", "prefill-0"}, {"labels", {{"app", "prefill"}}}, {"ready", true}}).ok());
  ASSERT_TRUE(
      kube_->CreatePod({{"name", "decode-pending"}, {"labels", {{"app", "decode"}}}, {"phase", "Pending"}}).ok());
  absl::Time t0 = absl::Now();
  StartDiscovery();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.count("decode-0") > 0; }));
  Report("start -> first worker upserted", *sink_.FirstCall("upsert", "decode-0", t0) - t0);
  WaitSynced();
  EXPECT_EQ(sink_.Pool().size(), 1u);  // not the not-ready, pending or prefill pods
  EXPECT_EQ(sink_.Pool().at("decode-0").spec.address.substr(0, 7), "10.244.");
  EXPECT_EQ(Metric("eldr_discovery_workers", {{"state", "ready"}}), 1);
  EXPECT_EQ(Metric("eldr_discovery_workers", {{"state", "not_ready"}}), 1);
  EXPECT_TRUE(LogContains("listed 3 pods"));

  // not ready -> ready: upserted once settled.
  t0 = absl::Now();
  ASSERT_TRUE(kube_->PatchPod("decode-1", {{"ready", true}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return Routable(pool, "decode-1"); }));
  const absl::Duration became_ready = *sink_.FirstCall("upsert", "decode-1", t0) - t0;
  Report("not ready -> ready (settle 100 ms)", became_ready);
  EXPECT_GE(became_ready, absl::Milliseconds(100));

  // A new pod.
  t0 = absl::Now();
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-2")).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return Routable(pool, "decode-2"); }));
  Report("new ready pod -> upsert (settle 100 ms)", *sink_.FirstCall("upsert", "decode-2", t0) - t0);

  // ready -> not ready: drained at once.
  t0 = absl::Now();
  ASSERT_TRUE(kube_->PatchPod("decode-2", {{"ready", false}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.at("decode-2").draining; }));
  Report("ready -> not ready -> drain", *sink_.FirstCall("drain", "decode-2", t0) - t0);

  // Terminating: drained; deleted: removed.
  t0 = absl::Now();
  ASSERT_TRUE(kube_->TerminatePod("decode-0").ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.at("decode-0").draining; }));
  Report("terminating -> drain", *sink_.FirstCall("drain", "decode-0", t0) - t0);
  EXPECT_TRUE(WaitUntil([&] { return Metric("eldr_discovery_workers", {{"state", "terminating"}}) == 1; }));
  t0 = absl::Now();
  ASSERT_TRUE(kube_->DeletePod("decode-0").ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.count("decode-0") == 0; }));
  Report("deleted -> remove", *sink_.FirstCall("remove", "decode-0", t0) - t0);

  // Replaced (same name, new uid and IP): removed at once, back with its new address.
  const std::string old_address = sink_.Pool().at("decode-1").spec.address;
  t0 = absl::Now();
  ASSERT_TRUE(kube_->ReplacePod("decode-1").ok());
  ASSERT_TRUE(sink_.WaitFor(
      [&](const auto& pool) { return Routable(pool, "decode-1") && pool.at("decode-1").spec.address != old_address; }));
  Report("replaced -> remove", *sink_.FirstCall("remove", "decode-1", t0) - t0);
  Report("replaced -> upsert new IP (settle 100 ms)", *sink_.FirstCall("upsert", "decode-1", t0) - t0);
  // The sink hears of the upsert first: the reconciler counts it after the sink call
  // (PoolReconciler::Call runs on_change after it), and the discovery publishes its applied set
  // after the reconciler's round (ReconcileLoop). Wait for both before reading them.
  ASSERT_TRUE(WaitUntil([&] {
    return discovery_->Status().applied == 2u &&
           Metric("eldr_discovery_pool_changes_total", {{"action", "upsert"}}) >= 4;
  })) << "applied "
      << discovery_->Status().applied << ", upserts counted "
      << Metric("eldr_discovery_pool_changes_total", {{"action", "upsert"}});

  const DiscoveryStatus status = discovery_->Status();
  EXPECT_TRUE(status.started);
  EXPECT_TRUE(status.synced);
  EXPECT_EQ(status.applied, 2u);
  EXPECT_EQ(status.watcher.lists, 1);
  EXPECT_EQ(Metric("eldr_discovery_synced"), 1);
  EXPECT_GE(Metric("eldr_discovery_pool_changes_total", {{"action", "upsert"}}), 4);
  EXPECT_EQ(Metric("eldr_discovery_pool_changes_total", {{"action", "remove"}}), 2);
  EXPECT_EQ(Metric("eldr_discovery_pool_changes_total", {{"action", "drain"}}), 2);
  EXPECT_GE(Metric("eldr_discovery_last_sync_age_seconds"), 0);
  EXPECT_LT(Metric("eldr_discovery_last_sync_age_seconds"), 5);
  EXPECT_EQ(Metric("eldr_discovery_errors_total", {{"kind", "unreachable"}}), 0);
  EXPECT_TRUE(LogContains("pool remove decode-0"));
}

TEST_F(DiscoveryIntegrationTest, DroppedWatchResumesFromLastResourceVersion) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  StartDiscovery();
  WaitSynced();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 1; }));
  const int64_t lists = Stats()["list_requests"].get<int64_t>();
  const int64_t watches = Stats()["watch_requests"].get<int64_t>();

  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(kube_->Faults({{"drop_watches", true}}).ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-1")).ok());  // while no watch is open, maybe
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.count("decode-1") > 0; }));
  Report("watch dropped + pod created -> upsert (settle 100 ms)", *sink_.FirstCall("upsert", "decode-1", t0) - t0);

  const Json stats = Stats();
  EXPECT_EQ(stats["list_requests"].get<int64_t>(), lists);  // no relist
  EXPECT_GT(stats["watch_requests"].get<int64_t>(), watches);
  const std::string last_query = stats["watch_queries"].back().get<std::string>();
  EXPECT_THAT(last_query, HasSubstr("resourceVersion=1"));  // resumed from a version (>= 1000)
  EXPECT_THAT(last_query, HasSubstr("allowWatchBookmarks=true"));
  EXPECT_THAT(last_query, HasSubstr("labelSelector=app%3Ddecode"));
  EXPECT_GE(Metric("eldr_discovery_watch_restarts_total", {{"reason", "error"}}), 1);
  EXPECT_EQ(sink_.Count("remove"), 0);
  EXPECT_EQ(discovery_->Status().watcher.lists, 1);
}

TEST_F(DiscoveryIntegrationTest, WatchClosedByTheServerIsResumed) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  KubernetesDiscoveryOptions options = Options();
  options.watcher.watch_timeout = absl::Seconds(1);  // timeoutSeconds=1 (jittered +-20%, rounded)
  StartDiscovery(options);
  WaitSynced();
  ASSERT_TRUE(WaitUntil([&] { return Metric("eldr_discovery_watch_restarts_total", {{"reason", "closed"}}) >= 2; }));
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-1")).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 2; }));
  const Json stats = Stats();
  EXPECT_EQ(stats["list_requests"].get<int64_t>(), 1);
  EXPECT_GE(stats["watch_requests"].get<int64_t>(), 3);
  EXPECT_THAT(stats["watch_queries"].back().get<std::string>(), HasSubstr("timeoutSeconds=1"));
  EXPECT_EQ(Metric("eldr_discovery_errors_total", {{"kind", "unreachable"}}), 0);
  EXPECT_TRUE(discovery_->Status().synced);
}

TEST_F(DiscoveryIntegrationTest, ExpiredContinueTokenRestartsTheList) {
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(kube_->CreatePod(DecodePod(absl::StrCat("decode-", i))).ok());
  ASSERT_TRUE(kube_->Faults({{"delay_ms", 300}}).ok());
  KubernetesDiscoveryOptions options = Options();
  options.watcher.list_page_size = 2;
  StartDiscovery(options);
  // While the second page is on its way, the snapshot of the first one is compacted away.
  ASSERT_TRUE(WaitUntil([&] { return Stats()["list_requests"].get<int64_t>() >= 1; }));
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-5")).ok());
  ASSERT_TRUE(kube_->Faults({{"compact", true}, {"delay_ms", 0}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 6; }));
  const DiscoveryStatus status = discovery_->Status();
  EXPECT_EQ(status.watcher.lists, 1);
  EXPECT_EQ(status.watcher.list_failures, 0);   // restarted at once, not a failure
  EXPECT_EQ(status.watcher.list_pages, 2 + 3);  // page 1, the expired page 2, then 3 pages of 6
  EXPECT_EQ(Stats()["list_requests"].get<int64_t>(), 5);
}

TEST_F(DiscoveryIntegrationTest, CompactionMakesTheWatchGoneAndRelists) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-1")).ok());
  StartDiscovery();
  WaitSynced();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 2; }));
  const int64_t lists = Stats()["list_requests"].get<int64_t>();
  // The watch misses a deletion (stalled), the history is compacted past it, the watch drops:
  // resuming is impossible (410), so discovery relists and finds the pod gone.
  ASSERT_TRUE(kube_->Faults({{"stall_watches", true}}).ok());
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(kube_->DeletePod("decode-1").ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-2")).ok());
  ASSERT_TRUE(kube_->Faults({{"compact", true}}).ok());
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(kube_->Faults({{"drop_watches", true}, {"stall_watches", false}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.count("decode-1") == 0 && pool.count("decode-2"); }));
  Report("compacted + dropped -> relist -> remove", *sink_.FirstCall("remove", "decode-1", t0) - t0);
  EXPECT_EQ(Stats()["list_requests"].get<int64_t>(), lists + 1);
  EXPECT_EQ(Metric("eldr_discovery_watch_restarts_total", {{"reason", "gone"}}), 1);
  EXPECT_EQ(discovery_->Status().watcher.lists, 2);
  EXPECT_TRUE(Routable(sink_.Pool(), "decode-0"));
  EXPECT_EQ(sink_.Count("remove"), 1);  // decode-0 never left the pool
}

TEST_F(DiscoveryIntegrationTest, ApiDownKeepsThePoolThenConverges) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(kube_->CreatePod(DecodePod(absl::StrCat("decode-", i))).ok());
  StartDiscovery();
  WaitSynced();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 3; }));
  ASSERT_TRUE(kube_->Faults({{"down", true}}).ok());
  ASSERT_TRUE(WaitUntil([&] { return !discovery_->Status().synced; }, absl::Seconds(5)));
  ASSERT_TRUE(kube_->DeletePod("decode-2").ok());  // the cluster changes during the outage
  absl::SleepFor(absl::Seconds(2));
  EXPECT_EQ(sink_.Pool().size(), 3u);  // nothing removed because the API server is unreachable
  EXPECT_EQ(sink_.Count("remove") + sink_.Count("drain"), 0);
  EXPECT_GE(Metric("eldr_discovery_errors_total", {{"kind", "unreachable"}}), 2);
  EXPECT_EQ(Metric("eldr_discovery_synced"), 0);
  EXPECT_GE(Metric("eldr_discovery_last_sync_age_seconds"), 1.5);
  EXPECT_THAT(discovery_->Status().last_error, HasSubstr("refused"));

  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(kube_->Faults({{"down", false}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 2; }));
  Report("API back after 2 s outage -> remove (backoff <= 1 s)", *sink_.FirstCall("remove", "decode-2", t0) - t0);
  EXPECT_TRUE(WaitUntil([&] { return discovery_->Status().synced; }));
  EXPECT_EQ(discovery_->Status().watcher.lists, 1);  // resumed from the history, no relist
}

TEST_F(DiscoveryIntegrationTest, GarbageWatchLinesNeverReachThePool) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(kube_->CreatePod(DecodePod(absl::StrCat("decode-", i))).ok());
  StartDiscovery();
  WaitSynced();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 3; }));
  ASSERT_TRUE(kube_->Faults({{"garbage", "watch"}}).ok());
  ASSERT_TRUE(kube_->Faults({{"drop_watches", true}}).ok());
  ASSERT_TRUE(WaitUntil([&] { return Metric("eldr_discovery_watch_restarts_total", {{"reason", "parse"}}) >= 3; }));
  EXPECT_GE(Metric("eldr_discovery_errors_total", {{"kind", "parse"}}), 3);
  EXPECT_EQ(sink_.Pool().size(), 3u);
  EXPECT_EQ(sink_.Count("remove") + sink_.Count("drain"), 0);
  EXPECT_EQ(discovery_->Status().watcher.lists, 1);
  // Events before the garbage still count: a change made now is seen by the next watch.
  ASSERT_TRUE(kube_->PatchPod("decode-0", {{"ready", false}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.at("decode-0").draining; }));
  ASSERT_TRUE(kube_->Faults({{"garbage", "off"}}).ok());
  ASSERT_TRUE(kube_->PatchPod("decode-0", {{"ready", true}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return Routable(pool, "decode-0"); }));
  EXPECT_TRUE(WaitUntil([&] { return discovery_->Status().synced; }));
}

TEST_F(DiscoveryIntegrationTest, GarbageListKeepsTheLastSet) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(kube_->CreatePod(DecodePod(absl::StrCat("decode-", i))).ok());
  StartDiscovery();
  WaitSynced();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 3; }));
  // Force a relist (missed event + compaction + drop) while lists answer garbage (HTML, then a
  // truncated PodList, alternately).
  ASSERT_TRUE(kube_->Faults({{"garbage", "list"}, {"stall_watches", true}}).ok());
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(kube_->DeletePod("decode-2").ok());
  ASSERT_TRUE(kube_->Faults({{"compact", true}}).ok());
  ASSERT_TRUE(kube_->Faults({{"drop_watches", true}, {"stall_watches", false}}).ok());
  ASSERT_TRUE(WaitUntil([&] { return discovery_->Status().watcher.list_failures >= 3; }));
  EXPECT_EQ(sink_.Pool().size(), 3u);  // never emptied, never changed by garbage
  EXPECT_EQ(sink_.Count("remove") + sink_.Count("drain"), 0);
  EXPECT_GE(Metric("eldr_discovery_errors_total", {{"kind", "parse"}}), 3);
  EXPECT_EQ(Metric("eldr_discovery_synced"), 0);
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(kube_->Faults({{"garbage", "off"}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 2; }));
  Report("garbage lists off -> relist -> remove", *sink_.FirstCall("remove", "decode-2", t0) - t0);
  EXPECT_EQ(discovery_->Status().watcher.lists, 2);
}

TEST_F(DiscoveryIntegrationTest, StalledWatchIsRestartedAfterSilence) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  KubernetesDiscoveryOptions options = Options();
  options.watcher.silence_timeout = absl::Milliseconds(1500);  // bookmarks come every 0.5 s
  StartDiscovery(options);
  WaitSynced();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 1; }));
  absl::SleepFor(absl::Seconds(2));
  EXPECT_EQ(Metric("eldr_discovery_watch_restarts_total", {{"reason", "silence"}}), 0);  // bookmarks keep it alive
  const absl::Time stalled = absl::Now();
  ASSERT_TRUE(kube_->Faults({{"stall_watches", true}}).ok());
  ASSERT_TRUE(WaitUntil([&] { return Metric("eldr_discovery_watch_restarts_total", {{"reason", "silence"}}) >= 1; }));
  Report("stalled watch -> silence restart (1.5 s limit)", absl::Now() - stalled);
  // Silence counts from the last byte: a bookmark up to 0.5 s before the stall.
  EXPECT_GE(absl::Now() - stalled, absl::Milliseconds(900));
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-1")).ok());
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(kube_->Faults({{"stall_watches", false}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 2; }));
  Report("stall lifted -> upsert", *sink_.FirstCall("upsert", "decode-1", t0) - t0);
  EXPECT_EQ(sink_.Count("remove"), 0);
}

TEST_F(DiscoveryIntegrationTest, TokenRotation) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  StartDiscovery();
  WaitSynced();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 1; }));
  for (int round = 1; round <= 3; ++round) {
    ASSERT_TRUE(kube_->WriteToken(absl::StrCat("rotated-", round)).ok());
    ASSERT_TRUE(kube_->Faults({{"drop_watches", true}}).ok());  // the next watch authenticates anew
    const std::string name = absl::StrCat("decode-", round);
    ASSERT_TRUE(kube_->CreatePod(DecodePod(name)).ok());
    ASSERT_TRUE(sink_.WaitFor([&](const auto& pool) { return pool.count(name) > 0; })) << round;
  }
  EXPECT_EQ(Stats()["unauthorized"].get<int64_t>(), 0);
  EXPECT_EQ(Metric("eldr_discovery_errors_total", {{"kind", "auth"}}), 0);
}

TEST_F(DiscoveryIntegrationTest, AuthAndServerErrorsAreCountedAndRetried) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  StartDiscovery();
  WaitSynced();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 1; }));
  ASSERT_TRUE(kube_->Faults({{"status_code", 401}, {"drop_watches", true}}).ok());
  ASSERT_TRUE(WaitUntil([&] { return Metric("eldr_discovery_errors_total", {{"kind", "auth"}}) >= 2; }));
  ASSERT_TRUE(kube_->Faults({{"status_code", 503}, {"drop_watches", true}}).ok());
  ASSERT_TRUE(WaitUntil([&] { return Metric("eldr_discovery_errors_total", {{"kind", "http"}}) >= 2; }));
  EXPECT_THAT(discovery_->Status().last_error, HasSubstr("HTTP 503"));
  EXPECT_EQ(sink_.Pool().size(), 1u);
  ASSERT_TRUE(kube_->Faults({{"status_code", 0}}).ok());
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-1")).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 2; }));
}

TEST_F(DiscoveryIntegrationTest, AnnotationsAndPagination) {
  for (int i = 0; i < 7; ++i) {
    Json pod = DecodePod(absl::StrCat("decode-", i));
    pod["ports"] =
        Json::array({{{"name", "http"}, {"containerPort", 8000}}, {{"name", "metrics"}, {"containerPort", 9090}}});
    if (i == 0) pod["annotations"] = {{"eldr.io/capacity", "4"}, {"eldr.io/max-inflight", "32"}};
    if (i == 1) pod["annotations"] = {{"eldr.io/capacity", "lots"}, {"eldr.io/metrics-port", "none"}};
    ASSERT_TRUE(kube_->CreatePod(pod).ok());
  }
  KubernetesDiscoveryOptions options = Options();
  options.watcher.list_page_size = 3;
  options.mapping.metrics_port = "metrics";
  StartDiscovery(options);
  WaitSynced();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 7; }));
  EXPECT_EQ(Stats()["list_requests"].get<int64_t>(), 3);  // 3 + 3 + 1
  EXPECT_EQ(discovery_->Status().watcher.list_pages, 3);
  const auto pool = sink_.Pool();
  EXPECT_EQ(pool.at("decode-0").spec.capacity, 4);
  EXPECT_EQ(pool.at("decode-0").spec.max_inflight, 32);
  EXPECT_THAT(pool.at("decode-0").spec.metrics_url, HasSubstr(":9090/metrics"));
  EXPECT_EQ(pool.at("decode-1").spec.capacity, 1);  // the default, with a problem counted
  EXPECT_EQ(pool.at("decode-1").spec.metrics_url, "");
  EXPECT_EQ(Metric("eldr_discovery_errors_total", {{"kind", "annotation"}}), 1);
  EXPECT_TRUE(LogContains("eldr.io/capacity=\"lots\" ignored"));
  // A change that starts routing waits for settle; an annotation change of a ready pod too.
  ASSERT_TRUE(kube_->PatchPod("decode-2", {{"annotations", {{"eldr.io/capacity", "2"}}}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.at("decode-2").spec.capacity == 2; }));
  // The problem is counted once, not at every event.
  ASSERT_TRUE(kube_->PatchPod("decode-3", {{"ready", false}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.at("decode-3").draining; }));
  EXPECT_EQ(Metric("eldr_discovery_errors_total", {{"kind", "annotation"}}), 1);
}

TEST_F(DiscoveryIntegrationTest, SinkFailuresAreRetried) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  sink_.FailNext(3);
  StartDiscovery();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 1; }));
  EXPECT_EQ(Metric("eldr_discovery_errors_total", {{"kind", "sink"}}), 3);
  EXPECT_TRUE(LogContains("pool upsert decode-0 failed (retried): sink refused"));
}

TEST_F(DiscoveryIntegrationTest, StopIsPrompt) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  StartDiscovery();
  WaitSynced();
  ASSERT_TRUE(WaitUntil([&] { return Stats()["open_watches"] == 1; }));
  absl::Time start = absl::Now();
  discovery_->Stop();
  const absl::Duration mid_watch = absl::Now() - start;
  EXPECT_LT(mid_watch, absl::Seconds(1));
  EXPECT_FALSE(discovery_->Status().started);
  EXPECT_TRUE(WaitUntil([&] { return Stats()["open_watches"] == 0; }));

  // Restart, then stop in the middle of a backoff delay (API down, backoff up to 30 s).
  ASSERT_TRUE(discovery_->Start().ok());
  ASSERT_TRUE(kube_->Faults({{"down", true}}).ok());
  ASSERT_TRUE(WaitUntil([&] { return discovery_->Status().watcher.errors[0] >= 1; }));
  absl::SleepFor(absl::Milliseconds(50));
  start = absl::Now();
  discovery_->Stop();
  const absl::Duration mid_backoff = absl::Now() - start;
  EXPECT_LT(mid_backoff, absl::Seconds(1));
  std::printf("[ stop ] mid-watch %.1f ms, mid-backoff %.1f ms\n", absl::ToDoubleMilliseconds(mid_watch),
              absl::ToDoubleMilliseconds(mid_backoff));

  // And in the middle of a slow list.
  ASSERT_TRUE(kube_->Faults({{"down", false}, {"delay_ms", 5000}}).ok());
  ASSERT_TRUE(discovery_->Start().ok());
  absl::SleepFor(absl::Milliseconds(300));
  start = absl::Now();
  discovery_->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  ASSERT_TRUE(kube_->Faults({{"delay_ms", 0}}).ok());
}

TEST_F(DiscoveryIntegrationTest, RefusesBadOptions) {
  KubernetesDiscoveryOptions options = Options();
  options.label_selector.clear();
  EXPECT_THAT(KubernetesDiscovery::Create(options, &sink_, nullptr).status().message(), HasSubstr("label selector"));
  options = Options();
  options.api.namespace_.clear();
  EXPECT_THAT(KubernetesDiscovery::Create(options, &sink_, nullptr).status().message(), HasSubstr("namespace"));
  options = Options();
  options.mapping.port.clear();
  EXPECT_FALSE(KubernetesDiscovery::Create(options, &sink_, nullptr).ok());
  options = Options();
  EXPECT_FALSE(KubernetesDiscovery::Create(options, nullptr, nullptr).ok());
  options.role.clear();
  EXPECT_FALSE(KubernetesDiscovery::Create(options, &sink_, nullptr).ok());
  // Without a registry it still works.
  auto discovery = KubernetesDiscovery::Create(Options(), &sink_, nullptr);
  ASSERT_TRUE(discovery.ok()) << discovery.status();
}

TEST_F(DiscoveryIntegrationTest, WrongCaIsATlsError) {
  // The fake's CA verifies its certificate; the system trust store does not.
  KubernetesDiscoveryOptions options = Options();
  options.api.ca_file.clear();
  StartDiscovery(options);
  ASSERT_TRUE(WaitUntil([&] { return discovery_->Status().watcher.list_failures >= 1; }));
  EXPECT_TRUE(WaitUntil([&] { return absl::StrContains(discovery_->Status().last_error, "does not verify"); }))
      << discovery_->Status().last_error;
  EXPECT_GE(Metric("eldr_discovery_errors_total", {{"kind", "unreachable"}}), 1);
  EXPECT_FALSE(discovery_->Status().synced);
}

TEST_F(DiscoveryIntegrationTest, KubeconfigAndInClusterConfigsReachTheStandIn) {
  ASSERT_TRUE(kube_->CreatePod(DecodePod("decode-0")).ok());
  const KubeApiConfig api = kube_->ApiConfig();
  absl::StatusOr<std::string> ca = ReadFile(api.ca_file);
  ASSERT_TRUE(ca.ok()) << ca.status();
  absl::StatusOr<std::string> token = ReadFile(api.token_file);
  ASSERT_TRUE(token.ok());

  // A kubeconfig with the CA inline (certificate-authority-data) and a relative tokenFile.
  std::filesystem::create_directories(dir_.File("kube"));
  std::filesystem::create_directories(dir_.File("sa"));
  ASSERT_TRUE(WriteFileAtomically(dir_.File("kube/token"), *token).ok());
  const std::string kubeconfig = absl::StrCat(R"(apiVersion: v1
kind: Config
current-context: test
clusters:
- name: fake
  cluster:
    server: )",
                                              api.server, R"(
    certificate-authority-data: )",
                                              absl::Base64Escape(*ca), R"(
users:
- name: sa
  user:
    tokenFile: token
contexts:
- name: test
  context: {cluster: fake, user: sa, namespace: default}
)");
  ASSERT_TRUE(WriteFileAtomically(dir_.File("kube/config"), kubeconfig).ok());
  absl::StatusOr<KubeApiConfig> from_kubeconfig = LoadKubeconfig(dir_.File("kube/config"));
  ASSERT_TRUE(from_kubeconfig.ok()) << from_kubeconfig.status();
  EXPECT_FALSE(from_kubeconfig->ca_pem.empty());
  KubernetesDiscoveryOptions options = Options();
  options.api = *from_kubeconfig;
  StartDiscovery(options);
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 1; }));
  discovery_->Stop();

  // The service-account layout of a pod.
  ASSERT_TRUE(WriteFileAtomically(dir_.File("sa/token"), *token).ok());
  ASSERT_TRUE(WriteFileAtomically(dir_.File("sa/ca.crt"), *ca).ok());
  ASSERT_TRUE(WriteFileAtomically(dir_.File("sa/namespace"), "default\n").ok());
  const std::string port = api.server.substr(api.server.rfind(':') + 1);
  absl::StatusOr<KubeApiConfig> in_cluster =
      InClusterConfig(dir_.File("sa"), [&](const std::string& name) -> std::optional<std::string> {
        if (name == "KUBERNETES_SERVICE_HOST") return "127.0.0.1";
        if (name == "KUBERNETES_SERVICE_PORT") return port;
        return std::nullopt;
      });
  ASSERT_TRUE(in_cluster.ok()) << in_cluster.status();
  RecordingSink second;
  options = Options();
  options.api = *in_cluster;
  auto discovery = KubernetesDiscovery::Create(options, &second, nullptr);
  ASSERT_TRUE(discovery.ok()) << discovery.status();
  ASSERT_TRUE((*discovery)->Start().ok());
  EXPECT_TRUE(second.WaitFor([](const auto& pool) { return pool.size() == 1; }));
  (*discovery)->Stop();
}

TEST_F(DiscoveryIntegrationTest, SlowThousandPods) {
  // 1,000 pods at start (two list pages of 500), then 1,000 more in one go over the watch.
  Json first = Json::array();
  Json second = Json::array();
  for (int i = 0; i < 1000; ++i) {
    first.push_back(DecodePod(absl::StrCat("decode-a", i)));
    second.push_back(DecodePod(absl::StrCat("decode-b", i)));
  }
  ASSERT_TRUE(kube_->Call("POST", "/pods/bulk", {{"pods", first}}).ok());
  absl::Time t0 = absl::Now();
  StartDiscovery();
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 1000; }, absl::Seconds(30)));
  Report("start -> 1000 listed pods upserted", absl::Now() - t0);
  EXPECT_EQ(Stats()["list_requests"].get<int64_t>(), 2);
  t0 = absl::Now();
  ASSERT_TRUE(kube_->Call("POST", "/pods/bulk", {{"pods", second}}).ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.size() == 2000; }, absl::Seconds(30)));
  Report("bulk +1000 over the watch -> all upserted", absl::Now() - t0);
  EXPECT_EQ(sink_.Count("upsert"), 2000);
  EXPECT_EQ(Metric("eldr_discovery_workers", {{"state", "ready"}}), 2000);
  // A single change among 2,000 still converges quickly.
  t0 = absl::Now();
  ASSERT_TRUE(kube_->DeletePod("decode-a500").ok());
  ASSERT_TRUE(sink_.WaitFor([](const auto& pool) { return pool.count("decode-a500") == 0; }));
  Report("one delete among 2000 -> remove", *sink_.FirstCall("remove", "decode-a500", t0) - t0);
}

}  // namespace
}  // namespace eldr::discovery
