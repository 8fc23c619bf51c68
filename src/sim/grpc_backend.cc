// The gRPC routing backend: every Route and Complete goes to a running eldr-router.
#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "eldr/v1/router.grpc.pb.h"
#include "eldr/v1/router.pb.h"
#include "sim/routing_backend.h"

namespace eldr::sim {
namespace {

absl::Status FromGrpc(const grpc::Status& status, absl::string_view what, absl::string_view target) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, " at ", target, " failed: ", status.error_message()));
}

std::unique_ptr<grpc::ClientContext> ContextWithDeadline(double timeout_s) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)));
  return context;
}

std::shared_ptr<grpc::Channel> OpenChannel(const std::string& target) {
  grpc::ChannelArguments arguments;
  // Signatures of large models are tens of kilobytes; centroid artifacts can be megabytes.
  arguments.SetMaxSendMessageSize(256 << 20);
  arguments.SetMaxReceiveMessageSize(256 << 20);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), arguments);
}

class GrpcBackend final : public RoutingBackend {
 public:
  GrpcBackend(DaemonInfo daemon, double rpc_timeout_s) : daemon_(std::move(daemon)), rpc_timeout_s_(rpc_timeout_s) {
    channel_ = OpenChannel(daemon_.target);
    router_ = eldr::v1::DecodeRouter::NewStub(channel_);
    admin_ = eldr::v1::RouterAdmin::NewStub(OpenChannel(daemon_.admin_target));
    ResetWorkerList();
  }

  std::string Describe() const override {
    return absl::StrFormat("eldr-router at grpc://%s (policy %s, tau %g)", daemon_.target,
                           PolicyKindName(daemon_.policy), daemon_.tau);
  }
  PolicyKind policy() const override { return daemon_.policy; }
  double tau() const override { return daemon_.tau; }
  const std::vector<std::string>& worker_ids() const override { return worker_ids_; }
  void StartRun() override {}

