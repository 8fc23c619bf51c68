#include "eldr/loadsignals/prom_text.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "loadsignals/fake_metrics_server.h"

namespace eldr {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

PromPage MustParse(absl::string_view text, const PromParseOptions& options = {}) {
  absl::StatusOr<PromPage> page = ParsePromText(text, options);
  EXPECT_TRUE(page.ok()) << page.status();
  return page.ok() ? *std::move(page) : PromPage{};
}

std::string ParseError(absl::string_view text) {
  absl::StatusOr<PromPage> page = ParsePromText(text);
  EXPECT_FALSE(page.ok()) << "parsed: " << text;
  return page.ok() ? "" : std::string(page.status().message());
}

TEST(PromTextTest, ParsesSamplesLabelsAndMetadata) {
  const PromPage page = MustParse(
      "# HELP http_requests_total The total number of HTTP requests.\n"
      "# TYPE http_requests_total counter\n"
      "http_requests_total{method=\"post\",code=\"200\"} 1027 1395066363000\n"
      "http_requests_total{method=\"post\",code=\"400\"}    3 1395066363000\n"
      "\n"
      "# A plain comment\n"
      "metric_without_timestamp_and_labels 12.47\n");
  ASSERT_EQ(page.samples.size(), 3u);
  EXPECT_EQ(page.samples[0].name, "http_requests_total");
  EXPECT_THAT(page.samples[0].labels, ElementsAre(Pair("method", "post"), Pair("code", "200")));
  EXPECT_EQ(page.samples[0].value, 1027);
  EXPECT_EQ(page.samples[0].timestamp_ms, 1395066363000);
  EXPECT_EQ(page.samples[1].value, 3);
  EXPECT_EQ(*page.samples[1].Label("code"), "400");
  EXPECT_EQ(page.samples[1].Label("path"), nullptr);
  EXPECT_EQ(page.samples[2].name, "metric_without_timestamp_and_labels");
  EXPECT_TRUE(page.samples[2].labels.empty());
  EXPECT_DOUBLE_EQ(page.samples[2].value, 12.47);
  EXPECT_FALSE(page.samples[2].timestamp_ms.has_value());
  EXPECT_EQ(page.types.at("http_requests_total"), PromMetricType::kCounter);
  EXPECT_EQ(page.help.at("http_requests_total"), "The total number of HTTP requests.");
}

TEST(PromTextTest, UnescapesLabelValuesAndHelp) {
  const PromPage page = MustParse(
      "# HELP msdos_file_access_time_seconds Access time\\nof a \\\\ file.\n"
      "msdos_file_access_time_seconds{path=\"C:\\\\DIR\\\\FILE.TXT\",error=\"Cannot find file:\\n\\\"FILE.TXT\\\"\"} "
      "1.458255915e9\n");
  ASSERT_EQ(page.samples.size(), 1u);
  EXPECT_EQ(*page.samples[0].Label("path"), "C:\\DIR\\FILE.TXT");
  EXPECT_EQ(*page.samples[0].Label("error"), "Cannot find file:\n\"FILE.TXT\"");
  EXPECT_DOUBLE_EQ(page.samples[0].value, 1.458255915e9);
  EXPECT_EQ(page.help.at("msdos_file_access_time_seconds"), "Access time\nof a \\ file.");
}

TEST(PromTextTest, SpecialValuesAndTimestamps) {
  const PromPage page = MustParse(
      "a NaN\n"
      "b +Inf\n"
      "c -Inf 0\n"
      "d -1.5e-3 -1395066363000\n"
      "e 0x1p-2\n"
      "f inf\n");
  ASSERT_EQ(page.samples.size(), 6u);
  EXPECT_TRUE(std::isnan(page.samples[0].value));
  EXPECT_TRUE(std::isinf(page.samples[1].value) && page.samples[1].value > 0);
  EXPECT_TRUE(std::isinf(page.samples[2].value) && page.samples[2].value < 0);
  EXPECT_EQ(page.samples[2].timestamp_ms, 0);
  EXPECT_DOUBLE_EQ(page.samples[3].value, -1.5e-3);
  EXPECT_EQ(page.samples[3].timestamp_ms, -1395066363000);
  EXPECT_DOUBLE_EQ(page.samples[4].value, 0.25);
  EXPECT_TRUE(std::isinf(page.samples[5].value));
}

TEST(PromTextTest, ToleratesWhitespaceCrLfTrailingCommaAndEmptyBraces) {
  const PromPage page = MustParse(
      "  \t# TYPE x gauge\r\n"
      "x { a = \"1\" , b=\"2\", } \t 5\r\n"
      "y{} 6\n"
      "z{a=\"q\"}7\n"
      "   \n"
      "#\n"
      "# HELP_NOT_METADATA anything goes\n"
      "# EOF\n");
  ASSERT_EQ(page.samples.size(), 3u);
  EXPECT_THAT(page.samples[0].labels, ElementsAre(Pair("a", "1"), Pair("b", "2")));
  EXPECT_EQ(page.samples[0].value, 5);
  EXPECT_EQ(page.samples[1].value, 6);
  EXPECT_EQ(page.samples[2].value, 7);
  EXPECT_EQ(page.types.at("x"), PromMetricType::kGauge);
}

TEST(PromTextTest, MetadataOrderIsNotEnforcedButContradictionsAre) {
  MustParse("x 1\n# TYPE x gauge\n# TYPE x gauge\n");
  EXPECT_THAT(ParseError("# TYPE x gauge\n# TYPE x counter\n"),
              HasSubstr("line 2: TYPE counter for x contradicts the earlier TYPE gauge"));
  EXPECT_THAT(ParseError("# HELP x one\n# HELP x two\n"), HasSubstr("line 2: second HELP line for x"));
}

TEST(PromTextTest, ErrorsNameTheLineAndTheProblem) {
  EXPECT_THAT(ParseError("ok 1\nbad{a=\"x} 1\n"),
              HasSubstr("line 2: value of label \"a\": unterminated quoted string"));
  EXPECT_THAT(ParseError("bad{a=\"\\t\"} 1\n"), HasSubstr("line 1: value of label \"a\": invalid escape sequence"));
  EXPECT_THAT(ParseError("a 1\nb\n"), HasSubstr("line 2: sample of b has no value"));
  EXPECT_THAT(ParseError("a one\n"), HasSubstr("line 1: sample of a: invalid value \"one\""));
  EXPECT_THAT(ParseError("a 1 2 3\n"), HasSubstr("line 1: sample of a: unexpected text after the timestamp"));
  EXPECT_THAT(ParseError("a 1 1.5\n"), HasSubstr("line 1: sample of a: invalid timestamp \"1.5\""));
  EXPECT_THAT(ParseError("a{x=\"1\",x=\"2\"} 1\n"), HasSubstr("line 1: label set: duplicate label name \"x\""));
  EXPECT_THAT(ParseError("1abc 1\n"), HasSubstr("line 1: invalid metric name"));
  EXPECT_THAT(ParseError("a{1x=\"1\"} 1\n"), HasSubstr("line 1: label set: invalid label name"));
  EXPECT_THAT(ParseError("a{x \"1\"} 1\n"), HasSubstr("expected '=' after label name \"x\""));
  EXPECT_THAT(ParseError("a{x=1} 1\n"), HasSubstr("value of label \"x\" must start with '\"'"));
  EXPECT_THAT(ParseError("a{x=\"1\" y=\"2\"} 1\n"), HasSubstr("expected ',' or '}'"));
  EXPECT_THAT(ParseError("a{x=\"1\"\n"), HasSubstr("line 1: label set: missing closing '}'"));
  EXPECT_THAT(ParseError("# TYPE a gauges\n"), HasSubstr("line 1: TYPE line for a: unknown metric type"));
  EXPECT_THAT(ParseError("# TYPE 9a gauge\n"), HasSubstr("line 1: TYPE line: invalid metric name"));
  EXPECT_THAT(ParseError("# HELP\n"), HasSubstr("line 1: HELP line without a metric name"));
  EXPECT_THAT(ParseError("a-1 1\n"), HasSubstr("expected a blank before the value"));
  EXPECT_THAT(ParseError("a 1e999\n"), HasSubstr("invalid value"));
  EXPECT_THAT(ParseError("a ++1\n"), HasSubstr("invalid value"));
  EXPECT_THAT(ParseError("a 1 ++5\n"), HasSubstr("invalid timestamp"));
  EXPECT_THAT(ParseError("a{x=\"\xff\"} 1\n"), HasSubstr("line 1: value of label \"x\" is not valid UTF-8"));
  EXPECT_THAT(ParseError("a{x=\"\xc0\xaf\"} 1\n"), HasSubstr("not valid UTF-8"));      // overlong '/'
  EXPECT_THAT(ParseError("a{x=\"\xed\xa0\x80\"} 1\n"), HasSubstr("not valid UTF-8"));  // surrogate
  EXPECT_THAT(ParseError("# HELP a caf\xc3\n"), HasSubstr("HELP line for a: text is not valid UTF-8"));
}

TEST(PromTextTest, AcceptsUtf8LabelValues) {
  const PromPage page = MustParse("a{model=\"caf\xc3\xa9-\xe4\xb8\xad-\xf0\x9f\x9a\x80\"} 1\n");
  ASSERT_EQ(page.samples.size(), 1u);
  EXPECT_EQ(*page.samples[0].Label("model"), "caf\xc3\xa9-\xe4\xb8\xad-\xf0\x9f\x9a\x80");
}

TEST(PromTextTest, KeptMetricsOnlyButWholePageChecked) {
  PromParseOptions options;
  options.keep_metrics = {"wanted"};
  const PromPage page = MustParse("other{a=\"1\"} 1\nwanted{b=\"2\"} 2\nother 3\n", options);
  ASSERT_EQ(page.samples.size(), 1u);
  EXPECT_EQ(page.samples[0].name, "wanted");
  EXPECT_THAT(page.samples[0].labels, ElementsAre(Pair("b", "2")));

  absl::StatusOr<PromPage> bad = ParsePromText("wanted 1\nother{a=\"\\q\"} 1\n", options);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("line 2"));
}

