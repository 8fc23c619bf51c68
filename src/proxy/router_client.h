// eldr-proxy's asynchronous client of eldr-router's data plane (Route, Complete) over gRPC's
// callback API: no thread waits for an answer.
//
// Two transports behind one interface (RouterClientOptions.api):
// - kUnary: one unary Route / Complete RPC per call, each with its deadline.
// - kStream (default): Route and Complete travel as messages of `streams` long-lived RouteStream
//   calls on the one channel (docs/api.md, "RouteStream"), each message with an id chosen here
//   and unique for the client's life. What a caller sees is what the unary RPC would give it:
//   * an answer's per-message error becomes the absl::Status the unary RPC ends with (same code,
//     same message; StatusOfStreamAnswer);
//   * a message without an answer by its deadline (route_timeout / complete_timeout after the
//     call) fails DEADLINE_EXCEEDED; an answer that comes later is dropped, and the lease of a late
//     successful Route is released with a Complete (nobody else knows that lease);
//   * when a stream ends (router restart, connection lost), every message sent on it and not yet
//     answered fails UNAVAILABLE, exactly once; the stream is re-opened on the next message after
//     a backoff (50 ms doubling to 2 s, back to 50 ms once a stream answered). While it waits,
//     messages go as unary RPCs (which fail fast as well while the router is away);
//   * with complete_errors_only a Complete goes with errors_only: its success is known when the
//     router answers a later message of the same stream (answers come in order), or assumed when
//     its deadline passes after it was written and no error answer came (not written by then:
//     DEADLINE_EXCEEDED, as any message);
//   * a router without RouteStream (it ends the stream UNIMPLEMENTED before reading anything)
//     gets the stream's messages again as unary RPCs (none of them was processed), and unary RPCs
//     from then on; the stream is tried again every 60 s (a router that was upgraded).
//   Each callback runs exactly once.
//
// Thread-safety: every method may be called from any thread. Callbacks run on gRPC's threads or
// on the client's deadline thread; they must not block. They may call Route / Complete again.
#ifndef ELDR_PROXY_ROUTER_CLIENT_H_
#define ELDR_PROXY_ROUTER_CLIENT_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "eldr/proxy/proxy.h"
#include "eldr/v1/router.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "proxy_metrics.h"

namespace eldr::proxy {

// The result a RouteStream answer stands for, as the unary RPC of the message's kind would end:
// OK when it holds the response of the kind `asked`; its error's code and message when it is an
// error (a code outside gRPC's range is UNKNOWN); INTERNAL when it holds the other kind or none.
absl::Status StatusOfStreamAnswer(const eldr::v1::RouteStreamResponse& answer,
                                  eldr::v1::RouteStreamRequest::KindCase asked);

class RouterClient {
 public:
  // FAILED_PRECONDITION when a TLS or token file cannot be read. The channel connects lazily,
  // the first RouteStream opens with the first message. `metrics` (optional) gets the stream
  // transport's counters (ProxyMetrics::RecordRouterStreamOpen, ...) and must outlive the client.
  static absl::StatusOr<std::unique_ptr<RouterClient>> Create(const RouterClientOptions& options,
                                                              ProxyMetrics* metrics = nullptr);
  // Waits for every message and call in flight to end (each has its deadline), then cancels the
  // open streams and waits for them.
  ~RouterClient();

  // Route; `done` gets the answer or the call's status (gRPC's code, its message).
  void Route(const eldr::v1::RouteRequest& request, std::function<void(absl::StatusOr<eldr::v1::RouteResponse>)> done);
  // Complete, retried once on UNAVAILABLE / DEADLINE_EXCEEDED; `done` (optional) gets the final
  // status (NOT_FOUND: the lease had already expired or been completed).
  void Complete(uint64_t lease_id, int64_t output_tokens, std::function<void(absl::Status)> done = nullptr);

  // True while the channel is READY or IDLE/CONNECTING after having been ready (readiness);
  // triggers a connection attempt when idle.
  bool Reachable();

