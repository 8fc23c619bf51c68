#include "sim/drift.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "sim/random.h"

namespace eldr::sim {
namespace {

// The arrival streams of the mix scenarios. The gaps use MakeArrivals' stream (workload.cc's
// kStreamArrivalTimes), so a drifted run keeps the undrifted run's unit gaps.
constexpr uint64_t kStreamArrivalTimes = 3;
constexpr uint64_t kStreamDriftDomains = 41;
constexpr uint64_t kStreamDriftRequests = 42;

// Request share per domain of the evaluation pool (its natural mix).
std::vector<double> NaturalShares(const Workload& workload) {
  std::vector<double> shares(workload.domains.size(), 0.0);
  for (const SimRequest& request : workload.pool) shares[request.domain] += 1;
  for (double& share : shares) share /= static_cast<double>(workload.pool.size());
  return shares;
}

std::vector<double> Normalised(std::vector<double> shares) {
  const double total = std::accumulate(shares.begin(), shares.end(), 0.0);
  for (double& share : shares) share /= total;
  return shares;
}

}  // namespace

absl::StatusOr<DriftScenario> ParseDriftScenario(absl::string_view name) {
  if (name == "none" || name.empty()) return DriftScenario::kNone;
  if (name == "mix_shift") return DriftScenario::kMixShift;
  if (name == "new_domain") return DriftScenario::kNewDomain;
  if (name == "pool_change") return DriftScenario::kPoolChange;
  return absl::InvalidArgumentError(
      absl::StrCat("--drift: unknown scenario '", name, "' (expected none, mix_shift, new_domain or pool_change)"));
}

absl::string_view DriftScenarioName(DriftScenario scenario) {
  switch (scenario) {
    case DriftScenario::kNone:
      return "none";
    case DriftScenario::kMixShift:
      return "mix_shift";
    case DriftScenario::kNewDomain:
      return "new_domain";
    case DriftScenario::kPoolChange:
      return "pool_change";
  }
  return "none";
}

absl::StatusOr<DriftPlan> PlanDrift(const Workload& workload, const DriftOptions& options, int requests, int decoders,
                                    const ClusterOptions& cluster) {
  DriftPlan plan;
  plan.scenario = options.scenario;
  if (options.calibrate_before && options.scenario != DriftScenario::kMixShift) {
    return absl::InvalidArgumentError("--drift_calibration=before needs --drift=mix_shift");
  }
  if (options.scenario == DriftScenario::kNone) return plan;
  if (!(options.change_fraction > cluster.warmup_fraction && options.change_fraction < 1 - cluster.cooldown_fraction)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--drift_at must leave measured arrivals on both sides of the change: in (%g, %g) (--warmup_fraction, "
        "1 - --cooldown_fraction), got %g",
        cluster.warmup_fraction, 1 - cluster.cooldown_fraction, options.change_fraction));
  }
  plan.change_arrival = static_cast<int>(std::lround(options.change_fraction * requests));
  plan.phase_labels = {"before", "after"};
  const int domains = static_cast<int>(workload.domains.size());
  std::vector<int> pool_per_domain(domains, 0);
  std::vector<double> decode_per_domain(domains, 0.0);
  double decode_total = 0;
  for (const SimRequest& request : workload.pool) {
    ++pool_per_domain[request.domain];
    decode_per_domain[request.domain] += request.decode_steps;
    decode_total += request.decode_steps;
  }
  switch (options.scenario) {
    case DriftScenario::kNone:
      break;
    case DriftScenario::kPoolChange:
      if (decoders < 2) return absl::InvalidArgumentError("--drift=pool_change needs at least 2 decoders");
      plan.add_worker = absl::StrCat("decode-", decoders);
      plan.drain_worker = "decode-0";
      return plan;
    case DriftScenario::kMixShift: {
      if (domains < 2) return absl::InvalidArgumentError("--drift=mix_shift needs a workload with at least 2 domains");
      if (!(options.dominant_share > 0 && options.dominant_share < 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--drift_dominant_share must be in (0, 1), got ", options.dominant_share));
      }
      const int first = domains / 2;
      std::vector<double> before(domains), after(domains);
      for (int d = 0; d < domains; ++d) {
        const bool in_first = d < first;
        const double dominant = options.dominant_share, rest = 1 - options.dominant_share;
        before[d] = in_first ? dominant / first : rest / (domains - first);
        after[d] = in_first ? rest / first : dominant / (domains - first);
      }
      plan.phase_domain_shares = {before, after};
      if (options.calibrate_before) plan.calibration_domain_shares = before;
      break;
    }
    case DriftScenario::kNewDomain: {
      if (domains < 2) return absl::InvalidArgumentError("--drift=new_domain needs a workload with at least 2 domains");
      int fresh = domains - 1;
      if (!options.new_domain.empty()) {
        const auto it = std::find(workload.domains.begin(), workload.domains.end(), options.new_domain);
        if (it == workload.domains.end()) {
          return absl::InvalidArgumentError(
              absl::StrCat("--drift_new_domain: the workload has no domain '", options.new_domain, "'"));
        }
        fresh = static_cast<int>(it - workload.domains.begin());
      }
      plan.excluded_domain = fresh;
      std::vector<double> after = NaturalShares(workload);
      std::vector<double> before = after;
      before[fresh] = 0;
      plan.phase_domain_shares = {Normalised(before), after};
      break;
    }
  }
  for (const std::vector<double>& shares : plan.phase_domain_shares) {
    double mean_decode = 0;
    for (int d = 0; d < domains; ++d) {
      if (shares[d] <= 0) continue;
      if (pool_per_domain[d] == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--drift: domain '", workload.domains[d], "' has no request in the evaluation pool"));
      }
      mean_decode += shares[d] * decode_per_domain[d] / pool_per_domain[d];
    }
    plan.phase_rate_scale.push_back(decode_total / static_cast<double>(workload.pool.size()) / mean_decode);
  }
  return plan;
}

std::vector<Arrival> MakeDriftArrivals(const Workload& workload, const DriftPlan& plan, double rate_per_s, int count,
                                       uint64_t seed) {
  if (plan.phase_domain_shares.empty()) return MakeArrivals(workload, rate_per_s, count, seed);
  Rng times = Rng::ForStream(seed, kStreamArrivalTimes);
  Rng domains = Rng::ForStream(seed, kStreamDriftDomains);
  Rng picks = Rng::ForStream(seed, kStreamDriftRequests);
  std::vector<std::vector<int>> members(workload.domains.size());
  for (int r = 0; r < static_cast<int>(workload.pool.size()); ++r) members[workload.pool[r].domain].push_back(r);
  std::vector<size_t> next_unused(members.size(), 0);
  std::vector<Arrival> arrivals(count);
  double t = 0;
  for (int i = 0; i < count; ++i) {
    const int phase = i < plan.change_arrival ? 0 : 1;
    const std::vector<double>& shares = plan.phase_domain_shares[phase];
    t += times.Exponential() * 1e6 / (rate_per_s * plan.phase_rate_scale[phase]);
    // The domain: the first whose cumulative share exceeds a uniform draw (the last with a share
    // when rounding leaves the draw above the total).
    const double u = domains.Uniform();
    int domain = -1;
    double cumulative = 0;
    for (int d = 0; d < static_cast<int>(shares.size()); ++d) {
      if (shares[d] <= 0) continue;
      domain = d;
      cumulative += shares[d];
      if (u < cumulative) break;
    }
    const std::vector<int>& candidates = members[domain];
    int request = 0;
    if (workload.sample_with_replacement) {
      request = candidates[picks.Below(candidates.size())];
    } else {
      request = candidates[next_unused[domain] % candidates.size()];
      ++next_unused[domain];
    }
    arrivals[i].time_us = t;
    arrivals[i].request = request;
  }
  return arrivals;
}

RunSchedule ScheduleFor(const DriftPlan& plan) {
  RunSchedule schedule;
  if (plan.scenario == DriftScenario::kNone) return schedule;
  schedule.phase_starts = {plan.change_arrival};
  if (plan.scenario == DriftScenario::kPoolChange) {
    schedule.pool_change_arrival = plan.change_arrival;
    schedule.add_worker = plan.add_worker;
    schedule.drain_worker = plan.drain_worker;
  }
  return schedule;
}

CalibrationData WithoutDomain(const CalibrationData& data, int domain) {
  if (domain < 0 || data.labels.empty()) return data;
  std::vector<int> kept;
  for (int i = 0; i < data.n; ++i) {
    if (data.labels[i] != domain) kept.push_back(i);
  }
  return SelectRequests(data, kept);
}

CalibrationData WithDomainShares(const CalibrationData& data, const std::vector<double>& shares) {
  if (shares.empty() || data.labels.empty()) return data;
  std::vector<std::vector<int>> by_domain(shares.size());
  for (int i = 0; i < data.n; ++i) {
    const int domain = data.labels[i];
    if (domain >= 0 && domain < static_cast<int>(shares.size())) by_domain[domain].push_back(i);
  }
  // T: the most requests in all whose shares every domain can fill.
  double total = std::numeric_limits<double>::infinity();
  for (size_t d = 0; d < shares.size(); ++d) {
    if (shares[d] > 0) total = std::min(total, static_cast<double>(by_domain[d].size()) / shares[d]);
  }
  std::vector<int> kept;
  for (size_t d = 0; d < shares.size(); ++d) {
    if (!(shares[d] > 0)) continue;
    const size_t take = std::min(by_domain[d].size(), static_cast<size_t>(std::floor(total * shares[d] + 1e-9)));
    kept.insert(kept.end(), by_domain[d].begin(), by_domain[d].begin() + static_cast<std::ptrdiff_t>(take));
  }
  std::sort(kept.begin(), kept.end());
  return SelectRequests(data, kept);
}

}  // namespace eldr::sim
