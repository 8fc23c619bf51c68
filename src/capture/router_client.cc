// RouterClient: sends a request's finished expert counts to eldr-router's DecodeRouter.Route over
// gRPC and returns the chosen decode worker; Complete releases the lease.
//
// The messages are proto/eldr/v1/router.proto compiled as a lite runtime copy under the package
// eldr.capture_wire.v1 (src/capture/CMakeLists.txt): the same wire format and method paths, but nothing
// registered in protobuf's global descriptor pool and no symbol shared with eldr_proto, so a process
// may load libeldr_capture.so next to any other copy of router.proto's generated code.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "eldr/capture/capture.hpp"
#include "eldr_capture_wire.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/proto_utils.h"

namespace eldr::capture {
namespace {

namespace v1 = ::eldr::capture_wire::v1;

constexpr size_t kMaxRequestIdBytes = 256;
constexpr char kRouteMethod[] = "/eldr.v1.DecodeRouter/Route";
constexpr char kCompleteMethod[] = "/eldr.v1.DecodeRouter/Complete";

// One blocking unary call of `method` through a generic stub typed on the lite messages.
template <typename Request, typename Response>
grpc::Status UnaryCall(const std::shared_ptr<grpc::Channel>& channel, const char* method, grpc::ClientContext& context,
                       const Request& request, Response* response) {
  grpc::TemplatedGenericStub<Request, Response> stub(channel);
  grpc::CompletionQueue queue;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> call =
      stub.PrepareUnaryCall(&context, method, request, &queue);
  grpc::Status status;
  if (call == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "cannot start the call");
  call->StartCall();
  int tag = 0;
  call->Finish(response, &status, &tag);
  void* got = nullptr;
  bool ok = false;
  if (!queue.Next(&got, &ok) || got != &tag) {
    status = grpc::Status(grpc::StatusCode::INTERNAL, "completion queue closed unexpectedly");
  }
  queue.Shutdown();
  while (queue.Next(&got, &ok)) {
  }
  return status;
}

absl::Status FromGrpc(const grpc::Status& status, const char* rpc, const std::string& target) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("router ", target, " ", rpc, ": ", status.error_message()));
}

class RouterClientImpl final : public RouterClient {
 public:
  RouterClientImpl(std::string target, std::shared_ptr<grpc::Channel> channel, int timeout_ms)
      : target_(std::move(target)), channel_(std::move(channel)), timeout_ms_(timeout_ms) {}

  absl::StatusOr<RouteDecision> RouteInt16(const std::string& request_id, int64_t prompt_tokens,
                                           absl::Span<const int16_t> counts, int layers, int experts) override {
    if (absl::Status s = CheckCounts(counts, layers, experts); !s.ok()) return s;
    v1::RouteRequest request;
    v1::ExpertCounts* wire = request.mutable_counts();
    wire->set_layers(layers);
    wire->set_experts(experts);
    // Little-endian whatever the host's byte order.
    std::string bytes(counts.size() * 2, '\0');
    for (size_t i = 0; i < counts.size(); ++i) {
      const uint16_t v = static_cast<uint16_t>(counts[i]);
      bytes[2 * i] = static_cast<char>(v & 0xff);
      bytes[2 * i + 1] = static_cast<char>(v >> 8);
    }
    wire->set_int16_le(std::move(bytes));
    return Route(request_id, prompt_tokens, request);
  }

  absl::StatusOr<RouteDecision> RouteInt32(const std::string& request_id, int64_t prompt_tokens,
                                           absl::Span<const int32_t> counts, int layers, int experts) override {
    if (absl::Status s = CheckCounts(counts, layers, experts); !s.ok()) return s;
    v1::RouteRequest request;
    v1::ExpertCounts* wire = request.mutable_counts();
    wire->set_layers(layers);
    wire->set_experts(experts);
    wire->mutable_values()->mutable_values()->Add(counts.begin(), counts.end());
    return Route(request_id, prompt_tokens, request);
  }

