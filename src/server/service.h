// The gRPC services of eldr-router: thin callback-API adapters between eldr.v1 messages and the
// routing core (eldr::Router). They check credentials, convert, call the core, count and answer;
// none of them blocks a gRPC thread (centroid reloads are handed to the CentroidLoader's thread).
//
// The data-plane methods are registered raw (grpc::ByteBuffer in and out), so the services parse
// the messages themselves: an unparsable message is INVALID_ARGUMENT with a reason and counted
// (eldr_rejected_total{reason="malformed"}), and an oversized one is refused from its byte length
// before it is parsed.
//
// RouteStream carries Route and Complete as messages of one bidirectional stream. Each message goes
// through the same function as its unary RPC (RouteMessage, CompleteMessage: validation, the core
// call, metrics, the failure log), and its status becomes the message's error through the same
// ToGrpcStatus. A message may carry a batch (RouteStreamBatch): its entries are handled in order,
// each exactly as a message of its own (the same functions, metrics and error conversion), and
// their answers go out in one message, one write; a batch of more than --max_stream_batch entries
// is refused whole with one INVALID_ARGUMENT before any entry is handled, an entry that is a batch
// itself is INVALID_ARGUMENT for that entry. Contract of a stream (docs/api.md, "RouteStream"):
//  - answers are written in the order the requests were read (the core answers synchronously);
//  - flow control: the next message is read while earlier answers are still being written, up to
//    kRouteStreamMaxPending answers waiting; then reading pauses until the client reads (HTTP/2 flow
//    control then holds back its writes), so a client that stops reading stalls only its own stream;
//  - the client half-closes: every message read is answered, then the stream ends OK;
//  - cancellation (or a lost connection): answers not yet handed to gRPC are dropped and the leases
//    of dropped Route answers released (eldr_route_stream_undelivered_total, per request: each
//    entry of a dropped batch answer counts);
//  - shutdown (FinishStreamsForShutdown): no further message is read, everything read is answered,
//    then the stream ends UNAVAILABLE (retry what was not answered on another replica);
//  - credentials (data-plane token) are checked once when the stream opens, like ReportLoad.
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
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
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
// Answers of one RouteStream that may wait to be written before the stream stops reading.
inline constexpr size_t kRouteStreamMaxPending = 64;

// The signature carried by `request`, as a view into it (valid while `request` lives), except
// gate-probability sums: their float32_le bytes are decoded into `*gate_prob_scratch` (resized;
// the view points there, valid while both live). Returns false in *present when the request has
// none. INVALID_ARGUMENT (with a RejectReason) when the oneof is structurally unusable: counts
// without data, non-positive or absurd geometry, gate sums whose byte length is not a multiple of
// 4. Values (negative counts or sums, NaN, sizes against the calibrated geometry, integer counts
// against gate_prob or gate sums against a count variant) are checked by the core.
absl::Status SignatureFromProto(const eldr::v1::RouteRequest& request, SignatureInput* input, bool* present,
                                std::vector<float>* gate_prob_scratch);

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
  int64_t max_stream_batch = 256;  // entries of one RouteStreamBatch at most (--max_stream_batch)
  int64_t max_report_streams = 1024;
  int64_t max_report_streams_per_peer = 64;
  absl::Duration report_stream_idle_timeout = absl::Minutes(2);
  // discovery=kubernetes: the pool follows the pods, so UpsertWorker, DrainWorker and RemoveWorker
  // answer FAILED_PRECONDITION (a change made here would be undone by the next watch event).
  bool pool_discovered = false;
};

// One request answered on a RouteStream (a message of its own, or an entry of a batch): what it
// asked for, and the lease of a successful Route (0 otherwise), released if its answer is never
// delivered.
struct StreamDelivery {
  StreamMessageKind kind = StreamMessageKind::kNone;
  uint64_t lease = 0;
};
// The requests one answer message carries: one for a single message, one per entry of a batch
// (none for an empty or refused batch). Inline for the single message: no allocation per message.
using StreamDeliveries = absl::InlinedVector<StreamDelivery, 1>;

