#include "router_client.h"

#include <algorithm>
#include <chrono>
#include <deque>
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

// Re-opening a stream that ended: the first wait, its doubling's cap, and how long a router that
// answered UNIMPLEMENTED is called unary before RouteStream is tried again.
constexpr absl::Duration kStreamInitialBackoff = absl::Milliseconds(50);
constexpr absl::Duration kStreamMaxBackoff = absl::Seconds(2);
constexpr absl::Duration kUnimplementedRetry = absl::Seconds(60);

// What an errors_only Complete that did not fail stands for: the unary Complete's OK.
eldr::v1::RouteStreamResponse CompletedWithoutAnswer() {
  eldr::v1::RouteStreamResponse answer;
  answer.mutable_complete();
  return answer;
}

}  // namespace

absl::StatusOr<RouterApi> ParseRouterApi(absl::string_view name) {
  if (name == "stream") return RouterApi::kStream;
  if (name == "unary") return RouterApi::kUnary;
  return absl::InvalidArgumentError(absl::StrCat("must be stream or unary, got '", name, "'"));
}

absl::Status StatusOfStreamAnswer(const eldr::v1::RouteStreamResponse& answer,
                                  eldr::v1::RouteStreamRequest::KindCase asked) {
  using Request = eldr::v1::RouteStreamRequest;
  using Response = eldr::v1::RouteStreamResponse;
  switch (answer.result_case()) {
    case Response::kError: {
      const int code = answer.error().code();
      // An error without a code would read as success: the router never sends one.
      if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
        return absl::UnknownError(
            absl::StrCat("eldr-router answered with error code ", code, ": ", answer.error().message()));
      }
      return absl::Status(static_cast<absl::StatusCode>(code), answer.error().message());
    }
    case Response::kRoute:
      if (asked == Request::kRoute) return absl::OkStatus();
      break;
    case Response::kComplete:
      if (asked == Request::kComplete) return absl::OkStatus();
      break;
    case Response::kBatch:  // the proxy sends no batches, so a batch answer matches nothing it asked
    case Response::RESULT_NOT_SET:
      break;
  }
  return absl::InternalError(absl::StrCat("eldr-router's RouteStream answer (result ", answer.result_case(),
                                          ") does not answer a ", asked == Request::kRoute ? "route" : "complete"));
}

