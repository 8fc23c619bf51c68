#include "server/service.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "eldr/core/errors.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "server/logging.h"
#include "server/status_conversion.h"

namespace eldr::server {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

void SetString(std::string* out, absl::string_view value) { out->assign(value.data(), value.size()); }

// What a log line may show of a caller-chosen string: bounded and escaped.
std::string Shown(absl::string_view text) {
  constexpr size_t kShown = 64;
  return text.size() <= kShown ? absl::CHexEscape(text) : absl::StrCat(absl::CHexEscape(text.substr(0, kShown)), "...");
}

// Counts name their geometry, or 0 x 0 for "the calibrated geometry" (eldr/core/signature.h).
absl::Status CheckGeometry(int32_t layers, int32_t experts) {
  if (layers == 0 && experts == 0) return absl::OkStatus();
  if (layers <= 0 || experts <= 0) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrCat("counts: layers and experts must be positive (or both 0: the calibrated "
                                     "geometry), got ",
                                     layers, "x", experts));
  }
  if (int64_t{layers} * experts > kMaxSignatureCells) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrCat("counts: ", layers, "x", experts, " exceeds the largest supported geometry"));
  }
  return absl::OkStatus();
}

// Parses a raw request; INVALID_ARGUMENT (kMalformed) naming the message type when it is not one.
template <typename Message>
absl::Status ParseRaw(const grpc::ByteBuffer& buffer, Message* message) {
  grpc::ByteBuffer copy(buffer);  // slices are shared, not copied
  grpc::ProtoBufferReader reader(&copy);
  if (!message->ParseFromZeroCopyStream(&reader)) {
    return InvalidInput(RejectReason::kMalformed,
                        absl::StrCat("the request is not a valid ", Message::descriptor()->full_name(), " message"));
  }
  return absl::OkStatus();
}

// A `parse` callback of RouteMessage/CompleteMessage that parses `raw` into `*into`.
template <typename Message>
auto ParseInto(const grpc::ByteBuffer& raw, Message* into) {
  return [&raw, into](const Message** out) -> absl::Status {
    ELDR_RETURN_IF_ERROR(ParseRaw(raw, into));
    *out = into;
    return absl::OkStatus();
  };
}

// A `parse` callback of RouteMessage/CompleteMessage for a message parsed already.
template <typename Message>
auto Parsed(const Message& message) {
  return [&message](const Message** out) -> absl::Status {
    *out = &message;
    return absl::OkStatus();
  };
}

// How a RouteStream ends when the daemon shuts down.
grpc::Status RouteStreamShutdownStatus() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "eldr-router is shutting down: every request it read on this stream was answered; send the "
                      "unanswered ones to another replica");
}

// A RouteStream request's failure as its answer: the code and message the unary RPC would end
// with, through the same ToGrpcStatus.
void SetStreamError(const absl::Status& status, eldr::v1::RouteStreamResponse* response) {
  const grpc::Status wire = ToGrpcStatus(status);
  eldr::v1::RouteStreamError* error = response->mutable_error();
  error->set_code(static_cast<int32_t>(wire.error_code()));
  SetString(error->mutable_message(), wire.error_message());
}

template <typename Message>
void SerializeRaw(const Message& message, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  (void)grpc::SerializationTraits<Message>::Serialize(message, out, &own_buffer);
}

// A refused credential: counted by plane, logged at most --log_rate_limit times a second per
// method and code.
void RecordRefusal(ServerMetrics* metrics, AuthPlane plane, absl::string_view method, const absl::Status& status,
                   const grpc::CallbackServerContext& context) {
  const bool missing = absl::IsUnauthenticated(status);
  metrics->RecordAuthRefused(plane, missing);
  ELDR_LOG_LIMITED(Warning, plane == AuthPlane::kAdmin ? "admin_refused" : "data_plane_refused",
                   absl::StrCat("refused/", method, "/", missing ? "unauthenticated" : "permission_denied"))
      .With("method", method)
      .With("peer", context.peer())
      .With("code", missing ? "UNAUTHENTICATED" : "PERMISSION_DENIED");
}

}  // namespace