// eldr.v1.DecodeRouter: Route, Complete, RouteStream, ReportLoad (raw methods, see above).
class DecodeRouterService final
    : public eldr::v1::DecodeRouter::WithRawCallbackMethod_Route<eldr::v1::DecodeRouter::WithRawCallbackMethod_Complete<
          eldr::v1::DecodeRouter::WithRawCallbackMethod_RouteStream<
              eldr::v1::DecodeRouter::WithRawCallbackMethod_ReportLoad<eldr::v1::DecodeRouter::Service>>>> {
 public:
  explicit DecodeRouterService(ServiceContext context);
  ~DecodeRouterService() override;

  grpc::ServerUnaryReactor* Route(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Complete(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RouteStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* ReportLoad(grpc::CallbackServerContext* context,
                                                        grpc::ByteBuffer* response) override;

  // Ends every open ReportLoad stream with OK and its summary, drains every RouteStream (no more
  // reads; what was read is answered, then UNAVAILABLE), and makes new streams end at once, so a
  // graceful shutdown does not wait for clients to hang up.
  void FinishStreamsForShutdown();
  // Ends the ReportLoad streams that received nothing for report_stream_idle_timeout (called
  // every second by the server).
  void EndIdleStreams(absl::Time now);

 private:
  class LoadReportReactor;
  friend class LoadReportReactor;
  class RouteStreamReactor;
  friend class RouteStreamReactor;

  // One Route, unary or streamed, from the credential check's verdict `admitted` on: the size
  // limit (`bytes`: the serialized RouteRequest), the request (`parse` yields it, valid for the
  // call), validation, the core's decision, the metrics and the failure log. `client` is the
  // caller's key for the router (RouteClientKey). Fills `response` on success.
  absl::Status RouteMessage(absl::string_view client, absl::Status admitted, int64_t bytes,
                            absl::FunctionRef<absl::Status(const eldr::v1::RouteRequest**)> parse,
                            eldr::v1::RouteResponse* response);
  // Validates one parsed request and routes it into `response`; fills `decided` for the metrics.
  absl::Status ValidateAndRoute(absl::string_view client, const eldr::v1::RouteRequest& request,
                                eldr::v1::RouteResponse* response, RouteResult* decided);
  // One Complete, unary or streamed, from the credential check's verdict on: the request (`parse`
  // yields it; a failure counts as malformed), validation, the release and its metrics.
  absl::Status CompleteMessage(absl::Status admitted,
                               absl::FunctionRef<absl::Status(const eldr::v1::CompleteRequest**)> parse,
                               eldr::v1::CompleteResponse* response);
  // One RouteStream message (`frame`, a serialized RouteStreamRequest) answered into `answer`
  // (a serialized RouteStreamResponse): a single request through AnswerStreamRequest, a batch
  // through AnswerStreamBatch. `request` and `response` are the stream's scratch messages (reused,
  // so that a stream's steady state allocates little). Fills *delivered with the requests the
  // answer carries. Returns whether to send the answer: false only for an errors_only message all of
  // whose requests succeeded (then `answer` is not written).
  bool AnswerStreamMessage(absl::string_view client, const grpc::ByteBuffer& frame,
                           eldr::v1::RouteStreamRequest* request, eldr::v1::RouteStreamResponse* response,
                           grpc::ByteBuffer* answer, StreamDeliveries* delivered);
  // One request, a message of its own or an entry of a batch, answered into `response` (its id,
  // then its route, complete or error) through RouteMessage or CompleteMessage, and counted in
  // eldr_route_stream_messages_total. `frame_bytes` is the size of the whole message the request
  // came in: when it is within --max_message_bytes, so is the request (its own size is computed
  // only otherwise). A request that is a batch is INVALID_ARGUMENT: only entries get here with one.
  StreamDelivery AnswerStreamRequest(absl::string_view client, const eldr::v1::RouteStreamRequest& request,
                                     int64_t frame_bytes, eldr::v1::RouteStreamResponse* response);
  // A batch message answered into `response`: refused whole (one INVALID_ARGUMENT error for its
  // id) beyond max_stream_batch entries, otherwise every entry in order into response->batch().
  void AnswerStreamBatch(absl::string_view client, const eldr::v1::RouteStreamRequest& request, int64_t frame_bytes,
                         eldr::v1::RouteStreamResponse* response, StreamDeliveries* delivered);
  // The key Route passes to the router for this caller: empty unless route_client_keys.
  std::string RouteClientKey(const grpc::CallbackServerContext& context) const;
  // The data-plane token check; counts and logs a refusal.
  absl::Status CheckDataToken(const grpc::CallbackServerContext& context, absl::string_view method);
  // Applies one load report of a stream whose bearer token is `stream_token`.
  absl::Status ApplyReport(const grpc::CallbackServerContext& context, const eldr::v1::LoadReport& report,
                           const std::string& stream_token);
  void StreamDone(LoadReportReactor* reactor);
  void RouteStreamDone(RouteStreamReactor* reactor);
  // The requests of an answer that its stream could not deliver: each counted, and its Route lease
  // (when not 0) released.
  void ReleaseUndelivered(const StreamDeliveries& delivered);

  const ServiceContext ctx_;
  absl::Mutex streams_mu_;
  bool shutting_down_ ABSL_GUARDED_BY(streams_mu_) = false;
  absl::flat_hash_set<LoadReportReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
  absl::flat_hash_set<RouteStreamReactor*> route_streams_ ABSL_GUARDED_BY(streams_mu_);
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
