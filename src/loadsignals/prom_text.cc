#include "eldr/loadsignals/prom_text.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace eldr {
namespace {

bool IsBlank(char c) { return c == ' ' || c == '\t'; }
bool IsMetricNameStart(char c) { return absl::ascii_isalpha(c) || c == '_' || c == ':'; }
bool IsMetricNameChar(char c) { return absl::ascii_isalnum(c) || c == '_' || c == ':'; }
bool IsLabelNameStart(char c) { return absl::ascii_isalpha(c) || c == '_'; }
bool IsLabelNameChar(char c) { return absl::ascii_isalnum(c) || c == '_'; }

// Whether `text` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF),
// as Prometheus requires of label values and HELP text.
bool IsValidUtf8(absl::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x80) {
      ++i;
      continue;
    }
    int length = 0;
    uint32_t code_point = 0;
    if ((byte & 0xE0) == 0xC0) {
      length = 2;
      code_point = byte & 0x1F;
    } else if ((byte & 0xF0) == 0xE0) {
      length = 3;
      code_point = byte & 0x0F;
    } else if ((byte & 0xF8) == 0xF0) {
      length = 4;
      code_point = byte & 0x07;
    } else {
      return false;
    }
    if (i + length > text.size()) return false;
    for (int k = 1; k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xC0) != 0x80) return false;
      code_point = (code_point << 6) | (next & 0x3F);
    }
    static constexpr uint32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};
    if (code_point < kSmallest[length] || code_point > 0x10FFFF || (code_point >= 0xD800 && code_point <= 0xDFFF)) {
      return false;
    }
    i += length;
  }
  return true;
}

// A short, printable rendering of outside bytes for error messages.
std::string Excerpt(absl::string_view text) {
  constexpr size_t kMax = 40;
  std::string out = absl::CHexEscape(text.substr(0, kMax));
  if (text.size() > kMax) out += "...";
  return out;
}

absl::StatusOr<PromMetricType> ParseMetricType(absl::string_view name) {
  if (name == "counter") return PromMetricType::kCounter;
  if (name == "gauge") return PromMetricType::kGauge;
  if (name == "histogram") return PromMetricType::kHistogram;
  if (name == "summary") return PromMetricType::kSummary;
  if (name == "untyped") return PromMetricType::kUntyped;
  return absl::InvalidArgumentError(absl::StrCat("unknown metric type \"", Excerpt(name), "\""));
}

