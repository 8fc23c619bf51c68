#include "eldr/proxy/prefill_picker.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "eldr/common/stable_hash.h"

namespace eldr::proxy {
namespace internal {

struct PrefillPickerState {
  struct Instance {
    std::string id;
    // Distinguishes this membership of `id` from an earlier one (removed, then added again), so a
    // lease taken before the removal releases nothing.
    uint64_t incarnation = 0;
    int64_t in_flight = 0;
  };
  struct RingPoint {
    uint64_t hash = 0;
    uint32_t instance = 0;  // index into `instances`
  };

  absl::Mutex mu;
  std::vector<Instance> instances ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, size_t> index ABSL_GUARDED_BY(mu);  // id -> index in `instances`
  std::vector<RingPoint> ring ABSL_GUARDED_BY(mu);                     // sorted by hash, then id
  int64_t total_in_flight ABSL_GUARDED_BY(mu) = 0;
  uint64_t cursor ABSL_GUARDED_BY(mu) = 0;  // round robin / least-loaded tie rotation
  uint64_t next_incarnation ABSL_GUARDED_BY(mu) = 1;

  bool Eligible(const std::vector<bool>& excluded, size_t i) const { return excluded.empty() || !excluded[i]; }

  // The least-loaded eligible instance, scanning from the rotating cursor: the first in scan order
  // wins ties, and the cursor moves on so that ties rotate.
  size_t LeastLoaded(const std::vector<bool>& excluded) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const size_t n = instances.size();
    size_t best = n;
    const size_t start = static_cast<size_t>(cursor % n);
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (start + k) % n;
      if (!Eligible(excluded, i)) continue;
      if (best == n || instances[i].in_flight < instances[best].in_flight) best = i;
    }
    ++cursor;
    return best;
  }

  // The next eligible instance from the cursor.
  size_t RoundRobin(const std::vector<bool>& excluded) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const size_t n = instances.size();
    const size_t start = static_cast<size_t>(cursor % n);
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (start + k) % n;
      if (Eligible(excluded, i)) {
        cursor = i + 1;
        return i;
      }
    }
    return n;
  }

  // The first eligible instance below `cap` clockwise from `key_hash`; instances.size() if none.
  size_t RingWalk(uint64_t key_hash, int64_t cap, const std::vector<bool>& excluded) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const auto first = std::lower_bound(ring.begin(), ring.end(), key_hash,
                                        [](const RingPoint& point, uint64_t h) { return point.hash < h; });
    size_t position = static_cast<size_t>(first - ring.begin());
    for (size_t step = 0; step < ring.size(); ++step, ++position) {
      const size_t i = ring[position % ring.size()].instance;
      if (Eligible(excluded, i) && instances[i].in_flight < cap) return i;
    }
    return instances.size();
  }

  void Release(absl::string_view id, uint64_t incarnation) {
    absl::MutexLock lock(&mu);
    const auto it = index.find(id);
    if (it == index.end()) return;
    Instance& instance = instances[it->second];
    if (instance.incarnation != incarnation || instance.in_flight <= 0) return;
    --instance.in_flight;
    --total_in_flight;
  }
};

}  // namespace internal

namespace {

using internal::PrefillPickerState;

constexpr size_t kMaxPrefixBytes = size_t{1} << 20;
constexpr int kMaxVirtualNodes = 1024;
constexpr double kMaxLoadFactor = 1000;

absl::Status ValidateInstances(const std::vector<std::string>& instances) {
  if (instances.size() > kMaxPrefillInstances) {
    return absl::InvalidArgumentError(absl::StrFormat("%d prefill instances given; at most %d are supported",
                                                      instances.size(), kMaxPrefillInstances));
  }
  absl::flat_hash_set<absl::string_view> seen;
  for (const std::string& id : instances) {
    if (id.empty()) return absl::InvalidArgumentError("a prefill instance id is empty");
    if (id.size() > kMaxPrefillInstanceIdBytes) {
      return absl::InvalidArgumentError(absl::StrFormat("prefill instance id \"%s...\" is %d bytes long; at most %d",
                                                        id.substr(0, 32), id.size(), kMaxPrefillInstanceIdBytes));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("prefill instance id \"", id, "\" is given twice"));
    }
  }
  return absl::OkStatus();
}

