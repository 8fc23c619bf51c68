#include "eldr/common/file.h"
#include "server/config.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "eldr/core/centroid_artifact.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/refit_component.h"

namespace eldr::server {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) { return absl::StrCat(::testing::TempDir(), "/", name); }

TEST(WorkerList, InlineListKeepsOrderAndDefaults) {
  auto workers = ParseWorkerList(" a=10.0.0.1:8000, b=10.0.0.2:8000 ,c=decode-2.svc:9000");
  ASSERT_TRUE(workers.ok()) << workers.status();
  ASSERT_EQ(workers->size(), 3u);
  EXPECT_EQ((*workers)[0].id, "a");
  EXPECT_EQ((*workers)[1].address, "10.0.0.2:8000");
  EXPECT_EQ((*workers)[2].address, "decode-2.svc:9000");
  EXPECT_DOUBLE_EQ((*workers)[2].capacity, 1.0);
  EXPECT_EQ((*workers)[2].max_inflight, 0);
}

TEST(WorkerList, InlineErrorsNameTheProblem) {
  EXPECT_THAT(ParseWorkerList("a=h:1,a=h:2").status().message(), HasSubstr("duplicate worker id 'a'"));
  EXPECT_THAT(ParseWorkerList("a=h:1,=h:2").status().message(), HasSubstr("'=h:2' is not id=host:port"));
  EXPECT_THAT(ParseWorkerList("a=").status().message(), HasSubstr("is not id=host:port"));
  EXPECT_THAT(ParseWorkerList("a=h:1,b").status().message(), HasSubstr("'b' is not id=host:port"));
}

TEST(WorkerList, JsonFileInBothShapes) {
  const std::string array = TempPath("workers_array.json");
  ASSERT_TRUE(WriteFileAtomically(array, R"([{"id": "w0", "address": "h0:1", "capacity": 2},
                                            {"id": "w1", "address": "h1:1", "max_inflight": 16}])")
                  .ok());
  auto workers = ParseWorkerList(array);
  ASSERT_TRUE(workers.ok()) << workers.status();
  ASSERT_EQ(workers->size(), 2u);
  EXPECT_DOUBLE_EQ((*workers)[0].capacity, 2);
  EXPECT_EQ((*workers)[1].max_inflight, 16);

  auto wrapped = ParseWorkerJson(R"({"workers": [{"id": "x", "address": "h:1"}]})");
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  EXPECT_EQ((*wrapped)[0].id, "x");
}

TEST(WorkerList, JsonErrorsNameTheWorkerAndField) {
  EXPECT_THAT(ParseWorkerJson("[{\"id\": \"a\"}]").status().message(), HasSubstr("address must not be empty"));
  EXPECT_THAT(ParseWorkerJson(R"([{"id": "a", "address": "h:1", "capacity": 0}])").status().message(),
              HasSubstr("worker 'a': capacity must be a finite number > 0"));
  EXPECT_THAT(ParseWorkerJson(R"([{"id": "a", "address": "h:1", "max_inflight": -1}])").status().message(),
              HasSubstr("max_inflight must be >= 0"));
  EXPECT_THAT(ParseWorkerJson(R"([{"id": "a", "address": "h:1", "capcity": 2}])").status().message(),
              HasSubstr("unknown key 'capcity'"));
  EXPECT_THAT(ParseWorkerJson(R"([{"id": 3, "address": "h:1"}])").status().message(),
              HasSubstr("'id' must be a string"));
  EXPECT_THAT(ParseWorkerJson("[1, 2").status().message(), HasSubstr("not valid JSON"));
  EXPECT_THAT(ParseWorkerJson(R"({"pool": []})").status().message(), HasSubstr("'workers'"));
  const auto missing = ParseWorkerList(TempPath("no-such-workers.json"));
  EXPECT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("no-such-workers.json"));
}

