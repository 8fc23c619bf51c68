#include "server/config.h"
#include "eldr/common/file.h"

#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "eldr/core/centroid_artifact.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/cluster_component.h"
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
              HasSubstr("worker 'a': capacity must be a finite number in"));
  EXPECT_THAT(ParseWorkerJson(R"([{"id": "a", "address": "h:1", "max_inflight": -1}])").status().message(),
              HasSubstr("worker 'a': max_inflight must be in"));
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
  EXPECT_EQ(o.router.policy, PolicyKind::kP2c);
  EXPECT_DOUBLE_EQ(o.router.tau, 0.25);
  EXPECT_EQ(o.router.load.lease_ttl, absl::Seconds(90));
  EXPECT_EQ(o.router.load.snapshot_staleness, absl::Milliseconds(1500));
  EXPECT_EQ(o.router.seed, 123u);
  EXPECT_EQ(o.refit.seed, 123u);  // one seed for routing and refit
  EXPECT_FALSE(o.keepalive_permit_without_calls);
  EXPECT_EQ(o.max_message_bytes, 65536);
  EXPECT_EQ(o.max_connection_age, absl::InfiniteDuration());
  EXPECT_EQ(o.log_level, LogLevel::kDebug);
  ASSERT_EQ(o.workers.size(), 1u);
  // Settings absent from the file keep their value.
  EXPECT_EQ(o.metrics_http.listen, ServerOptions().metrics_http.listen);
}

TEST(ConfigJson, TieBreak) {
  ServerOptions o;
  EXPECT_EQ(o.router.tie_break, TieBreak::kRandom);
  ASSERT_TRUE(ApplyConfigJson(R"({"tie_break": "lowest_index"})", &o).ok());
  EXPECT_EQ(o.router.tie_break, TieBreak::kLowestIndex);
}

TEST(ConfigJson, ErrorsNameTheSetting) {
  ServerOptions o;
  EXPECT_THAT(ApplyConfigJson(R"({"tua": 0.1})", &o).message(), HasSubstr("unknown setting 'tua'"));
  EXPECT_THAT(ApplyConfigJson(R"({"tau": "wide"})", &o).message(), HasSubstr("'tau'"));
  EXPECT_THAT(ApplyConfigJson(R"({"tau": [1]})", &o).message(), HasSubstr("'tau'"));
  EXPECT_THAT(ApplyConfigJson(R"({"policy": "fastest"})", &o).message(), HasSubstr("eldr, rr, random, jsq or p2c"));
  EXPECT_THAT(ApplyConfigJson(R"({"tie_break": "first"})", &o).message(), HasSubstr("random or lowest_index"));
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
  EXPECT_DOUBLE_EQ(o.router.tau, 0.2);
  EXPECT_EQ(o.router.policy, PolicyKind::kJsq);
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
  check([](ServerOptions& o) { o.router.tau = 1.5; }, "tau");
  check([](ServerOptions& o) { o.router.tau = -0.1; }, "tau");
  check([](ServerOptions& o) { o.router.load.lease_ttl = absl::ZeroDuration(); }, "lease_ttl");
  check([](ServerOptions& o) { o.tls_cert = "c.pem"; }, "tls_key");
  check([](ServerOptions& o) { o.tls_key = "k.pem"; }, "tls_cert");
  check([](ServerOptions& o) { o.tls_client_ca = "ca.pem"; }, "tls_client_ca");
  check([](ServerOptions& o) { o.max_message_bytes = 100; }, "max_message_bytes");
  check([](ServerOptions& o) { o.max_concurrent_streams = 0; }, "max_concurrent_streams");
  check([](ServerOptions& o) { o.max_stream_batch = 0; }, "max_stream_batch");
  check([](ServerOptions& o) { o.max_stream_batch = kMaxStreamBatchLimit + 1; }, "max_stream_batch");
  check([](ServerOptions& o) { o.keepalive_time = absl::ZeroDuration(); }, "keepalive_time");
  check([](ServerOptions& o) { o.shutdown_grace = -absl::Seconds(1); }, "shutdown_grace");
  check([](ServerOptions& o) { o.shutdown_drain_delay = absl::InfiniteDuration(); }, "shutdown_drain_delay");
  check([](ServerOptions& o) { o.admin_listen = o.listen; }, "admin_listen");
  check([](ServerOptions& o) { o.workers = {WorkerSpec{"a", "h:1"}, WorkerSpec{"a", "h:2"}}; }, "workers");

  ServerOptions largest_batch;
  largest_batch.max_stream_batch = kMaxStreamBatchLimit;
  EXPECT_TRUE(ValidateServerOptions(largest_batch).ok());
  EXPECT_EQ(ServerOptions().max_stream_batch, 256);

  ServerOptions both_ephemeral;
  both_ephemeral.listen = "127.0.0.1:0";
  both_ephemeral.admin_listen = "127.0.0.1:0";
  EXPECT_TRUE(ValidateServerOptions(both_ephemeral).ok());
}