absl::Status SignatureFromProto(const eldr::v1::RouteRequest& request, SignatureInput* input, bool* present,
                                std::vector<float>* gate_prob_scratch) {
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
    case RouteRequest::kGateProbSums: {
      const eldr::v1::GateProbSums& sums = request.gate_prob_sums();
      ELDR_RETURN_IF_ERROR(CheckGeometry(sums.layers(), sums.experts()));
      const std::string& bytes = sums.float32_le();
      if (bytes.size() % 4 != 0) {
        return InvalidInput(RejectReason::kGeometry,
                            absl::StrCat("gate_prob_sums: float32_le holds ", bytes.size(),
                                         " bytes, not a whole number of float32 values (4 bytes each)"));
      }
      if (bytes.size() / 4 > static_cast<size_t>(kMaxSignatureCells)) {
        return InvalidInput(RejectReason::kGeometry, absl::StrCat("gate_prob_sums: ", bytes.size() / 4,
                                                                  " values exceed the largest supported geometry"));
      }
      // Little-endian IEEE-754 bits whatever the host's byte order; copied (the bytes need not be
      // aligned for float).
      gate_prob_scratch->resize(bytes.size() / 4);
      for (size_t i = 0; i < gate_prob_scratch->size(); ++i) {
        uint32_t bits = 0;
        for (int b = 3; b >= 0; --b) bits = (bits << 8) | static_cast<uint8_t>(bytes[4 * i + b]);
        std::memcpy(&(*gate_prob_scratch)[i], &bits, sizeof(bits));
      }
      *input = GateProbSums{sums.layers(), sums.experts(), *gate_prob_scratch};
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

// ---------------------------------------------------------------------------------------------
// DecodeRouterService

// One ReportLoad stream. Reactions never run inline on the thread that calls StartRead/Finish
// (gRPC dispatches them), so holding mu_ around those calls cannot deadlock.
class DecodeRouterService::LoadReportReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  LoadReportReactor(DecodeRouterService* service, grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
                    std::string peer_key)
      : service_(service), context_(context), peer_key_(std::move(peer_key)), response_(response) {
    if (absl::StatusOr<std::string> token = BearerTokenOf(*context); token.ok()) stream_token_ = *std::move(token);
    last_activity_ = absl::Now();
  }

  const std::string& peer_key() const { return peer_key_; }

  // Starts reading, or ends the stream at once with `finish_now`.
  void Begin(const std::optional<grpc::Status>& finish_now) {
    absl::MutexLock lock(&mu_);
    if (finished_) return;  // a shutdown got to it first
    if (finish_now.has_value()) {
      FinishLocked(*finish_now);
    } else {
      StartRead(&buffer_);
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
    last_activity_ = absl::Now();
    eldr::v1::LoadReport report;
    absl::Status status = ParseRaw(buffer_, &report);
    if (status.ok()) {
      status = service_->ApplyReport(*context_, report, stream_token_);
    } else {
      service_->ctx_.metrics->RecordLoadReport(false);
      service_->ctx_.metrics->RecordRejected(RejectReason::kMalformed);
    }
    if (status.ok()) {
      summary_.set_accepted(summary_.accepted() + 1);
    } else {
      summary_.set_rejected(summary_.rejected() + 1);
      SetString(summary_.mutable_last_error(), status.message());
      ELDR_LOG(Debug, "load_report_rejected")
          .With("peer", peer_key_)
          .With("worker", Shown(report.worker_id()))
          .With("code", status);
    }
    StartRead(&buffer_);
  }

  void FinishForShutdown() {
    absl::MutexLock lock(&mu_);
    FinishLocked(grpc::Status::OK);
  }

  // Ends the stream when it received nothing since `cutoff`, counted before the client can see the
  // status (a client that got it and scrapes finds it counted).
  void FinishIfIdleSince(absl::Time cutoff, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    if (finished_ || last_activity_ >= cutoff) return;
    service_->ctx_.metrics->RecordReportStreamIdleEnded();
    FinishLocked(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                              absl::StrCat("no load report for ", absl::FormatDuration(timeout),
                                           " (--report_stream_idle_timeout); reconnect to report again")));
  }

  void OnDone() override {
    service_->StreamDone(this);
    delete this;
  }

 private:
  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    SerializeRaw(summary_, response_);
    Finish(status);
  }

  DecodeRouterService* const service_;
  grpc::CallbackServerContext* const context_;
  const std::string peer_key_;
  std::string stream_token_;  // the stream's bearer token (reporter_auth=token), read once
  grpc::ByteBuffer* const response_;
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_activity_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer buffer_;
  eldr::v1::ReportLoadResponse summary_;
};

