#include "server/config.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "nlohmann/json.hpp"

namespace eldr::server {
namespace {

using Json = nlohmann::json;

absl::Status BadValue(absl::string_view key, absl::string_view value, absl::string_view expected) {
  const std::string shown = value.size() <= 64 ? std::string(value) : absl::StrCat(value.substr(0, 64), "...");
  return absl::InvalidArgumentError(
      absl::StrCat("setting '", key, "': invalid value '", shown, "' (expected ", expected, ")"));
}

absl::StatusOr<absl::Duration> ParseDurationValue(absl::string_view key, absl::string_view text) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  double seconds = 0;
  if (absl::SimpleAtod(trimmed, &seconds) && std::isfinite(seconds)) return absl::Seconds(seconds);
  absl::Duration d;
  if (absl::ParseDuration(trimmed, &d)) return d;
  return BadValue(key, text, "a duration such as 250ms, 10s, 10m or inf");
}

absl::StatusOr<int64_t> ParseIntValue(absl::string_view key, absl::string_view text) {
  int64_t v = 0;
  if (absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v)) return v;
  return BadValue(key, text, "an integer");
}

absl::StatusOr<uint64_t> ParseUintValue(absl::string_view key, absl::string_view text) {
  absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  uint64_t v = 0;
  if (absl::ConsumePrefix(&trimmed, "0x") || absl::ConsumePrefix(&trimmed, "0X")) {
    if (absl::SimpleHexAtoi(trimmed, &v)) return v;
  } else if (absl::SimpleAtoi(trimmed, &v)) {
    return v;
  }
  return BadValue(key, text, "a non-negative integer (decimal or 0x hex)");
}

absl::StatusOr<double> ParseDoubleValue(absl::string_view key, absl::string_view text) {
  double v = 0;
  if (absl::SimpleAtod(absl::StripAsciiWhitespace(text), &v) && std::isfinite(v)) return v;
  return BadValue(key, text, "a finite number");
}

absl::StatusOr<bool> ParseBoolValue(absl::string_view key, absl::string_view text) {
  bool v = false;
  if (absl::SimpleAtob(absl::StripAsciiWhitespace(text), &v)) return v;
  return BadValue(key, text, "true or false");
}

// One setting: its key, how it is written, what it means, and how to set and show it.
struct OptionDef {
  std::string key;
  std::string type;  // for --help: string, duration, int, number, bool, list, or the choices
  std::string help;
  std::function<absl::Status(absl::string_view, ServerOptions*)> set;
  std::function<Json(const ServerOptions&)> get;
  bool is_bool = false;
};

// Every setting of a given C++ type is declared the same way: the key, the help, and where the
// value lives in ServerOptions.
template <typename T>
using FieldOf = std::function<T&(ServerOptions&)>;

template <typename T>
std::function<Json(const ServerOptions&)> Getter(FieldOf<T> field) {
  return [field](const ServerOptions& o) { return Json(field(const_cast<ServerOptions&>(o))); };
}

OptionDef StringOption(std::string key, std::string help, FieldOf<std::string> field) {
  return OptionDef{std::move(key), "string", std::move(help),
                   [field](absl::string_view v, ServerOptions* o) {
                     field(*o) = std::string(v);
                     return absl::OkStatus();
                   },
                   Getter(field)};
}

OptionDef DurationOption(std::string key, std::string help, FieldOf<absl::Duration> field) {
  const std::string name = key;
  return OptionDef{
      std::move(key), "duration", std::move(help),
      [name, field](absl::string_view v, ServerOptions* o) -> absl::Status {
        ELDR_ASSIGN_OR_RETURN(field(*o), ParseDurationValue(name, v));
        return absl::OkStatus();
      },
      [field](const ServerOptions& o) { return Json(absl::FormatDuration(field(const_cast<ServerOptions&>(o)))); }};
}

template <typename Int>
OptionDef IntOption(std::string key, std::string help, FieldOf<Int> field) {
  const std::string name = key;
  return OptionDef{std::move(key), "int", std::move(help),
                   [name, field](absl::string_view v, ServerOptions* o) -> absl::Status {
                     ELDR_ASSIGN_OR_RETURN(const int64_t value, ParseIntValue(name, v));
                     if (value < std::numeric_limits<Int>::min() || value > std::numeric_limits<Int>::max()) {
                       return BadValue(name, v, "an integer in range");
                     }
                     field(*o) = static_cast<Int>(value);
                     return absl::OkStatus();
                   },
                   [field](const ServerOptions& o) { return Json(int64_t{field(const_cast<ServerOptions&>(o))}); }};
}

OptionDef DoubleOption(std::string key, std::string help, FieldOf<double> field) {
  const std::string name = key;
  return OptionDef{std::move(key), "number", std::move(help),
                   [name, field](absl::string_view v, ServerOptions* o) -> absl::Status {
                     ELDR_ASSIGN_OR_RETURN(field(*o), ParseDoubleValue(name, v));
                     return absl::OkStatus();
                   },
                   Getter(field)};
}

OptionDef BoolOption(std::string key, std::string help, FieldOf<bool> field) {
  const std::string name = key;
  OptionDef def{std::move(key), "bool", std::move(help),
                [name, field](absl::string_view v, ServerOptions* o) -> absl::Status {
                  ELDR_ASSIGN_OR_RETURN(field(*o), ParseBoolValue(name, v));
                  return absl::OkStatus();
                },
                Getter(field)};
  def.is_bool = true;
  return def;
}

// A setting with a closed set of names (policy, log level, ...).
template <typename Enum>
OptionDef ChoiceOption(std::string key, std::string help, std::string choices, FieldOf<Enum> field,
                       std::function<absl::StatusOr<Enum>(absl::string_view)> parse,
                       std::function<absl::string_view(Enum)> name_of) {
  const std::string name = key;
  const std::string expected = choices;
  return OptionDef{
      std::move(key), std::move(choices), std::move(help),
      [=](absl::string_view v, ServerOptions* o) -> absl::Status {
        absl::StatusOr<Enum> value = parse(absl::StripAsciiWhitespace(v));
        if (!value.ok()) return BadValue(name, v, expected);
        field(*o) = *value;
        return absl::OkStatus();
      },
      [=](const ServerOptions& o) { return Json(std::string(name_of(field(const_cast<ServerOptions&>(o))))); }};
}

Json WorkerToJson(const WorkerSpec& w) {
  Json j = {{"id", w.id}, {"address", w.address}, {"capacity", w.capacity}};
  if (w.max_inflight != 0) j["max_inflight"] = w.max_inflight;
  if (!w.metrics_url.empty()) j["metrics_url"] = w.metrics_url;
  return j;
}