TEST(RefitSettings, ParsedCheckedAndDecideWhetherRefitRuns) {
  ServerOptions o;
  EXPECT_EQ(o.refit.window, absl::Seconds(60));
  EXPECT_EQ(o.refit.interval, absl::Seconds(10));
  EXPECT_TRUE(RefitEnabled(o));
  // The older spellings with a unit in the name still work, in that unit.
  ASSERT_TRUE(ApplyConfigJson(R"({"refit_window_s": 5, "refit_interval_s": 0})", &o).ok());
  EXPECT_EQ(o.refit.window, absl::Seconds(5));
  EXPECT_EQ(o.refit.interval, absl::ZeroDuration());
  EXPECT_FALSE(RefitEnabled(o));  // no periodic refit and nothing to persist: no refitter at all
  ASSERT_TRUE(SetServerOption("state_dir", "/var/lib/eldr", &o).ok());
  EXPECT_EQ(o.refit.state_dir, "/var/lib/eldr");
  EXPECT_TRUE(RefitEnabled(o));  // pool changes still refit, and learnt centroids persist
  ASSERT_TRUE(SetServerOption("refit_interval", "1500ms", &o).ok());
  EXPECT_EQ(o.refit.interval, absl::Milliseconds(1500));
  ASSERT_TRUE(SetServerOption("scrape_interval_ms", "250", &o).ok());
  EXPECT_EQ(o.scrape.interval, absl::Milliseconds(250));

  ServerOptions bad;
  bad.refit.window = absl::ZeroDuration();
  EXPECT_THAT(ValidateServerOptions(bad).message(), HasSubstr("'refit_window'"));
  bad = ServerOptions();
  bad.refit.interval = -absl::Seconds(1);
  EXPECT_THAT(ValidateServerOptions(bad).message(), HasSubstr("'refit_interval'"));
  EXPECT_THAT(SetServerOption("refit_interval_s", "soon", &bad).message(), HasSubstr("'refit_interval_s'"));
  bad = ServerOptions();
  bad.refit.max_step_distance = 0;
  EXPECT_THAT(ValidateServerOptions(bad).message(), HasSubstr("'refit_max_step'"));
  bad = ServerOptions();
  bad.refit.max_client_share = 1.5;
  EXPECT_THAT(ValidateServerOptions(bad).message(), HasSubstr("'refit_max_client_share'"));
  // The window's byte budget: 1 MiB at least; the default passes.
  bad = ServerOptions();
  EXPECT_TRUE(ValidateServerOptions(bad).ok());
  ASSERT_TRUE(SetServerOption("refit_window_bytes", "1048576", &bad).ok());
  EXPECT_EQ(bad.refit.max_window_bytes, 1 << 20);
  EXPECT_TRUE(ValidateServerOptions(bad).ok());
  ASSERT_TRUE(SetServerOption("refit_window_bytes", "1048575", &bad).ok());
  EXPECT_THAT(ValidateServerOptions(bad).message(), HasSubstr("'refit_window_bytes'"));
}

