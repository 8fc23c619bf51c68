#include "server/service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/errors.h"
#include "server/config.h"
#include "server/logging.h"
#include "server/status_conversion.h"

namespace eldr::server {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void SetString(std::string* out, absl::string_view value) { out->assign(value.data(), value.size()); }

absl::Status CheckGeometry(int32_t layers, int32_t experts) {
  if (layers <= 0 || experts <= 0) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrCat("counts: layers and experts must be positive, got ", layers, "x", experts));
  }
  if (int64_t{layers} * experts > kMaxSignatureCells) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrCat("counts: ", layers, "x", experts, " exceeds the largest supported geometry"));
  }
  return absl::OkStatus();
}

// A snapshot time in the future (clock skew between hosts) would stay "fresh" too long and hide
// leases acquired after it: it is taken as "now" instead.
absl::Time SnapshotTime(int64_t unix_us, absl::Time now) {
  if (unix_us == 0) return now;
  const absl::Time t = absl::FromUnixMicros(unix_us);
  return std::min(t, now);
}

}  // namespace

absl::Status SignatureFromProto(const eldr::v1::RouteRequest& request, SignatureInput* input, bool* present) {
  using eldr::v1::ExpertCounts;
  using eldr::v1::RouteRequest;
  *present = false;
  switch (request.signature_case()) {
    case RouteRequest::SIGNATURE_NOT_SET:
      return absl::OkStatus();
    case RouteRequest::kCounts: {
      const ExpertCounts& counts = request.counts();
      ELDR_RETURN_IF_ERROR(CheckGeometry(counts.layers(), counts.experts()));
      switch (counts.data_case()) {
        case ExpertCounts::kInt16Le:
          *input = CountsInt16Le{counts.layers(), counts.experts(), counts.int16_le()};
          break;
        case ExpertCounts::kValues: {
          const auto& values = counts.values().values();
          *input = CountsInt32{counts.layers(), counts.experts(),
                               absl::Span<const int32_t>(values.data(), static_cast<size_t>(values.size()))};
          break;
        }
        case ExpertCounts::DATA_NOT_SET:
          return InvalidInput(RejectReason::kMalformed, "counts: neither int16_le nor values is set");
      }
      *present = true;
      return absl::OkStatus();
    }
    case RouteRequest::kVector: {
      const auto& values = request.vector().values();
      *input = TransformedVector{absl::Span<const float>(values.data(), static_cast<size_t>(values.size()))};
      *present = true;
      return absl::OkStatus();
    }
  }
  return InvalidInput(RejectReason::kMalformed, "unknown signature kind");
}

bool ConstantTimeEquals(absl::string_view expected, absl::string_view given) {
  // Every byte of `expected` is visited whatever `given` holds; a length mismatch is folded into
  // the accumulator instead of returning early.
  volatile unsigned char diff = expected.size() == given.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff = diff | static_cast<unsigned char>(static_cast<unsigned char>(expected[i]) ^ g);
  }
  return diff == 0;
}

// ---------------------------------------------------------------------------------------------
// AdminAuthorizer

absl::StatusOr<std::unique_ptr<AdminAuthorizer>> AdminAuthorizer::Create(std::string token_file) {
  std::unique_ptr<AdminAuthorizer> auth(new AdminAuthorizer(std::move(token_file)));
  if (auth->enabled()) ELDR_RETURN_IF_ERROR(auth->Reload());
  return auth;
}

absl::Status AdminAuthorizer::Reload() {
  if (!enabled()) return absl::OkStatus();
  ELDR_ASSIGN_OR_RETURN(const std::string text, ReadFile(token_file_));
  const absl::string_view token = absl::StripAsciiWhitespace(text);
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("admin_token_file ", token_file_, ": the token is empty"));
  }
  absl::MutexLock lock(&mu_);
  token_ = std::string(token);
  return absl::OkStatus();
}

