#include "eldr/core/signature_scorer.h"

#include <variant>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace eldr {

SignatureScorer::SignatureScorer(const SignatureTransform& transform, const CentroidIndex& index)
    : transform_(transform), index_(index) {
  const ColumnSelection* kept = index.kept_columns();
  if (kept != nullptr && transform.SupportsApplyKept(*kept)) {
    kept_columns_ = kept;
    fused_ = true;
  }
}

absl::Status SignatureScorer::Transform(const SignatureInput& input, Buffers* buffers) const {
  buffers->signature_ready = false;
  buffers->signature.resize(static_cast<size_t>(transform_.dim()));
  ELDR_RETURN_IF_ERROR(transform_.Apply(input, absl::MakeSpan(buffers->signature)));
  buffers->signature_ready = true;
  return absl::OkStatus();
}

absl::Status SignatureScorer::Score(const SignatureInput& input, Buffers* buffers, std::vector<ScoredRow>* out) const {
  absl::Status searched;
  const auto* counts = std::get_if<CountsInt16Le>(&input);
  if (fused_ && counts != nullptr) {
    buffers->signature_ready = false;
    buffers->kept_query.resize(static_cast<size_t>(kept_columns_->kept) + 16);
    ELDR_ASSIGN_OR_RETURN(const SignatureTransform::KeptValues kept,
                          transform_.ApplyKept(*counts, *kept_columns_, absl::MakeSpan(buffers->kept_query)));
    searched = index_.SearchKept(buffers->kept_query, kept.scale, kept.norm, kept.max, out);
  } else {
    ELDR_RETURN_IF_ERROR(Transform(input, buffers));
    searched = index_.Search(buffers->signature, out);
  }
  if (!searched.ok()) return absl::InternalError(absl::StrCat("centroid index search failed: ", searched.message()));
  return absl::OkStatus();
}

absl::Span<const float> SignatureScorer::Signature(const SignatureInput& input, Buffers* buffers) const {
  if (!buffers->signature_ready && !Transform(input, buffers).ok()) return {};
  return buffers->signature;
}

}  // namespace eldr
