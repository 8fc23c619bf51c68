// eldr-proxy: the OpenAI-compatible front end of a prefill/decode-disaggregated deployment that
// picks each request's decode worker with eldr-router.
//
// One request (POST /v1/completions or /v1/chat/completions):
//   1. the body is validated (openai_protocol.h: 400 with the reason, 413 when too large);
//   2. a prefill instance is picked (prefill_picker.h) and sent the prefill body (max_tokens 1,
//      kv_transfer_params.do_remote_decode); an instance that refuses the connection, times out
//      or answers 5xx is retried on another one (at most prefill_attempts in all, with backoff); a
//      4xx (429 included) is passed to the client as it came;
//   3. the expert counts the prefill attached (eldr_expert_counts, or the reference's eldr_sig)
//      go to eldr-router's Route (with the A/B arm's policy for baseline requests); a signature the
//      router refuses is retried without it (load balancing); when the router cannot be reached,
//      the proxy picks a decode worker of its static list itself (round robin) and says so in a
//      metric (fail static), or answers 503 without one;
//   4. the decode body (the client's, with the prefill's kv_transfer_params) goes to the chosen
//      worker; a worker that cannot be reached before the response head is released (Complete) and
//      re-routed without it (exclude_workers), at most decode_attempts in all; the answer is passed
//      to the client piece by piece as it arrives, unchanged;
//   5. Complete(lease, output_tokens) when the answer ended, failed, or the client went away (then
//      the upstream call is cancelled too): exactly once per lease.
// After the first byte went to the client, an upstream failure ends the stream with an error event
// (stream_accounting.h SseErrorEvent), or aborts a non-streamed answer. Timeouts: connect,
// prefill answer, first token, idle stream, whole request. GET /v1/models is relayed from an
// engine, GET /health answers liveness, GET /readyz readiness (the router reached, instances
// known, not draining), GET /metrics the Prometheus text (also on `metrics_listen` when set).
//
// Thread-safety: Proxy's methods may be called from any thread.
#ifndef ELDR_PROXY_PROXY_H_
#define ELDR_PROXY_PROXY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "eldr/discovery/discovery.h"
#include "eldr/http/http_client.h"
#include "eldr/http/http_server.h"
#include "eldr/proxy/ab_split.h"
#include "eldr/proxy/prefill_picker.h"

namespace eldr::proxy {

// How the proxy reaches eldr-router.
// The RPCs eldr-proxy calls eldr-router's Route and Complete with (--router_api).
enum class RouterApi { kStream, kUnary };
// "stream" or "unary"; INVALID_ARGUMENT otherwise.
absl::StatusOr<RouterApi> ParseRouterApi(absl::string_view name);

struct RouterClientOptions {
  // "host:port" of eldr-router's data plane. Empty: no router; every request is routed by the
  // proxy's static decode list (round robin), as a plain two-phase proxy would.
  std::string target;
  // TLS to the router: a CA bundle (PEM) enables TLS; a client certificate and key add mutual TLS.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // TLS server name to verify instead of the target's host (empty: the host).
  std::string tls_server_name;
  // A file holding the data-plane bearer token (eldr-router --data_token_file), sent on Route and
  // Complete. Empty: none.
  std::string token_file;
  // Deadline of one Route call. > 0.
  absl::Duration route_timeout = absl::Seconds(1);
  // Deadline of one Complete call (they are retried once). > 0.
  absl::Duration complete_timeout = absl::Seconds(2);
  // kStream: Completes go with errors_only (docs/api.md, "RouteStream"): the router answers only a
  // failed one, which saves it one answer and one send per lease. A Complete counts as done OK
  // once the router answered a later message of its stream (answers come in order), or when its
  // deadline passes after it was written without an error coming; when its stream ends first, or it
  // was never written, it fails (UNAVAILABLE, DEADLINE_EXCEEDED) and is sent again, as any Complete.
  bool complete_errors_only = false;
  // How Route and Complete travel to the router. kStream: as messages of long-lived RouteStream
  // calls (docs/api.md, "RouteStream"): no call set-up per request; against a router without
  // RouteStream (UNIMPLEMENTED) the client falls back to the unary RPCs by itself. kUnary: one
  // unary Route and one unary Complete RPC per request.
  RouterApi api = RouterApi::kStream;
  // kStream: RouteStream calls kept open on the router's channel, [1, 64]; messages are spread over
  // them round robin. More than one because each stream is a serial pipeline on both sides (one
  // write at a time here; the router answers a stream's messages one after the other): on a
  // CPU-saturated host one stream put its queueing into the TTFT tail, four did not
  // (docs/benchmarks.md, "eldr-proxy").
  int streams = 4;
};

struct ProxyOptions {
  // The client-facing HTTP server. Defaults changed from HttpServerOptions': listen
  // 0.0.0.0:8000, 2 threads, 20000 connections, bodies up to 8 MiB, a minute to send a response
  // piece, 10 minutes of idle keep-alive.
  http::HttpServerOptions server = DefaultServerOptions();
  // A second listener for /metrics, /health and /readyz only (Triton-style: metrics on their own
  // port). Empty: none (they are on `server` in any case).
  std::string metrics_listen;
  // The upstream client (prefill and decode engines). Default: 2 threads.
  http::HttpClientOptions client = DefaultClientOptions();
  // Prefill instances and decode workers, "host:port" each. Prefill: at least one. Decode: the
  // static fallback when the router cannot be reached (and the whole routing when
  // router.target is empty; then at least one), and where /v1/models asks first.
  std::vector<std::string> prefill;
  std::vector<std::string> decode;
  // Kubernetes discovery (eldr/discovery/discovery.h) instead of the lists above: `prefill` (or
  // `decode`) must then be empty and becomes the addresses (pod IP:port) of the ready pods that
  // match the options' label selector; a pod that is not ready, terminating or gone leaves the
  // list at once, one that becomes ready joins after the reconciler's settle time. Until the
  // first prefill pod is found, requests get 503 and /readyz says so. The proxy sets the options'
  // `role` ("prefill", "decode": the eldr_discovery_* metrics' label); `log` is the caller's.
  std::optional<discovery::KubernetesDiscoveryOptions> prefill_discovery;
  std::optional<discovery::KubernetesDiscoveryOptions> decode_discovery;
  RouterClientOptions router;
  PrefillPickerOptions prefill_picker;
  AbSplitOptions ab;

