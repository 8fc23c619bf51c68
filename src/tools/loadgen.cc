// eldr-loadgen: an HTTP load generator for OpenAI-compatible (streaming) completion endpoints:
// eldr-proxy, vLLM, eldr-engine-emu. It measures what a client observes: time to first token
// (TTFT), time per output token (TPOT), end-to-end latency, the gaps between tokens, and errors.
//
// Which requests, and when: the same workload as eldr-sim (LoadTraceWorkload of --trace with
// --experts, --prefill_fraction, --calibration_fraction, --split_seed) and the same arrival
// sequence (MakeArrivals with --seed): the i-th request names trace request N = arrivals[i].request
// in its prompt ("eldr-trace:<N> " followed by filler words up to --prompt_bytes), as
// docs/engine-emulator.md specifies, so an emulator (or a proxy that routes on it) serves the same
// requests eldr-sim replays.
//   open loop    --rate=R: requests start at the Poisson arrival times of MakeArrivals at rate R,
//                whether or not earlier ones finished;
//   closed loop  --concurrency=C: C requests are in flight at all times (the next one starts when
//                one ends), in the order of the same arrival sequence.
// Either stops after --requests or --duration_s (whichever comes first when both are set);
// requests in flight then finish. Requests that start within the first --warmup_s seconds are
// sent but left out of every statistic.
//
// Per request: TTFT = send -> first event carrying text (choices[0].text or
// choices[0].delta.content non-empty; non-streaming: the whole response); TPOT = (last token -
// first token) / (tokens - 1) for requests with at least 2 tokens; end-to-end = send -> end;
// inter-token gaps (every gap of every request: the per-token latency a proxy adds shows here);
// tokens (the events carrying text; `usage.completion_tokens`, when sent, is compared with it and
// mismatches are counted). Latency statistics cover the requests that succeeded. Errors by kind:
//   connect      the server could not be reached (nothing of a response arrived)
//   http_<code>  a status other than 2xx
//   timeout      --timeout_s, --connect_timeout_s or --idle_timeout_s passed
//   stream_error an `error` object in the answer, a stream that ends without [DONE], a
//                connection that failed mid-answer, a malformed HTTP response
//   bad_json     an event or answer that is not JSON
//
// Rates: achieved_rate is the rate at which the measured requests started; duration_s spans the
// start of the measurement to the end of the last measured request, and tokens_per_s is their
// tokens over it (the drain at the end included).
//
// Output: a summary on stdout (on stderr with --json, which prints one JSON object on stdout
// instead), and with --out_requests one JSON line per request. The report includes the
// generator's own CPU time (getrusage) so a benchmark can subtract its cost. Exit status: 0 when
// the run completed (errors are data), 2 for bad flags (a --trace that cannot be loaded included),
// 1 when nothing could be sent (every request failed to connect, or none was due).
//
// Examples:
//   eldr-loadgen --target=127.0.0.1:8000 --rate=20 --duration_s=60 --warmup_s=5 --json
//   eldr-loadgen --target=127.0.0.1:8000 --concurrency=5000 --requests=50000 --endpoint=chat
#include <signal.h>
#include <sys/resource.h>
#include <sys/time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "eldr/common/daemon.h"
#include "eldr/http/http_client.h"
#include "eldr/http/sse.h"
#include "nlohmann/json.hpp"
#include "sim/workload.h"

ABSL_FLAG(std::string, target, "", "host:port of the server (IPv6: [addr]:port); required");
ABSL_FLAG(std::string, endpoint, "completions",
          "completions (POST /v1/completions with `prompt`) or chat (POST /v1/chat/completions with `messages`)");
ABSL_FLAG(bool, stream, true, "Streamed answers (\"stream\": true with stream_options.include_usage)");
ABSL_FLAG(std::string, model, "", "The `model` field; not sent when empty");
ABSL_FLAG(int, max_tokens, 0, "The `max_tokens` field; 0: not sent (the engine decides)");
ABSL_FLAG(int, prompt_bytes, 256, "Prompt length in bytes: the eldr-trace marker, then filler words");
ABSL_FLAG(std::string, api_key, "", "Sent as `Authorization: Bearer <key>` when not empty");
ABSL_FLAG(std::string, trace, "data/esft-routing", "Folder of real expert traces (the workload of eldr-sim)");
ABSL_FLAG(int, experts, 64, "Routed experts of the traced model");
ABSL_FLAG(double, prefill_fraction, 0.5, "Prompt share of each trace sequence");
ABSL_FLAG(double, calibration_fraction, 0.5, "Share of each domain's sequences kept for calibration");
ABSL_FLAG(uint64_t, split_seed, 1, "Seed of the calibration/evaluation split");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the arrival sequence (MakeArrivals)");
ABSL_FLAG(double, rate, 0, "Open loop: Poisson arrivals at this many requests/s");
ABSL_FLAG(int, concurrency, 0, "Closed loop: requests kept in flight");
ABSL_FLAG(int, requests, 0, "Requests to send; 0: bounded by --duration_s only");
ABSL_FLAG(double, duration_s, 0, "Seconds during which requests are started; 0: bounded by --requests only");
ABSL_FLAG(double, warmup_s, 0, "Requests starting in the first seconds of the run are left out of the statistics");
ABSL_FLAG(int, threads, 1, "io threads of the HTTP client");
ABSL_FLAG(bool, keepalive, true, "Reuse connections between requests");
ABSL_FLAG(double, timeout_s, 600, "Per request: the whole request at most");
ABSL_FLAG(double, connect_timeout_s, 10, "Per request: resolve + TCP connect at most");
ABSL_FLAG(double, idle_timeout_s, 300, "Per request: the longest silence between two pieces of an answer");
ABSL_FLAG(bool, json, false, "Print one JSON object on stdout (the summary then goes to stderr)");
ABSL_FLAG(std::string, out_requests, "", "Write one JSON line per request to this file");

