// eldr-microbench: Google Benchmark suite of the routing core.
//
//   BM_RouteDecision/<L>x<E>/K:<k>[/count]   one full route decision: int16 counts -> signature
//                                            transform -> centroid index search -> eldr policy
//                                            pick (tau 0.1), with the index BuildCentroidIndex
//                                            picks for k, scored as the Router does
//                                            (SignatureScorer: fused where it can); /count:
//                                            variant count (no IDF); /unfused: Apply, then Search;
//                                            /int8, /bf16: the exact scorer's 8-bit first stage,
//                                            its bfloat16 scan (forced)
//   BM_Transform/<L>x<E>                     the signature transform alone
//   BM_Scorer/<L>x<E>/K:<k>/<impl>           scoring one transformed signature only: exact_fp32,
//                                            exact_fp16, exact_bf16, exact_int8 (the exact scorer's scan
//                                            formats), reduced_flat (PCA + flat, the large-pool
//                                            default), reduced_flat_bf16, reduced_hnsw,
//                                            reduced_flat/d:<dims>/m:<candidates>, faiss_flat_ip
//                                            (FAISS IndexFlatIP, default settings),
//                                            faiss_flat_ip_blas (distance_compute_blas_threshold
//                                            1), transposed_fp16_skip_zeros (a rejected layout)
//   BM_ScoreBatch/<L>x<E>/K:<k>/n:<n>        ScoreBatch (sgemm) of n signatures
//
// Counters: band (mean band size), refined (rows re-scored in fp32 per query), candidates (rows
// returned per query), best_found / band_match (share of the 64 queries whose best row is among
// the candidates / whose band at tau 0.1 is the double-precision reference's), zero_idf_cols,
// density (share of non-zero counts in a prompt).
//
// Inputs are synthetic but shaped like real prefill counts: 256-token prompts, top-6 routing for
// 26x64 (DeepSeek-V2-Lite) and top-8 for 48x128 (Qwen3-30B-A3B); experts have a global popularity,
// eight domains and every worker its own preferences (clustered structure); a prompt draws each
// token's top-k experts without replacement from its worker's weights, with a per-prompt
// perturbation. The generator is tuned so that prompts use 94-96% of the experts, as the bundled
// real traces do at 256 tokens (94%), and IDF weights come from 256 calibration prompts (count_idf
// over all layers). Columns whose IDF is 0 (experts every calibration prompt used) come out at 26%
// for 48x128 and 43% for 26x64, against 43-57% in the real 26x64 traces: the exact scorer's column
// compaction is not flattered. Centroids are the transformed expected counts of each worker; the
// 64 queries are fresh prompts of workers 0-15, present in every pool size.
//
// Run: <build>/bin/eldr-microbench [--benchmark_filter=RouteDecision] [--benchmark_format=json]
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "core/centroid_index_internal.h"
#include "core/scorer_kernels.h"
#include "eldr/core/centroid_index.h"
#include "eldr/core/policy.h"
#include "eldr/core/signature.h"
#include "eldr/core/signature_scorer.h"
#include "faiss/IndexFlat.h"
#include "faiss/utils/distances.h"

namespace eldr {
namespace {

constexpr int kPromptTokens = 256;
constexpr int kDomains = 8;
constexpr int kMaxWorkers = 1024;
constexpr int kCalibrationPrompts = 256;
constexpr int kQueries = 64;
constexpr double kTau = 0.1;

struct Geometry {
  int layers;
  int experts;
  int top_k;
  std::string name() const { return absl::StrCat(layers, "x", experts); }
};

// Expert preference weights [layers][experts] of each worker: global popularity x domain
// preference x worker preference (log-normal factors).
class WorkloadModel {
 public:
  WorkloadModel(const Geometry& g, uint64_t seed) : g_(g), rng_(seed) {
    const int cells = g.layers * g.experts;
    std::gamma_distribution<double> popularity(1.5, 1.0);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> global(cells);
    for (double& v : global) v = popularity(rng_);
    std::vector<std::vector<double>> domain(kDomains, std::vector<double>(cells));
    for (auto& d : domain) {
      for (double& v : d) v = std::exp(0.7 * normal(rng_));
    }
    workers_.assign(kMaxWorkers, std::vector<double>(cells));
    for (int w = 0; w < kMaxWorkers; ++w) {
      for (int c = 0; c < cells; ++c) {
        workers_[w][c] = global[c] * domain[w % kDomains][c] * std::exp(0.4 * normal(rng_));
      }
    }
  }

