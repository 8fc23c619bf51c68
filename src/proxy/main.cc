// eldr-proxy: the OpenAI-compatible prefill/decode proxy that routes decode with eldr-router
// (include/eldr/proxy/proxy.h; operators' guide: docs/proxy.md).
//
//   eldr-proxy --listen=0.0.0.0:8000 --prefill=10.0.0.1:8100,10.0.0.2:8100 \
//       --router=eldr-router:50051 --decode=10.0.1.1:8200,10.0.1.2:8200
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "eldr/common/daemon.h"
#include "eldr/common/file.h"
#include "eldr/proxy/proxy.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:8000", "Client-facing HTTP address (port 0: any free port).");
ABSL_FLAG(std::string, metrics_listen, "", "Extra listener for /metrics, /health, /readyz only; empty: none.");
ABSL_FLAG(std::string, port_file, "", "Write {\"port\", \"metrics_port\", \"pid\"} here once listening.");
ABSL_FLAG(std::string, prefill, "", "Prefill instances, host:port,... (required unless --discovery=kubernetes).");
ABSL_FLAG(std::string, decode, "",
          "Decode workers, host:port,...: where requests go when eldr-router cannot be reached (round robin), "
          "or always when --router is empty.");
ABSL_FLAG(std::string, router, "",
          "eldr-router's data plane, host:port (or unix:/path). Empty: route by the --decode list only.");
ABSL_FLAG(std::string, router_tls_ca, "", "PEM CA bundle: TLS to the router.");
ABSL_FLAG(std::string, router_tls_cert, "", "PEM client certificate: mutual TLS to the router.");
ABSL_FLAG(std::string, router_tls_key, "", "PEM key of --router_tls_cert.");
ABSL_FLAG(std::string, router_tls_server_name, "", "Name to verify in the router's certificate (default: its host).");
ABSL_FLAG(std::string, router_token_file, "", "File with the router's data-plane bearer token.");
ABSL_FLAG(absl::Duration, route_timeout, absl::Seconds(1), "Deadline of one Route call.");
ABSL_FLAG(std::string, router_api, "stream",
          "stream (Route and Complete as messages of long-lived RouteStream calls; unary RPCs against a router "
          "without RouteStream) or unary (one Route and one Complete RPC per request).");
ABSL_FLAG(bool, router_complete_errors_only, false,
          "router_api=stream: Completes go with errors_only, answered by the router only when they fail "
          "(one answer and one send less per request on the router's side).");
ABSL_FLAG(int32_t, router_streams, 4,
          "router_api=stream: RouteStream calls kept open to the router, [1, 64]; messages go round robin.");
ABSL_FLAG(std::string, prefill_policy, "prefix_hash", "prefix_hash, least_loaded or round_robin.");
ABSL_FLAG(int64_t, prefill_prefix_bytes, 1024, "prefix_hash: bytes of the prompt that pick the instance.");
ABSL_FLAG(double, prefill_load_factor, 1.25,
          "prefix_hash: bounded-load factor (an instance holds at most "
          "factor x the mean in flight).");
ABSL_FLAG(double, ab_baseline_fraction, 0,
          "Share of requests routed by --ab_baseline_policy instead of eldr (live A/B comparison).");
