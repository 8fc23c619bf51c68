// eldr-router configuration: every setting of the daemon, with its default, and the parsers that
// fill it from a config file (JSON), from flags and from worker lists.
//
// One key per setting, spelled the same as the command-line flag (`tau`, `lease_ttl`, ...).
// Precedence: built-in defaults < the --config file < flags given on the command line.
// Durations are written the absl way ("250ms", "10s", "10m", "inf") or, in JSON, as a number of
// seconds. Paths are used as given (relative ones against the daemon's working directory).
#ifndef ELDR_SERVER_CONFIG_H_
#define ELDR_SERVER_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "eldr/core/policy.h"
#include "eldr/core/router.h"
#include "server/logging.h"

namespace eldr::server {

struct ServerOptions {
  // ---- Network ----
  // host:port of the data plane (DecodeRouter, health, reflection; RouterAdmin too unless
  // admin_listen is set). Port 0 picks a free port (see port_file).
  std::string listen = "0.0.0.0:50051";
  // host:port of the Prometheus endpoint (/metrics). Empty: no metrics endpoint.
  std::string metrics_listen = "0.0.0.0:9464";
  // host:port of a separate control-plane listener serving only RouterAdmin (plus health and
  // reflection). Empty: RouterAdmin is served on `listen`.
  std::string admin_listen;
  // When set, the bound ports are written here as JSON ({"grpc_port":..,"admin_port":..,
  // "metrics_port":..}) once the daemon listens: how tools find ports chosen with port 0.
  std::string port_file;

  // ---- Routing ----
  // Centroid artifact (JSON). Empty: start without centroids (eldr falls back to jsq with
  // reason no_centroids, and health stays NOT_SERVING under policy eldr until centroids load).
  std::string centroids;
  // The decode workers, in order (centroid rows follow this order when the artifact does not
  // name its workers). Filled from `workers` = "id=host:port,..." or a JSON file path.
  std::vector<WorkerSpec> workers;
  PolicyKind policy = PolicyKind::kEldr;
  double tau = 0.1;                                      // locality band width, [0, 1]
  absl::Duration lease_ttl = absl::Minutes(10);          // leases older than this expire
  absl::Duration snapshot_staleness = absl::Seconds(5);  // older load reports are ignored
  absl::Duration lease_expiry_interval = absl::Seconds(1);  // how often leases are expired
  uint64_t seed = 0x5eed;                                // tie-breaking / sampling seed

  // ---- Load scraping (decode workers' Prometheus endpoints, see load_scrape_component.h) ----
  // Metrics URL per worker, "id=url,..."; overrides the workers' `metrics_url` from the workers
  // JSON file. No URL at all: no scraping (load comes from ReportLoad and leases only).
  std::string worker_metrics;
  int64_t scrape_interval_ms = 100;     // between two scrapes of one worker
  int64_t scrape_timeout_ms = 1000;     // whole-request limit; a timeout is a failed scrape
  // Consecutive failed scrapes that mark a worker unhealthy (no new routes until one succeeds);
  // 0: never. Its load goes stale after snapshot_staleness either way.
  int64_t unhealthy_after_failures = 3;
  // Only series with this `model_name` label are summed; empty: every series on the page.
  std::string scrape_model_name;

  // ---- Online refit (see refit_component.h) ----
  // Refit is on when refit_interval_s > 0 or state_dir is set; otherwise no refitter exists and
  // routes pay nothing for it.
  int64_t refit_window_s = 60;    // signatures older than this leave the refit window; >= 1
  int64_t refit_interval_s = 10;  // seconds between periodic refits; 0: only pool changes refit
  // Folder for the learned centroids (centroids.json), reloaded at start when it matches the
  // configured artifact's transform. Empty: nothing persisted.
  std::string state_dir;

