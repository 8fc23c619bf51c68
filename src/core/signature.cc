#include "eldr/core/signature.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "core/scorer_kernels.h"
#include "core/signature_kernels.h"
#include "eldr/core/errors.h"

namespace eldr {
namespace internal {

// What the converters read of a SignatureTransform (borrowed from it, nothing copied).
struct TransformLayout {
  const SignatureSpec& spec;
  const internal::SignatureKernels& kernels;
  const float* weights;              // the IDF weights for count_idf, else nullptr
  bool wants_counts;                 // count variants take integer counts, gate_prob float sums
  const std::vector<int>& mask;      // the kept layers, ascending
  const std::vector<int>& unmasked;  // the other layers (still checked for bad values)
  bool all_layers;                   // mask keeps every layer: one contiguous pass
};

}  // namespace internal

namespace {

using internal::TransformLayout;

// Largest raw [layers][experts] matrix a transform accepts (16M cells, 32 MB of int16 counts):
// far above any real MoE model, low enough that sizes never overflow.
constexpr int64_t kMaxSignatureCells = int64_t{1} << 24;

bool AllFinite(const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(src[i])) return false;
  }
  return true;
}

int64_t FirstNonFinite(const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(src[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

int64_t FirstNegative(const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (src[i] < 0.f) return static_cast<int64_t>(i);
  }
  return -1;
}

// The geometry of an input matches the transform's: equal, or 0 x 0 ("the calibrated geometry").
bool GeometryMatches(int layers, int experts, const SignatureSpec& spec) {
  return (layers == spec.layers && experts == spec.experts) || (layers == 0 && experts == 0);
}

absl::Status GeometryError(absl::string_view what, int layers, int experts, const SignatureSpec& spec) {
  return InvalidInput(RejectReason::kGeometry,
                      absl::StrFormat("%s geometry %dx%d does not match the calibrated transform "
                                      "(%d layers x %d experts)",
                                      what, layers, experts, spec.layers, spec.experts));
}

absl::Status ZeroSignatureError() {
  return MakeInputError(absl::StatusCode::kFailedPrecondition, RejectReason::kZeroSignature,
                        "signature is all zeros on the layers of the layer mask");
}

// ---- SignatureTransform::Convert, one helper per input encoding ------------------------------
//
// On the routing path: each helper is called once, from Convert, and inlines into it. Every helper
// validates its input, writes the weighted (unnormalised) vector into `out` (dim() floats, already
// checked) and sets *sum_of_squares only on success.

// The rejection of integer counts sent to a gate_prob transform.
absl::Status IntegerCountsForGateProbError() {
  return InvalidInput(RejectReason::kWrongEncoding,
                      "integer counts sent to a gate_prob transform, which needs float "
                      "gate-probability sums");
}

// Squared L2 norm of `values` accumulated in double (when the float kernels overflow).
double SumOfSquaresInDouble(absl::Span<const float> values) {
  double sum = 0;
  for (size_t i = 0; i < values.size(); ++i) sum += static_cast<double>(values[i]) * values[i];
  return sum;
}

// Little-endian int16 counts: checks encoding, geometry and byte length.
absl::Status CheckInt16Counts(const TransformLayout& layout, const CountsInt16Le& counts) {
  const SignatureSpec& spec = layout.spec;
  if (!layout.wants_counts) return IntegerCountsForGateProbError();
  if (!GeometryMatches(counts.layers, counts.experts, spec)) {
    return GeometryError("int16 counts", counts.layers, counts.experts, spec);
  }
  if (counts.bytes.size() % 2 != 0) {
    return InvalidInput(
        RejectReason::kWrongEncoding,
        absl::StrFormat("int16 counts must have an even byte length, got %d bytes", counts.bytes.size()));
  }
  const size_t cells = static_cast<size_t>(spec.layers) * spec.experts;
  if (counts.bytes.size() != 2 * cells) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("int16 counts for %d layers x %d experts need %d bytes, "
                                        "got %d",
                                        spec.layers, spec.experts, 2 * cells, counts.bytes.size()));
  }
  return absl::OkStatus();
}