// The ring of `instances` (indices into it), sorted by hash, collisions ordered by id so that the
// ring does not depend on the order of the list.
std::vector<PrefillPickerState::RingPoint> BuildRing(const std::vector<std::string>& instances, int virtual_nodes) {
  std::vector<PrefillPickerState::RingPoint> ring;
  ring.reserve(instances.size() * static_cast<size_t>(virtual_nodes));
  std::string point_name;
  for (size_t i = 0; i < instances.size(); ++i) {
    for (int v = 0; v < virtual_nodes; ++v) {
      point_name.clear();
      absl::StrAppend(&point_name, instances[i], "#", v);
      ring.push_back({StableHash64(point_name), static_cast<uint32_t>(i)});
    }
  }
  std::sort(ring.begin(), ring.end(), [&](const auto& a, const auto& b) {
    if (a.hash != b.hash) return a.hash < b.hash;
    return instances[a.instance] < instances[b.instance];
  });
  return ring;
}

}  // namespace

absl::StatusOr<PrefillPolicy> ParsePrefillPolicy(absl::string_view name) {
  if (name == "prefix_hash") return PrefillPolicy::kPrefixHash;
  if (name == "least_loaded") return PrefillPolicy::kLeastLoaded;
  if (name == "round_robin") return PrefillPolicy::kRoundRobin;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown prefill policy \"", name, "\": expected prefix_hash, least_loaded or round_robin"));
}

absl::string_view PrefillPolicyName(PrefillPolicy policy) {
  switch (policy) {
    case PrefillPolicy::kPrefixHash:
      return "prefix_hash";
    case PrefillPolicy::kLeastLoaded:
      return "least_loaded";
    case PrefillPolicy::kRoundRobin:
      return "round_robin";
  }
  return "unknown";
}

absl::Status ValidatePrefillPickerOptions(const PrefillPickerOptions& options) {
  if (options.policy != PrefillPolicy::kPrefixHash && options.policy != PrefillPolicy::kLeastLoaded &&
      options.policy != PrefillPolicy::kRoundRobin) {
    return absl::InvalidArgumentError("PrefillPickerOptions.policy is not a PrefillPolicy");
  }
  if (options.prefix_bytes < 1 || options.prefix_bytes > kMaxPrefixBytes) {
    return absl::InvalidArgumentError(absl::StrFormat("PrefillPickerOptions.prefix_bytes must be in [1, %d], got %d",
                                                      kMaxPrefixBytes, options.prefix_bytes));
  }
  if (options.virtual_nodes < 1 || options.virtual_nodes > kMaxVirtualNodes) {
    return absl::InvalidArgumentError(absl::StrFormat("PrefillPickerOptions.virtual_nodes must be in [1, %d], got %d",
                                                      kMaxVirtualNodes, options.virtual_nodes));
  }
  if (!std::isfinite(options.load_factor) || options.load_factor < 1 || options.load_factor > kMaxLoadFactor) {
    return absl::InvalidArgumentError(absl::StrFormat("PrefillPickerOptions.load_factor must be in [1, %g], got %g",
                                                      kMaxLoadFactor, options.load_factor));
  }
  return absl::OkStatus();
}

// ---- PrefillLease ----------------------------------------------------------------------------------

PrefillLease::PrefillLease(std::shared_ptr<internal::PrefillPickerState> state, std::string id, uint64_t incarnation)
    : state_(std::move(state)), id_(std::move(id)), incarnation_(incarnation) {}

PrefillLease::PrefillLease(PrefillLease&& other) noexcept
    : state_(std::move(other.state_)), id_(std::move(other.id_)), incarnation_(other.incarnation_) {
  other.state_ = nullptr;
  other.id_.clear();
}

PrefillLease& PrefillLease::operator=(PrefillLease&& other) noexcept {
  if (this != &other) {
    Release();
    state_ = std::move(other.state_);
    id_ = std::move(other.id_);
    incarnation_ = other.incarnation_;
    other.state_ = nullptr;
    other.id_.clear();
  }
  return *this;
}

PrefillLease::~PrefillLease() { Release(); }

void PrefillLease::Release() {
  if (state_ == nullptr) return;
  state_->Release(id_, incarnation_);
  state_ = nullptr;
}

// ---- PrefillPicker ---------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<PrefillPicker>> PrefillPicker::Create(PrefillPickerOptions options,
                                                                     std::vector<std::string> instances) {
  if (absl::Status status = ValidatePrefillPickerOptions(options); !status.ok()) return status;
  auto state = std::make_shared<PrefillPickerState>();
  std::unique_ptr<PrefillPicker> picker(new PrefillPicker(options, std::move(state)));
  if (absl::Status status = picker->SetInstances(std::move(instances)); !status.ok()) return status;
  return picker;
}