grpc::Status AdminAuthorizer::Check(const grpc::CallbackServerContext& context) const {
  if (!enabled()) return grpc::Status::OK;
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "admin RPCs need the metadata 'authorization: Bearer <token>'");
  }
  absl::string_view value(it->second.data(), it->second.size());
  value = absl::StripAsciiWhitespace(value);
  // The scheme is case-insensitive (RFC 7235).
  if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "authorization metadata is not a bearer token");
  }
  const absl::string_view given = absl::StripLeadingAsciiWhitespace(value.substr(7));
  absl::MutexLock lock(&mu_);
  if (!ConstantTimeEquals(token_, given)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "wrong admin token");
  }
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------------------------
// DecodeRouterService

// One ReportLoad stream. Reactions never run inline on the thread that calls StartRead/Finish
// (gRPC dispatches them), so holding mu_ around those calls cannot deadlock.
class DecodeRouterService::LoadReportReactor final : public grpc::ServerReadReactor<eldr::v1::LoadReport> {
 public:
  LoadReportReactor(DecodeRouterService* service, grpc::CallbackServerContext* context,
                    eldr::v1::ReportLoadResponse* response)
      : service_(service), peer_(context->peer()), response_(response) {}

  void Begin(bool finish_now) {
    absl::MutexLock lock(&mu_);
    if (finished_) return;  // a shutdown got to it first
    if (finish_now) {
      FinishLocked(grpc::Status::OK);
    } else {
      StartRead(&report_);
    }
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    // After Finish the response is being sent: a report that still arrives is not applied, so
    // the summary the client gets is the one that was serialised.
    if (finished_) return;
    if (!ok) {  // the client half-closed, or the call is gone
      FinishLocked(grpc::Status::OK);
      return;
    }
    const absl::Status status = service_->ApplyReport(report_);
    if (status.ok()) {
      response_->set_accepted(response_->accepted() + 1);
    } else {
      response_->set_rejected(response_->rejected() + 1);
      SetString(response_->mutable_last_error(), status.message());
      ELDR_LOG(Debug, "load_report_rejected").With("peer", peer_).With("worker", report_.worker_id()).With("code", status);
    }
    StartRead(&report_);
  }

  void FinishForShutdown() {
    absl::MutexLock lock(&mu_);
    FinishLocked(grpc::Status::OK);
  }

  void OnDone() override {
    service_->StreamDone(this);
    delete this;
  }

 private:
  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  DecodeRouterService* const service_;
  const std::string peer_;
  eldr::v1::ReportLoadResponse* const response_;
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  eldr::v1::LoadReport report_;
};

DecodeRouterService::DecodeRouterService(ServiceContext context) : ctx_(std::move(context)) {}

DecodeRouterService::~DecodeRouterService() = default;

