// DistinctExpertCounter against a brute-force count with std::set, on random batches of several
// geometries (including expert counts that are not a multiple of 64 and the uint8 maximum).
#include "sim/distinct_experts.h"

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace eldr::sim {
namespace {

struct Geometry {
  int layers, experts, top_k;
};

void PrintTo(const Geometry& g, std::ostream* os) { *os << g.layers << "x" << g.experts << "x" << g.top_k; }

class DistinctExpertsTest : public ::testing::TestWithParam<Geometry> {};

TEST_P(DistinctExpertsTest, MatchesBruteForceOnRandomBatches) {
  const Geometry g = GetParam();
  std::mt19937 rng(1234 + g.experts);
  DistinctExpertCounter counter(g.layers, g.experts, g.top_k);
  for (int trial = 0; trial < 50; ++trial) {
    const int batch = 1 + static_cast<int>(rng() % 40);
    std::vector<std::vector<uint8_t>> tokens(batch);
    // Some batches draw from a narrow expert range, so repeats across tokens are common.
    const int range = trial % 2 == 0 ? g.experts : std::max(g.top_k, g.experts / 8);
    for (auto& token : tokens) {
      token.resize(static_cast<size_t>(g.layers) * g.top_k);
      for (int l = 0; l < g.layers; ++l) {
        std::set<int> chosen;  // a token's top-k ids are distinct, as the router's are
        while (static_cast<int>(chosen.size()) < g.top_k) chosen.insert(static_cast<int>(rng() % range));
        int c = 0;
        for (int e : chosen) token[static_cast<size_t>(l) * g.top_k + c++] = static_cast<uint8_t>(e);
      }
    }
    counter.Reset();
    for (const auto& token : tokens) counter.AddToken(token.data());

    int64_t total = 0;
    for (int l = 0; l < g.layers; ++l) {
      std::set<int> distinct;
      for (const auto& token : tokens) {
        for (int c = 0; c < g.top_k; ++c) distinct.insert(token[static_cast<size_t>(l) * g.top_k + c]);
      }
      EXPECT_EQ(counter.DistinctAtLayer(l), static_cast<int>(distinct.size())) << "trial " << trial << " layer " << l;
      total += static_cast<int64_t>(distinct.size());
    }
    EXPECT_EQ(counter.DistinctAllLayers(), total) << "trial " << trial;
  }
}

INSTANTIATE_TEST_SUITE_P(Geometries, DistinctExpertsTest,
                         ::testing::Values(Geometry{26, 64, 6}, Geometry{48, 128, 8}, Geometry{3, 100, 4},
                                           Geometry{2, 256, 16}, Geometry{1, 2, 1}),
                         [](const ::testing::TestParamInfo<Geometry>& info) {
                           return std::to_string(info.param.layers) + "x" + std::to_string(info.param.experts) + "x" +
                                  std::to_string(info.param.top_k);
                         });

TEST(DistinctExpertsTest, ResetForgetsEarlierTokens) {
  DistinctExpertCounter counter(2, 8, 2);
  const uint8_t first[] = {0, 1, 2, 3};
  const uint8_t second[] = {1, 4, 3, 5};
  counter.AddToken(first);
  counter.AddToken(second);
  EXPECT_EQ(counter.DistinctAtLayer(0), 3);  // {0, 1, 4}
  EXPECT_EQ(counter.DistinctAtLayer(1), 3);  // {2, 3, 5}
  counter.Reset();
  EXPECT_EQ(counter.DistinctAllLayers(), 0);
  counter.AddToken(second);
  EXPECT_EQ(counter.DistinctAllLayers(), 4);
}

}  // namespace
}  // namespace eldr::sim