 private:
  // What the caller of one message gets: the answer, or the status that ended it.
  using Answer = std::function<void(absl::StatusOr<eldr::v1::RouteStreamResponse>)>;
  class StreamCall;
  // A message sent on a stream and not answered yet. Owned by pending_ until exactly one of the
  // answer, its deadline or the end of its stream takes it out.
  struct PendingMessage {
    eldr::v1::RouteStreamRequest message;  // kept to re-send it unary when the stream is UNIMPLEMENTED
    absl::Time deadline;
    Answer done;
    StreamCall* call = nullptr;
  };
  // One of the `streams` places a RouteStream call is kept open in.
  struct StreamSlot {
    std::shared_ptr<StreamCall> call;  // the open call; null while none
    absl::Time reopen_after = absl::InfinitePast();
    absl::Duration backoff;
  };
  // Why a message did not go on a stream.
  enum class StreamRefusal { kNone, kUnimplemented, kReconnecting, kShuttingDown };

  RouterClient(RouterClientOptions options, std::shared_ptr<grpc::Channel> channel, std::string bearer,
               ProxyMetrics* metrics);
  // Sends one message by the configured transport; `done` runs exactly once.
  void Send(eldr::v1::RouteStreamRequest message, absl::Time deadline, Answer done);
  void SendUnary(eldr::v1::RouteStreamRequest message, absl::Time deadline, Answer done);
  // One unary call of SendUnary: `start(context, request, response, callback)` starts the RPC;
  // `set_answer(answer, response)` puts its response into the stream-shaped answer for `done`.
  template <typename Request, typename Response, typename Start, typename SetAnswer>
  void CallUnary(Request request, absl::Time deadline, Answer done, Start start, SetAnswer set_answer);
  // Puts the message on a stream (opening one when its slot may), or says why not; `message` and
  // `done` are moved from only when it went.
  StreamRefusal SendOnStream(eldr::v1::RouteStreamRequest& message, absl::Time deadline, Answer& done);
  void CompleteAttempt(uint64_t lease_id, int64_t output_tokens, int attempt, std::function<void(absl::Status)> done);
  std::unique_ptr<grpc::ClientContext> NewContext(absl::Time deadline) const;
  void CallStarted();
  void CallEnded();
  // The deadline thread (kStream): fails the messages whose deadline passed.
  void ExpireMessages();
  bool ExpiryShouldWake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // From StreamCall's reactions (they take mu_ themselves).
  void OnStreamAnswer(StreamCall* call, eldr::v1::RouteStreamResponse answer);
  // Takes out of pending_ the errors_only messages of `call` queued before message `id` (the
  // router answered `id`, so it read them and they did not fail) and returns their callbacks.
  std::vector<Answer> ConfirmErrorsOnlyLocked(const StreamCall* call, uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnStreamEnded(StreamCall* call, size_t slot, const grpc::Status& status);

  const RouterClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<eldr::v1::DecodeRouter::Stub> stub_;
  const std::string bearer_;  // "Bearer <token>", or empty
  ProxyMetrics* const metrics_;
  absl::Mutex mu_;
  // Unary calls in flight plus stream calls not yet done: the destructor waits for 0.
  int64_t calls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  // kStream state.
  std::vector<StreamSlot> slots_ ABSL_GUARDED_BY(mu_);
  size_t next_slot_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t streams_open_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time unary_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // after UNIMPLEMENTED
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;  // 0 is what the router answers an unparsable message with
  absl::flat_hash_map<uint64_t, PendingMessage> pending_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<absl::Time, uint64_t>> deadlines_ ABSL_GUARDED_BY(mu_);  // of pending_
  // Per stream call, the ids of its errors_only messages not yet known to have succeeded, in the
  // order they were queued (which is the order of their ids and of the router's answers).
  absl::flat_hash_map<const StreamCall*, std::deque<uint64_t>> unconfirmed_ ABSL_GUARDED_BY(mu_);
  // The deadline thread sleeps until expiry_wake_at_; a message due earlier sets expiry_kick_.
  absl::Time expiry_wake_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool expiry_kick_ ABSL_GUARDED_BY(mu_) = false;
  std::thread expiry_thread_;
};

}  // namespace eldr::proxy

#endif  // ELDR_PROXY_ROUTER_CLIENT_H_
