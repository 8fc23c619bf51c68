#include "eldr/discovery/kube_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "eldr/common/file.h"
#include "nlohmann/json.hpp"

namespace eldr::discovery {
namespace {

// libcurl's global state is initialised once per process and never torn down (other modules of
// the process use libcurl too).
void InitCurlOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

constexpr size_t kMaxTokenBytes = size_t{1} << 20;
// The payload of KubeHttpStatus's statuses: the HTTP code, in decimal.
constexpr char kHttpStatusPayload[] = "type.eldr.io/discovery.HttpStatus";

absl::Status HttpCodeStatus(int http_status, const std::string& text);
// The body of an answer other than 200 to a watch is kept up to this size (for its message).
constexpr size_t kMaxErrorBodyBytes = size_t{64} << 10;
// How long one slice of the transfer loop may block: bounds the reaction to the stop flag.
constexpr int kPollSliceMs = 50;

long ToMillis(absl::Duration d) { return static_cast<long>(std::max<int64_t>(1, absl::ToInt64Milliseconds(d))); }

// The bearer token to send: token_file's content when it can be read (read at every call), else
// the last content read from it, else the inline token.
class TokenSource {
 public:
  TokenSource(std::string token, std::string file) : inline_token_(std::move(token)), file_(std::move(file)) {}

  absl::StatusOr<std::string> Current() {
    if (file_.empty()) return inline_token_;
    absl::StatusOr<std::string> text = ReadFile(file_, kMaxTokenBytes);
    absl::MutexLock lock(&mu_);
    if (text.ok()) {
      std::string token(absl::StripAsciiWhitespace(*text));
      if (!token.empty()) last_read_ = std::move(token);
    }
    if (last_read_.has_value()) return *last_read_;
    if (!inline_token_.empty()) return inline_token_;
    if (!text.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot read the bearer token file: ", text.status().message()));
    }
    return absl::FailedPreconditionError(absl::StrCat("the bearer token file '", file_, "' is empty"));
  }

  bool from_file() const { return !file_.empty(); }

 private:
  const std::string inline_token_;
  const std::string file_;
  absl::Mutex mu_;
  std::optional<std::string> last_read_ ABSL_GUARDED_BY(mu_);
};

bool ValidHeaderValue(absl::string_view value) {
  for (char c : value) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) return false;
  }
  return true;
}

// One HTTP exchange in progress: what the callbacks fill in.
struct Exchange {
  bool lines = false;   // Watch: split a 200 body into lines
  size_t max_body = 0;  // Get: the body limit
  size_t max_line = 0;  // Watch: one line's limit
  const std::function<bool(absl::string_view)>* on_line = nullptr;
  const WatchHooks* hooks = nullptr;
  CURL* easy = nullptr;

  std::string body;     // Get: the body; Watch: the body of an answer other than 200
  std::string pending;  // Watch: the start of a line not complete yet
  int status = 0;       // known once the headers are complete
  bool headers_done = false;
  bool overflow = false;       // Get: body over max_body
  bool line_too_long = false;  // Watch: a line over max_line
  bool ended_by_callback = false;
  bool delivered = false;  // lines delivered since the last batch-end hook
  bool any_line = false;
  bool connected = false;  // the connection (and TLS handshake) was set up
  absl::Time last_activity;
  char error[CURL_ERROR_SIZE] = {};
};

size_t OnHeader(char* data, size_t size, size_t count, void* user) {
  auto* exchange = static_cast<Exchange*>(user);
  const size_t bytes = size * count;
  exchange->last_activity = absl::Now();
  const absl::string_view line(data, bytes);
  if (line == "\r\n" || line == "\n") {
    long code = 0;
    curl_easy_getinfo(exchange->easy, CURLINFO_RESPONSE_CODE, &code);
    if (code >= 200) {
      exchange->status = static_cast<int>(code);
      exchange->headers_done = true;
      if (exchange->lines && code == 200 && exchange->hooks != nullptr && exchange->hooks->on_open) {
        exchange->hooks->on_open();
      }
    }
  }
  return bytes;
}

