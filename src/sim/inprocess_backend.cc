// The in-process routing backend: the routing library itself, driven with simulated time.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "eldr/core/router.h"
#include "eldr/core/signature.h"
#include "sim/routing_backend.h"

namespace eldr::sim {
namespace {

class InProcessBackend final : public RoutingBackend {
 public:
  InProcessBackend(std::unique_ptr<Router> router, std::vector<std::string> worker_ids, PolicyKind policy, double tau,
                   int64_t max_inflight)
      : router_(std::move(router)),
        worker_ids_(std::move(worker_ids)),
        policy_(policy),
        tau_(tau),
        max_inflight_(max_inflight) {
    for (int i = 0; i < static_cast<int>(worker_ids_.size()); ++i) index_[worker_ids_[i]] = i;
  }

  std::string Describe() const override {
    return absl::StrFormat("in-process eldr::Router (policy %s, tau %g)", PolicyKindName(policy_), tau_);
  }
  PolicyKind policy() const override { return policy_; }
  double tau() const override { return tau_; }
  const std::vector<std::string>& worker_ids() const override { return worker_ids_; }

  void StartRun() override {
    // Simulated time restarts at 0 in each run; the router's clock must not go backwards (its lease
    // bookkeeping is time-ordered), so every run is placed one simulated minute after the last.
    run_origin_us_ = latest_us_ + 60e6;
  }

  absl::StatusOr<RouteDecision> Route(const RouteCall& call, double now_us) override {
    const SignatureInput signature =
        call.prompt_gate_sums.empty()
            ? SignatureInput(CountsInt16Le{call.layers, call.experts,
                                           absl::string_view(reinterpret_cast<const char*>(call.prompt_counts.data()),
                                                             call.prompt_counts.size() * sizeof(int16_t))})
            : SignatureInput(GateProbSums{call.layers, call.experts, call.prompt_gate_sums});
    ELDR_ASSIGN_OR_RETURN(RouteResult result, router_->Route(&signature, Clock(now_us)));
    RouteDecision decision;
    auto it = index_.find(result.worker_id);
    if (it == index_.end()) {
      return absl::InternalError(absl::StrCat("router chose unknown worker ", result.worker_id));
    }
    decision.worker = it->second;
    decision.lease_id = result.lease_id;
    decision.similarity = result.similarity;
    decision.band_size = result.band_size;
    decision.fallback = std::string(FallbackReasonLabel(result.fallback));
    return decision;
  }

  absl::Status Complete(uint64_t lease_id, int64_t output_tokens, double now_us) override {
    CompleteInput input;
    input.lease_id = lease_id;
    input.output_tokens = output_tokens;
    input.now = Clock(now_us);
    return router_->Complete(input).status();
  }

  absl::Status InstallCentroids(const CentroidArtifact& artifact) override {
    return router_->InstallCentroids(artifact).status();
  }

  absl::StatusOr<RouterState> GetState(double now_us) override { return router_->GetState(Clock(now_us)); }

  absl::Status SetPeerLeases(const absl::flat_hash_map<std::string, PeerLeaseCount>& peers) override {
    router_->SetPeerLeases(peers);
    return absl::OkStatus();
  }

  absl::StatusOr<int> AddWorker(const std::string& id) override {
    if (index_.contains(id)) return absl::AlreadyExistsError(absl::StrCat("worker ", id, " was in the pool already"));
    WorkerSpec spec;
    spec.id = id;
    spec.address = absl::StrCat("sim-", id, ":8000");
    spec.max_inflight = max_inflight_;
    ELDR_RETURN_IF_ERROR(router_->UpsertWorker(spec).status());
    const int index = static_cast<int>(worker_ids_.size());
    worker_ids_.push_back(id);
    index_[id] = index;
    return index;
  }

  absl::Status DrainWorker(const std::string& id) override { return router_->DrainWorker(id).status(); }
  absl::Status RemoveWorker(const std::string& id) override { return router_->RemoveWorker(id).status(); }

 private:
  absl::Time Clock(double now_us) {
    latest_us_ = std::max(latest_us_, run_origin_us_ + now_us);
    return absl::UnixEpoch() + absl::Microseconds(static_cast<int64_t>(run_origin_us_ + now_us));
  }

  std::unique_ptr<Router> router_;
  std::vector<std::string> worker_ids_;
  absl::flat_hash_map<std::string, int> index_;
  PolicyKind policy_;
  double tau_;
  int64_t max_inflight_;
  double run_origin_us_ = 0;
  double latest_us_ = 0;
};

}  // namespace

absl::StatusOr<RouterState> RoutingBackend::GetState(double /*now_us*/) {
  return absl::UnimplementedError(absl::StrCat(Describe(), " does not expose its router state"));
}

absl::Status RoutingBackend::SetPeerLeases(const absl::flat_hash_map<std::string, PeerLeaseCount>& /*peers*/) {
  return absl::UnimplementedError(absl::StrCat(Describe(), " does not take peer leases"));
}

absl::StatusOr<int> RoutingBackend::AddWorker(const std::string& /*id*/) {
  return absl::UnimplementedError(absl::StrCat(Describe(), " does not change its pool from the simulator"));
}

absl::Status RoutingBackend::DrainWorker(const std::string& /*id*/) {
  return absl::UnimplementedError(absl::StrCat(Describe(), " does not change its pool from the simulator"));
}

absl::Status RoutingBackend::RemoveWorker(const std::string& /*id*/) {
  return absl::UnimplementedError(absl::StrCat(Describe(), " does not change its pool from the simulator"));
}

absl::Status RoutingBackend::RestorePool() { return absl::OkStatus(); }

absl::Status RoutingBackend::SetDomainShares(const std::vector<double>& /*shares*/) { return absl::OkStatus(); }

absl::StatusOr<std::unique_ptr<RoutingBackend>> MakeInProcessBackend(PolicyKind policy, double tau,
                                                                     uint64_t router_seed, int workers,
                                                                     int64_t max_inflight, TieBreak tie_break,
                                                                     double max_load_gap) {
  if (workers < 1) return absl::InvalidArgumentError("--decoders must be >= 1");
  RouterOptions options;
  options.policy = policy;
  options.tau = tau;
  options.max_load_gap = max_load_gap;
  options.seed = router_seed;
  options.tie_break = tie_break;
  std::vector<WorkerSpec> specs;
  std::vector<std::string> ids;
  for (int i = 0; i < workers; ++i) {
    WorkerSpec spec;
    spec.id = absl::StrCat("decode-", i);
    spec.address = absl::StrCat("sim-decode-", i, ":8000");
    spec.max_inflight = max_inflight;
    ids.push_back(spec.id);
    specs.push_back(std::move(spec));
  }
  ELDR_ASSIGN_OR_RETURN(std::unique_ptr<Router> router, Router::Create(options, std::move(specs)));
  return std::unique_ptr<RoutingBackend>(
      new InProcessBackend(std::move(router), std::move(ids), policy, tau, max_inflight));
}

}  // namespace eldr::sim