  absl::StatusOr<RouteDecision> RouteGateProbSums(const std::string& request_id, int64_t prompt_tokens,
                                                  absl::Span<const float> sums, int layers, int experts) override {
    if (absl::Status s = CheckCounts(sums, layers, experts); !s.ok()) return s;
    v1::RouteRequest request;
    v1::GateProbSums* wire = request.mutable_gate_prob_sums();
    wire->set_layers(layers);
    wire->set_experts(experts);
    // IEEE-754 bits, little-endian whatever the host's byte order. Values are sent as they are: the
    // router rejects NaN and negative sums with INVALID_ARGUMENT.
    std::string bytes(sums.size() * 4, '\0');
    for (size_t i = 0; i < sums.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &sums[i], sizeof(bits));
      for (int b = 0; b < 4; ++b) bytes[4 * i + b] = static_cast<char>((bits >> (8 * b)) & 0xff);
    }
    wire->set_float32_le(std::move(bytes));
    return Route(request_id, prompt_tokens, request);
  }

  absl::StatusOr<RouteDecision> RouteWithoutSignature(const std::string& request_id, int64_t prompt_tokens) override {
    v1::RouteRequest request;
    return Route(request_id, prompt_tokens, request);
  }

  absl::StatusOr<std::string> Complete(uint64_t lease_id, int64_t output_tokens) override {
    if (output_tokens < 0) {
      return absl::InvalidArgumentError(absl::StrCat("complete: output_tokens must be >= 0, got ", output_tokens));
    }
    v1::CompleteRequest request;
    request.set_lease_id(lease_id);
    request.set_output_tokens(output_tokens);
    v1::CompleteResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status status = UnaryCall(channel_, kCompleteMethod, context, request, &response);
    if (!status.ok()) return FromGrpc(status, "Complete", target_);
    return response.worker_id();
  }

 private:
  template <typename T>
  static absl::Status CheckCounts(absl::Span<const T> counts, int layers, int experts) {
    if (layers <= 0 || experts <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("route: layers and experts must be > 0, got ", layers, " and ", experts));
    }
    if (counts.size() != static_cast<size_t>(layers) * static_cast<size_t>(experts)) {
      return absl::InvalidArgumentError(
          absl::StrCat("route: ", counts.size(), " counts for layers * experts = ", layers, " * ", experts));
    }
    for (size_t i = 0; i < counts.size(); ++i) {
      if (counts[i] < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("route: count [", i / experts, "][", i % experts, "] = ", counts[i], " is negative"));
      }
    }
    return absl::OkStatus();
  }

  void SetDeadline(grpc::ClientContext& context) const {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms_));
  }

  absl::StatusOr<RouteDecision> Route(const std::string& request_id, int64_t prompt_tokens, v1::RouteRequest& request) {
    if (request_id.size() > kMaxRequestIdBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("route: request_id has ", request_id.size(), " bytes, at most ", kMaxRequestIdBytes));
    }
    if (prompt_tokens < 0) {
      return absl::InvalidArgumentError(absl::StrCat("route: prompt_tokens must be >= 0, got ", prompt_tokens));
    }
    request.set_request_id(request_id);
    request.set_prompt_tokens(prompt_tokens);
    v1::RouteResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status status = UnaryCall(channel_, kRouteMethod, context, request, &response);
    if (!status.ok()) return FromGrpc(status, "Route", target_);
    RouteDecision decision;
    decision.worker_id = response.worker_id();
    decision.address = response.address();
    decision.lease_id = response.lease_id();
    decision.similarity = response.similarity();
    decision.band_size = response.band_size();
    decision.policy = response.policy();
    decision.fallback_reason = response.fallback_reason();
    decision.centroid_generation = response.centroid_generation();
    return decision;
  }

  const std::string target_;
  const std::shared_ptr<grpc::Channel> channel_;
  const int timeout_ms_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RouterClient>> RouterClient::Create(const std::string& target,
                                                                   const RouterClientOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("router client: target is empty");
  if (options.timeout_ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("router client: timeout_ms must be > 0, got ", options.timeout_ms));
  }
  const bool tls = !options.tls_root_certs_pem.empty();
  if (!tls && (!options.tls_client_cert_pem.empty() || !options.tls_client_key_pem.empty() ||
               !options.tls_server_name.empty())) {
    return absl::InvalidArgumentError(
        "router client: TLS client certificate, key or server name given without "
        "tls_root_certs_pem");
  }
  if (options.tls_client_cert_pem.empty() != options.tls_client_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "router client: mutual TLS needs both tls_client_cert_pem and tls_client_key_pem");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  grpc::ChannelArguments arguments;
  if (tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs_pem;
    ssl.pem_cert_chain = options.tls_client_cert_pem;
    ssl.pem_private_key = options.tls_client_key_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      arguments.SetSslTargetNameOverride(options.tls_server_name);
    }
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target, credentials, arguments);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("router client: cannot create a channel to '", target, "'"));
  }
  return std::unique_ptr<RouterClient>(new RouterClientImpl(target, std::move(channel), options.timeout_ms));
}

}  // namespace eldr::capture