OptionDef WorkersOption() {
  return OptionDef{
      "workers", "list",
      "Decode workers: 'id=host:port,...' or a JSON file of {id, address, capacity, max_inflight, metrics_url}.",
      [](absl::string_view v, ServerOptions* o) -> absl::Status {
        if (absl::StripAsciiWhitespace(v).empty()) {
          o->workers.clear();
          return absl::OkStatus();
        }
        absl::StatusOr<std::vector<WorkerSpec>> workers = ParseWorkerList(v);
        if (!workers.ok()) {
          return absl::Status(workers.status().code(), absl::StrCat("setting 'workers': ", workers.status().message()));
        }
        o->workers = *std::move(workers);
        return absl::OkStatus();
      },
      [](const ServerOptions& o) {
        Json list = Json::array();
        for (const WorkerSpec& w : o.workers) list.push_back(WorkerToJson(w));
        return list;
      }};
}

// The seed feeds the routing policy's generator and the refit's k-means alike.
OptionDef SeedOption() {
  return OptionDef{"seed", "int", "Seed of the tie-breaking, sampling and refit generators (decimal or 0x hex).",
                   [](absl::string_view v, ServerOptions* o) -> absl::Status {
                     ELDR_ASSIGN_OR_RETURN(o->router.seed, ParseUintValue("seed", v));
                     o->refit.seed = o->router.seed;
                     return absl::OkStatus();
                   },
                   [](const ServerOptions& o) { return Json(o.router.seed); }};
}