TEST(RefitSettings, DecodeWorkWeightsAndTheInstallGuard) {
  ServerOptions o;
  EXPECT_EQ(o.refit.max_imbalance_increase, 0.05);
  EXPECT_EQ(o.refit.max_churn, 0.5);
  EXPECT_EQ(o.refit.max_locality_decrease, 0);
  EXPECT_EQ(o.refit.min_experts_gain, 0.005);
  EXPECT_EQ(o.refit.expert_picks, 128);
  EXPECT_EQ(o.refit.default_output_tokens, 256);
  EXPECT_EQ(o.refit.default_tokens_per_second, 50);
  ASSERT_TRUE(SetServerOption("refit_max_imbalance_increase", "0.2", &o).ok());
  ASSERT_TRUE(SetServerOption("refit_max_churn", "1", &o).ok());
  ASSERT_TRUE(SetServerOption("refit_max_locality_decrease", "0.01", &o).ok());
  ASSERT_TRUE(SetServerOption("refit_min_experts_gain", "-0.01", &o).ok());
  ASSERT_TRUE(SetServerOption("refit_expert_picks", "48", &o).ok());
  ASSERT_TRUE(SetServerOption("refit_default_output_tokens", "0", &o).ok());
  ASSERT_TRUE(SetServerOption("refit_default_tokens_per_second", "80", &o).ok());
  ASSERT_TRUE(SetServerOption("refit_max_pending_signatures", "100", &o).ok());
  ASSERT_TRUE(SetServerOption("refit_pending_bytes", "65536", &o).ok());
  EXPECT_EQ(o.refit.max_imbalance_increase, 0.2);
  EXPECT_EQ(o.refit.max_churn, 1);
  EXPECT_EQ(o.refit.max_locality_decrease, 0.01);
  EXPECT_EQ(o.refit.min_experts_gain, -0.01);
  EXPECT_EQ(o.refit.expert_picks, 48);
  EXPECT_EQ(o.refit.default_output_tokens, 0);
  EXPECT_EQ(o.refit.default_tokens_per_second, 80);
  EXPECT_EQ(o.refit.max_pending_signatures, 100);
  EXPECT_EQ(o.refit.max_pending_bytes, 65536);
  EXPECT_TRUE(ValidateServerOptions(o).ok());
  ASSERT_TRUE(ApplyConfigJson(R"({"refit_max_churn": 0.25})", &o).ok());
  EXPECT_EQ(o.refit.max_churn, 0.25);

  const auto refused = [](const char* name, const char* value) {
    ServerOptions bad;
    EXPECT_TRUE(SetServerOption(name, value, &bad).ok()) << name;
    return std::string(ValidateServerOptions(bad).message());
  };
  EXPECT_THAT(refused("refit_max_imbalance_increase", "-0.1"), HasSubstr("'refit_max_imbalance_increase'"));
  ServerOptions not_a_number;
  not_a_number.refit.max_imbalance_increase = std::nan("");
  EXPECT_THAT(ValidateServerOptions(not_a_number).message(), HasSubstr("'refit_max_imbalance_increase'"));
  EXPECT_THAT(refused("refit_max_churn", "0"), HasSubstr("'refit_max_churn'"));
  EXPECT_THAT(refused("refit_max_locality_decrease", "-0.01"), HasSubstr("'refit_max_locality_decrease'"));
  EXPECT_THAT(refused("refit_max_locality_decrease", "2"), HasSubstr("must be in [0, 1]"));
  EXPECT_THAT(refused("refit_min_experts_gain", "-1.5"), HasSubstr("'refit_min_experts_gain'"));
  EXPECT_THAT(refused("refit_min_experts_gain", "1"), HasSubstr("must be in [-1, 1)"));
  EXPECT_THAT(refused("refit_expert_picks", "0"), HasSubstr("'refit_expert_picks'"));
  EXPECT_THAT(refused("refit_max_churn", "1.5"), HasSubstr("must be a fraction in (0, 1]"));
  EXPECT_THAT(refused("refit_default_output_tokens", "-1"), HasSubstr("'refit_default_output_tokens'"));
  EXPECT_THAT(refused("refit_default_tokens_per_second", "0"), HasSubstr("'refit_default_tokens_per_second'"));
  EXPECT_THAT(refused("refit_max_pending_signatures", "0"), HasSubstr("'refit_max_pending_signatures'"));
  EXPECT_THAT(refused("refit_pending_bytes", "100"), HasSubstr("'refit_pending_bytes'"));
}

