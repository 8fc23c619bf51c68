#include "eldr/core/policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "eldr/core/errors.h"

namespace eldr {
namespace {

// Smallest capacity weight used in a division; WorkerSpec validation keeps real ones > 0.
constexpr double kMinCapacity = 1e-9;

double NormalisedLoad(const WorkerLoadView& worker) { return worker.load / std::max(worker.capacity, kMinCapacity); }

bool AtLimit(const WorkerLoadView& worker) {
  return worker.max_inflight > 0 && worker.load >= static_cast<double>(worker.max_inflight);
}

// Loads are sums of small counts and reported doubles: treat values this close as a tie.
bool SameLoad(double a, double b) {
  return std::abs(a - b) <= 1e-9 * std::max(1.0, std::max(std::abs(a), std::abs(b)));
}

// A policy's tie-breaking: its seeded generator and the rule (TieBreak).
struct TieBreaker {
  TieBreaker(uint64_t seed, TieBreak rule) : rng(seed), rule(rule) {}
  std::mt19937_64 rng;
  TieBreak rule;
};

// Keeps the least normalised load seen so far. Ties: kRandom breaks them uniformly at random
// (reservoir sampling: the n-th tied worker replaces the pick with probability 1/n; the generator
// is drawn from only when there is a tie, so untied decisions do not advance it); kLowestIndex
// keeps the lowest worker index, whatever order the workers are offered in.
class LeastLoaded {
 public:
  explicit LeastLoaded(TieBreaker* ties) : ties_(ties) {}

  void Offer(int index, double load) {
    if (pick_ < 0 || (load < best_ && !SameLoad(load, best_))) {
      pick_ = index;
      best_ = load;
      tied_ = 1;
      return;
    }
    if (!SameLoad(load, best_)) return;
    if (ties_->rule == TieBreak::kLowestIndex) {
      pick_ = std::min(pick_, index);
      return;
    }
    ++tied_;
    if (std::uniform_int_distribution<uint64_t>(0, tied_ - 1)(ties_->rng) == 0) pick_ = index;
  }
  int pick() const { return pick_; }

 private:
  TieBreaker* ties_;
  int pick_ = -1;
  double best_ = 0;
  uint64_t tied_ = 0;
};

int EligibleCount(absl::Span<const WorkerLoadView> workers) {
  int n = 0;
  for (const WorkerLoadView& w : workers) n += w.eligible ? 1 : 0;
  return n;
}

// The k-th eligible worker (0-based), or -1.
int NthEligible(absl::Span<const WorkerLoadView> workers, int k) {
  for (int i = 0; i < static_cast<int>(workers.size()); ++i) {
    if (!workers[i].eligible) continue;
    if (k-- == 0) return i;
  }
  return -1;
}

int PickJsq(absl::Span<const WorkerLoadView> workers, TieBreaker* ties) {
  LeastLoaded least(ties);
  for (int i = 0; i < static_cast<int>(workers.size()); ++i) {
    if (workers[i].eligible) least.Offer(i, NormalisedLoad(workers[i]));
  }
  return least.pick();
}

// The overload spill: least loaded among eligible workers below their limit, or among every
// eligible worker when all are at their limit (the request still has to go somewhere).
int PickSpill(absl::Span<const WorkerLoadView> workers, TieBreaker* ties) {
  LeastLoaded below_limit(ties);
  for (int i = 0; i < static_cast<int>(workers.size()); ++i) {
    if (workers[i].eligible && !AtLimit(workers[i])) {
      below_limit.Offer(i, NormalisedLoad(workers[i]));
    }
  }
  if (below_limit.pick() >= 0) return below_limit.pick();
  return PickJsq(workers, ties);
}

class EldrPolicy final : public RoutingPolicy {
 public:
  EldrPolicy(uint64_t seed, TieBreak rule) : ties_(seed, rule) {}
  PolicyKind kind() const override { return PolicyKind::kEldr; }