// clang-format off
const std::vector<OptionDef>& OptionTable() {
  static const auto* table = new std::vector<OptionDef>{
      // ---- Network ----
      StringOption("listen", "host:port of the gRPC data plane (port 0: any free port), or unix:/path for a Unix socket.",
                   [](ServerOptions& o) -> std::string& { return o.listen; }),
      StringOption("admin_listen", "host:port of the RouterAdmin listener (loopback by default); empty: on --listen.",
                   [](ServerOptions& o) -> std::string& { return o.admin_listen; }),
      BoolOption("allow_insecure_admin",
                 "Start even though RouterAdmin is reachable beyond loopback without a token or mutual TLS.",
                 [](ServerOptions& o) -> bool& { return o.allow_insecure_admin; }),
      StringOption("metrics_listen", "host:port of the HTTP endpoint (/metrics, /healthz, /readyz); empty disables it.",
                   [](ServerOptions& o) -> std::string& { return o.metrics_http.listen; }),
      IntOption<int>("metrics_max_connections", "Open connections of the HTTP endpoint at most (more get 503).",
                     [](ServerOptions& o) -> int& { return o.metrics_http.max_connections; }),
      StringOption("port_file", "Write the bound ports here as JSON once listening (for port 0).",
                   [](ServerOptions& o) -> std::string& { return o.port_file; }),
      // ---- Routing ----
      StringOption("centroids", "Centroid artifact (JSON). Empty: start without centroids (eldr falls back to jsq).",
                   [](ServerOptions& o) -> std::string& { return o.centroids; }),
      StringOption("centroids_dir",
                   "ReloadCentroids(path) reads only regular files in this folder (default: the folder of --centroids).",
                   [](ServerOptions& o) -> std::string& { return o.centroids_dir; }),
      IntOption<int64_t>("max_artifact_bytes", "Largest centroid artifact accepted (file or inline).",
                         [](ServerOptions& o) -> int64_t& { return o.max_artifact_bytes; }),
      WorkersOption(),
      ChoiceOption<DiscoveryMode>("discovery",
                                  "Where decode workers come from: static (--workers and the admin API) or kubernetes "
                                  "(the pods matching --decode_selector).",
                                  "static or kubernetes",
                                  [](ServerOptions& o) -> DiscoveryMode& { return o.discovery.mode; },
                                  ParseDiscoveryMode, DiscoveryModeName),
      StringOption("decode_selector", "discovery=kubernetes: label selector of the decode pods.",
                   [](ServerOptions& o) -> std::string& { return o.discovery.decode_selector; }),
      StringOption("kube_namespace", "discovery=kubernetes: namespace watched (default: the pod's own).",
                   [](ServerOptions& o) -> std::string& { return o.discovery.kube_namespace; }),
      StringOption("kubeconfig", "discovery=kubernetes: kubeconfig file (default: the in-cluster service account).",
                   [](ServerOptions& o) -> std::string& { return o.discovery.kubeconfig; }),
      StringOption("kube_context", "discovery=kubernetes: context of --kubeconfig (default: its current-context).",
                   [](ServerOptions& o) -> std::string& { return o.discovery.kube_context; }),
      StringOption("worker_port",
                   "discovery=kubernetes: the decode engine's container port, name or number (annotation eldr.io/port).",
                   [](ServerOptions& o) -> std::string& { return o.discovery.worker_port; }),
      StringOption("worker_metrics_port",
                   "discovery=kubernetes: port of the engine's /metrics, name or number (default: the worker port).",
                   [](ServerOptions& o) -> std::string& { return o.discovery.worker_metrics_port; }),
      StringOption("worker_metrics_path", "discovery=kubernetes: path of the engine's Prometheus page.",
                   [](ServerOptions& o) -> std::string& { return o.discovery.worker_metrics_path; }),
      DurationOption("discovery_settle",
                     "discovery=kubernetes: a pod joins the pool once routable this long (leaving is immediate).",
                     [](ServerOptions& o) -> absl::Duration& { return o.discovery.settle; }),
      ChoiceOption<PolicyKind>("policy", "Routing policy.", "eldr, rr, random, jsq or p2c",
                               [](ServerOptions& o) -> PolicyKind& { return o.router.policy; }, ParsePolicyKind,
                               PolicyKindName),
      DoubleOption("tau", "Locality band width in [0, 1] (eldr).",
                   [](ServerOptions& o) -> double& { return o.router.tau; }),
      DoubleOption("eldr_max_load_gap",
                   "eldr: a request whose band pick carries more than this many in-flight requests (per unit "
                   "capacity) above the pool's mean goes to the least loaded worker (fallback load_gap). 0: off.",
                   [](ServerOptions& o) -> double& { return o.router.max_load_gap; }),
      ChoiceOption<TieBreak>("tie_break",
                             "Among equally loaded workers (band, jsq, spill, p2c): random, or lowest_index (the "
                             "reference implementation's rule, to reproduce its decisions).",
                             "random or lowest_index",
                             [](ServerOptions& o) -> TieBreak& { return o.router.tie_break; }, ParseTieBreak,
                             TieBreakName),
      SeedOption(),
      DurationOption("lease_ttl", "A lease without Complete expires after this.",
                     [](ServerOptions& o) -> absl::Duration& { return o.router.load.lease_ttl; }),
      DurationOption("snapshot_staleness", "Load reports older than this are ignored (the router's lease count is used).",
                     [](ServerOptions& o) -> absl::Duration& { return o.router.load.snapshot_staleness; }),
      IntOption<int64_t>("max_live_leases",
                         "Live leases at most; at the limit a route releases the oldest lease (counted as evicted).",
                         [](ServerOptions& o) -> int64_t& { return o.router.max_live_leases; }),
      DurationOption("lease_expiry_interval", "How often expired leases are released.",
                     [](ServerOptions& o) -> absl::Duration& { return o.lease_expiry_interval; }),
      // ---- Load scraping ----
      StringOption("worker_metrics",
                   "Decode workers' Prometheus pages to scrape for load: 'id=url,...' (vLLM or SGLang); overrides "
                   "metrics_url in the workers file.",
                   [](ServerOptions& o) -> std::string& { return o.worker_metrics; }),
      DurationOption("scrape_interval", "Time between two scrapes of one worker.",
                     [](ServerOptions& o) -> absl::Duration& { return o.scrape.interval; }),
      DurationOption("scrape_timeout", "A scrape taking longer fails.",
                     [](ServerOptions& o) -> absl::Duration& { return o.scrape.timeout; }),
      IntOption<int>("unhealthy_after_failures",
                     "Consecutive failed scrapes that mark a worker unhealthy until one succeeds (0: never).",
                     [](ServerOptions& o) -> int& { return o.scrape.unhealthy_after_failures; }),
      StringOption("scrape_model_name", "Sum only the series with this model_name label (empty: all series).",
                   [](ServerOptions& o) -> std::string& { return o.scrape.engine.model_name; }),
      // ---- Online refit ----
      DurationOption("refit_window", "Online refit: signatures older than this leave the refit window.",
                     [](ServerOptions& o) -> absl::Duration& { return o.refit.window; }),
      DurationOption("refit_interval",
                     "Online refit: time between periodic refits; 0 turns periodic refit off (pool changes still "
                     "refit when --state_dir is set). Refit runs when this is > 0 or --state_dir is set.",
                     [](ServerOptions& o) -> absl::Duration& { return o.refit.interval; }),
      StringOption("state_dir",
                   "Folder where refitted centroids are persisted and reloaded from at start (same transform as "
                   "--centroids); empty: no persistence.",
                   [](ServerOptions& o) -> std::string& { return o.refit.state_dir; }),
      IntOption<int>("refit_max_window_signatures", "Signatures the refit window keeps at most (an even sample).",
                     [](ServerOptions& o) -> int& { return o.refit.max_window_signatures; }),
      IntOption<int64_t>("refit_window_bytes",
                         "Bytes the refit window's storage may hold (half-precision signatures); fewer signatures "
                         "than --refit_max_window_signatures are kept when they do not fit. At least 1 MiB.",
                         [](ServerOptions& o) -> int64_t& { return o.refit.max_window_bytes; }),
      DoubleOption("refit_max_client_share",
                   "Largest fraction of the refit window one client may hold (on top of the fair share 1/n).",
                   [](ServerOptions& o) -> double& { return o.refit.max_client_share; }),
      DoubleOption("refit_max_step", "Cosine distance one refit may move a worker's centroid at most (2: no bound).",
                   [](ServerOptions& o) -> double& { return o.refit.max_step_distance; }),
      DoubleOption("refit_max_drift",
                   "Cosine distance a centroid may drift from the calibrated one at most, in total (2: no bound).",
                   [](ServerOptions& o) -> double& { return o.refit.max_drift_distance; }),
      DoubleOption("refit_max_imbalance_increase",
                   "Install guard: a refit is installed only when its predicted work imbalance on the window (max "
                   "over mean of the zones' decode work per capacity) exceeds the set in service's by at most this.",
                   [](ServerOptions& o) -> double& { return o.refit.max_imbalance_increase; }),
      DoubleOption("refit_max_locality_decrease",
                   "Install guard, the locality bound: a refit passes it when its predicted locality on the window "
                   "(mean best similarity, weighted by decode work) is at most this below the set in service's, or "
                   "when it saves --refit_min_experts_gain of the experts per step (pool-change and capacity-change "
                   "refits are exempt); 1: no bound.",
                   [](ServerOptions& o) -> double& { return o.refit.max_locality_decrease; }),
      DoubleOption("refit_min_experts_gain",
                   "Install guard, the locality bound: a refit passes it when it predicts at least this fraction "
                   "fewer distinct experts per decode step on the window than the set in service, or no lower "
                   "locality than --refit_max_locality_decrease allows; negative: that much more is accepted; -1: "
                   "no bound.",
                   [](ServerOptions& o) -> double& { return o.refit.min_experts_gain; }),
      DoubleOption("refit_expert_picks",
                   "Install guard's step model: expert picks per layer in one decode step of one worker (sequences "
                   "per step times the model's experts per token).",
                   [](ServerOptions& o) -> double& { return o.refit.expert_picks; }),
      DoubleOption("refit_max_churn",
                   "Install guard: largest fraction of the window's signatures a refit may move to another worker "
                   "(pool-change refits are exempt); 1: no bound.",
                   [](ServerOptions& o) -> double& { return o.refit.max_churn; }),
      DoubleOption("refit_default_output_tokens",
                   "Refit weight of a signature whose lease expired or was evicted (no Complete): this many decode "
                   "tokens; 0 drops such signatures.",
                   [](ServerOptions& o) -> double& { return o.refit.default_output_tokens; }),
      DoubleOption("refit_default_tokens_per_second",
                   "Refit weight of a Complete without output_tokens: hold seconds times the decode rate measured on "
                   "completes that reported tokens, or this rate until one did.",
                   [](ServerOptions& o) -> double& { return o.refit.default_tokens_per_second; }),
      IntOption<int>("refit_max_pending_signatures",
                     "Admitted signatures waiting for their request to complete, at most (oldest dropped beyond).",
                     [](ServerOptions& o) -> int& { return o.refit.max_pending_signatures; }),
      IntOption<int64_t>("refit_pending_bytes",
                         "Bytes the pending signatures may hold (half precision; oldest dropped beyond).",
                         [](ServerOptions& o) -> int64_t& { return o.refit.max_pending_bytes; }),
      // ---- Cluster ----
      StringOption("cluster_redis",
                   "host:port of a Redis (or Valkey) the router replicas of one pool share: one refit leader, "
                   "one centroid generation, pool-wide lease counts; empty: this replica is alone.",
                   [](ServerOptions& o) -> std::string& { return o.cluster.redis; }),
      StringOption("cluster_redis_password_file", "File with the Redis password (AUTH); empty: none.",
                   [](ServerOptions& o) -> std::string& { return o.cluster.redis_password_file; }),
      IntOption<int>("cluster_redis_db", "Redis database (SELECT).",
                     [](ServerOptions& o) -> int& { return o.cluster.redis_db; }),
      StringOption("cluster_name", "Key prefix in Redis: the replicas of one pool share it, other pools differ.",
                   [](ServerOptions& o) -> std::string& { return o.cluster.cluster_name; }),
      StringOption("replica_id", "This replica's identity in the cluster (default: $POD_NAME, else the host name).",
                   [](ServerOptions& o) -> std::string& { return o.cluster.replica_id; }),
      DurationOption("cluster_leader_lease",
                     "The refit leader's lease in Redis (renewed every third of it); a dead leader is replaced "
                     "within about one lease.",
                     [](ServerOptions& o) -> absl::Duration& { return o.cluster.leader_lease; }),
      BoolOption("cluster_leader_eligible", "false: this replica only follows (never refits, never publishes).",
                 [](ServerOptions& o) -> bool& { return o.cluster.leader_eligible; }),
      DurationOption("cluster_load_interval",
                     "How often this replica publishes its lease counts and reads the other replicas' "
                     "(theirs stop counting 10 x this, at least 1 s, after their last publication).",
                     [](ServerOptions& o) -> absl::Duration& { return o.cluster.load_interval; }),
      DurationOption("cluster_centroid_check_interval",
                     "How often the published centroid generation is checked (the fallback to announcements).",
                     [](ServerOptions& o) -> absl::Duration& { return o.cluster.centroid_check_interval; }),
      DurationOption("cluster_redis_timeout", "The longest one Redis command or connection attempt may take.",
                     [](ServerOptions& o) -> absl::Duration& { return o.cluster.redis_timeout; }),
      // ---- Security ----
      StringOption("tls_cert", "PEM certificate chain: enables TLS on the gRPC ports.",
                   [](ServerOptions& o) -> std::string& { return o.tls_cert; }),
      StringOption("tls_key", "PEM private key of --tls_cert.", [](ServerOptions& o) -> std::string& { return o.tls_key; }),
      StringOption("tls_client_ca", "PEM client CA bundle: mutual TLS (clients without a valid certificate are refused).",
                   [](ServerOptions& o) -> std::string& { return o.tls_client_ca; }),
      DurationOption("tls_reload_interval", "How often the TLS files are re-read and, when valid, rotated in.",
                     [](ServerOptions& o) -> absl::Duration& { return o.tls_reload_interval; }),
      StringOption("tls_mirror_dir",
                   "Private folder for the validated copies of the TLS files gRPC reads (default: a new one in $TMPDIR).",
                   [](ServerOptions& o) -> std::string& { return o.tls_mirror_dir; }),
      StringOption("admin_token_file", "File with the bearer token every RouterAdmin RPC must present (re-read on SIGHUP).",
                   [](ServerOptions& o) -> std::string& { return o.admin_token_file; }),
      StringOption("data_token_file",
                   "File with the bearer token every DecodeRouter RPC must present (re-read on SIGHUP); empty: none.",
                   [](ServerOptions& o) -> std::string& { return o.data_token_file; }),
      ChoiceOption<ReporterAuth>("reporter_auth", "Who may report load for a worker.", "none, token or mtls",
                                 [](ServerOptions& o) -> ReporterAuth& { return o.reporter_auth; }, ParseReporterAuth,
                                 ReporterAuthName),
      StringOption("reporter_tokens_file",
                   "reporter_auth=token: JSON object {\"worker id\": \"token\"} (re-read on SIGHUP).",
                   [](ServerOptions& o) -> std::string& { return o.reporter_tokens_file; }),
      // ---- Limits ----
      IntOption<int64_t>("max_message_bytes",
                         "Largest Route request on the data plane: larger ones are INVALID_ARGUMENT (oversized); gRPC "
                         "refuses beyond 4x this with RESOURCE_EXHAUSTED.",
                         [](ServerOptions& o) -> int64_t& { return o.max_message_bytes; }),
      IntOption<int64_t>("admin_max_message_bytes", "Largest message on the admin listener (inline artifacts).",
                         [](ServerOptions& o) -> int64_t& { return o.admin_max_message_bytes; }),
      IntOption<int64_t>("max_concurrent_streams", "Concurrent RPCs per connection.",
                         [](ServerOptions& o) -> int64_t& { return o.max_concurrent_streams; }),
      IntOption<int64_t>("max_stream_batch",
                         "Requests one RouteStream batch message may carry; a larger batch is answered with one "
                         "INVALID_ARGUMENT error and none of its entries is handled.",
                         [](ServerOptions& o) -> int64_t& { return o.max_stream_batch; }),
      IntOption<int64_t>("max_report_streams", "Open ReportLoad streams at most (more: RESOURCE_EXHAUSTED).",
                         [](ServerOptions& o) -> int64_t& { return o.max_report_streams; }),
      IntOption<int64_t>("max_report_streams_per_peer", "Open ReportLoad streams per peer address at most.",
                         [](ServerOptions& o) -> int64_t& { return o.max_report_streams_per_peer; }),
      DurationOption("report_stream_idle_timeout", "A ReportLoad stream silent this long is ended.",
                     [](ServerOptions& o) -> absl::Duration& { return o.report_stream_idle_timeout; }),
      DurationOption("keepalive_time", "Idle time before the server pings a connection.",
                     [](ServerOptions& o) -> absl::Duration& { return o.keepalive_time; }),
      DurationOption("keepalive_timeout", "Time to wait for a keepalive ack before closing the connection.",
                     [](ServerOptions& o) -> absl::Duration& { return o.keepalive_timeout; }),
      DurationOption("keepalive_min_ping_interval", "Minimum interval between client pings the server tolerates.",
                     [](ServerOptions& o) -> absl::Duration& { return o.keepalive_min_ping_interval; }),
      BoolOption("keepalive_permit_without_calls", "Allow client keepalive pings on connections without calls.",
                 [](ServerOptions& o) -> bool& { return o.keepalive_permit_without_calls; }),
      DurationOption("max_connection_idle", "Close connections idle this long (inf: never).",
                     [](ServerOptions& o) -> absl::Duration& { return o.max_connection_idle; }),
      DurationOption("max_connection_age", "Close connections older than this (inf: never).",
                     [](ServerOptions& o) -> absl::Duration& { return o.max_connection_age; }),
      DurationOption("max_connection_age_grace", "Grace for calls on a connection closed for its age (inf: unlimited).",
                     [](ServerOptions& o) -> absl::Duration& { return o.max_connection_age_grace; }),
      // ---- Lifecycle and logs ----
      DurationOption("shutdown_drain_delay",
                     "On SIGTERM, keep serving this long after readiness turns false, before closing.",
                     [](ServerOptions& o) -> absl::Duration& { return o.shutdown_drain_delay; }),
      DurationOption("shutdown_grace", "On SIGTERM, in-flight RPCs get this long to finish.",
                     [](ServerOptions& o) -> absl::Duration& { return o.shutdown_grace; }),
      ChoiceOption<LogLevel>("log_level", "Lowest level logged.", "debug, info, warning or error",
                             [](ServerOptions& o) -> LogLevel& { return o.log_level; }, ParseLogLevel, LogLevelName),
      ChoiceOption<LogFormat>("log_format", "One line per event on stderr: key=value or JSON.", "kv or json",
                              [](ServerOptions& o) -> LogFormat& { return o.log_format; }, ParseLogFormat,
                              LogFormatName),
      DoubleOption("log_rate_limit", "Warning lines of one kind per second at most (the rest are counted).",
                   [](ServerOptions& o) -> double& { return o.log_rate_limit; }),
  };
  return *table;
}
// clang-format on

