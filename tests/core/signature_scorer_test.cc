// SignatureScorer: the fused path (ApplyKept + SearchKept) decides as Apply + Search.
#include "eldr/core/signature_scorer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "eldr/core/centroid_index.h"
#include "eldr/core/errors.h"
#include "eldr/core/signature.h"
#include "gtest/gtest.h"

namespace eldr {
namespace {

std::string Int16Bytes(const std::vector<int32_t>& values) {
  std::string bytes;
  for (int32_t v : values) {
    const uint16_t u = static_cast<uint16_t>(static_cast<int16_t>(v));
    bytes.push_back(static_cast<char>(u & 0xff));
    bytes.push_back(static_cast<char>(u >> 8));
  }
  return bytes;
}

// Prompts of `domains` kinds: each domain prefers its own experts; a third of the (layer, expert)
// cells are used by every prompt, hence IDF 0, hence dropped by the index.
struct Workload {
  SignatureSpec spec;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int> domain;
};

Workload MakeWorkload(int layers, int experts, int domains, int n, std::mt19937_64& rng) {
  Workload w;
  const int cells = layers * experts;
  std::vector<std::vector<double>> preference(domains, std::vector<double>(cells));
  std::uniform_real_distribution<double> uniform(0, 1);
  std::vector<char> everywhere(cells);
  for (int c = 0; c < cells; ++c) everywhere[c] = uniform(rng) < 0.33;
  for (auto& p : preference) {
    for (double& v : p) v = std::pow(uniform(rng), 3) * 20;
  }
  for (int i = 0; i < n; ++i) {
    const int d = static_cast<int>(rng() % domains);
    std::vector<int32_t> counts(cells);
    for (int c = 0; c < cells; ++c) {
      std::poisson_distribution<int> poisson(preference[d][c]);
      counts[c] = poisson(rng) + (everywhere[c] ? 1 : 0);
    }
    w.prompts.push_back(std::move(counts));
    w.domain.push_back(d);
  }
  // IDF over the prompts, as calibration computes it.
  std::vector<int32_t> flat;
  for (const auto& p : w.prompts) flat.insert(flat.end(), p.begin(), p.end());
  w.spec.layers = layers;
  w.spec.experts = experts;
  w.spec.variant = SignatureVariant::kCountIdf;
  w.spec.idf = ComputeIdf(flat, n, layers, experts);
  return w;
}

// Centroids: the normalised mean transformed signature of each worker's prompts (worker k takes
// domain k % domains, prompts k, k + workers, ...), the shape refit and calibration produce.
std::vector<float> Centroids(const Workload& w, const SignatureTransform& t, int workers, int domains) {
  std::vector<float> rows(static_cast<size_t>(workers) * t.dim(), 0.f);
  std::vector<float> signature(t.dim());
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    const int worker = static_cast<int>(i % workers);
    if (w.domain[i] != worker % domains) continue;
    EXPECT_TRUE(t.Apply(CountsInt32{0, 0, w.prompts[i]}, absl::MakeSpan(signature)).ok());
    for (int j = 0; j < t.dim(); ++j) rows[static_cast<size_t>(worker) * t.dim() + j] += signature[j];
  }
  for (int r = 0; r < workers; ++r) {
    double norm = 0;
    for (int j = 0; j < t.dim(); ++j) norm += std::pow(rows[static_cast<size_t>(r) * t.dim() + j], 2);
    if (norm == 0) {
      rows[static_cast<size_t>(r) * t.dim() + r % t.dim()] = 1.f;
      continue;
    }
    for (int j = 0; j < t.dim(); ++j) rows[static_cast<size_t>(r) * t.dim() + j] /= std::sqrt(norm);
  }
  return rows;
}

// The index of `workers` Centroids at band tau `tau`, scanning in `format`.
std::unique_ptr<CentroidIndex> WorkerIndex(const Workload& w, const SignatureTransform& t, int workers, float tau,
                                           HalfFormat format = HalfFormat::kAuto) {
  CentroidIndexOptions options;
  options.band_tau = tau;
  options.half_format = format;
  auto index = BuildCentroidIndex(Centroids(w, t, workers, 6), workers, t.dim(), options);
  EXPECT_TRUE(index.ok()) << index.status();
  return index.ok() ? *std::move(index) : nullptr;
}

// Band membership at tau from a set of scores: rows with score >= best - tau.
std::vector<int> Band(const std::vector<ScoredRow>& scored, float tau, float margin, std::vector<int>* near_edge) {
  float best = -1e30f;
  for (const ScoredRow& s : scored) best = std::max(best, s.score);
  std::vector<int> band;
  for (const ScoredRow& s : scored) {
    if (std::fabs(s.score - (best - tau)) < margin) near_edge->push_back(s.row);
    if (s.score >= best - tau) band.push_back(s.row);
  }
  std::sort(band.begin(), band.end());
  return band;
}

void ExpectSameDecisions(const CentroidIndex& index, const SignatureTransform& transform, const Workload& w, float tau,
                         int first_query) {
  const SignatureScorer scorer(transform, index);
  ASSERT_TRUE(scorer.fused()) << index.kind();
  SignatureScorer::Buffers buffers;
  std::vector<float> signature(transform.dim());
  std::vector<ScoredRow> fused, unfused;
  int judged = 0;
  for (size_t i = first_query; i < w.prompts.size(); ++i) {
    const std::string bytes = Int16Bytes(w.prompts[i]);
    const CountsInt16Le counts{0, 0, bytes};
    ASSERT_TRUE(scorer.Score(counts, &buffers, &fused).ok());
    ASSERT_TRUE(transform.Apply(counts, absl::MakeSpan(signature)).ok());
    ASSERT_TRUE(index.Search(signature, &unfused).ok());
    // The same candidate rows, the same scores up to float rounding.
    std::vector<float> by_row(index.rows(), -9.f);
    for (const ScoredRow& s : unfused) by_row[s.row] = s.score;
    for (const ScoredRow& s : fused) {
      ASSERT_NE(by_row[s.row], -9.f) << index.kind() << " query " << i << " row " << s.row;
      EXPECT_NEAR(s.score, by_row[s.row], 1e-5f) << index.kind() << " query " << i;
    }
    std::vector<int> near_fused, near_unfused;
    const std::vector<int> band_fused = Band(fused, tau, 1e-5f, &near_fused);
    const std::vector<int> band_unfused = Band(unfused, tau, 1e-5f, &near_unfused);
    if (near_fused.empty() && near_unfused.empty()) {
      EXPECT_EQ(band_fused, band_unfused) << index.kind() << " query " << i;
      ++judged;
    }
    // The full signature, built on demand, is Apply's.
    const absl::Span<const float> lazy = scorer.Signature(counts, &buffers);
    ASSERT_EQ(lazy.size(), signature.size());
    for (size_t j = 0; j < signature.size(); ++j) ASSERT_EQ(lazy[j], signature[j]);
  }
  EXPECT_GT(judged, static_cast<int>(w.prompts.size() - first_query) * 9 / 10);
}

TEST(SignatureScorerTest, FusedPathDecidesAsApplyThenSearch) {
  std::mt19937_64 rng(7);
  const Workload w = MakeWorkload(/*layers=*/12, /*experts=*/64, /*domains=*/6, /*n=*/600, rng);
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(w.spec);
  ASSERT_TRUE(transform.ok()) << transform.status();
  for (float tau : {0.02f, 0.1f}) {
    for (int workers : {8, 16, 200}) {
      const std::unique_ptr<CentroidIndex> index = WorkerIndex(w, *transform, workers, tau);
      ASSERT_NE(index, nullptr);
      ASSERT_NE(index->kept_columns(), nullptr);
      EXPECT_LT(index->kept_columns()->kept, transform->dim());
      ExpectSameDecisions(*index, *transform, w, tau, 400);
    }
  }
}

// ApplyKept leaves the normalisation to SearchKept, which scales as part of its 8-bit scan or in a
// pass of its own: the results are bit for bit those of scaling the values first, for every scan
// format and both index kinds.
TEST(SignatureScorerTest, SearchKeptScalesAsScalingFirstWould) {
  std::mt19937_64 rng(9);
  const Workload w = MakeWorkload(/*layers=*/16, /*experts=*/128, /*domains=*/6, /*n=*/300, rng);
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(w.spec);
  ASSERT_TRUE(transform.ok()) << transform.status();
  int compared = 0;
  for (HalfFormat format : {HalfFormat::kAuto, HalfFormat::kInt8, HalfFormat::kBfloat16, HalfFormat::kBinary16}) {
    for (int workers : {16, 200}) {
      const std::unique_ptr<CentroidIndex> index = WorkerIndex(w, *transform, workers, 0.05f, format);
      ASSERT_NE(index, nullptr);
      const ColumnSelection* kept = index->kept_columns();
      ASSERT_NE(kept, nullptr);
      std::vector<float> values(kept->kept + 16), scaled(kept->kept + 16, 0.f);
      std::vector<ScoredRow> by_index, by_caller;
      for (size_t i = 200; i < w.prompts.size(); ++i) {
        const std::string bytes = Int16Bytes(w.prompts[i]);
        const absl::StatusOr<SignatureTransform::KeptValues> applied =
            transform->ApplyKept(CountsInt16Le{0, 0, bytes}, *kept, absl::MakeSpan(values));
        ASSERT_TRUE(applied.ok()) << applied.status();
        ASSERT_NE(applied->scale, 1.f);
        for (int k = 0; k < kept->kept; ++k) scaled[k] = values[k] * applied->scale;
        ASSERT_TRUE(index->SearchKept(values, applied->scale, applied->norm, applied->max, &by_index).ok());
        ASSERT_TRUE(index->SearchKept(scaled, 1.f, applied->norm, applied->max, &by_caller).ok());
        ASSERT_EQ(by_index.size(), by_caller.size()) << index->kind();
        for (size_t j = 0; j < by_index.size(); ++j) {
          ASSERT_EQ(by_index[j].row, by_caller[j].row) << index->kind() << " query " << i;
          ASSERT_EQ(by_index[j].score, by_caller[j].score) << index->kind() << " query " << i;
        }
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 4 * 2 * 100);
}

TEST(SignatureScorerTest, FusedPathWithALayerMaskAndRejections) {
  std::mt19937_64 rng(8);
  Workload w = MakeWorkload(10, 32, 4, 500, rng);
  // Keep layers 1, 4, 7: the IDF of the kept layers only.
  std::vector<float> idf;
  for (int layer : {1, 4, 7}) {
    idf.insert(idf.end(), w.spec.idf.begin() + layer * 32, w.spec.idf.begin() + (layer + 1) * 32);
  }
  w.spec.layer_mask = {1, 4, 7};
  w.spec.idf = idf;
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(w.spec);
  ASSERT_TRUE(transform.ok()) << transform.status();
  const std::vector<float> centroids = Centroids(w, *transform, 12, 4);
  auto index = BuildCentroidIndex(centroids, 12, transform->dim(), CentroidIndexOptions{});
  ASSERT_TRUE(index.ok()) << index.status();
  ExpectSameDecisions(**index, *transform, w, 0.1f, 300);

  const SignatureScorer scorer(*transform, **index);
  SignatureScorer::Buffers buffers;
  std::vector<ScoredRow> out;
  std::vector<int32_t> negative = w.prompts[0];
  negative[9 * 32 + 3] = -1;  // an unmasked layer is still checked
  const std::string bytes = Int16Bytes(negative);
  const absl::Status rejected = scorer.Score(CountsInt16Le{0, 0, bytes}, &buffers, &out);
  EXPECT_EQ(RejectReasonOf(rejected), RejectReason::kNegativeCount) << rejected;
  std::vector<int32_t> zero = w.prompts[0];
  for (int layer : {1, 4, 7}) std::fill(zero.begin() + layer * 32, zero.begin() + (layer + 1) * 32, 0);
  const std::string zero_bytes = Int16Bytes(zero);
  EXPECT_EQ(RejectReasonOf(scorer.Score(CountsInt16Le{0, 0, zero_bytes}, &buffers, &out)),
            RejectReason::kZeroSignature);
  // Other encodings take Apply + Search.
  EXPECT_TRUE(scorer.Score(CountsInt32{0, 0, w.prompts[1]}, &buffers, &out).ok());
  EXPECT_EQ(out.size(), 12u);
}

TEST(SignatureScorerTest, NotFusedWhereTheTransformOrIndexCannot) {
  SignatureSpec gate;
  gate.layers = 2;
  gate.experts = 16;
  gate.variant = SignatureVariant::kGateProb;
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(gate);
  ASSERT_TRUE(transform.ok());
  std::vector<float> rows(4 * 32, 0.f);
  for (int r = 0; r < 4; ++r) rows[r * 32 + r] = 1.f;  // most columns zero: dropped
  auto index = BuildCentroidIndex(rows, 4, 32, CentroidIndexOptions{});
  ASSERT_TRUE(index.ok());
  ASSERT_NE((*index)->kept_columns(), nullptr);
  EXPECT_FALSE(SignatureScorer(*transform, **index).fused());
  // A kept query without its 16 floats of room.
  std::vector<ScoredRow> out;
  std::vector<float> query((*index)->kept_columns()->kept + 15, 0.f);
  EXPECT_EQ(RejectReasonOf((*index)->SearchKept(query, 1.f, 1.f, -1.f, &out)), RejectReason::kGeometry);
}

// Centroids that use every column (the count variant has no IDF to zero any): the index keeps
// them all, and the route decision still takes the fused path, with Apply + Search's decisions.
TEST(SignatureScorerTest, FusedPathWhereTheIndexKeepsEveryColumn) {
  std::mt19937_64 rng(10);
  Workload w = MakeWorkload(/*layers=*/8, /*experts=*/64, /*domains=*/6, /*n=*/600, rng);
  w.spec.variant = SignatureVariant::kCount;
  w.spec.idf.clear();
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(w.spec);
  ASSERT_TRUE(transform.ok()) << transform.status();
  for (HalfFormat format : {HalfFormat::kAuto, HalfFormat::kInt8, HalfFormat::kBfloat16}) {
    for (int workers : {16, 200}) {
      const std::unique_ptr<CentroidIndex> index = WorkerIndex(w, *transform, workers, 0.05f, format);
      ASSERT_NE(index, nullptr);
      ASSERT_NE(index->kept_columns(), nullptr) << index->kind();
      EXPECT_EQ(index->kept_columns()->kept, transform->dim()) << index->kind();
      ExpectSameDecisions(*index, *transform, w, 0.05f, 400);
    }
  }
}

}  // namespace
}  // namespace eldr
