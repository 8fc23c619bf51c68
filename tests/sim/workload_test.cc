// Workloads: the real-trace split and replay, the synthetic generator's structure and
// reproducibility, arrivals, and the locality measurements eldr-sim prints.
#include "sim/workload.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "eldr/trace/trace.h"
#include "gtest/gtest.h"

namespace eldr::sim {
namespace {

std::string TraceDir() {
  const char* data = std::getenv("ELDR_DATA_DIR");
  return std::string(data != nullptr ? data : "data") + "/esft-routing";
}

TEST(TraceWorkloadTest, SplitIsDisjointPerDomainAndReplaysRealTokens) {
  TraceWorkloadOptions options;
  options.dir = TraceDir();
  options.prefill_fraction = 0.5;
  options.calibration_fraction = 0.5;
  options.seed = 3;
  absl::StatusOr<Workload> workload = LoadTraceWorkload(options);
  ASSERT_TRUE(workload.ok()) << workload.status();
  absl::StatusOr<ExpertTrace> trace = LoadExpertTrace(options.dir, 64);
  ASSERT_TRUE(trace.ok()) << trace.status();

  EXPECT_EQ(workload->layers, 26);
  EXPECT_EQ(workload->experts, 64);
  EXPECT_EQ(workload->top_k, 6);
  EXPECT_TRUE(workload->sample_with_replacement);
  // Every usable sequence is on exactly one side; every domain is on both.
  const int sequences = static_cast<int>(trace->sequences.size());
  EXPECT_EQ(static_cast<int>(workload->pool.size()) + workload->calibration.n, sequences);
  std::set<int> calibration_domains(workload->calibration.labels.begin(), workload->calibration.labels.end());
  EXPECT_EQ(calibration_domains.size(), trace->domains.size());
  std::set<int> pool_domains;
  for (const SimRequest& request : workload->pool) pool_domains.insert(request.domain);
  EXPECT_EQ(pool_domains.size(), trace->domains.size());
  std::set<std::string> evaluated;
  for (const SimRequest& request : workload->pool) evaluated.insert(request.source);
  EXPECT_EQ(evaluated.size(), workload->pool.size());

  // A pool request replays its real sequence: prompt counts are those of its first tokens, and
  // decode step s uses exactly the experts of token prompt + s.
  const size_t row = static_cast<size_t>(trace->layers) * trace->top_k;
  for (const SimRequest& request : workload->pool) {
    const TraceSequence* match = nullptr;
    for (const TraceSequence& seq : trace->sequences) {
      if (request.source == trace->domains[seq.domain] + "#" + std::to_string(seq.index_in_domain)) {
        match = &seq;
      }
    }
    ASSERT_NE(match, nullptr) << request.source;
    EXPECT_EQ(request.prompt_tokens, PrefillTokens(match->tokens, 0.5));
    EXPECT_EQ(request.prompt_tokens + request.decode_steps, match->tokens);
    std::vector<int32_t> counts(26 * 64, 0);
    AccumulateCounts(*trace, *match, 0, request.prompt_tokens, absl::MakeSpan(counts));
    ASSERT_EQ(request.prompt_counts.size(), counts.size());
    for (size_t i = 0; i < counts.size(); ++i) ASSERT_EQ(request.prompt_counts[i], counts[i]);
    for (int s = 0; s < request.decode_steps; s += 7) {
      const uint8_t* expected = match->topk.data() + (request.prompt_tokens + s) * row;
      ASSERT_TRUE(std::equal(expected, expected + row, workload->DecodeToken(request, s)))
          << request.source << " step " << s;
    }
  }
}

TEST(TraceWorkloadTest, RealTracesShowTheirPublishedStructure) {
  TraceWorkloadOptions options;
  options.dir = TraceDir();
  absl::StatusOr<Workload> workload = LoadTraceWorkload(options);
  ASSERT_TRUE(workload.ok()) << workload.status();
  const LocalityStats stats = MeasureWorkloadLocality(*workload, 16, 400, 20000, 1);
  // data/esft-routing/README.md: about 5% fewer distinct experts for one-domain batches of 16
  // (42.4 vs 44.6 of 64) and a prompt/decode correlation of about 0.79.
  EXPECT_NEAR(stats.same_domain_distinct, 42.4, 1.5);
  EXPECT_NEAR(stats.mixed_distinct, 44.6, 1.5);
  EXPECT_GT(stats.same_domain_reduction, 0.02);
  EXPECT_LT(stats.same_domain_reduction, 0.08);
  EXPECT_NEAR(stats.prompt_decode_correlation, 0.79, 0.06);
}

TEST(TraceWorkloadTest, UnreadableFolderIsAClearError) {
  TraceWorkloadOptions options;
  options.dir = "/nonexistent/eldr-traces";
  absl::StatusOr<Workload> workload = LoadTraceWorkload(options);
  ASSERT_FALSE(workload.ok());
  EXPECT_NE(workload.status().message().find("/nonexistent/eldr-traces"), absl::string_view::npos) << workload.status();
  options.dir = TraceDir();
  options.prefill_fraction = 1.5;
  EXPECT_EQ(LoadTraceWorkload(options).status().code(), absl::StatusCode::kInvalidArgument);
}

SyntheticOptions SmallSynthetic() {
  SyntheticOptions options;
  options.layers = 12;
  options.experts = 64;
  options.top_k = 4;
  options.requests = 200;
  options.calibration_requests = 50;
  options.prompt_tokens_mean = 64;
  options.output_tokens_mean = 24;
  return options;
}

TEST(SyntheticWorkloadTest, SameSeedSameWorkloadAndCalibrationIsSeparate) {
  const SyntheticOptions options = SmallSynthetic();
  absl::StatusOr<Workload> a = GenerateSyntheticWorkload(options);
  absl::StatusOr<Workload> b = GenerateSyntheticWorkload(options);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(a->pool.size(), 200u);
  EXPECT_EQ(a->calibration.n, 50);
  EXPECT_EQ(a->generated_tokens, b->generated_tokens);
  EXPECT_EQ(a->calibration.prefill_counts, b->calibration.prefill_counts);
  for (size_t r = 0; r < a->pool.size(); ++r) {
    const SimRequest& request = a->pool[r];
    EXPECT_EQ(request.prompt_counts, b->pool[r].prompt_counts);
    // Each layer's counts sum to prompt tokens x top-k; each token's top-k ids are distinct.
    for (int l = 0; l < options.layers; ++l) {
      int sum = 0;
      for (int e = 0; e < options.experts; ++e) sum += request.prompt_counts[l * options.experts + e];
      ASSERT_EQ(sum, request.prompt_tokens * options.top_k);
    }
    for (int s = 0; s < request.decode_steps; ++s) {
      const uint8_t* token = a->DecodeToken(request, s);
      for (int l = 0; l < options.layers; ++l) {
        std::set<int> ids(token + l * options.top_k, token + (l + 1) * options.top_k);
        ASSERT_EQ(static_cast<int>(ids.size()), options.top_k);
        ASSERT_LT(*ids.rbegin(), options.experts);
      }
    }
  }
  SyntheticOptions other = options;
  other.seed = 2;
  absl::StatusOr<Workload> c = GenerateSyntheticWorkload(other);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->generated_tokens, c->generated_tokens);
}

// The defaults give the published structure on the 48x128 top-8 geometry: one-domain batches touch
// 17-21% fewer distinct experts than mixed ones, and prompt/decode correlation is about 0.8.
TEST(SyntheticWorkloadTest, DefaultsGiveThePublishedStructure) {
  SyntheticOptions options;  // 48x128x8, 4 domains
  options.requests = 500;
  options.calibration_requests = 1;
  absl::StatusOr<Workload> workload = GenerateSyntheticWorkload(options);
  ASSERT_TRUE(workload.ok()) << workload.status();
  const LocalityStats stats = MeasureWorkloadLocality(*workload, 16, 400, 20000, 1);
  EXPECT_GE(stats.same_domain_reduction, 0.17);
  EXPECT_LE(stats.same_domain_reduction, 0.21);
  EXPECT_NEAR(stats.prompt_decode_correlation, 0.8, 0.05);

  // The knob works: no locality, no same-domain advantage.
  options.locality = 0;
  options.requests = 200;
  absl::StatusOr<Workload> flat = GenerateSyntheticWorkload(options);
  ASSERT_TRUE(flat.ok());
  const LocalityStats flat_stats = MeasureWorkloadLocality(*flat, 16, 400, 2000, 1);
  EXPECT_LT(std::abs(flat_stats.same_domain_reduction), 0.02);
}

TEST(SyntheticWorkloadTest, GeometryParsing) {
  SyntheticOptions options;
  ASSERT_TRUE(ParseGeometry("24x64x6", &options).ok());
  EXPECT_EQ(options.layers, 24);
  EXPECT_EQ(options.experts, 64);
  EXPECT_EQ(options.top_k, 6);
  for (const char* bad : {"48x128", "48x128x8x1", "axbxc", "48x300x8", "48x8x8", "0x128x8", ""}) {
    EXPECT_EQ(ParseGeometry(bad, &options).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ArrivalsTest, RatesScaleTheSameSequence) {
  absl::StatusOr<Workload> workload = GenerateSyntheticWorkload(SmallSynthetic());
  ASSERT_TRUE(workload.ok());
  const std::vector<Arrival> slow = MakeArrivals(*workload, 10, 150, 5);
  const std::vector<Arrival> fast = MakeArrivals(*workload, 40, 150, 5);
  ASSERT_EQ(slow.size(), 150u);
  for (size_t i = 0; i < slow.size(); ++i) {
    EXPECT_EQ(slow[i].request, fast[i].request);
    EXPECT_NEAR(slow[i].time_us, 4 * fast[i].time_us, 1e-6 * slow[i].time_us);
    if (i > 0) EXPECT_GT(slow[i].time_us, slow[i - 1].time_us);
  }
  // Mean gap of a Poisson process at 10/s: 100 ms (loose bound for 150 samples).
  EXPECT_NEAR(slow.back().time_us / 150, 100e3, 20e3);
}

TEST(SpearmanTest, RanksWithTies) {
  EXPECT_NEAR(SpearmanCorrelation({1, 2, 3, 4}, {10, 20, 30, 40}), 1.0, 1e-12);
  EXPECT_NEAR(SpearmanCorrelation({1, 2, 3, 4}, {4, 3, 2, 1}), -1.0, 1e-12);
  EXPECT_NEAR(SpearmanCorrelation({1, 2, 2, 3}, {1, 2, 2, 3}), 1.0, 1e-12);
  EXPECT_EQ(SpearmanCorrelation({1, 1, 1}, {1, 2, 3}), 0.0);
}

}  // namespace
}  // namespace eldr::sim
