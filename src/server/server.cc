#include "server/server.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <limits>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
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
constexpr char kRouterAdminServiceName[] = "eldr.v1.RouterAdmin";
// Health service name for liveness probes: SERVING from the moment the listener is up until
// shutdown, whatever the pool and centroids (readiness uses ""), so a router whose workers are all
// drained is taken out of rotation but not restarted.
constexpr char kLivenessServiceName[] = "liveness";
// How long answers already handed to gRPC get to reach the clients before the remaining calls
// and connections are cut during a shutdown.
constexpr absl::Duration kAnswerFlushTime = absl::Milliseconds(100);

// gRPC channel arguments take milliseconds as int; INT_MAX means "never" for the connection
// limits and is the largest representable keepalive.
int ToGrpcMillis(absl::Duration d) {
  if (d == absl::InfiniteDuration()) return INT_MAX;
  const int64_t ms = absl::ToInt64Milliseconds(d);
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

// Something done every `interval` on its own thread until Stop.
class PeriodicComponent : public BackgroundComponent {
 public:
  PeriodicComponent(std::string name, absl::Duration interval, std::function<void()> tick)
      : name_(std::move(name)), interval_(interval), tick_(std::move(tick)) {}
  ~PeriodicComponent() override { Stop(); }

  std::string name() const override { return name_; }

  absl::Status Start() override {
    thread_ = std::thread([this] {
      while (!stop_.WaitForNotificationWithTimeout(interval_)) tick_();
    });
    return absl::OkStatus();
  }

  void Stop() override {
    if (!stop_.HasBeenNotified()) stop_.Notify();
    if (thread_.joinable()) thread_.join();
  }

 private:
  const std::string name_;
  const absl::Duration interval_;
  const std::function<void()> tick_;
  absl::Notification stop_;
  std::thread thread_;
};

// The TLS files gRPC reads are validated private copies (TlsFileMirror): a mismatched pair is a
// startup error, and a broken rotation is refused, logged and counted while the pair in service
// stays. gRPC's own watcher then picks up the copies.
absl::StatusOr<std::unique_ptr<TlsFileMirror>> MakeTlsMirror(const ServerOptions& o) {
  if (o.tls_cert.empty()) return std::unique_ptr<TlsFileMirror>();
  std::string dir = o.tls_mirror_dir;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/eldr-router-tls-XXXXXX");
    if (::mkdtemp(pattern.data()) == nullptr) {
      return absl::ErrnoToStatus(errno, absl::StrCat("setting 'tls_mirror_dir': cannot create ", pattern));
    }
    dir = pattern;
  }
  return TlsFileMirror::Create(TlsFiles{o.tls_cert, o.tls_key, o.tls_client_ca}, dir);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(const ServerOptions& o,
                                                                         const TlsFileMirror* mirror) {
  if (mirror == nullptr) return grpc::InsecureServerCredentials();
  const TlsFiles files = mirror->mirrored();
  const auto refresh_s = static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(o.tls_reload_interval)));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.key, files.cert,
                                                                                       files.client_ca, refresh_s);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (files.client_ca.empty()) {
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

// The one place where the router's changes become log lines, metrics and health.
class RouterServer::Events final : public RouterObserver {
 public:
  explicit Events(RouterServer* server) : server_(server) {}

  void OnPoolChanged(const PoolChange& change) override {
    switch (change.kind) {
      case PoolChangeKind::kAdded:
      case PoolChangeKind::kUpdated:
        ELDR_LOG(Info, "worker_upserted")
            .With("worker", change.spec.id)
            .With("address", change.spec.address)
            .With("capacity", change.spec.capacity)
            .With("max_inflight", change.spec.max_inflight)
            .With("created", change.kind == PoolChangeKind::kAdded);
        break;
      case PoolChangeKind::kDraining:
        ELDR_LOG(Info, "worker_draining").With("worker", change.spec.id).With("inflight", change.inflight);
        break;
      case PoolChangeKind::kRemoved:
        ELDR_LOG(Info, "worker_removed").With("worker", change.spec.id).With("dropped_leases", change.inflight);
        break;
      case PoolChangeKind::kHealthChanged:
        return;  // the load source that decided logs it, with its reason
    }
    server_->UpdateHealth();
  }

  void OnCentroidsInstalled(const CentroidInstall& install) override {
    server_->metrics_->RecordCentroidInstall(install.source, true);
    ELDR_LOG(Info, "centroids_installed")
        .With("source", CentroidSourceLabel(install.source))
        .With("generation", install.generation)
        .With("rows", install.rows)
        .With("dim", install.dim)
        .With("model", install.model)
        .With("transform_changed", install.transform_changed);
    server_->UpdateHealth();
  }

  void OnCentroidsRejected(CentroidSource source, const absl::Status& status) override {
    server_->metrics_->RecordCentroidInstall(source, false);
    if (status.code() == absl::StatusCode::kInvalidArgument || status.code() == absl::StatusCode::kFailedPrecondition) {
      server_->metrics_->RecordRejected(RejectReasonOf(status));
    }
    ELDR_LOG_LIMITED(Warning, "centroids_rejected", absl::StrCat("centroids_rejected/", CentroidSourceLabel(source)))
        .With("source", CentroidSourceLabel(source))
        .With("code", status);
  }

 private:
  RouterServer* const server_;
};

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(ServerOptions options, ServerExtensions extensions) {
  ELDR_RETURN_IF_ERROR(ValidateServerOptions(options));
  SetLogLevel(options.log_level);
  SetLogFormat(options.log_format);
  DaemonLogLimiter().set_per_second(options.log_rate_limit);
  if (options.allow_insecure_admin) {
    const std::string& admin = options.admin_listen.empty() ? options.listen : options.admin_listen;
    if (!IsLoopbackAddress(admin) && options.admin_token_file.empty() && options.tls_client_ca.empty()) {
      ELDR_LOG(Warning, "admin_insecure")
          .With("admin_address", admin)
          .With("note", "RouterAdmin accepts unauthenticated calls from the network (allow_insecure_admin)");
    }
  }

  ELDR_ASSIGN_OR_RETURN(std::unique_ptr<Router> router, Router::Create(options.router, options.workers));
  std::unique_ptr<RouterServer> server(new RouterServer(std::move(options), std::move(router)));
  const ServerOptions& o = server->options_;
  const bool discovered = o.discovery.mode == DiscoveryMode::kKubernetes;
  ELDR_ASSIGN_OR_RETURN(server->admin_token_, BearerTokenFile::Create("admin_token_file", o.admin_token_file));
  ELDR_ASSIGN_OR_RETURN(server->data_token_, BearerTokenFile::Create("data_token_file", o.data_token_file));
  if (o.reporter_auth == ReporterAuth::kToken) {
    ELDR_ASSIGN_OR_RETURN(server->reporter_tokens_, WorkerTokenFile::Create(o.reporter_tokens_file));
  }
  ELDR_ASSIGN_OR_RETURN(server->tls_mirror_, MakeTlsMirror(o));
  ELDR_ASSIGN_OR_RETURN(server->credentials_, MakeCredentials(o, server->tls_mirror_.get()));
  ELDR_ASSIGN_OR_RETURN(server->loader_,
                        CentroidLoader::Create(CentroidLoaderOptions{o.centroids, o.centroids_dir,
                                                                     static_cast<size_t>(o.max_artifact_bytes),
                                                                     /*fit_rows_to_pool=*/discovered},
                                               server->router_.get()));

  ServiceContext ctx;
  ctx.router = server->router_.get();
  ctx.metrics = server->metrics_.get();
  ctx.loader = server->loader_.get();
  ctx.configured_policy = o.router.policy;
  ctx.admin_token = server->admin_token_.get();
  ctx.data_token = server->data_token_.get();
  ctx.reporter_auth = o.reporter_auth;
  ctx.reporter_tokens = server->reporter_tokens_.get();
  ctx.mutual_tls = !o.tls_client_ca.empty();
  ctx.route_client_keys = o.refit.interval > absl::ZeroDuration() || !o.refit.state_dir.empty();
  ctx.max_request_bytes = o.max_message_bytes;
  ctx.max_stream_batch = o.max_stream_batch;
  ctx.max_report_streams = o.max_report_streams;
  ctx.max_report_streams_per_peer = o.max_report_streams_per_peer;
  ctx.report_stream_idle_timeout = o.report_stream_idle_timeout;
  ctx.pool_discovered = discovered;
  server->decode_service_ = std::make_unique<DecodeRouterService>(ctx);
  server->admin_service_ = std::make_unique<RouterAdminService>(ctx);

  server->router_->AddObserver(server->events_.get());
  // A discovered pool starts empty: the discovery component installs the configured centroids once
  // the first pods joined (their names are not known before); a broken file still fails here.
  if (!o.centroids.empty() && discovered) {
    absl::StatusOr<CentroidArtifact> artifact =
        LoadCentroidArtifact(o.centroids, static_cast<size_t>(o.max_artifact_bytes));
    if (!artifact.ok()) {
      return absl::Status(artifact.status().code(), absl::StrCat("--centroids: ", artifact.status().message()));
    }
  }
  if (!o.centroids.empty() && !discovered) {
    absl::StatusOr<LoadedCentroids> loaded = server->loader_->LoadConfiguredNow(CentroidSource::kStartup);
    if (!loaded.ok()) {
      const bool misfit = absl::IsFailedPrecondition(loaded.status());
      return absl::Status(loaded.status().code(),
                          absl::StrCat("--centroids ", o.centroids, misfit ? " does not fit --workers: " : ": ",
                                       loaded.status().message()));
    }
  }

  RouterServer* raw = server.get();
  server->components_.push_back(std::make_unique<PeriodicComponent>("lease_expiry", o.lease_expiry_interval, [raw] {
    const int64_t expired = raw->router_->ExpireLeases(absl::Now());
    if (expired > 0) ELDR_LOG(Info, "leases_expired").With("count", expired);
  }));
  server->components_.push_back(std::make_unique<PeriodicComponent>(
      "report_stream_idle", absl::Seconds(1), [raw] { raw->decode_service_->EndIdleStreams(absl::Now()); }));
  if (!o.centroids.empty()) {
    // A rewritten --centroids file (an edited ConfigMap) is reloaded like SIGHUP does it.
    server->components_.push_back(std::make_unique<CentroidFileWatch>(
        o.centroids, absl::Seconds(1), [raw] { raw->loader_->ReloadConfigured(CentroidSource::kFileWatch); }));
  }
  if (server->tls_mirror_ != nullptr) {
    server->components_.push_back(std::make_unique<PeriodicComponent>("tls_rotation", o.tls_reload_interval, [raw] {
      absl::StatusOr<bool> rotated = raw->tls_mirror_->Refresh();
      if (!rotated.ok()) {
        raw->metrics_->RecordTlsRotation(false);
        ELDR_LOG_LIMITED(Warning, "tls_rotation_refused", "tls_rotation_refused").With("code", rotated.status());
      } else if (*rotated) {
        raw->metrics_->RecordTlsRotation(true);
        ELDR_LOG(Info, "tls_rotated").With("generation", raw->tls_mirror_->generation());
      }
    }));
  }
  ComponentContext context;
  context.router = server->router_.get();
  context.metrics = server->metrics_.get();
  context.options = &server->options_;
  context.loader = server->loader_.get();
  for (const ComponentFactory& factory : extensions.components) {
    ELDR_ASSIGN_OR_RETURN(std::unique_ptr<BackgroundComponent> component, factory(context));
    if (component != nullptr) server->components_.push_back(std::move(component));
  }
  return server;
}

RouterServer::RouterServer(ServerOptions options, std::unique_ptr<Router> router)
    : options_(std::move(options)),
      router_(std::move(router)),
      metrics_(std::make_unique<ServerMetrics>()),
      events_(std::make_unique<Events>(this)) {
  metrics_->AttachRouter(router_.get());
}

RouterServer::~RouterServer() {
  bool started = false;
  {
    absl::MutexLock lock(&health_mu_);
    started = started_;
  }
  if (started && !shutdown_done_.HasBeenNotified()) Shutdown();
  StopComponents();
  if (ops_http_ != nullptr) ops_http_->Stop();  // no scrape may read the router while it is destroyed
  loader_.reset();                              // joins its thread before the router goes
  router_->RemoveObserver(events_.get());
}

absl::StatusOr<std::unique_ptr<grpc::Server>> RouterServer::BuildServer(const std::string& address, bool data_plane,
                                                                        bool admin, int64_t max_message_bytes,
                                                                        int* port) {
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
  // The data plane sends only answers the router builds itself, whose size follows from its own
  // limits (a RouteStream batch answer grows with --max_stream_batch, not with the caller's bytes),
  // so no send limit applies there: a batch answer over --max_message_bytes would otherwise end the
  // stream. An admin listener of its own keeps the limit on what it sends.
  builder.SetMaxSendMessageSize(data_plane ? -1 : static_cast<int>(max_message_bytes));
  // gRPC binds with SO_REUSEPORT by default: a second daemon on the same port would silently
  // share the traffic instead of failing to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, static_cast<int>(options_.max_concurrent_streams));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ToGrpcMillis(options_.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ToGrpcMillis(options_.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, options_.keepalive_permit_without_calls ? 1 : 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             ToGrpcMillis(options_.keepalive_min_ping_interval));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, ToGrpcMillis(options_.max_connection_idle));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, ToGrpcMillis(options_.max_connection_age));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, ToGrpcMillis(options_.max_connection_age_grace));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    if (server != nullptr) server->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", address, "' (address in use, or not a valid host:port or unix:path)"));
  }
  // gRPC reports 1 for a bound Unix socket, which has no port.
  if (IsUnixSocketAddress(address)) *port = 0;
  // The default health service starts out SERVING for ""; nothing can have connected yet (the
  // port is not announced), and it flips to the real state before Start returns.
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("", false);
  if (data_plane) health->SetServingStatus(kDecodeRouterServiceName, false);
  if (admin) health->SetServingStatus(kRouterAdminServiceName, false);
  health->SetServingStatus(kLivenessServiceName, true);
  return server;
}

