#include "sim/workload.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "sim/distinct_experts.h"
#include "sim/random.h"

namespace eldr::sim {
namespace {

// Random streams: every purpose draws from its own generator, so changing one part of a workload
// (e.g. the number of requests) does not reshuffle the others.
enum Stream : uint64_t {
  kStreamSplit = 1,
  kStreamFields = 2,
  kStreamArrivalTimes = 3,
  kStreamArrivalRequests = 4,
  kStreamStats = 5,
  kStreamRequestBase = 1'000'000,  // + request index (evaluation), + 1<<40 (calibration)
};
constexpr uint64_t kCalibrationRequestOffset = uint64_t{1} << 40;

// Walker's alias table over `weights` (positive, any scale): one 64-bit random number per sample,
// its high half picking the column and its low half the coin.
class AliasTable {
 public:
  void Build(const std::vector<double>& weights) {
    const int n = static_cast<int>(weights.size());
    threshold_.assign(n, 0);
    alias_.assign(n, 0);
    const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
    std::vector<double> scaled(n);
    std::vector<int> small, large;
    for (int i = 0; i < n; ++i) {
      scaled[i] = weights[i] * n / total;
      (scaled[i] < 1.0 ? small : large).push_back(i);
    }
    auto keep_probability = [&](int i, double p) {
      threshold_[i] = static_cast<uint64_t>(std::clamp(p, 0.0, 1.0) * 4294967296.0);
    };
    while (!small.empty() && !large.empty()) {
      const int s = small.back();
      small.pop_back();
      const int l = large.back();
      keep_probability(s, scaled[s]);
      alias_[s] = l;
      scaled[l] -= 1.0 - scaled[s];
      if (scaled[l] < 1.0) {
        large.pop_back();
        small.push_back(l);
      }
    }
    for (int i : large) keep_probability(i, 1.0);
    for (int i : small) keep_probability(i, 1.0);  // rounding leftovers
  }

  int Sample(Rng& rng) const {
    const uint64_t bits = rng.Next();
    const uint32_t column = static_cast<uint32_t>(((bits >> 32) * threshold_.size()) >> 32);
    const uint64_t coin = bits & 0xffffffffu;
    return coin < threshold_[column] ? static_cast<int>(column) : alias_[column];
  }