// Parses a float the way Prometheus does (Go's strconv.ParseFloat): optional sign, decimal or
// hexadecimal notation, and case-insensitive inf / infinity / nan.
bool ParsePromFloat(absl::string_view token, double* out) {
  if (token.empty()) return false;
  bool negative = false;
  absl::string_view body = token;
  if (body[0] == '+' || body[0] == '-') {
    negative = body[0] == '-';
    body.remove_prefix(1);
  }
  if (body.empty()) return false;
  if (absl::EqualsIgnoreCase(body, "inf") || absl::EqualsIgnoreCase(body, "infinity")) {
    *out = negative ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
    return true;
  }
  if (absl::EqualsIgnoreCase(body, "nan")) {
    *out = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  // from_chars would take "inf"/"nan" spellings and a second sign; only digits may follow here.
  std::chars_format format = std::chars_format::general;
  if (body.size() > 2 && body[0] == '0' && (body[1] == 'x' || body[1] == 'X')) {
    body.remove_prefix(2);
    format = std::chars_format::hex;
  }
  if (body.empty() || !(absl::ascii_isxdigit(body[0]) || body[0] == '.')) return false;
  double value = 0;
  const char* end = body.data() + body.size();
  auto [ptr, ec] = std::from_chars(body.data(), end, value, format);
  if (ec != std::errc() || ptr != end) return false;
  *out = negative ? -value : value;
  return true;
}

bool ParsePromTimestamp(absl::string_view token, int64_t* out) {
  if (!token.empty() && token[0] == '+') token.remove_prefix(1);
  if (token.empty() || token[0] == '+') return false;
  const char* end = token.data() + token.size();
  auto [ptr, ec] = std::from_chars(token.data(), end, *out);
  return ec == std::errc() && ptr == end;
}

class PageParser {
 public:
  PageParser(absl::string_view text, const PromParseOptions& options) : text_(text), options_(options) {}

  absl::StatusOr<PromPage> Parse() {
    if (text_.size() > options_.max_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("page of ", text_.size(), " bytes exceeds the limit of ", options_.max_bytes));
    }
    size_t start = 0;
    while (start < text_.size()) {
      size_t newline = text_.find('\n', start);
      if (newline == absl::string_view::npos) newline = text_.size();
      ++line_number_;
      absl::Status status = ParseLine(text_.substr(start, newline - start));
      if (!status.ok()) return status;
      start = newline + 1;
    }
    return std::move(page_);
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("line ", line_number_, ": ", what));
  }

  absl::Status ParseLine(absl::string_view line) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    while (!line.empty() && IsBlank(line.front())) line.remove_prefix(1);
    while (!line.empty() && IsBlank(line.back())) line.remove_suffix(1);
    if (line.empty()) return absl::OkStatus();
    if (line.front() == '#') return ParseComment(line.substr(1));
    return ParseSample(line);
  }

  // `text` is the line after '#'. Only "HELP" and "TYPE" followed by a blank carry metadata.
  absl::Status ParseComment(absl::string_view text) {
    size_t pos = 0;
    SkipBlanks(text, &pos);
    absl::string_view keyword = ReadUntilBlank(text, &pos);
    if (keyword != "HELP" && keyword != "TYPE") return absl::OkStatus();
    if (pos >= text.size()) return Error(absl::StrCat(keyword, " line without a metric name"));
    SkipBlanks(text, &pos);
    absl::string_view name = ReadUntilBlank(text, &pos);
    if (!IsValidMetricName(name)) {
      return Error(absl::StrCat(keyword, " line: invalid metric name \"", Excerpt(name), "\""));
    }
    SkipBlanks(text, &pos);
    absl::string_view rest = text.substr(pos);
    if (keyword == "TYPE") {
      absl::StatusOr<PromMetricType> type = ParseMetricType(rest);
      if (!type.ok()) return Error(absl::StrCat("TYPE line for ", name, ": ", type.status().message()));
      auto [it, inserted] = page_.types.try_emplace(std::string(name), *type);
      if (!inserted && it->second != *type) {
        return Error(absl::StrCat("TYPE ", PromMetricTypeName(*type), " for ", name, " contradicts the earlier TYPE ",
                                  PromMetricTypeName(it->second)));
      }
      return absl::OkStatus();
    }
    std::string help;
    help.reserve(rest.size());
    for (size_t i = 0; i < rest.size(); ++i) {
      if (rest[i] != '\\') {
        help.push_back(rest[i]);
        continue;
      }
      if (i + 1 >= rest.size()) return Error(absl::StrCat("HELP line for ", name, ": dangling backslash"));
      const char escaped = rest[++i];
      if (escaped == '\\') {
        help.push_back('\\');
      } else if (escaped == 'n') {
        help.push_back('\n');
      } else {
        return Error(absl::StrCat("HELP line for ", name, ": invalid escape sequence \"\\",
                                  Excerpt(absl::string_view(&escaped, 1)), "\""));
      }
    }
    if (!IsValidUtf8(help)) return Error(absl::StrCat("HELP line for ", name, ": text is not valid UTF-8"));
    auto [it, inserted] = page_.help.try_emplace(std::string(name), std::move(help));
    if (!inserted && it->second != help) {
      return Error(absl::StrCat("second HELP line for ", name, " with a different text"));
    }
    return absl::OkStatus();
  }

  absl::Status ParseSample(absl::string_view line) {
    if (++sample_lines_ > options_.max_samples) {
      return absl::ResourceExhaustedError(
          absl::StrCat("line ", line_number_, ": more than ", options_.max_samples, " samples on the page"));
    }
    size_t pos = 0;
    while (pos < line.size() && IsMetricNameChar(line[pos])) ++pos;
    absl::string_view name = line.substr(0, pos);
    if (name.empty() || !IsMetricNameStart(name.front())) {
      return Error(absl::StrCat("invalid metric name at \"", Excerpt(line), "\""));
    }
    const bool keep = options_.keep_metrics.empty() || options_.keep_metrics.contains(name);
    PromSample sample;
    if (keep) sample.name = std::string(name);

    const size_t name_end = pos;
    SkipBlanks(line, &pos);
    bool had_labels = false;
    if (pos < line.size() && line[pos] == '{') {
      ++pos;
      absl::Status status = ParseLabels(line, &pos, keep ? &sample : nullptr);
      if (!status.ok()) return status;
      had_labels = true;
      SkipBlanks(line, &pos);
    }
    if (pos >= line.size()) return Error(absl::StrCat("sample of ", name, " has no value"));
    // After a bare name a blank must end it (`up-1` is not `up` and `-1`); after '}' the value
    // may follow directly.
    if (!had_labels && pos == name_end) {
      return Error(absl::StrCat("sample of ", name, ": expected a blank before the value, got \"",
                                Excerpt(line.substr(pos)), "\""));
    }
    absl::string_view value_token = ReadUntilBlank(line, &pos);
    double value = 0;
    if (!ParsePromFloat(value_token, &value)) {
      return Error(absl::StrCat("sample of ", name, ": invalid value \"", Excerpt(value_token), "\""));
    }
    SkipBlanks(line, &pos);
    std::optional<int64_t> timestamp;
    if (pos < line.size()) {
      absl::string_view timestamp_token = ReadUntilBlank(line, &pos);
      int64_t ms = 0;
      if (!ParsePromTimestamp(timestamp_token, &ms)) {
        return Error(absl::StrCat("sample of ", name, ": invalid timestamp \"", Excerpt(timestamp_token), "\""));
      }
      timestamp = ms;
      SkipBlanks(line, &pos);
      if (pos < line.size()) {
        return Error(absl::StrCat("sample of ", name, ": unexpected text after the timestamp: \"",
                                  Excerpt(line.substr(pos)), "\""));
      }
    }
    if (keep) {
      sample.value = value;
      sample.timestamp_ms = timestamp;
      page_.samples.push_back(std::move(sample));
    }
    return absl::OkStatus();
  }

  // Parses `label="value", ...}` starting after '{'. `sample` is null when the sample is not kept:
  // the labels are then checked but not stored.
  absl::Status ParseLabels(absl::string_view line, size_t* pos, PromSample* sample) {
    size_t count = 0;
    // Label names seen on this sample, to reject duplicates; pages rarely carry more than a
    // handful of labels per sample, so a linear scan beats hashing.
    label_names_.clear();
    while (true) {
      SkipBlanks(line, pos);
      if (*pos >= line.size()) return Error("label set: missing closing '}'");
      if (line[*pos] == '}') {
        ++*pos;
        return absl::OkStatus();
      }
      const size_t name_start = *pos;
      if (!IsLabelNameStart(line[*pos])) {
        return Error(absl::StrCat("label set: invalid label name at \"", Excerpt(line.substr(*pos)), "\""));
      }
      while (*pos < line.size() && IsLabelNameChar(line[*pos])) ++*pos;
      absl::string_view label_name = line.substr(name_start, *pos - name_start);
      if (std::find(label_names_.begin(), label_names_.end(), label_name) != label_names_.end()) {
        return Error(absl::StrCat("label set: duplicate label name \"", label_name, "\""));
      }
      if (++count > options_.max_labels_per_sample) {
        return Error(absl::StrCat("label set: more than ", options_.max_labels_per_sample, " labels"));
      }
      label_names_.push_back(label_name);
      SkipBlanks(line, pos);
      if (*pos >= line.size() || line[*pos] != '=') {
        return Error(absl::StrCat("label set: expected '=' after label name \"", label_name, "\""));
      }
      ++*pos;
      SkipBlanks(line, pos);
      if (*pos >= line.size() || line[*pos] != '"') {
        return Error(absl::StrCat("label set: value of label \"", label_name, "\" must start with '\"'"));
      }
      ++*pos;
      std::string value;
      absl::Status status = ReadQuoted(line, pos, label_name, sample != nullptr ? &value : nullptr);
      if (!status.ok()) return status;
      if (sample != nullptr) sample->labels.emplace_back(std::string(label_name), std::move(value));
      SkipBlanks(line, pos);
      if (*pos >= line.size()) return Error("label set: missing closing '}'");
      if (line[*pos] == ',') {
        ++*pos;
      } else if (line[*pos] != '}') {
        return Error(absl::StrCat("label set: expected ',' or '}' after the value of label \"", label_name,
                                  "\", got \"", Excerpt(line.substr(*pos)), "\""));
      }
    }
  }

  // Reads an escaped label value up to its closing quote (`*pos` is just after the opening one).
  absl::Status ReadQuoted(absl::string_view line, size_t* pos, absl::string_view label_name, std::string* out) {
    const size_t start = *pos;
    while (*pos < line.size()) {
      const char c = line[(*pos)++];
      if (c == '"') {
        // Escapes are ASCII, so checking the raw bytes checks the unescaped value.
        if (!IsValidUtf8(line.substr(start, *pos - 1 - start))) {
          return Error(absl::StrCat("value of label \"", label_name, "\" is not valid UTF-8"));
        }
        return absl::OkStatus();
      }
      if (c != '\\') {
        if (out != nullptr) out->push_back(c);
        continue;
      }
      if (*pos >= line.size()) break;
      const char escaped = line[(*pos)++];
      char decoded;
      if (escaped == '\\') {
        decoded = '\\';
      } else if (escaped == '"') {
        decoded = '"';
      } else if (escaped == 'n') {
        decoded = '\n';
      } else {
        return Error(absl::StrCat("value of label \"", label_name, "\": invalid escape sequence \"\\",
                                  Excerpt(absl::string_view(&escaped, 1)), "\""));
      }
      if (out != nullptr) out->push_back(decoded);
    }
    return Error(absl::StrCat("value of label \"", label_name, "\": unterminated quoted string"));
  }

  static void SkipBlanks(absl::string_view text, size_t* pos) {
    while (*pos < text.size() && IsBlank(text[*pos])) ++*pos;
  }
  static absl::string_view ReadUntilBlank(absl::string_view text, size_t* pos) {
    const size_t start = *pos;
    while (*pos < text.size() && !IsBlank(text[*pos])) ++*pos;
    return text.substr(start, *pos - start);
  }
  static bool IsValidMetricName(absl::string_view name) {
    if (name.empty() || !IsMetricNameStart(name.front())) return false;
    return std::all_of(name.begin(), name.end(), IsMetricNameChar);
  }

  const absl::string_view text_;
  const PromParseOptions& options_;
  PromPage page_;
  int64_t line_number_ = 0;
  size_t sample_lines_ = 0;
  std::vector<absl::string_view> label_names_;
};