// One RouteStream call (gRPC's callback reactor). Writes go one at a time from a queue of message
// ids; a read is always outstanding. Messages are written from outside reactions too (by the
// thread that queued one on an idle call), so the call holds a hold (AddHold) until it is known to
// have ended and no write is outstanding: OnDone cannot run under a write being started.
//
// Lifetime: shared by its slot and by itself (self_) until OnDone; RouterClient counts it in
// calls_in_flight_ from its creation to the end of OnDone's work.
class RouterClient::StreamCall final
    : public grpc::ClientBidiReactor<eldr::v1::RouteStreamRequest, eldr::v1::RouteStreamResponse> {
 public:
  StreamCall(RouterClient* client, size_t slot) : client_(client), slot_(slot) {
    if (!client_->bearer_.empty()) context_.AddMetadata("authorization", client_->bearer_);
  }

  // Starts the call; with `write`, also the write EnqueueLocked asked for.
  void Start(bool write) {
    client_->stub_->async()->RouteStream(&context_, this);
    AddHold();
    StartRead(&read_buf_);
    if (write) StartWrite(&write_buf_);
    StartCall();
    bool cancel;
    {
      absl::MutexLock lock(&client_->mu_);
      cancel = client_->shutting_down_;
    }
    // The destructor's cancellation may have come before the call existed.
    if (cancel) context_.TryCancel();
  }

  // Queues message `id` (in client_->pending_). True when the caller must now StartWrite(next
  // write) outside the lock: the call was idle and write_buf_ holds the message.
  bool EnqueueLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(client_->mu_) {
    unwritten_.push_back(id);
    if (writing_ || ended_) return false;
    return TakeNextWriteLocked();
  }
  void StartQueuedWrite() { StartWrite(&write_buf_); }

  // Whether the call can no longer carry messages (a write or the read failed).
  bool ended() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(client_->mu_) { return ended_; }
  // The id of the last message whose write completed (ids grow in write order); 0 before any.
  uint64_t written_through() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(client_->mu_) { return written_through_; }
  void Cancel() { context_.TryCancel(); }

  void OnWriteDone(bool ok) override {
    bool more = false;
    bool release = false;
    {
      absl::MutexLock lock(&client_->mu_);
      if (!ok) ended_ = true;
      if (ok) written_through_ = writing_id_;
      if (!ended_) {
        more = TakeNextWriteLocked();
      } else {
        writing_ = false;
        release = ReleaseHoldLocked();
      }
    }
    if (more) StartWrite(&write_buf_);
    if (release) RemoveHold();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the call ended: OnDone follows once the hold is gone
      bool release;
      {
        absl::MutexLock lock(&client_->mu_);
        ended_ = true;
        release = ReleaseHoldLocked();
      }
      if (release) RemoveHold();
      return;
    }
    eldr::v1::RouteStreamResponse answer = std::move(read_buf_);
    read_buf_.Clear();
    StartRead(&read_buf_);
    client_->OnStreamAnswer(this, std::move(answer));
  }

  void OnDone(const grpc::Status& status) override {
    std::shared_ptr<StreamCall> keep = std::move(self_);
    client_->OnStreamEnded(this, slot_, status);  // the last use of client_
  }

  std::shared_ptr<StreamCall> self_;  // set by the opener; released in OnDone

 private:
  // The next queued message still pending into write_buf_ (writing_ stays true), or false when
  // none is left (writing_ turns false). Messages that expired while queued are skipped.
  bool TakeNextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(client_->mu_) {
    while (!unwritten_.empty()) {
      const uint64_t id = unwritten_.front();
      unwritten_.pop_front();
      auto it = client_->pending_.find(id);
      if (it == client_->pending_.end()) continue;
      write_buf_ = it->second.message;
      writing_id_ = id;
      writing_ = true;
      return true;
    }
    writing_ = false;
    return false;
  }
  // True once (the caller then calls RemoveHold) when the call ended and no write is outstanding.
  bool ReleaseHoldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(client_->mu_) {
    if (!ended_ || writing_ || hold_released_) return false;
    hold_released_ = true;
    return true;
  }

  RouterClient* const client_;
  const size_t slot_;
  grpc::ClientContext context_;
  eldr::v1::RouteStreamResponse read_buf_;  // touched by the read reactions only
  // Touched by whoever set writing_ (under the lock) until its OnWriteDone.
  eldr::v1::RouteStreamRequest write_buf_;
  std::deque<uint64_t> unwritten_ ABSL_GUARDED_BY(client_->mu_);
  bool writing_ ABSL_GUARDED_BY(client_->mu_) = false;
  uint64_t writing_id_ ABSL_GUARDED_BY(client_->mu_) = 0;       // of write_buf_ while writing_
  uint64_t written_through_ ABSL_GUARDED_BY(client_->mu_) = 0;  // see written_through()
  bool ended_ ABSL_GUARDED_BY(client_->mu_) = false;
  bool hold_released_ ABSL_GUARDED_BY(client_->mu_) = false;
};

absl::StatusOr<std::unique_ptr<RouterClient>> RouterClient::Create(const RouterClientOptions& options,
                                                                   ProxyMetrics* metrics) {
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
  return std::unique_ptr<RouterClient>(new RouterClient(options, std::move(channel), std::move(bearer), metrics));
}

RouterClient::RouterClient(RouterClientOptions options, std::shared_ptr<grpc::Channel> channel, std::string bearer,
                           ProxyMetrics* metrics)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(eldr::v1::DecodeRouter::NewStub(channel_)),
      bearer_(std::move(bearer)),
      metrics_(metrics) {
  if (options_.api == RouterApi::kStream) {
    slots_.resize(static_cast<size_t>(std::max(1, options_.streams)));
    for (StreamSlot& slot : slots_) slot.backoff = kStreamInitialBackoff;
    expiry_thread_ = std::thread([this] { ExpireMessages(); });
  }
}

std::unique_ptr<grpc::ClientContext> RouterClient::NewContext(absl::Time deadline) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(deadline));
  if (!bearer_.empty()) context->AddMetadata("authorization", bearer_);
  return context;
}