ABSL_FLAG(std::string, ab_baseline_policy, "jsq", "The A/B baseline: rr, random, jsq or p2c.");
ABSL_FLAG(uint64_t, ab_seed, 0, "Hash seed of the A/B split.");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(2), "Engine connect deadline.");
ABSL_FLAG(absl::Duration, prefill_timeout, absl::Seconds(120), "A prefill's whole answer.");
ABSL_FLAG(absl::Duration, first_token_timeout, absl::Seconds(120), "A streamed decode answer's head.");
ABSL_FLAG(absl::Duration, stream_idle_timeout, absl::Seconds(60), "Longest silence inside a decode answer.");
ABSL_FLAG(absl::Duration, request_timeout, absl::Minutes(30), "A whole request.");
ABSL_FLAG(int32_t, prefill_attempts, 3, "Prefill instances tried per request at most.");
ABSL_FLAG(int32_t, decode_attempts, 3, "Decode workers tried per request at most (before the answer's head).");
ABSL_FLAG(absl::Duration, retry_backoff, absl::Milliseconds(20), "Wait before a prefill retry, doubled each time.");
ABSL_FLAG(int64_t, max_request_bytes, 8 << 20, "Client body limit (413 beyond).");
ABSL_FLAG(int64_t, max_in_flight, 100000, "Requests in flight at most (503 beyond).");
ABSL_FLAG(bool, route_with_gate_prob_sums, false,
          "Route with the prefill's eldr_gate_prob_sums (a router calibrated with gate_prob) instead of its counts.");
ABSL_FLAG(int32_t, max_connections, 20000, "Client connections at most.");
ABSL_FLAG(int32_t, threads, 2, "Front-end io threads (also the request logic's).");
ABSL_FLAG(int32_t, client_threads, 2, "Upstream io threads.");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(30), "On SIGTERM, time in-flight requests get to finish.");
ABSL_FLAG(std::string, discovery, "static",
          "static (the --prefill and --decode lists) or kubernetes (the ready pods matching --prefill_selector and, "
          "for the fail-static decode list, --decode_selector).");
ABSL_FLAG(std::string, prefill_selector, "", "discovery=kubernetes: label selector of the prefill pods (required).");
ABSL_FLAG(std::string, decode_selector, "",
          "discovery=kubernetes: label selector of the decode pods for the fail-static list (empty: none).");
ABSL_FLAG(std::string, prefill_port, "http",
          "discovery=kubernetes: the prefill engine's container port, name or number.");
ABSL_FLAG(std::string, decode_port, "http",
          "discovery=kubernetes: the decode engine's container port, name or number.");
ABSL_FLAG(std::string, kube_namespace, "", "discovery=kubernetes: namespace watched (default: the pod's own).");
ABSL_FLAG(std::string, kubeconfig, "",
          "discovery=kubernetes: kubeconfig file (default: the in-cluster service account).");
ABSL_FLAG(std::string, kube_context, "",
          "discovery=kubernetes: context of --kubeconfig (default: its current-context).");
ABSL_FLAG(absl::Duration, discovery_settle, absl::Seconds(1),
          "discovery=kubernetes: a pod joins once routable this long (leaving is immediate).");

namespace {

std::vector<std::string> SplitList(const std::string& text) {
  return absl::StrSplit(text, ',', absl::SkipWhitespace());
}

void LogDiscovery(eldr::discovery::LogSeverity severity, const std::string& message) {
  std::fprintf(stderr, "eldr-proxy: discovery %s: %s\n",
               std::string(eldr::discovery::LogSeverityName(severity)).c_str(), message.c_str());
}

// The discovery of one role's pods from the flags.
absl::StatusOr<eldr::discovery::KubernetesDiscoveryOptions> DiscoveryFromFlags(const std::string& selector,
                                                                               const std::string& port) {
  eldr::discovery::KubernetesDiscoveryOptions options;
  ELDR_ASSIGN_OR_RETURN(options.api, eldr::discovery::ResolveKubeApiConfig(absl::GetFlag(FLAGS_kubeconfig),
                                                                           absl::GetFlag(FLAGS_kube_context)));
  options.namespace_ = absl::GetFlag(FLAGS_kube_namespace);
  if (options.namespace_.empty())
    options.namespace_ = options.api.namespace_.empty() ? "default" : options.api.namespace_;
  options.label_selector = selector;
  options.mapping.port = port;
  options.reconciler.settle = absl::GetFlag(FLAGS_discovery_settle);
  options.log = LogDiscovery;
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "eldr-proxy: OpenAI-compatible prefill/decode proxy; the decode worker of each request is picked by "
      "eldr-router from the prompt's expert signature.");
  absl::ParseCommandLine(argc, argv);
  // Debian's Abseil checks lock ordering on every Mutex acquisition (a graph of held locks, a few
  // percent of the CPU of each streamed token); the tests run with it, the daemon without.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Stop signals reach the wait at the end only; thousands of streams need as many descriptors.
  const sigset_t signals = eldr::BlockStopSignals();
  eldr::RaiseOpenFilesLimit();

