#include "fuzz/fuzz_targets.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/loadsignals/prom_text.h"
#include "eldr/core/signature.h"
#include "eldr/trace/trace.h"
#ifdef ELDR_FUZZ_HAVE_SERVER_CONFIG
#include "eldr/v1/router.pb.h"
#include "server/config.h"
#include "server/service.h"
#endif

namespace eldr::fuzz {
namespace {

// A broken invariant: report it and abort, which libFuzzer (and the replay test) treat as a crash.
#define ELDR_FUZZ_CHECK(condition, message)                                                  \
  do {                                                                                       \
    if (!(condition)) {                                                                      \
      std::fprintf(stderr, "fuzz invariant failed at %s:%d: %s (%s)\n", __FILE__, __LINE__, \
                   #condition, message);                                                     \
      std::abort();                                                                          \
    }                                                                                        \
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
  return a.name == b.name && a.labels == b.labels && SameDouble(a.value, b.value) &&
         a.timestamp_ms == b.timestamp_ms;
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
    case 0: input = CountsInt16Le{layers, experts, payload}; break;
    case 1: input = CountsInt32{layers, experts, ints}; break;
    case 2: input = GateProbSums{layers, experts, floats}; break;
    default: input = TransformedVector{floats}; break;
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
                      again->spec.experts == artifact->spec.experts &&
                      again->spec.variant == artifact->spec.variant &&
                      again->spec.EffectiveMask() == artifact->spec.EffectiveMask() &&
                      again->workers == artifact->workers && again->model == artifact->model &&
                      again->seed == artifact->seed,
                  "round trip changed the artifact's header");
  ELDR_FUZZ_CHECK(again->centroids.size() == artifact->centroids.size() &&
                      again->spec.idf.size() == artifact->spec.idf.size(),
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
    ELDR_FUZZ_CHECK(server::ValidateWorkerSpec((*workers)[i]).ok(), "an accepted worker does not validate");
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
  const absl::Status converted = server::SignatureFromProto(request, &input, &present);
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

const std::vector<FuzzTarget>& AllFuzzTargets() {
  static const auto* targets = new std::vector<FuzzTarget>{
      {"signature", &FuzzSignature},
      {"centroid_artifact", &FuzzCentroidArtifact},
      {"prom_text", &FuzzPromText},
      {"npy", &FuzzNpy},
#ifdef ELDR_FUZZ_HAVE_SERVER_CONFIG
      {"worker_file", &FuzzWorkerFile},
      {"config", &FuzzConfig},
      {"route_request", &FuzzRouteRequest},
#endif
  };
  return *targets;
}

}  // namespace eldr::fuzz
