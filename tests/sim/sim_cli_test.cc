// eldr-sim as users run it: determinism of the JSON for a seed, the output formats, the figure,
// and clear failures on bad flags and unreadable traces.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "testing/process.h"

namespace eldr::sim {
namespace {

using ::eldr::testing::BinaryPath;
using ::eldr::testing::ProcessResult;
using ::testing::HasSubstr;

// The test harness runs a binary by path; argv[0] is the binary here.
ProcessResult RunCommand(const std::vector<std::string>& argv, double timeout_s) {
  return ::eldr::testing::RunProcess(argv[0], std::vector<std::string>(argv.begin() + 1, argv.end()),
                                     absl::Seconds(timeout_s));
}

std::string TraceDir() {
  const char* data = std::getenv("ELDR_DATA_DIR");
  return std::string(data != nullptr ? data : "data") + "/esft-routing";
}

// A small synthetic run: a few seconds.
std::vector<std::string> SmallSynthetic(const std::string& seed) {
  return {BinaryPath("eldr-sim"),    "--synthetic=12x64x4",       "--domains=2",    "--topics_per_domain=2",
          "--requests=300",          "--calibration_requests=96", "--decoders=4",   "--rates=15,40",
          "--prompt_tokens_mean=64", "--output_tokens_mean=32",   "--seed=" + seed, "--quiet"};
}

ProcessResult Sim(std::vector<std::string> argv, std::vector<std::string> extra = {}) {
  argv.insert(argv.end(), extra.begin(), extra.end());
  return RunCommand(argv, 240);
}

TEST(SimCliTest, SameSeedSameJsonOtherSeedOtherJson) {
  const ProcessResult first = Sim(SmallSynthetic("7"), {"--json"});
  const ProcessResult second = Sim(SmallSynthetic("7"), {"--json"});
  const ProcessResult other = Sim(SmallSynthetic("8"), {"--json"});
  ASSERT_EQ(first.exit_code, 0) << first.stderr_text;
  ASSERT_EQ(second.exit_code, 0) << second.stderr_text;
  ASSERT_EQ(other.exit_code, 0) << other.stderr_text;
  EXPECT_EQ(first.stdout_text, second.stdout_text);
  EXPECT_NE(first.stdout_text, other.stdout_text);

  const nlohmann::json json = nlohmann::json::parse(first.stdout_text);
  ASSERT_TRUE(json["results"].is_array());
  // 2 rates x 6 default policies, each with the documented keys.
  ASSERT_EQ(json["results"].size(), 12u);
  for (const nlohmann::json& result : json["results"]) {
    for (const char* key : {"tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms",
                            "distinct_experts_per_layer", "load_imbalance", "rate_rps", "policy"}) {
      EXPECT_TRUE(result.contains(key)) << key;
    }
    EXPECT_GT(result["tpot_p50_ms"].get<double>(), 0);
    EXPECT_LE(result["tpot_p50_ms"].get<double>(), result["tpot_p90_ms"].get<double>());
    EXPECT_LE(result["tpot_p90_ms"].get<double>(), result["tpot_p99_ms"].get<double>());
    EXPECT_GE(result["load_imbalance"].get<double>(), 1.0);
    // The reference's TTFT (end of prefill) comes before the first decoded token.
    EXPECT_GT(result["ttft_prefill_p50_ms"].get<double>(), 0);
    EXPECT_LT(result["ttft_prefill_p50_ms"].get<double>(), result["ttft_p50_ms"].get<double>());
  }
  EXPECT_EQ(json["ttft_definition"], "decode");
}

// One seed through --seeds is the plain single-seed output, byte for byte; several seeds give the
// aggregate (mean and standard error per cell) beside every seed's own results.
TEST(SimCliTest, SeedsAggregateAndOneSeedIsThePlainOutput) {
  std::vector<std::string> base = SmallSynthetic("1");
  base.erase(std::find(base.begin(), base.end(), "--seed=1"));
  const ProcessResult plain = Sim(base, {"--json", "--policies=jsq,eldr"});
  const ProcessResult one = Sim(base, {"--json", "--policies=jsq,eldr", "--seeds=1"});
  ASSERT_EQ(plain.exit_code, 0) << plain.stderr_text;
  ASSERT_EQ(one.exit_code, 0) << one.stderr_text;
  EXPECT_EQ(plain.stdout_text, one.stdout_text);

  const ProcessResult several = Sim(base, {"--json", "--policies=jsq,eldr", "--seeds=1-3"});
  ASSERT_EQ(several.exit_code, 0) << several.stderr_text;
  const nlohmann::json json = nlohmann::json::parse(several.stdout_text);
  EXPECT_EQ(json["seeds"], nlohmann::json({1, 2, 3}));
  ASSERT_EQ(json["runs"].size(), 3u);
  // The first seed's run is the single-seed run; the others ran at its rates.
  EXPECT_EQ(json["runs"][0], nlohmann::json::parse(plain.stdout_text));
  EXPECT_EQ(json["runs"][2]["rates"], json["runs"][0]["rates"]);
  // 2 rates x (jsq, eldr, best LB).
  ASSERT_EQ(json["aggregate"].size(), 6u);
  double sum = 0;
  for (int s = 0; s < 3; ++s) sum += json["runs"][s]["results"][1]["tpot_p50_ms"].get<double>();
  const nlohmann::json& eldr = json["aggregate"][1];
  EXPECT_EQ(eldr["policy"], "eldr");
  EXPECT_EQ(eldr["seeds"], 3);
  EXPECT_NEAR(eldr["tpot_p50_ms_mean"].get<double>(), sum / 3, 1e-9);
  EXPECT_GT(eldr["tpot_p50_ms_se"].get<double>(), 0);
  EXPECT_TRUE(eldr.contains("p99_vs_best_lb_pct_mean"));
  EXPECT_TRUE(json["aggregate"][2]["best_load_balancer"].get<bool>());

  const ProcessResult table = Sim(base, {"--policies=jsq,eldr", "--seeds=1-3"});
  ASSERT_EQ(table.exit_code, 0) << table.stderr_text;
  EXPECT_THAT(table.stdout_text, HasSubstr("mean ± standard error over the 3 seeds"));
  EXPECT_THAT(table.stdout_text, HasSubstr("best LB"));
}

// A drift run reports its phases in the table, the JSON and the CSV.
TEST(SimCliTest, DriftPhasesInEveryOutput) {
  const std::vector<std::string> drift = {"--policies=jsq,eldr,oracle", "--drift=mix_shift", "--rates=30"};
  std::vector<std::string> json_flags = drift, csv_flags = drift;
  json_flags.push_back("--json");
  csv_flags.push_back("--csv");
  const ProcessResult json_run = Sim(SmallSynthetic("2"), json_flags);
  const ProcessResult csv_run = Sim(SmallSynthetic("2"), csv_flags);
  const ProcessResult table = Sim(SmallSynthetic("2"), drift);
  ASSERT_EQ(json_run.exit_code, 0) << json_run.stderr_text;
  ASSERT_EQ(csv_run.exit_code, 0) << csv_run.stderr_text;
  ASSERT_EQ(table.exit_code, 0) << table.stderr_text;
  const nlohmann::json json = nlohmann::json::parse(json_run.stdout_text);
  EXPECT_EQ(json["drift"]["scenario"], "mix_shift");
  EXPECT_EQ(json["drift"]["change_arrival"], 150);
  for (const nlohmann::json& result : json["results"]) {
    ASSERT_EQ(result["phases"].size(), 2u);
    EXPECT_EQ(result["phases"][0]["phase"], "before");
    EXPECT_EQ(result["phases"][1]["first_arrival"], 150);
    EXPECT_EQ(result["phases"][0]["measured_requests"].get<int>() + result["phases"][1]["measured_requests"].get<int>(),
              result["measured_requests"].get<int>());
  }
  EXPECT_THAT(csv_run.stdout_text, HasSubstr(",phase\n"));
  EXPECT_THAT(csv_run.stdout_text, HasSubstr(",after\n"));
  EXPECT_THAT(table.stdout_text, HasSubstr("-- phase before: arrivals 0-149"));
  EXPECT_THAT(table.stdout_text, HasSubstr("-- phase after: arrivals 150-299"));
  EXPECT_THAT(table.stdout_text, HasSubstr("oracle"));
}

// --ttft=prefill puts the reference's TTFT in the table's columns, and says so.
TEST(SimCliTest, TtftDefinitionSelectsTheTableColumns) {
  const ProcessResult decode = Sim(SmallSynthetic("7"), {"--policies=jsq", "--json"});
  const ProcessResult prefill = Sim(SmallSynthetic("7"), {"--policies=jsq", "--ttft=prefill"});
  ASSERT_EQ(decode.exit_code, 0) << decode.stderr_text;
  ASSERT_EQ(prefill.exit_code, 0) << prefill.stderr_text;
  EXPECT_THAT(prefill.stdout_text, HasSubstr("(prefill)"));
  const nlohmann::json json = nlohmann::json::parse(decode.stdout_text);
  const nlohmann::json& first = json["results"][0];
  // The first rate's jsq row: policy, TPOT p50 / p90 / p99, then the TTFT p50 shown.
  std::istringstream table(prefill.stdout_text);
  std::string line;
  while (std::getline(table, line) && line.rfind("jsq ", 0) != 0) {
  }
  std::istringstream row(line);
  std::string policy;
  double tpot50 = 0, tpot90 = 0, tpot99 = 0, ttft50 = 0;
  ASSERT_TRUE(row >> policy >> tpot50 >> tpot90 >> tpot99 >> ttft50) << prefill.stdout_text;
  EXPECT_NEAR(ttft50, first["ttft_prefill_p50_ms"].get<double>(), 0.051);
  EXPECT_GT(std::abs(ttft50 - first["ttft_p50_ms"].get<double>()), 0.051) << "the decode TTFT was shown";
}

TEST(SimCliTest, RealTracesTableCsvAndFigure) {
  const ::eldr::testing::TempDir temp;
  const std::string dir = temp.path();
  const std::string png = dir + "/figure.png", csv = dir + "/out.csv";
  const ProcessResult run =
      Sim({BinaryPath("eldr-sim"), "--trace=" + TraceDir(), "--prefill_fraction=0.5", "--decoders=4", "--requests=400",
           "--rates=40,100", "--policies=jsq,eldr", "--quiet", "--plot=" + png, "--csv_out=" + csv});
  ASSERT_EQ(run.exit_code, 0) << run.stderr_text;
  EXPECT_THAT(run.stdout_text, HasSubstr("rate 40 req/s"));
  EXPECT_THAT(run.stdout_text, HasSubstr("rate 100 req/s"));
  EXPECT_THAT(run.stdout_text, HasSubstr("eldr"));
  EXPECT_THAT(run.stdout_text, HasSubstr("figure written to " + png));

  std::ifstream figure(png, std::ios::binary);
  std::string magic(8, '\0');
  figure.read(magic.data(), 8);
  EXPECT_EQ(magic, std::string("\x89PNG\r\n\x1a\n", 8));

  std::ifstream csv_in(csv);
  std::string header, line;
  std::getline(csv_in, header);
  EXPECT_THAT(header, HasSubstr("rate_rps,policy,tpot_p50_ms"));
  int rows = 0;
  while (std::getline(csv_in, line)) ++rows;
  EXPECT_EQ(rows, 4);
}

// --replicas: the one-router rows equal a plain run's, every setup has its rows with their labels,
// and each replica routed its share.
TEST(SimCliTest, ReplicasAddRowsAndLeaveTheOneRouterRowsAlone) {
  const ProcessResult plain = Sim(SmallSynthetic("7"), {"--json", "--policies=jsq,eldr,eldr_refit"});
  const ProcessResult replicated =
      Sim(SmallSynthetic("7"), {"--json", "--policies=jsq,eldr,eldr_refit", "--replicas=1,3", "--replica_sync_ms=50"});
  const ProcessResult table = Sim(SmallSynthetic("7"), {"--policies=jsq,eldr", "--replicas=3", "--shared_state=on"});
  ASSERT_EQ(plain.exit_code, 0) << plain.stderr_text;
  ASSERT_EQ(replicated.exit_code, 0) << replicated.stderr_text;
  ASSERT_EQ(table.exit_code, 0) << table.stderr_text;
  const nlohmann::json one = nlohmann::json::parse(plain.stdout_text);
  const nlohmann::json many = nlohmann::json::parse(replicated.stdout_text);
  // 2 rates x (1 router, 3 shared, 3 unshared) x 3 policies.
  ASSERT_EQ(one["results"].size(), 6u);
  ASSERT_EQ(many["results"].size(), 18u);
  EXPECT_EQ(many["router_setups"].size(), 3u);
  EXPECT_EQ(many["replica_options"]["sync_period_ms"].get<double>(), 50);
  EXPECT_EQ(many["replica_options"]["install_lag_ms"].get<double>(), 50);
  nlohmann::json one_router = nlohmann::json::array();
  std::vector<std::string> labels;
  for (const nlohmann::json& result : many["results"]) {
    labels.push_back(result["label"].get<std::string>());
    const int replicas = result["replicas"].get<int>();
    int routed = 0;
    for (const nlohmann::json& count : result["routes_per_replica"]) routed += count.get<int>();
    EXPECT_EQ(routed, 300);
    EXPECT_EQ(static_cast<int>(result["routes_per_replica"].size()), replicas);
    if (replicas == 1) one_router.push_back(result);
  }
  EXPECT_EQ(one_router, one["results"]);
  EXPECT_THAT(labels, ::testing::Contains("eldr_refit R3 shared"));
  EXPECT_THAT(labels, ::testing::Contains("jsq R3 unshared"));
  EXPECT_THAT(table.stdout_text, HasSubstr("[3 replicas, shared state]"));
  EXPECT_THAT(table.stdout_text, ::testing::Not(HasSubstr("no shared state")));
}

struct BadInvocation {
  std::string name;
  std::vector<std::string> flags;
  std::string message;
};

void PrintTo(const BadInvocation& invocation, std::ostream* os) { *os << invocation.name; }

class SimCliBadInputTest : public ::testing::TestWithParam<BadInvocation> {};

TEST_P(SimCliBadInputTest, FailsWithAClearMessage) {
  std::vector<std::string> argv = {BinaryPath("eldr-sim"), "--quiet"};
  argv.insert(argv.end(), GetParam().flags.begin(), GetParam().flags.end());
  const ProcessResult run = RunCommand(argv, 60);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.stderr_text, HasSubstr(GetParam().message)) << run.stderr_text;
}

INSTANTIATE_TEST_SUITE_P(
    Flags, SimCliBadInputTest,
    ::testing::Values(
        BadInvocation{"UnknownFlag", {"--no_such_flag=1", "--synthetic=8x16x2"}, "no_such_flag"},
        BadInvocation{"NoWorkload", {}, "--trace DIR"},
        BadInvocation{"TwoWorkloads", {"--synthetic=8x16x2", "--trace=/tmp"}, "exactly one workload"},
        BadInvocation{"BadGeometry", {"--synthetic=48x128"}, "LAYERSxEXPERTSxTOPK"},
        BadInvocation{"UnreadableTraces", {"--trace=/nonexistent/traces"}, "/nonexistent/traces"},
        BadInvocation{"BadRate", {"--synthetic=8x16x2", "--rates=5,fast"}, "'fast'"},
        BadInvocation{"UnknownPolicy", {"--synthetic=8x16x2", "--policies=rr,best"}, "unknown policy 'best'"},
        BadInvocation{"BadRouterUrl", {"--synthetic=8x16x2", "--router=http://127.0.0.1:1"}, "grpc://HOST:PORT"},
        BadInvocation{
            "NegativeCost", {"--synthetic=8x16x2", "--prefill_fraction=0.5", "--t_expert_us=-2"}, "t_expert_us"},
        BadInvocation{"BadPrefillFraction", {"--trace=" + TraceDir(), "--prefill_fraction=1"}, "--prefill_fraction"},
        BadInvocation{"TooFewRequests", {"--synthetic=8x16x2", "--requests=5"}, "--requests"},
        BadInvocation{"JsonAndCsv", {"--synthetic=8x16x2", "--json", "--csv"}, "pick one"},
        BadInvocation{"BadReplicas", {"--synthetic=8x16x2", "--replicas=1,0"}, "--replicas: '0'"},
        BadInvocation{
            "BadSharedState", {"--synthetic=8x16x2", "--replicas=3", "--shared_state=maybe"}, "--shared_state"},
        BadInvocation{
            "BadSyncPeriod", {"--synthetic=8x16x2", "--replicas=3", "--replica_sync_ms=0"}, "--replica_sync_ms"},
        BadInvocation{"BadSyncPhases", {"--synthetic=8x16x2", "--replica_sync_phases=random"}, "--replica_sync_phases"},
        BadInvocation{"BadTtft", {"--synthetic=8x16x2", "--ttft=first"}, "--ttft must be decode or prefill"},
        BadInvocation{"BadTieBreak", {"--synthetic=8x16x2", "--tie_break=first"}, "random or lowest_index"},
        BadInvocation{"BadAssignment", {"--synthetic=8x16x2", "--replica_assignment=hash"}, "--replica_assignment"},
        BadInvocation{"GateProbOnTraces", {"--trace=" + TraceDir(), "--variant=gate_prob"}, "do not carry"},
        BadInvocation{"BadMaskRule", {"--synthetic=8x16x2", "--mask_rule=peak"}, "unknown layer-mask rule"},
        BadInvocation{"UnknownDrift", {"--synthetic=8x16x2", "--drift=sideways"}, "--drift: unknown scenario"},
        BadInvocation{"DriftInsideTheWarmup",
                      {"--synthetic=8x16x2", "--requests=100", "--drift=mix_shift", "--drift_at=0.1"},
                      "--drift_at"},
        BadInvocation{"NegativePace", {"--synthetic=8x16x2", "--pace=-1"}, "--pace must be"},
        BadInvocation{"PaceWithoutADaemon", {"--synthetic=8x16x2", "--pace=2"}, "needs --router"},
        BadInvocation{"BadSeeds", {"--synthetic=8x16x2", "--seeds=3-1"}, "--seeds: '3-1'"},
        BadInvocation{"SeedAndSeeds", {"--synthetic=8x16x2", "--seed=4", "--seeds=1-2"}, "not both"},
        BadInvocation{"ReplicatedOracle",
                      {"--synthetic=8x16x2", "--requests=100", "--policies=oracle", "--replicas=3"},
                      "one router only"},
        BadInvocation{"ReplicasThroughADaemon",
                      {"--synthetic=8x16x2", "--replicas=3", "--router=grpc://127.0.0.1:1"},
                      "drop --router"},
        // Nothing listens on port 1 of the loopback.
        BadInvocation{"RouterNotListening",
                      {"--synthetic=8x16x2", "--router=grpc://127.0.0.1:1", "--rpc_timeout_s=1"},
                      "did not answer"}),
    [](const ::testing::TestParamInfo<BadInvocation>& info) { return info.param.name; });

}  // namespace
}  // namespace eldr::sim