TEST(PromTextTest, SizeLimits) {
  PromParseOptions options;
  options.max_bytes = 10;
  EXPECT_EQ(ParsePromText("a_long_metric 1\n", options).status().code(), absl::StatusCode::kResourceExhausted);
  options = {};
  options.max_samples = 2;
  EXPECT_TRUE(ParsePromText("a 1\nb 2\n", options).ok());
  EXPECT_EQ(ParsePromText("a 1\nb 2\nc 3\n", options).status().code(), absl::StatusCode::kResourceExhausted);
  options = {};
  options.max_labels_per_sample = 2;
  EXPECT_TRUE(ParsePromText("a{x=\"1\",y=\"2\"} 1\n", options).ok());
  EXPECT_THAT(ParsePromText("a{x=\"1\",y=\"2\",z=\"3\"} 1\n", options).status().message(),
              HasSubstr("more than 2 labels"));
}

TEST(PromTextTest, ParsesAFullVllmPage) {
  const std::string text = testing::VllmMetricsPage({3, 2, 0.25}, "meta-llama/Llama-3.1-8B-Instruct", 2);
  const PromPage page = MustParse(text);
  EXPECT_GT(page.samples.size(), 60u);
  EXPECT_EQ(page.types.at("vllm:time_to_first_token_seconds"), PromMetricType::kHistogram);
  int inf_buckets = 0;
  for (const PromSample& sample : page.samples) {
    const std::string* le = sample.Label("le");
    if (le != nullptr && *le == "+Inf") ++inf_buckets;
  }
  EXPECT_EQ(inf_buckets, 4);  // two histograms x two engines
}