// Delivers the complete lines of `exchange->pending`; false to abort the transfer.
bool DeliverLines(Exchange* exchange, bool final) {
  std::string& pending = exchange->pending;
  size_t start = 0;
  while (true) {
    const size_t newline = pending.find('\n', start);
    absl::string_view line;
    if (newline == std::string::npos) {
      if (!final || start >= pending.size()) break;
      line = absl::string_view(pending).substr(start);
      start = pending.size();
    } else {
      line = absl::string_view(pending).substr(start, newline - start);
      start = newline + 1;
    }
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    if (line.size() > exchange->max_line) {
      exchange->line_too_long = true;
      return false;
    }
    exchange->delivered = true;
    exchange->any_line = true;
    if (!(*exchange->on_line)(line)) {
      exchange->ended_by_callback = true;
      pending.clear();
      return false;
    }
  }
  pending.erase(0, start);
  if (pending.size() > exchange->max_line) {
    exchange->line_too_long = true;
    return false;
  }
  return true;
}

size_t OnBody(char* data, size_t size, size_t count, void* user) {
  auto* exchange = static_cast<Exchange*>(user);
  const size_t bytes = size * count;
  exchange->last_activity = absl::Now();
  if (!exchange->lines) {
    if (exchange->body.size() + bytes > exchange->max_body) {
      exchange->overflow = true;
      return 0;  // libcurl aborts with CURLE_WRITE_ERROR
    }
    exchange->body.append(data, bytes);
    return bytes;
  }
  if (exchange->status == 0) {
    long code = 0;
    curl_easy_getinfo(exchange->easy, CURLINFO_RESPONSE_CODE, &code);
    exchange->status = static_cast<int>(code);
  }
  if (exchange->status != 200) {
    const size_t room = kMaxErrorBodyBytes - std::min(kMaxErrorBodyBytes, exchange->body.size());
    exchange->body.append(data, std::min(room, bytes));
    return bytes;
  }
  // A line longer than the limit is refused as soon as it is, before all of it is buffered.
  const size_t newline = absl::string_view(data, bytes).find('\n');
  if (newline == absl::string_view::npos && exchange->pending.size() + bytes > exchange->max_line) {
    exchange->line_too_long = true;
    return 0;
  }
  exchange->pending.append(data, bytes);
  return DeliverLines(exchange, /*final=*/false) ? bytes : 0;
}

// How a transfer loop ended, besides libcurl's code.
enum class Interrupt { kNone, kStopped, kSilent };

// Runs `easy` to completion on this thread, in slices of kPollSliceMs, checking `stop` and the
// silence limit between slices.
CURLcode Drive(CURL* easy, Exchange& exchange, const std::atomic<bool>* stop, absl::Duration silence,
               Interrupt* interrupt) {
  *interrupt = Interrupt::kNone;
  CURLM* multi = curl_multi_init();
  if (multi == nullptr) return CURLE_OUT_OF_MEMORY;
  if (curl_multi_add_handle(multi, easy) != CURLM_OK) {
    curl_multi_cleanup(multi);
    return CURLE_FAILED_INIT;
  }
  exchange.last_activity = absl::Now();
  CURLcode result = CURLE_OK;
  bool done = false;
  while (!done) {
    int running = 0;
    const CURLMcode perform = curl_multi_perform(multi, &running);
    if (exchange.delivered) {
      exchange.delivered = false;
      if (exchange.hooks != nullptr && exchange.hooks->on_batch_end) exchange.hooks->on_batch_end();
    }
    if (perform != CURLM_OK) {
      result = CURLE_FAILED_INIT;
      break;
    }
    int queued = 0;
    while (CURLMsg* message = curl_multi_info_read(multi, &queued)) {
      if (message->msg == CURLMSG_DONE && message->easy_handle == easy) {
        result = message->data.result;
        done = true;
      }
    }
    if (done || running == 0) break;
    if (stop != nullptr && stop->load(std::memory_order_relaxed)) {
      *interrupt = Interrupt::kStopped;
      break;
    }
    if (silence > absl::ZeroDuration() && absl::Now() - exchange.last_activity > silence) {
      *interrupt = Interrupt::kSilent;
      break;
    }
    curl_multi_poll(multi, nullptr, 0, kPollSliceMs, nullptr);
  }
  curl_off_t pretransfer = 0;
  curl_easy_getinfo(easy, CURLINFO_PRETRANSFER_TIME_T, &pretransfer);
  exchange.connected = pretransfer > 0 || exchange.headers_done;
  curl_multi_remove_handle(multi, easy);
  curl_multi_cleanup(multi);
  return result;
}