absl::Status NegativeInt16CountError() {
  return InvalidInput(RejectReason::kNegativeCount, "int16 counts contain a negative count");
}

// Little-endian int16 counts: checks them (CheckInt16Counts), converts the masked layers and
// rejects a negative count on any layer.
absl::Status ConvertInt16Counts(const TransformLayout& layout, const CountsInt16Le& counts, absl::Span<float> out,
                                double* sum_of_squares) {
  ELDR_RETURN_IF_ERROR(CheckInt16Counts(layout, counts));
  const size_t experts = static_cast<size_t>(layout.spec.experts);
  const size_t cells = static_cast<size_t>(layout.spec.layers) * experts;
  const internal::SignatureKernels& kernels = layout.kernels;
  const float* weights = layout.weights;
  const char* base = counts.bytes.data();
  int32_t bits = 0;
  double sum = 0;
  if (layout.all_layers) {
    sum = kernels.convert_int16(base, weights, out.data(), cells, &bits);
  } else {
    for (size_t j = 0; j < layout.mask.size(); ++j) {
      sum += kernels.convert_int16(base + 2 * experts * layout.mask[j], weights ? weights + j * experts : nullptr,
                                   out.data() + j * experts, experts, &bits);
    }
    for (int layer : layout.unmasked) bits |= kernels.or_int16(base + 2 * experts * layer, experts);
  }
  if (bits < 0) return NegativeInt16CountError();
  *sum_of_squares = sum;
  return absl::OkStatus();
}

// int32 counts: checks encoding, geometry and length, converts the masked layers and rejects a
// negative count on any layer.
absl::Status ConvertInt32Counts(const TransformLayout& layout, const CountsInt32& counts, absl::Span<float> out,
                                double* sum_of_squares) {
  const SignatureSpec& spec = layout.spec;
  const size_t experts = static_cast<size_t>(spec.experts);
  if (!layout.wants_counts) return IntegerCountsForGateProbError();
  if (!GeometryMatches(counts.layers, counts.experts, spec)) {
    return GeometryError("int32 counts", counts.layers, counts.experts, spec);
  }
  const size_t cells = static_cast<size_t>(spec.layers) * experts;
  if (counts.values.size() != cells) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("int32 counts for %d layers x %d experts need %d values, "
                                        "got %d",
                                        spec.layers, spec.experts, cells, counts.values.size()));
  }
  const internal::SignatureKernels& kernels = layout.kernels;
  const float* weights = layout.weights;
  const int32_t* base = counts.values.data();
  int32_t bits = 0;
  double sum = 0;
  if (layout.all_layers) {
    sum = kernels.convert_int32(base, weights, out.data(), cells, &bits);
  } else {
    for (size_t j = 0; j < layout.mask.size(); ++j) {
      sum += kernels.convert_int32(base + experts * layout.mask[j], weights ? weights + j * experts : nullptr,
                                   out.data() + j * experts, experts, &bits);
    }
    for (int layer : layout.unmasked) {
      const int32_t* row = base + experts * layer;
      for (size_t e = 0; e < experts; ++e) bits |= row[e];
    }
  }
  if (bits < 0) {
    return InvalidInput(RejectReason::kNegativeCount, "int32 counts contain a negative count");
  }
  *sum_of_squares = sum;
  return absl::OkStatus();
}