void RouterClient::Route(const eldr::v1::RouteRequest& request,
                         std::function<void(absl::StatusOr<eldr::v1::RouteResponse>)> done) {
  eldr::v1::RouteStreamRequest message;
  *message.mutable_route() = request;
  Send(std::move(message), absl::Now() + options_.route_timeout,
       [done = std::move(done)](absl::StatusOr<eldr::v1::RouteStreamResponse> answer) {
         if (!answer.ok()) {
           done(answer.status());
         } else {
           done(std::move(*answer->mutable_route()));
         }
       });
}

void RouterClient::Complete(uint64_t lease_id, int64_t output_tokens, std::function<void(absl::Status)> done) {
  CompleteAttempt(lease_id, output_tokens, 0, std::move(done));
}

void RouterClient::CompleteAttempt(uint64_t lease_id, int64_t output_tokens, int attempt,
                                   std::function<void(absl::Status)> done) {
  eldr::v1::RouteStreamRequest message;
  message.mutable_complete()->set_lease_id(lease_id);
  message.mutable_complete()->set_output_tokens(output_tokens);
  // Read on streams only: a unary Complete is always answered.
  message.set_errors_only(options_.complete_errors_only);
  Send(std::move(message), absl::Now() + options_.complete_timeout,
       [this, lease_id, output_tokens, attempt,
        done = std::move(done)](absl::StatusOr<eldr::v1::RouteStreamResponse> answer) mutable {
         const absl::Status status = answer.status();
         if ((absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) && attempt == 0) {
           // One more try: an unreleased lease inflates the worker's load until it expires.
           CompleteAttempt(lease_id, output_tokens, 1, std::move(done));
         } else if (done) {
           done(status);
         }
       });
}

void RouterClient::Send(eldr::v1::RouteStreamRequest message, absl::Time deadline, Answer done) {
  if (options_.api == RouterApi::kStream) {
    const StreamRefusal refusal = SendOnStream(message, deadline, done);
    if (refusal == StreamRefusal::kNone) return;
    if (metrics_ != nullptr && refusal != StreamRefusal::kShuttingDown) {
      metrics_->RecordRouterUnaryFallback(refusal == StreamRefusal::kUnimplemented ? "unimplemented" : "reconnecting");
    }
  }
  SendUnary(std::move(message), deadline, std::move(done));
}

template <typename Request, typename Response, typename Start, typename SetAnswer>
void RouterClient::CallUnary(Request request, absl::Time deadline, Answer done, Start start, SetAnswer set_answer) {
  // The call's state lives until its callback ran.
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    Request request;
    Response response;
    Answer done;
  };
  auto* call = new Call{NewContext(deadline), std::move(request), {}, std::move(done)};
  CallStarted();
  start(call->context.get(), &call->request, &call->response, [this, call, set_answer](grpc::Status status) {
    std::unique_ptr<Call> owned(call);
    if (status.ok()) {
      eldr::v1::RouteStreamResponse answer;
      set_answer(answer, std::move(owned->response));
      owned->done(std::move(answer));
    } else {
      owned->done(FromGrpc(status));
    }
    CallEnded();
  });
}

void RouterClient::SendUnary(eldr::v1::RouteStreamRequest message, absl::Time deadline, Answer done) {
  auto* async = stub_->async();
  if (message.has_route()) {
    CallUnary<eldr::v1::RouteRequest, eldr::v1::RouteResponse>(
        std::move(*message.mutable_route()), deadline, std::move(done),
        [async](grpc::ClientContext* context, const eldr::v1::RouteRequest* request, eldr::v1::RouteResponse* response,
                std::function<void(grpc::Status)> callback) {
          async->Route(context, request, response, std::move(callback));
        },
        [](eldr::v1::RouteStreamResponse& answer, eldr::v1::RouteResponse response) {
          *answer.mutable_route() = std::move(response);
        });
    return;
  }
  CallUnary<eldr::v1::CompleteRequest, eldr::v1::CompleteResponse>(
      std::move(*message.mutable_complete()), deadline, std::move(done),
      [async](grpc::ClientContext* context, const eldr::v1::CompleteRequest* request,
              eldr::v1::CompleteResponse* response, std::function<void(grpc::Status)> callback) {
        async->Complete(context, request, response, std::move(callback));
      },
      [](eldr::v1::RouteStreamResponse& answer, eldr::v1::CompleteResponse response) {
        *answer.mutable_complete() = std::move(response);
      });
}