absl::Status TransportError(CURLcode code, const Exchange& exchange, const std::string& server, bool watch) {
  const std::string detail = exchange.error[0] != '\0' ? std::string(exchange.error) : curl_easy_strerror(code);
  switch (code) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
      return absl::UnavailableError(absl::StrCat("cannot resolve the Kubernetes API server ", server, ": ", detail));
    case CURLE_COULDNT_CONNECT:
      return absl::UnavailableError(
          absl::StrCat("cannot connect to the Kubernetes API server ", server, " (refused or unreachable): ", detail));
    case CURLE_OPERATION_TIMEDOUT:
      // A watch has no overall limit: only its connection set-up can time out.
      if (watch || !exchange.connected) {
        return absl::UnavailableError(
            absl::StrCat("connecting to the Kubernetes API server ", server, " timed out: ", detail));
      }
      return absl::DeadlineExceededError(
          absl::StrCat("request to the Kubernetes API server ", server, " timed out: ", detail));
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_SSL_ENGINE_NOTFOUND:
    case CURLE_SSL_ENGINE_SETFAILED:
    case CURLE_SSL_CIPHER:
    case CURLE_SSL_SHUTDOWN_FAILED:
    case CURLE_SSL_CRL_BADFILE:
    case CURLE_SSL_ISSUER_ERROR:
    case CURLE_SSL_PINNEDPUBKEYNOTMATCH:
    case CURLE_SSL_INVALIDCERTSTATUS:
    case CURLE_USE_SSL_FAILED:
      return absl::UnavailableError(
          absl::StrCat("TLS handshake with the Kubernetes API server ", server, " failed: ", detail));
    case CURLE_PEER_FAILED_VERIFICATION:
      return absl::UnavailableError(absl::StrCat("the certificate of the Kubernetes API server ", server,
                                                 " does not verify against the configured CA: ", detail));
    case CURLE_SSL_CERTPROBLEM:
      return absl::UnavailableError(
          absl::StrCat("the client certificate or key for ", server, " cannot be used: ", detail));
    case CURLE_SSL_CACERT_BADFILE:
      return absl::UnavailableError(absl::StrCat("the CA bundle for ", server, " cannot be read: ", detail));
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_PARTIAL_FILE:
    case CURLE_GOT_NOTHING:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return absl::UnavailableError(
          absl::StrCat("connection to the Kubernetes API server ", server, " lost: ", detail));
    default:
      return absl::UnavailableError(absl::StrCat("request to the Kubernetes API server ", server, " failed: ", detail));
  }
}

class KubeClientImpl final : public KubeClient {
 public:
  KubeClientImpl(KubeApiConfig config, KubeClientOptions options)
      : config_(std::move(config)), options_(std::move(options)), tokens_(config_.token, config_.token_file) {
    base_ = config_.server;
    while (!base_.empty() && base_.back() == '/') base_.pop_back();
  }

