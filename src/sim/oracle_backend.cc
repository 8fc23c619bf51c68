// The oracle backend: routes by the request's domain label, which no router can see (the
// reference implementation's "Domain" baseline), to bound what locality can give.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "sim/random.h"
#include "sim/routing_backend.h"

namespace eldr::sim {
namespace {

// The oracle's tie-breaking stream (apart from every other stream derived from the same seed).
constexpr uint64_t kStreamOracleTies = 31;

class OracleBackend final : public RoutingBackend {
 public:
  OracleBackend(int workers, uint64_t seed, TieBreak tie_break)
      : ties_(Rng::ForStream(seed, kStreamOracleTies)), tie_break_(tie_break) {
    for (int i = 0; i < workers; ++i) {
      worker_ids_.push_back(absl::StrCat("decode-", i));
      index_[worker_ids_.back()] = i;
      active_.push_back(true);
      leases_.push_back(0);
    }
    Regroup();
  }

  std::string Describe() const override {
    return "in-process domain oracle (groups by decode work share, least loaded in the group)";
  }
  // Reported as jsq (least loaded); experiment.h's PolicySpec::oracle is what marks it.
  PolicyKind policy() const override { return PolicyKind::kJsq; }
  double tau() const override { return 0; }
  const std::vector<std::string>& worker_ids() const override { return worker_ids_; }

  void StartRun() override {}

  absl::StatusOr<RouteDecision> Route(const RouteCall& call, double /*now_us*/) override {
    const std::vector<int>* candidates = &all_active_;
    if (call.domain >= 0 && call.domain < static_cast<int>(groups_.size()) && !groups_[call.domain].empty()) {
      candidates = &groups_[call.domain];
    }
    if (candidates->empty()) return absl::UnavailableError("the oracle has no active decode worker");
    int64_t least = std::numeric_limits<int64_t>::max();
    tied_.clear();
    for (int w : *candidates) {
      if (leases_[w] < least) {
        least = leases_[w];
        tied_.clear();
      }
      if (leases_[w] == least) tied_.push_back(w);
    }
    const int chosen = tie_break_ == TieBreak::kLowestIndex ? tied_.front() : tied_[ties_.Below(tied_.size())];
    ++leases_[chosen];
    RouteDecision decision;
    decision.worker = chosen;
    decision.lease_id = next_lease_++;
    lease_worker_[decision.lease_id] = chosen;
    return decision;
  }

  absl::Status Complete(uint64_t lease_id, int64_t /*output_tokens*/, double /*now_us*/) override {
    auto it = lease_worker_.find(lease_id);
    if (it == lease_worker_.end()) return absl::NotFoundError(absl::StrCat("oracle: unknown lease ", lease_id));
    --leases_[it->second];
    lease_worker_.erase(it);
    return absl::OkStatus();
  }

  absl::Status InstallCentroids(const CentroidArtifact& /*artifact*/) override {
    return absl::FailedPreconditionError("the oracle routes by domain labels, not centroids");
  }

  absl::StatusOr<int> AddWorker(const std::string& id) override {
    if (index_.contains(id)) return absl::AlreadyExistsError(absl::StrCat("worker ", id, " was in the pool already"));
    const int index = static_cast<int>(worker_ids_.size());
    worker_ids_.push_back(id);
    index_[id] = index;
    active_.push_back(true);
    leases_.push_back(0);
    Regroup();
    return index;
  }

  absl::Status DrainWorker(const std::string& id) override {
    auto it = index_.find(id);
    if (it == index_.end()) return absl::NotFoundError(absl::StrCat("oracle: unknown worker ", id));
    active_[it->second] = false;
    Regroup();
    return absl::OkStatus();
  }

  absl::Status RemoveWorker(const std::string& id) override {
    auto it = index_.find(id);
    if (it == index_.end()) return absl::NotFoundError(absl::StrCat("oracle: unknown worker ", id));
    const int worker = it->second;
    // As Router::RemoveWorker: the worker's leases are dropped.
    for (auto lease = lease_worker_.begin(); lease != lease_worker_.end();) {
      if (lease->second == worker) {
        lease_worker_.erase(lease++);
      } else {
        ++lease;
      }
    }
    leases_[worker] = 0;
    active_[worker] = false;
    index_.erase(it);
    Regroup();
    return absl::OkStatus();
  }

  absl::Status SetDomainShares(const std::vector<double>& shares) override {
    shares_ = shares;
    Regroup();
    return absl::OkStatus();
  }

 private:
  // Groups of the active workers, in index order, for the current shares.
  void Regroup() {
    all_active_.clear();
    for (int w = 0; w < static_cast<int>(active_.size()); ++w) {
      if (active_[w]) all_active_.push_back(w);
    }
    const std::vector<std::vector<int>> positions = DomainGroups(shares_, static_cast<int>(all_active_.size()));
    groups_.assign(positions.size(), {});
    for (size_t d = 0; d < positions.size(); ++d) {
      for (int p : positions[d]) groups_[d].push_back(all_active_[p]);
    }
  }

  std::vector<std::string> worker_ids_;
  absl::flat_hash_map<std::string, int> index_;
  std::vector<bool> active_;
  std::vector<int64_t> leases_;
  absl::flat_hash_map<uint64_t, int> lease_worker_;
  uint64_t next_lease_ = 1;
  std::vector<double> shares_;
  std::vector<int> all_active_;
  std::vector<std::vector<int>> groups_;  // per domain: worker indices
  std::vector<int> tied_;
  Rng ties_;
  TieBreak tie_break_;
};

}  // namespace

std::vector<std::vector<int>> DomainGroups(const std::vector<double>& shares, int workers) {
  const int domains = static_cast<int>(shares.size());
  std::vector<std::vector<int>> groups(domains);
  std::vector<int> positive;
  for (int d = 0; d < domains; ++d) {
    if (shares[d] > 0) positive.push_back(d);
  }
  if (positive.empty() || workers < 1) return groups;
  // Highest averages: each worker in turn goes to the domain with the most work per worker it
  // would have (share / (seats + 1)).
  std::vector<int> seats(domains, 0);
  for (int w = 0; w < workers; ++w) {
    int best = positive.front();
    for (int d : positive) {
      if (shares[d] / (seats[d] + 1) > shares[best] / (seats[best] + 1)) best = d;
    }
    ++seats[best];
  }
  // Seated domains own contiguous blocks, in domain order.
  int next = 0;
  std::vector<double> group_work(domains, 0.0);  // per seated domain: the work its block serves
  for (int d : positive) {
    for (int s = 0; s < seats[d]; ++s) groups[d].push_back(next++);
    group_work[d] = shares[d];
  }
  // Domains left without a seat, largest first, share the block with the least work per worker.
  std::vector<int> unseated;
  for (int d : positive) {
    if (seats[d] == 0) unseated.push_back(d);
  }
  std::stable_sort(unseated.begin(), unseated.end(), [&](int a, int b) { return shares[a] > shares[b]; });
  for (int d : unseated) {
    int host = -1;
    for (int h : positive) {
      if (seats[h] == 0) continue;
      if (host < 0 || group_work[h] / seats[h] < group_work[host] / seats[host]) host = h;
    }
    group_work[host] += shares[d];
    groups[d] = groups[host];
  }
  return groups;
}

absl::StatusOr<std::unique_ptr<RoutingBackend>> MakeOracleBackend(int workers, uint64_t seed, TieBreak tie_break) {
  if (workers < 1) return absl::InvalidArgumentError("--decoders must be >= 1");
  return std::unique_ptr<RoutingBackend>(new OracleBackend(workers, seed, tie_break));
}

}  // namespace eldr::sim
