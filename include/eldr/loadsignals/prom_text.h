// Prometheus text exposition format (version 0.0.4) parser, and the extraction of a decode engine's
// load (vLLM, SGLang) from a parsed page.
//
// The parser accepts what Prometheus itself accepts from a scrape target: `# HELP name text` and
// `# TYPE name type` lines, other `#` lines as comments, empty lines, and sample lines
//   metric_name [ "{" label="value" { "," label="value" } [ "," ] "}" ] value [ timestamp_ms ]
// with label values escaping `\\`, `\"` and `\n`, values as decimal floats or NaN / +Inf / -Inf,
// and an optional integer timestamp in milliseconds. Lines end with "\n" ("\r\n" is tolerated);
// blanks and tabs separate tokens. Anything else is an error whose message names the 1-based line
// and what is wrong there, e.g. "line 12: label value: unterminated quoted string".
//
// Everything here is a pure function of its arguments: thread-safe, no global state.
#ifndef ELDR_LOADSIGNALS_PROM_TEXT_H_
#define ELDR_LOADSIGNALS_PROM_TEXT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace eldr {

enum class PromMetricType { kUntyped, kCounter, kGauge, kHistogram, kSummary };

// "untyped", "counter", "gauge", "histogram", "summary".
absl::string_view PromMetricTypeName(PromMetricType type);

struct PromSample {
  std::string name;  // the series' metric name as written, e.g. "vllm:e2e_request_latency_seconds_bucket"
  std::vector<std::pair<std::string, std::string>> labels;  // unescaped, in page order, names distinct
  double value = 0;                                         // may be NaN or +-Inf
  std::optional<int64_t> timestamp_ms;

  // The value of label `name`, or nullptr when the sample has no such label.
  const std::string* Label(absl::string_view name) const;
};

struct PromPage {
  std::vector<PromSample> samples;  // in page order (only the kept ones, see PromParseOptions)
  // Metadata by metric family name, from the TYPE and HELP lines (HELP text unescaped).
  absl::flat_hash_map<std::string, PromMetricType> types;
  absl::flat_hash_map<std::string, std::string> help;
};

struct PromParseOptions {
  // When non-empty, only samples whose metric name is in the set are materialised in
  // PromPage::samples; every other line is still fully checked, so a malformed page is an error
  // whichever metrics the caller wants. Scraping uses it to skip the (large) histograms cheaply.
  absl::flat_hash_set<std::string> keep_metrics;
  // A page larger than this is rejected outright (RESOURCE_EXHAUSTED).
  size_t max_bytes = 16 << 20;
  // More sample lines than this (kept or not) is an error (RESOURCE_EXHAUSTED).
  size_t max_samples = 1'000'000;
  // More labels than this on one sample is an error.
  size_t max_labels_per_sample = 64;
};

// Parses a whole page. Errors: INVALID_ARGUMENT "line N: <what is wrong>" for syntax (bad metric or
// label name, bad escape, unterminated string, bad value or timestamp, duplicate label name in a
// sample, unknown metric type, a TYPE or HELP line that contradicts an earlier one for the same
// family), RESOURCE_EXHAUSTED for the size limits above. Like Prometheus' own scrape parser, the
// order of metadata and samples is not enforced (a TYPE after its family's samples is accepted).
absl::StatusOr<PromPage> ParsePromText(absl::string_view text, const PromParseOptions& options = {});

// ---- Decode engine load ------------------------------------------------------------------------

enum class EngineKind {
  kAuto,    // whichever of the two the page carries (vLLM first)
  kVllm,    // vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
            // (or the older vllm:gpu_cache_usage_perc)
  kSglang,  // sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage
};

// "auto", "vllm", "sglang".
absl::string_view EngineKindName(EngineKind kind);
absl::StatusOr<EngineKind> ParseEngineKind(absl::string_view name);

struct EngineLoadOptions {
  EngineKind engine = EngineKind::kAuto;
  // Only series whose `model_name` label equals this are read; empty: every series. Engines serving
  // several models (or a shared metrics endpoint) need it to report the served model's load only.
  std::string model_name;
};

struct EngineLoad {
  EngineKind engine = EngineKind::kVllm;  // the engine that was recognised (never kAuto)
  double running = 0;                     // sum over the selected series (e.g. one per data-parallel engine)
  double waiting = 0;                     // sum over the selected series
  // Mean over the selected series of the KV cache usage fraction, clamped to [0, 1]: usage is a
  // per-engine fraction, so a sum would exceed 1. nullopt when the page does not carry it.
  std::optional<double> kv_usage;
  int series = 0;  // series that contributed to `running`
};

// The metric names EngineLoadFromPage reads for `engine` (kAuto: both engines'), for
// PromParseOptions::keep_metrics.
absl::flat_hash_set<std::string> EngineLoadMetricNames(EngineKind engine);

// Reads the engine's load from a parsed page. Errors (INVALID_ARGUMENT): neither engine's
// running/waiting gauges are on the page (or not the requested engine's); no series carries the
// requested model_name (the message lists the model names that are there); a selected value is
// negative, NaN or infinite.
absl::StatusOr<EngineLoad> EngineLoadFromPage(const PromPage& page, const EngineLoadOptions& options = {});

// ParsePromText (keeping only the load metrics) followed by EngineLoadFromPage.
absl::StatusOr<EngineLoad> ParseEngineLoad(absl::string_view text, const EngineLoadOptions& options = {});

}  // namespace eldr

#endif  // ELDR_LOADSIGNALS_PROM_TEXT_H_