// Float gate-probability sums: checks encoding, geometry and length, converts the masked layers
// and rejects a non-finite value (first) or a negative one on any layer, naming its position.
absl::Status ConvertGateProbSums(const TransformLayout& layout, const GateProbSums& sums, absl::Span<float> out,
                                 double* sum_of_squares) {
  const SignatureSpec& spec = layout.spec;
  const size_t experts = static_cast<size_t>(spec.experts);
  if (layout.wants_counts) {
    return InvalidInput(RejectReason::kWrongEncoding,
                        absl::StrCat("float gate-probability sums sent to a ", SignatureVariantName(spec.variant),
                                     " transform, which needs integer counts"));
  }
  if (!GeometryMatches(sums.layers, sums.experts, spec)) {
    return GeometryError("gate-probability sums", sums.layers, sums.experts, spec);
  }
  const size_t cells = static_cast<size_t>(spec.layers) * experts;
  if (sums.values.size() != cells) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("gate-probability sums for %d layers x %d experts need %d "
                                        "values, got %d",
                                        spec.layers, spec.experts, cells, sums.values.size()));
  }
  const float* base = sums.values.data();
  int32_t negatives = 0;
  double sum = 0;
  if (layout.all_layers) {
    sum = layout.kernels.convert_float(base, out.data(), cells, &negatives);
  } else {
    for (size_t j = 0; j < layout.mask.size(); ++j) {
      sum +=
          layout.kernels.convert_float(base + experts * layout.mask[j], out.data() + j * experts, experts, &negatives);
    }
  }
  bool finite = std::isfinite(sum);
  for (int layer : layout.unmasked) finite = finite && AllFinite(base + experts * layer, experts);
  if (!finite) {
    const int64_t bad = FirstNonFinite(base, cells);
    if (bad >= 0) {
      return InvalidInput(RejectReason::kNonFinite,
                          absl::StrFormat("gate-probability sums: value at layer %d expert %d is "
                                          "%g",
                                          bad / spec.experts, bad % spec.experts, base[bad]));
    }
    // Finite values whose squares overflow float: take the norm in double.
    sum = SumOfSquaresInDouble(out);
  }
  for (int layer : layout.unmasked) {
    if (FirstNegative(base + experts * layer, experts) >= 0) ++negatives;
  }
  if (negatives > 0) {
    const int64_t bad = FirstNegative(base, cells);
    return InvalidInput(RejectReason::kNegativeCount,
                        absl::StrFormat("gate-probability sums: value at layer %d expert %d is "
                                        "negative (%g)",
                                        bad / spec.experts, bad % spec.experts, base[bad]));
  }
  *sum_of_squares = sum;
  return absl::OkStatus();
}

// An already transformed vector (any sign): checks its length and rejects a non-finite value.
absl::Status ConvertTransformedVector(const TransformLayout& layout, const TransformedVector& vector, int dim,
                                      absl::Span<float> out, double* sum_of_squares) {
  if (static_cast<int64_t>(vector.values.size()) != dim) {
    return InvalidInput(RejectReason::kGeometry, absl::StrFormat("transformed signature has %d values, the calibrated "
                                                                 "transform has dimension %d",
                                                                 vector.values.size(), dim));
  }
  int32_t negatives = 0;  // a transformed vector may have any sign
  double sum = layout.kernels.convert_float(vector.values.data(), out.data(), out.size(), &negatives);
  if (!std::isfinite(sum)) {
    const int64_t bad = FirstNonFinite(vector.values.data(), vector.values.size());
    if (bad >= 0) {
      return InvalidInput(RejectReason::kNonFinite,
                          absl::StrFormat("transformed signature: value %d is %g", bad, vector.values[bad]));
    }
    sum = SumOfSquaresInDouble(out);
  }
  *sum_of_squares = sum;
  return absl::OkStatus();
}

}  // namespace

// ---- SignatureVariant / SignatureSpec ---------------------------------------------------------

absl::StatusOr<SignatureVariant> ParseSignatureVariant(absl::string_view name) {
  if (name == "count") return SignatureVariant::kCount;
  if (name == "count_idf") return SignatureVariant::kCountIdf;
  if (name == "gate_prob" || name == "gate_prob_all") return SignatureVariant::kGateProb;
  return InvalidInput(
      RejectReason::kMalformed,
      absl::StrCat("unknown signature variant '", name, "' (expected count, count_idf, gate_prob or gate_prob_all)"));
}

absl::string_view SignatureVariantName(SignatureVariant variant) {
  switch (variant) {
    case SignatureVariant::kCount:
      return "count";
    case SignatureVariant::kCountIdf:
      return "count_idf";
    case SignatureVariant::kGateProb:
      return "gate_prob";
  }
  return "count";
}

int SignatureSpec::masked_layers() const { return layer_mask.empty() ? layers : static_cast<int>(layer_mask.size()); }

int SignatureSpec::dim() const { return masked_layers() * experts; }

