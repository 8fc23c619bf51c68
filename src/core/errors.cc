#include "eldr/core/errors.h"

#include <optional>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace eldr {
namespace {

// The payload is the reason's label, so it survives any transport that copies payloads verbatim.
constexpr absl::string_view kRejectReasonPayloadUrl = "type.googleapis.com/eldr.RejectReason";

constexpr RejectReason kAllReasons[] = {
    RejectReason::kGeometry,      RejectReason::kNegativeCount, RejectReason::kNonFinite,
    RejectReason::kZeroSignature, RejectReason::kWrongEncoding, RejectReason::kMalformed,
    RejectReason::kUnknownWorker, RejectReason::kOversized,     RejectReason::kOutOfRange,
    RejectReason::kOther,
};

}  // namespace

absl::Span<const RejectReason> AllRejectReasons() { return kAllReasons; }

absl::string_view RejectReasonLabel(RejectReason reason) {
  switch (reason) {
    case RejectReason::kGeometry:
      return "geometry";
    case RejectReason::kNegativeCount:
      return "negative_count";
    case RejectReason::kNonFinite:
      return "non_finite";
    case RejectReason::kZeroSignature:
      return "zero_signature";
    case RejectReason::kWrongEncoding:
      return "wrong_encoding";
    case RejectReason::kMalformed:
      return "malformed";
    case RejectReason::kUnknownWorker:
      return "unknown_worker";
    case RejectReason::kOversized:
      return "oversized";
    case RejectReason::kOutOfRange:
      return "out_of_range";
    case RejectReason::kOther:
      return "other";
  }
  return "other";
}

absl::Status MakeInputError(absl::StatusCode code, RejectReason reason, absl::string_view message) {
  absl::Status status(code, message);
  if (!status.ok()) {
    status.SetPayload(kRejectReasonPayloadUrl, absl::Cord(RejectReasonLabel(reason)));
  }
  return status;
}

absl::Status InvalidInput(RejectReason reason, absl::string_view message) {
  return MakeInputError(absl::StatusCode::kInvalidArgument, reason, message);
}

RejectReason RejectReasonOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kRejectReasonPayloadUrl);
  if (!payload.has_value()) return RejectReason::kOther;
  const std::string label(*payload);
  for (RejectReason reason : kAllReasons) {
    if (RejectReasonLabel(reason) == label) return reason;
  }
  return RejectReason::kOther;
}

}  // namespace eldr
