// eldr-router configuration: every setting of the daemon, defined once in one table (config.cc)
// that gives its key, type, default and help, and from which the command-line flags, the config
// file keys, --help and the effective-settings dump are all derived.
//
// ServerOptions is composed of the libraries' own Options structs (RouterOptions, LoadScraperOptions,
// RefitOptions, http::HttpServerOptions), so a setting goes straight to the library that uses it.
// Their documented defaults are the daemon's defaults unless the field comment below says
// otherwise.
//
// One key per setting, spelled the same as the command-line flag (`tau`, `lease_ttl`, ...).
// Precedence: built-in defaults < the --config file < flags given on the command line.
// Durations are written the absl way ("250ms", "10s", "10m", "inf") or as a number of seconds.
// A few settings keep an older spelling with a unit in its name (`refit_interval_s=10`,
// `scrape_interval_ms=100`); the number is then read in that unit.
#ifndef ELDR_SERVER_CONFIG_H_
#define ELDR_SERVER_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "eldr/core/router.h"
#include "eldr/http/http_server.h"
#include "eldr/loadsignals/load_scraper.h"
#include "eldr/refit/refit.h"
#include "server/logging.h"

namespace eldr::server {

// The largest --max_stream_batch accepted: a batch is handled on one gRPC thread in one go (about
// 5 us per route), and its answer is one message, so a batch stays well below 100 ms of work and a
// few hundred kilobytes of answer.
inline constexpr int64_t kMaxStreamBatchLimit = 4096;

// Who may push load reports for a worker (ReportLoad).
enum class ReporterAuth {
  kNone,   // any data-plane client, for any worker (the data-plane token still applies)
  kToken,  // a stream's bearer token must be the worker's own (reporter_tokens_file)
  kMtls,   // the client certificate must name the worker (CN or a DNS SAN equal to its id)
};
absl::StatusOr<ReporterAuth> ParseReporterAuth(absl::string_view name);
absl::string_view ReporterAuthName(ReporterAuth auth);

// Where the decode workers come from.
enum class DiscoveryMode {
  kStatic,      // the `workers` setting and the admin API (UpsertWorker, DrainWorker, RemoveWorker)
  kKubernetes,  // the pods matching `decode_selector` (discovery_component.h); `workers` must be empty
};
absl::StatusOr<DiscoveryMode> ParseDiscoveryMode(absl::string_view name);
absl::string_view DiscoveryModeName(DiscoveryMode mode);

// Kubernetes discovery of the decode workers (discovery=kubernetes; see discovery_component.h).
struct DiscoverySettings {
  DiscoveryMode mode = DiscoveryMode::kStatic;
  // The label selector of the decode pods, e.g. "app.kubernetes.io/component=decode" (required).
  std::string decode_selector;
  // The namespace watched; empty: the pod's own (the service account's), else the kubeconfig
  // context's.
  std::string kube_namespace;
  // A kubeconfig file to reach the API server from outside the cluster; empty: the in-cluster
  // configuration (service-account token and CA, KUBERNETES_SERVICE_HOST/PORT).
  std::string kubeconfig;
  std::string kube_context;  // of the kubeconfig; empty: its current-context
  // The decode engine's container port (name or number): worker address = pod IP:port. Pod
  // annotation eldr.io/port overrides it.
  std::string worker_port = "http";
  // The port (name or number) and path of the engine's Prometheus page, for load scraping; empty
  // port: the worker port (vLLM serves /metrics there). Annotations eldr.io/metrics-port and
  // eldr.io/metrics-path override them.
  std::string worker_metrics_port;
  std::string worker_metrics_path = "/metrics";
  // A pod that becomes routable (new, ready again, changed) joins the pool once it has stayed so
  // this long; stopping routes (not ready, terminating, gone) is immediate.
  absl::Duration settle = absl::Seconds(1);
};

// Router replicas that agree through Redis (see cluster_component.h, docs/cluster.md).
struct ClusterSettings {
  // host:port (or host, [v6]:port, unix:/path) of the Redis / Valkey server. Empty: no cluster.
  std::string redis;
  std::string redis_password_file;       // AUTH with this file's contents; empty: none
  int redis_db = 0;                      // SELECT
  std::string cluster_name = "default";  // the key prefix: pools sharing one Redis differ here
  // This replica's identity among the others. Empty: $POD_NAME, else the host name.
  std::string replica_id;
  // The refit leader's lease (renewed every third of it): a dead leader is replaced within about
  // one lease. false in leader_eligible: this replica follows only (never refits, never publishes).
  absl::Duration leader_lease = absl::Seconds(3);
  bool leader_eligible = true;
  // How often this replica publishes its leases and reads the others' (their keys expire after
  // 10 x this, at least 1 s), and how often it checks the published centroid generation (the
  // fallback to announcements).
  absl::Duration load_interval = absl::Milliseconds(100);
  absl::Duration centroid_check_interval = absl::Seconds(1);
  // One Redis command (or pipeline) at most; the connect attempt at most.
  absl::Duration redis_timeout = absl::Seconds(1);
};

// The daemon's default load-gap guard (RouterOptions::max_load_gap): measured in
// docs/evaluation.md, "The load-gap guard".
inline constexpr double kDefaultMaxLoadGap = 4;

struct ServerOptions {
  ServerOptions();

