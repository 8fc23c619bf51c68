// Statistics of the centroid index for its tests and eldr-microbench (private to eldr_core).
#ifndef ELDR_CORE_CENTROID_INDEX_INTERNAL_H_
#define ELDR_CORE_CENTROID_INDEX_INTERNAL_H_

#include <cstdint>
#include <utility>
#include <vector>

namespace eldr::internal {

// Rows the calling thread's searches have re-scored in fp32 so far (16-bit scans whose score was
// too close to the best score or to the band edge to decide).
int64_t RefinedRowsOnThisThread();

// Rearranges pairs[0, n) so that pairs[0, k) holds k pairs with the highest scores (.first; ties
// broken arbitrarily) and pairs[k, n) the rest, in no particular order; 0 <= k <= n, no score
// NaN. What std::nth_element does, but its partitions are branch-free copies into `buffer`
// (resized as needed): nth_element's comparisons of near-random scores mispredict about half the
// time, and selecting the large-pool candidates that way was an eighth of a K = 1,024 decision.
// Median-of-three pivots; after 2 log2(n) + 4 rounds without converging (only crafted input) it
// finishes with std::nth_element, so the worst case stays O(n log n).
void SelectBest(std::pair<float, int>* pairs, int n, int k, std::vector<std::pair<float, int>>* buffer);

}  // namespace eldr::internal

#endif  // ELDR_CORE_CENTROID_INDEX_INTERNAL_H_
