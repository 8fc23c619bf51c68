#include "eldr/core/errors.h"

#include <cctype>
#include <set>
#include <string>

#include "gtest/gtest.h"

namespace eldr {
namespace {

constexpr RejectReason kReasons[] = {
    RejectReason::kGeometry,      RejectReason::kNegativeCount, RejectReason::kNonFinite,
    RejectReason::kZeroSignature, RejectReason::kWrongEncoding, RejectReason::kMalformed,
    RejectReason::kUnknownWorker, RejectReason::kOversized,     RejectReason::kOutOfRange,
    RejectReason::kOther,
};

TEST(RejectReasonTest, LabelsAreDistinctLowerSnakeCase) {
  std::set<std::string> seen;
  for (RejectReason reason : kReasons) {
    const std::string label(RejectReasonLabel(reason));
    ASSERT_FALSE(label.empty());
    EXPECT_TRUE(std::islower(static_cast<unsigned char>(label.front()))) << label;
    for (char c : label) {
      EXPECT_TRUE(std::islower(static_cast<unsigned char>(c)) || c == '_') << label;
    }
    EXPECT_TRUE(seen.insert(label).second) << "duplicate label " << label;
  }
  EXPECT_EQ(RejectReasonLabel(RejectReason::kZeroSignature), "zero_signature");
  EXPECT_EQ(RejectReasonLabel(RejectReason::kNegativeCount), "negative_count");
}

TEST(RejectReasonTest, PayloadRoundTripsForEveryReason) {
  for (RejectReason reason : kReasons) {
    const absl::Status status = MakeInputError(absl::StatusCode::kFailedPrecondition, reason, "why it failed");
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(status.message(), "why it failed");
    EXPECT_EQ(RejectReasonOf(status), reason) << RejectReasonLabel(reason);
  }
}

TEST(RejectReasonTest, InvalidInputIsInvalidArgument) {
  const absl::Status status = InvalidInput(RejectReason::kNonFinite, "NaN at 3");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RejectReasonOf(status), RejectReason::kNonFinite);
}

TEST(RejectReasonTest, StatusWithoutReasonIsOther) {
  EXPECT_EQ(RejectReasonOf(absl::InvalidArgumentError("plain")), RejectReason::kOther);
  EXPECT_EQ(RejectReasonOf(absl::OkStatus()), RejectReason::kOther);
  // An OK code cannot carry a payload; the result is simply OK.
  EXPECT_TRUE(MakeInputError(absl::StatusCode::kOk, RejectReason::kGeometry, "").ok());
}

TEST(RejectReasonTest, ReasonSurvivesCopy) {
  absl::Status original = InvalidInput(RejectReason::kUnknownWorker, "w9");
  absl::Status copy = original;
  EXPECT_EQ(RejectReasonOf(copy), RejectReason::kUnknownWorker);
}

}  // namespace
}  // namespace eldr