// Older spellings with a unit in the name: the number is read in that unit.
struct OptionAlias {
  const char* old_key;
  const char* key;
  const char* unit;  // appended to a plain number
};
constexpr OptionAlias kAliases[] = {
    {"scrape_interval_ms", "scrape_interval", "ms"},
    {"scrape_timeout_ms", "scrape_timeout", "ms"},
    {"refit_window_s", "refit_window", "s"},
    {"refit_interval_s", "refit_interval", "s"},
};

const OptionDef* FindOption(absl::string_view key) {
  for (const OptionDef& def : OptionTable()) {
    if (def.key == key) return &def;
  }
  return nullptr;
}

// Resolves an alias: the option it stands for and the value in that option's syntax.
const OptionDef* FindOptionOrAlias(absl::string_view key, absl::string_view value, std::string* resolved_value) {
  *resolved_value = std::string(value);
  if (const OptionDef* def = FindOption(key)) return def;
  for (const OptionAlias& alias : kAliases) {
    if (key != alias.old_key) continue;
    double number = 0;
    if (absl::SimpleAtod(absl::StripAsciiWhitespace(value), &number)) {
      *resolved_value = absl::StrCat(absl::StripAsciiWhitespace(value), alias.unit);
    }
    return FindOption(alias.key);
  }
  return nullptr;
}

