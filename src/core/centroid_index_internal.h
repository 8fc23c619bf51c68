// Statistics of the centroid index for its tests and eldr-microbench (private to eldr_core).
#ifndef ELDR_CORE_CENTROID_INDEX_INTERNAL_H_
#define ELDR_CORE_CENTROID_INDEX_INTERNAL_H_

#include <cstdint>

namespace eldr::internal {

// Rows the calling thread's searches have re-scored in fp32 so far (16-bit scans whose score was
// too close to the best score or to the band edge to decide).
int64_t RefinedRowsOnThisThread();

}  // namespace eldr::internal

#endif  // ELDR_CORE_CENTROID_INDEX_INTERNAL_H_
