// RouterServer: the eldr-router daemon minus its main(): builds the Router from ServerOptions,
// serves DecodeRouter / RouterAdmin (callback API) with gRPC health checking and reflection,
// serves /metrics, /healthz and /readyz over HTTP, runs background components (lease expiry, file
// watch, TLS rotation, load scraping, online refit), reloads centroids without failing an RPC, and
// shuts down within a bounded time.
//
// Lifecycle: Create (validates everything, loads centroids and workers; every configuration error
// surfaces here with a message naming the setting) -> Start (components, listeners, HTTP endpoint,
// port file) -> Shutdown (from any thread, e.g. the signal thread) -> Wait returns.
//
// Changes reach the daemon's logs, metrics and health one way: RouterServer observes its Router
// (RouterObserver). Every worker change and every centroid install or refusal, whatever its
// source (startup, SIGHUP, admin RPC, file watch, refit, state_dir), is logged, counted by source
// and re-evaluates readiness in that one place.
//
// Health (grpc.health.v1, services "" and "eldr.v1.DecodeRouter", HTTP /readyz): SERVING while at
// least one worker is active and, under policy eldr, centroids are installed; NOT_SERVING otherwise
// and from the moment Shutdown begins. Liveness (health service "liveness", HTTP /healthz): SERVING
// until shutdown. Routes are answered either way (readiness only steers load balancers).
//
// Extension points: BackgroundComponent + ServerExtensions::components, for anything that runs
// beside the servers. Factories get a ComponentContext (the Router, which they may observe and
// mutate; the metrics registry; the options; the centroid loader). Started in order before the
// listeners open, stopped in reverse order after the listeners closed.
//
// Thread-safety: Start once from one thread; Shutdown, ReloadFromSignal, Wait and the accessors
// from any.
#ifndef ELDR_SERVER_SERVER_H_
#define ELDR_SERVER_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "eldr/core/router.h"
#include "grpcpp/grpcpp.h"
#include "server/auth.h"
#include "server/centroid_loader.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/ops_http.h"
#include "server/service.h"
#include "server/tls_files.h"

namespace eldr::server {

// Something that runs beside the gRPC servers for the daemon's lifetime.
class BackgroundComponent {
 public:
  virtual ~BackgroundComponent() = default;
  // For logs ("lease_expiry", "load_scraper", "refit").
  virtual std::string name() const = 0;
  // Called once from RouterServer::Start, before the listeners open. An error aborts startup.
  virtual absl::Status Start() = 0;
  // Called once during shutdown, after the listeners stopped. Must return promptly.
  virtual void Stop() = 0;
};

struct ComponentContext {
  Router* router = nullptr;
  ServerMetrics* metrics = nullptr;
  const ServerOptions* options = nullptr;
  CentroidLoader* loader = nullptr;
};

// Returns the component, or null when the settings leave it nothing to do (it is then skipped).
using ComponentFactory =
    std::function<absl::StatusOr<std::unique_ptr<BackgroundComponent>>(const ComponentContext& context)>;

struct ServerExtensions {
  // Built in order by Create, after the Router and the startup centroids; see BackgroundComponent.
  std::vector<ComponentFactory> components;
};

class RouterServer {
 public:
  static absl::StatusOr<std::unique_ptr<RouterServer>> Create(ServerOptions options, ServerExtensions extensions = {});
  // Shuts down (if Start ran and Shutdown did not) and releases everything. Must not run after an
  // unclean shutdown (see clean_shutdown()).
  ~RouterServer();

  RouterServer(const RouterServer&) = delete;
  RouterServer& operator=(const RouterServer&) = delete;

  // Starts components, the gRPC listener(s) and the HTTP endpoint, sets health, writes the port
  // file. On error everything started so far is stopped again.
  absl::Status Start();

  // Bound ports (after Start): the data plane, the admin listener (== grpc_port() when admin is
  // served on the data plane) and the HTTP endpoint (0 when disabled). 0 for a listener on a Unix
  // socket.
  int grpc_port() const { return grpc_port_; }
  int admin_port() const { return admin_port_; }
  int metrics_port() const { return metrics_port_; }

  // SIGHUP: queues a reload of the configured centroid file (coalesced with one already waiting)
  // and re-reads the token files. Never blocks on a reload; failures are logged and counted and
  // keep what is in service.
  void ReloadFromSignal();

  // Graceful shutdown: readiness false at once; RPCs still served for shutdown_drain_delay; then
  // open ReportLoad streams are answered, no new RPCs are taken, in-flight RPCs get shutdown_grace,
  // and components stop. Idempotent; blocks until done: at most drain delay + grace + about a
  // second, even when a centroid load is still running (see clean_shutdown()).
  void Shutdown();
  // Blocks until a Shutdown (from any thread) has completed.
  void Wait();
  // After Shutdown: false when a centroid load was still running at the deadline. It still uses
  // the router, so the server must not be destroyed: the process exits without destructors.
  bool clean_shutdown() const;

  // True while readiness is SERVING.
  bool serving() const;

  Router& router() { return *router_; }
  ServerMetrics& metrics() { return *metrics_; }
  const ServerOptions& options() const { return options_; }

 private:
  class Events;

  RouterServer(ServerOptions options, std::unique_ptr<Router> router);

  absl::StatusOr<std::unique_ptr<grpc::Server>> BuildServer(const std::string& address, bool data_plane, bool admin,
                                                            int64_t max_message_bytes, int* port);
  absl::Status StartListeners();
  void StopListeners();
  // Re-evaluates and publishes the health status.
  void UpdateHealth();
  absl::Status WritePortFile() const;
  void StopComponents();

  const ServerOptions options_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<Events> events_;
  std::unique_ptr<BearerTokenFile> admin_token_;
  std::unique_ptr<BearerTokenFile> data_token_;
  std::unique_ptr<WorkerTokenFile> reporter_tokens_;
  std::unique_ptr<TlsFileMirror> tls_mirror_;
  std::unique_ptr<CentroidLoader> loader_;
  std::unique_ptr<DecodeRouterService> decode_service_;
  std::unique_ptr<RouterAdminService> admin_service_;
  std::vector<std::unique_ptr<BackgroundComponent>> components_;
  size_t components_started_ = 0;
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  std::unique_ptr<OpsHttpEndpoint> ops_http_;

  std::unique_ptr<grpc::Server> data_server_;
  std::unique_ptr<grpc::Server> admin_server_;  // null when admin is served on data_server_
  int grpc_port_ = 0;
  int admin_port_ = 0;
  int metrics_port_ = 0;

  mutable absl::Mutex health_mu_;
  bool started_ ABSL_GUARDED_BY(health_mu_) = false;
  bool shutting_down_ ABSL_GUARDED_BY(health_mu_) = false;
  bool serving_ ABSL_GUARDED_BY(health_mu_) = false;

  mutable absl::Mutex shutdown_mu_;  // held for the whole of Shutdown
  bool clean_shutdown_ ABSL_GUARDED_BY(shutdown_mu_) = true;
  absl::Notification shutdown_done_;
};

}  // namespace eldr::server

#endif  // ELDR_SERVER_SERVER_H_