TEST(EngineLoadTest, SumsVllmSeriesOfAllEngines) {
  absl::StatusOr<EngineLoad> load = ParseEngineLoad(testing::VllmMetricsPage({6, 4, 0.5}, "m", 2));
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->engine, EngineKind::kVllm);
  EXPECT_DOUBLE_EQ(load->running, 6);
  EXPECT_DOUBLE_EQ(load->waiting, 4);
  EXPECT_EQ(load->series, 2);
  ASSERT_TRUE(load->kv_usage.has_value());
  EXPECT_DOUBLE_EQ(*load->kv_usage, 0.5);  // mean of the engines' fractions, not their sum
}

TEST(EngineLoadTest, ReadsSglang) {
  absl::StatusOr<EngineLoad> load = ParseEngineLoad(testing::SglangMetricsPage({5, 7, 0.125}, "qwen"));
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->engine, EngineKind::kSglang);
  EXPECT_DOUBLE_EQ(load->running, 5);
  EXPECT_DOUBLE_EQ(load->waiting, 7);
  EXPECT_DOUBLE_EQ(*load->kv_usage, 0.125);
}

TEST(EngineLoadTest, FiltersByModelName) {
  const std::string two_models = absl::StrCat(testing::VllmMetricsPage({3, 1, 0.2}, "model-a"),
                                              testing::VllmMetricsPage({10, 20, 0.9}, "model-b"));
  // Two pages concatenated repeat HELP/TYPE lines with identical text, which is valid.
  EngineLoadOptions options;
  options.model_name = "model-b";
  absl::StatusOr<EngineLoad> load = ParseEngineLoad(two_models, options);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_DOUBLE_EQ(load->running, 10);
  EXPECT_DOUBLE_EQ(load->waiting, 20);
  EXPECT_DOUBLE_EQ(*load->kv_usage, 0.9);

  options.model_name = "";
  load = ParseEngineLoad(two_models, options);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_DOUBLE_EQ(load->running, 13);
  EXPECT_DOUBLE_EQ(load->waiting, 21);

  options.model_name = "model-c";
  load = ParseEngineLoad(two_models, options);
  ASSERT_FALSE(load.ok());
  EXPECT_THAT(load.status().message(), HasSubstr("no vllm:num_requests_running series with model_name \"model-c\""));
  EXPECT_THAT(load.status().message(), HasSubstr("\"model-a\", \"model-b\""));
}

