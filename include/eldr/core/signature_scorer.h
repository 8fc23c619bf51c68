// A route's scoring: the raw signature of a request, transformed and scored against the worker
// centroids.
//
// Two paths, with the same results (the same rejections, and decisions those of fp32 scoring; see
// CentroidIndexOptions::band_tau):
//  - fused, for int16 counts of a count or count_idf transform against an index with a kept-column
//    search (CentroidIndex::kept_columns: the exact and reduced indexes, whether they drop columns
//    or not; with count_idf every expert all calibration requests used has IDF 0 and is dropped,
//    and where none is, the fused path still saves Apply's normalising pass and Search's norm
//    pass): SignatureTransform::ApplyKept writes only the kept columns of the
//    signature, in one pass over the counts, with the factor that normalises them, and
//    CentroidIndex::SearchKept scales and scores them (the 8-bit scan scales on its way). The
//    full-dimension signature is built only if someone asks for it (Signature), which the online
//    refit window does for the few signatures it samples.
//  - otherwise SignatureTransform::Apply, then CentroidIndex::Search.
// Measured in docs/benchmarks.md, "Full route decision".
#ifndef ELDR_CORE_SIGNATURE_SCORER_H_
#define ELDR_CORE_SIGNATURE_SCORER_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "eldr/core/centroid_index.h"
#include "eldr/core/signature.h"

namespace eldr {

// Immutable; Score and Signature are const and thread-safe given per-thread Buffers. The transform
// and the index must outlive the scorer.
class SignatureScorer {
 public:
  SignatureScorer(const SignatureTransform& transform, const CentroidIndex& index);

  // Whether int16 counts take the fused path.
  bool fused() const { return fused_; }

  // Per-call buffers (one per thread, reused: no allocation in steady state).
  struct Buffers {
    std::vector<float> kept_query;  // fused path: the kept columns, before normalisation
    std::vector<float> signature;   // the unit signature, once built
    bool signature_ready = false;   // `signature` holds the input last scored
  };

  // Validates and transforms `input` and scores it: fills `out` as CentroidIndex::Search does.
  // Errors: SignatureTransform::Apply's rejections as they are (FAILED_PRECONDITION kZeroSignature
  // among them: the router falls back to load balancing); INTERNAL "centroid index search
  // failed: ..." when the index fails.
  absl::Status Score(const SignatureInput& input, Buffers* buffers, std::vector<ScoredRow>* out) const;

  // Validates and transforms `input` only (Apply), into buffers->signature.
  absl::Status Transform(const SignatureInput& input, Buffers* buffers) const;

  // The unit-norm signature of `input`, which the last successful Score or Transform with
  // `buffers` accepted: built now if the fused path skipped it. Valid until `buffers` is next used.
  absl::Span<const float> Signature(const SignatureInput& input, Buffers* buffers) const;

 private:
  const SignatureTransform& transform_;
  const CentroidIndex& index_;
  const ColumnSelection* kept_columns_ = nullptr;  // non-null iff fused_
  bool fused_ = false;
};

}  // namespace eldr

#endif  // ELDR_CORE_SIGNATURE_SCORER_H_