// The metric names of one engine.
struct EngineMetricNames {
  EngineKind engine;
  absl::string_view running;
  absl::string_view waiting;
  // KV usage gauges in order of preference (vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc).
  std::vector<absl::string_view> kv_usage;
};

const std::vector<EngineMetricNames>& KnownEngines() {
  static const auto* engines = new std::vector<EngineMetricNames>{
      {EngineKind::kVllm,
       "vllm:num_requests_running",
       "vllm:num_requests_waiting",
       {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}},
      {EngineKind::kSglang, "sglang:num_running_reqs", "sglang:num_queue_reqs", {"sglang:token_usage"}},
  };
  return *engines;
}

bool SelectedByModel(const PromSample& sample, absl::string_view model_name) {
  if (model_name.empty()) return true;
  const std::string* label = sample.Label("model_name");
  return label != nullptr && *label == model_name;
}

absl::Status CheckLoadValue(const PromSample& sample) {
  if (!std::isfinite(sample.value) || sample.value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(sample.name, " has the value ", sample.value, "; a load must be finite and >= 0"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view PromMetricTypeName(PromMetricType type) {
  switch (type) {
    case PromMetricType::kUntyped:
      return "untyped";
    case PromMetricType::kCounter:
      return "counter";
    case PromMetricType::kGauge:
      return "gauge";
    case PromMetricType::kHistogram:
      return "histogram";
    case PromMetricType::kSummary:
      return "summary";
  }
  return "untyped";
}

const std::string* PromSample::Label(absl::string_view label_name) const {
  for (const auto& [name, value] : labels) {
    if (name == label_name) return &value;
  }
  return nullptr;
}

absl::StatusOr<PromPage> ParsePromText(absl::string_view text, const PromParseOptions& options) {
  return PageParser(text, options).Parse();
}

absl::string_view EngineKindName(EngineKind kind) {
  switch (kind) {
    case EngineKind::kAuto:
      return "auto";
    case EngineKind::kVllm:
      return "vllm";
    case EngineKind::kSglang:
      return "sglang";
  }
  return "auto";
}

absl::StatusOr<EngineKind> ParseEngineKind(absl::string_view name) {
  if (name == "auto") return EngineKind::kAuto;
  if (name == "vllm") return EngineKind::kVllm;
  if (name == "sglang") return EngineKind::kSglang;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown engine \"", Excerpt(name), "\"; expected auto, vllm or sglang"));
}

absl::flat_hash_set<std::string> EngineLoadMetricNames(EngineKind engine) {
  absl::flat_hash_set<std::string> names;
  for (const EngineMetricNames& known : KnownEngines()) {
    if (engine != EngineKind::kAuto && engine != known.engine) continue;
    names.emplace(known.running);
    names.emplace(known.waiting);
    for (absl::string_view kv : known.kv_usage) names.emplace(kv);
  }
  return names;
}

absl::StatusOr<EngineLoad> EngineLoadFromPage(const PromPage& page, const EngineLoadOptions& options) {
  const EngineMetricNames* chosen = nullptr;
  for (const EngineMetricNames& known : KnownEngines()) {
    if (options.engine != EngineKind::kAuto && options.engine != known.engine) continue;
    const bool present = std::any_of(page.samples.begin(), page.samples.end(),
                                     [&](const PromSample& s) { return s.name == known.running; });
    if (present) {
      chosen = &known;
      break;
    }
  }
  if (chosen == nullptr) {
    if (options.engine == EngineKind::kAuto) {
      return absl::InvalidArgumentError(
          "no decode engine load metrics on the page (neither vllm:num_requests_running nor "
          "sglang:num_running_reqs)");
    }
    const EngineMetricNames& wanted =
        *std::find_if(KnownEngines().begin(), KnownEngines().end(),
                      [&](const EngineMetricNames& known) { return known.engine == options.engine; });
    return absl::InvalidArgumentError(absl::StrCat("no ", wanted.running, " on the page"));
  }

  EngineLoad load;
  load.engine = chosen->engine;
  bool any_waiting = false;
  std::vector<std::string> other_models;
  double kv_sum = 0;
  int kv_series = 0;
  for (const PromSample& sample : page.samples) {
    const bool is_running = sample.name == chosen->running;
    const bool is_waiting = sample.name == chosen->waiting;
    if (!is_running && !is_waiting) continue;
    if (!SelectedByModel(sample, options.model_name)) {
      const std::string* model = sample.Label("model_name");
      const std::string shown = model == nullptr ? "(no model_name label)" : absl::StrCat("\"", *model, "\"");
      if (other_models.size() < 8 && std::find(other_models.begin(), other_models.end(), shown) == other_models.end()) {
        other_models.push_back(shown);
      }
      continue;
    }
    absl::Status status = CheckLoadValue(sample);
    if (!status.ok()) return status;
    if (is_running) {
      load.running += sample.value;
      ++load.series;
    } else {
      load.waiting += sample.value;
      any_waiting = true;
    }
  }
  if (load.series == 0) {
    return absl::InvalidArgumentError(absl::StrCat("no ", chosen->running, " series with model_name \"",
                                                   options.model_name, "\"; the page has ",
                                                   absl::StrJoin(other_models, ", ")));
  }
  if (!any_waiting) {
    return absl::InvalidArgumentError(
        absl::StrCat("the page has ", chosen->running, " but no ", chosen->waiting,
                     options.model_name.empty() ? "" : absl::StrCat(" for model_name \"", options.model_name, "\"")));
  }
  for (absl::string_view candidate : chosen->kv_usage) {
    for (const PromSample& sample : page.samples) {
      if (sample.name != candidate || !SelectedByModel(sample, options.model_name)) continue;
      absl::Status status = CheckLoadValue(sample);
      if (!status.ok()) return status;
      kv_sum += sample.value;
      ++kv_series;
    }
    if (kv_series > 0) break;
  }
  if (kv_series > 0) load.kv_usage = std::clamp(kv_sum / kv_series, 0.0, 1.0);
  return load;
}

absl::StatusOr<EngineLoad> ParseEngineLoad(absl::string_view text, const EngineLoadOptions& options) {
  PromParseOptions parse_options;
  parse_options.keep_metrics = EngineLoadMetricNames(options.engine);
  absl::StatusOr<PromPage> page = ParsePromText(text, parse_options);
  if (!page.ok()) return page.status();
  return EngineLoadFromPage(*page, options);
}

}  // namespace eldr