 private:
  std::vector<uint64_t> threshold_;  // keep-probability * 2^32 (2^32: always keep)
  std::vector<int> alias_;
};

// top_k distinct experts drawn from `table` without replacement (sequential draws proportional to
// the weights, duplicates redrawn: the Plackett-Luce model). Writes top_k ids to `out`.
void SampleTopK(const AliasTable& table, int top_k, Rng& rng, uint64_t* seen_words, uint8_t* out) {
  int chosen = 0;
  while (chosen < top_k) {
    const int expert = table.Sample(rng);
    uint64_t& word = seen_words[expert >> 6];
    const uint64_t bit = uint64_t{1} << (expert & 63);
    if (word & bit) continue;
    word |= bit;
    out[chosen++] = static_cast<uint8_t>(expert);
  }
}

int LogNormalLength(Rng& rng, double mean, double sigma, int low, int high) {
  // Parameterised by its mean: mu = ln(mean) - sigma^2 / 2.
  const double mu = std::log(mean) - 0.5 * sigma * sigma;
  const double value = std::exp(mu + sigma * rng.Normal());
  return std::clamp(static_cast<int>(std::lround(value)), low, high);
}

absl::Status CheckSyntheticOptions(const SyntheticOptions& o) {
  if (o.layers < 1 || o.experts < 2 || o.experts > 256 || o.top_k < 1 || o.top_k >= o.experts) {
    return absl::InvalidArgumentError(
        absl::StrFormat("synthetic geometry %dx%dx%d: need layers >= 1, 2 <= experts <= 256, 1 <= top_k < experts",
                        o.layers, o.experts, o.top_k));
  }
  if (o.domains < 1 || o.topics_per_domain < 1) {
    return absl::InvalidArgumentError("synthetic: --domains and --topics_per_domain must be >= 1");
  }
  const double scales[] = {o.locality, o.global_scale, o.domain_scale, o.topic_scale, o.request_scale, o.drift_scale};
  for (double s : scales) {
    if (!std::isfinite(s) || s < 0 || s > 20) {
      return absl::InvalidArgumentError("synthetic: --locality and the scales must be in [0, 20]");
    }
  }
  if (o.requests < 1) return absl::InvalidArgumentError("synthetic: --requests must be >= 1");
  if (o.calibration_requests < 1) {
    return absl::InvalidArgumentError("synthetic: --calibration_requests must be >= 1");
  }
  if (!(o.prompt_tokens_mean >= 1 && o.prompt_tokens_mean <= 8192) ||
      !(o.output_tokens_mean >= 2 && o.output_tokens_mean <= 2048)) {
    return absl::InvalidArgumentError(
        "synthetic: --prompt_tokens_mean must be in [1, 8192] and --output_tokens_mean in [2, 2048]");
  }
  return absl::OkStatus();
}

// The Gaussian fields shared by every request of a synthetic workload.
struct SyntheticFields {
  std::vector<float> global;  // [layers][experts]
  std::vector<float> domain;  // [domains][layers][experts]
  std::vector<float> topic;   // [domains * topics][layers][experts]
};

SyntheticFields MakeFields(const SyntheticOptions& o) {
  Rng rng = Rng::ForStream(o.seed, kStreamFields);
  const size_t plane = static_cast<size_t>(o.layers) * o.experts;
  SyntheticFields fields;
  fields.global.resize(plane);
  for (float& v : fields.global) v = static_cast<float>(o.global_scale * rng.Normal());
  fields.domain.resize(plane * o.domains);
  for (float& v : fields.domain) v = static_cast<float>(o.domain_scale * rng.Normal());
  fields.topic.resize(plane * o.domains * o.topics_per_domain);
  for (float& v : fields.topic) v = static_cast<float>(o.topic_scale * rng.Normal());
  return fields;
}

// One synthetic request: its prompt counts, its prompt's gate-probability sums (when
// `prompt_gate_sums` is non-null: every prompt token of a request shares its softmax, so the sums
// are prompt_tokens x softmax per layer, over all experts, as the reference's gate_prob_all
// captures them), and its decode tokens (stored when `decode_topk` is non-null) and/or decode
// counts (when `decode_counts` is non-null).
void GenerateRequest(const SyntheticOptions& o, const SyntheticFields& fields, uint64_t stream, int* domain_out,
                     int* prompt_tokens_out, int* decode_steps_out, std::vector<int32_t>* prompt_counts,
                     std::vector<float>* prompt_gate_sums, std::vector<uint8_t>* decode_topk,
                     std::vector<int32_t>* decode_counts) {
  Rng rng = Rng::ForStream(o.seed, stream);
  const int domain = static_cast<int>(rng.Below(o.domains));
  const int topic = domain * o.topics_per_domain + static_cast<int>(rng.Below(o.topics_per_domain));
  const int prompt_tokens = LogNormalLength(rng, o.prompt_tokens_mean, 0.6, 16, 8192);
  const int decode_steps = LogNormalLength(rng, o.output_tokens_mean, 0.6, 8, 2048);
  *domain_out = domain;
  *prompt_tokens_out = prompt_tokens;
  *decode_steps_out = decode_steps;

  const int layers = o.layers, experts = o.experts, top_k = o.top_k;
  const size_t plane = static_cast<size_t>(layers) * experts;
  std::vector<AliasTable> prompt_tables(layers), decode_tables(layers);
  std::vector<double> logits(experts), weights(experts);
  for (int l = 0; l < layers; ++l) {
    const size_t row = static_cast<size_t>(l) * experts;
    for (int e = 0; e < experts; ++e) {
      logits[e] = fields.global[row + e] +
                  o.locality * (fields.domain[plane * domain + row + e] + fields.topic[plane * topic + row + e]) +
                  o.request_scale * rng.Normal();
    }
    const double peak = *std::max_element(logits.begin(), logits.end());
    for (int e = 0; e < experts; ++e) weights[e] = std::exp(logits[e] - peak);
    prompt_tables[l].Build(weights);
    if (prompt_gate_sums != nullptr) {
      if (l == 0) prompt_gate_sums->assign(plane, 0.0f);
      double total = 0;
      for (int e = 0; e < experts; ++e) total += weights[e];
      for (int e = 0; e < experts; ++e) {
        (*prompt_gate_sums)[row + e] = static_cast<float>(prompt_tokens * weights[e] / total);
      }
    }
    for (int e = 0; e < experts; ++e) logits[e] += o.drift_scale * rng.Normal();
    const double decode_peak = *std::max_element(logits.begin(), logits.end());
    for (int e = 0; e < experts; ++e) weights[e] = std::exp(logits[e] - decode_peak);
    decode_tables[l].Build(weights);
  }

  const int words = (experts + 63) / 64;
  std::vector<uint64_t> seen(words);
  std::vector<uint8_t> choice(top_k);
  prompt_counts->assign(plane, 0);
  for (int t = 0; t < prompt_tokens; ++t) {
    for (int l = 0; l < layers; ++l) {
      std::fill(seen.begin(), seen.end(), 0);
      SampleTopK(prompt_tables[l], top_k, rng, seen.data(), choice.data());
      int32_t* counts = prompt_counts->data() + static_cast<size_t>(l) * experts;
      for (uint8_t e : choice) ++counts[e];
    }
  }
  if (decode_topk != nullptr) decode_topk->resize(static_cast<size_t>(decode_steps) * layers * top_k);
  if (decode_counts != nullptr) decode_counts->assign(plane, 0);
  for (int t = 0; t < decode_steps; ++t) {
    for (int l = 0; l < layers; ++l) {
      std::fill(seen.begin(), seen.end(), 0);
      uint8_t* out =
          decode_topk != nullptr ? decode_topk->data() + (static_cast<size_t>(t) * layers + l) * top_k : choice.data();
      SampleTopK(decode_tables[l], top_k, rng, seen.data(), out);
      if (decode_counts != nullptr) {
        int32_t* counts = decode_counts->data() + static_cast<size_t>(l) * experts;
        for (int c = 0; c < top_k; ++c) ++counts[out[c]];
      }
    }
  }
}

std::vector<int16_t> ToInt16(const std::vector<int32_t>& counts) {
  std::vector<int16_t> out(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) {
    out[i] = static_cast<int16_t>(std::min<int32_t>(counts[i], INT16_MAX));
  }
  return out;
}

double CosineDistance(const std::vector<double>& a, const std::vector<double>& b) {
  double dot = 0, na = 0, nb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    dot += a[i] * b[i];
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  if (na <= 0 || nb <= 0) return 1.0;
  return 1.0 - dot / std::sqrt(na * nb);
}

std::vector<double> Ranks(const std::vector<double>& values) {
  const size_t n = values.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return values[x] < values[y]; });
  std::vector<double> ranks(n);
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j + 1 < n && values[order[j + 1]] == values[order[i]]) ++j;
    const double average = 0.5 * static_cast<double>(i + j);
    for (size_t m = i; m <= j; ++m) ranks[order[m]] = average;
    i = j + 1;
  }
  return ranks;
}

}  // namespace