  absl::StatusOr<KubeResponse> Get(const std::string& path_and_query, absl::Duration timeout,
                                   const std::atomic<bool>* stop) override {
    for (int attempt = 0;; ++attempt) {
      absl::StatusOr<std::string> token = tokens_.Current();
      if (!token.ok()) return token.status();
      Exchange exchange;
      exchange.max_body = options_.max_body_bytes;
      CURLcode code = CURLE_OK;
      Interrupt interrupt = Interrupt::kNone;
      absl::Status ran = Run(path_and_query, *token, std::min(timeout, options_.connect_timeout), timeout,
                             absl::ZeroDuration(), stop, exchange, &code, &interrupt);
      if (!ran.ok()) return ran;
      if (interrupt == Interrupt::kStopped) return absl::CancelledError("request cancelled");
      if (code == CURLE_WRITE_ERROR && exchange.overflow) {
        return absl::ResourceExhaustedError(absl::StrCat("answer of the Kubernetes API server to ", path_and_query,
                                                         " is larger than ", options_.max_body_bytes, " bytes"));
      }
      if (code != CURLE_OK) return TransportError(code, exchange, base_, /*watch=*/false);
      if (exchange.status == 401 && attempt == 0 && RetryAfter401(*token)) continue;
      return KubeResponse{exchange.status, std::move(exchange.body)};
    }
  }

  absl::Status Watch(const std::string& path_and_query, const WatchLimits& limits,
                     const std::function<bool(absl::string_view line)>& on_line, const std::atomic<bool>& stop,
                     const WatchHooks& hooks) override {
    for (int attempt = 0;; ++attempt) {
      absl::StatusOr<std::string> token = tokens_.Current();
      if (!token.ok()) return token.status();
      Exchange exchange;
      exchange.lines = true;
      exchange.max_line = limits.max_line_bytes;
      exchange.on_line = &on_line;
      exchange.hooks = &hooks;
      CURLcode code = CURLE_OK;
      Interrupt interrupt = Interrupt::kNone;
      absl::Status ran = Run(path_and_query, *token, limits.connect_timeout, absl::ZeroDuration(),
                             limits.silence_timeout, &stop, exchange, &code, &interrupt);
      if (!ran.ok()) return ran;
      if (interrupt == Interrupt::kStopped) return absl::CancelledError("watch cancelled");
      if (interrupt == Interrupt::kSilent) {
        return absl::DeadlineExceededError(absl::StrCat(
            "watch silent for ", absl::FormatDuration(limits.silence_timeout), " (no event, bookmark or byte)"));
      }
      if (exchange.ended_by_callback) return absl::OkStatus();
      if (exchange.line_too_long) {
        return absl::ResourceExhaustedError(
            absl::StrCat("watch event line longer than ", limits.max_line_bytes, " bytes"));
      }
      if (exchange.headers_done && exchange.status != 200 && exchange.status != 0) {
        if (exchange.status == 401 && attempt == 0 && RetryAfter401(*token)) continue;
        return KubeHttpStatus(exchange.status, exchange.body);
      }
      if (code != CURLE_OK) return TransportError(code, exchange, base_, /*watch=*/true);
      if (exchange.status != 200) return KubeHttpStatus(exchange.status, exchange.body);
      // A clean end: a last line without its newline is still an event.
      if (!exchange.pending.empty()) {
        DeliverLines(&exchange, /*final=*/true);
        if (exchange.delivered && hooks.on_batch_end) hooks.on_batch_end();
      }
      return absl::OkStatus();
    }
  }

  const KubeApiConfig& config() const override { return config_; }

 private:
  // After a 401 with `used`: whether the token file now holds another token (then retry once).
  bool RetryAfter401(const std::string& used) {
    if (!tokens_.from_file()) return false;
    absl::StatusOr<std::string> again = tokens_.Current();
    return again.ok() && *again != used;
  }