  eldr::proxy::ProxyOptions options;
  options.server.listen = absl::GetFlag(FLAGS_listen);
  options.server.threads = absl::GetFlag(FLAGS_threads);
  options.server.max_connections = absl::GetFlag(FLAGS_max_connections);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.client.threads = absl::GetFlag(FLAGS_client_threads);
  options.prefill = SplitList(absl::GetFlag(FLAGS_prefill));
  options.decode = SplitList(absl::GetFlag(FLAGS_decode));
  options.router.target = absl::GetFlag(FLAGS_router);
  options.router.tls_ca_file = absl::GetFlag(FLAGS_router_tls_ca);
  options.router.tls_cert_file = absl::GetFlag(FLAGS_router_tls_cert);
  options.router.tls_key_file = absl::GetFlag(FLAGS_router_tls_key);
  options.router.tls_server_name = absl::GetFlag(FLAGS_router_tls_server_name);
  options.router.token_file = absl::GetFlag(FLAGS_router_token_file);
  options.router.route_timeout = absl::GetFlag(FLAGS_route_timeout);
  absl::StatusOr<eldr::proxy::RouterApi> router_api = eldr::proxy::ParseRouterApi(absl::GetFlag(FLAGS_router_api));
  if (!router_api.ok()) {
    std::fprintf(stderr, "eldr-proxy: --router_api: %s\n", std::string(router_api.status().message()).c_str());
    return 2;
  }
  options.router.api = *router_api;
  options.router.streams = absl::GetFlag(FLAGS_router_streams);
  options.router.complete_errors_only = absl::GetFlag(FLAGS_router_complete_errors_only);
  absl::StatusOr<eldr::proxy::PrefillPolicy> policy =
      eldr::proxy::ParsePrefillPolicy(absl::GetFlag(FLAGS_prefill_policy));
  if (!policy.ok()) {
    std::fprintf(stderr, "eldr-proxy: --prefill_policy: %s\n", std::string(policy.status().message()).c_str());
    return 2;
  }
  options.prefill_picker.policy = *policy;
  if (absl::GetFlag(FLAGS_prefill_prefix_bytes) < 1) {
    std::fprintf(stderr, "eldr-proxy: --prefill_prefix_bytes must be >= 1\n");
    return 2;
  }
  options.prefill_picker.prefix_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_prefill_prefix_bytes));
  options.prefill_picker.load_factor = absl::GetFlag(FLAGS_prefill_load_factor);
  options.ab.baseline_fraction = absl::GetFlag(FLAGS_ab_baseline_fraction);
  options.ab.baseline_policy = absl::GetFlag(FLAGS_ab_baseline_policy);
  options.ab.seed = absl::GetFlag(FLAGS_ab_seed);
  options.connect_timeout = absl::GetFlag(FLAGS_connect_timeout);
  options.prefill_timeout = absl::GetFlag(FLAGS_prefill_timeout);
  options.first_token_timeout = absl::GetFlag(FLAGS_first_token_timeout);
  options.stream_idle_timeout = absl::GetFlag(FLAGS_stream_idle_timeout);
  options.request_timeout = absl::GetFlag(FLAGS_request_timeout);
  options.prefill_attempts = absl::GetFlag(FLAGS_prefill_attempts);
  options.decode_attempts = absl::GetFlag(FLAGS_decode_attempts);
  options.retry_backoff = absl::GetFlag(FLAGS_retry_backoff);
  if (absl::GetFlag(FLAGS_max_request_bytes) < 1) {
    std::fprintf(stderr, "eldr-proxy: --max_request_bytes must be >= 1\n");
    return 2;
  }
  options.max_request_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_request_bytes));
  options.server.max_body_bytes = options.max_request_bytes;
  options.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  options.route_with_gate_prob_sums = absl::GetFlag(FLAGS_route_with_gate_prob_sums);
  options.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  const std::string discovery = absl::GetFlag(FLAGS_discovery);
  if (discovery == "kubernetes") {
    if (absl::GetFlag(FLAGS_prefill_selector).empty()) {
      std::fprintf(stderr, "eldr-proxy: --prefill_selector is required with --discovery=kubernetes\n");
      return 2;
    }
    absl::StatusOr<eldr::discovery::KubernetesDiscoveryOptions> prefill =
        DiscoveryFromFlags(absl::GetFlag(FLAGS_prefill_selector), absl::GetFlag(FLAGS_prefill_port));
    if (!prefill.ok()) {
      std::fprintf(stderr, "eldr-proxy: discovery: %s\n", std::string(prefill.status().message()).c_str());
      return 2;
    }
    options.prefill_discovery = *std::move(prefill);
    if (!absl::GetFlag(FLAGS_decode_selector).empty()) {
      absl::StatusOr<eldr::discovery::KubernetesDiscoveryOptions> decode =
          DiscoveryFromFlags(absl::GetFlag(FLAGS_decode_selector), absl::GetFlag(FLAGS_decode_port));
      if (!decode.ok()) {
        std::fprintf(stderr, "eldr-proxy: discovery: %s\n", std::string(decode.status().message()).c_str());
        return 2;
      }
      options.decode_discovery = *std::move(decode);
    }
  } else if (discovery != "static") {
    std::fprintf(stderr, "eldr-proxy: --discovery must be static or kubernetes, got '%s'\n", discovery.c_str());
    return 2;
  }

  absl::StatusOr<std::unique_ptr<eldr::proxy::Proxy>> proxy = eldr::proxy::Proxy::Create(options);
  if (!proxy.ok()) {
    std::fprintf(stderr, "eldr-proxy: %s\n", std::string(proxy.status().message()).c_str());
    return 2;
  }
  if (absl::Status started = (*proxy)->Start(); !started.ok()) {
    std::fprintf(stderr, "eldr-proxy: %s\n", std::string(started.message()).c_str());
    return 1;
  }
  std::fprintf(stderr, "eldr-proxy: listening on port %d (prefill: %s, router %s)\n", (*proxy)->port(),
               options.prefill_discovery.has_value()
                   ? absl::StrCat("pods matching ", options.prefill_discovery->label_selector).c_str()
                   : absl::StrCat(options.prefill.size(), " instances").c_str(),
               options.router.target.empty() ? "none" : options.router.target.c_str());
  if (const std::string port_file = absl::GetFlag(FLAGS_port_file); !port_file.empty()) {
    const std::string text =
        absl::StrCat("{\"port\": ", (*proxy)->port(), ", \"metrics_port\": ", (*proxy)->metrics_port(),
                     ", \"pid\": ", getpid(), "}\n");
    if (absl::Status written = eldr::WriteFileAtomically(port_file, text); !written.ok()) {
      std::fprintf(stderr, "eldr-proxy: --port_file: %s\n", std::string(written.message()).c_str());
      return 1;
    }
  }
  const int received = eldr::WaitForStopSignal(signals);
  std::fprintf(stderr, "eldr-proxy: signal %d: draining for at most %s\n", received,
               absl::FormatDuration(options.shutdown_grace).c_str());
  (*proxy)->Shutdown(options.shutdown_grace);
  const eldr::proxy::ProxyStats stats = (*proxy)->stats();
  std::fprintf(stderr, "eldr-proxy: stopped: %llu requests, %llu completed, %llu upstream errors, %llu client gone\n",
               static_cast<unsigned long long>(stats.requests), static_cast<unsigned long long>(stats.completed),
               static_cast<unsigned long long>(stats.upstream_errors),
               static_cast<unsigned long long>(stats.client_gone));
  return 0;
}