  absl::StatusOr<RouteDecision> Route(const RouteCall& call, double /*now_us*/) override {
    eldr::v1::RouteRequest request;
    request.set_request_id(absl::StrCat("sim-", call.request_id));
    request.set_prompt_tokens(call.prompt_tokens);
    // The wire formats are little-endian int16 and float32, the in-memory layouts on every platform
    // this project builds for (x86-64, aarch64).
    if (!call.prompt_gate_sums.empty()) {
      eldr::v1::GateProbSums* sums = request.mutable_gate_prob_sums();
      sums->set_layers(call.layers);
      sums->set_experts(call.experts);
      sums->set_float32_le(reinterpret_cast<const char*>(call.prompt_gate_sums.data()),
                           call.prompt_gate_sums.size() * sizeof(float));
    } else {
      eldr::v1::ExpertCounts* counts = request.mutable_counts();
      counts->set_layers(call.layers);
      counts->set_experts(call.experts);
      counts->set_int16_le(reinterpret_cast<const char*>(call.prompt_counts.data()),
                           call.prompt_counts.size() * sizeof(int16_t));
    }
    eldr::v1::RouteResponse response;
    auto context = ContextWithDeadline(rpc_timeout_s_);
    ELDR_RETURN_IF_ERROR(FromGrpc(router_->Route(context.get(), request, &response), "Route", daemon_.target));
    auto it = index_.find(response.worker_id());
    if (it == index_.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "eldr-router at ", daemon_.target, " routed to worker '", response.worker_id(),
          "', which is not in its pool as the simulation knows it (was the pool changed outside the simulation?)"));
    }
    RouteDecision decision;
    decision.worker = it->second;
    decision.lease_id = response.lease_id();
    decision.similarity = response.similarity();
    decision.band_size = response.band_size();
    decision.fallback = response.fallback_reason();
    return decision;
  }

  absl::Status Complete(uint64_t lease_id, int64_t output_tokens, double /*now_us*/) override {
    eldr::v1::CompleteRequest request;
    request.set_lease_id(lease_id);
    request.set_output_tokens(output_tokens);
    eldr::v1::CompleteResponse response;
    auto context = ContextWithDeadline(rpc_timeout_s_);
    return FromGrpc(router_->Complete(context.get(), request, &response), "Complete", daemon_.target);
  }

  absl::Status InstallCentroids(const CentroidArtifact& artifact) override {
    eldr::v1::ReloadCentroidsRequest request;
    request.set_artifact_json(SerializeCentroidArtifact(artifact));
    return CallAdmin<eldr::v1::ReloadCentroidsResponse>(&AdminStub::ReloadCentroids, request, "ReloadCentroids");
  }

  absl::StatusOr<int> AddWorker(const std::string& id) override {
    if (index_.contains(id)) return absl::AlreadyExistsError(absl::StrCat("worker ", id, " was in the pool already"));
    // GetState (hence worker_ids()) lists active workers only: a draining worker of that id would be
    // re-activated by UpsertWorker rather than added, so it is refused before the daemon changes.
    eldr::v1::ListWorkersResponse listed;
    ELDR_RETURN_IF_ERROR(CallAdmin(&AdminStub::ListWorkers, eldr::v1::ListWorkersRequest(), "ListWorkers", &listed));
    for (const eldr::v1::WorkerState& worker : listed.workers()) {
      if (worker.worker().id() == id) {
        return absl::AlreadyExistsError(absl::StrCat("worker ", id, " is in the pool of eldr-router at ",
                                                     daemon_.target, " already (", worker.state(), ")"));
      }
    }
    eldr::v1::UpsertWorkerRequest request;
    eldr::v1::Worker* worker = request.mutable_worker();
    worker->set_id(id);
    worker->set_address(absl::StrCat("sim-", id, ":8000"));
    worker->set_capacity(daemon_.capacities.empty() ? 1.0 : daemon_.capacities.front());
    worker->set_max_inflight(daemon_.max_inflight.empty() ? 0 : daemon_.max_inflight.front());
    ELDR_RETURN_IF_ERROR(CallAdmin<eldr::v1::UpsertWorkerResponse>(&AdminStub::UpsertWorker, request, "UpsertWorker"));
    added_.push_back(id);
    const int index = static_cast<int>(worker_ids_.size());
    worker_ids_.push_back(id);
    index_[id] = index;
    return index;
  }

  absl::Status DrainWorker(const std::string& id) override {
    eldr::v1::DrainWorkerRequest request;
    request.set_worker_id(id);
    ELDR_RETURN_IF_ERROR(CallAdmin<eldr::v1::DrainWorkerResponse>(&AdminStub::DrainWorker, request, "DrainWorker"));
    NoteOriginalChanged(id);
    return absl::OkStatus();
  }

  absl::Status RemoveWorker(const std::string& id) override {
    eldr::v1::RemoveWorkerRequest request;
    request.set_worker_id(id);
    ELDR_RETURN_IF_ERROR(CallAdmin<eldr::v1::RemoveWorkerResponse>(&AdminStub::RemoveWorker, request, "RemoveWorker"));
    // The worker keeps its index in worker_ids() (the simulator's workers are indexed by it); the
    // daemon no longer knows it, so it is never routed to again.
    NoteOriginalChanged(id);
    if (changed_.contains(id)) removed_.insert(id);
    return absl::OkStatus();
  }

  absl::Status RestorePool() override {
    // Added workers leave first, then the starting workers rejoin: the pool never holds more
    // workers than during a run. A worker already gone (NOT_FOUND) is what removal wants.
    for (auto it = added_.rbegin(); it != added_.rend(); ++it) {
      ELDR_RETURN_IF_ERROR(RemoveIfPresent(*it));
    }
    added_.clear();
    // The daemon's pool order is its insertion order, and lowest_index tie-breaking follows it: a
    // removed worker re-added would come last. So from the first removed starting worker on, every
    // starting worker leaves and all rejoin in their starting order. (They lose their reported
    // load snapshots, which the simulator never sends; a lease of another client on them is
    // dropped, so point the simulator at a daemon of its own.)
    const int n = static_cast<int>(daemon_.worker_ids.size());
    int first_removed = n;
    for (int i = 0; i < n; ++i) {
      if (removed_.contains(daemon_.worker_ids[i])) {
        first_removed = i;
        break;
      }
    }
    for (int i = first_removed; i < n; ++i) ELDR_RETURN_IF_ERROR(RemoveIfPresent(daemon_.worker_ids[i]));
    for (int i = 0; i < n; ++i) {
      // Before the first removed one, only drained workers need to rejoin (UpsertWorker
      // re-activates a draining worker in place).
      if (i < first_removed && !changed_.contains(daemon_.worker_ids[i])) continue;
      eldr::v1::UpsertWorkerRequest request;
      eldr::v1::Worker* worker = request.mutable_worker();
      worker->set_id(daemon_.worker_ids[i]);
      worker->set_address(daemon_.addresses[i]);
      worker->set_capacity(daemon_.capacities[i]);
      worker->set_max_inflight(daemon_.max_inflight[i]);
      ELDR_RETURN_IF_ERROR(CallAdmin<eldr::v1::UpsertWorkerResponse>(
          &AdminStub::UpsertWorker, request,
          absl::StrCat("UpsertWorker ", daemon_.worker_ids[i], " (restoring the pool)")));
    }
    changed_.clear();
    removed_.clear();
    ResetWorkerList();
    return absl::OkStatus();
  }

 private:
  DaemonInfo daemon_;
  double rpc_timeout_s_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<eldr::v1::DecodeRouter::Stub> router_;
  std::unique_ptr<eldr::v1::RouterAdmin::Stub> admin_;
  absl::flat_hash_map<std::string, int> index_;
  // worker_ids(): the daemon's active workers at the start, then those AddWorker added.
  std::vector<std::string> worker_ids_;
  // Since the last RestorePool: the workers AddWorker added (in order), and the starting workers
  // that were drained or removed.
  std::vector<std::string> added_;
  absl::flat_hash_set<std::string> changed_;
  absl::flat_hash_set<std::string> removed_;  // those of changed_ that were removed

  using AdminStub = eldr::v1::RouterAdmin::Stub;
  // One RouterAdmin RPC with the simulator's deadline, its status named by `what`; the answer goes
  // to `response` when one is given.
  template <typename Response, typename Request>
  absl::Status CallAdmin(grpc::Status (AdminStub::*rpc)(grpc::ClientContext*, const Request&, Response*),
                         const Request& request, absl::string_view what, Response* response = nullptr) {
    Response local;
    auto context = ContextWithDeadline(rpc_timeout_s_);
    return FromGrpc((admin_.get()->*rpc)(context.get(), request, response != nullptr ? response : &local), what,
                    daemon_.admin_target);
  }

  absl::Status RemoveIfPresent(const std::string& id) {
    eldr::v1::RemoveWorkerRequest request;
    request.set_worker_id(id);
    const absl::Status removed = CallAdmin<eldr::v1::RemoveWorkerResponse>(
        &AdminStub::RemoveWorker, request, absl::StrCat("RemoveWorker ", id, " (restoring the pool)"));
    return absl::IsNotFound(removed) ? absl::OkStatus() : removed;
  }

  void ResetWorkerList() {
    worker_ids_ = daemon_.worker_ids;
    index_.clear();
    for (int i = 0; i < static_cast<int>(worker_ids_.size()); ++i) index_[worker_ids_[i]] = i;
  }
  void NoteOriginalChanged(const std::string& id) {
    if (std::find(daemon_.worker_ids.begin(), daemon_.worker_ids.end(), id) != daemon_.worker_ids.end()) {
      changed_.insert(id);
    }
  }
};

}  // namespace