PrefillPicker::PrefillPicker(PrefillPickerOptions options, std::shared_ptr<internal::PrefillPickerState> state)
    : options_(options), state_(std::move(state)) {
  absl::MutexLock lock(&state_->mu);
  state_->cursor = options_.seed;
}

PrefillPicker::~PrefillPicker() = default;

absl::Status PrefillPicker::SetInstances(std::vector<std::string> instances) {
  if (absl::Status status = ValidateInstances(instances); !status.ok()) return status;
  std::vector<PrefillPickerState::RingPoint> ring = BuildRing(instances, options_.virtual_nodes);

  PrefillPickerState& state = *state_;
  absl::MutexLock lock(&state.mu);
  std::vector<PrefillPickerState::Instance> updated;
  updated.reserve(instances.size());
  absl::flat_hash_map<std::string, size_t> index;
  index.reserve(instances.size());
  int64_t total = 0;
  for (std::string& id : instances) {
    PrefillPickerState::Instance instance;
    if (const auto it = state.index.find(id); it != state.index.end()) {
      instance = state.instances[it->second];
    } else {
      instance.id = std::move(id);
      instance.incarnation = state.next_incarnation++;
    }
    total += instance.in_flight;
    index.emplace(instance.id, updated.size());
    updated.push_back(std::move(instance));
  }
  state.instances = std::move(updated);
  state.index = std::move(index);
  state.ring = std::move(ring);
  state.total_in_flight = total;
  return absl::OkStatus();
}

absl::StatusOr<PrefillLease> PrefillPicker::Pick(absl::string_view prompt_key, absl::Span<const std::string> exclude) {
  // The key's hash needs no lock.
  const uint64_t key_hash =
      options_.policy == PrefillPolicy::kPrefixHash ? StableHash64(prompt_key.substr(0, options_.prefix_bytes)) : 0;

  PrefillPickerState& state = *state_;
  absl::MutexLock lock(&state.mu);
  const size_t n = state.instances.size();
  if (n == 0) return absl::UnavailableError("no prefill instance is configured");

  // Eligibility: everything unless excluded. The common case (no exclusions) allocates nothing.
  std::vector<bool> excluded;
  size_t eligible = n;
  int64_t eligible_in_flight = state.total_in_flight;
  if (!exclude.empty()) {
    excluded.assign(n, false);
    for (const std::string& id : exclude) {
      const auto it = state.index.find(id);
      if (it == state.index.end() || excluded[it->second]) continue;
      excluded[it->second] = true;
      --eligible;
      eligible_in_flight -= state.instances[it->second].in_flight;
    }
    if (eligible == 0) {
      return absl::UnavailableError(
          absl::StrFormat("every prefill instance (%d) is excluded for this request (they failed it)", n));
    }
  }
  size_t chosen = n;
  switch (options_.policy) {
    case PrefillPolicy::kRoundRobin:
      chosen = state.RoundRobin(excluded);
      break;
    case PrefillPolicy::kLeastLoaded:
      chosen = state.LeastLoaded(excluded);
      break;
    case PrefillPolicy::kPrefixHash: {
      const double cap =
          std::ceil(options_.load_factor * static_cast<double>(eligible_in_flight + 1) / static_cast<double>(eligible));
      chosen = state.RingWalk(
          key_hash, cap >= 0x1.0p62 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(cap), excluded);
      // Unreachable by the cap's construction (the average is below it); kept as a safe fallback.
      if (chosen == n) chosen = state.LeastLoaded(excluded);
      break;
    }
  }

  PrefillPickerState::Instance& instance = state.instances[chosen];
  ++instance.in_flight;
  ++state.total_in_flight;
  return PrefillLease(state_, instance.id, instance.incarnation);
}

std::vector<PrefillInstanceLoad> PrefillPicker::Loads() const {
  absl::MutexLock lock(&state_->mu);
  std::vector<PrefillInstanceLoad> loads;
  loads.reserve(state_->instances.size());
  for (const auto& instance : state_->instances) loads.push_back({instance.id, instance.in_flight});
  return loads;
}

size_t PrefillPicker::size() const {
  absl::MutexLock lock(&state_->mu);
  return state_->instances.size();
}

}  // namespace eldr::proxy