// One RouteStream. The read chain (OnReadDone) answers each message synchronously and queues the
// answer; the write chain (OnWriteDone) writes the queue in order, one message at a time; the two
// run concurrently, on gRPC's threads. mu_ guards what they share. gRPC never runs a reaction
// inline from StartRead/StartWrite/Finish, so calling those under mu_ cannot deadlock.
//
// The stream finishes once reads are closed (half-close, shutdown, cancellation or a failed
// write), no message is being answered, and no answer waits or is being written. A read may still
// be outstanding then (gRPC allows it); a message it still delivers is not answered.
class DecodeRouterService::RouteStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  RouteStreamReactor(DecodeRouterService* service, std::string client)
      : service_(service), client_(std::move(client)) {}

  // Starts reading, or ends the stream at once with `finish_now`.
  void Begin(const std::optional<grpc::Status>& finish_now) {
    absl::MutexLock lock(&mu_);
    if (finish_now.has_value()) CloseReadsLocked(*finish_now);
    ReadNextLocked();
    MaybeFinishLocked();
  }

  void OnReadDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      read_pending_ = false;
      if (!ok) CloseReadsLocked(grpc::Status::OK);  // the client half-closed (or the call is gone)
      if (read_closed_) {                           // a message that arrives after the end was decided is not answered
        MaybeFinishLocked();
        return;
      }
      answering_ = true;
    }
    // Only the read chain touches frame_, request_ and response_: no lock while the core works.
    Answer answer;
    const bool send =
        service_->AnswerStreamMessage(client_, frame_, &request_, &response_, &answer.buffer, &answer.delivered);
    frame_.Clear();
    absl::MutexLock lock(&mu_);
    answering_ = false;
    if (cancelled_) {
      service_->ReleaseUndelivered(answer.delivered);
    } else if (!send) {  // an errors_only message that succeeded: nothing to write, nothing to release
      ReadNextLocked();
    } else {
      queue_.push_back(std::move(answer));
      WriteNextLocked();
      ReadNextLocked();
    }
    MaybeFinishLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {  // the call is gone: this answer and those behind it never reach the client
      cancelled_ = true;
      CloseReadsLocked(grpc::Status(grpc::StatusCode::CANCELLED, "RouteStream write failed"));
      DropQueuedLocked();
    } else {
      queue_.pop_front();
      WriteNextLocked();
      ReadNextLocked();
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    CloseReadsLocked(grpc::Status(grpc::StatusCode::CANCELLED, "RouteStream cancelled"));
    DropQueuedLocked();
    MaybeFinishLocked();
  }

  void FinishForShutdown() {
    absl::MutexLock lock(&mu_);
    CloseReadsLocked(RouteStreamShutdownStatus());
    MaybeFinishLocked();
  }

  void OnDone() override {
    service_->RouteStreamDone(this);
    delete this;
  }

 private:
  struct Answer {
    grpc::ByteBuffer buffer;     // a serialized RouteStreamResponse
    StreamDeliveries delivered;  // its requests; their Route leases are released if it is never delivered
  };

  // No more reads; the first reason decides the status the stream ends with.
  void CloseReadsLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (read_closed_) return;
    read_closed_ = true;
    end_ = status;
  }

  void ReadNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (read_closed_ || read_pending_ || answering_ || queue_.size() >= kRouteStreamMaxPending) return;
    read_pending_ = true;
    StartRead(&frame_);
  }

  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || queue_.empty() || cancelled_) return;
    writing_ = true;
    StartWrite(&queue_.front().buffer);
  }

  // Releases every answer not handed to gRPC, and the one being written when its write failed.
  void DropQueuedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t keep = writing_ ? 1 : 0;  // its OnWriteDone(false) drops it
    while (queue_.size() > keep) {
      service_->ReleaseUndelivered(queue_.back().delivered);
      queue_.pop_back();
    }
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || !read_closed_ || answering_ || writing_ || !queue_.empty()) return;
    finished_ = true;
    Finish(end_);
  }

  DecodeRouterService* const service_;
  const std::string client_;  // the caller's key for the router, computed once per stream
  // The read chain's own: one read is outstanding or one message answered at a time.
  grpc::ByteBuffer frame_;
  eldr::v1::RouteStreamRequest request_;
  eldr::v1::RouteStreamResponse response_;

  absl::Mutex mu_;
  std::deque<Answer> queue_ ABSL_GUARDED_BY(mu_);  // in request order; front() is written when writing_
  grpc::Status end_ ABSL_GUARDED_BY(mu_);
  bool read_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool answering_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

DecodeRouterService::DecodeRouterService(ServiceContext context) : ctx_(std::move(context)) {}

DecodeRouterService::~DecodeRouterService() = default;

absl::Status DecodeRouterService::CheckDataToken(const grpc::CallbackServerContext& context, absl::string_view method) {
  if (ctx_.data_token == nullptr || !ctx_.data_token->enabled()) return absl::OkStatus();
  absl::Status status = ctx_.data_token->Check(context);
  if (!status.ok()) RecordRefusal(ctx_.metrics, AuthPlane::kData, method, status, context);
  return status;
}