namespace {

using Clock = std::chrono::steady_clock;
using eldr::http::ClientCallbacks;
using eldr::http::ClientRequest;
using eldr::http::ClientResponseHead;
using eldr::http::ClientResult;
using eldr::http::HttpClient;
using eldr::http::HttpClientOptions;
using eldr::http::SseEvent;
using eldr::http::SseParser;
using nlohmann::json;

constexpr int kExitOk = 0;
constexpr int kExitNothingSent = 1;
constexpr int kExitBadFlags = 2;

// A non-2xx answer's body is kept up to this (for the error message); a non-streamed answer up to
// kMaxAnswerBytes.
constexpr size_t kMaxErrorBodyBytes = 4096;
constexpr size_t kMaxAnswerBytes = 64 << 20;
// Arrivals generated at most (open loop with --duration_s only: rate * duration).
constexpr double kMaxArrivals = 50e6;

std::atomic<bool> interrupted{false};

void OnSignal(int) { interrupted.store(true); }

double Seconds(Clock::duration duration) { return std::chrono::duration<double>(duration).count(); }
double Millis(Clock::duration duration) { return std::chrono::duration<double, std::milli>(duration).count(); }

// ---- Flags ---------------------------------------------------------------------------------------

// absl::ParseCommandLine exits with status 1 on an unknown flag or a bad value; this tool promises
// 2. So every "--name[=value]" is checked against the registry (and its value parsed into the
// flag) first; absl's own parse then sees only good flags. Its special flags (--help*, --flagfile,
// ...) are left to it.
bool CheckFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::StartsWith(arg, "-")) continue;
    absl::string_view body = arg.substr(absl::StartsWith(arg, "--") ? 2 : 1);
    absl::string_view name = body, value;
    const size_t equals = body.find('=');
    const bool has_value = equals != absl::string_view::npos;
    if (has_value) {
      name = body.substr(0, equals);
      value = body.substr(equals + 1);
    }
    if (absl::StartsWith(name, "help") || name == "version" || name == "only_check_args" || name == "flagfile" ||
        name == "fromenv" || name == "tryfromenv" || name == "undefok") {
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    bool negated = false;
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      flag = absl::FindCommandLineFlag(name.substr(2));
      negated = flag != nullptr && flag->IsOfType<bool>() && !has_value;
      if (!negated) flag = nullptr;
    }
    if (flag == nullptr) {
      std::cerr << "eldr-loadgen: unknown flag " << arg << " (--help lists the flags)\n";
      return false;
    }
    std::string text;
    if (negated) {
      text = "false";
    } else if (has_value) {
      text = std::string(value);
    } else if (flag->IsOfType<bool>()) {
      text = "true";
    } else if (i + 1 < argc) {
      text = argv[++i];
    } else {
      std::cerr << "eldr-loadgen: flag --" << name << " needs a value\n";
      return false;
    }
    std::string error;
    if (!flag->ParseFrom(text, &error)) {
      std::cerr << "eldr-loadgen: bad value for --" << flag->Name() << ": " << error << "\n";
      return false;
    }
  }
  return true;
}

struct Config {
  std::string host;
  int port = 0;
  std::string target_text;
  bool chat = false;
  bool stream = true;
  std::string model;
  int max_tokens = 0;
  int prompt_bytes = 256;
  std::string api_key;
  eldr::sim::TraceWorkloadOptions workload;
  uint64_t seed = 1;
  double rate = 0;        // open loop when > 0
  int concurrency = 0;    // closed loop when > 0
  int requests = 0;       // 0: unbounded
  double duration_s = 0;  // 0: unbounded
  double warmup_s = 0;
  int threads = 1;
  bool keepalive = true;
  absl::Duration timeout;
  absl::Duration connect_timeout;
  absl::Duration idle_timeout;
  bool json = false;
  std::string out_requests;
};

absl::Status ParseTarget(absl::string_view text, Config* config) {
  const auto invalid = [&] {
    return absl::InvalidArgumentError(absl::StrCat("--target must be host:port or [IPv6]:port, got \"", text, "\""));
  };
  absl::string_view host, port;
  if (absl::StartsWith(text, "[")) {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') return invalid();
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) return invalid();
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (absl::StrContains(host, ':')) return invalid();
  }
  int port_number = 0;
  if (host.empty() || !absl::SimpleAtoi(port, &port_number) || port_number < 1 || port_number > 65535) {
    return invalid();
  }
  config->host = std::string(host);
  config->port = port_number;
  config->target_text = std::string(text);
  return absl::OkStatus();
}

absl::Duration SecondsFlag(double seconds) { return absl::Seconds(seconds); }

