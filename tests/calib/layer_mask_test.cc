#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "eldr/calib/calibration.h"
#include "eldr/core/signature.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SpearmanTest, RanksNotValues) {
  EXPECT_DOUBLE_EQ(SpearmanCorrelation(std::vector<double>{1, 2, 3, 4}, std::vector<double>{10, 20, 300, 4000}), 1.0);
  EXPECT_DOUBLE_EQ(SpearmanCorrelation(std::vector<double>{1, 2, 3, 4}, std::vector<double>{4, 3, 2, 1}), -1.0);
  // Ties take average ranks: x ranks (1.5, 1.5, 3), y ranks (1, 2, 3) -> r = 0.866...
  EXPECT_NEAR(SpearmanCorrelation(std::vector<double>{5, 5, 9}, std::vector<double>{1, 2, 3}), std::sqrt(3.0) / 2,
              1e-12);
  EXPECT_EQ(SpearmanCorrelation(std::vector<double>{1, 1, 1}, std::vector<double>{1, 2, 3}), 0.0);
  EXPECT_EQ(SpearmanCorrelation(std::vector<double>{1}, std::vector<double>{1}), 0.0);
}

// Layers 0 and 1 of the prompt carry the request's domain; on layers 2..5 the prompt looks like a
// random domain (misleading). Decode usage follows the request's domain on every layer. The search
// must keep informative layers only, and beat the all-layers signature clearly.
CalibrationData MakeData() {
  const int n = 90, layers = 6, experts = 8, domains = 3;
  std::mt19937_64 rng(17);
  CalibrationData data;
  data.layers = layers;
  data.experts = experts;
  data.n = n;
  data.prefill_counts.resize(n * layers * experts);
  data.decode_counts.resize(n * layers * experts);
  for (int r = 0; r < n; ++r) {
    const int domain = r % domains;
    data.labels.push_back(domain);
    for (int l = 0; l < layers; ++l) {
      const int apparent = l < 2 ? domain : static_cast<int>(rng() % domains);
      for (int e = 0; e < experts; ++e) {
        const int at = (r * layers + l) * experts + e;
        // Each domain's hot experts: 0-2, 3-5, 6-7.
        data.prefill_counts[at] = (e / 3 == apparent ? 6 : 0) + static_cast<int>(rng() % 3);
        data.decode_counts[at] = (e / 3 == domain ? 8 : 1) + static_cast<int>(rng() % 3);
      }
    }
  }
  return data;
}

TEST(LayerMaskTest, KeepsInformativeLayersAndStopsAtThePeak) {
  const CalibrationData data = MakeData();
  const std::vector<float> idf = ComputeIdf(data.prefill_counts, data.n, data.layers, data.experts);
  absl::StatusOr<LayerMaskSearchResult> mask = SearchLayerMask(data, idf, 30000, 1);
  ASSERT_TRUE(mask.ok()) << mask.status();
  EXPECT_EQ(mask->pairs, 90 * 89 / 2);
  ASSERT_FALSE(mask->steps.empty());
  for (int l : mask->layer_mask) EXPECT_LT(l, 2) << "noise layer " << l << " chosen";
  for (size_t i = 1; i < mask->steps.size(); ++i) {
    EXPECT_GT(mask->steps[i].correlation, mask->steps[i - 1].correlation);
  }
  EXPECT_EQ(mask->correlation, mask->steps.back().correlation);
  EXPECT_GT(mask->correlation, mask->all_layers_correlation + 0.1);
  EXPECT_GT(mask->correlation, 0.5);
  EXPECT_TRUE(std::is_sorted(mask->layer_mask.begin(), mask->layer_mask.end()));
}

TEST(LayerMaskTest, SampledPairsAreSeeded) {
  const CalibrationData data = MakeData();
  const std::vector<float> idf = ComputeIdf(data.prefill_counts, data.n, data.layers, data.experts);
  const auto a = SearchLayerMask(data, idf, 500, 3);
  const auto b = SearchLayerMask(data, idf, 500, 3);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->pairs, 500);
  EXPECT_EQ(a->layer_mask, b->layer_mask);
  ASSERT_EQ(a->steps.size(), b->steps.size());
  for (size_t i = 0; i < a->steps.size(); ++i) EXPECT_EQ(a->steps[i].correlation, b->steps[i].correlation);
}

TEST(LayerMaskTest, RejectsMissingDecodeCounts) {
  CalibrationData data = MakeData();
  const std::vector<float> idf = ComputeIdf(data.prefill_counts, data.n, data.layers, data.experts);
  data.decode_counts.clear();
  EXPECT_THAT(SearchLayerMask(data, idf, 100, 1).status().message(), HasSubstr("decode counts are missing"));
  data = MakeData();
  EXPECT_THAT(SearchLayerMask(data, std::vector<float>(3), 100, 1).status().message(), HasSubstr("3 IDF weights"));
}

}  // namespace
}  // namespace eldr