std::vector<const char*> Argv(std::initializer_list<const char*> args) {
  std::vector<const char*> argv = {"eldr-router"};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

TEST(CommandLine, FlagsComeFromTheOneTable) {
  const std::string config = TempPath("cli-config.json");
  ASSERT_TRUE(WriteFileAtomically(config, R"({"tau": 0.3, "policy": "jsq", "lease_ttl": "1m"})").ok());
  ServerOptions o;
  const std::string config_flag = "--config=" + config;
  // The file applies first wherever it stands; flags override it in order.
  auto argv = Argv({"--tau=0.2", config_flag.c_str(), "--nokeepalive_permit_without_calls", "--seed", "0x10",
                    "-lease_ttl=2m", "--refit_interval_s=3"});
  absl::StatusOr<CommandLine> parsed = ParseCommandLine(static_cast<int>(argv.size()), argv.data(), &o);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_FALSE(parsed->help);
  EXPECT_DOUBLE_EQ(o.router.tau, 0.2);
  EXPECT_EQ(o.router.policy, PolicyKind::kJsq);
  EXPECT_EQ(o.router.load.lease_ttl, absl::Minutes(2));
  EXPECT_FALSE(o.keepalive_permit_without_calls);
  EXPECT_EQ(o.router.seed, 16u);
  EXPECT_EQ(o.refit.interval, absl::Seconds(3));

  auto help = Argv({"--help"});
  EXPECT_TRUE(ParseCommandLine(2, help.data(), &o)->help);
  for (const auto& [args, expected] : std::vector<std::pair<std::vector<const char*>, std::string>>{
           {{"--no_such_flag=1"}, "unknown flag --no_such_flag"},
           {{"stray"}, "unexpected argument 'stray'"},
           {{"--tau"}, "--tau needs a value"},
           {{"--tau=wide"}, "'tau'"},
           {{"--nolisten"}, "unknown flag --nolisten"}}) {
    std::vector<const char*> argv2 = {"eldr-router"};
    argv2.insert(argv2.end(), args.begin(), args.end());
    ServerOptions fresh;
    const absl::StatusOr<CommandLine> bad = ParseCommandLine(static_cast<int>(argv2.size()), argv2.data(), &fresh);
    EXPECT_FALSE(bad.ok()) << args[0];
    EXPECT_THAT(bad.status().message(), HasSubstr(expected)) << args[0];
  }
  // --help documents every setting with its default.
  const std::string usage = UsageText();
  for (const std::string& key : ServerOptionKeys()) EXPECT_THAT(usage, HasSubstr("--" + key + "=")) << key;
  EXPECT_THAT(usage, HasSubstr("(default: 0.1)"));
}

TEST(Validation, AdminIsNotReachableFromTheNetworkWithoutCredentials) {
  ServerOptions o;
  EXPECT_TRUE(IsLoopbackAddress(o.admin_listen)) << o.admin_listen;
  EXPECT_TRUE(ValidateServerOptions(o).ok());
  for (const char* address : {"0.0.0.0:50052", "10.1.2.3:50052", "[::]:50052", "admin.example.com:1"}) {
    ServerOptions exposed;
    exposed.admin_listen = address;
    const absl::Status s = ValidateServerOptions(exposed);
    EXPECT_FALSE(s.ok()) << address;
    EXPECT_THAT(s.message(), HasSubstr("without credentials")) << address;
    exposed.admin_token_file = "/etc/eldr/admin-token";
    EXPECT_TRUE(ValidateServerOptions(exposed).ok()) << address;
    exposed.admin_token_file.clear();
    exposed.allow_insecure_admin = true;
    EXPECT_TRUE(ValidateServerOptions(exposed).ok()) << address;
  }
  // Admin on the data plane (admin_listen empty) follows the data plane's address.
  ServerOptions on_data_plane;
  on_data_plane.admin_listen.clear();
  EXPECT_FALSE(ValidateServerOptions(on_data_plane).ok());  // listen defaults to 0.0.0.0
  on_data_plane.listen = "127.0.0.1:50051";
  EXPECT_TRUE(ValidateServerOptions(on_data_plane).ok());
  for (const char* loopback : {"127.0.0.1:1", "127.5.6.7:1", "localhost:1", "[::1]:1", "unix:/run/eldr.sock"}) {
    EXPECT_TRUE(IsLoopbackAddress(loopback)) << loopback;
  }
  for (const char* remote : {"0.0.0.0:1", "128.0.0.1:1", "127.0.0.1.example.com:1", "[::]:1", ":1"}) {
    EXPECT_FALSE(IsLoopbackAddress(remote)) << remote;
  }
}

TEST(Validation, WorkerAddressesAndCapacitiesAreChecked) {
  EXPECT_THAT(ParseWorkerList("a=attacker:6666\nHost: x").status().message(), HasSubstr("address"));
  EXPECT_THAT(ParseWorkerJson(R"([{"id": "a", "address": "h:1\nX-Evil: 1"}])").status().message(),
              HasSubstr("address"));
  EXPECT_THAT(ParseWorkerJson(R"([{"id": "a", "address": "h:1", "capacity": 1e-300}])").status().message(),
              HasSubstr("capacity"));
  EXPECT_THAT(ParseWorkerJson(R"([{"id": "a", "address": "h:99999"}])").status().message(), HasSubstr("port"));
  EXPECT_THAT(ParseWorkerJson(R"([{"id": "a b", "address": "h:1"}])").status().message(), HasSubstr("id"));
  EXPECT_TRUE(ParseWorkerJson(R"([{"id": "decode-0", "address": "[fd00::1]:8000"}])").ok());
}

}  // namespace
}  // namespace eldr::server

