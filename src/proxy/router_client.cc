#include "router_client.h"

#include <chrono>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"

namespace eldr::proxy {
namespace {

// gRPC's status as an absl::Status (the codes have the same numbers).
absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::string> ReadSetting(const std::string& path, absl::string_view setting) {
  absl::StatusOr<std::string> text = ReadFile(path, 1 << 20);
  if (!text.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("--", setting, ": ", text.status().message()));
  }
  return text;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RouterClient>> RouterClient::Create(const RouterClientOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  // Routes are small and latency-bound: keep the connection warm between bursts.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  if (!options.tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    ELDR_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadSetting(options.tls_ca_file, "router_tls_ca"));
    if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
      ELDR_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadSetting(options.tls_cert_file, "router_tls_cert"));
      ELDR_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadSetting(options.tls_key_file, "router_tls_key"));
    }
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  }
  std::string bearer;
  if (!options.token_file.empty()) {
    absl::StatusOr<std::string> token = ReadSetting(options.token_file, "router_token_file");
    if (!token.ok()) return token.status();
    const absl::string_view trimmed = absl::StripAsciiWhitespace(*token);
    if (trimmed.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("--router_token_file: ", options.token_file, " is empty"));
    }
    bearer = absl::StrCat("Bearer ", trimmed);
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(options.target, credentials, args);
  return std::unique_ptr<RouterClient>(new RouterClient(options, std::move(channel), std::move(bearer)));
}

RouterClient::RouterClient(RouterClientOptions options, std::shared_ptr<grpc::Channel> channel, std::string bearer)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(eldr::v1::DecodeRouter::NewStub(channel_)),
      bearer_(std::move(bearer)) {}

std::unique_ptr<grpc::ClientContext> RouterClient::NewContext(absl::Duration timeout) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!bearer_.empty()) context->AddMetadata("authorization", bearer_);
  return context;
}

void RouterClient::Route(const eldr::v1::RouteRequest& request,
                         std::function<void(absl::StatusOr<eldr::v1::RouteResponse>)> done) {
  // The call's state lives until its callback ran.
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    eldr::v1::RouteRequest request;
    eldr::v1::RouteResponse response;
    std::function<void(absl::StatusOr<eldr::v1::RouteResponse>)> done;
  };
  auto* call = new Call{NewContext(options_.route_timeout), request, {}, std::move(done)};
  CallStarted();
  stub_->async()->Route(call->context.get(), &call->request, &call->response, [this, call](grpc::Status status) {
    std::unique_ptr<Call> owned(call);
    if (status.ok()) {
      owned->done(std::move(owned->response));
    } else {
      owned->done(FromGrpc(status));
    }
    CallEnded();
  });
}

void RouterClient::Complete(uint64_t lease_id, int64_t output_tokens, std::function<void(absl::Status)> done) {
  CompleteAttempt(lease_id, output_tokens, 0, std::move(done));
}

void RouterClient::CompleteAttempt(uint64_t lease_id, int64_t output_tokens, int attempt,
                                   std::function<void(absl::Status)> done) {
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    eldr::v1::CompleteRequest request;
    eldr::v1::CompleteResponse response;
  };
  auto* call = new Call{NewContext(options_.complete_timeout), {}, {}};
  CallStarted();
  call->request.set_lease_id(lease_id);
  call->request.set_output_tokens(output_tokens);
  stub_->async()->Complete(
      call->context.get(), &call->request, &call->response,
      [this, call, lease_id, output_tokens, attempt, done = std::move(done)](grpc::Status status) mutable {
        std::unique_ptr<Call> owned(call);
        const bool transient = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                               status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
        if (transient && attempt == 0) {
          // One more try: an unreleased lease inflates the worker's load until it expires.
          CompleteAttempt(lease_id, output_tokens, 1, std::move(done));
        } else if (done) {
          done(FromGrpc(status));
        }
        CallEnded();
      });
}

RouterClient::~RouterClient() {
  // Callbacks reference this client: wait for the calls in flight (each has a deadline).
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int64_t* calls) { return *calls == 0; }, &calls_in_flight_));
}

void RouterClient::CallStarted() {
  absl::MutexLock lock(&mu_);
  ++calls_in_flight_;
}

void RouterClient::CallEnded() {
  absl::MutexLock lock(&mu_);
  --calls_in_flight_;
}

bool RouterClient::Reachable() {
  const grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/true);
  return state != GRPC_CHANNEL_TRANSIENT_FAILURE && state != GRPC_CHANNEL_SHUTDOWN;
}

}  // namespace eldr::proxy