  // ---- Security ----
  // PEM files of the server certificate chain and key: TLS on every gRPC listener. Both or none.
  std::string tls_cert;
  std::string tls_key;
  // PEM bundle of client CAs: mutual TLS, clients without a certificate signed by one of them are
  // refused during the handshake. Requires tls_cert/tls_key.
  std::string tls_client_ca;
  // How often the TLS files are re-read; changed certificates apply to new connections.
  absl::Duration tls_reload_interval = absl::Seconds(60);
  // File holding the admin bearer token (surrounding whitespace ignored). When set, every
  // RouterAdmin RPC needs the metadata `authorization: Bearer <token>`: none is UNAUTHENTICATED,
  // a wrong one PERMISSION_DENIED. Re-read on SIGHUP.
  std::string admin_token_file;

  // ---- Limits ----
  // Largest message accepted or sent on the data plane. The biggest signature realistic today
  // (128 layers x 512 experts as packed int32) is about 256 KiB: 1 MiB leaves 4x headroom while
  // bounding what one request can make the router allocate. A larger Route request is
  // INVALID_ARGUMENT (eldr_rejected_total{reason="oversized"}); the transport itself refuses, with
  // RESOURCE_EXHAUSTED and before any handler, messages over kTransportMessageHeadroom (4) times it.
  int64_t max_message_bytes = 1 << 20;
  // Same limit on the separate admin listener, where ReloadCentroids may carry an artifact inline.
  int64_t admin_max_message_bytes = 64 << 20;
  // Concurrent RPCs (HTTP/2 streams) per connection.
  int64_t max_concurrent_streams = 1024;
  // Server-initiated keepalive pings on idle connections, and how long to wait for the ack.
  absl::Duration keepalive_time = absl::Hours(2);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // Minimum interval between client pings the server tolerates (more frequent pings get the
  // connection closed with GOAWAY after a few strikes).
  absl::Duration keepalive_min_ping_interval = absl::Seconds(10);
  // Whether clients may ping while they have no call in flight.
  bool keepalive_permit_without_calls = true;
  // Close connections idle this long / older than this (after a grace for their calls). inf: never.
  absl::Duration max_connection_idle = absl::InfiniteDuration();
  absl::Duration max_connection_age = absl::InfiniteDuration();
  absl::Duration max_connection_age_grace = absl::InfiniteDuration();

  // ---- Lifecycle and logs ----
  // On SIGTERM health turns NOT_SERVING at once, and the daemon keeps serving for this long so
  // load balancers and clients watching health stop sending before the listeners close (RPCs that
  // race with the close are refused or cancelled by gRPC). 0: close at once.
  absl::Duration shutdown_drain_delay = absl::ZeroDuration();
  // Then: time in-flight RPCs get to finish before they are cancelled and the daemon exits.
  absl::Duration shutdown_grace = absl::Seconds(10);
  LogLevel log_level = LogLevel::kInfo;
  LogFormat log_format = LogFormat::kKeyValue;
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

// Cross-setting checks (ranges, TLS pairs, ...). The message names the setting.
absl::Status ValidateServerOptions(const ServerOptions& options);

// Workers from "id=host:port,id=host:port" or, when `spec` holds no '=', a JSON file: an array of
// {"id", "address", "capacity"?, "max_inflight"?, "metrics_url"?} or an object with such an array
// under "workers".
// Ids must be distinct and non-empty, addresses non-empty, capacity > 0, max_inflight >= 0.
absl::StatusOr<std::vector<WorkerSpec>> ParseWorkerList(absl::string_view spec);
// The JSON text form of the above (no file access).
absl::StatusOr<std::vector<WorkerSpec>> ParseWorkerJson(absl::string_view json_text);
// Checks one worker (same rules); the message names the worker and the field.
absl::Status ValidateWorkerSpec(const WorkerSpec& worker);

// The effective settings as a JSON object (for the startup log line and tests).
std::string ServerOptionsToJson(const ServerOptions& options);

}  // namespace eldr::server

#endif  // ELDR_SERVER_CONFIG_H_
