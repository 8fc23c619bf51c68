// Choosing the prefill instance of a request, in eldr-proxy.
//
// Three policies:
//   prefix_hash   consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018) on
//                 the first `prefix_bytes` of the prompt text: requests sharing a prefix land on
//                 the same instance, so its prefix cache serves them. Each instance owns
//                 `virtual_nodes` points of a 64-bit ring (StableHash64 of "<id>#<v>", v = 0..V-1);
//                 a key (StableHash64 of its prefix) goes to the owner of the first point at or
//                 after it, clockwise. An instance may hold at most
//                     cap = ceil(load_factor * (in_flight_total + 1) / n)
//                 requests (in_flight_total and n over the instances not excluded); when the owner
//                 is at its cap, the walk goes on clockwise to the next instance below it. Some
//                 instance is always below the cap (its average is below it), so a pick never
//                 fails for load. Adding or removing one instance moves only the keys of its arcs
//                 (about 1/n of them); hot prefixes overflow to their ring successors, not to
//                 random instances.
//   least_loaded  the instance with the fewest requests in flight; ties rotate.
//   round_robin   instances in turn, in the order given to SetInstances.
//
// The ring depends only on the instance ids (not on their order, nor on the seed): every proxy
// replica, and every restart, maps a prefix to the same instance when it sees the same instances.
//
// In flight = picked and not yet released. Pick returns a PrefillLease; the count drops when the
// lease is released (Release, destruction, or move-assignment over it). A lease may outlive its
// picker (its release is then a no-op); a lease on an instance that SetInstances removed releases
// nothing, and neither does one on an instance removed and added again (it counts afresh).
//
// Thread-safety: PrefillPicker is thread-safe (one internal mutex; Pick is O(n) plus the ring
// walk). A PrefillLease is not: one owner at a time, like a unique_ptr; different leases may be
// released concurrently from any threads.
#ifndef ELDR_PROXY_PREFILL_PICKER_H_
#define ELDR_PROXY_PREFILL_PICKER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace eldr::proxy {

enum class PrefillPolicy { kPrefixHash, kLeastLoaded, kRoundRobin };

// "prefix_hash", "least_loaded", "round_robin". Anything else: INVALID_ARGUMENT listing them.
absl::StatusOr<PrefillPolicy> ParsePrefillPolicy(absl::string_view name);
// The name ParsePrefillPolicy reads (also a stable metric label value).
absl::string_view PrefillPolicyName(PrefillPolicy policy);

struct PrefillPickerOptions {
  PrefillPolicy policy = PrefillPolicy::kPrefixHash;
  // prefix_hash: the key is the first `prefix_bytes` bytes of the prompt key. [1, 1 MiB].
  size_t prefix_bytes = 1024;
  // prefix_hash: ring points per instance. [1, 1024]. More points, more even arcs.
  int virtual_nodes = 160;
  // prefix_hash: the bounded-load factor c of the cap above. Finite, [1, 1000]; 1 keeps every
  // instance within one request of perfect balance (locality suffers), large values effectively
  // disable the bound.
  double load_factor = 1.25;
  // round_robin: the first instance is seed % n. least_loaded: the tie rotation starts there too.
  uint64_t seed = 0;
};

// OK, or INVALID_ARGUMENT naming the first offending field ("PrefillPickerOptions.prefix_bytes
// must be in [1, 1048576], got 0").
absl::Status ValidatePrefillPickerOptions(const PrefillPickerOptions& options);

// Limits on the instance list of SetInstances.
inline constexpr size_t kMaxPrefillInstances = 1024;
inline constexpr size_t kMaxPrefillInstanceIdBytes = 256;

namespace internal {
struct PrefillPickerState;
}  // namespace internal

// One request in flight on a prefill instance. Move-only; releases its count when destroyed.
class PrefillLease {
 public:
  // An empty lease: valid() is false, Release does nothing.
  PrefillLease() = default;
  PrefillLease(PrefillLease&& other) noexcept;
  // Releases this lease first, then takes over `other`'s.
  PrefillLease& operator=(PrefillLease&& other) noexcept;
  PrefillLease(const PrefillLease&) = delete;
  PrefillLease& operator=(const PrefillLease&) = delete;
  ~PrefillLease();

  // The instance id as given to the picker (e.g. "10.0.0.7:8100"). Empty for an empty lease; kept
  // after Release.
  const std::string& id() const { return id_; }
  // True from Pick until Release (or a move out of it).
  bool valid() const { return state_ != nullptr; }
  // Drops the in-flight count now (e.g. when the prefill answered, before the decode streams).
  // Idempotent.
  void Release();

 private:
  friend class PrefillPicker;
  PrefillLease(std::shared_ptr<internal::PrefillPickerState> state, std::string id, uint64_t incarnation);

  std::shared_ptr<internal::PrefillPickerState> state_;
  std::string id_;
  uint64_t incarnation_ = 0;
};

struct PrefillInstanceLoad {
  std::string id;
  int64_t in_flight = 0;
};

class PrefillPicker {
 public:
  // INVALID_ARGUMENT for bad options (ValidatePrefillPickerOptions) or instances (SetInstances).
  // An empty instance list is allowed: Pick then answers UNAVAILABLE until SetInstances.
  static absl::StatusOr<std::unique_ptr<PrefillPicker>> Create(PrefillPickerOptions options,
                                                               std::vector<std::string> instances);

  PrefillPicker(const PrefillPicker&) = delete;
  PrefillPicker& operator=(const PrefillPicker&) = delete;
  ~PrefillPicker();

  // Picks an instance for a request whose prompt key (see ClientRequest::prompt_key) is
  // `prompt_key`, skipping the ids in `exclude` (instances that already failed this request; ids
  // not in the pool are ignored), and counts it in flight until the lease is released.
  // UNAVAILABLE when there is no instance, or every instance is excluded.
  absl::StatusOr<PrefillLease> Pick(absl::string_view prompt_key, absl::Span<const std::string> exclude = {});

  // Replaces the instance list (service discovery). Ids must be non-empty, at most
  // kMaxPrefillInstanceIdBytes bytes, unique, and at most kMaxPrefillInstances of them; else
  // INVALID_ARGUMENT and nothing changes. Kept instances keep their in-flight counts; new ones
  // start at 0; removed ones are forgotten (their leases release nothing). The order sets the
  // round-robin sequence only.
  absl::Status SetInstances(std::vector<std::string> instances);

  // Every instance with its in-flight count, in SetInstances order.
  std::vector<PrefillInstanceLoad> Loads() const;
  // Number of instances.
  size_t size() const;
  const PrefillPickerOptions& options() const { return options_; }

 private:
  PrefillPicker(PrefillPickerOptions options, std::shared_ptr<internal::PrefillPickerState> state);

  const PrefillPickerOptions options_;
  const std::shared_ptr<internal::PrefillPickerState> state_;
};

}  // namespace eldr::proxy

#endif  // ELDR_PROXY_PREFILL_PICKER_H_