absl::StatusOr<Config> ConfigFromFlags() {
  Config config;
  if (absl::GetFlag(FLAGS_target).empty()) return absl::InvalidArgumentError("--target is required (host:port)");
  if (absl::Status status = ParseTarget(absl::GetFlag(FLAGS_target), &config); !status.ok()) return status;
  const std::string endpoint = absl::GetFlag(FLAGS_endpoint);
  if (endpoint != "completions" && endpoint != "chat") {
    return absl::InvalidArgumentError(absl::StrCat("--endpoint must be completions or chat, got \"", endpoint, "\""));
  }
  config.chat = endpoint == "chat";
  config.stream = absl::GetFlag(FLAGS_stream);
  config.model = absl::GetFlag(FLAGS_model);
  config.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (config.max_tokens < 0) return absl::InvalidArgumentError("--max_tokens must be >= 0 (0: not sent)");
  config.prompt_bytes = absl::GetFlag(FLAGS_prompt_bytes);
  if (config.prompt_bytes < 0 || config.prompt_bytes > (16 << 20)) {
    return absl::InvalidArgumentError("--prompt_bytes must be in [0, 16 MiB]");
  }
  config.api_key = absl::GetFlag(FLAGS_api_key);
  if (config.api_key.find_first_of("\r\n") != std::string::npos) {
    return absl::InvalidArgumentError("--api_key must not hold CR or LF");
  }
  config.workload.dir = absl::GetFlag(FLAGS_trace);
  config.workload.experts = absl::GetFlag(FLAGS_experts);
  config.workload.prefill_fraction = absl::GetFlag(FLAGS_prefill_fraction);
  config.workload.calibration_fraction = absl::GetFlag(FLAGS_calibration_fraction);
  config.workload.seed = absl::GetFlag(FLAGS_split_seed);
  if (config.workload.dir.empty()) return absl::InvalidArgumentError("--trace is required (a folder of traces)");
  config.seed = absl::GetFlag(FLAGS_seed);
  config.rate = absl::GetFlag(FLAGS_rate);
  config.concurrency = absl::GetFlag(FLAGS_concurrency);
  if (!(config.rate >= 0) || !std::isfinite(config.rate)) return absl::InvalidArgumentError("--rate must be >= 0");
  if (config.concurrency < 0 || config.concurrency > 1000000) {
    return absl::InvalidArgumentError("--concurrency must be in [0, 1000000]");
  }
  if ((config.rate > 0) == (config.concurrency > 0)) {
    return absl::InvalidArgumentError("set exactly one of --rate (open loop) and --concurrency (closed loop)");
  }
  config.requests = absl::GetFlag(FLAGS_requests);
  config.duration_s = absl::GetFlag(FLAGS_duration_s);
  config.warmup_s = absl::GetFlag(FLAGS_warmup_s);
  if (config.requests < 0) return absl::InvalidArgumentError("--requests must be >= 0");
  if (!(config.duration_s >= 0) || !std::isfinite(config.duration_s)) {
    return absl::InvalidArgumentError("--duration_s must be >= 0");
  }
  if (config.requests == 0 && config.duration_s == 0) {
    return absl::InvalidArgumentError("set --requests, --duration_s or both");
  }
  if (!(config.warmup_s >= 0) || !std::isfinite(config.warmup_s)) {
    return absl::InvalidArgumentError("--warmup_s must be >= 0");
  }
  if (config.rate > 0 && config.requests == 0 && config.rate * config.duration_s > kMaxArrivals) {
    return absl::InvalidArgumentError("--rate * --duration_s exceeds 50 million requests");
  }
  config.threads = absl::GetFlag(FLAGS_threads);
  if (config.threads < 1 || config.threads > 256) return absl::InvalidArgumentError("--threads must be in [1, 256]");
  config.keepalive = absl::GetFlag(FLAGS_keepalive);
  for (const auto& [value, name] : {std::pair{absl::GetFlag(FLAGS_timeout_s), "--timeout_s"},
                                    std::pair{absl::GetFlag(FLAGS_connect_timeout_s), "--connect_timeout_s"},
                                    std::pair{absl::GetFlag(FLAGS_idle_timeout_s), "--idle_timeout_s"}}) {
    if (!(value > 0)) return absl::InvalidArgumentError(absl::StrCat(name, " must be > 0"));
  }
  config.timeout = SecondsFlag(absl::GetFlag(FLAGS_timeout_s));
  config.connect_timeout = SecondsFlag(absl::GetFlag(FLAGS_connect_timeout_s));
  config.idle_timeout = SecondsFlag(absl::GetFlag(FLAGS_idle_timeout_s));
  config.json = absl::GetFlag(FLAGS_json);
  config.out_requests = absl::GetFlag(FLAGS_out_requests);
  return config;
}

// ---- Statistics ----------------------------------------------------------------------------------

// Quantiles of exact samples (linear interpolation between order statistics).
struct Summary {
  size_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
};

Summary Summarize(std::vector<double> values) {
  Summary summary;
  summary.count = values.size();
  if (values.empty()) return summary;
  std::sort(values.begin(), values.end());
  const auto quantile = [&](double q) {
    const double position = q * static_cast<double>(values.size() - 1);
    const size_t low = static_cast<size_t>(std::floor(position));
    const size_t high = std::min(low + 1, values.size() - 1);
    return values[low] + (values[high] - values[low]) * (position - static_cast<double>(low));
  };
  double sum = 0;
  for (double value : values) sum += value;
  summary.mean = sum / static_cast<double>(values.size());
  summary.p50 = quantile(0.5);
  summary.p90 = quantile(0.9);
  summary.p99 = quantile(0.99);
  summary.max = values.back();
  return summary;
}

// Inter-token gaps: there may be hundreds of millions in a long run, so they go into a histogram
// with logarithmic buckets 0.1% wide (quantiles within 0.1%), from 1 us to ~1000 s; one per io
// thread (no locking), merged at the end. The maximum and the mean are exact.
class GapHistogram {
 public:
  GapHistogram() : counts_(kBuckets, 0) {}

  void Add(double ms) {
    const double us = std::max(ms * 1000.0, 1.0);
    const size_t bucket = std::min<size_t>(static_cast<size_t>(std::log(us) / kLogRatio + 0.5), kBuckets - 1);
    ++counts_[bucket];
    ++count_;
    sum_ms_ += ms;
    max_ms_ = std::max(max_ms_, ms);
  }

  void Merge(const GapHistogram& other) {
    for (size_t i = 0; i < kBuckets; ++i) counts_[i] += other.counts_[i];
    count_ += other.count_;
    sum_ms_ += other.sum_ms_;
    max_ms_ = std::max(max_ms_, other.max_ms_);
  }

  Summary Summarize() const {
    Summary summary;
    summary.count = count_;
    if (count_ == 0) return summary;
    summary.mean = sum_ms_ / static_cast<double>(count_);
    summary.max = max_ms_;
    const auto quantile = [&](double q) {
      const uint64_t rank = static_cast<uint64_t>(std::ceil(q * static_cast<double>(count_)));
      uint64_t seen = 0;
      for (size_t i = 0; i < kBuckets; ++i) {
        seen += counts_[i];
        if (seen >= std::max<uint64_t>(rank, 1))
          return std::min(std::exp(static_cast<double>(i) * kLogRatio) / 1000.0, max_ms_);
      }
      return max_ms_;
    };
    summary.p50 = quantile(0.5);
    summary.p90 = quantile(0.9);
    summary.p99 = quantile(0.99);
    return summary;
  }

