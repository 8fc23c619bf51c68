// How centroid rows follow a discovered pool: FitRowsToPool (an artifact offered to a pool whose
// names it does not know) and RefitRowsToPool (pods joining and leaving without online refit).
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "eldr/core/centroid_artifact.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/centroid_loader.h"
#include "server/discovery_component.h"

namespace eldr::server {
namespace {

using ::testing::ElementsAre;

// k rows of dimension 2 (a unit vector at angle i per row), named `workers` (or unnamed).
CentroidArtifact Rows(int k, std::vector<std::string> workers = {}) {
  CentroidArtifact artifact;
  artifact.spec.layers = 1;
  artifact.spec.experts = 2;
  artifact.spec.variant = SignatureVariant::kCount;
  artifact.k = k;
  for (int i = 0; i < k; ++i) {
    const float angle = 0.3f * static_cast<float>(i);
    artifact.centroids.push_back(std::cos(angle));
    artifact.centroids.push_back(std::sin(angle));
  }
  artifact.workers = std::move(workers);
  return artifact;
}

std::vector<float> Row(const CentroidArtifact& artifact, int i) {
  const auto row = artifact.row(i);
  return std::vector<float>(row.begin(), row.end());
}

TEST(FitRowsToPoolTest, UnnamedRowsGoToThePodsInPoolOrderAndLeftoversAreDropped) {
  const CentroidArtifact configured = Rows(4);
  const CentroidArtifact fitted = FitRowsToPool(configured, {"decode-b", "decode-a"});
  ASSERT_EQ(fitted.k, 2);
  EXPECT_THAT(fitted.workers, ElementsAre("decode-b", "decode-a"));
  EXPECT_EQ(Row(fitted, 0), Row(configured, 0));
  EXPECT_EQ(Row(fitted, 1), Row(configured, 1));
}

TEST(FitRowsToPoolTest, RowsNamedAfterAPodKeepItAndTheOthersFillTheRest) {
  const CentroidArtifact configured = Rows(3, {"gone-0", "decode-1", "gone-2"});
  const CentroidArtifact fitted = FitRowsToPool(configured, {"decode-0", "decode-1", "decode-2"});
  ASSERT_EQ(fitted.k, 3);
  // Row 1 stays with decode-1; rows 0 and 2 go to the pods without a row, in pool order.
  EXPECT_THAT(fitted.workers, ElementsAre("decode-0", "decode-1", "decode-2"));
  EXPECT_EQ(Row(fitted, 1), Row(configured, 1));
  EXPECT_EQ(Row(fitted, 2), Row(configured, 2));
}

TEST(FitRowsToPoolTest, AnEmptyPoolLeavesTheArtifactAsItIs) {
  const CentroidArtifact configured = Rows(2, {"a", "b"});
  const CentroidArtifact fitted = FitRowsToPool(configured, {});
  EXPECT_EQ(fitted.k, 2);
  EXPECT_THAT(fitted.workers, ElementsAre("a", "b"));
}

TEST(RefitRowsToPoolTest, AJoiningPodTakesAFreeRowAndALeavingPodFreesItsRow) {
  const CentroidArtifact configured = Rows(4);
  // In service: rows 0 and 1 of the configured artifact on two pods.
  CentroidArtifact current = FitRowsToPool(configured, {"p0", "p1"});
  ASSERT_EQ(current.k, 2);

  // p2 joins: it takes the first configured row no pod holds (row 2).
  std::optional<CentroidArtifact> joined = RefitRowsToPool(current, configured, {"p0", "p1", "p2"}, {"p0", "p1", "p2"});
  ASSERT_TRUE(joined.has_value());
  EXPECT_THAT(joined->workers, ElementsAre("p0", "p1", "p2"));
  EXPECT_EQ(Row(*joined, 2), Row(configured, 2));

  // p0 leaves, p3 joins: p1 and p2 keep their rows, p3 gets row 0 (free again).
  std::optional<CentroidArtifact> moved = RefitRowsToPool(*joined, configured, {"p1", "p2", "p3"}, {"p1", "p2", "p3"});
  ASSERT_TRUE(moved.has_value());
  EXPECT_THAT(moved->workers, ElementsAre("p1", "p2", "p3"));
  EXPECT_EQ(Row(*moved, 0), Row(configured, 1));
  EXPECT_EQ(Row(*moved, 1), Row(configured, 2));
  EXPECT_EQ(Row(*moved, 2), Row(configured, 0));
}

TEST(RefitRowsToPoolTest, APodBackUnderItsNameTakesItsNamedRow) {
  const CentroidArtifact configured = Rows(3, {"decode-0", "decode-1", "decode-2"});
  CentroidArtifact current = FitRowsToPool(configured, {"decode-0", "decode-1", "decode-2"});
  // decode-0 and decode-1 restart (removed, then back): both rows are free again, and each takes
  // its own even though decode-1 comes first.
  std::optional<CentroidArtifact> gone = RefitRowsToPool(current, configured, {"decode-2"}, {"decode-2"});
  ASSERT_TRUE(gone.has_value());
  std::optional<CentroidArtifact> back =
      RefitRowsToPool(*gone, configured, {"decode-1", "decode-0", "decode-2"}, {"decode-1", "decode-0", "decode-2"});
  ASSERT_TRUE(back.has_value());
  EXPECT_THAT(back->workers, ElementsAre("decode-2", "decode-1", "decode-0"));
  EXPECT_EQ(Row(*back, 1), Row(configured, 1));
  EXPECT_EQ(Row(*back, 2), Row(configured, 0));
}

TEST(RefitRowsToPoolTest, NothingToChangeOrNothingPossibleIsNullopt) {
  const CentroidArtifact configured = Rows(2);
  const CentroidArtifact current = FitRowsToPool(configured, {"p0", "p1"});
  EXPECT_FALSE(RefitRowsToPool(current, configured, {"p0", "p1"}, {"p0", "p1"}).has_value());
  // A third pod but no free row: unchanged.
  EXPECT_FALSE(RefitRowsToPool(current, configured, {"p0", "p1", "p2"}, {"p0", "p1", "p2"}).has_value());
  // A draining worker keeps its row but does not take one.
  const CentroidArtifact one = FitRowsToPool(configured, {"p0"});
  EXPECT_FALSE(RefitRowsToPool(one, configured, {"p0", "drain"}, {"p0"}).has_value());
  // Every pod gone: nothing left to install.
  EXPECT_FALSE(RefitRowsToPool(current, configured, {}, {}).has_value());
  // Another transform: the configured rows cannot serve.
  CentroidArtifact other = Rows(2);
  other.spec.variant = SignatureVariant::kGateProb;
  EXPECT_FALSE(RefitRowsToPool(current, other, {"p0", "p1", "p2"}, {"p0", "p1", "p2"}).has_value());
}

}  // namespace
}  // namespace eldr::server
