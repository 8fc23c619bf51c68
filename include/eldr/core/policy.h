// Routing policies: given the candidates' locality scores and every worker's load, pick one worker.
//
// All policies share one interface and are selectable by name. They are pure decision functions
// over a snapshot (PolicyInput); the Router owns the state. Not thread-safe by themselves: the
// Router serialises Pick calls (rr counters and the seeded generator live in the policy).
#ifndef ELDR_CORE_POLICY_H_
#define ELDR_CORE_POLICY_H_

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace eldr {

enum class PolicyKind { kEldr, kRoundRobin, kRandom, kJsq, kP2c };
inline constexpr int kPolicyKinds = 5;

// Names: "eldr", "rr", "random", "jsq", "p2c".
absl::StatusOr<PolicyKind> ParsePolicyKind(absl::string_view name);
absl::string_view PolicyKindName(PolicyKind kind);

// Why a decision did not follow the requested policy. Labels are stable metric label values.
enum class FallbackReason {
  kNone,
  kNoSignature,         // eldr without a signature in the request -> jsq
  kZeroSignature,       // signature all zero after the layer mask -> jsq
  kNoCentroids,         // no centroids loaded -> jsq
  kNoEligibleCentroid,  // no routable worker has a centroid -> jsq
  kOverload,            // every band member at its in-flight limit -> least loaded overall (spill)
  kLoadGap,             // the band's least loaded member too far above the least loaded worker -> spill
  kAllUnhealthy,        // every worker unhealthy -> route by leases among all non-draining (fail open)
};
absl::string_view FallbackReasonLabel(FallbackReason reason);  // "", "no_signature", ...

// One worker as a policy sees it.
struct WorkerLoadView {
  double load = 0;           // effective in-flight requests (leases + reported snapshot)
  double capacity = 1;       // capacity weight (> 0); eldr and jsq compare load / capacity
  int64_t max_inflight = 0;  // 0: no limit; otherwise load >= max_inflight means "at limit"
  bool eligible = true;      // routable (not draining, healthy, or fail-open)
};

// A locality candidate: a worker (index into PolicyInput::workers) and its centroid's exact score.
struct WorkerScore {
  int worker = 0;
  float score = 0.f;
};

struct PolicyInput {
  absl::Span<const WorkerLoadView> workers;
  // Locality candidates for eldr. Workers without a centroid are absent. Empty when there is no
  // usable signature.
  absl::Span<const WorkerScore> candidates;
  double tau = 0.1;
  // Why `candidates` is empty, reported by eldr as its fallback (it then decides as jsq): the caller
  // knows whether the request had no signature, a zero one, or no centroids were loaded.
  FallbackReason no_scores_reason = FallbackReason::kNoSignature;
  // eldr's load-gap guard (RouterOptions::max_load_gap): > 0 and the band's pick carries more than
  // this much load/capacity above the least loaded eligible worker below its limit -> that worker
  // instead (fallback kLoadGap, used = jsq). 0: off.
  double max_load_gap = 0;
};

// eldr: the band is every eligible candidate whose score >= best - tau (best = the highest score
// among eligible candidates; band_size counts them); members at their in-flight limit cannot be
// picked; the least load/capacity member wins, ties by TieBreak (below). If every band member is at its limit, the
// request spills to the least loaded eligible worker overall (fallback kOverload, used = jsq). With max_load_gap > 0,
// a pick whose load/capacity exceeds the least loaded eligible worker's (below its limit) by more than the gap spills
// to that worker too (fallback kLoadGap, used = jsq). If `candidates` is
// empty, fallback = no_scores_reason; if no candidate is eligible, fallback = kNoEligibleCentroid; both decide as jsq.
// rr: next eligible worker in index order. random: uniform over eligible workers. jsq: least load/capacity, ties at
// random. p2c: two distinct eligible workers at random, the lower load/capacity wins (ties at random); a single
// eligible worker is picked directly.
struct PolicyDecision {
  int worker = -1;            // index into PolicyInput::workers; -1 when none is eligible
  float best_similarity = 0;  // eldr: best score among eligible candidates; 0 otherwise
  int band_size = 0;          // eldr: eligible workers within tau of the best; 0 otherwise
  FallbackReason fallback = FallbackReason::kNone;
  PolicyKind used = PolicyKind::kEldr;  // the policy that actually decided (jsq on fallback)
};

class RoutingPolicy {
 public:
  virtual ~RoutingPolicy() = default;
  virtual PolicyKind kind() const = 0;
  // Picks among eligible workers. Returns worker = -1 only when no worker is eligible.
  virtual PolicyDecision Pick(const PolicyInput& input) = 0;
};

// How a policy chooses among workers of equal least load (load / capacity within a relative
// 1e-9): in the locality band, in jsq, in the overload spill and between p2c's two draws.
//  - kRandom (the default): uniformly at random. In-flight counts are small integers, so ties are
//    common; a fixed order would send every tie to the same worker and skew a band's load.
//  - kLowestIndex: the lowest worker index (pool order), the reference implementation's rule
//    (np.argmin over the band in worker order): use it to reproduce its decisions exactly.
enum class TieBreak { kRandom, kLowestIndex };
// "random", "lowest_index"; INVALID_ARGUMENT naming the accepted values.
absl::StatusOr<TieBreak> ParseTieBreak(absl::string_view name);
absl::string_view TieBreakName(TieBreak tie_break);

// `seed` seeds the tie-breaking / sampling generator (std::mt19937_64), so a decision sequence is
// reproducible for a given seed and input sequence.
std::unique_ptr<RoutingPolicy> MakePolicy(PolicyKind kind, uint64_t seed, TieBreak tie_break = TieBreak::kRandom);

}  // namespace eldr

#endif  // ELDR_CORE_POLICY_H_