std::vector<int> SignatureSpec::EffectiveMask() const {
  if (!layer_mask.empty()) return layer_mask;
  std::vector<int> all(layers > 0 ? layers : 0);
  for (int l = 0; l < static_cast<int>(all.size()); ++l) all[l] = l;
  return all;
}

bool SameTransform(const SignatureSpec& a, const SignatureSpec& b) {
  if (a.layers != b.layers || a.experts != b.experts || a.variant != b.variant) return false;
  if (a.EffectiveMask() != b.EffectiveMask() || a.idf.size() != b.idf.size()) return false;
  for (size_t i = 0; i < a.idf.size(); ++i) {
    if (std::abs(a.idf[i] - b.idf[i]) > 1e-6f * std::max(1.0f, std::abs(a.idf[i]))) return false;
  }
  return true;
}

absl::Status ValidateSignatureSpec(const SignatureSpec& spec) {
  if (spec.layers < 1) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrCat("signature spec: layers (L) must be >= 1, got ", spec.layers));
  }
  if (spec.experts < 1) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrCat("signature spec: experts (e) must be >= 1, got ", spec.experts));
  }
  if (int64_t{spec.layers} * spec.experts > kMaxSignatureCells) {
    return InvalidInput(RejectReason::kOversized,
                        absl::StrFormat("signature spec: %d layers x %d experts exceeds the limit "
                                        "of %d cells",
                                        spec.layers, spec.experts, kMaxSignatureCells));
  }
  for (size_t i = 0; i < spec.layer_mask.size(); ++i) {
    const int layer = spec.layer_mask[i];
    if (layer < 0 || layer >= spec.layers) {
      return InvalidInput(
          RejectReason::kGeometry,
          absl::StrFormat("signature spec: layer_mask[%d] = %d is outside [0, %d)", i, layer, spec.layers));
    }
    if (i > 0 && layer <= spec.layer_mask[i - 1]) {
      return InvalidInput(RejectReason::kMalformed,
                          absl::StrFormat("signature spec: layer_mask must be sorted and distinct, "
                                          "but layer_mask[%d] = %d follows %d",
                                          i, layer, spec.layer_mask[i - 1]));
    }
  }
  if (spec.variant == SignatureVariant::kCountIdf) {
    if (static_cast<int64_t>(spec.idf.size()) != spec.dim()) {
      return InvalidInput(RejectReason::kGeometry,
                          absl::StrFormat("signature spec: sig_idf has %d weights, expected "
                                          "|layer_mask| * experts = %d * %d = %d",
                                          spec.idf.size(), spec.masked_layers(), spec.experts, spec.dim()));
    }
    bool any_positive = false;
    for (size_t i = 0; i < spec.idf.size(); ++i) {
      const float w = spec.idf[i];
      if (!std::isfinite(w) || w < 0.f) {
        return InvalidInput(std::isfinite(w) ? RejectReason::kMalformed : RejectReason::kNonFinite,
                            absl::StrFormat("signature spec: sig_idf[%d] = %g is not a finite "
                                            "non-negative weight",
                                            i, w));
      }
      any_positive |= w > 0.f;
    }
    if (!any_positive) {
      return InvalidInput(RejectReason::kMalformed,
                          "signature spec: sig_idf is all zeros, so every signature would vanish");
    }
  } else if (!spec.idf.empty()) {
    return InvalidInput(RejectReason::kMalformed,
                        absl::StrCat("signature spec: sig_idf is only valid for variant count_idf, "
                                     "not ",
                                     SignatureVariantName(spec.variant)));
  }
  return absl::OkStatus();
}

// ---- SignatureTransform ----------------------------------------------------------------------

SignatureTransform::SignatureTransform(SignatureSpec spec)
    : spec_(std::move(spec)), dim_(spec_.dim()), mask_(spec_.EffectiveMask()) {
  all_layers_ = static_cast<int>(mask_.size()) == spec_.layers;
  std::vector<bool> kept(spec_.layers, false);
  for (int layer : mask_) kept[layer] = true;
  for (int l = 0; l < spec_.layers; ++l) {
    if (!kept[l]) unmasked_.push_back(l);
  }
}

absl::StatusOr<SignatureTransform> SignatureTransform::Create(SignatureSpec spec) {
  ELDR_RETURN_IF_ERROR(ValidateSignatureSpec(spec));
  return SignatureTransform(std::move(spec));
}

