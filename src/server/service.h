// The gRPC services of eldr-router: thin callback-API adapters between eldr.v1 messages and the
// routing core (eldr::Router). They convert, call the core, count, and answer; none of them blocks
// a gRPC thread (the one blocking operation, ReloadCentroids, runs on a BlockingExecutor).
//
// Status codes (docs/api.md has the full table):
//   INVALID_ARGUMENT    malformed input, with the reason (counted in eldr_rejected_total{reason})
//   NOT_FOUND           unknown lease or worker
//   FAILED_PRECONDITION valid request the current state refuses (artifact rows vs workers)
//   UNAVAILABLE         no worker can take the request, or the daemon is shutting down
//   UNAUTHENTICATED / PERMISSION_DENIED   admin RPC without / with a wrong bearer token
#ifndef ELDR_SERVER_SERVICE_H_
#define ELDR_SERVER_SERVICE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "eldr/core/router.h"
#include "eldr/core/signature.h"
#include "eldr/v1/router.grpc.pb.h"
#include "eldr/v1/router.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/blocking_executor.h"
#include "server/metrics.h"

namespace eldr::server {

// Limits on RouteRequest fields that the schema cannot express.
inline constexpr size_t kMaxRequestIdBytes = 256;
// The data plane's transport accepts messages up to this many times --max_message_bytes, so that a
// request over the limit reaches the handler, which refuses it with INVALID_ARGUMENT (reason
// oversized, counted); gRPC itself refuses (RESOURCE_EXHAUSTED, before any handler) only what is
// larger still, which bounds what one request can make the router allocate.
inline constexpr int64_t kTransportMessageHeadroom = 4;
// layers * experts above this is rejected before any allocation (far beyond any real model).
inline constexpr int64_t kMaxSignatureCells = int64_t{1} << 24;

// The signature carried by `request`, as a view into it (valid while `request` lives).
// Returns false in *present when the request has none. INVALID_ARGUMENT (with a RejectReason) when
// the oneof is structurally unusable: counts without data, non-positive or absurd geometry.
// Values (negative counts, NaN, sizes against the calibrated geometry) are checked by the core.
absl::Status SignatureFromProto(const eldr::v1::RouteRequest& request, SignatureInput* input, bool* present);

// Compares without early exit: the time taken depends only on the length of `expected`.
bool ConstantTimeEquals(absl::string_view expected, absl::string_view given);

// Bearer-token check of admin RPCs. Thread-safe; Reload may run while checks happen.
class AdminAuthorizer {
 public:
  // Empty `token_file`: checks always pass. Otherwise the file must hold a non-empty token.
  static absl::StatusOr<std::unique_ptr<AdminAuthorizer>> Create(std::string token_file);

  bool enabled() const { return !token_file_.empty(); }
  // Re-reads the token file; on error the previous token stays in force.
  absl::Status Reload();
  // OK; UNAUTHENTICATED when the `authorization: Bearer <token>` metadata is absent or not a
  // bearer token; PERMISSION_DENIED when the token is wrong.
  grpc::Status Check(const grpc::CallbackServerContext& context) const;

 private:
  explicit AdminAuthorizer(std::string token_file) : token_file_(std::move(token_file)) {}

  const std::string token_file_;
  mutable absl::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
};

// What the services need from the server that owns them. Pointers are not owned and outlive the
// services.
struct ServiceContext {
  Router* router = nullptr;
  ServerMetrics* metrics = nullptr;
  PolicyKind configured_policy = PolicyKind::kEldr;
  const AdminAuthorizer* admin_auth = nullptr;  // null: admin RPCs are not checked
  // Largest serialized RouteRequest accepted (--max_message_bytes); 0: no check here.
  int64_t max_request_bytes = 0;
  BlockingExecutor* blocking = nullptr;
  // Loads and installs centroids: `path` (empty: the configured --centroids file) or, when
  // `inline_json` is set, that text. Blocking; called on `blocking`. Returns the installed
  // generation and rows.
  std::function<absl::StatusOr<std::pair<uint64_t, int>>(const std::string& path, const std::string* inline_json)>
      reload_centroids;
  // Called after the worker pool changed (upsert, drain, remove), to re-evaluate health.
  std::function<void()> on_pool_changed;
};

// eldr.v1.DecodeRouter: Route, Complete, ReportLoad.
class DecodeRouterService final : public eldr::v1::DecodeRouter::CallbackService {
 public:
  explicit DecodeRouterService(ServiceContext context);
  ~DecodeRouterService() override;