 private:
  static constexpr double kLogRatio = 0.0009995003330835331;  // log(1.001)
  static constexpr size_t kBuckets = 20800;                   // 1.001^20800 us ~ 1070 s

  std::vector<uint64_t> counts_;
  uint64_t count_ = 0;
  double sum_ms_ = 0;
  double max_ms_ = 0;
};

// The histograms of the io threads. Each thread adds to its own; they are read after the client
// (and so its threads) is gone.
class GapHistograms {
 public:
  GapHistogram& ForThisThread() {
    thread_local GapHistogram* mine = nullptr;
    thread_local const GapHistograms* owner = nullptr;
    if (mine == nullptr || owner != this) {
      absl::MutexLock lock(&mu_);
      histograms_.push_back(std::make_unique<GapHistogram>());
      mine = histograms_.back().get();
      owner = this;
    }
    return *mine;
  }
  GapHistogram Merged() {
    absl::MutexLock lock(&mu_);
    GapHistogram merged;
    for (const auto& histogram : histograms_) merged.Merge(*histogram);
    return merged;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::unique_ptr<GapHistogram>> histograms_ ABSL_GUARDED_BY(mu_);
};

// ---- Requests --------------------------------------------------------------------------------------

// One request's outcome. Written by its own callbacks only (serialised by the client), read once
// the client is gone.
struct Record {
  int sequence = 0;
  int trace_request = 0;
  bool measured = false;
  Clock::time_point start;
  Clock::time_point end;
  int http_status = 0;
  std::string error;  // kind; empty: ok
  int tokens = 0;
  std::optional<int64_t> usage_tokens;
  std::optional<double> ttft_ms;
  std::optional<double> tpot_ms;
  double e2e_ms = 0;
};

// The state of one request in flight.
struct InFlight {
  Record* record = nullptr;
  SseParser parser;
  bool success_status = false;
  bool saw_done = false;
  std::string body;  // non-streamed answer, or a non-2xx answer's first bytes
  std::string error_message;
  Clock::time_point first_token;
  Clock::time_point last_token;
};

// The filler after the marker: words, so a tokenizer sees ordinary text.
std::string MakeFiller(size_t bytes) {
  static constexpr const char* kWords[] = {"the",    "router", "sends", "each",    "request", "to",  "a",
                                           "decode", "worker", "whose", "experts", "match",   "its", "prompt"};
  std::string filler;
  for (size_t i = 0; filler.size() < bytes; ++i) absl::StrAppend(&filler, kWords[i % 14], " ");
  filler.resize(bytes);
  return filler;
}

class LoadGenerator {
 public:
  LoadGenerator(Config config, const eldr::sim::Workload& workload, std::unique_ptr<HttpClient> client)
      : config_(std::move(config)), workload_(workload), client_(std::move(client)) {
    filler_ = MakeFiller(static_cast<size_t>(config_.prompt_bytes));
    base_request_.method = "POST";
    base_request_.host = config_.host;
    base_request_.port = config_.port;
    base_request_.target = config_.chat ? "/v1/chat/completions" : "/v1/completions";
    base_request_.headers = {{"Content-Type", "application/json"},
                             {"Accept", config_.stream ? "text/event-stream" : "application/json"}};
    if (!config_.api_key.empty()) base_request_.headers.emplace_back("Authorization", "Bearer " + config_.api_key);
    base_request_.connect_timeout = config_.connect_timeout;
    base_request_.idle_timeout = config_.idle_timeout;
    base_request_.total_timeout = config_.timeout;
  }

  // Runs the whole load; returns once every request sent has ended.
  void Run();

  // After Run: the report as JSON and as text.
  json Report();
  std::string Text(const json& report) const;
  absl::Status WriteRequests(const std::string& path);

  int64_t sent() const { return sent_.load(); }
  // Requests that reached the server (a response head arrived, or at least no connect error).
  int64_t reached() const { return reached_.load(); }