  // Sets up and drives one request. Errors only for a request that could not be set up.
  absl::Status Run(const std::string& path_and_query, const std::string& token, absl::Duration connect_timeout,
                   absl::Duration total_timeout, absl::Duration silence, const std::atomic<bool>* stop,
                   Exchange& exchange, CURLcode* code, Interrupt* interrupt) {
    if (path_and_query.empty() || path_and_query[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat("request path \"", path_and_query, "\" must start with '/'"));
    }
    if (!ValidHeaderValue(token)) {
      return absl::FailedPreconditionError("the bearer token contains control characters");
    }
    CURL* easy = curl_easy_init();
    if (easy == nullptr) return absl::InternalError("libcurl could not create a handle");
    exchange.easy = easy;
    curl_slist* headers = nullptr;
    headers = curl_slist_append(headers, "Accept: application/json");
    std::string authorization;
    if (!token.empty()) {
      authorization = absl::StrCat("Authorization: Bearer ", token);
      headers = curl_slist_append(headers, authorization.c_str());
    }
    const std::string url = base_ + path_and_query;
    curl_easy_setopt(easy, CURLOPT_URL, url.c_str());
    curl_easy_setopt(easy, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(easy, CURLOPT_USERAGENT, options_.user_agent.c_str());
    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, &OnBody);
    curl_easy_setopt(easy, CURLOPT_WRITEDATA, &exchange);
    curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, &OnHeader);
    curl_easy_setopt(easy, CURLOPT_HEADERDATA, &exchange);
    curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, exchange.error);
    curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(easy, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(easy, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, ToMillis(connect_timeout));
    if (total_timeout > absl::ZeroDuration()) curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, ToMillis(total_timeout));
    curl_easy_setopt(easy, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(easy, CURLOPT_PROXY, options_.proxy.c_str());
    // Compressed answers are fine for lists (PodLists compress well); watches stay plain so every
    // event is delivered as soon as it arrives.
    if (!exchange.lines) curl_easy_setopt(easy, CURLOPT_ACCEPT_ENCODING, "");
    if (config_.insecure_skip_tls_verify) {
      curl_easy_setopt(easy, CURLOPT_SSL_VERIFYPEER, 0L);
      curl_easy_setopt(easy, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    curl_blob ca_blob{};
    if (!config_.ca_pem.empty()) {
      ca_blob = curl_blob{const_cast<char*>(config_.ca_pem.data()), config_.ca_pem.size(), CURL_BLOB_COPY};
      curl_easy_setopt(easy, CURLOPT_CAINFO_BLOB, &ca_blob);
      curl_easy_setopt(easy, CURLOPT_CAPATH, nullptr);
    } else if (!config_.ca_file.empty()) {
      curl_easy_setopt(easy, CURLOPT_CAINFO, config_.ca_file.c_str());
      curl_easy_setopt(easy, CURLOPT_CAPATH, nullptr);
    }
    curl_blob cert_blob{};
    curl_blob key_blob{};
    if (!config_.client_cert_pem.empty()) {
      cert_blob =
          curl_blob{const_cast<char*>(config_.client_cert_pem.data()), config_.client_cert_pem.size(), CURL_BLOB_COPY};
      curl_easy_setopt(easy, CURLOPT_SSLCERT_BLOB, &cert_blob);
      curl_easy_setopt(easy, CURLOPT_SSLCERTTYPE, "PEM");
    } else if (!config_.client_cert_file.empty()) {
      curl_easy_setopt(easy, CURLOPT_SSLCERT, config_.client_cert_file.c_str());
      curl_easy_setopt(easy, CURLOPT_SSLCERTTYPE, "PEM");
    }
    if (!config_.client_key_pem.empty()) {
      key_blob =
          curl_blob{const_cast<char*>(config_.client_key_pem.data()), config_.client_key_pem.size(), CURL_BLOB_COPY};
      curl_easy_setopt(easy, CURLOPT_SSLKEY_BLOB, &key_blob);
      curl_easy_setopt(easy, CURLOPT_SSLKEYTYPE, "PEM");
    } else if (!config_.client_key_file.empty()) {
      curl_easy_setopt(easy, CURLOPT_SSLKEY, config_.client_key_file.c_str());
      curl_easy_setopt(easy, CURLOPT_SSLKEYTYPE, "PEM");
    }
    *code = Drive(easy, exchange, stop, silence, interrupt);
    curl_easy_cleanup(easy);
    curl_slist_free_all(headers);
    // The header held the token: wipe the copy.
    std::fill(authorization.begin(), authorization.end(), '\0');
    return absl::OkStatus();
  }

  const KubeApiConfig config_;
  const KubeClientOptions options_;
  std::string base_;
  TokenSource tokens_;
};

}  // namespace