TEST(ConfigJson, SetsEveryKindOfValue) {
  ServerOptions o;
  ASSERT_TRUE(ApplyConfigJson(R"({
      "listen": "127.0.0.1:7000", "policy": "p2c", "tau": 0.25, "lease_ttl": 90,
      "snapshot_staleness": "1500ms", "seed": 123, "keepalive_permit_without_calls": false,
      "max_message_bytes": 65536, "max_connection_age": "inf", "log_level": "debug",
      "workers": [{"id": "a", "address": "h:1"}]})",
                              &o)
                  .ok());
  EXPECT_EQ(o.listen, "127.0.0.1:7000");
  EXPECT_EQ(o.policy, PolicyKind::kP2c);
  EXPECT_DOUBLE_EQ(o.tau, 0.25);
  EXPECT_EQ(o.lease_ttl, absl::Seconds(90));
  EXPECT_EQ(o.snapshot_staleness, absl::Milliseconds(1500));
  EXPECT_EQ(o.seed, 123u);
  EXPECT_FALSE(o.keepalive_permit_without_calls);
  EXPECT_EQ(o.max_message_bytes, 65536);
  EXPECT_EQ(o.max_connection_age, absl::InfiniteDuration());
  EXPECT_EQ(o.log_level, LogLevel::kDebug);
  ASSERT_EQ(o.workers.size(), 1u);
  // Settings absent from the file keep their value.
  EXPECT_EQ(o.metrics_listen, ServerOptions().metrics_listen);
}

TEST(ConfigJson, ErrorsNameTheSetting) {
  ServerOptions o;
  EXPECT_THAT(ApplyConfigJson(R"({"tua": 0.1})", &o).message(), HasSubstr("unknown setting 'tua'"));
  EXPECT_THAT(ApplyConfigJson(R"({"tau": "wide"})", &o).message(), HasSubstr("'tau'"));
  EXPECT_THAT(ApplyConfigJson(R"({"tau": [1]})", &o).message(), HasSubstr("'tau'"));
  EXPECT_THAT(ApplyConfigJson(R"({"policy": "fastest"})", &o).message(), HasSubstr("eldr, rr, random, jsq or p2c"));
  EXPECT_THAT(ApplyConfigJson(R"({"lease_ttl": "soon"})", &o).message(), HasSubstr("duration"));
  EXPECT_THAT(ApplyConfigJson(R"({"seed": -1})", &o).message(), HasSubstr("'seed'"));
  EXPECT_THAT(ApplyConfigJson("[]", &o).message(), HasSubstr("JSON object"));
  EXPECT_THAT(ApplyConfigJson("{", &o).message(), HasSubstr("not valid JSON"));
  EXPECT_THAT(ApplyConfigFile(TempPath("no-such-config.json"), &o).message(), HasSubstr("no-such-config.json"));
}

TEST(ConfigJson, FlagsAppliedAfterTheFileWin) {
  // main() applies the file, then each flag given on the command line through SetServerOption.
  ServerOptions o;
  ASSERT_TRUE(ApplyConfigJson(R"({"tau": 0.3, "policy": "jsq"})", &o).ok());
  ASSERT_TRUE(SetServerOption("tau", "0.2", &o).ok());
  EXPECT_DOUBLE_EQ(o.tau, 0.2);
  EXPECT_EQ(o.policy, PolicyKind::kJsq);
  EXPECT_FALSE(SetServerOption("no_such_flag", "1", &o).ok());
}

TEST(ConfigJson, EffectiveSettingsRoundTrip) {
  // The JSON dump of any settings applies back to the same settings: every key is settable and
  // printed in a form its parser accepts.
  ServerOptions o;
  ASSERT_TRUE(ApplyConfigJson(R"({"policy": "rr", "tau": 0.7, "lease_ttl": "42s", "seed": 99,
                                  "max_connection_idle": "5m", "log_format": "json",
                                  "workers": [{"id": "a", "address": "h:1", "capacity": 3}]})",
                              &o)
                  .ok());
  const std::string dumped = ServerOptionsToJson(o);
  const nlohmann::json j = nlohmann::json::parse(dumped);
  for (const std::string& key : ServerOptionKeys()) EXPECT_TRUE(j.contains(key)) << key;
  ServerOptions back;
  ASSERT_TRUE(ApplyConfigJson(dumped, &back).ok()) << dumped;
  EXPECT_EQ(ServerOptionsToJson(back), dumped);
}