absl::Status SignatureTransform::Apply(const SignatureInput& input, absl::Span<float> out) const {
  double sum_of_squares = 0;
  ELDR_RETURN_IF_ERROR(Convert(input, out, &sum_of_squares));
  if (!(sum_of_squares > 0)) return ZeroSignatureError();
  // The kernels square in float: components below ~1e-19 underflow and a sum past ~1e38
  // overflows, so outside this range the sum is not the norm. Rare (hostile or degenerate
  // inputs): rescale by the largest component and take the norm in double.
  constexpr double kFloatSquaresExactFrom = 1e-30;
  constexpr double kFloatSquaresExactTo = 1e36;
  if (!(sum_of_squares >= kFloatSquaresExactFrom && sum_of_squares <= kFloatSquaresExactTo)) {
    float largest = 0;
    for (float v : out) largest = std::max(largest, std::fabs(v));
    if (!(largest > 0)) return ZeroSignatureError();
    if (!std::isfinite(largest)) {
      return InvalidInput(RejectReason::kNonFinite,
                          "the weighted signature overflows float (counts times IDF weights)");
    }
    sum_of_squares = 0;
    for (float& v : out) {
      v /= largest;
      sum_of_squares += static_cast<double>(v) * v;
    }
  }
  const float factor = static_cast<float>(1.0 / std::sqrt(sum_of_squares));
  internal::BestSignatureKernels().scale(out.data(), out.size(), factor, out.data());
  return absl::OkStatus();
}

absl::Status SignatureTransform::Weighted(const SignatureInput& input, absl::Span<float> out) const {
  double sum_of_squares = 0;
  return Convert(input, out, &sum_of_squares);
}

TransformLayout SignatureTransform::Layout() const {
  return TransformLayout{spec_,
                         internal::BestSignatureKernels(),
                         spec_.variant == SignatureVariant::kCountIdf ? spec_.idf.data() : nullptr,
                         spec_.variant != SignatureVariant::kGateProb,
                         mask_,
                         unmasked_,
                         all_layers_};
}

absl::Status SignatureTransform::Convert(const SignatureInput& input, absl::Span<float> out,
                                         double* sum_of_squares) const {
  if (static_cast<int64_t>(out.size()) != dim_) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("output buffer holds %d floats, the transform produces %d", out.size(), dim_));
  }
  const TransformLayout layout = Layout();
  if (const auto* counts = std::get_if<CountsInt16Le>(&input)) {
    return ConvertInt16Counts(layout, *counts, out, sum_of_squares);
  }
  if (const auto* counts = std::get_if<CountsInt32>(&input)) {
    return ConvertInt32Counts(layout, *counts, out, sum_of_squares);
  }
  if (const auto* sums = std::get_if<GateProbSums>(&input)) {
    return ConvertGateProbSums(layout, *sums, out, sum_of_squares);
  }
  return ConvertTransformedVector(layout, std::get<TransformedVector>(input), dim_, out, sum_of_squares);
}

bool SignatureTransform::SupportsApplyKept(const ColumnSelection& selection) const {
  const size_t chunks = static_cast<size_t>((dim_ + 15) / 16);
  return spec_.variant != SignatureVariant::kGateProb && selection.dim == dim_ && selection.masks.size() == chunks &&
         selection.offsets.size() == chunks && selection.kept >= 0 && selection.kept <= dim_ &&
         (all_layers_ || spec_.experts % 16 == 0);
}