  // Counts [layers][experts] of one prompt served by `worker`: a per-prompt factor on the
  // weights, then every token picks top_k distinct experts per layer with probability
  // proportional to the weights (sequential sampling without replacement, by rejection).
  std::vector<int32_t> SamplePrompt(int worker) {
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    std::vector<int32_t> counts(static_cast<size_t>(g_.layers) * g_.experts, 0);
    std::vector<double> cdf(g_.experts);
    for (int l = 0; l < g_.layers; ++l) {
      double total = 0;
      for (int e = 0; e < g_.experts; ++e) {
        total += workers_[worker][l * g_.experts + e] * std::exp(0.3 * normal(rng_));
        cdf[e] = total;
      }
      for (int t = 0; t < kPromptTokens; ++t) {
        uint64_t chosen[4] = {0, 0, 0, 0};  // up to 256 experts
        for (int pick = 0; pick < g_.top_k;) {
          const double u = uniform(rng_) * total;
          const int e = static_cast<int>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
          const int expert = std::min(e, g_.experts - 1);
          uint64_t& word = chosen[expert >> 6];
          const uint64_t bit = uint64_t{1} << (expert & 63);
          if (word & bit) continue;
          word |= bit;
          ++counts[l * g_.experts + expert];
          ++pick;
        }
      }
    }
    return counts;
  }

  // Expected counts of a prompt of `worker`, for its centroid: per token, the probability that
  // an expert is among k draws, 1 - (1 - p)^k.
  std::vector<double> ExpectedCounts(int worker) const {
    std::vector<double> expected(static_cast<size_t>(g_.layers) * g_.experts);
    for (int l = 0; l < g_.layers; ++l) {
      double total = 0;
      for (int e = 0; e < g_.experts; ++e) total += workers_[worker][l * g_.experts + e];
      for (int e = 0; e < g_.experts; ++e) {
        const double p = workers_[worker][l * g_.experts + e] / total;
        expected[l * g_.experts + e] = kPromptTokens * (1 - std::pow(1 - p, g_.top_k));
      }
    }
    return expected;
  }

  std::mt19937_64& rng() { return rng_; }