absl::StatusOr<std::string> ParseGrpcTarget(const std::string& url) {
  constexpr absl::string_view kScheme = "grpc://";
  if (!absl::StartsWith(url, kScheme)) {
    return absl::InvalidArgumentError(absl::StrCat("--router '", url, "': expected grpc://HOST:PORT"));
  }
  const std::string target = url.substr(kScheme.size());
  const size_t colon = target.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(target.substr(colon + 1), &port) || port < 1 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--router '", url, "': expected grpc://HOST:PORT with a port in 1..65535"));
  }
  return target;
}

absl::StatusOr<DaemonInfo> QueryDaemon(const std::string& target, const std::string& admin_target, double timeout_s) {
  std::shared_ptr<grpc::Channel> channel = OpenChannel(admin_target);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                 std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)))) {
    return absl::UnavailableError(absl::StrFormat(
        "eldr-router's admin service at %s did not answer within %g s (is it running and listening there? "
        "see --router_admin)",
        admin_target, timeout_s));
  }
  auto admin = eldr::v1::RouterAdmin::NewStub(channel);
  eldr::v1::GetStateRequest request;
  eldr::v1::GetStateResponse state;
  auto context = ContextWithDeadline(timeout_s);
  ELDR_RETURN_IF_ERROR(FromGrpc(admin->GetState(context.get(), request, &state), "GetState", admin_target));

  DaemonInfo info;
  info.target = target;
  info.admin_target = admin_target;
  absl::StatusOr<PolicyKind> policy = ParsePolicyKind(state.policy());
  if (!policy.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("eldr-router at ", target, " reports an unknown policy '", state.policy(), "'"));
  }
  info.policy = *policy;
  info.tau = state.tau();
  info.live_leases = state.live_leases();
  info.centroid_generation = state.centroid_generation();
  for (const eldr::v1::WorkerState& worker : state.workers()) {
    if (worker.state() != "active") continue;
    info.worker_ids.push_back(worker.worker().id());
    info.addresses.push_back(worker.worker().address());
    info.capacities.push_back(worker.worker().capacity() == 0 ? 1.0 : worker.worker().capacity());
    info.max_inflight.push_back(worker.worker().max_inflight());
  }
  if (info.worker_ids.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("eldr-router at ", target, " has no active decode worker"));
  }
  return info;
}

absl::StatusOr<std::unique_ptr<RoutingBackend>> MakeGrpcBackend(const DaemonInfo& daemon, double rpc_timeout_s) {
  if (daemon.worker_ids.empty()) {
    return absl::FailedPreconditionError("eldr-router has no active decode worker");
  }
  return std::unique_ptr<RoutingBackend>(new GrpcBackend(daemon, rpc_timeout_s));
}

}  // namespace eldr::sim
