#include "fuzz/fuzz_targets.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/signature.h"
#include "eldr/http/http_server.h"
#include "eldr/loadsignals/prom_text.h"
#include "eldr/trace/trace.h"
#ifdef ELDR_FUZZ_HAVE_PROXY
#include "eldr/http/sse.h"
#include "eldr/proxy/openai_protocol.h"
#include "eldr/proxy/stream_accounting.h"
#include "nlohmann/json.hpp"
#endif
#ifdef ELDR_FUZZ_HAVE_SERVER_CONFIG
#include "eldr/v1/router.pb.h"
#include "server/config.h"
#include "server/service.h"
#endif

namespace eldr::fuzz {
namespace {

// A broken invariant: report it and abort, which libFuzzer (and the replay test) treat as a crash.
#define ELDR_FUZZ_CHECK(condition, message)                                                                       \
  do {                                                                                                            \
    if (!(condition)) {                                                                                           \
      std::fprintf(stderr, "fuzz invariant failed at %s:%d: %s (%s)\n", __FILE__, __LINE__, #condition, message); \
      std::abort();                                                                                               \
    }                                                                                                             \
  } while (0)

// Consumes the fuzzer's bytes front to back; past the end it yields zeros.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t Byte() { return offset_ < size_ ? data_[offset_++] : 0; }
  float Float() {
    uint32_t bits = 0;
    for (int i = 0; i < 4; ++i) bits |= static_cast<uint32_t>(Byte()) << (8 * i);
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  absl::string_view Rest() const {
    return absl::string_view(reinterpret_cast<const char*>(data_) + std::min(offset_, size_),
                             size_ - std::min(offset_, size_));
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t offset_ = 0;
};

template <typename T>
std::vector<T> Reinterpret(absl::string_view bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

// What a successful SignatureTransform::Apply promises: finite values of unit norm.
void CheckAppliedSignature(const std::vector<float>& out) {
  double norm = 0;
  for (float v : out) {
    ELDR_FUZZ_CHECK(std::isfinite(v), "Apply produced a non-finite value");
    norm += static_cast<double>(v) * v;
  }
  ELDR_FUZZ_CHECK(std::fabs(std::sqrt(norm) - 1.0) < 1e-3, "Apply's output is not unit norm");
}

bool SameDouble(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

bool SameSample(const PromSample& a, const PromSample& b) {
  return a.name == b.name && a.labels == b.labels && SameDouble(a.value, b.value) && a.timestamp_ms == b.timestamp_ms;
}

bool IsHttpToken(absl::string_view text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && !absl::StrContains("!#$%&'*+-.^_`|~", c)) return false;
  }
  return true;
}

bool IsFramingHeader(absl::string_view name) {
  return absl::EqualsIgnoreCase(name, "Content-Length") || absl::EqualsIgnoreCase(name, "Transfer-Encoding");
}

// A refusal: INVALID_ARGUMENT or RESOURCE_EXHAUSTED with a short fixed reason (letters, digits,
// spaces and '-' only, which an echo of arbitrary input would hardly keep to).
void CheckHttpRefusal(const absl::Status& status) {
  ELDR_FUZZ_CHECK(
      status.code() == absl::StatusCode::kInvalidArgument || status.code() == absl::StatusCode::kResourceExhausted,
      "a refusal with an unexpected code");
  ELDR_FUZZ_CHECK(!status.message().empty() && status.message().size() <= 64, "a refusal reason of odd length");
  for (char c : status.message()) {
    ELDR_FUZZ_CHECK(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == ' ' || c == '-',
                    "a refusal reason with unexpected characters");
  }
}

// What ParseHttpRequest promises of a request it accepts under `limits`.
void CheckHttpRequest(const http::HttpRequest& request, const http::HttpServerOptions& limits) {
  ELDR_FUZZ_CHECK(IsHttpToken(request.method), "the method is not a token");
  ELDR_FUZZ_CHECK(request.version == 10 || request.version == 11, "a version other than 1.0/1.1");
  if (request.target == "*") {
    ELDR_FUZZ_CHECK(request.method == "OPTIONS" && request.path == "*" && request.query.empty(),
                    "an asterisk target without OPTIONS");
  } else {
    ELDR_FUZZ_CHECK(!request.target.empty() && request.target[0] == '/', "a target that is not origin-form");
    for (char c : request.target) {
      const auto byte = static_cast<unsigned char>(c);
      ELDR_FUZZ_CHECK(byte > 0x20 && byte < 0x7f && c != '#', "a target with a forbidden byte");
    }
    const size_t question = request.target.find('?');
    ELDR_FUZZ_CHECK(request.path == request.target.substr(0, question), "path is not the target up to '?'");
    ELDR_FUZZ_CHECK(request.query == (question == std::string::npos ? "" : request.target.substr(question + 1)),
                    "query is not the target after '?'");
  }
  int hosts = 0;
  for (const auto& [name, value] : request.headers) {
    ELDR_FUZZ_CHECK(IsHttpToken(name), "a header name that is not a token");
    for (char c : value) {
      ELDR_FUZZ_CHECK(c != '\r' && c != '\n' && c != '\0', "a header value with CR, LF or NUL");
    }
    ELDR_FUZZ_CHECK(
        value.empty() || (value.front() != ' ' && value.front() != '\t' && value.back() != ' ' && value.back() != '\t'),
        "a header value with surrounding whitespace");
    if (absl::EqualsIgnoreCase(name, "Host")) ++hosts;
    const std::optional<absl::string_view> found = request.Header(absl::AsciiStrToUpper(name));
    ELDR_FUZZ_CHECK(found.has_value(), "Header() misses a header");
  }
  ELDR_FUZZ_CHECK(hosts <= 1 && (request.version == 10 || hosts == 1), "the Host rule was not enforced");
  ELDR_FUZZ_CHECK(request.body.size() <= limits.max_body_bytes, "a body over the limit");
  ELDR_FUZZ_CHECK(request.peer.empty(), "a peer without a connection");
}

// The request in canonical wire form: its head fields but the framing ones, then Content-Length.
std::string SerializeHttpRequest(const http::HttpRequest& request) {
  std::string wire = absl::StrCat(request.method, " ", request.target, " HTTP/1.", request.version % 10, "\r\n");
  for (const auto& [name, value] : request.headers) {
    if (!IsFramingHeader(name)) absl::StrAppend(&wire, name, ": ", value, "\r\n");
  }
  if (!request.body.empty()) absl::StrAppend(&wire, "Content-Length: ", request.body.size(), "\r\n");
  absl::StrAppend(&wire, "\r\n", request.body);
  return wire;
}

bool SameHttpRequest(const http::HttpRequest& a, const http::HttpRequest& b, bool ignore_framing) {
  if (a.method != b.method || a.target != b.target || a.path != b.path || a.query != b.query ||
      a.version != b.version || a.body != b.body) {
    return false;
  }
  if (!ignore_framing) return a.headers == b.headers;
  std::vector<std::pair<std::string, std::string>> a_headers, b_headers;
  for (const auto& header : a.headers) {
    if (!IsFramingHeader(header.first)) a_headers.push_back(header);
  }
  for (const auto& header : b.headers) {
    if (!IsFramingHeader(header.first)) b_headers.push_back(header);
  }
  return a_headers == b_headers;
}

}  // namespace

int FuzzSignature(const uint8_t* data, size_t size) {
  ByteReader in(data, size);
  SignatureSpec spec;
  spec.layers = 1 + in.Byte() % 8;
  spec.experts = 1 + in.Byte() % 16;
  spec.variant = static_cast<SignatureVariant>(in.Byte() % 3);
  const uint8_t mask_bits = in.Byte();
  for (int layer = 0; layer < spec.layers; ++layer) {
    if (mask_bits & (1u << layer)) spec.layer_mask.push_back(layer);
  }
  if (spec.variant == SignatureVariant::kCountIdf) {
    // Mostly sane weights (small non-negative), sometimes raw bit patterns (NaN, negative, huge).
    const bool raw = in.Byte() % 4 == 0;
    for (int i = 0; i < spec.dim(); ++i) spec.idf.push_back(raw ? in.Float() : in.Byte() / 16.0f);
  }
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(spec);
  if (!transform.ok()) return 0;

  const uint8_t encoding = in.Byte() % 4;
  // The claimed geometry usually matches the spec; otherwise it is anything, including absurd.
  int layers = spec.layers, experts = spec.experts;
  if (in.Byte() % 4 == 0) {
    layers = static_cast<int8_t>(in.Byte()) * 257;
    experts = static_cast<int8_t>(in.Byte()) * 263;
  }
  const absl::string_view payload = in.Rest();
  const std::vector<int32_t> ints = Reinterpret<int32_t>(payload);
  const std::vector<float> floats = Reinterpret<float>(payload);
  SignatureInput input;
  switch (encoding) {
    case 0:
      input = CountsInt16Le{layers, experts, payload};
      break;
    case 1:
      input = CountsInt32{layers, experts, ints};
      break;
    case 2:
      input = GateProbSums{layers, experts, floats};
      break;
    default:
      input = TransformedVector{floats};
      break;
  }
  std::vector<float> out(static_cast<size_t>(transform->dim()), -1.0f);
  const absl::Status applied = transform->Apply(input, absl::MakeSpan(out));
  if (applied.ok()) CheckAppliedSignature(out);
  std::vector<float> weighted(static_cast<size_t>(transform->dim()));
  const absl::Status weighed = transform->Weighted(input, absl::MakeSpan(weighted));
  if (weighed.ok() && encoding != 3) {
    // Counts and gate sums are non-negative, and so are the weights. Weighted promises no
    // normalisation, so a huge weight times a huge count may overflow to +Inf; NaN or a negative
    // component would be a bug. (A transformed vector is the caller's and may have any sign.)
    for (float v : weighted) ELDR_FUZZ_CHECK(!std::isnan(v) && v >= 0, "Weighted produced a bad weight");
  }
  return 0;
}

int FuzzCentroidArtifact(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<CentroidArtifact> artifact = ParseCentroidArtifact(text);
  if (!artifact.ok()) return 0;
  ELDR_FUZZ_CHECK(ValidateCentroidArtifact(*artifact).ok(), "a parsed artifact does not validate");
  const std::string serialized = SerializeCentroidArtifact(*artifact);
  absl::StatusOr<CentroidArtifact> again = ParseCentroidArtifact(serialized);
  ELDR_FUZZ_CHECK(again.ok(), "a serialized artifact does not parse back");
  ELDR_FUZZ_CHECK(again->k == artifact->k && again->spec.layers == artifact->spec.layers &&
                      again->spec.experts == artifact->spec.experts && again->spec.variant == artifact->spec.variant &&
                      again->spec.EffectiveMask() == artifact->spec.EffectiveMask() &&
                      again->workers == artifact->workers && again->model == artifact->model &&
                      again->seed == artifact->seed,
                  "round trip changed the artifact's header");
  ELDR_FUZZ_CHECK(
      again->centroids.size() == artifact->centroids.size() && again->spec.idf.size() == artifact->spec.idf.size(),
      "round trip changed the artifact's sizes");
  for (size_t i = 0; i < artifact->centroids.size(); ++i) {
    ELDR_FUZZ_CHECK(again->centroids[i] == artifact->centroids[i], "round trip changed a centroid value");
  }
  for (size_t i = 0; i < artifact->spec.idf.size(); ++i) {
    ELDR_FUZZ_CHECK(again->spec.idf[i] == artifact->spec.idf[i], "round trip changed an IDF weight");
  }
  return 0;
}

int FuzzPromText(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<PromPage> full = ParsePromText(text);
  PromParseOptions filtered_options;
  filtered_options.keep_metrics = EngineLoadMetricNames(EngineKind::kAuto);
  absl::StatusOr<PromPage> filtered = ParsePromText(text, filtered_options);
  // Keeping fewer samples must not change whether (or where) the page is malformed.
  ELDR_FUZZ_CHECK(full.ok() == filtered.ok(), "the kept-metrics filter changed the parse verdict");
  if (!full.ok()) {
    ELDR_FUZZ_CHECK(full.status() == filtered.status(), "the kept-metrics filter changed the error");
    return 0;
  }
  size_t kept = 0;
  for (const PromSample& sample : full->samples) {
    if (!filtered_options.keep_metrics.contains(sample.name)) continue;
    ELDR_FUZZ_CHECK(kept < filtered->samples.size() && SameSample(sample, filtered->samples[kept]),
                    "the kept-metrics filter changed a kept sample");
    ++kept;
  }
  ELDR_FUZZ_CHECK(kept == filtered->samples.size(), "the kept-metrics filter kept other samples");

  for (const std::string& model : {std::string(), std::string("m")}) {
    EngineLoadOptions options;
    options.model_name = model;
    absl::StatusOr<EngineLoad> load = EngineLoadFromPage(*full, options);
    absl::StatusOr<EngineLoad> load_filtered = EngineLoadFromPage(*filtered, options);
    ELDR_FUZZ_CHECK(load.ok() == load_filtered.ok(), "engine load differs with the filter");
    if (!load.ok()) continue;
    ELDR_FUZZ_CHECK(std::isfinite(load->running) && load->running >= 0, "running is not a load");
    ELDR_FUZZ_CHECK(std::isfinite(load->waiting) && load->waiting >= 0, "waiting is not a load");
    ELDR_FUZZ_CHECK(!load->kv_usage.has_value() || (*load->kv_usage >= 0 && *load->kv_usage <= 1),
                    "kv usage outside [0, 1]");
    ELDR_FUZZ_CHECK(load->series >= 1, "a load without a series");
  }
  return 0;
}

int FuzzNpy(const uint8_t* data, size_t size) {
  absl::StatusOr<NpyArray> array = ParseNpy(absl::Span<const uint8_t>(data, size), "fuzz.npy");
  if (!array.ok()) return 0;
  // The item size is the number at the end of the descr ("<i8" -> 8, "|u1" -> 1).
  size_t digits = array->dtype.size();
  while (digits > 0 && array->dtype[digits - 1] >= '0' && array->dtype[digits - 1] <= '9') --digits;
  ELDR_FUZZ_CHECK(digits < array->dtype.size(), "accepted a dtype without an item size");
  const int64_t item_size = std::atoll(array->dtype.c_str() + digits);
  for (int64_t dimension : array->shape) ELDR_FUZZ_CHECK(dimension >= 0, "negative dimension");
  ELDR_FUZZ_CHECK(static_cast<int64_t>(array->data.size()) == array->elements() * item_size,
                  "data size does not match shape x item size");
  return 0;
}

#ifdef ELDR_FUZZ_HAVE_SERVER_CONFIG
int FuzzWorkerFile(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::vector<WorkerSpec>> workers = server::ParseWorkerJson(text);
  if (!workers.ok()) return 0;
  for (size_t i = 0; i < workers->size(); ++i) {
    ELDR_FUZZ_CHECK(ValidateWorkerSpec((*workers)[i]).ok(), "an accepted worker does not validate");
    for (size_t j = 0; j < i; ++j) {
      ELDR_FUZZ_CHECK((*workers)[i].id != (*workers)[j].id, "accepted duplicate worker ids");
    }
  }
  return 0;
}

int FuzzConfig(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  server::ServerOptions options;
  if (server::ApplyConfigJson(text, &options).ok()) {
    (void)server::ValidateServerOptions(options);
    (void)server::ServerOptionsToJson(options);
  }
  // The same bytes as one flag: `key=value`.
  const size_t equals = text.find('=');
  if (equals != absl::string_view::npos) {
    server::ServerOptions flag_options;
    if (server::SetServerOption(text.substr(0, equals), text.substr(equals + 1), &flag_options).ok()) {
      (void)server::ValidateServerOptions(flag_options);
    }
  }
  return 0;
}
#endif

#ifdef ELDR_FUZZ_HAVE_SERVER_CONFIG
int FuzzRouteRequest(const uint8_t* data, size_t size) {
  // The daemon's path for a Route message: protobuf decoding, then SignatureFromProto, then the
  // transform of the centroid set in service (a fixed 4 x 8 count_idf spec here). A message
  // claiming another geometry must be refused by one of them, never read out of bounds.
  static const SignatureTransform* const transform = [] {
    SignatureSpec spec;
    spec.layers = 4;
    spec.experts = 8;
    spec.variant = SignatureVariant::kCountIdf;
    for (int i = 0; i < spec.dim(); ++i) spec.idf.push_back(0.25f * static_cast<float>(i % 5));
    absl::StatusOr<SignatureTransform> created = SignatureTransform::Create(spec);
    ELDR_FUZZ_CHECK(created.ok(), "the fixed spec does not validate");
    return new SignatureTransform(*std::move(created));
  }();
  eldr::v1::RouteRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  SignatureInput input;
  bool present = false;
  std::vector<float> gate_prob_scratch;
  const absl::Status converted = server::SignatureFromProto(request, &input, &present, &gate_prob_scratch);
  if (!converted.ok()) {
    ELDR_FUZZ_CHECK(converted.code() == absl::StatusCode::kInvalidArgument,
                    "a refused signature is not INVALID_ARGUMENT");
    return 0;
  }
  if (!present) return 0;
  std::vector<float> out(static_cast<size_t>(transform->dim()));
  const absl::Status applied = transform->Apply(input, absl::MakeSpan(out));
  if (applied.ok()) CheckAppliedSignature(out);
  return 0;
}
#endif

int FuzzHttpRequest(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  const http::HttpServerOptions defaults;
  http::HttpServerOptions tight;
  tight.max_header_bytes = 128;
  tight.max_body_bytes = 16;
  const absl::StatusOr<http::HttpRequest> parsed = http::ParseHttpRequest(bytes, defaults);
  const absl::StatusOr<http::HttpRequest> again = http::ParseHttpRequest(bytes, defaults);
  const absl::StatusOr<http::HttpRequest> tight_parsed = http::ParseHttpRequest(bytes, tight);
  ELDR_FUZZ_CHECK(parsed.ok() == again.ok() &&
                      (parsed.ok() ? SameHttpRequest(*parsed, *again, false) : parsed.status() == again.status()),
                  "the parse is not deterministic");
  if (!parsed.ok()) {
    CheckHttpRefusal(parsed.status());
    ELDR_FUZZ_CHECK(!tight_parsed.ok(), "tighter limits accepted what the defaults refused");
    CheckHttpRefusal(tight_parsed.status());
    return 0;
  }
  CheckHttpRequest(*parsed, defaults);
  if (tight_parsed.ok()) {
    CheckHttpRequest(*tight_parsed, tight);
    ELDR_FUZZ_CHECK(SameHttpRequest(*parsed, *tight_parsed, false), "the limits changed an accepted request");
  } else {
    ELDR_FUZZ_CHECK(tight_parsed.status().code() == absl::StatusCode::kResourceExhausted,
                    "tighter limits refused an accepted request for another reason than size");
  }
  // Canonical framing may make the head a little longer: parse it back with room for that.
  http::HttpServerOptions roomy = defaults;
  roomy.max_header_bytes = 60 * 1024;
  const absl::StatusOr<http::HttpRequest> reparsed = http::ParseHttpRequest(SerializeHttpRequest(*parsed), roomy);
  ELDR_FUZZ_CHECK(reparsed.ok(), "a re-serialised request does not parse");
  ELDR_FUZZ_CHECK(SameHttpRequest(*parsed, *reparsed, true), "a re-serialised request parses differently");
  return 0;
}

#ifdef ELDR_FUZZ_HAVE_PROXY
int FuzzOpenAiRequest(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const proxy::Endpoint endpoint = (data[0] & 1) ? proxy::Endpoint::kChatCompletions : proxy::Endpoint::kCompletions;
  const absl::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  constexpr size_t kLimit = 1 << 16;
  const absl::StatusOr<proxy::ClientRequest> parsed = proxy::ParseClientRequest(endpoint, body, kLimit);
  if (!parsed.ok()) {
    const absl::StatusCode code = parsed.status().code();
    ELDR_FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kResourceExhausted,
                    "a refused client body must be INVALID_ARGUMENT or RESOURCE_EXHAUSTED");
    ELDR_FUZZ_CHECK(!parsed.status().message().empty(), "a refusal must say why");
    return 0;
  }
  ELDR_FUZZ_CHECK(body.size() <= kLimit, "a body over the limit was accepted");
  ELDR_FUZZ_CHECK(!parsed->max_tokens.has_value() || *parsed->max_tokens >= 1, "max_tokens below 1 was accepted");

  const absl::StatusOr<nlohmann::json> prefill = proxy::ParseJson(proxy::MakePrefillBody(*parsed));
  ELDR_FUZZ_CHECK(prefill.ok() && prefill->is_object(), "the prefill body is not a JSON object");
  ELDR_FUZZ_CHECK(prefill->value("max_tokens", nlohmann::json()) == 1, "the prefill body must ask for one token");
  ELDR_FUZZ_CHECK(prefill->value("stream", nlohmann::json()) == false, "the prefill body must not stream");
  ELDR_FUZZ_CHECK(!prefill->contains("stream_options"), "the prefill body must drop stream_options");
  const nlohmann::json& prefill_kv = (*prefill)["kv_transfer_params"];
  ELDR_FUZZ_CHECK(prefill_kv.is_object() && prefill_kv.value("do_remote_decode", false) == true,
                  "the prefill body must set do_remote_decode");

  const nlohmann::json kv = {{"do_remote_prefill", true},
                             {"remote_engine_id", "e"},
                             {"remote_block_ids", {1, 2}},
                             {"remote_host", "10.0.0.1"},
                             {"remote_port", 5600}};
  const std::string decode_body = proxy::MakeDecodeBody(*parsed, kv);
  const absl::StatusOr<nlohmann::json> decode = proxy::ParseJson(decode_body);
  ELDR_FUZZ_CHECK(decode.ok() && decode->is_object(), "the decode body is not a JSON object");
  ELDR_FUZZ_CHECK((*decode)["kv_transfer_params"] == kv, "the decode body must carry the prefill's kv_transfer_params");
  // The decode body is the client's body but for kv_transfer_params, so the same rules accept it
  // (its size may grow by the parameters and by canonical JSON escapes).
  const absl::StatusOr<proxy::ClientRequest> again = proxy::ParseClientRequest(endpoint, decode_body, 1 << 22);
  ELDR_FUZZ_CHECK(again.ok(), "the decode body breaks the client request rules");
  ELDR_FUZZ_CHECK(again->stream == parsed->stream && again->include_usage == parsed->include_usage &&
                      again->max_tokens == parsed->max_tokens && again->model == parsed->model &&
                      again->prompt_key == parsed->prompt_key,
                  "the decode body reads as another request");
  return 0;
}

int FuzzPrefillResponse(const uint8_t* data, size_t size) {
  const absl::string_view body(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<proxy::PrefillResult> parsed = proxy::ParsePrefillResponse(body);
  if (!parsed.ok()) {
    const absl::StatusCode code = parsed.status().code();
    ELDR_FUZZ_CHECK(code == absl::StatusCode::kInternal || code == absl::StatusCode::kFailedPrecondition,
                    "a refused prefill answer must be INTERNAL (not a JSON object) or FAILED_PRECONDITION");
    ELDR_FUZZ_CHECK(!parsed.status().message().empty(), "a refusal must say why");
    return 0;
  }
  ELDR_FUZZ_CHECK(parsed->kv_transfer_params.is_object(), "kv_transfer_params must be an object");
  ELDR_FUZZ_CHECK(
      !parsed->kv_transfer_params.contains("eldr_expert_counts") && !parsed->kv_transfer_params.contains("eldr_sig"),
      "the signature keys must not be forwarded to the decode engine");
  ELDR_FUZZ_CHECK(parsed->prompt_tokens >= 0, "prompt_tokens is negative");
  if (!parsed->signature.has_value()) return 0;
  const proxy::Signature& signature = *parsed->signature;
  ELDR_FUZZ_CHECK(!signature.int16_le.empty() && signature.int16_le.size() % 2 == 0,
                  "a signature must be whole int16 values");
  ELDR_FUZZ_CHECK(signature.source == "eldr_expert_counts" || signature.source == "eldr_sig", "unknown source");
  if (signature.source == "eldr_expert_counts") {
    ELDR_FUZZ_CHECK(signature.layers >= 1 && signature.experts >= 1 &&
                        signature.int16_le.size() ==
                            2 * static_cast<size_t>(signature.layers) * static_cast<size_t>(signature.experts),
                    "eldr_expert_counts must hold layers x experts values");
  } else {
    ELDR_FUZZ_CHECK(signature.layers == 0 && signature.experts == 0, "eldr_sig has no geometry");
  }
  for (size_t i = 0; i + 1 < signature.int16_le.size(); i += 2) {
    const auto high = static_cast<uint8_t>(signature.int16_le[i + 1]);
    ELDR_FUZZ_CHECK(high < 0x80, "a negative count was taken");
  }
  return 0;
}

int FuzzSseStream(const uint8_t* data, size_t size) {
  ByteReader reader(data, size);
  const size_t max_event_bytes = 64 + reader.Byte() * 16;
  const absl::string_view stream(reinterpret_cast<const char*>(data), size);

  std::vector<http::SseEvent> whole;
  http::SseParser whole_parser(max_event_bytes);
  const absl::Status whole_status =
      whole_parser.Feed(stream, [&whole](const http::SseEvent& event) { whole.push_back(event); });

  std::vector<http::SseEvent> pieces;
  http::SseParser piece_parser(max_event_bytes);
  absl::Status piece_status;
  for (size_t at = 0, draw = 0; at < stream.size() && piece_status.ok(); ++draw) {
    const size_t length = std::min<size_t>(stream.size() - at, 1 + data[draw % size] % 37);
    piece_status = piece_parser.Feed(stream.substr(at, length),
                                     [&pieces](const http::SseEvent& event) { pieces.push_back(event); });
    at += length;
  }
  ELDR_FUZZ_CHECK(whole_status.ok() == piece_status.ok(), "splitting the stream changed whether it fails");
  if (!whole_status.ok()) {
    ELDR_FUZZ_CHECK(whole_status.code() == absl::StatusCode::kResourceExhausted, "an SSE failure is a size limit");
    return 0;
  }
  ELDR_FUZZ_CHECK(whole.size() == pieces.size(), "splitting the stream changed the number of events");
  proxy::DecodeStreamObserver observer;
  for (size_t i = 0; i < whole.size(); ++i) {
    ELDR_FUZZ_CHECK(whole[i].event == pieces[i].event && whole[i].data == pieces[i].data &&
                        whole[i].id == pieces[i].id && whole[i].retry_ms == pieces[i].retry_ms,
                    "splitting the stream changed an event");
    ELDR_FUZZ_CHECK(whole[i].data.size() <= max_event_bytes, "an event over the limit was dispatched");
    observer.OnEvent(whole[i]);
  }
  ELDR_FUZZ_CHECK(observer.events() == static_cast<int64_t>(whole.size()), "every event is observed");
  ELDR_FUZZ_CHECK(observer.token_events() + observer.malformed_events() <= observer.events(),
                  "more token or malformed events than events");
  ELDR_FUZZ_CHECK(observer.output_tokens() >= 0, "negative output tokens");
  return 0;
}
#endif

const std::vector<FuzzTarget>& AllFuzzTargets() {
  static const auto* targets = new std::vector<FuzzTarget>{
      {"signature", &FuzzSignature},          {"centroid_artifact", &FuzzCentroidArtifact},
      {"prom_text", &FuzzPromText},           {"npy", &FuzzNpy},
      {"http_request", &FuzzHttpRequest},
#ifdef ELDR_FUZZ_HAVE_SERVER_CONFIG
      {"worker_file", &FuzzWorkerFile},       {"config", &FuzzConfig},
      {"route_request", &FuzzRouteRequest},
#endif
#ifdef ELDR_FUZZ_HAVE_PROXY
      {"openai_request", &FuzzOpenAiRequest}, {"prefill_response", &FuzzPrefillResponse},
      {"sse_stream", &FuzzSseStream},
#endif
  };
  return *targets;
}

}  // namespace eldr::fuzz