 private:
  Geometry g_;
  std::mt19937_64 rng_;
  std::vector<std::vector<double>> workers_;
};

struct Workload {
  Geometry geometry;
  SignatureVariant variant;
  std::unique_ptr<SignatureTransform> transform;
  int dim = 0;
  std::vector<float> centroids;                   // kMaxWorkers unit rows
  std::vector<std::string> query_bytes;           // int16 little-endian counts
  std::vector<std::vector<float>> query_vectors;  // transformed queries
  double zero_idf_fraction = 0;
  double density = 0;  // fraction of non-zero counts per prompt
};

std::string Int16Bytes(const std::vector<int32_t>& counts) {
  std::string bytes(counts.size() * 2, '\0');
  for (size_t i = 0; i < counts.size(); ++i) {
    const uint16_t v = static_cast<uint16_t>(static_cast<int16_t>(counts[i]));
    bytes[2 * i] = static_cast<char>(v & 0xff);
    bytes[2 * i + 1] = static_cast<char>(v >> 8);
  }
  return bytes;
}

std::unique_ptr<Workload> BuildWorkload(const Geometry& g, SignatureVariant variant) {
  auto w = std::make_unique<Workload>();
  w->geometry = g;
  w->variant = variant;
  WorkloadModel model(g, /*seed=*/0xe1d7 + g.layers);
  const int cells = g.layers * g.experts;

  // IDF from calibration prompts of random workers.
  std::vector<int32_t> calibration;
  calibration.reserve(static_cast<size_t>(kCalibrationPrompts) * cells);
  int64_t nonzero = 0;
  for (int n = 0; n < kCalibrationPrompts; ++n) {
    const std::vector<int32_t> counts = model.SamplePrompt(static_cast<int>(model.rng()() % kMaxWorkers));
    for (int32_t c : counts) nonzero += c > 0;
    calibration.insert(calibration.end(), counts.begin(), counts.end());
  }
  w->density = static_cast<double>(nonzero) / (static_cast<double>(kCalibrationPrompts) * cells);
  SignatureSpec spec;
  spec.layers = g.layers;
  spec.experts = g.experts;
  spec.variant = variant;
  if (variant == SignatureVariant::kCountIdf) {
    spec.idf = ComputeIdf(calibration, kCalibrationPrompts, g.layers, g.experts);
    w->zero_idf_fraction = static_cast<double>(std::count(spec.idf.begin(), spec.idf.end(), 0.f)) / cells;
  }
  auto transform = SignatureTransform::Create(spec);
  if (!transform.ok()) {
    std::fprintf(stderr, "eldr-microbench: %s\n", std::string(transform.status().message()).c_str());
    std::abort();
  }
  w->transform = std::make_unique<SignatureTransform>(*std::move(transform));
  w->dim = w->transform->dim();

  // Centroids: the transformed expected counts of each worker.
  w->centroids.resize(static_cast<size_t>(kMaxWorkers) * w->dim);
  for (int k = 0; k < kMaxWorkers; ++k) {
    const std::vector<double> expected = model.ExpectedCounts(k);
    float* row = w->centroids.data() + static_cast<size_t>(k) * w->dim;
    double norm2 = 0;
    for (int c = 0; c < cells; ++c) {
      const double v = expected[c] * (spec.idf.empty() ? 1.0 : spec.idf[c]);
      row[c] = static_cast<float>(v);
      norm2 += v * v;
    }
    for (int c = 0; c < cells; ++c) row[c] = static_cast<float>(row[c] / std::sqrt(norm2));
  }

  // Queries: fresh prompts of the first 16 workers (present in every pool size), so each query
  // has a home worker in every benchmarked pool.
  for (int q = 0; q < kQueries; ++q) {
    const std::vector<int32_t> counts = model.SamplePrompt(q % 16);
    w->query_bytes.push_back(Int16Bytes(counts));
    std::vector<float> vec(w->dim);
    const absl::Status status =
        w->transform->Apply(CountsInt16Le{g.layers, g.experts, w->query_bytes.back()}, absl::MakeSpan(vec));
    if (!status.ok()) {
      std::fprintf(stderr, "eldr-microbench: %s\n", std::string(status.message()).c_str());
      std::abort();
    }
    w->query_vectors.push_back(std::move(vec));
  }
  return w;
}

const Workload& GetWorkload(const Geometry& g, SignatureVariant variant) {
  static std::mutex mu;
  static std::map<std::pair<std::string, int>, std::unique_ptr<Workload>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{g.name(), static_cast<int>(variant)}];
  if (!slot) slot = BuildWorkload(g, variant);
  return *slot;
}

absl::Span<const float> FirstRows(const Workload& w, int k) {
  return absl::MakeConstSpan(w.centroids.data(), static_cast<size_t>(k) * w.dim);
}

std::unique_ptr<CentroidIndex> MustBuild(absl::StatusOr<std::unique_ptr<CentroidIndex>> index) {
  if (!index.ok()) {
    std::fprintf(stderr, "eldr-microbench: %s\n", std::string(index.status().message()).c_str());
    std::abort();
  }
  return *std::move(index);
}

void SetCommonCounters(benchmark::State& state, const Workload& w) {
  state.counters["zero_idf_cols"] = w.zero_idf_fraction;
  state.counters["density"] = w.density;
}

// ---- Full route decision ------------------------------------------------------------------------

// `fused`: the router's scoring (SignatureScorer, which fuses the transform into the index's
// column selection where it can); false: Apply then Search, as before the fusion.
void RouteDecision(benchmark::State& state, Geometry g, int k, SignatureVariant variant, bool fused = true,
                   HalfFormat format = HalfFormat::kAuto) {
  const Workload& w = GetWorkload(g, variant);
  CentroidIndexOptions options;
  options.half_format = format;
  options.band_tau = kTau;
  std::unique_ptr<CentroidIndex> index = MustBuild(BuildCentroidIndex(FirstRows(w, k), k, w.dim, options));
  std::unique_ptr<RoutingPolicy> policy = MakePolicy(PolicyKind::kEldr, /*seed=*/1);
  std::vector<WorkerLoadView> workers(k);
  std::mt19937 rng(5);
  for (WorkerLoadView& worker : workers) worker.load = static_cast<double>(rng() % 8);
  const SignatureScorer scorer(*w.transform, *index);
  SignatureScorer::Buffers buffers;
  std::vector<float> signature(w.dim);
  std::vector<ScoredRow> scores;
  std::vector<WorkerScore> candidates;  // row r belongs to worker r, as the Router maps them
  size_t i = 0;
  int64_t band_total = 0;
  const int64_t refined_before = internal::RefinedRowsOnThisThread();
  for (auto _ : state) {
    const size_t q = i++ % w.query_bytes.size();
    const CountsInt16Le counts{g.layers, g.experts, w.query_bytes[q]};
    const bool ok =
        fused ? scorer.Score(counts, &buffers, &scores).ok()
              : w.transform->Apply(counts, absl::MakeSpan(signature)).ok() && index->Search(signature, &scores).ok();
    if (!ok) {
      state.SkipWithError("route decision failed");
      break;
    }
    candidates.clear();
    for (const ScoredRow& scored : scores) candidates.push_back(WorkerScore{scored.row, scored.score});
    const PolicyDecision decision = policy->Pick(PolicyInput{workers, candidates, kTau});
    benchmark::DoNotOptimize(decision);
    band_total += decision.band_size;
  }
  state.SetLabel(absl::StrCat(index->kind(), fused && scorer.fused() ? " fused " : " ", ScoringKernelsName()));
  SetCommonCounters(state, w);
  const double n = std::max<double>(1, static_cast<double>(state.iterations()));
  state.counters["band"] = static_cast<double>(band_total) / n;
  state.counters["refined"] = static_cast<double>(internal::RefinedRowsOnThisThread() - refined_before) / n;
}

void Transform(benchmark::State& state, Geometry g) {
  const Workload& w = GetWorkload(g, SignatureVariant::kCountIdf);
  std::vector<float> signature(w.dim);
  size_t i = 0;
  for (auto _ : state) {
    const size_t q = i++ % w.query_bytes.size();
    benchmark::DoNotOptimize(
        w.transform->Apply(CountsInt16Le{g.layers, g.experts, w.query_bytes[q]}, absl::MakeSpan(signature)));
    benchmark::ClobberMemory();
  }
  SetCommonCounters(state, w);
}

// ---- Scorers alone ------------------------------------------------------------------------------

void ScoreWithIndex(benchmark::State& state, Geometry g, int k, CentroidIndexKind kind, CentroidIndexOptions options) {
  const Workload& w = GetWorkload(g, SignatureVariant::kCountIdf);
  options.band_tau = kTau;
  std::unique_ptr<CentroidIndex> index = MustBuild(BuildCentroidIndexOfKind(kind, FirstRows(w, k), k, w.dim, options));
  std::vector<ScoredRow> scores;
  size_t i = 0;
  int64_t returned = 0;
  const int64_t refined_before = internal::RefinedRowsOnThisThread();
  for (auto _ : state) {
    if (!index->Search(w.query_vectors[i++ % w.query_vectors.size()], &scores).ok()) {
      state.SkipWithError("search failed");
      break;
    }
    returned += static_cast<int64_t>(scores.size());
    benchmark::DoNotOptimize(scores.data());
  }
  state.SetLabel(std::string(index->kind()));
  const double n = std::max<double>(1, static_cast<double>(state.iterations()));
  state.counters["candidates"] = static_cast<double>(returned) / n;
  state.counters["refined"] = static_cast<double>(internal::RefinedRowsOnThisThread() - refined_before) / n;
  // Quality against a double-precision reference over every query: the best row among the
  // candidates, and the band at tau = 0.1 decided as the reference decides it (rows within 1e-4
  // of the reference edge are not judged).
  int best_found = 0, band_match = 0;
  for (const std::vector<float>& q : w.query_vectors) {
    if (!index->Search(q, &scores).ok()) break;
    std::vector<double> reference(k);
    for (int r = 0; r < k; ++r) {
      double sum = 0;
      for (int c = 0; c < w.dim; ++c) {
        sum += static_cast<double>(w.centroids[static_cast<size_t>(r) * w.dim + c]) * q[c];
      }
      reference[r] = sum;
    }
    const int best = static_cast<int>(std::max_element(reference.begin(), reference.end()) - reference.begin());
    float got_best = -1e30f;
    std::vector<char> in_band(k, 0);
    for (const ScoredRow& s : scores) got_best = std::max(got_best, s.score);
    bool found = false;
    for (const ScoredRow& s : scores) {
      found |= s.row == best;
      in_band[s.row] = static_cast<double>(s.score) >= static_cast<double>(got_best) - kTau;
    }
    bool match = true;
    for (int r = 0; r < k; ++r) {
      const double edge = reference[best] - kTau;
      if (std::fabs(reference[r] - edge) <= 1e-4) continue;
      match &= (reference[r] >= edge) == static_cast<bool>(in_band[r]);
    }
    best_found += found;
    band_match += match;
  }
  state.counters["best_found"] = static_cast<double>(best_found) / w.query_vectors.size();
  state.counters["band_match"] = static_cast<double>(band_match) / w.query_vectors.size();
  SetCommonCounters(state, w);
}

// FAISS IndexFlatIP over the full-dimension centroids, one query per search (k = all rows).
// blas_threshold 20 is FAISS's default (a single query takes its scalar path); 1 sends even one
// query through BLAS sgemm.
void ScoreWithFaissFlat(benchmark::State& state, Geometry g, int k, int blas_threshold) {
  const Workload& w = GetWorkload(g, SignatureVariant::kCountIdf);
  faiss::IndexFlatIP index(w.dim);
  index.add(k, w.centroids.data());
  std::vector<float> distances(k);
  std::vector<faiss::Index::idx_t> labels(k);
  const int saved_threshold = faiss::distance_compute_blas_threshold;
  faiss::distance_compute_blas_threshold = blas_threshold;
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(1);
  size_t i = 0;
  for (auto _ : state) {
    index.search(1, w.query_vectors[i++ % w.query_vectors.size()].data(), k, distances.data(), labels.data());
    benchmark::DoNotOptimize(distances.data());
  }
  omp_set_num_threads(saved_threads);
  faiss::distance_compute_blas_threshold = saved_threshold;
  SetCommonCounters(state, w);
}

// A layout the exact scorer could have used and does not, kept here because the measurement is
// the reason: centroids transposed to [dim][K] (binary16) so that zero query entries are skipped.
// Real prompts use ~94% of the experts, so little is skipped, and the column-at-a-time access has
// K/16 accumulators per entry instead of streaming rows.
class TransposedScorer {
 public:
  TransposedScorer(const float* rows, int k, int dim) : k_(k), dim_(dim), nonzero_(dim) {
    columns_.assign(static_cast<size_t>(dim) * k, 0);
    for (int i = 0; i < dim; ++i) {
      for (int r = 0; r < k; ++r) {
        columns_[static_cast<size_t>(i) * k + r] = internal::FloatToHalf(rows[static_cast<size_t>(r) * dim + i]);
      }
    }
  }