 private:
  std::string Body(int trace_request) const;
  // A record for the next request, counted as sent (under the lock that decides whether the run
  // still sends, so that Run never sees every sent request ended while one is about to start).
  Record* AddRecordLocked(int sequence, int trace_request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts the request of `record` (from any thread).
  void Send(Record* record);
  void OnHead(InFlight& flight, const ClientResponseHead& head);
  void OnBody(InFlight& flight, absl::string_view piece);
  void OnEvent(InFlight& flight, const SseEvent& event);
  void OnDone(InFlight& flight, const ClientResult& result);
  // The answer of a non-streamed request.
  void ParseAnswer(InFlight& flight);
  void Fail(InFlight& flight, const char* kind, std::string message);
  // Closed loop: the next request of the sequence, unless the run is over.
  void SendNextClosedLoop();
  bool StopSending() const;

  const Config config_;
  const eldr::sim::Workload& workload_;
  std::unique_ptr<HttpClient> client_;
  std::string filler_;
  ClientRequest base_request_;
  GapHistograms gaps_;

  Clock::time_point run_start_;
  Clock::time_point measure_start_;
  Clock::time_point send_deadline_ = Clock::time_point::max();
  double cpu_start_s_ = 0;
  double cpu_user_s_ = 0, cpu_sys_s_ = 0;
  Clock::time_point run_end_;
  double max_send_lag_ms_ = 0;  // open loop: how late the latest request started

  std::atomic<int64_t> sent_{0};
  std::atomic<int64_t> reached_{0};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> max_in_flight_{0};
  std::atomic<bool> stop_{false};

  absl::Mutex mu_;
  std::deque<Record> records_ ABSL_GUARDED_BY(mu_);  // by sequence; references stay valid
  std::vector<eldr::sim::Arrival> arrivals_ ABSL_GUARDED_BY(mu_);
  int next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t ended_ ABSL_GUARDED_BY(mu_) = 0;
  bool sending_done_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::string> first_error_ ABSL_GUARDED_BY(mu_);  // kind -> its first message
};

std::string LoadGenerator::Body(int trace_request) const {
  std::string prompt = absl::StrCat("eldr-trace:", trace_request, " ");
  if (prompt.size() < filler_.size()) prompt.append(filler_, 0, filler_.size() - prompt.size());
  json body = json::object();
  if (!config_.model.empty()) body["model"] = config_.model;
  if (config_.chat) {
    body["messages"] = json::array({json{{"role", "user"}, {"content", prompt}}});
  } else {
    body["prompt"] = prompt;
  }
  if (config_.max_tokens > 0) body["max_tokens"] = config_.max_tokens;
  body["stream"] = config_.stream;
  if (config_.stream) body["stream_options"] = json{{"include_usage", true}};
  return body.dump();
}

bool LoadGenerator::StopSending() const {
  return stop_.load(std::memory_order_relaxed) || interrupted.load(std::memory_order_relaxed) ||
         Clock::now() >= send_deadline_;
}

Record* LoadGenerator::AddRecordLocked(int sequence, int trace_request) {
  records_.emplace_back();
  Record* record = &records_.back();
  record->sequence = sequence;
  record->trace_request = trace_request;
  sent_.fetch_add(1);
  return record;
}

void LoadGenerator::Send(Record* record) {
  auto flight = std::make_shared<InFlight>();
  flight->record = record;
  ClientRequest request = base_request_;
  request.body = Body(record->trace_request);
  const int64_t now_in_flight = in_flight_.fetch_add(1) + 1;
  int64_t seen = max_in_flight_.load();
  while (now_in_flight > seen && !max_in_flight_.compare_exchange_weak(seen, now_in_flight)) {
  }
  ClientCallbacks callbacks;
  callbacks.on_head = [this, flight](const ClientResponseHead& head) { OnHead(*flight, head); };
  callbacks.on_body = [this, flight](absl::string_view piece) { OnBody(*flight, piece); };
  callbacks.on_done = [this, flight](const ClientResult& result) { OnDone(*flight, result); };
  record->start = Clock::now();
  record->measured = record->start >= measure_start_;
  client_->Start(std::move(request), std::move(callbacks));
}

void LoadGenerator::Fail(InFlight& flight, const char* kind, std::string message) {
  if (!flight.record->error.empty()) return;
  flight.record->error = kind;
  flight.error_message = std::move(message);
}

void LoadGenerator::OnHead(InFlight& flight, const ClientResponseHead& head) {
  flight.record->http_status = head.status;
  flight.success_status = head.status / 100 == 2;  // else the kind is set at the end (http_<code>)
}

void LoadGenerator::OnBody(InFlight& flight, absl::string_view piece) {
  if (!flight.success_status) {
    if (flight.body.size() < kMaxErrorBodyBytes) {
      flight.body.append(piece.data(), std::min(piece.size(), kMaxErrorBodyBytes - flight.body.size()));
    }
    return;
  }
  if (!config_.stream) {
    if (flight.body.size() + piece.size() > kMaxAnswerBytes) {
      Fail(flight, "bad_json", absl::StrCat("the answer exceeds ", kMaxAnswerBytes, " bytes"));
      return;
    }
    flight.body.append(piece.data(), piece.size());
    return;
  }
  if (!flight.record->error.empty()) return;
  const absl::Status status = flight.parser.Feed(piece, [&](const SseEvent& event) { OnEvent(flight, event); });
  if (!status.ok()) Fail(flight, "stream_error", std::string(status.message()));
}

// The text of choices[0] (`text`, or chat's `delta.content`), or empty.
absl::string_view ChoiceText(const json& message) {
  const auto choices = message.find("choices");
  if (choices == message.end() || !choices->is_array() || choices->empty()) return {};
  const json& choice = choices->front();
  if (!choice.is_object()) return {};
  const auto text = choice.find("text");
  if (text != choice.end() && text->is_string()) return text->get_ref<const std::string&>();
  for (const char* container : {"delta", "message"}) {
    const auto part = choice.find(container);
    if (part == choice.end() || !part->is_object()) continue;
    const auto content = part->find("content");
    if (content != part->end() && content->is_string()) return content->get_ref<const std::string&>();
  }
  return {};
}

std::optional<int64_t> UsageTokens(const json& message) {
  const auto usage = message.find("usage");
  if (usage == message.end() || !usage->is_object()) return std::nullopt;
  const auto tokens = usage->find("completion_tokens");
  if (tokens == usage->end() || !tokens->is_number_integer()) return std::nullopt;
  return tokens->get<int64_t>();
}

std::string ErrorText(const json& message) {
  const json& error = message["error"];
  if (error.is_object() && error.contains("message") && error["message"].is_string()) {
    return error["message"].get<std::string>();
  }
  return error.dump();
}

bool HasError(const json& message) {
  const auto error = message.find("error");
  return error != message.end() && !error->is_null();
}

void LoadGenerator::OnEvent(InFlight& flight, const SseEvent& event) {
  if (!flight.record->error.empty() || flight.saw_done) return;
  if (event.data == "[DONE]") {
    flight.saw_done = true;
    return;
  }
  const json message = json::parse(event.data, nullptr, /*allow_exceptions=*/false);
  if (message.is_discarded() || !message.is_object()) {
    Fail(flight, "bad_json", absl::StrCat("an event is not a JSON object: ", event.data.substr(0, 200)));
    return;
  }
  if (HasError(message)) {
    Fail(flight, "stream_error", ErrorText(message));
    return;
  }
  if (const std::optional<int64_t> usage = UsageTokens(message)) flight.record->usage_tokens = usage;
  if (ChoiceText(message).empty()) return;
  const Clock::time_point now = Clock::now();
  Record& record = *flight.record;
  if (++record.tokens == 1) {
    flight.first_token = now;
  } else if (record.measured) {
    gaps_.ForThisThread().Add(Millis(now - flight.last_token));
  }
  flight.last_token = now;
}

void LoadGenerator::ParseAnswer(InFlight& flight) {
  const json message = json::parse(flight.body, nullptr, /*allow_exceptions=*/false);
  if (message.is_discarded() || !message.is_object()) {
    Fail(flight, "bad_json", absl::StrCat("the answer is not a JSON object: ", flight.body.substr(0, 200)));
    return;
  }
  if (HasError(message)) {
    Fail(flight, "stream_error", ErrorText(message));
    return;
  }
  Record& record = *flight.record;
  record.usage_tokens = UsageTokens(message);
  if (record.usage_tokens) {
    record.tokens = static_cast<int>(*record.usage_tokens);
  } else {
    record.tokens = ChoiceText(message).empty() ? 0 : 1;
  }
}

void LoadGenerator::OnDone(InFlight& flight, const ClientResult& result) {
  Record& record = *flight.record;
  record.end = Clock::now();
  record.e2e_ms = Millis(record.end - record.start);
  if (!result.status.ok()) {
    const char* kind = "stream_error";
    switch (result.status.code()) {
      case absl::StatusCode::kUnavailable:
        kind = result.head_received ? "stream_error" : "connect";
        break;
      case absl::StatusCode::kDeadlineExceeded:
        // A connect that timed out never reached the server.
        kind = !result.head_received && absl::StrContains(result.status.message(), "connect_timeout") ? "connect"
                                                                                                      : "timeout";
        break;
      case absl::StatusCode::kCancelled:
        kind = "cancelled";
        break;
      default:
        break;
    }
    Fail(flight, kind, std::string(result.status.message()));
  }
  if (record.error != "connect") reached_.fetch_add(1);
  if (!flight.success_status && result.head_received) {
    record.error = absl::StrCat("http_", record.http_status);
    flight.error_message = flight.body;
  }
  if (record.error.empty()) {
    if (config_.stream) {
      if (!flight.saw_done) Fail(flight, "stream_error", "the stream ended without data: [DONE]");
    } else {
      ParseAnswer(flight);
    }
  }
  if (record.error.empty()) {
    if (config_.stream) {
      if (record.tokens > 0) record.ttft_ms = Millis(flight.first_token - record.start);
      if (record.tokens >= 2) {
        record.tpot_ms = Millis(flight.last_token - flight.first_token) / static_cast<double>(record.tokens - 1);
      }
    } else {
      record.ttft_ms = record.e2e_ms;
    }
  }
  const std::string kind = record.error;
  const std::string message = std::move(flight.error_message);
  flight.body.clear();
  in_flight_.fetch_sub(1);
  {
    absl::MutexLock lock(&mu_);
    if (!kind.empty() && !first_error_.count(kind)) first_error_[kind] = message.substr(0, 300);
    ++ended_;
  }
  if (config_.concurrency > 0) SendNextClosedLoop();
}

void LoadGenerator::SendNextClosedLoop() {
  Record* record;
  {
    absl::MutexLock lock(&mu_);
    if (sending_done_) return;
    if (StopSending() || (config_.requests > 0 && next_sequence_ >= config_.requests)) {
      sending_done_ = true;
      return;
    }
    if (next_sequence_ >= static_cast<int>(arrivals_.size())) {
      // Duration-bounded closed loop: extend the sequence (MakeArrivals is prefix-stable).
      const int count = static_cast<int>(std::min<int64_t>(int64_t{2} * arrivals_.size(), INT32_MAX));
      if (count <= next_sequence_) {
        sending_done_ = true;
        return;
      }
      arrivals_ = eldr::sim::MakeArrivals(workload_, 1.0, count, config_.seed);
    }
    const int sequence = next_sequence_++;
    record = AddRecordLocked(sequence, arrivals_[sequence].request);
  }
  Send(record);
}

double CpuSeconds(bool user) {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const timeval& time = user ? usage.ru_utime : usage.ru_stime;
  return static_cast<double>(time.tv_sec) + static_cast<double>(time.tv_usec) / 1e6;
}

void LoadGenerator::Run() {
  const double cpu_user_start = CpuSeconds(true), cpu_sys_start = CpuSeconds(false);
  run_start_ = Clock::now();
  measure_start_ =
      run_start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(config_.warmup_s));
  if (config_.duration_s > 0) {
    send_deadline_ =
        run_start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(config_.duration_s));
  }
  if (config_.rate > 0) {
    const int count = config_.requests > 0 ? config_.requests
                                           : static_cast<int>(std::ceil(config_.rate * config_.duration_s * 1.2 + 100));
    const std::vector<eldr::sim::Arrival> arrivals =
        eldr::sim::MakeArrivals(workload_, config_.rate, count, config_.seed);
    for (int i = 0; i < count; ++i) {
      const Clock::time_point due = run_start_ + std::chrono::duration_cast<Clock::duration>(
                                                     std::chrono::duration<double, std::micro>(arrivals[i].time_us));
      if (due >= send_deadline_) break;
      // Sleep in slices so that a signal stops the run promptly.
      while (Clock::now() < due && !interrupted.load()) {
        std::this_thread::sleep_until(std::min(due, Clock::now() + std::chrono::milliseconds(100)));
      }
      if (interrupted.load()) break;
      max_send_lag_ms_ = std::max(max_send_lag_ms_, Millis(Clock::now() - due));
      Record* record;
      {
        absl::MutexLock lock(&mu_);
        record = AddRecordLocked(i, arrivals[i].request);
      }
      Send(record);
    }
    absl::MutexLock lock(&mu_);
    sending_done_ = true;
  } else {
    {
      absl::MutexLock lock(&mu_);
      arrivals_ =
          eldr::sim::MakeArrivals(workload_, 1.0, config_.requests > 0 ? config_.requests : 65536, config_.seed);
    }
    const int initial = config_.requests > 0 ? std::min(config_.concurrency, config_.requests) : config_.concurrency;
    for (int i = 0; i < initial; ++i) SendNextClosedLoop();
    // Stop at the deadline or on a signal; the in-flight requests then finish.
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (sending_done_) break;
        if (StopSending()) {
          sending_done_ = true;
          break;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  stop_.store(true);
  {
    absl::MutexLock lock(&mu_);
    const auto all_ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ended_ == sent_.load(); };
    while (!all_ended()) mu_.AwaitWithTimeout(absl::Condition(&all_ended), absl::Milliseconds(100));
  }
  // The io threads end here: every record and histogram is final from now on.
  client_.reset();
  run_end_ = Clock::now();
  cpu_user_s_ = CpuSeconds(true) - cpu_user_start;
  cpu_sys_s_ = CpuSeconds(false) - cpu_sys_start;
}

json SummaryJson(const Summary& summary) {
  return json{{"count", summary.count}, {"mean", summary.mean}, {"p50", summary.p50},
              {"p90", summary.p90},     {"p99", summary.p99},   {"max", summary.max}};
}

json LoadGenerator::Report() {
  absl::MutexLock lock(&mu_);
  std::vector<double> ttft, tpot, e2e;
  int64_t measured = 0, ok = 0, warmup = 0, warmup_errors = 0, tokens = 0, usage_reported = 0, usage_mismatches = 0;
  std::map<std::string, int64_t> errors;
  Clock::time_point window_end = measure_start_;
  Clock::time_point first_start = Clock::time_point::max(), last_start = Clock::time_point::min();
  for (const Record& record : records_) {
    if (!record.measured) {
      ++warmup;
      if (!record.error.empty()) ++warmup_errors;
      continue;
    }
    ++measured;
    window_end = std::max(window_end, record.end);
    first_start = std::min(first_start, record.start);
    last_start = std::max(last_start, record.start);
    if (!record.error.empty()) {
      ++errors[record.error];
      continue;
    }
    ++ok;
    tokens += record.tokens;
    if (record.ttft_ms) ttft.push_back(*record.ttft_ms);
    if (record.tpot_ms) tpot.push_back(*record.tpot_ms);
    e2e.push_back(record.e2e_ms);
    if (config_.stream && record.usage_tokens) {
      ++usage_reported;
      if (*record.usage_tokens != record.tokens) ++usage_mismatches;
    }
  }
  const double window_s = std::max(Seconds(window_end - measure_start_), 1e-9);
  json report = json::object();
  report["target"] = config_.target_text;
  report["endpoint"] = config_.chat ? "/v1/chat/completions" : "/v1/completions";
  report["stream"] = config_.stream;
  report["mode"] = config_.rate > 0 ? "open" : "closed";
  if (config_.rate > 0) {
    report["rate"] = config_.rate;
    report["max_send_lag_ms"] = max_send_lag_ms_;
  } else {
    report["concurrency"] = config_.concurrency;
  }
  report["requests_sent"] = static_cast<int64_t>(records_.size());
  report["warmup_requests"] = warmup;
  report["warmup_errors"] = warmup_errors;
  report["requests_measured"] = measured;
  report["requests_ok"] = ok;
  report["requests_error"] = measured - ok;
  json error_counts = json::object();
  for (const auto& [kind, count] : errors) error_counts[kind] = count;
  report["errors"] = error_counts;
  json samples = json::object();
  for (const auto& [kind, message] : first_error_) samples[kind] = message;
  report["error_samples"] = samples;
  report["duration_s"] = measured > 0 ? window_s : 0.0;
  report["run_s"] = Seconds(run_end_ - run_start_);
  // The rate requests started at: (n - 1) gaps between the first and the last measured start (the
  // drain at the end, when requests finish but none start, is not part of it).
  const double start_span_s = measured >= 2 ? Seconds(last_start - first_start) : 0.0;
  report["achieved_rate"] = start_span_s > 0 ? static_cast<double>(measured - 1) / start_span_s
                            : measured > 0   ? static_cast<double>(measured) / window_s
                                             : 0.0;
  report["tokens"] = tokens;
  report["tokens_per_s"] = measured > 0 ? static_cast<double>(tokens) / window_s : 0.0;
  report["ttft_ms"] = SummaryJson(Summarize(std::move(ttft)));
  report["tpot_ms"] = SummaryJson(Summarize(std::move(tpot)));
  report["e2e_ms"] = SummaryJson(Summarize(std::move(e2e)));
  report["inter_token_ms"] = SummaryJson(gaps_.Merged().Summarize());
  report["usage_reported"] = usage_reported;
  report["usage_mismatches"] = usage_mismatches;
  report["max_concurrent_streams"] = max_in_flight_.load();
  report["client_cpu_s"] = cpu_user_s_ + cpu_sys_s_;
  report["client_cpu_user_s"] = cpu_user_s_;
  report["client_cpu_sys_s"] = cpu_sys_s_;
  report["threads"] = config_.threads;
  return report;
}

std::string LoadGenerator::Text(const json& report) const {
  std::string text =
      absl::StrFormat("eldr-loadgen: %d requests to %s %s (%s), %s, %.1f s measured (%d warm-up requests)\n",
                      report["requests_sent"].get<int64_t>(), config_.target_text,
                      report["endpoint"].get<std::string>(), config_.stream ? "streamed" : "not streamed",
                      config_.rate > 0 ? absl::StrFormat("open loop at %g req/s", config_.rate)
                                       : absl::StrFormat("closed loop with %d in flight", config_.concurrency),
                      report["duration_s"].get<double>(), report["warmup_requests"].get<int64_t>());
  std::vector<std::string> errors;
  for (const auto& [kind, count] : report["errors"].items())
    errors.push_back(absl::StrCat(kind, " ", count.get<int64_t>()));
  absl::StrAppendFormat(&text, "  ok %d, errors %d%s\n", report["requests_ok"].get<int64_t>(),
                        report["requests_error"].get<int64_t>(),
                        errors.empty() ? "" : absl::StrCat(" (", absl::StrJoin(errors, ", "), ")"));
  for (const auto& [kind, message] : report["error_samples"].items()) {
    absl::StrAppendFormat(&text, "    %s: %s\n", kind, message.get<std::string>());
  }
  absl::StrAppendFormat(&text, "  achieved %.2f req/s, %.1f tokens/s, at most %d requests in flight\n",
                        report["achieved_rate"].get<double>(), report["tokens_per_s"].get<double>(),
                        report["max_concurrent_streams"].get<int64_t>());
  absl::StrAppendFormat(&text, "  %-16s %8s %10s %10s %10s %10s\n", "ms", "count", "p50", "p90", "p99", "max");
  for (const char* name : {"ttft_ms", "tpot_ms", "e2e_ms", "inter_token_ms"}) {
    const json& s = report[name];
    absl::StrAppendFormat(&text, "  %-16s %8d %10.2f %10.2f %10.2f %10.2f\n", name, s["count"].get<int64_t>(),
                          s["p50"].get<double>(), s["p90"].get<double>(), s["p99"].get<double>(),
                          s["max"].get<double>());
  }
  if (report["usage_mismatches"].get<int64_t>() > 0) {
    absl::StrAppendFormat(&text, "  usage.completion_tokens differs from the token events in %d requests\n",
                          report["usage_mismatches"].get<int64_t>());
  }
  if (report.contains("max_send_lag_ms")) {
    absl::StrAppendFormat(&text, "  latest start behind schedule: %.2f ms\n", report["max_send_lag_ms"].get<double>());
  }
  absl::StrAppendFormat(&text, "  client cpu %.2f s (user %.2f, sys %.2f) over %.1f s\n",
                        report["client_cpu_s"].get<double>(), report["client_cpu_user_s"].get<double>(),
                        report["client_cpu_sys_s"].get<double>(), report["run_s"].get<double>());
  return text;
}

absl::Status LoadGenerator::WriteRequests(const std::string& path) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write --out_requests file ", path));
  absl::MutexLock lock(&mu_);
  for (const Record& record : records_) {
    json line = {{"seq", record.sequence},
                 {"id", record.trace_request},
                 {"start_s", Seconds(record.start - run_start_)},
                 {"warmup", !record.measured},
                 {"status", record.http_status},
                 {"error", record.error.empty() ? json(nullptr) : json(record.error)},
                 {"tokens", record.tokens},
                 {"e2e_ms", record.e2e_ms},
                 {"ttft_ms", record.ttft_ms ? json(*record.ttft_ms) : json(nullptr)},
                 {"tpot_ms", record.tpot_ms ? json(*record.tpot_ms) : json(nullptr)},
                 {"usage_tokens", record.usage_tokens ? json(*record.usage_tokens) : json(nullptr)}};
    out << line.dump() << "\n";
  }
  out.flush();
  if (!out) return absl::UnavailableError(absl::StrCat("writing --out_requests file ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "HTTP load generator for OpenAI-compatible streaming endpoints (eldr-proxy, vLLM, eldr-engine-emu).\n"
      "  eldr-loadgen --target=HOST:PORT (--rate=R | --concurrency=C) (--requests=N | --duration_s=S) [--json]");
  if (!CheckFlags(argc, argv)) return kExitBadFlags;
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<Config> config = ConfigFromFlags();
  if (!config.ok()) {
    std::cerr << "eldr-loadgen: " << config.status().message() << "\n";
    return kExitBadFlags;
  }
  absl::StatusOr<eldr::sim::Workload> workload = eldr::sim::LoadTraceWorkload(config->workload);
  if (!workload.ok()) {
    std::cerr << "eldr-loadgen: --trace: " << workload.status().message() << "\n";
    return kExitBadFlags;
  }
  if (workload->pool.empty()) {
    std::cerr << "eldr-loadgen: --trace: the evaluation pool is empty\n";
    return kExitBadFlags;
  }
  eldr::RaiseOpenFilesLimit();
  HttpClientOptions client_options;
  client_options.threads = config->threads;
  client_options.max_idle_per_origin = config->keepalive ? 100000 : 0;
  absl::StatusOr<std::unique_ptr<HttpClient>> client = HttpClient::Create(client_options);
  if (!client.ok()) {
    std::cerr << "eldr-loadgen: " << client.status().message() << "\n";
    return kExitBadFlags;
  }

  struct sigaction action {};
  action.sa_handler = OnSignal;
  action.sa_flags = SA_RESETHAND;  // a second signal ends the process at once
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);

  const bool print_json = config->json;
  const std::string out_requests = config->out_requests;
  LoadGenerator generator(*std::move(config), *workload, *std::move(client));
  generator.Run();
  const json report = generator.Report();
  const std::string text = generator.Text(report);
  if (print_json) {
    std::cerr << text;
    std::cout << report.dump() << std::endl;
  } else {
    std::cout << text;
  }
  if (!out_requests.empty()) {
    if (absl::Status status = generator.WriteRequests(out_requests); !status.ok()) {
      std::cerr << "eldr-loadgen: " << status.message() << "\n";
    }
  }
  if (generator.sent() == 0) {
    std::cerr << "eldr-loadgen: no request was sent\n";
    return kExitNothingSent;
  }
  if (generator.reached() == 0) {
    std::cerr << "eldr-loadgen: no request reached " << absl::GetFlag(FLAGS_target) << "\n";
    return kExitNothingSent;
  }
  return kExitOk;
}