absl::StatusOr<SignatureTransform::KeptValues> SignatureTransform::ApplyKept(const CountsInt16Le& counts,
                                                                             const ColumnSelection& selection,
                                                                             absl::Span<float> out) const {
  if (!SupportsApplyKept(selection)) {
    return absl::FailedPreconditionError(absl::StrCat("ApplyKept: the ", SignatureVariantName(spec_.variant),
                                                      " transform cannot write this column selection"));
  }
  if (static_cast<int64_t>(out.size()) < int64_t{selection.kept} + 16) {
    return InvalidInput(RejectReason::kGeometry, absl::StrFormat("ApplyKept: output buffer holds %d floats, needs %d",
                                                                 out.size(), int64_t{selection.kept} + 16));
  }
  const TransformLayout layout = Layout();
  ELDR_RETURN_IF_ERROR(CheckInt16Counts(layout, counts));
  const internal::ScorerKernels& kernels = internal::BestKernels();
  const int experts = spec_.experts;
  const char* base = counts.bytes.data();
  int32_t bits = 0;
  double sum = 0;
  float kept_sum = 0, kept_max = 0;
  if (all_layers_) {
    sum = kernels.convert_gather_int16(base, layout.weights, dim_, selection.masks.data(), selection.offsets.data(),
                                       out.data(), &kept_sum, &kept_max, &bits);
  } else {
    // Layer j of the mask is columns [j * experts, (j + 1) * experts): whole chunks.
    for (size_t j = 0; j < mask_.size(); ++j) {
      const size_t first_chunk = j * experts / 16;
      sum += kernels.convert_gather_int16(base + 2 * static_cast<size_t>(experts) * mask_[j],
                                          layout.weights ? layout.weights + j * experts : nullptr, experts,
                                          selection.masks.data() + first_chunk, selection.offsets.data() + first_chunk,
                                          out.data(), &kept_sum, &kept_max, &bits);
    }
    for (int layer : unmasked_)
      bits |= layout.kernels.or_int16(base + 2 * static_cast<size_t>(experts) * layer, experts);
  }
  if (bits < 0) return NegativeInt16CountError();
  if (!(sum > 0)) return ZeroSignatureError();
  // Outside the range where float squares are exact enough (see Apply): Apply's rescaled path,
  // then the selected columns of its result. Not reached by int16 counts and finite IDF weights
  // below ~1e13; kept for hostile specs.
  constexpr double kFloatSquaresExactFrom = 1e-30;
  constexpr double kFloatSquaresExactTo = 1e36;
  if (!(sum >= kFloatSquaresExactFrom && sum <= kFloatSquaresExactTo)) {
    std::vector<float> whole(dim_);
    ELDR_RETURN_IF_ERROR(Apply(counts, absl::MakeSpan(whole)));
    double kept_norm2 = 0;
    float largest = 0;
    for (int c = 0, at = 0; c < static_cast<int>(selection.masks.size()); ++c) {
      for (int bit = 0; bit < 16; ++bit) {
        if ((selection.masks[c] >> bit) & 1) {
          const float v = whole[16 * c + bit];
          out[at++] = v;
          kept_norm2 += static_cast<double>(v) * v;
          largest = std::max(largest, v);
        }
      }
    }
    return KeptValues{1.f, static_cast<float>(std::sqrt(kept_norm2)), largest};
  }
  // The scaling is left to the scorer (see the header). Rounding is monotonic: the largest scaled
  // value is the scaled largest value.
  const double inverse_norm = 1.0 / std::sqrt(sum);
  const float factor = static_cast<float>(inverse_norm);
  return KeptValues{factor, static_cast<float>(std::sqrt(std::max(0.0, static_cast<double>(kept_sum))) * inverse_norm),
                    kept_max * factor};
}

// ---- IDF ---------------------------------------------------------------------------------------

std::vector<float> ComputeIdf(absl::Span<const int32_t> counts, int n, int layers, int experts) {
  if (n < 0 || layers < 1 || experts < 1 || static_cast<int64_t>(counts.size()) != int64_t{n} * layers * experts) {
    return {};
  }
  const size_t cells = static_cast<size_t>(layers) * experts;
  std::vector<int64_t> document_frequency(cells, 0);
  for (int r = 0; r < n; ++r) {
    const int32_t* row = counts.data() + static_cast<size_t>(r) * cells;
    for (size_t c = 0; c < cells; ++c) document_frequency[c] += row[c] != 0 ? 1 : 0;
  }
  std::vector<float> idf(cells);
  for (size_t c = 0; c < cells; ++c) {
    idf[c] = static_cast<float>(
        std::log((static_cast<double>(n) + 1.0) / (static_cast<double>(document_frequency[c]) + 1.0)));
  }
  return idf;
}

}  // namespace eldr