  __attribute__((target("avx512f,avx512vl,f16c,fma"))) void Score(const float* q, float* out) const {
    const int chunks = k_ / 16;
    __m512 acc[2][4];  // K <= 64
    for (int c = 0; c < chunks; ++c) acc[0][c] = acc[1][c] = _mm512_setzero_ps();
    // Nonzero entries listed without branches first, so that the scan itself does not branch.
    int nonzero = 0;
    for (int i = 0; i < dim_; ++i) {
      nonzero_[nonzero] = i;
      nonzero += q[i] != 0.f;
    }
    int parity = 0;
    for (int n = 0; n < nonzero; ++n) {
      const int i = nonzero_[n];
      const __m512 qi = _mm512_set1_ps(q[i]);
      const uint16_t* column = columns_.data() + static_cast<size_t>(i) * k_;
      for (int c = 0; c < chunks; ++c) {
        const __m512 v =
            _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + 16 * c)));
        acc[parity][c] = _mm512_fmadd_ps(v, qi, acc[parity][c]);
      }
      parity ^= 1;
    }
    for (int c = 0; c < chunks; ++c) {
      _mm512_storeu_ps(out + 16 * c, _mm512_add_ps(acc[0][c], acc[1][c]));
    }
  }

 private:
  int k_;
  int dim_;
  std::vector<uint16_t> columns_;
  mutable std::vector<int> nonzero_;
};

