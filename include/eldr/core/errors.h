// Input rejections carry a machine-readable reason next to the human message, so every front end
// (gRPC server, tools, simulator) can count rejections by reason without parsing messages.
#ifndef ELDR_CORE_ERRORS_H_
#define ELDR_CORE_ERRORS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace eldr {

// Why an input was rejected. Each has a stable lower_snake_case label (RejectReasonLabel) that is
// used as a Prometheus label value: keep the set small and closed.
enum class RejectReason {
  kGeometry,       // layers/experts/dimension do not match the calibrated transform
  kNegativeCount,  // a count below zero
  kNonFinite,      // NaN or Inf in a float input
  kZeroSignature,  // nothing left after the layer mask (callers fall back to load balancing)
  kWrongEncoding,  // e.g. counts sent to a gate_prob transform, odd byte length
  kMalformed,      // unparsable artifact, worker file, config or payload
  kUnknownWorker,  // a worker id that is not in the pool
  kOversized,      // larger than the configured limit
  kOutOfRange,     // a number outside its documented range (capacity, load, port, ...)
  kOther,
};

absl::string_view RejectReasonLabel(RejectReason reason);

// Every reason, in declaration order (for metric series created up front).
absl::Span<const RejectReason> AllRejectReasons();

// An absl::Status with `code` and `message` that carries `reason` as a payload.
absl::Status MakeInputError(absl::StatusCode code, RejectReason reason, absl::string_view message);

// Shorthand for the common INVALID_ARGUMENT case.
absl::Status InvalidInput(RejectReason reason, absl::string_view message);

// The reason attached by MakeInputError, or kOther when the status carries none.
RejectReason RejectReasonOf(const absl::Status& status);

}  // namespace eldr

#endif  // ELDR_CORE_ERRORS_H_