  // Upstream deadlines. Each > 0.
  absl::Duration connect_timeout = absl::Seconds(2);
  absl::Duration prefill_timeout = absl::Seconds(120);      // the prefill's whole answer
  absl::Duration first_token_timeout = absl::Seconds(120);  // decode: from the call to its head
  absl::Duration stream_idle_timeout = absl::Seconds(60);   // decode: longest silence mid-answer
  absl::Duration request_timeout = absl::Minutes(30);       // the whole request
  // Attempts in all (first try included), [1, 16]: prefill instances tried, decode workers tried.
  int prefill_attempts = 3;
  int decode_attempts = 3;
  // Wait before a retry on another prefill instance, doubled each time. >= 0.
  absl::Duration retry_backoff = absl::Milliseconds(20);
  // Client request body at most, bytes (beyond: 413). Also bounds the server's max_body_bytes.
  size_t max_request_bytes = 8 << 20;
  // Requests in flight at most; beyond, 503 at once. [1, 10000000].
  int64_t max_in_flight = 100000;
  // Bytes of one answer queued for a client that reads slower than the engine writes; beyond,
  // the client's connection is closed (the engine call cancelled, the lease completed). >= 64 KiB.
  size_t max_buffered_bytes_per_stream = 16 << 20;
  // On SIGTERM: readiness turns false at once, requests in flight get this long to finish.
  absl::Duration shutdown_grace = absl::Seconds(30);
  // Which signature Route carries when the prefill attached gate-probability sums
  // (eldr_gate_prob_sums): false sends the counts (a router calibrated with count or count_idf),
  // true the gate sums (a router calibrated with gate_prob), falling back to the counts when a
  // prefill attached none. Gate sums alone are never sent to a count router.
  bool route_with_gate_prob_sums = false;

  static http::HttpServerOptions DefaultServerOptions();
  static http::HttpClientOptions DefaultClientOptions();
};

// OK, or INVALID_ARGUMENT naming the first offending field ("ProxyOptions.prefill ...").
absl::Status ValidateProxyOptions(const ProxyOptions& options);

// Counters since Start (in_flight is a gauge), for tests and logs; /metrics exports more.
struct ProxyStats {
  uint64_t requests = 0;          // completions and chat requests received
  uint64_t completed = 0;         // answered with the engine's answer to its end
  uint64_t client_errors = 0;     // refused before any upstream call (400, 413, 503 overload)
  uint64_t upstream_errors = 0;   // ended by an upstream failure (502/503/504, or mid-stream)
  uint64_t client_gone = 0;       // the client left before the end
  uint64_t prefill_retries = 0;   // prefill attempts after the first
  uint64_t decode_reroutes = 0;   // decode attempts after the first
  uint64_t router_failures = 0;   // Route calls that failed (the request then fell back)
  uint64_t static_routes = 0;     // decode workers picked by the static list
  uint64_t leases_completed = 0;  // Complete calls made (one per lease)
  int64_t in_flight = 0;
};

class Proxy {
 public:
  // INVALID_ARGUMENT for bad options; FAILED_PRECONDITION for an unreadable token or TLS file.
  static absl::StatusOr<std::unique_ptr<Proxy>> Create(ProxyOptions options);
  virtual ~Proxy() = default;

  // Starts listening. UNAVAILABLE naming the address when it cannot be bound.
  virtual absl::Status Start() = 0;
  // The bound ports (0 before Start, and for metrics when metrics_listen is empty).
  virtual int port() const = 0;
  virtual int metrics_port() const = 0;
  // Readiness turns false and new requests are refused (503); in-flight requests go on. Then
  // waits until none is left or `grace` passed, and stops the servers (a request still running is
  // cut: its upstream call cancelled, its lease completed). Idempotent.
  virtual void Shutdown(absl::Duration grace) = 0;
  virtual ProxyStats stats() const = 0;
  // The Prometheus text of /metrics.
  virtual std::string MetricsText() const = 0;

 protected:
  Proxy() = default;
};

}  // namespace eldr::proxy

#endif  // ELDR_PROXY_PROXY_H_