TEST(Validation, DefaultsAreValidAndRangesAreChecked) {
  EXPECT_TRUE(ValidateServerOptions(ServerOptions()).ok());
  auto check = [](auto mutate, const std::string& setting) {
    ServerOptions o;
    mutate(o);
    const absl::Status s = ValidateServerOptions(o);
    EXPECT_FALSE(s.ok()) << setting;
    EXPECT_THAT(s.message(), HasSubstr("'" + setting + "'"));
  };
  check([](ServerOptions& o) { o.tau = 1.5; }, "tau");
  check([](ServerOptions& o) { o.tau = -0.1; }, "tau");
  check([](ServerOptions& o) { o.lease_ttl = absl::ZeroDuration(); }, "lease_ttl");
  check([](ServerOptions& o) { o.tls_cert = "c.pem"; }, "tls_key");
  check([](ServerOptions& o) { o.tls_key = "k.pem"; }, "tls_cert");
  check([](ServerOptions& o) { o.tls_client_ca = "ca.pem"; }, "tls_client_ca");
  check([](ServerOptions& o) { o.max_message_bytes = 100; }, "max_message_bytes");
  check([](ServerOptions& o) { o.max_concurrent_streams = 0; }, "max_concurrent_streams");
  check([](ServerOptions& o) { o.keepalive_time = absl::ZeroDuration(); }, "keepalive_time");
  check([](ServerOptions& o) { o.shutdown_grace = -absl::Seconds(1); }, "shutdown_grace");
  check([](ServerOptions& o) { o.shutdown_drain_delay = absl::InfiniteDuration(); }, "shutdown_drain_delay");
  check([](ServerOptions& o) { o.admin_listen = o.listen; }, "admin_listen");
  check([](ServerOptions& o) { o.workers = {WorkerSpec{"a", "h:1"}, WorkerSpec{"a", "h:2"}}; }, "workers");

  ServerOptions both_ephemeral;
  both_ephemeral.listen = "127.0.0.1:0";
  both_ephemeral.admin_listen = "127.0.0.1:0";
  EXPECT_TRUE(ValidateServerOptions(both_ephemeral).ok());
}

TEST(RefitSettings, ParsedCheckedAndDecideWhetherRefitRuns) {
  ServerOptions o;
  EXPECT_EQ(o.refit_window_s, 60);
  EXPECT_EQ(o.refit_interval_s, 10);
  EXPECT_TRUE(RefitEnabled(o));
  ASSERT_TRUE(ApplyConfigJson(R"({"refit_window_s": 5, "refit_interval_s": 0})", &o).ok());
  EXPECT_EQ(o.refit_window_s, 5);
  EXPECT_EQ(o.refit_interval_s, 0);
  EXPECT_FALSE(RefitEnabled(o));  // no periodic refit and nothing to persist: no refitter at all
  ASSERT_TRUE(SetServerOption("state_dir", "/var/lib/eldr", &o).ok());
  EXPECT_EQ(o.state_dir, "/var/lib/eldr");
  EXPECT_TRUE(RefitEnabled(o));  // pool changes still refit, and learnt centroids persist

  ServerOptions bad;
  bad.refit_window_s = 0;
  EXPECT_THAT(ValidateServerOptions(bad).message(), HasSubstr("'refit_window_s'"));
  bad = ServerOptions();
  bad.refit_interval_s = -1;
  EXPECT_THAT(ValidateServerOptions(bad).message(), HasSubstr("'refit_interval_s'"));
  EXPECT_THAT(SetServerOption("refit_interval_s", "soon", &bad).message(), HasSubstr("'refit_interval_s'"));
}

}  // namespace
}  // namespace eldr::server