absl::StatusOr<WorkerSpec> WorkerFromJson(const Json& j, size_t index) {
  const std::string where = absl::StrCat("worker #", index);
  if (!j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected an object with id and address"));
  WorkerSpec w;
  for (const auto& [key, value] : j.items()) {
    if (key == "id" || key == "address" || key == "metrics_url") {
      if (!value.is_string()) return absl::InvalidArgumentError(absl::StrCat(where, ": '", key, "' must be a string"));
      (key == "id" ? w.id : key == "address" ? w.address : w.metrics_url) = value.get<std::string>();
    } else if (key == "capacity") {
      if (!value.is_number()) return absl::InvalidArgumentError(absl::StrCat(where, ": 'capacity' must be a number"));
      w.capacity = value.get<double>();
    } else if (key == "max_inflight") {
      if (!value.is_number_integer()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": 'max_inflight' must be an integer"));
      }
      w.max_inflight = value.get<int64_t>();
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown key '", key, "' (expected id, address, capacity, max_inflight, metrics_url)"));
    }
  }
  return w;
}

absl::StatusOr<std::vector<WorkerSpec>> CheckWorkers(std::vector<WorkerSpec> workers) {
  absl::flat_hash_set<std::string> seen;
  for (const WorkerSpec& w : workers) {
    ELDR_RETURN_IF_ERROR(ValidateWorkerSpec(w));
    if (!seen.insert(w.id).second) return absl::InvalidArgumentError(absl::StrCat("duplicate worker id '", w.id, "'"));
  }
  return workers;
}

std::string JsonToSettingText(const Json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "true" : "false";
  if (value.is_number_integer()) {
    return value.is_number_unsigned() ? absl::StrCat(value.get<uint64_t>()) : absl::StrCat(value.get<int64_t>());
  }
  return absl::StrCat(value.get<double>());
}

}  // namespace

ServerOptions::ServerOptions() {
  metrics_http.listen = "0.0.0.0:9464";
  // The daemon guards P99 by default (docs/operations.md, "The load-gap guard"); the library's
  // RouterOptions leave it off.
  router.max_load_gap = kDefaultMaxLoadGap;
  metrics_http.max_connections = 64;
  refit.seed = router.seed;
}

absl::StatusOr<DiscoveryMode> ParseDiscoveryMode(absl::string_view name) {
  if (name == "static") return DiscoveryMode::kStatic;
  if (name == "kubernetes") return DiscoveryMode::kKubernetes;
  return absl::InvalidArgumentError(absl::StrCat("unknown discovery '", name, "'"));
}

absl::string_view DiscoveryModeName(DiscoveryMode mode) {
  return mode == DiscoveryMode::kKubernetes ? "kubernetes" : "static";
}

absl::StatusOr<ReporterAuth> ParseReporterAuth(absl::string_view name) {
  if (name == "none") return ReporterAuth::kNone;
  if (name == "token") return ReporterAuth::kToken;
  if (name == "mtls") return ReporterAuth::kMtls;
  return absl::InvalidArgumentError(absl::StrCat("unknown reporter_auth '", name, "'"));
}

absl::string_view ReporterAuthName(ReporterAuth auth) {
  switch (auth) {
    case ReporterAuth::kNone:
      return "none";
    case ReporterAuth::kToken:
      return "token";
    case ReporterAuth::kMtls:
      return "mtls";
  }
  return "none";
}

const std::vector<std::string>& ServerOptionKeys() {
  static const auto* keys = [] {
    auto* out = new std::vector<std::string>();
    for (const OptionDef& def : OptionTable()) out->push_back(def.key);
    return out;
  }();
  return *keys;
}