RouterClient::StreamRefusal RouterClient::SendOnStream(eldr::v1::RouteStreamRequest& message, absl::Time deadline,
                                                       Answer& done) {
  std::shared_ptr<StreamCall> call;
  bool opened = false;
  bool start_write = false;
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return StreamRefusal::kShuttingDown;
    const absl::Time now = absl::Now();
    if (now < unary_until_) return StreamRefusal::kUnimplemented;
    // The next slot round robin whose call can take the message, or may open one.
    for (size_t i = 0; i < slots_.size() && call == nullptr; ++i) {
      const size_t index = (next_slot_ + i) % slots_.size();
      StreamSlot& slot = slots_[index];
      if (slot.call != nullptr) {
        if (slot.call->ended()) continue;  // its OnDone is on the way
        call = slot.call;
      } else if (now >= slot.reopen_after) {
        slot.call = std::make_shared<StreamCall>(this, index);
        slot.call->self_ = slot.call;
        call = slot.call;
        opened = true;
        ++calls_in_flight_;
        // The gauge is set under mu_: a stream opening while another ends could otherwise set it
        // out of order and leave it at a stale count.
        if (metrics_ != nullptr) metrics_->SetRouterStreamsOpen(++streams_open_);
      }
      if (call != nullptr) next_slot_ = index + 1;
    }
    if (call == nullptr) return StreamRefusal::kReconnecting;
    const uint64_t id = next_id_++;
    message.set_id(id);
    if (message.errors_only()) unconfirmed_[call.get()].push_back(id);
    pending_.emplace(id, PendingMessage{std::move(message), deadline, std::move(done), call.get()});
    deadlines_.emplace(deadline, id);
    if (deadline < expiry_wake_at_) expiry_kick_ = true;
    start_write = call->EnqueueLocked(id);
  }
  if (opened) {
    if (metrics_ != nullptr) metrics_->RecordRouterStreamOpen();
    call->Start(start_write);
  } else if (start_write) {
    call->StartQueuedWrite();
  }
  return StreamRefusal::kNone;
}

std::vector<RouterClient::Answer> RouterClient::ConfirmErrorsOnlyLocked(const StreamCall* call, uint64_t id) {
  std::vector<Answer> confirmed;
  auto queued = unconfirmed_.find(call);
  if (queued == unconfirmed_.end()) return confirmed;
  std::deque<uint64_t>& ids = queued->second;
  while (!ids.empty() && ids.front() <= id) {
    const uint64_t earlier = ids.front();
    ids.pop_front();
    if (earlier == id) continue;  // answered itself: an error, the caller's to deliver
    auto it = pending_.find(earlier);
    if (it == pending_.end() || it->second.call != call) continue;  // expired meanwhile
    confirmed.push_back(std::move(it->second.done));
    deadlines_.erase({it->second.deadline, it->first});
    pending_.erase(it);
  }
  if (ids.empty()) unconfirmed_.erase(queued);
  return confirmed;
}

void RouterClient::OnStreamAnswer(StreamCall* call, eldr::v1::RouteStreamResponse answer) {
  Answer done;
  eldr::v1::RouteStreamRequest::KindCase asked = eldr::v1::RouteStreamRequest::KIND_NOT_SET;
  std::vector<Answer> confirmed;
  {
    absl::MutexLock lock(&mu_);
    confirmed = ConfirmErrorsOnlyLocked(call, answer.id());
    auto it = pending_.find(answer.id());
    if (it != pending_.end() && it->second.call == call) {
      done = std::move(it->second.done);
      asked = it->second.message.kind_case();
      deadlines_.erase({it->second.deadline, it->first});
      pending_.erase(it);
      // The router answers on this call: the next break starts its backoff afresh.
      for (StreamSlot& slot : slots_) {
        if (slot.call.get() == call) slot.backoff = kStreamInitialBackoff;
      }
    }
  }
  for (Answer& earlier : confirmed) earlier(CompletedWithoutAnswer());
  if (done == nullptr) {
    // Late (its caller already got DEADLINE_EXCEEDED and routed elsewhere): a lease it took would
    // count on the worker until it expires, so release it.
    if (answer.has_route() && answer.route().lease_id() != 0) Complete(answer.route().lease_id(), 0);
    return;
  }
  absl::Status status = StatusOfStreamAnswer(answer, asked);
  if (status.ok()) {
    done(std::move(answer));
  } else {
    done(std::move(status));
  }
}