  grpc::ServerUnaryReactor* Route(grpc::CallbackServerContext* context, const eldr::v1::RouteRequest* request,
                                  eldr::v1::RouteResponse* response) override;
  grpc::ServerUnaryReactor* Complete(grpc::CallbackServerContext* context,
                                     const eldr::v1::CompleteRequest* request,
                                     eldr::v1::CompleteResponse* response) override;
  grpc::ServerReadReactor<eldr::v1::LoadReport>* ReportLoad(grpc::CallbackServerContext* context,
                                                            eldr::v1::ReportLoadResponse* response) override;

  // Ends every open ReportLoad stream with OK and its summary, and makes new streams end at once,
  // so a graceful shutdown does not wait for workers to hang up.
  void FinishStreamsForShutdown();

  // The conversion + routing step of Route (exposed for tests): fills `response` and, for the
  // metrics, `decided` (whose worker_id/address strings are moved into the response).
  absl::Status RouteOnce(const eldr::v1::RouteRequest& request, eldr::v1::RouteResponse* response,
                         RouteResult* decided);

 private:
  class LoadReportReactor;
  friend class LoadReportReactor;

  absl::Status ApplyReport(const eldr::v1::LoadReport& report);
  void StreamDone(LoadReportReactor* reactor);

  const ServiceContext ctx_;
  absl::Mutex streams_mu_;
  bool shutting_down_ ABSL_GUARDED_BY(streams_mu_) = false;
  absl::flat_hash_set<LoadReportReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
};

// eldr.v1.RouterAdmin. Mutations are serialised so that `created` / `dropped_leases` are exact.
class RouterAdminService final : public eldr::v1::RouterAdmin::CallbackService {
 public:
  explicit RouterAdminService(ServiceContext context);

  grpc::ServerUnaryReactor* ListWorkers(grpc::CallbackServerContext* context,
                                        const eldr::v1::ListWorkersRequest* request,
                                        eldr::v1::ListWorkersResponse* response) override;
  grpc::ServerUnaryReactor* UpsertWorker(grpc::CallbackServerContext* context,
                                         const eldr::v1::UpsertWorkerRequest* request,
                                         eldr::v1::UpsertWorkerResponse* response) override;
  grpc::ServerUnaryReactor* DrainWorker(grpc::CallbackServerContext* context,
                                        const eldr::v1::DrainWorkerRequest* request,
                                        eldr::v1::DrainWorkerResponse* response) override;
  grpc::ServerUnaryReactor* RemoveWorker(grpc::CallbackServerContext* context,
                                         const eldr::v1::RemoveWorkerRequest* request,
                                         eldr::v1::RemoveWorkerResponse* response) override;
  grpc::ServerUnaryReactor* ReloadCentroids(grpc::CallbackServerContext* context,
                                            const eldr::v1::ReloadCentroidsRequest* request,
                                            eldr::v1::ReloadCentroidsResponse* response) override;
  grpc::ServerUnaryReactor* GetState(grpc::CallbackServerContext* context,
                                     const eldr::v1::GetStateRequest* request,
                                     eldr::v1::GetStateResponse* response) override;

 private:
  // Runs the token check; on refusal finishes the reactor, counts, and returns false.
  bool Authorize(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor, absl::string_view method);

  const ServiceContext ctx_;
  absl::Mutex mutation_mu_;  // serialises UpsertWorker / DrainWorker / RemoveWorker
};

// Fills a WorkerState message from the core's view (shared by ListWorkers and GetState).
void WorkerStatusToProto(const WorkerStatus& status, absl::Time now, eldr::v1::WorkerState* out);

}  // namespace eldr::server

#endif  // ELDR_SERVER_SERVICE_H_