std::string DecodeRouterService::RouteClientKey(const grpc::CallbackServerContext& context) const {
  return ctx_.route_client_keys ? ClientKey(context, ctx_.mutual_tls) : std::string();
}

absl::Status DecodeRouterService::ValidateAndRoute(absl::string_view client, const eldr::v1::RouteRequest& request,
                                                   eldr::v1::RouteResponse* response, RouteResult* decided) {
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
  std::vector<float> gate_prob_scratch;
  ELDR_RETURN_IF_ERROR(SignatureFromProto(request, &input, &present, &gate_prob_scratch));
  RouteInput route;
  route.signature = present ? &input : nullptr;
  route.now = absl::Now();
  route.client = client;
  for (const std::string& id : request.exclude_workers()) {
    if (id.size() > kMaxWorkerIdBytes) {
      return MakeInputError(
          absl::StatusCode::kInvalidArgument, RejectReason::kOversized,
          absl::StrCat("exclude_workers holds an id of ", id.size(), " bytes; ids have at most ", kMaxWorkerIdBytes));
    }
  }
  // Usually empty (a re-route excludes one worker): copied, since a repeated field is not contiguous.
  const std::vector<std::string> excluded(request.exclude_workers().begin(), request.exclude_workers().end());
  route.exclude_workers = excluded;
  if (!request.policy().empty()) {
    absl::StatusOr<PolicyKind> policy = ParsePolicyKind(request.policy());
    if (!policy.ok()) return InvalidInput(RejectReason::kOutOfRange, policy.status().message());
    route.policy = *policy;
  }
  ELDR_ASSIGN_OR_RETURN(RouteResult r, ctx_.router->Route(route));
  SetString(response->mutable_worker_id(), r.worker_id);
  SetString(response->mutable_address(), r.address);
  response->set_lease_id(r.lease_id);
  response->set_similarity(r.similarity);
  response->set_band_size(r.band_size);
  SetString(response->mutable_policy(), PolicyKindName(r.policy));
  SetString(response->mutable_fallback_reason(), FallbackReasonLabel(r.fallback));
  response->set_centroid_generation(r.centroid_generation);
  *decided = std::move(r);
  return absl::OkStatus();
}

absl::Status DecodeRouterService::RouteMessage(absl::string_view client, absl::Status status, int64_t bytes,
                                               absl::FunctionRef<absl::Status(const eldr::v1::RouteRequest**)> parse,
                                               eldr::v1::RouteResponse* response) {
  const Clock::time_point start = Clock::now();
  const eldr::v1::RouteRequest* request = nullptr;
  RouteResult decided;
  if (status.ok() && ctx_.max_request_bytes > 0 && bytes > ctx_.max_request_bytes) {
    status = MakeInputError(absl::StatusCode::kInvalidArgument, RejectReason::kOversized,
                            absl::StrCat("RouteRequest is ", bytes, " bytes; the router accepts at most ",
                                         ctx_.max_request_bytes, " (--max_message_bytes)"));
  }
  if (status.ok()) status = parse(&request);
  if (status.ok()) status = ValidateAndRoute(client, *request, response, &decided);
  const double seconds = SecondsSince(start);
  if (status.ok()) {
    ctx_.metrics->RecordRoute(decided, seconds);
    return status;
  }
  ctx_.metrics->RecordRouteFailure(ctx_.configured_policy, status, seconds);
  const absl::string_view reason = RejectReasonLabel(RejectReasonOf(status));
  ELDR_LOG_LIMITED(Debug, "route_failed",
                   absl::StrCat("route_failed/", absl::StatusCodeToString(status.code()), "/", reason))
      .With("request_id", Shown(request != nullptr ? request->request_id() : absl::string_view()))
      .With("reason", reason)
      .With("code", status);
  return status;
}

absl::Status DecodeRouterService::CompleteMessage(
    absl::Status status, absl::FunctionRef<absl::Status(const eldr::v1::CompleteRequest**)> parse,
    eldr::v1::CompleteResponse* response) {
  const eldr::v1::CompleteRequest* request = nullptr;
  if (status.ok()) {
    status = parse(&request);
    if (!status.ok()) ctx_.metrics->RecordRejected(RejectReason::kMalformed);
  }
  if (status.ok() && request->output_tokens() < 0) {
    status = InvalidInput(RejectReason::kNegativeCount,
                          absl::StrCat("output_tokens must not be negative, got ", request->output_tokens()));
    ctx_.metrics->RecordRejected(RejectReason::kNegativeCount);
  }
  if (status.ok()) {
    absl::StatusOr<std::string> worker = ctx_.router->Complete(request->lease_id(), request->output_tokens());
    status = worker.status();
    ctx_.metrics->RecordComplete(status.ok());
    if (worker.ok()) response->set_worker_id(*std::move(worker));
  }
  return status;
}

