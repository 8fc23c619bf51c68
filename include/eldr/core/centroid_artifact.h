// The calibration artifact: the signature transform plus one unit centroid per decode worker.
//
// JSON, compatible with the reference implementation's files (which load unchanged): keys `L`, `e`,
// `k`, `variant`, `layer_mask`, `sig_idf`, `centroids` (k unit rows), `model`, `seed`, and the
// optional `workers` (the worker id of each row). Other keys of the reference (`algo`, `m`, `n_fit`,
// `sig_dtype`, `layer_select`, hashes, ...) are accepted and ignored.
#ifndef ELDR_CORE_CENTROID_ARTIFACT_H_
#define ELDR_CORE_CENTROID_ARTIFACT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "eldr/common/file.h"
#include "eldr/core/signature.h"

namespace eldr {

struct CentroidArtifact {
  SignatureSpec spec;
  int k = 0;                         // centroid rows
  std::vector<float> centroids;      // k * spec.dim(), row-major, unit rows
  std::vector<std::string> workers;  // empty, or k distinct worker ids naming the rows
  std::string model;                 // free text, e.g. "DeepSeek-V2-Lite"
  uint64_t seed = 0;                 // calibration seed, for reproducibility

  int dim() const { return spec.dim(); }
  absl::Span<const float> row(int i) const {
    return absl::Span<const float>(centroids).subspan(static_cast<size_t>(i) * dim(), dim());
  }
};

// Every check of the artifact; the message names the one that failed: spec (see
// ValidateSignatureSpec), k >= 1, k rows of dim() finite values, unit norm within 1e-3, workers
// empty or k distinct non-empty ids.
absl::Status ValidateCentroidArtifact(const CentroidArtifact& artifact);

// Parse + validate. Errors are INVALID_ARGUMENT with RejectReason kMalformed (syntax, missing or
// mistyped keys) or the reason of the failed check.
absl::StatusOr<CentroidArtifact> ParseCentroidArtifact(absl::string_view json_text);

// Reads `path` (a regular file of at most `max_bytes`, see eldr/common/file.h) and parses it. File
// errors (NOT_FOUND, FAILED_PRECONDITION for a non-regular file, RESOURCE_EXHAUSTED over the limit,
// ...) name the path; parse errors are those of ParseCentroidArtifact, prefixed with the path.
absl::StatusOr<CentroidArtifact> LoadCentroidArtifact(const std::string& path, size_t max_bytes = kDefaultMaxFileBytes);

// Pretty JSON with the reference keys plus `workers` (when set).
std::string SerializeCentroidArtifact(const CentroidArtifact& artifact);

// Validates, writes to a temporary file in the same folder, fsyncs and renames over `path`, so a
// reader sees either the old file or the complete new one.
absl::Status SaveCentroidArtifact(const CentroidArtifact& artifact, const std::string& path);

}  // namespace eldr

#endif  // ELDR_CORE_CENTROID_ARTIFACT_H_