// ---- Real traces -----------------------------------------------------------------------------------

absl::StatusOr<Workload> LoadTraceWorkload(const TraceWorkloadOptions& options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("--trace: empty folder name");
  if (!(options.prefill_fraction > 0 && options.prefill_fraction < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefill_fraction must be in (0, 1), got ", options.prefill_fraction));
  }
  if (!(options.calibration_fraction > 0 && options.calibration_fraction < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--calibration_fraction must be in (0, 1), got ", options.calibration_fraction));
  }
  absl::StatusOr<ExpertTrace> loaded = LoadExpertTrace(options.dir, options.experts);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat("cannot read the traces in '", options.dir, "': ", loaded.status().message()));
  }
  auto trace = std::make_shared<const ExpertTrace>(*std::move(loaded));
  if (trace->sequences.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no sequences in the traces of '", options.dir, "'"));
  }
  if (trace->experts > 256) {
    return absl::InvalidArgumentError("traces with more than 256 experts are not supported");
  }

  Workload workload;
  workload.layers = trace->layers;
  workload.experts = trace->experts;
  workload.top_k = trace->top_k;
  workload.domains = trace->domains;
  workload.sample_with_replacement = true;

  // Per-domain split, so that both sides hold every domain.
  Rng rng = Rng::ForStream(options.seed, kStreamSplit);
  std::vector<std::vector<int>> by_domain(trace->domains.size());
  for (int s = 0; s < static_cast<int>(trace->sequences.size()); ++s) {
    const TraceSequence& seq = trace->sequences[s];
    if (seq.tokens < 2) continue;  // no decode step to replay
    by_domain[seq.domain].push_back(s);
  }
  std::vector<int> calibration_sequences, evaluation_sequences;
  for (std::vector<int>& members : by_domain) {
    rng.Shuffle(members);
    const int n = static_cast<int>(members.size());
    if (n == 0) continue;
    int calibration = static_cast<int>(std::lround(options.calibration_fraction * n));
    calibration = n >= 2 ? std::clamp(calibration, 1, n - 1) : 0;
    calibration_sequences.insert(calibration_sequences.end(), members.begin(), members.begin() + calibration);
    evaluation_sequences.insert(evaluation_sequences.end(), members.begin() + calibration, members.end());
  }
  std::sort(calibration_sequences.begin(), calibration_sequences.end());
  std::sort(evaluation_sequences.begin(), evaluation_sequences.end());
  if (calibration_sequences.empty() || evaluation_sequences.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the traces of '", options.dir, "' have too few sequences to split into calibration and evaluation"));
  }
  ELDR_ASSIGN_OR_RETURN(workload.calibration,
                        CalibrationDataFromTrace(*trace, options.prefill_fraction, calibration_sequences));

  const size_t plane = static_cast<size_t>(trace->layers) * trace->experts;
  std::vector<int32_t> counts(plane);
  int64_t decode_tokens = 0;
  for (int s : evaluation_sequences) {
    const TraceSequence& seq = trace->sequences[s];
    SimRequest request;
    request.domain = seq.domain;
    request.prompt_tokens = PrefillTokens(seq.tokens, options.prefill_fraction);
    request.decode_steps = seq.tokens - request.prompt_tokens;
    std::fill(counts.begin(), counts.end(), 0);
    AccumulateCounts(*trace, seq, 0, request.prompt_tokens, absl::MakeSpan(counts));
    request.prompt_counts = ToInt16(counts);
    request.decode_topk = seq.topk.data() + static_cast<size_t>(request.prompt_tokens) * trace->layers * trace->top_k;
    request.source = absl::StrCat(trace->domains[seq.domain], "#", seq.index_in_domain);
    decode_tokens += request.decode_steps;
    workload.pool.push_back(std::move(request));
  }
  workload.description = absl::StrFormat(
      "real traces %s: %dx%d top-%d, %d domains, %d evaluation sequences (%.0f decode tokens mean), "
      "%d calibration sequences, prefill fraction %.2f",
      options.dir, trace->layers, trace->experts, trace->top_k, static_cast<int>(trace->domains.size()),
      static_cast<int>(workload.pool.size()), static_cast<double>(decode_tokens) / workload.pool.size(),
      static_cast<int>(calibration_sequences.size()), options.prefill_fraction);
  workload.trace = std::move(trace);
  return workload;
}