absl::Status RouterServer::StartListeners() {
  const bool separate_admin = !options_.admin_listen.empty();
  auto data = BuildServer(options_.listen, /*data_plane=*/true, /*admin=*/!separate_admin, options_.max_message_bytes,
                          &grpc_port_);
  if (!data.ok()) return absl::Status(data.status().code(), absl::StrCat("listen: ", data.status().message()));
  data_server_ = *std::move(data);
  admin_port_ = grpc_port_;
  if (separate_admin) {
    auto admin = BuildServer(options_.admin_listen, /*data_plane=*/false, /*admin=*/true,
                             options_.admin_max_message_bytes, &admin_port_);
    if (!admin.ok())
      return absl::Status(admin.status().code(), absl::StrCat("admin_listen: ", admin.status().message()));
    admin_server_ = *std::move(admin);
  }
  if (!options_.metrics_http.listen.empty()) {
    std::shared_ptr<prometheus::Collectable> stats = OpsHttpEndpoint::StatsCollector();
    metrics_->AddCollectable(stats);
    ELDR_ASSIGN_OR_RETURN(ops_http_, OpsHttpEndpoint::Start(
                                         options_.metrics_http, metrics_.get(), [this] { return serving(); },
                                         [this] {
                                           absl::MutexLock lock(&health_mu_);
                                           return !shutting_down_;
                                         },
                                         std::move(stats)));
    metrics_port_ = ops_http_->port();
  }
  return absl::OkStatus();
}