TEST(EngineLoadTest, OlderVllmCacheGaugeIsUsedWhenTheNewOneIsAbsent) {
  absl::StatusOr<EngineLoad> load = ParseEngineLoad(
      "vllm:num_requests_running{model_name=\"m\"} 1.0\n"
      "vllm:num_requests_waiting{model_name=\"m\"} 0.0\n"
      "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.75\n");
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_DOUBLE_EQ(*load->kv_usage, 0.75);

  load = ParseEngineLoad("vllm:num_requests_running 1.0\nvllm:num_requests_waiting 2.0\n");
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_FALSE(load->kv_usage.has_value());
}

TEST(EngineLoadTest, RejectsMissingOrBadGauges) {
  EXPECT_THAT(ParseEngineLoad("process_cpu_seconds_total 1\n").status().message(),
              HasSubstr("neither vllm:num_requests_running nor sglang:num_running_reqs"));
  EXPECT_THAT(ParseEngineLoad("vllm:num_requests_running 1\n").status().message(),
              HasSubstr("but no vllm:num_requests_waiting"));
  EXPECT_THAT(ParseEngineLoad("vllm:num_requests_running -1\nvllm:num_requests_waiting 0\n").status().message(),
              HasSubstr("finite and >= 0"));
  EXPECT_THAT(ParseEngineLoad("vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n").status().message(),
              HasSubstr("finite and >= 0"));
  EXPECT_THAT(ParseEngineLoad("vllm:num_requests_running 1\nvllm:num_requests_waiting +Inf\n").status().message(),
              HasSubstr("finite and >= 0"));
  EngineLoadOptions sglang;
  sglang.engine = EngineKind::kSglang;
  EXPECT_THAT(ParseEngineLoad(testing::VllmMetricsPage({1, 1, 0}, "m"), sglang).status().message(),
              HasSubstr("no sglang:num_running_reqs on the page"));
  // A syntax error anywhere fails the page, even outside the load gauges.
  EXPECT_THAT(
      ParseEngineLoad(absl::StrCat(testing::VllmMetricsPage({1, 1, 0}, "m"), "garbage here\n")).status().message(),
      HasSubstr("invalid value \"here\""));
}

TEST(EngineKindTest, NamesRoundTrip) {
  for (EngineKind kind : {EngineKind::kAuto, EngineKind::kVllm, EngineKind::kSglang}) {
    absl::StatusOr<EngineKind> parsed = ParseEngineKind(EngineKindName(kind));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kind);
  }
  EXPECT_FALSE(ParseEngineKind("tgi").ok());
}

}  // namespace
}  // namespace eldr