// ---- Synthetic -----------------------------------------------------------------------------------

absl::Status ParseGeometry(absl::string_view text, SyntheticOptions* options) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, 'x');
  int values[3];
  bool ok = parts.size() == 3;
  for (int i = 0; ok && i < 3; ++i) ok = absl::SimpleAtoi(parts[i], &values[i]) && values[i] > 0;
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--synthetic '", text, "': expected LAYERSxEXPERTSxTOPK, three positive integers such as 48x128x8"));
  }
  if (values[1] > 256 || values[1] < 2) {
    return absl::InvalidArgumentError(absl::StrCat("--synthetic '", text, "': experts must be in [2, 256]"));
  }
  if (values[2] >= values[1]) {
    return absl::InvalidArgumentError(
        absl::StrCat("--synthetic '", text, "': top-k must be below the number of experts"));
  }
  options->layers = values[0];
  options->experts = values[1];
  options->top_k = values[2];
  return absl::OkStatus();
}

absl::StatusOr<Workload> GenerateSyntheticWorkload(const SyntheticOptions& o) {
  ELDR_RETURN_IF_ERROR(CheckSyntheticOptions(o));
  const SyntheticFields fields = MakeFields(o);
  const size_t plane = static_cast<size_t>(o.layers) * o.experts;

  Workload workload;
  workload.layers = o.layers;
  workload.experts = o.experts;
  workload.top_k = o.top_k;
  for (int d = 0; d < o.domains; ++d) workload.domains.push_back(absl::StrCat("domain", d));
  workload.sample_with_replacement = false;

  workload.generated_tokens.resize(o.requests);
  workload.pool.resize(o.requests);
  CalibrationData& calibration = workload.calibration;
  calibration.layers = o.layers;
  calibration.experts = o.experts;
  calibration.n = o.calibration_requests;
  calibration.prefill_counts.resize(plane * o.calibration_requests);
  calibration.decode_counts.resize(plane * o.calibration_requests);
  calibration.gate_prob_sums.resize(plane * o.calibration_requests);
  calibration.labels.resize(o.calibration_requests);

  // Every request draws from its own random stream and writes only its own slots, so the
  // requests are generated in parallel and the workload does not depend on the thread count.
  const int total = o.requests + o.calibration_requests;
  std::atomic<int> next{0};
  auto generate = [&] {
    std::vector<int32_t> prompt_counts, decode_counts;
    std::vector<float> gate_sums;
    for (int i = next++; i < total; i = next++) {
      if (i < o.requests) {
        SimRequest& request = workload.pool[i];
        GenerateRequest(o, fields, kStreamRequestBase + i, &request.domain, &request.prompt_tokens,
                        &request.decode_steps, &prompt_counts, &request.prompt_gate_sums, &workload.generated_tokens[i],
                        nullptr);
        request.prompt_counts = ToInt16(prompt_counts);
        request.decode_topk = workload.generated_tokens[i].data();
        request.source = absl::StrCat("synthetic#", i);
      } else {
        const int r = i - o.requests;
        int prompt_tokens = 0, decode_steps = 0;
        GenerateRequest(o, fields, kStreamRequestBase + kCalibrationRequestOffset + r, &calibration.labels[r],
                        &prompt_tokens, &decode_steps, &prompt_counts, &gate_sums, nullptr, &decode_counts);
        std::copy(prompt_counts.begin(), prompt_counts.end(), calibration.prefill_counts.begin() + plane * r);
        std::copy(gate_sums.begin(), gate_sums.end(), calibration.gate_prob_sums.begin() + plane * r);
        std::copy(decode_counts.begin(), decode_counts.end(), calibration.decode_counts.begin() + plane * r);
      }
    }
  };
  const int threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, std::min(16, total));
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) helpers.emplace_back(generate);
  generate();
  for (std::thread& helper : helpers) helper.join();
  int64_t decode_tokens = 0;
  for (const SimRequest& request : workload.pool) decode_tokens += request.decode_steps;

  workload.description = absl::StrFormat(
      "synthetic %dx%dx%d: %d domains x %d topics, locality %.2f, %d evaluation requests (%.0f decode "
      "tokens mean), %d calibration requests",
      o.layers, o.experts, o.top_k, o.domains, o.topics_per_domain, o.locality, o.requests,
      static_cast<double>(decode_tokens) / o.requests, o.calibration_requests);
  return workload;
}