  PolicyDecision Pick(const PolicyInput& input) override {
    PolicyDecision decision;
    decision.used = PolicyKind::kEldr;
    const absl::Span<const WorkerLoadView> workers = input.workers;
    const int n = static_cast<int>(workers.size());

    float best = -std::numeric_limits<float>::infinity();
    bool any_candidate = false;
    for (const WorkerScore& candidate : input.candidates) {
      if (candidate.worker < 0 || candidate.worker >= n || !workers[candidate.worker].eligible) continue;
      any_candidate = true;
      best = std::max(best, candidate.score);
    }
    if (!any_candidate) {
      decision.fallback = input.candidates.empty() ? input.no_scores_reason : FallbackReason::kNoEligibleCentroid;
      if (decision.fallback == FallbackReason::kNone) decision.fallback = FallbackReason::kNoSignature;
      decision.used = PolicyKind::kJsq;
      decision.worker = PickJsq(workers, &ties_);
      return decision;
    }

    // Scores are floats; the band edge is compared in double so tau = 0 keeps exactly the best.
    const double edge = static_cast<double>(best) - std::max(0.0, input.tau);
    LeastLoaded least(&ties_);
    int band_size = 0;
    for (const WorkerScore& candidate : input.candidates) {
      if (candidate.worker < 0 || candidate.worker >= n) continue;
      const WorkerLoadView& worker = workers[candidate.worker];
      if (!worker.eligible || static_cast<double>(candidate.score) < edge) continue;
      ++band_size;
      if (!AtLimit(worker)) least.Offer(candidate.worker, NormalisedLoad(worker));
    }
    decision.best_similarity = best;
    decision.band_size = band_size;
    if (least.pick() >= 0) {
      decision.worker = least.pick();
      if (input.max_load_gap > 0) {
        // Locality stops paying once the band's workers queue far behind the rest of the pool (a
        // domain surging past its zone): the gap bounds how far. The lightest load is found without
        // the tie breaker, so decisions that do not spill draw exactly what they would without it.
        double lightest = std::numeric_limits<double>::infinity();
        for (const WorkerLoadView& worker : workers) {
          if (worker.eligible && !AtLimit(worker)) lightest = std::min(lightest, NormalisedLoad(worker));
        }
        if (NormalisedLoad(workers[decision.worker]) - lightest > input.max_load_gap) {
          decision.worker = PickSpill(workers, &ties_);
          decision.fallback = FallbackReason::kLoadGap;
          decision.used = PolicyKind::kJsq;
        }
      }
      return decision;
    }
    decision.fallback = FallbackReason::kOverload;
    decision.used = PolicyKind::kJsq;
    decision.worker = PickSpill(workers, &ties_);
    return decision;
  }

 private:
  TieBreaker ties_;
};

class RoundRobinPolicy final : public RoutingPolicy {
 public:
  PolicyKind kind() const override { return PolicyKind::kRoundRobin; }

  PolicyDecision Pick(const PolicyInput& input) override {
    PolicyDecision decision;
    decision.used = PolicyKind::kRoundRobin;
    const int n = static_cast<int>(input.workers.size());
    for (int step = 0; step < n; ++step) {
      const int i = static_cast<int>((next_ + step) % static_cast<uint64_t>(n));
      if (input.workers[i].eligible) {
        decision.worker = i;
        next_ = static_cast<uint64_t>(i) + 1;
        break;
      }
    }
    return decision;
  }

 private:
  uint64_t next_ = 0;
};

class RandomPolicy final : public RoutingPolicy {
 public:
  explicit RandomPolicy(uint64_t seed) : rng_(seed) {}
  PolicyKind kind() const override { return PolicyKind::kRandom; }

  PolicyDecision Pick(const PolicyInput& input) override {
    PolicyDecision decision;
    decision.used = PolicyKind::kRandom;
    const int eligible = EligibleCount(input.workers);
    if (eligible == 0) return decision;
    const int k = static_cast<int>(std::uniform_int_distribution<int>(0, eligible - 1)(rng_));
    decision.worker = NthEligible(input.workers, k);
    return decision;
  }

 private:
  std::mt19937_64 rng_;
};

class JsqPolicy final : public RoutingPolicy {
 public:
  JsqPolicy(uint64_t seed, TieBreak rule) : ties_(seed, rule) {}
  PolicyKind kind() const override { return PolicyKind::kJsq; }

  PolicyDecision Pick(const PolicyInput& input) override {
    PolicyDecision decision;
    decision.used = PolicyKind::kJsq;
    decision.worker = PickJsq(input.workers, &ties_);
    return decision;
  }

