// A minimal Kubernetes API client over libcurl: GET for lists, and streaming GET for watches
// (newline-delimited JSON events). It knows nothing about resources; PodWatcher builds the paths.
//
// Every call uses its own libcurl handle and connection (lists and watches are rare: one watch
// lives for minutes), driven on the calling thread in slices of at most 50 ms, so a call notices
// its stop flag within 100 ms wherever it is (connecting, in the TLS handshake, reading).
// Proxies named by the environment (http_proxy, ...) are not used: the API server is reached
// directly unless KubeClientOptions::proxy names one.
//
// Credentials: the bearer token of KubeApiConfig (token_file read on every request, so a rotated
// token is used from the next request on; after a 401 the file is read once more, and when it
// holds a different token the request is retried once with it), the client certificate, and the
// CA, all as KubeApiConfig documents.
//
// Error mapping (the message names the server and says what failed):
//   UNAVAILABLE        connection refused / unreachable / DNS failure / connect timeout / TLS
//                      handshake or certificate verification failure / connection lost mid-way;
//                      HTTP 429 and 5xx
//   DEADLINE_EXCEEDED  Get: no complete answer within its timeout; Watch: no byte for
//                      silence_timeout
//   CANCELLED          the stop flag was set
//   RESOURCE_EXHAUSTED a body (Get) or one event line (Watch) over its limit
//   HTTP statuses (Watch; Get callers use KubeHttpStatus): see KubeHttpStatus.
//
// Thread-safety: every method may be called from many threads at once.
#ifndef ELDR_DISCOVERY_KUBE_CLIENT_H_
#define ELDR_DISCOVERY_KUBE_CLIENT_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "eldr/discovery/kube_config.h"

namespace eldr::discovery {

struct KubeClientOptions {
  // A Get answer larger than this fails with RESOURCE_EXHAUSTED (a PodList page of 500 pods is a
  // few MiB).
  size_t max_body_bytes = size_t{64} << 20;
  // Connection set-up limit (TCP + TLS) of Get; Watch has its own in WatchLimits.
  absl::Duration connect_timeout = absl::Seconds(10);
  // Sent as the User-Agent header.
  std::string user_agent = "eldr-discovery";
  // A proxy URL for every request; empty: none (the environment's proxy variables are ignored).
  std::string proxy;
};

// An HTTP answer of Get, whatever its status.
struct KubeResponse {
  int http_status = 0;
  std::string body;
};

struct WatchLimits {
  // Connection set-up limit (TCP + TLS); past it: UNAVAILABLE.
  absl::Duration connect_timeout = absl::Seconds(10);
  // No byte at all (headers, events, bookmarks, keep-alive chunks) for this long after the request
  // was sent: DEADLINE_EXCEEDED. The server is asked for bookmarks, so a healthy watch is never
  // silent for long.
  absl::Duration silence_timeout = absl::Seconds(90);
  // One event line longer than this: RESOURCE_EXHAUSTED (the stream is abandoned).
  size_t max_line_bytes = size_t{16} << 20;
};

// Optional hooks of Watch, called on the calling thread.
struct WatchHooks {
  // The server answered 200 and the stream is open (before any line).
  std::function<void()> on_open;
  // Every line received together (in one read from the connection) has been passed to on_line:
  // a caller that applies events one by one can publish once per batch instead of once per line.
  std::function<void()> on_batch_end;
};

// The canonical status of an HTTP status code, with the message of a Kubernetes Status body
// ({"kind":"Status","message":...}) when `body` is one, else the start of the body:
//   2xx OK; 400, 422 INVALID_ARGUMENT; 401 UNAUTHENTICATED; 403 PERMISSION_DENIED; 404 NOT_FOUND;
//   409 ABORTED; 410 Gone: OUT_OF_RANGE (kGoneCode; the requested resourceVersion or continue
//   token is too old); 429, 5xx UNAVAILABLE; any other UNKNOWN.
// The message reads "HTTP <code>: <message>", and the status carries the HTTP code (HttpStatusOf).
absl::Status KubeHttpStatus(int http_status, absl::string_view body);
// The HTTP code of a status made by KubeHttpStatus (also those Watch returns); nullopt for any
// other status (transport errors, OK).
std::optional<int> HttpStatusOf(const absl::Status& status);

// The code KubeHttpStatus gives HTTP 410 Gone (and PodWatcher a watch ERROR event of code 410).
inline constexpr absl::StatusCode kGoneCode = absl::StatusCode::kOutOfRange;
inline bool IsGone(const absl::Status& status) { return status.code() == kGoneCode; }

// Percent-encodes a query parameter value (RFC 3986 unreserved characters stay).
std::string UrlEncode(absl::string_view value);

class KubeClient {
 public:
  // INVALID_ARGUMENT for a config ValidateKubeApiConfig refuses; INTERNAL when libcurl cannot be
  // initialised. Files named by the config are read at each request, not here.
  static absl::StatusOr<std::unique_ptr<KubeClient>> Create(KubeApiConfig config, KubeClientOptions options = {});
  virtual ~KubeClient() = default;

  // GET <server><path_and_query> (path_and_query starts with '/'). Returns the answer, whatever its
  // HTTP status (a 401 only after the token retry described above). Errors: UNAVAILABLE (also when
  // the connection could not be set up within min(timeout, connect_timeout)), DEADLINE_EXCEEDED
  // (connected, but the answer was not complete within `timeout`), RESOURCE_EXHAUSTED,
  // CANCELLED when `stop` (may be null) is set; FAILED_PRECONDITION when a credential file cannot
  // be read and nothing was read from it before.
  virtual absl::StatusOr<KubeResponse> Get(const std::string& path_and_query, absl::Duration timeout,
                                           const std::atomic<bool>* stop = nullptr) = 0;

  // Streaming GET: calls `on_line` with every complete line of a 200 answer (without its '\n' and
  // a trailing '\r'; empty lines skipped), in order, on the calling thread. An event may span many
  // reads, and a read may carry many events. Returns when the stream ends:
  //   OK                the server ended the stream cleanly (e.g. timeoutSeconds passed; a last
  //                     line without '\n' is delivered first), or `on_line` returned false
  //   UNAVAILABLE       a connection or TLS failure (before or during the stream)
  //   DEADLINE_EXCEEDED silence (see WatchLimits::silence_timeout)
  //   CANCELLED         `stop` became true (checked at least every 100 ms)
  //   RESOURCE_EXHAUSTED one line over WatchLimits::max_line_bytes
  //   KubeHttpStatus(status, body) for an answer other than 200
  virtual absl::Status Watch(const std::string& path_and_query, const WatchLimits& limits,
                             const std::function<bool(absl::string_view line)>& on_line, const std::atomic<bool>& stop,
                             const WatchHooks& hooks = {}) = 0;

  virtual const KubeApiConfig& config() const = 0;
};

}  // namespace eldr::discovery

#endif  // ELDR_DISCOVERY_KUBE_CLIENT_H_
