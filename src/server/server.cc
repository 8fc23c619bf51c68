#include "server/server.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <limits>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "eldr/core/errors.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "nlohmann/json.hpp"
#include "server/centroid_file_watch.h"
#include "server/logging.h"

namespace eldr::server {
namespace {

constexpr char kDecodeRouterServiceName[] = "eldr.v1.DecodeRouter";
// How long answers already handed to gRPC get to reach the clients before the remaining calls
// and connections are cut during a shutdown.
constexpr absl::Duration kAnswerFlushTime = absl::Milliseconds(100);
constexpr char kRouterAdminServiceName[] = "eldr.v1.RouterAdmin";
// Health service name for liveness probes: SERVING from the moment the listener is up until
// shutdown, whatever the pool and centroids (readiness uses ""), so a router whose workers are all
// drained is taken out of rotation but not restarted.
constexpr char kLivenessServiceName[] = "liveness";

// gRPC channel arguments take milliseconds as int; INT_MAX means "never" for the connection
// limits and is the largest representable keepalive.
int ToGrpcMillis(absl::Duration d) {
  if (d == absl::InfiniteDuration()) return INT_MAX;
  const int64_t ms = absl::ToInt64Milliseconds(d);
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

// Releases leases whose Complete never came.
class LeaseExpiryComponent final : public BackgroundComponent {
 public:
  LeaseExpiryComponent(Router* router, absl::Duration interval) : router_(router), interval_(interval) {}

  std::string name() const override { return "lease_expiry"; }

  absl::Status Start() override {
    thread_ = std::thread([this] {
      while (!stop_.WaitForNotificationWithTimeout(interval_)) {
        const int64_t expired = router_->ExpireLeases(absl::Now());
        if (expired > 0) ELDR_LOG(Info, "leases_expired").With("count", expired);
      }
    });
    return absl::OkStatus();
  }

  void Stop() override {
    if (!stop_.HasBeenNotified()) stop_.Notify();
    if (thread_.joinable()) thread_.join();
  }

 private:
  Router* const router_;
  const absl::Duration interval_;
  absl::Notification stop_;
  std::thread thread_;
};

absl::Status CheckPemFile(absl::string_view setting, const std::string& path) {
  auto text = ReadFile(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(), absl::StrCat("setting '", setting, "': ", text.status().message()));
  }
  if (text->find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("setting '", setting, "': ", path, " holds no PEM block"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(const ServerOptions& o) {
  if (o.tls_cert.empty()) return grpc::InsecureServerCredentials();
  // The file watcher only logs unreadable files; checking them here turns a typo into a startup
  // error that names the setting.
  ELDR_RETURN_IF_ERROR(CheckPemFile("tls_cert", o.tls_cert));
  ELDR_RETURN_IF_ERROR(CheckPemFile("tls_key", o.tls_key));
  if (!o.tls_client_ca.empty()) ELDR_RETURN_IF_ERROR(CheckPemFile("tls_client_ca", o.tls_client_ca));
  const auto refresh_s = static_cast<unsigned int>(absl::ToInt64Seconds(o.tls_reload_interval));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      o.tls_key, o.tls_cert, o.tls_client_ca, refresh_s);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (o.tls_client_ca.empty()) {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::experimental::TlsServerCredentials(tls);
  if (creds == nullptr) return absl::InvalidArgumentError("TLS: gRPC refused the TLS settings");
  return creds;
}

void InitReflectionOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::EnableDefaultHealthCheckService(true);
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(ServerOptions options,
                                                                   ServerExtensions extensions) {
  ELDR_RETURN_IF_ERROR(ValidateServerOptions(options));
  SetLogLevel(options.log_level);
  SetLogFormat(options.log_format);

  RouterOptions router_options;
  router_options.policy = options.policy;
  router_options.tau = options.tau;
  router_options.seed = options.seed;
  router_options.load.lease_ttl = options.lease_ttl;
  router_options.load.snapshot_staleness = options.snapshot_staleness;
  router_options.on_signature = std::move(extensions.on_signature);
  ELDR_ASSIGN_OR_RETURN(std::unique_ptr<Router> router, Router::Create(std::move(router_options), options.workers));

  ELDR_ASSIGN_OR_RETURN(std::unique_ptr<AdminAuthorizer> auth, AdminAuthorizer::Create(options.admin_token_file));

  std::unique_ptr<RouterServer> server(new RouterServer(std::move(options), std::move(router), std::move(auth)));
  ELDR_ASSIGN_OR_RETURN(server->credentials_, MakeCredentials(server->options_));

  if (!server->options_.centroids.empty()) {
    auto artifact = LoadCentroidArtifact(server->options_.centroids);
    if (!artifact.ok()) {
      return absl::Status(artifact.status().code(), absl::StrCat("--centroids ", server->options_.centroids, ": ",
                                                                 artifact.status().message()));
    }
    absl::Status installed = server->router_->InstallCentroids(*artifact);
    if (!installed.ok()) {
      return absl::Status(installed.code(), absl::StrCat("--centroids ", server->options_.centroids,
                                                         " does not fit --workers: ", installed.message()));
    }
  }

  ComponentContext context;
  context.router = server->router_.get();
  context.metrics = server->metrics_.get();
  context.options = &server->options_;
  RouterServer* raw = server.get();
  context.install_centroids = [raw](const CentroidArtifact& artifact) {
    return raw->InstallArtifact(artifact, "component");
  };
  server->components_.push_back(
      std::make_unique<LeaseExpiryComponent>(server->router_.get(), server->options_.lease_expiry_interval));
  if (!server->options_.centroids.empty()) {
    // A rewritten --centroids file (an edited ConfigMap) is reloaded like SIGHUP does it.
    server->components_.push_back(std::make_unique<CentroidFileWatch>(
        server->options_.centroids, absl::Seconds(1), [raw] { (void)raw->ReloadCentroids(std::string(), nullptr); }));
  }
  for (const ComponentFactory& factory : extensions.components) {
    ELDR_ASSIGN_OR_RETURN(std::unique_ptr<BackgroundComponent> component, factory(context));
    if (component != nullptr) server->components_.push_back(std::move(component));
  }
  return server;
}

RouterServer::RouterServer(ServerOptions options, std::unique_ptr<Router> router,
                           std::unique_ptr<AdminAuthorizer> auth)
    : options_(std::move(options)),
      router_(std::move(router)),
      metrics_(std::make_unique<ServerMetrics>()),
      admin_auth_(std::move(auth)),
      blocking_(std::make_unique<BlockingExecutor>(1)) {
  metrics_->AttachRouter(router_.get());
  ServiceContext ctx;
  ctx.router = router_.get();
  ctx.metrics = metrics_.get();
  ctx.configured_policy = options_.policy;
  ctx.admin_auth = admin_auth_->enabled() ? admin_auth_.get() : nullptr;
  ctx.max_request_bytes = options_.max_message_bytes;
  ctx.blocking = blocking_.get();
  ctx.reload_centroids = [this](const std::string& path, const std::string* inline_json) {
    return ReloadCentroids(path, inline_json);
  };
  ctx.on_pool_changed = [this] { UpdateHealth(); };
  decode_service_ = std::make_unique<DecodeRouterService>(ctx);
  admin_service_ = std::make_unique<RouterAdminService>(ctx);
}

RouterServer::~RouterServer() {
  bool started = false;
  {
    absl::MutexLock lock(&health_mu_);
    started = started_;
  }
  if (started && !shutdown_done_.HasBeenNotified()) Shutdown();
  StopComponents();
  metrics_->StopExposer();  // no scrape may read the router while it is destroyed
  blocking_->Shutdown();
}

absl::StatusOr<std::unique_ptr<grpc::Server>> RouterServer::BuildServer(const std::string& address,
                                                                        bool data_plane, bool admin,
                                                                        int64_t max_message_bytes, int* port) {
  InitReflectionOnce();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, credentials_, port);
  if (data_plane) builder.RegisterService(decode_service_.get());
  if (admin) builder.RegisterService(admin_service_.get());
  // The data plane's handlers check the limit themselves (INVALID_ARGUMENT, counted): its transport
  // lets through kTransportMessageHeadroom times more so that they see what is over it.
  const int64_t receive_limit =
      data_plane ? std::min<int64_t>(max_message_bytes * kTransportMessageHeadroom, std::numeric_limits<int>::max())
                 : max_message_bytes;
  builder.SetMaxReceiveMessageSize(static_cast<int>(receive_limit));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  // gRPC binds with SO_REUSEPORT by default: a second daemon on the same port would silently
  // share the traffic instead of failing to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, static_cast<int>(options_.max_concurrent_streams));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ToGrpcMillis(options_.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ToGrpcMillis(options_.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                             options_.keepalive_permit_without_calls ? 1 : 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             ToGrpcMillis(options_.keepalive_min_ping_interval));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, ToGrpcMillis(options_.max_connection_idle));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, ToGrpcMillis(options_.max_connection_age));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                             ToGrpcMillis(options_.max_connection_age_grace));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    if (server != nullptr) server->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", address, "' (address in use, or not a valid host:port)"));
  }
  // The default health service starts out SERVING for ""; nothing can have connected yet (the
  // port is not announced), and it flips to the real state before Start returns.
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("", false);
  if (data_plane) health->SetServingStatus(kDecodeRouterServiceName, false);
  if (admin) health->SetServingStatus(kRouterAdminServiceName, false);
  health->SetServingStatus(kLivenessServiceName, true);
  return server;
}

absl::Status RouterServer::Start() {
  {
    absl::MutexLock lock(&health_mu_);
    if (started_) return absl::FailedPreconditionError("RouterServer::Start called twice");
  }
  for (; components_started_ < components_.size(); ++components_started_) {
    BackgroundComponent& c = *components_[components_started_];
    absl::Status status = c.Start();
    if (!status.ok()) {
      StopComponents();
      return absl::Status(status.code(), absl::StrCat("component ", c.name(), ": ", status.message()));
    }
  }

  const bool separate_admin = !options_.admin_listen.empty();
  auto data = BuildServer(options_.listen, /*data_plane=*/true, /*admin=*/!separate_admin,
                          options_.max_message_bytes, &grpc_port_);
  if (!data.ok()) {
    StopComponents();
    return absl::Status(data.status().code(), absl::StrCat("listen: ", data.status().message()));
  }
  data_server_ = *std::move(data);
  admin_port_ = grpc_port_;
  if (separate_admin) {
    auto admin = BuildServer(options_.admin_listen, /*data_plane=*/false, /*admin=*/true,
                             options_.admin_max_message_bytes, &admin_port_);
    if (!admin.ok()) {
      data_server_->Shutdown();
      StopComponents();
      return absl::Status(admin.status().code(), absl::StrCat("admin_listen: ", admin.status().message()));
    }
    admin_server_ = *std::move(admin);
  }
  if (!options_.metrics_listen.empty()) {
    auto port = metrics_->StartExposer(options_.metrics_listen);
    if (!port.ok()) {
      if (admin_server_) admin_server_->Shutdown();
      data_server_->Shutdown();
      StopComponents();
      return port.status();
    }
    metrics_port_ = *port;
  }
  {
    absl::MutexLock lock(&health_mu_);
    started_ = true;
  }
  UpdateHealth();
  const RouterState state = router_->GetState(absl::Now());
  ELDR_LOG(Info, "router_started")
      .With("grpc_port", grpc_port_)
      .With("admin_port", admin_port_)
      .With("metrics_port", metrics_port_)
      .With("tls", !options_.tls_cert.empty())
      .With("mtls", !options_.tls_client_ca.empty())
      .With("admin_token", admin_auth_->enabled())
      .With("policy", PolicyKindName(options_.policy))
      .With("tau", options_.tau)
      .With("workers", state.workers.size())
      .With("centroid_generation", state.centroid_generation)
      .With("centroid_rows", state.centroid_rows)
      .With("index", state.index_kind)
      .With("serving", serving());
  // The port file is written last: whoever waits for it (tests, wrappers) then also finds the
  // router_started log line.
  absl::Status port_file = WritePortFile();
  if (!port_file.ok()) {
    Shutdown();
    return port_file;
  }
  return absl::OkStatus();
}

absl::Status RouterServer::WritePortFile() const {
  if (options_.port_file.empty()) return absl::OkStatus();
  nlohmann::json j = {{"grpc_port", grpc_port_}, {"admin_port", admin_port_}, {"metrics_port", metrics_port_},
                      {"pid", static_cast<int64_t>(getpid())}};
  absl::Status status = WriteFileAtomically(options_.port_file, j.dump() + "\n");
  if (!status.ok()) return absl::Status(status.code(), absl::StrCat("port_file: ", status.message()));
  return absl::OkStatus();
}

bool RouterServer::serving() const {
  absl::MutexLock lock(&health_mu_);
  return serving_;
}

void RouterServer::UpdateHealth() {
  const RouterState state = router_->GetState(absl::Now());
  int active = 0;
  for (const WorkerStatus& w : state.workers) {
    if (w.state == WorkerState::kActive) ++active;
  }
  const bool centroids_ok = options_.policy != PolicyKind::kEldr || state.centroid_generation > 0;
  absl::MutexLock lock(&health_mu_);
  if (!started_ || shutting_down_) return;
  const bool serving = active > 0 && centroids_ok;
  for (grpc::Server* s : {data_server_.get(), admin_server_.get()}) {
    if (s != nullptr) {
      s->GetHealthCheckService()->SetServingStatus(serving);  // every name, liveness included
      s->GetHealthCheckService()->SetServingStatus(kLivenessServiceName, true);
    }
  }
  if (serving != serving_) {
    serving_ = serving;
    ELDR_LOG(Info, "health_changed")
        .With("serving", serving)
        .With("active_workers", active)
        .With("centroid_generation", state.centroid_generation);
  }
}

absl::StatusOr<uint64_t> RouterServer::InstallArtifact(const CentroidArtifact& artifact, absl::string_view source) {
  absl::Status status;
  uint64_t generation = 0;
  {
    absl::MutexLock lock(&reload_mu_);
    status = router_->InstallCentroids(artifact);
    if (status.ok()) generation = router_->GetState(absl::Now()).centroid_generation;
  }
  metrics_->RecordReload(status.ok());
  if (!status.ok()) {
    if (status.code() == absl::StatusCode::kInvalidArgument || status.code() == absl::StatusCode::kFailedPrecondition) {
      metrics_->RecordRejected(RejectReasonOf(status));
    }
    ELDR_LOG(Warning, "centroids_rejected").With("source", source).With("code", status);
    return status;
  }
  ELDR_LOG(Info, "centroids_installed")
      .With("source", source)
      .With("generation", generation)
      .With("rows", artifact.k)
      .With("dim", artifact.dim())
      .With("model", artifact.model);
  UpdateHealth();
  return generation;
}

absl::StatusOr<std::pair<uint64_t, int>> RouterServer::ReloadCentroids(const std::string& path,
                                                                      const std::string* inline_json) {
  absl::StatusOr<CentroidArtifact> artifact;
  std::string source;
  if (inline_json != nullptr) {
    source = "inline";
    artifact = ParseCentroidArtifact(*inline_json);
  } else {
    source = path.empty() ? options_.centroids : path;
    if (source.empty()) {
      metrics_->RecordReload(false);
      return absl::FailedPreconditionError("no path given and no --centroids file configured");
    }
    artifact = LoadCentroidArtifact(source);
  }
  if (!artifact.ok()) {
    metrics_->RecordReload(false);
    if (artifact.status().code() == absl::StatusCode::kInvalidArgument) {
      metrics_->RecordRejected(RejectReasonOf(artifact.status()));
    }
    ELDR_LOG(Warning, "centroids_rejected").With("source", source).With("code", artifact.status());
    const absl::Status& s = artifact.status();
    return absl::Status(s.code(), inline_json != nullptr ? std::string(s.message())
                                                         : absl::StrCat(source, ": ", s.message()));
  }
  ELDR_ASSIGN_OR_RETURN(const uint64_t generation, InstallArtifact(*artifact, source));
  return std::make_pair(generation, artifact->k);
}

void RouterServer::ReloadFromSignal() {
  ELDR_LOG(Info, "reload_requested").With("signal", "SIGHUP");
  if (!options_.centroids.empty()) {
    // Errors are logged and counted inside; the old set stays.
    (void)ReloadCentroids(std::string(), nullptr);
  }
  if (admin_auth_->enabled()) {
    absl::Status status = admin_auth_->Reload();
    if (status.ok()) {
      ELDR_LOG(Info, "admin_token_reloaded");
    } else {
      ELDR_LOG(Warning, "admin_token_reload_failed").With("code", status);
    }
  }
}

void RouterServer::StopComponents() {
  while (components_started_ > 0) {
    --components_started_;
    components_[components_started_]->Stop();
  }
}

void RouterServer::Shutdown() {
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  if (shutdown_done_.HasBeenNotified()) return;
  const absl::Time begin = absl::Now();
  {
    absl::MutexLock lock(&health_mu_);
    shutting_down_ = true;
    serving_ = false;
    for (grpc::Server* s : {data_server_.get(), admin_server_.get()}) {
      if (s != nullptr) s->GetHealthCheckService()->Shutdown();
    }
  }
  ELDR_LOG(Info, "shutdown_started")
      .With("drain_delay", options_.shutdown_drain_delay)
      .With("grace", options_.shutdown_grace);
  if (options_.shutdown_drain_delay > absl::ZeroDuration()) absl::SleepFor(options_.shutdown_drain_delay);
  decode_service_->FinishStreamsForShutdown();
  // The metrics endpoint takes about a second to stop (its HTTP server's poll period): stop it
  // while the listeners drain rather than after.
  std::thread metrics_stop([this] { metrics_->StopExposer(); });
  const std::chrono::system_clock::time_point deadline =
      absl::ToChronoTime(absl::Now() + options_.shutdown_grace);
  // Both listeners stop taking new calls at once (GOAWAY) and share the grace period.
  absl::Notification servers_stopped;
  std::thread stopper([this, deadline, &servers_stopped] {
    std::thread admin_stop;
    if (admin_server_ != nullptr) admin_stop = std::thread([this, deadline] { admin_server_->Shutdown(deadline); });
    if (data_server_ != nullptr) data_server_->Shutdown(deadline);
    if (admin_stop.joinable()) admin_stop.join();
    servers_stopped.Notify();
  });
  // gRPC's Shutdown also waits for every client connection to close, and a client whose channel
  // is idle answers the GOAWAY only when its own backup poller runs (seconds later). Our RPCs
  // finish by themselves: unary handlers answer inline, streams were finished above, and the
  // blocking executor runs its queue to the end (later submissions are answered UNAVAILABLE).
  // Once that is done and the last answers had time to leave, the remaining calls (health
  // watches, idle connections) are cut instead of holding the shutdown for the whole grace.
  blocking_->Shutdown();
  if (!servers_stopped.WaitForNotificationWithTimeout(kAnswerFlushTime)) {
    for (grpc::Server* s : {data_server_.get(), admin_server_.get()}) {
      if (s != nullptr) grpc_server_cancel_all_calls(s->c_server());
    }
  }
  stopper.join();
  StopComponents();
  metrics_stop.join();
  const RouterState state = router_->GetState(absl::Now());
  ELDR_LOG(Info, "shutdown_complete")
      .With("took", absl::Now() - begin)
      .With("live_leases", state.live_leases);
  shutdown_done_.Notify();
}

void RouterServer::Wait() { shutdown_done_.WaitForNotification(); }

}  // namespace eldr::server
