// The gRPC services of eldr-router: thin callback-API adapters between eldr.v1 messages and the
// routing core (eldr::Router). They check credentials, convert, call the core, count and answer;
// none of them blocks a gRPC thread (centroid reloads are handed to the CentroidLoader's thread).
//
// The data-plane methods are registered raw (grpc::ByteBuffer in and out), so the services parse
// the messages themselves: an unparsable message is INVALID_ARGUMENT with a reason and counted
// (eldr_rejected_total{reason="malformed"}), and an oversized one is refused from its byte length
// before it is parsed.
//
// Status codes (docs/api.md has the full table):
//   INVALID_ARGUMENT    malformed input, with the reason (counted in eldr_rejected_total{reason})
//   NOT_FOUND           unknown lease or worker
//   FAILED_PRECONDITION valid request the current state refuses (artifact rows vs workers)
//   RESOURCE_EXHAUSTED  a limit: ReportLoad streams, the reload queue
//   UNAVAILABLE         no worker can take the request, or the daemon is shutting down
//   DEADLINE_EXCEEDED   a ReportLoad stream that stayed silent past its idle timeout
//   UNAUTHENTICATED / PERMISSION_DENIED   a call without / with wrong credentials
#ifndef ELDR_SERVER_SERVICE_H_
#define ELDR_SERVER_SERVICE_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "eldr/core/router.h"
#include "eldr/core/signature.h"
#include "eldr/v1/router.grpc.pb.h"
#include "eldr/v1/router.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/auth.h"
#include "server/centroid_loader.h"
#include "server/config.h"
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

// What the services need from the server that owns them. Pointers are not owned and outlive the
// services.
struct ServiceContext {
  Router* router = nullptr;
  ServerMetrics* metrics = nullptr;
  CentroidLoader* loader = nullptr;
  PolicyKind configured_policy = PolicyKind::kEldr;
  const BearerTokenFile* admin_token = nullptr;  // null or disabled: admin RPCs are not checked
  const BearerTokenFile* data_token = nullptr;   // null or disabled: data-plane RPCs are not checked
  ReporterAuth reporter_auth = ReporterAuth::kNone;
  const WorkerTokenFile* reporter_tokens = nullptr;  // reporter_auth == kToken
  bool mutual_tls = false;                           // client certificates are verified (identities are meaningful)
  bool route_client_keys = false;  // pass each Route's client key to the router (per-client refit admission)
  int64_t max_request_bytes = 0;   // largest serialized RouteRequest accepted (--max_message_bytes)
  int64_t max_report_streams = 1024;
  int64_t max_report_streams_per_peer = 64;
  absl::Duration report_stream_idle_timeout = absl::Minutes(2);
  // discovery=kubernetes: the pool follows the pods, so UpsertWorker, DrainWorker and RemoveWorker
  // answer FAILED_PRECONDITION (a change made here would be undone by the next watch event).
  bool pool_discovered = false;
};

// eldr.v1.DecodeRouter: Route, Complete, ReportLoad (raw methods, see above).
class DecodeRouterService final
    : public eldr::v1::DecodeRouter::WithRawCallbackMethod_Route<eldr::v1::DecodeRouter::WithRawCallbackMethod_Complete<
          eldr::v1::DecodeRouter::WithRawCallbackMethod_ReportLoad<eldr::v1::DecodeRouter::Service>>> {
 public:
  explicit DecodeRouterService(ServiceContext context);
  ~DecodeRouterService() override;

  grpc::ServerUnaryReactor* Route(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Complete(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* ReportLoad(grpc::CallbackServerContext* context,
                                                        grpc::ByteBuffer* response) override;

  // Ends every open ReportLoad stream with OK and its summary, and makes new streams end at once,
  // so a graceful shutdown does not wait for workers to hang up.
  void FinishStreamsForShutdown();
  // Ends the ReportLoad streams that received nothing for report_stream_idle_timeout (called
  // every second by the server).
  void EndIdleStreams(absl::Time now);

 private:
  class LoadReportReactor;
  friend class LoadReportReactor;

  // Parses and routes one request into `response`; fills `decided` for the metrics.
  absl::Status RouteOnce(grpc::CallbackServerContext* context, const grpc::ByteBuffer& request,
                         eldr::v1::RouteResponse* response, RouteResult* decided, std::string* request_id);
  // The data-plane token check; counts and logs a refusal.
  absl::Status CheckDataToken(const grpc::CallbackServerContext& context, absl::string_view method);
  // Applies one load report of a stream whose bearer token is `stream_token`.
  absl::Status ApplyReport(const grpc::CallbackServerContext& context, const eldr::v1::LoadReport& report,
                           const std::string& stream_token);
  void StreamDone(LoadReportReactor* reactor);

  const ServiceContext ctx_;
  absl::Mutex streams_mu_;
  bool shutting_down_ ABSL_GUARDED_BY(streams_mu_) = false;
  absl::flat_hash_set<LoadReportReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
  absl::flat_hash_map<std::string, int64_t> streams_per_peer_ ABSL_GUARDED_BY(streams_mu_);
};

// eldr.v1.RouterAdmin.
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
  grpc::ServerUnaryReactor* GetState(grpc::CallbackServerContext* context, const eldr::v1::GetStateRequest* request,
                                     eldr::v1::GetStateResponse* response) override;

 private:
  // Runs the token check; on refusal finishes the reactor, counts, logs (rate-limited) and
  // returns false.
  bool Authorize(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor, absl::string_view method);
  // False (and the call answered FAILED_PRECONDITION) when the pool is discovered.
  bool PoolIsStatic(grpc::ServerUnaryReactor* reactor, absl::string_view method);

  const ServiceContext ctx_;
};

// Fills a WorkerState message from the core's view (shared by ListWorkers and GetState).
void WorkerStatusToProto(const WorkerStatus& status, absl::Time now, eldr::v1::WorkerState* out);

}  // namespace eldr::server

#endif  // ELDR_SERVER_SERVICE_H_