namespace eldr::server {
namespace {

TEST(ClusterSettingsTest, FlagsDefaultsAndValidation) {
  ServerOptions options;
  EXPECT_TRUE(options.cluster.redis.empty());
  EXPECT_EQ(options.cluster.cluster_name, "default");
  ASSERT_TRUE(SetServerOption("cluster_redis", "10.0.0.7:6380", &options).ok());
  ASSERT_TRUE(SetServerOption("cluster_redis_db", "3", &options).ok());
  ASSERT_TRUE(SetServerOption("cluster_name", "pool-a", &options).ok());
  ASSERT_TRUE(SetServerOption("cluster_redis_password_file", "/run/secrets/redis", &options).ok());
  EXPECT_TRUE(ValidateServerOptions(options).ok());
  // replica_id: the setting, else $POD_NAME, else the host name.
  ::setenv("POD_NAME", "router-7f9c-abcde", 1);
  EXPECT_EQ(DefaultReplicaId(options), "router-7f9c-abcde");
  ::unsetenv("POD_NAME");
  EXPECT_FALSE(DefaultReplicaId(options).empty());
  ASSERT_TRUE(SetServerOption("replica_id", "r1", &options).ok());
  EXPECT_EQ(DefaultReplicaId(options), "r1");
  absl::StatusOr<cluster::ClusterOptions> cluster_options = ClusterOptionsFromSettings(options);
  ASSERT_TRUE(cluster_options.ok()) << cluster_options.status();
  EXPECT_EQ(cluster_options->redis.address, "10.0.0.7:6380");
  EXPECT_EQ(cluster_options->redis.db, 3);
  EXPECT_EQ(cluster_options->redis.password_file, "/run/secrets/redis");
  EXPECT_EQ(cluster_options->cluster_name, "pool-a");
  EXPECT_EQ(cluster_options->replica_id, "r1");

  ServerOptions bad = options;
  bad.cluster.redis_db = -1;
  EXPECT_THAT(ValidateServerOptions(bad).message(), HasSubstr("cluster_redis_db"));
  bad = options;
  bad.cluster.redis = "host:notaport";
  EXPECT_THAT(ClusterOptionsFromSettings(bad).status().message(), HasSubstr("cluster_redis"));
  bad = options;
  bad.cluster.replica_id = "has space";
  EXPECT_THAT(ClusterOptionsFromSettings(bad).status().message(), HasSubstr("replica_id"));
}

// docs/api.md documents every setting of the one table (the table is where flags come from, the
// page is where operators look).
TEST(Docs, ApiPageDocumentsEverySetting) {
  const char* source = std::getenv("ELDR_SOURCE_DIR");
  ASSERT_NE(source, nullptr);
  absl::StatusOr<std::string> page = ReadFile(std::string(source) + "/docs/api.md");
  ASSERT_TRUE(page.ok()) << page.status();
  for (const std::string& key : ServerOptionKeys()) {
    EXPECT_TRUE(absl::StrContains(*page, "`--" + key + "`")) << "docs/api.md does not document --" << key;
  }
}

}  // namespace
}  // namespace eldr::server