absl::Status SetServerOption(absl::string_view key, absl::string_view value, ServerOptions* options) {
  std::string resolved;
  const OptionDef* def = FindOptionOrAlias(key, value, &resolved);
  if (def == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown setting '", key, "'"));
  absl::Status status = def->set(resolved, options);
  if (!status.ok() && def->key != key) {
    return absl::Status(status.code(), absl::StrCat(status.message(), " (given as '", key, "')"));
  }
  return status;
}

absl::Status ApplyConfigJson(absl::string_view json_text, ServerOptions* options) {
  Json root = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("config: not valid JSON");
  if (!root.is_object()) return absl::InvalidArgumentError("config: expected a JSON object of settings");
  for (const auto& [key, value] : root.items()) {
    if (key == "workers" && (value.is_array() || value.is_object())) {
      auto workers = ParseWorkerJson(value.dump());
      if (!workers.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("config: setting 'workers': ", workers.status().message()));
      }
      options->workers = *std::move(workers);
      continue;
    }
    if (!value.is_string() && !value.is_boolean() && !value.is_number()) {
      if (FindOption(key) == nullptr)
        return absl::InvalidArgumentError(absl::StrCat("config: unknown setting '", key, "'"));
      return absl::InvalidArgumentError(
          absl::StrCat("config: setting '", key, "': expected a string, number or boolean"));
    }
    absl::Status status = SetServerOption(key, JsonToSettingText(value), options);
    if (!status.ok()) return absl::InvalidArgumentError(absl::StrCat("config: ", status.message()));
  }
  return absl::OkStatus();
}

absl::Status ApplyConfigFile(const std::string& path, ServerOptions* options) {
  ELDR_ASSIGN_OR_RETURN(const std::string text, ReadFile(path, size_t{16} << 20));
  absl::Status status = ApplyConfigJson(text, options);
  if (!status.ok()) return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
  return absl::OkStatus();
}

absl::StatusOr<CommandLine> ParseCommandLine(int argc, const char* const* argv, ServerOptions* options) {
  struct Flag {
    std::string name;
    std::optional<std::string> value;
  };
  std::vector<Flag> flags;
  CommandLine result;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg.size() < 2 || arg[0] != '-') {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "' (settings are --key=value)"));
    }
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    Flag flag;
    const size_t eq = arg.find('=');
    flag.name = std::string(arg.substr(0, eq));
    if (eq != absl::string_view::npos) flag.value = std::string(arg.substr(eq + 1));
    if (flag.name == "help" || flag.name == "h") {
      result.help = true;
      continue;
    }
    if (flag.name == "version") {
      result.version = true;
      continue;
    }
    std::string ignored;
    const OptionDef* def = FindOptionOrAlias(flag.name, "", &ignored);
    const bool negated_bool = def == nullptr && absl::StartsWith(flag.name, "no") &&
                              FindOption(flag.name.substr(2)) != nullptr && FindOption(flag.name.substr(2))->is_bool;
    if (negated_bool) {
      if (flag.value.has_value()) return absl::InvalidArgumentError(absl::StrCat("--", flag.name, " takes no value"));
      flag.name = flag.name.substr(2);
      flag.value = "false";
    } else if (def == nullptr && flag.name != "config") {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", flag.name, " (see --help)"));
    } else if (!flag.value.has_value()) {
      if (def != nullptr && def->is_bool) {
        flag.value = "true";
      } else if (i + 1 < argc) {
        flag.value = std::string(argv[++i]);
      } else {
        return absl::InvalidArgumentError(absl::StrCat("flag --", flag.name, " needs a value"));
      }
    }
    flags.push_back(std::move(flag));
  }
  if (result.help || result.version) return result;
  // The config file first, wherever it stands; then the flags in order, so they override it.
  for (const Flag& flag : flags) {
    if (flag.name == "config" && !flag.value->empty()) ELDR_RETURN_IF_ERROR(ApplyConfigFile(*flag.value, options));
  }
  for (const Flag& flag : flags) {
    if (flag.name != "config") ELDR_RETURN_IF_ERROR(SetServerOption(flag.name, *flag.value, options));
  }
  return result;
}

std::string UsageText() {
  const ServerOptions defaults;
  std::string text =
      "eldr-router: routes each request to the decode worker whose expert centroid matches its prefill "
      "signature, balanced with load.\n\n"
      "Usage: eldr-router --workers=... --centroids=... [--key=value ...]\n\n"
      "  --config=FILE  JSON object of any settings below (same keys); flags on the command line override it.\n"
      "  --help, --version\n\n";
  for (const OptionDef& def : OptionTable()) {
    const Json value = def.get(defaults);
    std::string shown = value.is_string() ? value.get<std::string>() : value.dump();
    if (shown.empty() || shown == "[]") shown = "(none)";
    absl::StrAppend(&text, "  --", def.key, "=<", def.type, ">  (default: ", shown, ")\n      ", def.help, "\n");
  }
  absl::StrAppend(&text, "\nOlder spellings still accepted: ");
  for (const OptionAlias& alias : kAliases) {
    absl::StrAppend(&text, "--", alias.old_key, " (= --", alias.key, " in ", alias.unit, ") ");
  }
  text += "\n";
  return text;
}

bool IsUnixSocketAddress(absl::string_view address) {
  return absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:");
}

bool IsLoopbackAddress(absl::string_view address) {
  if (IsUnixSocketAddress(address)) return true;
  const size_t colon = address.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? address : address.substr(0, colon);
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  if (absl::EqualsIgnoreCase(host, "localhost") || host == "::1") return true;
  // 127.0.0.0/8, written as a dotted quad.
  std::vector<absl::string_view> octets = absl::StrSplit(host, '.');
  if (octets.size() != 4 || octets[0] != "127") return false;
  for (absl::string_view octet : octets) {
    int v = 0;
    if (!absl::SimpleAtoi(octet, &v) || v < 0 || v > 255) return false;
  }
  return true;
}