 private:
  TieBreaker ties_;
};

class P2cPolicy final : public RoutingPolicy {
 public:
  P2cPolicy(uint64_t seed, TieBreak rule) : ties_(seed, rule) {}
  PolicyKind kind() const override { return PolicyKind::kP2c; }

  PolicyDecision Pick(const PolicyInput& input) override {
    PolicyDecision decision;
    decision.used = PolicyKind::kP2c;
    const int eligible = EligibleCount(input.workers);
    if (eligible == 0) return decision;
    if (eligible == 1) {
      decision.worker = NthEligible(input.workers, 0);
      return decision;
    }
    // Two distinct draws: the second is uniform over the other eligible - 1 workers.
    const int first = std::uniform_int_distribution<int>(0, eligible - 1)(ties_.rng);
    int second = std::uniform_int_distribution<int>(0, eligible - 2)(ties_.rng);
    if (second >= first) ++second;
    const int a = NthEligible(input.workers, first);
    const int b = NthEligible(input.workers, second);
    // The lower load wins, ties by the tie-break rule (b offered first: a random tie's draw of 0
    // picks a, the first draw).
    LeastLoaded least(&ties_);
    least.Offer(b, NormalisedLoad(input.workers[b]));
    least.Offer(a, NormalisedLoad(input.workers[a]));
    decision.worker = least.pick();
    return decision;
  }

 private:
  TieBreaker ties_;
};

}  // namespace

absl::StatusOr<PolicyKind> ParsePolicyKind(absl::string_view name) {
  if (name == "eldr") return PolicyKind::kEldr;
  if (name == "rr") return PolicyKind::kRoundRobin;
  if (name == "random") return PolicyKind::kRandom;
  if (name == "jsq") return PolicyKind::kJsq;
  if (name == "p2c") return PolicyKind::kP2c;
  return InvalidInput(RejectReason::kMalformed,
                      absl::StrCat("unknown routing policy '", name, "' (expected eldr, rr, random, jsq or p2c)"));
}

absl::string_view PolicyKindName(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kEldr:
      return "eldr";
    case PolicyKind::kRoundRobin:
      return "rr";
    case PolicyKind::kRandom:
      return "random";
    case PolicyKind::kJsq:
      return "jsq";
    case PolicyKind::kP2c:
      return "p2c";
  }
  return "eldr";
}

absl::string_view FallbackReasonLabel(FallbackReason reason) {
  switch (reason) {
    case FallbackReason::kNone:
      return "";
    case FallbackReason::kNoSignature:
      return "no_signature";
    case FallbackReason::kZeroSignature:
      return "zero_signature";
    case FallbackReason::kNoCentroids:
      return "no_centroids";
    case FallbackReason::kNoEligibleCentroid:
      return "no_eligible_centroid";
    case FallbackReason::kOverload:
      return "overload";
    case FallbackReason::kLoadGap:
      return "load_gap";
    case FallbackReason::kAllUnhealthy:
      return "all_unhealthy";
  }
  return "";
}

std::unique_ptr<RoutingPolicy> MakePolicy(PolicyKind kind, uint64_t seed, TieBreak tie_break) {
  switch (kind) {
    case PolicyKind::kEldr:
      return std::make_unique<EldrPolicy>(seed, tie_break);
    case PolicyKind::kRoundRobin:
      return std::make_unique<RoundRobinPolicy>();
    case PolicyKind::kRandom:
      return std::make_unique<RandomPolicy>(seed);
    case PolicyKind::kJsq:
      return std::make_unique<JsqPolicy>(seed, tie_break);
    case PolicyKind::kP2c:
      return std::make_unique<P2cPolicy>(seed, tie_break);
  }
  return std::make_unique<JsqPolicy>(seed, tie_break);
}

absl::StatusOr<TieBreak> ParseTieBreak(absl::string_view name) {
  if (name == "random") return TieBreak::kRandom;
  if (name == "lowest_index") return TieBreak::kLowestIndex;
  return absl::InvalidArgumentError(absl::StrCat("unknown tie break '", name, "' (expected random or lowest_index)"));
}

absl::string_view TieBreakName(TieBreak tie_break) {
  return tie_break == TieBreak::kLowestIndex ? "lowest_index" : "random";
}

}  // namespace eldr