void ScoreTransposed(benchmark::State& state, Geometry g, int k) {
  if (internal::CpuSimdLevel() != internal::SimdLevel::kAvx512) {
    state.SkipWithError("needs AVX-512");
    return;
  }
  const Workload& w = GetWorkload(g, SignatureVariant::kCountIdf);
  TransposedScorer scorer(w.centroids.data(), k, w.dim);
  std::vector<float> out(k);
  size_t i = 0;
  int64_t nonzero = 0;
  for (auto _ : state) {
    const std::vector<float>& q = w.query_vectors[i++ % w.query_vectors.size()];
    scorer.Score(q.data(), out.data());
    benchmark::DoNotOptimize(out.data());
  }
  for (const auto& q : w.query_vectors) {
    nonzero += std::count_if(q.begin(), q.end(), [](float v) { return v != 0.f; });
  }
  state.counters["query_nonzero"] =
      static_cast<double>(nonzero) / (static_cast<double>(w.query_vectors.size()) * w.dim);
  SetCommonCounters(state, w);
}

void ScoreBatch(benchmark::State& state, Geometry g, int k, int n) {
  const Workload& w = GetWorkload(g, SignatureVariant::kCountIdf);
  std::unique_ptr<CentroidIndex> index =
      MustBuild(BuildCentroidIndex(FirstRows(w, k), k, w.dim, CentroidIndexOptions()));
  std::vector<float> queries;
  for (int i = 0; i < n; ++i) {
    const auto& q = w.query_vectors[i % w.query_vectors.size()];
    queries.insert(queries.end(), q.begin(), q.end());
  }
  std::vector<float> scores(static_cast<size_t>(n) * k);
  for (auto _ : state) {
    if (!index->ScoreBatch(queries, n, absl::MakeSpan(scores)).ok()) {
      state.SkipWithError("batch failed");
      break;
    }
    benchmark::DoNotOptimize(scores.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
}

// Microseconds, plus a "min" aggregate next to mean/median/stddev when --benchmark_repetitions
// is given: on a shared machine the minimum is the least disturbed figure.
void CommonSettings(benchmark::internal::Benchmark* b) {
  b->Unit(benchmark::kMicrosecond);
  b->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); });
}