void RouterClient::OnStreamEnded(StreamCall* call, size_t slot_index, const grpc::Status& status) {
  const bool unimplemented = status.error_code() == grpc::StatusCode::UNIMPLEMENTED;
  std::vector<PendingMessage> orphans;  // sent on the call and not answered
  {
    absl::MutexLock lock(&mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.call != call) {
        ++it;
        continue;
      }
      deadlines_.erase({it->second.deadline, it->first});
      orphans.push_back(std::move(it->second));
      pending_.erase(it++);
    }
    unconfirmed_.erase(call);
    StreamSlot& slot = slots_[slot_index];
    if (slot.call.get() == call) slot.call.reset();
    if (metrics_ != nullptr) metrics_->SetRouterStreamsOpen(--streams_open_);  // under mu_, as in Send
    const absl::Time now = absl::Now();
    if (unimplemented) {
      unary_until_ = now + kUnimplementedRetry;
    } else {
      slot.reopen_after = now + slot.backoff;
      slot.backoff = std::min(slot.backoff * 2, kStreamMaxBackoff);
    }
  }
  if (unimplemented) {
    // A router without RouteStream read none of them: they go again, unary, with their deadlines.
    for (PendingMessage& orphan : orphans) {
      if (metrics_ != nullptr) metrics_->RecordRouterUnaryFallback("unimplemented");
      SendUnary(std::move(orphan.message), orphan.deadline, std::move(orphan.done));
    }
  } else {
    const absl::Status ended = absl::UnavailableError(
        absl::StrCat("eldr-router's RouteStream ended before answering (",
                     absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())), ": ",
                     status.error_message(), ")"));
    for (PendingMessage& orphan : orphans) orphan.done(ended);
  }
  CallEnded();  // after the callbacks: the destructor must not finish under them
}

void RouterClient::ExpireMessages() {
  mu_.Lock();
  while (!(shutting_down_ && pending_.empty())) {
    const absl::Time now = absl::Now();
    // With whether it did not fail: an errors_only message written to its stream, for which no
    // error came in its time (its stream is still up: else it would have failed UNAVAILABLE).
    std::vector<std::pair<Answer, bool>> expired;
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const uint64_t id = deadlines_.begin()->second;
      deadlines_.erase(deadlines_.begin());
      auto it = pending_.find(id);
      const PendingMessage& message = it->second;
      const bool did_not_fail = message.message.errors_only() && message.call->written_through() >= id;
      expired.emplace_back(std::move(it->second.done), did_not_fail);
      pending_.erase(it);
    }
    if (!expired.empty()) {
      mu_.Unlock();
      for (auto& [done, did_not_fail] : expired) {
        if (did_not_fail) {
          done(CompletedWithoutAnswer());
        } else {
          done(absl::DeadlineExceededError("Deadline Exceeded: no answer on eldr-router's RouteStream in time"));
        }
      }
      mu_.Lock();
      continue;
    }
    expiry_wake_at_ = deadlines_.empty() ? absl::InfiniteFuture() : deadlines_.begin()->first;
    expiry_kick_ = false;
    mu_.AwaitWithDeadline(absl::Condition(this, &RouterClient::ExpiryShouldWake), expiry_wake_at_);
  }
  mu_.Unlock();
}

bool RouterClient::ExpiryShouldWake() const { return expiry_kick_ || (shutting_down_ && pending_.empty()); }

RouterClient::~RouterClient() {
  // Callbacks reference this client: let every message end (answer or deadline), end the streams,
  // then wait for every call.
  std::vector<std::shared_ptr<StreamCall>> open;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    expiry_kick_ = true;
    mu_.Await(absl::Condition(
        +[](absl::flat_hash_map<uint64_t, PendingMessage>* pending) { return pending->empty(); }, &pending_));
    for (const StreamSlot& slot : slots_) {
      if (slot.call != nullptr) open.push_back(slot.call);
    }
  }
  for (const std::shared_ptr<StreamCall>& call : open) call->Cancel();
  open.clear();
  // Before the wait for the calls: a callback the deadline thread runs may start one (a retry).
  if (expiry_thread_.joinable()) expiry_thread_.join();
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int64_t* calls) { return *calls == 0; }, &calls_in_flight_));
  }
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
