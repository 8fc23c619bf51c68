// Transforming calibration requests into unit signatures (shared by calibration, evaluation and
// the benchmark). Not part of the public API.
#ifndef ELDR_CALIB_SIGNATURES_H_
#define ELDR_CALIB_SIGNATURES_H_

#include <vector>

#include "absl/status/statusor.h"
#include "eldr/calib/calibration.h"
#include "eldr/core/signature.h"

namespace eldr {

// Unit signatures of data's requests under `transform`, row-major [usable][dim]. Requests whose
// signature is all zero on the transform's layers are skipped; `usable` receives the indices of
// the rows returned. Errors name the request.
absl::StatusOr<std::vector<float>> TransformRequests(const CalibrationData& data, const SignatureTransform& transform,
                                                     std::vector<int>* usable);

}  // namespace eldr

#endif  // ELDR_CALIB_SIGNATURES_H_