void RouterServer::StopListeners() {
  if (ops_http_ != nullptr) ops_http_->Stop();
  if (admin_server_ != nullptr) admin_server_->Shutdown();
  if (data_server_ != nullptr) data_server_->Shutdown();
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
  if (absl::Status listening = StartListeners(); !listening.ok()) {
    StopListeners();
    StopComponents();
    return listening;
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
      .With("admin_on_loopback",
            IsLoopbackAddress(options_.admin_listen.empty() ? options_.listen : options_.admin_listen))
      .With("tls", tls_mirror_ != nullptr)
      .With("mtls", !options_.tls_client_ca.empty())
      .With("admin_token", admin_token_->enabled())
      .With("data_token", data_token_->enabled())
      .With("reporter_auth", ReporterAuthName(options_.reporter_auth))
      .With("policy", PolicyKindName(options_.router.policy))
      .With("tau", options_.router.tau)
      .With("workers", state.workers.size())
      .With("centroid_generation", state.centroid_generation)
      .With("centroid_rows", state.centroid_rows)
      .With("index", state.index_kind)
      .With("simd", ScoringKernelsName())
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
  nlohmann::json j = {{"grpc_port", grpc_port_},
                      {"admin_port", admin_port_},
                      {"metrics_port", metrics_port_},
                      {"pid", static_cast<int64_t>(getpid())}};
  absl::Status status = WriteFileAtomically(options_.port_file, j.dump() + "\n");
  if (!status.ok()) return absl::Status(status.code(), absl::StrCat("port_file: ", status.message()));
  return absl::OkStatus();
}

bool RouterServer::serving() const {
  absl::MutexLock lock(&health_mu_);
  return serving_;
}

bool RouterServer::clean_shutdown() const {
  absl::MutexLock lock(&shutdown_mu_);
  return clean_shutdown_;
}

void RouterServer::UpdateHealth() {
  const RouterState state = router_->GetState(absl::Now());
  int active = 0;
  for (const WorkerStatus& w : state.workers) {
    if (w.state == WorkerState::kActive) ++active;
  }
  const bool centroids_ok = options_.router.policy != PolicyKind::kEldr || state.centroid_generation > 0;
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

void RouterServer::ReloadFromSignal() {
  ELDR_LOG_LIMITED(Info, "reload_requested", "reload_requested").With("signal", "SIGHUP");
  // Queued on the loader's thread; a reload already waiting absorbs this one.
  if (!options_.centroids.empty()) loader_->ReloadConfigured(CentroidSource::kSignal);
  struct Reloadable {
    const char* event;
    absl::Status status;
  };
  for (const Reloadable& reload :
       {Reloadable{"admin_token_reload_failed", admin_token_->Reload()},
        Reloadable{"data_token_reload_failed", data_token_->Reload()},
        Reloadable{"reporter_tokens_reload_failed",
                   reporter_tokens_ != nullptr ? reporter_tokens_->Reload() : absl::OkStatus()}}) {
    if (!reload.status.ok()) ELDR_LOG(Warning, reload.event).With("code", reload.status);
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
  const absl::Time deadline = absl::Now() + options_.shutdown_grace;
  // Both listeners stop taking new calls at once (GOAWAY) and share the grace period.
  absl::Notification servers_stopped;
  std::thread stopper([this, deadline, &servers_stopped] {
    const auto chrono_deadline = absl::ToChronoTime(deadline);
    std::thread admin_stop;
    if (admin_server_ != nullptr) {
      admin_stop = std::thread([this, chrono_deadline] { admin_server_->Shutdown(chrono_deadline); });
    }
    if (data_server_ != nullptr) data_server_->Shutdown(chrono_deadline);
    if (admin_stop.joinable()) admin_stop.join();
    servers_stopped.Notify();
  });
  // A reload that is still queued is answered UNAVAILABLE; one that is running gets the grace
  // period. Past it, the daemon does not wait: clean_shutdown() turns false and main() exits
  // without destroying what the load still uses.
  clean_shutdown_ = loader_->Shutdown(deadline);
  // gRPC's Shutdown also waits for every client connection to close, and a client whose channel
  // is idle answers the GOAWAY only when its own backup poller runs (seconds later). Our RPCs
  // finish by themselves: unary handlers answer inline, streams were finished above, and reloads
  // are answered by the loader. Once the last answers had time to leave, the remaining calls
  // (health watches, idle connections) are cut instead of holding the shutdown for the whole grace.
  if (!servers_stopped.WaitForNotificationWithTimeout(kAnswerFlushTime)) {
    for (grpc::Server* s : {data_server_.get(), admin_server_.get()}) {
      if (s != nullptr) grpc_server_cancel_all_calls(s->c_server());
    }
  }
  stopper.join();
  StopComponents();
  if (ops_http_ != nullptr) ops_http_->Stop();
  const RouterState state = router_->GetState(absl::Now());
  ELDR_LOG(Info, "shutdown_complete")
      .With("took", absl::Now() - begin)
      .With("live_leases", state.live_leases)
      .With("clean", clean_shutdown_);
  shutdown_done_.Notify();
}

void RouterServer::Wait() { shutdown_done_.WaitForNotification(); }

}  // namespace eldr::server
