// RouterServer: the eldr-router daemon minus its main(): builds the Router from ServerOptions,
// serves DecodeRouter / RouterAdmin (callback API) with gRPC health checking and reflection,
// exposes Prometheus metrics, runs background components (lease expiry, ...), reloads centroids
// without failing an RPC, and shuts down gracefully.
//
// Lifecycle: Create (validates everything, loads centroids and workers; every configuration error
// surfaces here with a message naming the setting) -> Start (components, listeners, metrics,
// port file) -> Shutdown (from any thread, e.g. the SIGTERM handler thread) -> Wait returns.
//
// Health (grpc.health.v1, services "" and "eldr.v1.DecodeRouter"): SERVING while at least one
// worker is active and, under policy eldr, centroids are installed; NOT_SERVING otherwise and from
// the moment Shutdown begins. Routes are answered either way (NOT_SERVING only steers readiness).
//
// Extension points (kept deliberately small so later features are a few lines in main.cc):
//  - BackgroundComponent + ServerExtensions::components: anything that runs beside the servers.
//    Factories get a ComponentContext (the Router, the metrics registry, the options and a way
//    to install centroids exactly like a reload does). Started in order before the listeners
//    open, stopped in reverse order after the listeners closed.
//    * Load scraping of decode workers: a component owning an eldr::LoadScraper (load_scraper.h)
//      built from the Router pointer; its Start/Stop map onto the scraper's; its per-worker
//      metrics go into ComponentContext::metrics->registry().
//    * Online refit: a component owning an eldr::OnlineRefitter (refit.h) that installs new
//      centroids through ComponentContext::install_centroids (so generation, logs, metrics and
//      health stay consistent); its window is fed through ServerExtensions::on_signature.
//  - ServerExtensions::on_signature: becomes RouterOptions::on_signature (the Router must be built
//    with it). It is called on gRPC threads for every accepted signature: it must not block. The
//    refitter usually does not exist yet when the Router is built, so pass a small forwarding
//    object that the refit component's factory completes.
//  - metrics().registry(): where components register their families (one /metrics page).
//
// Thread-safety: Start once from one thread; Shutdown, Reload*, Wait and the accessors from any.
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
#include "absl/types/span.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/router.h"
#include "grpcpp/grpcpp.h"
#include "server/blocking_executor.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/service.h"

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
  // Installs `artifact` the way ReloadCentroids does (serialised with reloads, logged, counted,
  // health re-evaluated). Returns the new generation.
  std::function<absl::StatusOr<uint64_t>(const CentroidArtifact& artifact)> install_centroids;
};

// Returns the component, or null when the settings leave it nothing to do (it is then skipped).
using ComponentFactory =
    std::function<absl::StatusOr<std::unique_ptr<BackgroundComponent>>(const ComponentContext& context)>;

struct ServerExtensions {
  // Becomes RouterOptions::on_signature. Empty: none (no per-route cost).
  std::function<void(absl::Span<const float> signature, const std::string& worker)> on_signature;
  // Built in order by Create, after the Router; see BackgroundComponent.
  std::vector<ComponentFactory> components;
};

class RouterServer {
 public:
  static absl::StatusOr<std::unique_ptr<RouterServer>> Create(ServerOptions options,
                                                              ServerExtensions extensions = {});
  // Shuts down (if Start ran and Shutdown did not) and releases everything.
  ~RouterServer();

  RouterServer(const RouterServer&) = delete;
  RouterServer& operator=(const RouterServer&) = delete;

  // Starts components, the gRPC listener(s) and the metrics endpoint, sets health, writes the
  // port file. On error everything started so far is stopped again.
  absl::Status Start();

  // Bound ports (after Start): the data plane, the admin listener (== grpc_port() when admin is
  // served on the data plane) and the metrics endpoint (0 when disabled).
  int grpc_port() const { return grpc_port_; }
  int admin_port() const { return admin_port_; }
  int metrics_port() const { return metrics_port_; }

  // SIGHUP: reloads the configured centroid file (when one is configured) and the admin token.
  // A failure keeps what is in service and is logged and counted; RPCs are not affected.
  void ReloadFromSignal();

  // Loads and installs centroids from `path` (empty: the configured --centroids file) or, when
  // `inline_json` is non-null, from that text. Returns (generation, rows). Errors: those of the
  // artifact parser (INVALID_ARGUMENT with the reason), of the file (NOT_FOUND, ...), and
  // FAILED_PRECONDITION when the rows do not match the workers. The current set stays on error.
  absl::StatusOr<std::pair<uint64_t, int>> ReloadCentroids(const std::string& path, const std::string* inline_json);

  // Graceful shutdown: health NOT_SERVING (RPCs still served for shutdown_drain_delay), then open
  // ReportLoad streams are answered, no new RPCs are taken, in-flight RPCs get up to
  // shutdown_grace to finish, and components stop. Idempotent; blocks until done (at most
  // drain delay + grace + the components' Stop).
  void Shutdown();
  // Blocks until a Shutdown (from any thread) has completed.
  void Wait();

  // True while health reports SERVING.
  bool serving() const;

  Router& router() { return *router_; }
  ServerMetrics& metrics() { return *metrics_; }
  const ServerOptions& options() const { return options_; }

 private:
  RouterServer(ServerOptions options, std::unique_ptr<Router> router, std::unique_ptr<AdminAuthorizer> auth);

  absl::StatusOr<uint64_t> InstallArtifact(const CentroidArtifact& artifact, absl::string_view source);
  absl::StatusOr<std::unique_ptr<grpc::Server>> BuildServer(const std::string& address, bool data_plane,
                                                            bool admin, int64_t max_message_bytes, int* port);
  // Re-evaluates and publishes the health status.
  void UpdateHealth();
  absl::Status WritePortFile() const;
  void StopComponents();

  const ServerOptions options_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<AdminAuthorizer> admin_auth_;
  std::unique_ptr<BlockingExecutor> blocking_;
  std::unique_ptr<DecodeRouterService> decode_service_;
  std::unique_ptr<RouterAdminService> admin_service_;
  std::vector<std::unique_ptr<BackgroundComponent>> components_;
  size_t components_started_ = 0;
  std::shared_ptr<grpc::ServerCredentials> credentials_;

  std::unique_ptr<grpc::Server> data_server_;
  std::unique_ptr<grpc::Server> admin_server_;  // null when admin is served on data_server_
  int grpc_port_ = 0;
  int admin_port_ = 0;
  int metrics_port_ = 0;

  absl::Mutex reload_mu_;  // serialises centroid installs

  mutable absl::Mutex health_mu_;
  bool started_ ABSL_GUARDED_BY(health_mu_) = false;
  bool shutting_down_ ABSL_GUARDED_BY(health_mu_) = false;
  bool serving_ ABSL_GUARDED_BY(health_mu_) = false;

  absl::Mutex shutdown_mu_;  // held for the whole of Shutdown
  absl::Notification shutdown_done_;
};

}  // namespace eldr::server

#endif  // ELDR_SERVER_SERVER_H_