// ---- Arrivals --------------------------------------------------------------------------------------

std::vector<Arrival> MakeArrivals(const Workload& workload, double rate_per_s, int count, uint64_t seed) {
  Rng times = Rng::ForStream(seed, kStreamArrivalTimes);
  Rng picks = Rng::ForStream(seed, kStreamArrivalRequests);
  const uint64_t pool = workload.pool.size();
  std::vector<Arrival> arrivals(count);
  double t = 0;
  for (int i = 0; i < count; ++i) {
    t += times.Exponential() * 1e6 / rate_per_s;
    arrivals[i].time_us = t;
    arrivals[i].request = static_cast<int>(workload.sample_with_replacement ? picks.Below(pool) : i % pool);
  }
  return arrivals;
}

// ---- Structure of a workload -----------------------------------------------------------------------

double SpearmanCorrelation(const std::vector<double>& a, const std::vector<double>& b) {
  const size_t n = std::min(a.size(), b.size());
  if (n < 2) return 0;
  const std::vector<double> ra = Ranks(a), rb = Ranks(b);
  const double mean = 0.5 * static_cast<double>(n - 1);
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    sab += (ra[i] - mean) * (rb[i] - mean);
    saa += (ra[i] - mean) * (ra[i] - mean);
    sbb += (rb[i] - mean) * (rb[i] - mean);
  }
  if (saa <= 0 || sbb <= 0) return 0;
  return sab / std::sqrt(saa * sbb);
}