void RegisterAll() {
  const Geometry geometries[] = {{26, 64, 6}, {48, 128, 8}};
  const int pools[] = {8, 16, 24, 32, 48, 64, 96, 256, 1024};
  for (const Geometry& g : geometries) {
    for (int k : pools) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_RouteDecision/", g.name(), "/K:", k).c_str(),
          [g, k](benchmark::State& state) { RouteDecision(state, g, k, SignatureVariant::kCountIdf); })
          ->Apply(CommonSettings);
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_RouteDecision/", g.name(), "/K:", k, "/unfused").c_str(),
          [g, k](benchmark::State& state) { RouteDecision(state, g, k, SignatureVariant::kCountIdf, false); })
          ->Apply(CommonSettings);
      for (HalfFormat format : {HalfFormat::kInt8, HalfFormat::kBfloat16}) {
        benchmark::RegisterBenchmark(
            absl::StrCat("BM_RouteDecision/", g.name(), "/K:", k, format == HalfFormat::kInt8 ? "/int8" : "/bf16")
                .c_str(),
            [g, k, format](benchmark::State& state) {
              RouteDecision(state, g, k, SignatureVariant::kCountIdf, true, format);
            })
            ->Apply(CommonSettings);
      }
    }
  }
  // No IDF: no column is zero everywhere, the exact scorer reads every column.
  for (int k : {16, 256}) {
    const Geometry g{48, 128, 8};
    benchmark::RegisterBenchmark(
        absl::StrCat("BM_RouteDecision/", g.name(), "/K:", k, "/count").c_str(),
        [g, k](benchmark::State& state) { RouteDecision(state, g, k, SignatureVariant::kCount); })
        ->Apply(CommonSettings);
  }
  for (const Geometry& g : geometries) {
    benchmark::RegisterBenchmark(absl::StrCat("BM_Transform/", g.name()).c_str(), [g](benchmark::State& state) {
      Transform(state, g);
    })->Apply(CommonSettings);
  }
  for (const Geometry& g : geometries) {
    for (int k : {16, 32, 64, 96, 128, 192, 256, 512, 1024}) {
      const std::string prefix = absl::StrCat("BM_Scorer/", g.name(), "/K:", k, "/");
      CentroidIndexOptions fp32;
      fp32.half_precision = false;
      CentroidIndexOptions fp16;
      fp16.half_format = HalfFormat::kBinary16;
      CentroidIndexOptions bf16;
      bf16.half_format = HalfFormat::kBfloat16;
      CentroidIndexOptions int8;
      int8.half_format = HalfFormat::kInt8;
      CentroidIndexOptions hnsw;
      hnsw.use_hnsw = true;
      benchmark::RegisterBenchmark((prefix + "exact_fp32").c_str(), [=](benchmark::State& s) {
        ScoreWithIndex(s, g, k, CentroidIndexKind::kExact, fp32);
      })->Apply(CommonSettings);
      benchmark::RegisterBenchmark((prefix + "exact_int8").c_str(), [=](benchmark::State& s) {
        ScoreWithIndex(s, g, k, CentroidIndexKind::kExact, int8);
      })->Apply(CommonSettings);
      benchmark::RegisterBenchmark((prefix + "exact_fp16").c_str(), [=](benchmark::State& s) {
        ScoreWithIndex(s, g, k, CentroidIndexKind::kExact, fp16);
      })->Apply(CommonSettings);
      benchmark::RegisterBenchmark((prefix + "exact_bf16").c_str(), [=](benchmark::State& s) {
        ScoreWithIndex(s, g, k, CentroidIndexKind::kExact, bf16);
      })->Apply(CommonSettings);
      benchmark::RegisterBenchmark((prefix + "reduced_flat").c_str(), [=](benchmark::State& s) {
        ScoreWithIndex(s, g, k, CentroidIndexKind::kFaissReduced, CentroidIndexOptions());
      })->Apply(CommonSettings);
      benchmark::RegisterBenchmark((prefix + "reduced_flat_bf16").c_str(), [=](benchmark::State& s) {
        ScoreWithIndex(s, g, k, CentroidIndexKind::kFaissReduced, bf16);
      })->Apply(CommonSettings);
      benchmark::RegisterBenchmark((prefix + "reduced_hnsw").c_str(), [=](benchmark::State& s) {
        ScoreWithIndex(s, g, k, CentroidIndexKind::kFaissReduced, hnsw);
      })->Apply(CommonSettings);
      benchmark::RegisterBenchmark((prefix + "faiss_flat_ip").c_str(), [=](benchmark::State& s) {
        ScoreWithFaissFlat(s, g, k, /*blas_threshold=*/20);
      })->Apply(CommonSettings);
      benchmark::RegisterBenchmark((prefix + "faiss_flat_ip_blas").c_str(), [=](benchmark::State& s) {
        ScoreWithFaissFlat(s, g, k, 1);
      })->Apply(CommonSettings);
      if (k >= 256) {
        for (int dims : {16, 32, 64, 96, 128}) {
          for (int candidates : {16, 32, 48}) {
            CentroidIndexOptions reduced;
            reduced.reduced_dims = dims;
            reduced.candidates = candidates;
            benchmark::RegisterBenchmark(
                absl::StrCat(prefix, "reduced_flat/d:", dims, "/m:", candidates).c_str(),
                [=](benchmark::State& s) { ScoreWithIndex(s, g, k, CentroidIndexKind::kFaissReduced, reduced); })
                ->Apply(CommonSettings);
          }
        }
      }
      if (k <= 64) {
        benchmark::RegisterBenchmark((prefix + "transposed_fp16_skip_zeros").c_str(), [=](benchmark::State& s) {
          ScoreTransposed(s, g, k);
        })->Apply(CommonSettings);
      }
    }
  }
  for (int n : {64, 1024}) {
    const Geometry g{48, 128, 8};
    benchmark::RegisterBenchmark(absl::StrCat("BM_ScoreBatch/", g.name(), "/K:256/n:", n).c_str(),
                                 [g, n](benchmark::State& s) { ScoreBatch(s, g, 256, n); })
        ->Apply(CommonSettings);
  }
}

}  // namespace
}  // namespace eldr

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  eldr::RegisterAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