absl::Status DecodeRouterService::RouteOnce(const eldr::v1::RouteRequest& request,
                                            eldr::v1::RouteResponse* response, RouteResult* decided) {
  if (ctx_.max_request_bytes > 0) {
    // A cheap upper bound first (a packed int32 takes at most 10 bytes); the exact size only when
    // the bound is over the limit, which keeps ByteSizeLong's walk over packed values off the
    // common path.
    using eldr::v1::RouteRequest;
    const RouteRequest::SignatureCase kind = request.signature_case();
    const int64_t bound =
        64 + static_cast<int64_t>(request.request_id().size()) +
        (kind == RouteRequest::kCounts ? static_cast<int64_t>(request.counts().int16_le().size()) +
                                             10 * int64_t{request.counts().values().values_size()}
                                       : 0) +
        (kind == RouteRequest::kVector ? 4 * int64_t{request.vector().values_size()} : 0);
    if (bound > ctx_.max_request_bytes) {
      const int64_t size = static_cast<int64_t>(request.ByteSizeLong());
      if (size > ctx_.max_request_bytes) {
        return MakeInputError(absl::StatusCode::kInvalidArgument, RejectReason::kOversized,
                              absl::StrCat("RouteRequest is ", size, " bytes; the router accepts at most ",
                                           ctx_.max_request_bytes, " (--max_message_bytes)"));
      }
    }
  }
  if (request.request_id().size() > kMaxRequestIdBytes) {
    return MakeInputError(absl::StatusCode::kInvalidArgument, RejectReason::kOversized,
                          absl::StrCat("request_id is ", request.request_id().size(), " bytes; at most ",
                                       kMaxRequestIdBytes, " are allowed"));
  }
  if (request.prompt_tokens() < 0) {
    return InvalidInput(RejectReason::kNegativeCount,
                        absl::StrCat("prompt_tokens must not be negative, got ", request.prompt_tokens()));
  }
  SignatureInput input;
  bool present = false;
  ELDR_RETURN_IF_ERROR(SignatureFromProto(request, &input, &present));
  absl::StatusOr<RouteResult> result = ctx_.router->Route(present ? &input : nullptr, absl::Now());
  if (!result.ok()) return result.status();
  RouteResult& r = *result;
  *response->mutable_worker_id() = std::move(r.worker_id);
  *response->mutable_address() = std::move(r.address);
  response->set_lease_id(r.lease_id);
  response->set_similarity(r.similarity);
  response->set_band_size(r.band_size);
  SetString(response->mutable_policy(), PolicyKindName(r.policy));
  SetString(response->mutable_fallback_reason(), FallbackReasonLabel(r.fallback));
  response->set_centroid_generation(r.centroid_generation);
  *decided = std::move(r);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* DecodeRouterService::Route(grpc::CallbackServerContext* context,
                                                     const eldr::v1::RouteRequest* request,
                                                     eldr::v1::RouteResponse* response) {
  const Clock::time_point start = Clock::now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RouteResult decided;
  const absl::Status status = RouteOnce(*request, response, &decided);
  const double seconds = SecondsSince(start);
  if (status.ok()) {
    ctx_.metrics->RecordRoute(decided, seconds);
  } else {
    ctx_.metrics->RecordRouteFailure(ctx_.configured_policy, status, seconds);
    ELDR_LOG(Debug, "route_failed")
        .With("request_id", request->request_id())
        .With("reason", RejectReasonLabel(RejectReasonOf(status)))
        .With("code", status);
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* DecodeRouterService::Complete(grpc::CallbackServerContext* context,
                                                        const eldr::v1::CompleteRequest* request,
                                                        eldr::v1::CompleteResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status;
  if (request->output_tokens() < 0) {
    status = InvalidInput(RejectReason::kNegativeCount,
                          absl::StrCat("output_tokens must not be negative, got ", request->output_tokens()));
    ctx_.metrics->RecordRejected(RejectReason::kNegativeCount);
  } else {
    absl::StatusOr<std::string> worker = ctx_.router->CompleteLease(request->lease_id());
    status = worker.status();
    if (worker.ok()) *response->mutable_worker_id() = *std::move(worker);
    ctx_.metrics->RecordComplete(status.ok());
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::Status DecodeRouterService::ApplyReport(const eldr::v1::LoadReport& report) {
  const absl::Time now = absl::Now();
  absl::Status status;
  if (report.worker_id().empty()) {
    status = InvalidInput(RejectReason::kUnknownWorker, "load report without worker_id");
  } else if (!std::isfinite(report.running()) || !std::isfinite(report.waiting()) ||
             !std::isfinite(report.kv_usage())) {
    status = InvalidInput(RejectReason::kNonFinite,
                          absl::StrCat("load report of '", report.worker_id(), "': non-finite value"));
  } else if (report.running() < 0 || report.waiting() < 0 || report.kv_usage() < 0) {
    status = InvalidInput(RejectReason::kNegativeCount,
                          absl::StrCat("load report of '", report.worker_id(), "': negative value"));
  } else {
    LoadSnapshot snapshot;
    snapshot.running = report.running();
    snapshot.waiting = report.waiting();
    snapshot.kv_usage = report.kv_usage();
    snapshot.taken_at = SnapshotTime(report.snapshot_time_unix_us(), now);
    status = ctx_.router->ReportLoad(report.worker_id(), snapshot);
    if (absl::IsNotFound(status)) {
      status = MakeInputError(absl::StatusCode::kNotFound, RejectReason::kUnknownWorker, status.message());
    }
  }
  ctx_.metrics->RecordLoadReport(status.ok());
  if (!status.ok()) ctx_.metrics->RecordRejected(RejectReasonOf(status));
  return status;
}

grpc::ServerReadReactor<eldr::v1::LoadReport>* DecodeRouterService::ReportLoad(
    grpc::CallbackServerContext* context, eldr::v1::ReportLoadResponse* response) {
  auto* reactor = new LoadReportReactor(this, context, response);
  bool finish_now = false;
  {
    absl::MutexLock lock(&streams_mu_);
    finish_now = shutting_down_;
    streams_.insert(reactor);
  }
  reactor->Begin(finish_now);
  return reactor;
}

void DecodeRouterService::StreamDone(LoadReportReactor* reactor) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(reactor);
}

void DecodeRouterService::FinishStreamsForShutdown() {
  // Reactors delete themselves in OnDone after removing themselves from streams_ under
  // streams_mu_; holding it here keeps every listed reactor alive while it is asked to finish.
  absl::MutexLock lock(&streams_mu_);
  shutting_down_ = true;
  for (LoadReportReactor* reactor : streams_) reactor->FinishForShutdown();
}

// ---------------------------------------------------------------------------------------------
// RouterAdminService

void WorkerStatusToProto(const WorkerStatus& status, absl::Time now, eldr::v1::WorkerState* out) {
  eldr::v1::Worker* worker = out->mutable_worker();
  worker->set_id(status.spec.id);
  worker->set_address(status.spec.address);
  worker->set_capacity(status.spec.capacity);
  worker->set_max_inflight(status.spec.max_inflight);
  out->set_state(status.state == WorkerState::kDraining ? "draining" : "active");
  out->set_healthy(status.healthy);
  out->set_has_centroid(status.has_centroid);
  out->set_inflight(status.load.leases);
  if (status.load.snapshot.has_value()) {
    out->set_reported_load(status.load.snapshot->running + status.load.snapshot->waiting);
    out->set_reported_kv_usage(status.load.snapshot->kv_usage);
    out->set_report_age_seconds(absl::ToDoubleSeconds(now - status.load.snapshot->taken_at));
  } else {
    out->set_report_age_seconds(-1);
  }
  out->set_effective_load(status.load.effective);
}

RouterAdminService::RouterAdminService(ServiceContext context) : ctx_(std::move(context)) {}

bool RouterAdminService::Authorize(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                                   absl::string_view method) {
  if (ctx_.admin_auth == nullptr) return true;
  grpc::Status status = ctx_.admin_auth->Check(*context);
  if (status.ok()) return true;
  const bool missing = status.error_code() == grpc::StatusCode::UNAUTHENTICATED;
  ctx_.metrics->RecordAdminRefused(missing);
  ELDR_LOG(Warning, "admin_refused")
      .With("method", method)
      .With("peer", context->peer())
      .With("code", missing ? "UNAUTHENTICATED" : "PERMISSION_DENIED");
  reactor->Finish(status);
  return false;
}

grpc::ServerUnaryReactor* RouterAdminService::ListWorkers(grpc::CallbackServerContext* context,
                                                          const eldr::v1::ListWorkersRequest*,
                                                          eldr::v1::ListWorkersResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorize(context, reactor, "ListWorkers")) return reactor;
  const absl::Time now = absl::Now();
  const RouterState state = ctx_.router->GetState(now);
  for (const WorkerStatus& w : state.workers) WorkerStatusToProto(w, now, response->add_workers());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* RouterAdminService::UpsertWorker(grpc::CallbackServerContext* context,
                                                           const eldr::v1::UpsertWorkerRequest* request,
                                                           eldr::v1::UpsertWorkerResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorize(context, reactor, "UpsertWorker")) return reactor;
  const eldr::v1::Worker& w = request->worker();
  WorkerSpec spec;
  spec.id = w.id();
  spec.address = w.address();
  spec.capacity = w.capacity() == 0 ? 1.0 : w.capacity();  // proto3 default: unset means 1
  spec.max_inflight = w.max_inflight();
  absl::Status status = ValidateWorkerSpec(spec);
  if (status.ok()) {
    absl::MutexLock lock(&mutation_mu_);
    bool existed = false;
    for (const WorkerStatus& ws : ctx_.router->GetState(absl::Now()).workers) {
      if (ws.spec.id == spec.id) existed = true;
    }
    status = ctx_.router->UpsertWorker(spec);
    if (status.ok()) response->set_created(!existed);
  } else {
    ctx_.metrics->RecordRejected(RejectReason::kMalformed);
  }
  if (status.ok()) {
    ELDR_LOG(Info, "worker_upserted")
        .With("worker", spec.id)
        .With("address", spec.address)
        .With("capacity", spec.capacity)
        .With("max_inflight", spec.max_inflight)
        .With("created", response->created());
    if (ctx_.on_pool_changed) ctx_.on_pool_changed();
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* RouterAdminService::DrainWorker(grpc::CallbackServerContext* context,
                                                          const eldr::v1::DrainWorkerRequest* request,
                                                          eldr::v1::DrainWorkerResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorize(context, reactor, "DrainWorker")) return reactor;
  absl::Status status;
  {
    absl::MutexLock lock(&mutation_mu_);
    status = ctx_.router->DrainWorker(request->worker_id());
    if (status.ok()) {
      for (const WorkerStatus& ws : ctx_.router->GetState(absl::Now()).workers) {
        if (ws.spec.id == request->worker_id()) response->set_inflight(ws.load.leases);
      }
    }
  }
  if (status.ok()) {
    ELDR_LOG(Info, "worker_draining").With("worker", request->worker_id()).With("inflight", response->inflight());
    if (ctx_.on_pool_changed) ctx_.on_pool_changed();
  } else if (absl::IsNotFound(status)) {
    ctx_.metrics->RecordRejected(RejectReason::kUnknownWorker);
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* RouterAdminService::RemoveWorker(grpc::CallbackServerContext* context,
                                                           const eldr::v1::RemoveWorkerRequest* request,
                                                           eldr::v1::RemoveWorkerResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorize(context, reactor, "RemoveWorker")) return reactor;
  absl::Status status;
  {
    absl::MutexLock lock(&mutation_mu_);
    int64_t inflight = 0;
    for (const WorkerStatus& ws : ctx_.router->GetState(absl::Now()).workers) {
      if (ws.spec.id == request->worker_id()) inflight = ws.load.leases;
    }
    status = ctx_.router->RemoveWorker(request->worker_id());
    if (status.ok()) response->set_dropped_leases(inflight);
  }
  if (status.ok()) {
    ELDR_LOG(Info, "worker_removed")
        .With("worker", request->worker_id())
        .With("dropped_leases", response->dropped_leases());
    if (ctx_.on_pool_changed) ctx_.on_pool_changed();
  } else if (absl::IsNotFound(status)) {
    ctx_.metrics->RecordRejected(RejectReason::kUnknownWorker);
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* RouterAdminService::ReloadCentroids(grpc::CallbackServerContext* context,
                                                              const eldr::v1::ReloadCentroidsRequest* request,
                                                              eldr::v1::ReloadCentroidsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorize(context, reactor, "ReloadCentroids")) return reactor;
  // Reading and indexing an artifact blocks: it runs on the blocking executor, which answers.
  // The request and response live until the reactor finishes.
  const bool queued = ctx_.blocking->Submit([this, reactor, request, response] {
    const bool is_inline = request->source_case() == eldr::v1::ReloadCentroidsRequest::kArtifactJson;
    auto result = ctx_.reload_centroids(is_inline ? std::string() : request->path(),
                                        is_inline ? &request->artifact_json() : nullptr);
    if (result.ok()) {
      response->set_centroid_generation(result->first);
      response->set_rows(result->second);
    }
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  if (!queued) reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is shutting down"));
  return reactor;
}

grpc::ServerUnaryReactor* RouterAdminService::GetState(grpc::CallbackServerContext* context,
                                                       const eldr::v1::GetStateRequest*,
                                                       eldr::v1::GetStateResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorize(context, reactor, "GetState")) return reactor;
  const absl::Time now = absl::Now();
  const RouterState state = ctx_.router->GetState(now);
  SetString(response->mutable_policy(), PolicyKindName(state.policy));
  response->set_tau(state.tau);
  response->set_centroid_generation(state.centroid_generation);
  response->set_centroid_rows(state.centroid_rows);
  response->set_index_kind(state.index_kind);
  for (const WorkerStatus& w : state.workers) WorkerStatusToProto(w, now, response->add_workers());
  response->set_live_leases(state.live_leases);
  response->set_leases_expired_total(state.leases_expired_total);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace eldr::server