absl::Status KubeHttpStatus(int http_status, absl::string_view body) {
  if (http_status >= 200 && http_status < 300) return absl::OkStatus();
  std::string message;
  const nlohmann::json parsed = nlohmann::json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_object()) {
    auto it = parsed.find("message");
    if (it != parsed.end() && it->is_string()) message = it->get<std::string>();
    if (message.empty()) {
      it = parsed.find("reason");
      if (it != parsed.end() && it->is_string()) message = it->get<std::string>();
    }
  }
  if (message.empty()) {
    std::string start(absl::StripAsciiWhitespace(body.substr(0, 200)));
    for (char& c : start) {
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) == 0x7f) c = ' ';
    }
    message = start.empty() ? "(no message)" : start;
  }
  absl::Status status = HttpCodeStatus(http_status, absl::StrCat("HTTP ", http_status, ": ", message));
  status.SetPayload(kHttpStatusPayload, absl::Cord(absl::StrCat(http_status)));
  return status;
}

std::optional<int> HttpStatusOf(const absl::Status& status) {
  absl::optional<absl::Cord> payload = status.GetPayload(kHttpStatusPayload);
  if (!payload.has_value()) return std::nullopt;
  int code = 0;
  if (!absl::SimpleAtoi(std::string(*payload), &code)) return std::nullopt;
  return code;
}

namespace {

absl::Status HttpCodeStatus(int http_status, const std::string& text) {
  switch (http_status) {
    case 400:
    case 422:
      return absl::InvalidArgumentError(text);
    case 401:
      return absl::UnauthenticatedError(text);
    case 403:
      return absl::PermissionDeniedError(text);
    case 404:
      return absl::NotFoundError(text);
    case 409:
      return absl::AbortedError(text);
    case 410:
      return absl::Status(kGoneCode, text);
    case 429:
      return absl::UnavailableError(text);
    default:
      if (http_status >= 500 && http_status < 600) return absl::UnavailableError(text);
      return absl::UnknownError(text);
  }
}

}  // namespace

std::string UrlEncode(absl::string_view value) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (absl::ascii_isalnum(u) || c == '-' || c == '.' || c == '_' || c == '~') {
      out.push_back(c);
    } else {
      out.push_back('%');
      out.push_back(kHex[u >> 4]);
      out.push_back(kHex[u & 15]);
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<KubeClient>> KubeClient::Create(KubeApiConfig config, KubeClientOptions options) {
  absl::Status valid = ValidateKubeApiConfig(config);
  if (!valid.ok()) return valid;
  if (options.max_body_bytes == 0) return absl::InvalidArgumentError("max_body_bytes must be > 0");
  if (options.connect_timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("connect_timeout must be > 0");
  InitCurlOnce();
  const curl_version_info_data* version = curl_version_info(CURLVERSION_NOW);
  if (version == nullptr || (version->features & CURL_VERSION_SSL) == 0) {
    if (absl::StartsWithIgnoreCase(config.server, "https://")) {
      return absl::InternalError("libcurl was built without TLS support");
    }
  }
  return std::unique_ptr<KubeClient>(new KubeClientImpl(std::move(config), std::move(options)));
}

}  // namespace eldr::discovery
