// eldr-proxy's asynchronous client of eldr-router's data plane (Route, Complete) over gRPC's
// callback API: no thread waits for an answer.
//
// Thread-safety: every method may be called from any thread. Callbacks run on gRPC's threads; they
// must not block.
#ifndef ELDR_PROXY_ROUTER_CLIENT_H_
#define ELDR_PROXY_ROUTER_CLIENT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "eldr/proxy/proxy.h"
#include "eldr/v1/router.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace eldr::proxy {

class RouterClient {
 public:
  // FAILED_PRECONDITION when a TLS or token file cannot be read. The channel connects lazily.
  static absl::StatusOr<std::unique_ptr<RouterClient>> Create(const RouterClientOptions& options);
  // Waits for the calls in flight to end (each has its deadline).
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
  RouterClient(RouterClientOptions options, std::shared_ptr<grpc::Channel> channel, std::string bearer);
  void CompleteAttempt(uint64_t lease_id, int64_t output_tokens, int attempt, std::function<void(absl::Status)> done);
  std::unique_ptr<grpc::ClientContext> NewContext(absl::Duration timeout) const;
  void CallStarted();
  void CallEnded();

  const RouterClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<eldr::v1::DecodeRouter::Stub> stub_;
  const std::string bearer_;  // "Bearer <token>", or empty
  absl::Mutex mu_;
  int64_t calls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace eldr::proxy

#endif  // ELDR_PROXY_ROUTER_CLIENT_H_
