// Expert signatures: from a request's per-layer expert counts (captured during prefill) to the unit
// vector that is compared with worker centroids.
//
// Transform (docs/architecture.md, "Data flow"): keep the layers of the layer mask, multiply element-wise
// by the IDF weights (variant count_idf), flatten row-major [masked layer][expert], L2-normalise.
#ifndef ELDR_CORE_SIGNATURE_H_
#define ELDR_CORE_SIGNATURE_H_

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "eldr/core/column_selection.h"

namespace eldr {

enum class SignatureVariant {
  kCount,     // raw counts, no IDF
  kCountIdf,  // counts times IDF weights (default)
  kGateProb,  // sums of gate probabilities (float input), no IDF
};

// Accepts "count", "count_idf", "gate_prob" and the reference implementation's "gate_prob_all".
absl::StatusOr<SignatureVariant> ParseSignatureVariant(absl::string_view name);
// "count", "count_idf" or "gate_prob".
absl::string_view SignatureVariantName(SignatureVariant variant);

// Everything the transform needs. Produced by calibration, stored in the centroid artifact.
struct SignatureSpec {
  int layers = 0;   // MoE layers in the raw counts (L)
  int experts = 0;  // routed experts per layer (E)
  SignatureVariant variant = SignatureVariant::kCountIdf;
  // Sorted, distinct layer indices in [0, layers). Empty means every layer.
  std::vector<int> layer_mask;
  // For kCountIdf: |mask| * experts weights, row-major [masked layer][expert] (the artifact's
  // `sig_idf`). Empty for the other variants.
  std::vector<float> idf;

  // Number of kept layers: layer_mask.size(), or `layers` when the mask is empty.
  int masked_layers() const;
  // Dimension of the transformed vector: masked_layers() * experts.
  int dim() const;
  // The mask made explicit: layer_mask, or 0..layers-1 when it is empty.
  std::vector<int> EffectiveMask() const;
};

// Checks the invariants above; the message names the failed check.
absl::Status ValidateSignatureSpec(const SignatureSpec& spec);

// Whether signatures made under `a` are comparable with those made under `b`: same geometry,
// variant and effective layer mask, and IDF weights equal within a relative 1e-6 (they round-trip
// through JSON). A refit window, a persisted state or a replica's centroids are only meaningful
// within one transform.
bool SameTransform(const SignatureSpec& a, const SignatureSpec& b);

// Raw inputs, as they arrive on the wire. Views: the caller keeps the data alive during the call.
// The geometry (layers x experts) must equal the calibrated one, or be 0 x 0: "the calibrated
// geometry" (for payloads that carry bare bytes, such as the reference implementation's
// `eldr_sig`); the data's length must then match the calibrated geometry exactly.
struct CountsInt16Le {  // int16 little-endian, row-major [layers][experts] (the reference engine's bytes)
  int layers = 0;
  int experts = 0;
  absl::string_view bytes;
};
struct CountsInt32 {  // int32 values, row-major [layers][experts]
  int layers = 0;
  int experts = 0;
  absl::Span<const int32_t> values;
};
struct GateProbSums {  // float sums of gate probabilities, row-major [layers][experts]
  int layers = 0;
  int experts = 0;
  absl::Span<const float> values;
};
struct TransformedVector {  // already transformed, dim() floats; renormalised on input
  absl::Span<const float> values;
};
using SignatureInput = std::variant<CountsInt16Le, CountsInt32, GateProbSums, TransformedVector>;

namespace internal {
struct TransformLayout;  // signature.cc
}  // namespace internal

// An immutable, validated transform. Thread-safe: Apply is const and keeps no state.
class SignatureTransform {
 public:
  static absl::StatusOr<SignatureTransform> Create(SignatureSpec spec);

  const SignatureSpec& spec() const { return spec_; }
  int dim() const { return dim_; }

  // Writes the unit-norm transformed signature into `out` (exactly dim() floats).
  // Errors (all carry a RejectReason, see errors.h):
  //  - INVALID_ARGUMENT/kGeometry: layers, experts, byte length or vector length do not match;
  //  - INVALID_ARGUMENT/kNegativeCount, kNonFinite: bad values (also negative gate sums);
  //  - INVALID_ARGUMENT/kWrongEncoding: integer counts for gate_prob or float sums for a count variant;
  //  - FAILED_PRECONDITION/kZeroSignature: the input is all zeros on the masked layers; the router
  //    then falls back to load balancing.
  absl::Status Apply(const SignatureInput& input, absl::Span<float> out) const;

  // Like Apply (same inputs, same rejections), but returns the weighted vector before
  // normalisation and does not reject an all-zero result. For calibration, which needs the raw
  // weighted vectors.
  absl::Status Weighted(const SignatureInput& input, absl::Span<float> out) const;

  // Whether ApplyKept can serve `selection`: a count or count_idf transform, a selection of dim()
  // columns, and either every layer in the mask or layers of whole 16-column chunks (experts a
  // multiple of 16).
  bool SupportsApplyKept(const ColumnSelection& selection) const;

  // The fused form of Apply for int16 counts and a scorer that reads only some columns
  // (CentroidIndex::SearchKept): writes the columns of `selection` of the signature before
  // normalisation, in order, into `out` (at least selection.kept + 16 floats: the vector kernels
  // store whole registers), and returns the factor that normalises them: the unit-norm signature's
  // kept values are out[i] * scale, each product rounded to float (SearchKept scales them on its
  // way through them, instead of a pass of its own here), with their norm (<= 1) and largest value
  // (>= 0). One pass over the counts: the full-dimension vector is never written. Validation and
  // rejections are Apply's; the scaled values are Apply's up to float rounding (the norm is summed
  // in another order). Requires SupportsApplyKept(selection) (FAILED_PRECONDITION otherwise).
  struct KeptValues {
    float scale = 1;  // the unit signature's values are out[i] * scale
    float norm = 0;   // of the scaled values
    float max = 0;    // the largest scaled value
  };
  absl::StatusOr<KeptValues> ApplyKept(const CountsInt16Le& counts, const ColumnSelection& selection,
                                       absl::Span<float> out) const;

 private:
  explicit SignatureTransform(SignatureSpec spec);
  // What the converters read of this transform (see signature.cc).
  internal::TransformLayout Layout() const;
  // Validates `input`, writes the weighted (unnormalised) vector into `out` and its squared norm.
  absl::Status Convert(const SignatureInput& input, absl::Span<float> out, double* sum_of_squares) const;

  SignatureSpec spec_;
  int dim_ = 0;
  std::vector<int> mask_;      // EffectiveMask(), cached
  std::vector<int> unmasked_;  // layers outside the mask (still checked for bad values)
  bool all_layers_ = false;    // mask keeps every layer: one contiguous pass
};

// IDF weights from N calibration count matrices [N][layers][experts] (row-major, int32):
// idf[l][e] = log((N + 1) / (df[l][e] + 1)), df = requests with a non-zero count at (l, e).
// Returns all layers ([layers][experts]); the caller keeps the rows of its mask. Returns an empty
// vector when the arguments are inconsistent (counts.size() != n * layers * experts, n < 0, or a
// non-positive geometry).
std::vector<float> ComputeIdf(absl::Span<const int32_t> counts, int n, int layers, int experts);

}  // namespace eldr

#endif  // ELDR_CORE_SIGNATURE_H_
