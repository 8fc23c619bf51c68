// The columns of a signature that a centroid index scores (CentroidIndex::kept_columns), in the
// form the fused transform writes them (SignatureTransform::ApplyKept).
#ifndef ELDR_CORE_COLUMN_SELECTION_H_
#define ELDR_CORE_COLUMN_SELECTION_H_

#include <cstdint>

#include "absl/types/span.h"

namespace eldr {

// A subset of the columns [0, dim) of a transformed signature, ascending. A view: the index that
// owns it keeps it alive (as long as the index).
struct ColumnSelection {
  int dim = 0;
  // Bit i % 16 of masks[i / 16]: column i is kept. ceil(dim / 16) words; bits at or beyond dim
  // are clear.
  absl::Span<const uint16_t> masks;
  // offsets[c]: kept columns before chunk c (columns 16c .. 16c + 15), one per word of masks.
  absl::Span<const int> offsets;
  int kept = 0;  // number of kept columns
};

}  // namespace eldr

#endif  // ELDR_CORE_COLUMN_SELECTION_H_