grpc::ServerUnaryReactor* DecodeRouterService::Route(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  eldr::v1::RouteRequest parsed;
  eldr::v1::RouteResponse answer;
  const absl::Status status =
      RouteMessage(RouteClientKey(*context), CheckDataToken(*context, "Route"), static_cast<int64_t>(request->Length()),
                   ParseInto(*request, &parsed), &answer);
  if (status.ok()) SerializeRaw(answer, response);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* DecodeRouterService::Complete(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  eldr::v1::CompleteRequest parsed;
  eldr::v1::CompleteResponse answer;
  const absl::Status status =
      CompleteMessage(CheckDataToken(*context, "Complete"), ParseInto(*request, &parsed), &answer);
  if (status.ok()) SerializeRaw(answer, response);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

namespace {

// Whether an errors_only message may go unanswered: a Complete, or a batch of Completes only.
bool CompletesOnly(const eldr::v1::RouteStreamRequest& request) {
  using eldr::v1::RouteStreamRequest;
  if (request.kind_case() == RouteStreamRequest::kComplete) return true;
  if (request.kind_case() != RouteStreamRequest::kBatch) return false;
  for (const RouteStreamRequest& entry : request.batch().requests()) {
    if (entry.kind_case() != RouteStreamRequest::kComplete) return false;
  }
  return true;
}

// Whether an answer reports a failure, of the message or of an entry of its batch.
bool AnswersAFailure(const eldr::v1::RouteStreamResponse& response) {
  if (response.has_error()) return true;
  for (const eldr::v1::RouteStreamResponse& entry : response.batch().responses()) {
    if (entry.has_error()) return true;
  }
  return false;
}

}  // namespace

bool DecodeRouterService::AnswerStreamMessage(absl::string_view client, const grpc::ByteBuffer& frame,
                                              eldr::v1::RouteStreamRequest* request,
                                              eldr::v1::RouteStreamResponse* response, grpc::ByteBuffer* answer,
                                              StreamDeliveries* delivered) {
  request->Clear();
  response->Clear();
  delivered->clear();
  const auto frame_bytes = static_cast<int64_t>(frame.Length());
  // A malformed message, refused whole: nothing in it is handled.
  const auto refuse = [&](const absl::Status& status) {
    ctx_.metrics->RecordRejected(RejectReason::kMalformed);
    SetStreamError(status, response);
    ctx_.metrics->RecordRouteStreamMessage(StreamMessageKind::kNone, /*ok=*/false);
    delivered->push_back(StreamDelivery{});
  };
  if (absl::Status status = ParseRaw(frame, request); !status.ok()) {
    refuse(status);  // answered with id 0
  } else if (request->errors_only() && !CompletesOnly(*request)) {
    response->set_id(request->id());
    refuse(InvalidInput(RejectReason::kMalformed,
                        "RouteStreamRequest: errors_only is for a Complete or a batch of Completes only (a Route's "
                        "answer is its decision); nothing in this message was handled"));
  } else if (request->kind_case() == eldr::v1::RouteStreamRequest::kBatch) {
    AnswerStreamBatch(client, *request, frame_bytes, response, delivered);
  } else {
    delivered->push_back(AnswerStreamRequest(client, *request, frame_bytes, response));
  }
  if (request->errors_only() && !AnswersAFailure(*response)) {
    ctx_.metrics->RecordRouteStreamUnanswered();
    return false;
  }
  SerializeRaw(*response, answer);
  return true;
}

StreamDelivery DecodeRouterService::AnswerStreamRequest(absl::string_view client,
                                                        const eldr::v1::RouteStreamRequest& request,
                                                        int64_t frame_bytes, eldr::v1::RouteStreamResponse* response) {
  using eldr::v1::RouteStreamRequest;
  StreamDelivery delivery;
  absl::Status status;
  response->set_id(request.id());
  switch (request.kind_case()) {
    case RouteStreamRequest::kRoute: {
      delivery.kind = StreamMessageKind::kRoute;
      // The frame holds the RouteRequest plus a few bytes (plus the other entries of a batch): the
      // request's own size is computed only when the frame is over the limit.
      const int64_t bytes = ctx_.max_request_bytes > 0 && frame_bytes > ctx_.max_request_bytes
                                ? static_cast<int64_t>(request.route().ByteSizeLong())
                                : frame_bytes;
      status = RouteMessage(client, absl::OkStatus(), bytes, Parsed(request.route()), response->mutable_route());
      if (status.ok()) delivery.lease = response->route().lease_id();
      break;
    }
    case RouteStreamRequest::kComplete:
      delivery.kind = StreamMessageKind::kComplete;
      status = CompleteMessage(absl::OkStatus(), Parsed(request.complete()), response->mutable_complete());
      break;
    case RouteStreamRequest::kBatch:  // a batch message goes to AnswerStreamBatch: this is an entry
      status = InvalidInput(RejectReason::kMalformed,
                            "RouteStreamBatch: this entry is itself a batch; batches do not nest (send its "
                            "requests as entries of the outer batch)");
      ctx_.metrics->RecordRejected(RejectReason::kMalformed);
      break;
    case RouteStreamRequest::KIND_NOT_SET:
      status = InvalidInput(RejectReason::kMalformed, "RouteStreamRequest: neither route nor complete is set");
      ctx_.metrics->RecordRejected(RejectReason::kMalformed);
      break;
  }
  if (!status.ok()) SetStreamError(status, response);
  ctx_.metrics->RecordRouteStreamMessage(delivery.kind, status.ok());
  return delivery;
}

void DecodeRouterService::AnswerStreamBatch(absl::string_view client, const eldr::v1::RouteStreamRequest& request,
                                            int64_t frame_bytes, eldr::v1::RouteStreamResponse* response,
                                            StreamDeliveries* delivered) {
  response->set_id(request.id());
  const auto& entries = request.batch().requests();
  if (entries.size() > ctx_.max_stream_batch) {
    // Refused before any entry is handled, so the caller knows that none was (no lease taken, none
    // released): it can split the batch and send it again.
    SetStreamError(
        MakeInputError(absl::StatusCode::kInvalidArgument, RejectReason::kOversized,
                       absl::StrCat("RouteStreamBatch holds ", entries.size(), " requests; the router accepts at most ",
                                    ctx_.max_stream_batch, " in one batch (--max_stream_batch); none was handled")),
        response);
    ctx_.metrics->RecordRejected(RejectReason::kOversized);
    ctx_.metrics->RecordRouteStreamBatchRefused();
    return;
  }
  eldr::v1::RouteStreamBatchResponse* answers = response->mutable_batch();  // set even when empty
  delivered->reserve(static_cast<size_t>(entries.size()));
  for (const eldr::v1::RouteStreamRequest& entry : entries) {
    delivered->push_back(AnswerStreamRequest(client, entry, frame_bytes, answers->add_responses()));
  }
  ctx_.metrics->RecordRouteStreamBatch(entries.size());
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* DecodeRouterService::RouteStream(
    grpc::CallbackServerContext* context) {
  auto* reactor = new RouteStreamReactor(this, RouteClientKey(*context));
  const absl::Status refuse = CheckDataToken(*context, "RouteStream");
  bool shutting_down = false;
  {
    // The gauge is set under the lock: two streams opening or closing at once could otherwise
    // set it out of order and leave it at a stale count.
    absl::MutexLock lock(&streams_mu_);
    shutting_down = shutting_down_;
    route_streams_.insert(reactor);
    ctx_.metrics->SetRouteStreamsOpen(static_cast<int64_t>(route_streams_.size()));
  }
  std::optional<grpc::Status> finish_now;
  if (shutting_down) {
    finish_now = RouteStreamShutdownStatus();
  } else if (!refuse.ok()) {
    finish_now = ToGrpcStatus(refuse);
  }
  reactor->Begin(finish_now);
  return reactor;
}

void DecodeRouterService::RouteStreamDone(RouteStreamReactor* reactor) {
  absl::MutexLock lock(&streams_mu_);
  route_streams_.erase(reactor);
  ctx_.metrics->SetRouteStreamsOpen(static_cast<int64_t>(route_streams_.size()));  // under the lock, as above
}

void DecodeRouterService::ReleaseUndelivered(const StreamDeliveries& delivered) {
  for (const StreamDelivery& d : delivered) {
    ctx_.metrics->RecordRouteStreamUndelivered(d.kind);
    if (d.lease != 0) (void)ctx_.router->Complete(d.lease);  // NOT_FOUND: it expired or was evicted meanwhile
  }
}

absl::Status DecodeRouterService::ApplyReport(const grpc::CallbackServerContext& context,
                                              const eldr::v1::LoadReport& report, const std::string& stream_token) {
  absl::Status status;
  if (report.worker_id().empty()) {
    status = InvalidInput(RejectReason::kUnknownWorker, "load report without worker_id");
  } else if (ctx_.reporter_auth == ReporterAuth::kToken &&
             (ctx_.reporter_tokens == nullptr || !ctx_.reporter_tokens->Matches(report.worker_id(), stream_token))) {
    status = absl::PermissionDeniedError(
        absl::StrCat("this stream's token may not report for worker '", Shown(report.worker_id()), "'"));
    RecordRefusal(ctx_.metrics, AuthPlane::kReporter, "ReportLoad", status, context);
  } else if (ctx_.reporter_auth == ReporterAuth::kMtls) {
    const std::vector<std::string> identities = PeerCertificateIdentities(context);
    if (std::find(identities.begin(), identities.end(), report.worker_id()) == identities.end()) {
      status = absl::PermissionDeniedError(
          absl::StrCat("the client certificate does not name worker '", Shown(report.worker_id()), "'"));
      RecordRefusal(ctx_.metrics, AuthPlane::kReporter, "ReportLoad", status, context);
    }
  }
  if (status.ok()) {
    LoadSnapshot snapshot;
    snapshot.running = report.running();
    snapshot.waiting = report.waiting();
    snapshot.kv_usage = report.kv_usage();
    const absl::Time now = absl::Now();
    snapshot.taken_at =
        report.snapshot_time_unix_us() == 0 ? now : absl::FromUnixMicros(report.snapshot_time_unix_us());
    status = ctx_.router->ReportLoad(report.worker_id(), snapshot, now);
  }
  ctx_.metrics->RecordLoadReport(status.ok());
  if (!status.ok() && !absl::IsPermissionDenied(status)) ctx_.metrics->RecordRejected(RejectReasonOf(status));
  return status;
}

grpc::ServerReadReactor<grpc::ByteBuffer>* DecodeRouterService::ReportLoad(grpc::CallbackServerContext* context,
                                                                           grpc::ByteBuffer* response) {
  auto* reactor = new LoadReportReactor(this, context, response, ClientKey(*context, ctx_.mutual_tls));
  absl::Status refuse = CheckDataToken(*context, "ReportLoad");
  bool shutting_down = false;
  int64_t open = 0;
  {
    absl::MutexLock lock(&streams_mu_);
    shutting_down = shutting_down_;
    if (refuse.ok() && static_cast<int64_t>(streams_.size()) >= ctx_.max_report_streams) {
      refuse = absl::ResourceExhaustedError(
          absl::StrCat("the router has ", streams_.size(), " ReportLoad streams open (--max_report_streams)"));
      ctx_.metrics->RecordReportStreamRefused(/*per_peer=*/false);
    }
    int64_t& of_peer = streams_per_peer_[reactor->peer_key()];
    if (refuse.ok() && of_peer >= ctx_.max_report_streams_per_peer) {
      refuse = absl::ResourceExhaustedError(
          absl::StrCat("this peer has ", of_peer, " ReportLoad streams open (--max_report_streams_per_peer)"));
      ctx_.metrics->RecordReportStreamRefused(/*per_peer=*/true);
    }
    ++of_peer;  // every registered stream counts until StreamDone, refused ones included
    streams_.insert(reactor);
    open = static_cast<int64_t>(streams_.size());
  }
  ctx_.metrics->SetReportStreamsOpen(open);
  std::optional<grpc::Status> finish_now;
  if (shutting_down) {
    finish_now = grpc::Status::OK;  // answered at once with its (empty) summary
  } else if (!refuse.ok()) {
    finish_now = ToGrpcStatus(refuse);
    if (absl::IsResourceExhausted(refuse)) {
      ELDR_LOG_LIMITED(Warning, "report_stream_refused", "report_stream_refused")
          .With("peer", reactor->peer_key())
          .With("code", refuse);
    }
  }
  reactor->Begin(finish_now);
  return reactor;
}

void DecodeRouterService::StreamDone(LoadReportReactor* reactor) {
  int64_t open = 0;
  {
    absl::MutexLock lock(&streams_mu_);
    streams_.erase(reactor);
    auto it = streams_per_peer_.find(reactor->peer_key());
    if (it != streams_per_peer_.end() && --it->second <= 0) streams_per_peer_.erase(it);
    open = static_cast<int64_t>(streams_.size());
  }
  ctx_.metrics->SetReportStreamsOpen(open);
}

void DecodeRouterService::FinishStreamsForShutdown() {
  // Reactors delete themselves in OnDone after removing themselves from streams_ under
  // streams_mu_; holding it here keeps every listed reactor alive while it is asked to finish.
  absl::MutexLock lock(&streams_mu_);
  shutting_down_ = true;
  for (LoadReportReactor* reactor : streams_) reactor->FinishForShutdown();
  for (RouteStreamReactor* reactor : route_streams_) reactor->FinishForShutdown();
}

void DecodeRouterService::EndIdleStreams(absl::Time now) {
  const absl::Time cutoff = now - ctx_.report_stream_idle_timeout;
  absl::MutexLock lock(&streams_mu_);
  for (LoadReportReactor* reactor : streams_) reactor->FinishIfIdleSince(cutoff, ctx_.report_stream_idle_timeout);
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
  out->set_peer_leases(status.load.peer_leases);
}

RouterAdminService::RouterAdminService(ServiceContext context) : ctx_(std::move(context)) {}

bool RouterAdminService::Authorize(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                                   absl::string_view method) {
  if (ctx_.admin_token == nullptr || !ctx_.admin_token->enabled()) return true;
  const absl::Status status = ctx_.admin_token->Check(*context);
  if (status.ok()) return true;
  RecordRefusal(ctx_.metrics, AuthPlane::kAdmin, method, status, *context);
  reactor->Finish(ToGrpcStatus(status));
  return false;
}

bool RouterAdminService::PoolIsStatic(grpc::ServerUnaryReactor* reactor, absl::string_view method) {
  if (!ctx_.pool_discovered) return true;
  ELDR_LOG_LIMITED(Warning, "admin_pool_change_refused", "admin_pool_change_refused")
      .With("method", method)
      .With("reason", "discovery=kubernetes owns the pool");
  reactor->Finish(ToGrpcStatus(absl::FailedPreconditionError(
      absl::StrCat(method,
                   ": the pool is discovered from Kubernetes (discovery=kubernetes); change the decode pods "
                   "(labels, readiness, deletion) instead"))));
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
  if (!PoolIsStatic(reactor, "UpsertWorker")) return reactor;
  const eldr::v1::Worker& w = request->worker();
  WorkerSpec spec;
  spec.id = w.id();
  spec.address = w.address();
  spec.capacity = w.capacity() == 0 ? 1.0 : w.capacity();  // proto3 default: unset means 1
  spec.max_inflight = w.max_inflight();
  absl::StatusOr<PoolChange> change = ctx_.router->UpsertWorker(spec);
  if (change.ok()) {
    response->set_created(change->kind == PoolChangeKind::kAdded);
  } else {
    ctx_.metrics->RecordRejected(RejectReasonOf(change.status()));
  }
  reactor->Finish(ToGrpcStatus(change.status()));
  return reactor;
}

grpc::ServerUnaryReactor* RouterAdminService::DrainWorker(grpc::CallbackServerContext* context,
                                                          const eldr::v1::DrainWorkerRequest* request,
                                                          eldr::v1::DrainWorkerResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorize(context, reactor, "DrainWorker")) return reactor;
  if (!PoolIsStatic(reactor, "DrainWorker")) return reactor;
  absl::StatusOr<PoolChange> change = ctx_.router->DrainWorker(request->worker_id());
  if (change.ok()) {
    response->set_inflight(change->inflight);
  } else {
    ctx_.metrics->RecordRejected(RejectReasonOf(change.status()));
  }
  reactor->Finish(ToGrpcStatus(change.status()));
  return reactor;
}

grpc::ServerUnaryReactor* RouterAdminService::RemoveWorker(grpc::CallbackServerContext* context,
                                                           const eldr::v1::RemoveWorkerRequest* request,
                                                           eldr::v1::RemoveWorkerResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorize(context, reactor, "RemoveWorker")) return reactor;
  if (!PoolIsStatic(reactor, "RemoveWorker")) return reactor;
  absl::StatusOr<PoolChange> change = ctx_.router->RemoveWorker(request->worker_id());
  if (change.ok()) {
    response->set_dropped_leases(change->inflight);
  } else {
    ctx_.metrics->RecordRejected(RejectReasonOf(change.status()));
  }
  reactor->Finish(ToGrpcStatus(change.status()));
  return reactor;
}

grpc::ServerUnaryReactor* RouterAdminService::ReloadCentroids(grpc::CallbackServerContext* context,
                                                              const eldr::v1::ReloadCentroidsRequest* request,
                                                              eldr::v1::ReloadCentroidsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorize(context, reactor, "ReloadCentroids")) return reactor;
  // Reading and indexing an artifact blocks: the loader's thread does it and answers. The request
  // and response live until the reactor finishes.
  LoadCallback done = [reactor, response](const absl::StatusOr<LoadedCentroids>& result) {
    if (result.ok()) {
      response->set_centroid_generation(result->generation);
      response->set_rows(result->rows);
    }
    reactor->Finish(ToGrpcStatus(result.status()));
  };
  if (request->source_case() == eldr::v1::ReloadCentroidsRequest::kArtifactJson) {
    ctx_.loader->ReloadInline(request->artifact_json(), std::move(done));
  } else {
    ctx_.loader->ReloadPath(request->path(), std::move(done));
  }
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