absl::Status ValidateServerOptions(const ServerOptions& o) {
  auto bad = [](absl::string_view key, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("setting '", key, "': ", why));
  };
  if (o.listen.empty()) return bad("listen", "must be host:port");
  if (!o.admin_listen.empty() && o.admin_listen == o.listen && !absl::EndsWith(o.listen, ":0")) {
    return bad("admin_listen", "must differ from listen (leave it empty to serve admin on listen)");
  }
  const std::string& admin_address = o.admin_listen.empty() ? o.listen : o.admin_listen;
  const bool admin_protected = !o.admin_token_file.empty() || !o.tls_client_ca.empty();
  if (!IsLoopbackAddress(admin_address) && !admin_protected && !o.allow_insecure_admin) {
    return bad("admin_listen",
               absl::StrCat("RouterAdmin would be reachable from the network at ", admin_address,
                            " without credentials: set admin_token_file or tls_client_ca, keep admin_listen on "
                            "loopback, or pass allow_insecure_admin to accept the risk"));
  }
  if (!(o.router.tau >= 0.0 && o.router.tau <= 1.0)) return bad("tau", "must be in [0, 1]");
  if (!(o.router.max_load_gap >= 0.0 && std::isfinite(o.router.max_load_gap))) {
    return bad("eldr_max_load_gap", "must be finite and >= 0 (0: off)");
  }
  if (o.router.load.lease_ttl <= absl::ZeroDuration()) return bad("lease_ttl", "must be positive");
  if (o.router.load.snapshot_staleness <= absl::ZeroDuration()) return bad("snapshot_staleness", "must be positive");
  if (o.router.max_live_leases < 1) return bad("max_live_leases", "must be at least 1");
  if (o.lease_expiry_interval <= absl::ZeroDuration() || o.lease_expiry_interval == absl::InfiniteDuration()) {
    return bad("lease_expiry_interval", "must be positive and finite");
  }
  if (o.max_artifact_bytes < 1024) return bad("max_artifact_bytes", "must be at least 1024");
  if (o.scrape.interval < absl::Milliseconds(1)) return bad("scrape_interval", "must be at least 1ms");
  if (o.scrape.timeout < absl::Milliseconds(1)) return bad("scrape_timeout", "must be at least 1ms");
  if (o.scrape.unhealthy_after_failures < 0 || o.scrape.unhealthy_after_failures > 1'000'000) {
    return bad("unhealthy_after_failures", "must be in [0, 1000000] (0: never mark unhealthy)");
  }
  if (o.refit.window < absl::Seconds(1)) return bad("refit_window", "must be at least 1s");
  if (o.refit.interval < absl::ZeroDuration()) return bad("refit_interval", "must not be negative");
  if (o.refit.max_window_signatures < 1) return bad("refit_max_window_signatures", "must be at least 1");
  if (o.refit.max_window_bytes < kMinRefitWindowBytes) {
    return bad("refit_window_bytes", absl::StrCat("must be at least ", kMinRefitWindowBytes, " (1 MiB)"));
  }
  if (!(o.refit.max_client_share > 0 && o.refit.max_client_share <= 1)) {
    return bad("refit_max_client_share", "must be a fraction in (0, 1]");
  }
  if (!(o.refit.max_step_distance > 0 && o.refit.max_step_distance <= 2)) {
    return bad("refit_max_step", "must be a cosine distance in (0, 2]");
  }
  if (!(o.refit.max_drift_distance > 0 && o.refit.max_drift_distance <= 2)) {
    return bad("refit_max_drift", "must be a cosine distance in (0, 2]");
  }
  if (!(o.refit.max_imbalance_increase >= 0 && o.refit.max_imbalance_increase <= 1000)) {
    return bad("refit_max_imbalance_increase", "must be in [0, 1000] (an increase of max/mean work share)");
  }
  if (!(o.refit.max_locality_decrease >= 0 && o.refit.max_locality_decrease <= 1)) {
    return bad("refit_max_locality_decrease", "must be in [0, 1] (a decrease of mean cosine similarity; 1: no bound)");
  }
  if (!(o.refit.min_experts_gain >= -1 && o.refit.min_experts_gain < 1)) {
    return bad("refit_min_experts_gain",
               "must be in [-1, 1) (a fraction of the predicted experts per step; -1: no bound)");
  }
  if (!(o.refit.expert_picks > 0 && o.refit.expert_picks <= 1e6)) {
    return bad("refit_expert_picks", "must be in (0, 1e6] (expert picks per layer in one decode step)");
  }
  if (!(o.refit.max_churn > 0 && o.refit.max_churn <= 1)) {
    return bad("refit_max_churn", "must be a fraction in (0, 1] (1: no bound)");
  }
  if (!(o.refit.default_output_tokens >= 0 && o.refit.default_output_tokens <= 1e9)) {
    return bad("refit_default_output_tokens", "must be in [0, 1e9] (0: drop unmeasured signatures)");
  }
  if (!(o.refit.default_tokens_per_second > 0 && o.refit.default_tokens_per_second <= 1e9)) {
    return bad("refit_default_tokens_per_second", "must be in (0, 1e9]");
  }
  if (o.refit.max_pending_signatures < 1) return bad("refit_max_pending_signatures", "must be at least 1");
  if (o.refit.max_pending_bytes < 1024) return bad("refit_pending_bytes", "must be at least 1024");
  if (!o.cluster.redis.empty()) {
    if (o.cluster.redis_db < 0 || o.cluster.redis_db >= (1 << 20))
      return bad("cluster_redis_db", "must be in [0, 1048576)");
    if (o.cluster.cluster_name.empty()) return bad("cluster_name", "must not be empty");
    if (o.cluster.leader_lease < absl::Milliseconds(300) || o.cluster.leader_lease > absl::Minutes(5))
      return bad("cluster_leader_lease", "must be in [300ms, 5m]");
    if (o.cluster.load_interval < absl::Milliseconds(10) || o.cluster.load_interval > absl::Seconds(10))
      return bad("cluster_load_interval", "must be in [10ms, 10s]");
    if (o.cluster.centroid_check_interval < absl::Milliseconds(50) ||
        o.cluster.centroid_check_interval > absl::Minutes(5))
      return bad("cluster_centroid_check_interval", "must be in [50ms, 5m]");
    if (o.cluster.redis_timeout < absl::Milliseconds(10) || o.cluster.redis_timeout > absl::Seconds(60))
      return bad("cluster_redis_timeout", "must be in [10ms, 60s]");
    if (o.cluster.redis_timeout * 3 > o.cluster.leader_lease)
      return bad("cluster_redis_timeout", "must be at most a third of cluster_leader_lease (a renewal must fit)");
  }
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return bad(o.tls_cert.empty() ? "tls_cert" : "tls_key", "tls_cert and tls_key go together");
  }
  if (!o.tls_client_ca.empty() && o.tls_cert.empty()) {
    return bad("tls_client_ca", "mutual TLS needs tls_cert and tls_key as well");
  }
  if (o.tls_reload_interval < absl::Seconds(1) || o.tls_reload_interval == absl::InfiniteDuration()) {
    return bad("tls_reload_interval", "must be at least 1s and finite");
  }
  if (o.reporter_auth == ReporterAuth::kToken && o.reporter_tokens_file.empty()) {
    return bad("reporter_tokens_file", "reporter_auth=token needs the file of per-worker tokens");
  }
  if (o.reporter_auth == ReporterAuth::kMtls && o.tls_client_ca.empty()) {
    return bad("reporter_auth", "mtls needs mutual TLS (tls_client_ca)");
  }
  constexpr int64_t kMinMessage = 4096;
  constexpr int64_t kMaxMessage = std::numeric_limits<int32_t>::max();
  if (o.max_message_bytes < kMinMessage || o.max_message_bytes > kMaxMessage) {
    return bad("max_message_bytes", "must be between 4096 and 2147483647");
  }
  if (o.admin_max_message_bytes < kMinMessage || o.admin_max_message_bytes > kMaxMessage) {
    return bad("admin_max_message_bytes", "must be between 4096 and 2147483647");
  }
  if (o.max_concurrent_streams < 1 || o.max_concurrent_streams > std::numeric_limits<int32_t>::max()) {
    return bad("max_concurrent_streams", "must be between 1 and 2147483647");
  }
  if (o.max_stream_batch < 1 || o.max_stream_batch > kMaxStreamBatchLimit) {
    return bad("max_stream_batch", absl::StrCat("must be between 1 and ", kMaxStreamBatchLimit));
  }
  if (o.max_report_streams < 1) return bad("max_report_streams", "must be at least 1");
  if (o.max_report_streams_per_peer < 1) return bad("max_report_streams_per_peer", "must be at least 1");
  if (o.report_stream_idle_timeout <= absl::ZeroDuration()) {
    return bad("report_stream_idle_timeout", "must be positive (inf: never)");
  }
  for (const auto& [key, d] : {std::pair<const char*, absl::Duration>{"keepalive_time", o.keepalive_time},
                               {"keepalive_timeout", o.keepalive_timeout},
                               {"keepalive_min_ping_interval", o.keepalive_min_ping_interval},
                               {"max_connection_idle", o.max_connection_idle},
                               {"max_connection_age", o.max_connection_age},
                               {"max_connection_age_grace", o.max_connection_age_grace}}) {
    if (d <= absl::ZeroDuration()) return bad(key, "must be positive (inf: never)");
  }
  if (o.shutdown_drain_delay < absl::ZeroDuration() || o.shutdown_drain_delay == absl::InfiniteDuration()) {
    return bad("shutdown_drain_delay", "must be finite and not negative");
  }
  if (o.shutdown_grace < absl::ZeroDuration() || o.shutdown_grace == absl::InfiniteDuration()) {
    return bad("shutdown_grace", "must be finite and not negative");
  }
  if (!(o.log_rate_limit > 0)) return bad("log_rate_limit", "must be positive");
  if (!o.metrics_http.listen.empty()) {
    if (absl::Status http = http::ValidateHttpServerOptions(o.metrics_http); !http.ok()) {
      return bad("metrics_*", http.message());
    }
  }
  auto ids = CheckWorkers(o.workers);
  if (!ids.ok()) return bad("workers", ids.status().message());
  if (o.discovery.mode == DiscoveryMode::kKubernetes) {
    // Discovery owns the pool: a static list beside it would be overwritten or fight it.
    if (!o.workers.empty()) {
      return bad("workers",
                 "cannot be mixed with discovery=kubernetes (the pool is the pods matching decode_selector)");
    }
    if (!o.worker_metrics.empty()) {
      return bad("worker_metrics",
                 "cannot be mixed with discovery=kubernetes (use worker_metrics_port, or the pod annotation "
                 "eldr.io/metrics-port)");
    }
    if (absl::StripAsciiWhitespace(o.discovery.decode_selector).empty()) {
      return bad("decode_selector", "is required with discovery=kubernetes (e.g. app.kubernetes.io/component=decode)");
    }
    if (o.discovery.worker_port.empty()) return bad("worker_port", "is required with discovery=kubernetes");
    if (o.discovery.worker_metrics_path.empty() || o.discovery.worker_metrics_path[0] != '/') {
      return bad("worker_metrics_path", "must start with '/'");
    }
    if (o.discovery.settle < absl::ZeroDuration() || o.discovery.settle == absl::InfiniteDuration()) {
      return bad("discovery_settle", "must be finite and not negative");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<WorkerSpec>> ParseWorkerJson(absl::string_view json_text) {
  Json root = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("workers: not valid JSON");
  if (root.is_object()) {
    if (!root.contains("workers") || root.size() != 1) {
      return absl::InvalidArgumentError("workers: expected an array, or an object whose only key is 'workers'");
    }
    root = root["workers"];
  }
  if (!root.is_array()) return absl::InvalidArgumentError("workers: expected an array of worker objects");
  std::vector<WorkerSpec> workers;
  workers.reserve(root.size());
  for (size_t i = 0; i < root.size(); ++i) {
    ELDR_ASSIGN_OR_RETURN(WorkerSpec w, WorkerFromJson(root[i], i));
    workers.push_back(std::move(w));
  }
  return CheckWorkers(std::move(workers));
}

absl::StatusOr<std::vector<WorkerSpec>> ParseWorkerList(absl::string_view spec) {
  spec = absl::StripAsciiWhitespace(spec);
  if (!absl::StrContains(spec, '=')) {
    const std::string path(spec);
    ELDR_ASSIGN_OR_RETURN(const std::string text, ReadFile(path, size_t{64} << 20));
    auto workers = ParseWorkerJson(text);
    if (!workers.ok())
      return absl::Status(workers.status().code(), absl::StrCat(path, ": ", workers.status().message()));
    return workers;
  }
  std::vector<WorkerSpec> workers;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    const size_t eq = item.find('=');
    WorkerSpec w;
    if (eq != absl::string_view::npos) {
      w.id = std::string(absl::StripAsciiWhitespace(item.substr(0, eq)));
      w.address = std::string(absl::StripAsciiWhitespace(item.substr(eq + 1)));
    }
    if (w.id.empty() || w.address.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("workers: item '", item, "' is not id=host:port"));
    }
    workers.push_back(std::move(w));
  }
  if (workers.empty()) return absl::InvalidArgumentError("workers: the list is empty");
  return CheckWorkers(std::move(workers));
}

std::string ServerOptionsToJson(const ServerOptions& options) {
  Json j = Json::object();
  for (const OptionDef& def : OptionTable()) j[def.key] = def.get(options);
  return j.dump();
}

}  // namespace eldr::server