  // ---- Network ----
  // host:port of the data plane (DecodeRouter, health, reflection). Port 0 picks a free port.
  std::string listen = "0.0.0.0:50051";
  // host:port of the control plane (RouterAdmin, health, reflection). Empty: served on `listen`.
  // Loopback by default: the admin service is not reachable from the network unless an operator
  // moves it, and a non-loopback admin address needs admin_token_file or tls_client_ca (or
  // allow_insecure_admin, which logs a warning at start).
  std::string admin_listen = "127.0.0.1:50052";
  bool allow_insecure_admin = false;
  // The operations HTTP endpoint: /metrics (Prometheus), /healthz (liveness), /readyz (readiness).
  // metrics_http.listen defaults to 0.0.0.0:9464 (the Prometheus default port); empty disables it.
  http::HttpServerOptions metrics_http;
  // When set, the bound ports are written here as JSON ({"grpc_port":..,"admin_port":..,
  // "metrics_port":..,"pid":..}) once the daemon listens: how tools find ports chosen with port 0.
  // A listener on a Unix socket has port 0 there.
  std::string port_file;

  // ---- Routing ----
  // Centroid artifact (JSON). Empty: start without centroids (eldr falls back to jsq with reason
  // no_centroids, and readiness stays false under policy eldr until centroids load).
  std::string centroids;
  // ReloadCentroids(path) reads only regular files inside this folder. Empty: the folder of
  // `centroids` (no path reloads at all when that is empty too).
  std::string centroids_dir;
  // Largest artifact file or inline artifact accepted.
  int64_t max_artifact_bytes = int64_t{256} << 20;
  // The decode workers, in order (centroid rows follow this order when the artifact does not
  // name its workers). Filled from `workers` = "id=host:port,..." or a JSON file path.
  std::vector<WorkerSpec> workers;
  // Static `workers`, or discovered from Kubernetes.
  DiscoverySettings discovery;
  // policy, tau, seed, lease_ttl, snapshot_staleness, max_live_leases.
  RouterOptions router;
  absl::Duration lease_expiry_interval = absl::Seconds(1);  // how often leases are expired

  // ---- Load scraping (decode workers' Prometheus pages, see load_scrape_component.h) ----
  // Metrics URL per worker, "id=url,..."; overrides the workers' `metrics_url` from the workers
  // JSON file. No URL at all: no scraping (load comes from ReportLoad and leases only).
  std::string worker_metrics;
  LoadScraperOptions scrape;  // scrape_interval, scrape_timeout, unhealthy_after_failures, ...

  // ---- Online refit (see refit_component.h) ----
  // Refit runs when refit.interval > 0 or refit.state_dir is set; otherwise no refitter exists and
  // routes pay nothing for it.
  RefitOptions refit;

  // ---- Cluster (replicas sharing centroids, refit leader and load; see cluster_component.h) ----
  ClusterSettings cluster;

  // ---- Security ----
  // PEM files of the server certificate chain and key: TLS on every gRPC listener. Both or none.
  // The pair is validated at start and at every rotation (a broken rotation keeps the pair in
  // service); gRPC reads private copies in tls_mirror_dir (empty: a fresh folder under $TMPDIR).
  std::string tls_cert;
  std::string tls_key;
  // PEM bundle of client CAs: mutual TLS on every listener.
  std::string tls_client_ca;
  absl::Duration tls_reload_interval = absl::Seconds(60);
  std::string tls_mirror_dir;
  // Bearer token of RouterAdmin (`authorization: Bearer <token>`); re-read on SIGHUP.
  std::string admin_token_file;
  // Bearer token every DecodeRouter RPC must present (Route, Complete, ReportLoad); empty: none.
  std::string data_token_file;
  ReporterAuth reporter_auth = ReporterAuth::kNone;
  // reporter_auth=token: JSON object {"<worker id>": "<token>", ...}; re-read on SIGHUP.
  std::string reporter_tokens_file;