LocalityStats MeasureWorkloadLocality(const Workload& workload, int batch, int batches, int pairs, uint64_t seed) {
  LocalityStats stats;
  stats.batch = batch;
  Rng rng = Rng::ForStream(seed, kStreamStats);
  const int pool = static_cast<int>(workload.pool.size());
  std::vector<std::vector<int>> by_domain(workload.domains.size());
  for (int r = 0; r < pool; ++r) by_domain[workload.pool[r].domain].push_back(r);
  std::vector<int> populated;
  for (int d = 0; d < static_cast<int>(by_domain.size()); ++d) {
    if (!by_domain[d].empty()) populated.push_back(d);
  }
  if (pool == 0 || batch < 1 || batches < 1) return stats;

  DistinctExpertCounter counter(workload.layers, workload.experts, workload.top_k);
  auto add_random_token = [&](int r) {
    const SimRequest& request = workload.pool[r];
    counter.AddToken(workload.DecodeToken(request, static_cast<int>(rng.Below(request.decode_steps))));
  };
  double same = 0, mixed = 0;
  for (int b = 0; b < batches; ++b) {
    const std::vector<int>& members = by_domain[populated[rng.Below(populated.size())]];
    counter.Reset();
    for (int i = 0; i < batch; ++i) add_random_token(members[rng.Below(members.size())]);
    same += static_cast<double>(counter.DistinctAllLayers()) / workload.layers;
    counter.Reset();
    for (int i = 0; i < batch; ++i) add_random_token(static_cast<int>(rng.Below(pool)));
    mixed += static_cast<double>(counter.DistinctAllLayers()) / workload.layers;
  }
  stats.same_domain_distinct = same / batches;
  stats.mixed_distinct = mixed / batches;
  stats.same_domain_reduction = 1.0 - stats.same_domain_distinct / stats.mixed_distinct;

  // Prompt and decode usage of a sample of requests, then random pairs among them.
  std::vector<int> sample(pool);
  std::iota(sample.begin(), sample.end(), 0);
  rng.Shuffle(sample);
  sample.resize(std::min(pool, 512));
  const size_t plane = static_cast<size_t>(workload.layers) * workload.experts;
  std::vector<std::vector<double>> prompt(sample.size()), decode(sample.size());
  for (size_t i = 0; i < sample.size(); ++i) {
    const SimRequest& request = workload.pool[sample[i]];
    prompt[i].assign(request.prompt_counts.begin(), request.prompt_counts.end());
    decode[i].assign(plane, 0);
    for (int step = 0; step < request.decode_steps; ++step) {
      const uint8_t* token = workload.DecodeToken(request, step);
      for (int l = 0; l < workload.layers; ++l) {
        for (int c = 0; c < workload.top_k; ++c) {
          decode[i][static_cast<size_t>(l) * workload.experts + token[l * workload.top_k + c]] += 1;
        }
      }
    }
  }
  if (sample.size() >= 2 && pairs > 0) {
    std::vector<double> prompt_distance, decode_distance;
    prompt_distance.reserve(pairs);
    decode_distance.reserve(pairs);
    for (int p = 0; p < pairs; ++p) {
      const size_t i = rng.Below(sample.size());
      size_t j = rng.Below(sample.size() - 1);
      if (j >= i) ++j;
      prompt_distance.push_back(CosineDistance(prompt[i], prompt[j]));
      decode_distance.push_back(CosineDistance(decode[i], decode[j]));
    }
    stats.prompt_decode_correlation = SpearmanCorrelation(prompt_distance, decode_distance);
    stats.pairs = pairs;
  }
  return stats;
}

}  // namespace eldr::sim
