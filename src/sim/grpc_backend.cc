// The gRPC routing backend: every Route and Complete goes to a running eldr-router.
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_map.h"
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
    for (int i = 0; i < static_cast<int>(daemon_.worker_ids.size()); ++i) {
      index_[daemon_.worker_ids[i]] = i;
    }
  }

  std::string Describe() const override {
    return absl::StrFormat("eldr-router at grpc://%s (policy %s, tau %g)", daemon_.target,
                           PolicyKindName(daemon_.policy), daemon_.tau);
  }
  PolicyKind policy() const override { return daemon_.policy; }
  double tau() const override { return daemon_.tau; }
  const std::vector<std::string>& worker_ids() const override { return daemon_.worker_ids; }
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
      return absl::FailedPreconditionError(
          absl::StrCat("eldr-router at ", daemon_.target, " routed to worker '", response.worker_id(),
                       "', which it did not list when the simulation started (was the pool changed?)"));
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
    eldr::v1::ReloadCentroidsResponse response;
    auto context = ContextWithDeadline(rpc_timeout_s_);
    return FromGrpc(admin_->ReloadCentroids(context.get(), request, &response), "ReloadCentroids", daemon_.target);
  }

 private:
  DaemonInfo daemon_;
  double rpc_timeout_s_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<eldr::v1::DecodeRouter::Stub> router_;
  std::unique_ptr<eldr::v1::RouterAdmin::Stub> admin_;
  absl::flat_hash_map<std::string, int> index_;
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