  // ---- Limits ----
  // Largest message accepted or sent on the data plane (a larger Route is INVALID_ARGUMENT,
  // counted as oversized; the transport refuses beyond 4x with RESOURCE_EXHAUSTED).
  int64_t max_message_bytes = 1 << 20;
  // Same limit on the admin listener, where ReloadCentroids may carry an artifact inline.
  int64_t admin_max_message_bytes = 64 << 20;
  int64_t max_concurrent_streams = 1024;  // concurrent RPCs per connection
  // Entries of one RouteStreamBatch at most; a larger batch is refused whole (INVALID_ARGUMENT).
  int64_t max_stream_batch = 256;
  // Open ReportLoad streams at most, in total and per peer address; beyond, RESOURCE_EXHAUSTED.
  int64_t max_report_streams = 1024;
  int64_t max_report_streams_per_peer = 64;
  // A ReportLoad stream that sends nothing for this long is ended (DEADLINE_EXCEEDED).
  absl::Duration report_stream_idle_timeout = absl::Minutes(2);
  absl::Duration keepalive_time = absl::Hours(2);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  absl::Duration keepalive_min_ping_interval = absl::Seconds(10);
  bool keepalive_permit_without_calls = true;
  absl::Duration max_connection_idle = absl::InfiniteDuration();
  absl::Duration max_connection_age = absl::InfiniteDuration();
  absl::Duration max_connection_age_grace = absl::InfiniteDuration();

  // ---- Lifecycle and logs ----
  // On SIGTERM readiness turns false at once and the daemon keeps serving this long, then the
  // listeners close and in-flight RPCs get shutdown_grace; the process exits after at most both
  // (plus a second for components), whatever a reload is doing.
  absl::Duration shutdown_drain_delay = absl::ZeroDuration();
  absl::Duration shutdown_grace = absl::Seconds(10);
  LogLevel log_level = LogLevel::kInfo;
  LogFormat log_format = LogFormat::kKeyValue;
  // Warning lines of one kind (refused admin calls, failed routes by reason, ...) per second at
  // most; the rest are counted and reported in the next line of that kind.
  double log_rate_limit = 10;
};

// The settings keys (flag names), in documentation order. `config` itself is not one.
const std::vector<std::string>& ServerOptionKeys();

// Sets one setting from its text form (the flag syntax). INVALID_ARGUMENT names the key and the
// problem; unknown keys are INVALID_ARGUMENT too.
absl::Status SetServerOption(absl::string_view key, absl::string_view value, ServerOptions* options);

// Applies a JSON config object (keys as above; `workers` may also be an array of worker objects;
// durations may be numbers of seconds). Unknown keys are an error naming them. Settings absent
// from the file keep their current value.
absl::Status ApplyConfigJson(absl::string_view json_text, ServerOptions* options);
// Reads `path` and applies it; errors name the path.
absl::Status ApplyConfigFile(const std::string& path, ServerOptions* options);

// What ParseCommandLine found besides settings.
struct CommandLine {
  bool help = false;     // --help / -h: print UsageText() and exit 0
  bool version = false;  // --version
};
// The daemon's argv: --config=FILE (applied first, wherever it stands), then every setting in
// order: --key=value, --key value, -key=value; booleans also as --key and --nokey. Unknown
// flags and stray arguments are INVALID_ARGUMENT naming them.
absl::StatusOr<CommandLine> ParseCommandLine(int argc, const char* const* argv, ServerOptions* options);
// --help: every setting with its type, default and meaning.
std::string UsageText();

// Cross-setting checks (ranges, TLS pairs, admin exposure, ...). The message names the setting.
absl::Status ValidateServerOptions(const ServerOptions& options);

// Workers from "id=host:port,id=host:port" or, when `spec` holds no '=', a JSON file: an array of
// {"id", "address", "capacity"?, "max_inflight"?, "metrics_url"?} or an object with such an array
// under "workers". Each worker obeys ValidateWorkerSpec (eldr/core/router.h); ids are distinct.
absl::StatusOr<std::vector<WorkerSpec>> ParseWorkerList(absl::string_view spec);
// The JSON text form of the above (no file access).
absl::StatusOr<std::vector<WorkerSpec>> ParseWorkerJson(absl::string_view json_text);

// Whether a listen address is a Unix domain socket ("unix:/path", "unix-abstract:name").
bool IsUnixSocketAddress(absl::string_view address);

// Whether a listen address is on the loopback interface only (127.0.0.0/8, [::1], localhost,
// unix sockets).
bool IsLoopbackAddress(absl::string_view address);

// The effective settings as a JSON object (for the startup log line and tests).
std::string ServerOptionsToJson(const ServerOptions& options);

}  // namespace eldr::server

#endif  // ELDR_SERVER_CONFIG_H_
