#include "eldr/proxy/openai_protocol.h"

#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace eldr::proxy {
namespace {

using Json = nlohmann::json;

constexpr int64_t kMaxSignatureDimension = 65536;
constexpr int64_t kMaxSignatureCounts = int64_t{1} << 24;

// The value of a JSON integer that fits int64_t, or of a float with an integral value in that
// range (1.0: pydantic's lax mode, hence vLLM, accepts it for an int field); nullopt otherwise.
std::optional<int64_t> IntegerValue(const Json& value) {
  if (value.is_number_unsigned()) {
    if (value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(value.get<uint64_t>());
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double d = value.get<double>();
    if (std::isfinite(d) && d == std::trunc(d) && d >= -0x1.0p63 && d < 0x1.0p63) return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

std::optional<int64_t> NonNegativeInt64(const Json& value) {
  const std::optional<int64_t> integer = IntegerValue(value);
  if (integer.has_value() && *integer >= 0) return integer;
  return std::nullopt;
}

// A field that is absent or JSON null.
bool Absent(const Json& object, absl::string_view key) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null();
}

absl::Status FieldError(absl::string_view field, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", rule));
}

// A short description of a JSON value's type for error messages ("a string", "an array", ...).
std::string Describe(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return value.get<bool>() ? "true" : "false";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return value.dump();
    case Json::value_t::number_float:
      return absl::StrCat("a non-integer number (", value.dump(), ")");
    default:
      return "another JSON type";
  }
}

// A positive integer field (max_tokens, max_completion_tokens); nullopt when absent or null.
absl::StatusOr<std::optional<int64_t>> PositiveIntegerField(const Json& body, absl::string_view key) {
  if (Absent(body, key)) return std::optional<int64_t>();
  const Json& value = body.at(std::string(key));
  const std::optional<int64_t> number = NonNegativeInt64(value);
  if (number.has_value() && *number >= 1) return number;
  if (value.is_number() && value.get<double>() >= 0x1.0p63) return FieldError(key, "is too large");
  return FieldError(key, absl::StrCat("must be an integer >= 1, got ", Describe(value)));
}

// `n` / `best_of`: absent, null or 1.
absl::Status SingleChoiceField(const Json& body, absl::string_view key) {
  if (Absent(body, key)) return absl::OkStatus();
  const Json& value = body.at(std::string(key));
  if (IntegerValue(value) == 1) return absl::OkStatus();
  return FieldError(
      key, absl::StrCat("must be 1 (the prefill/decode proxy serves one choice per request), got ", Describe(value)));
}

bool IsTokenId(const Json& value) { return NonNegativeInt64(value).has_value(); }

// A token-id array: non-empty, integers >= 0; appends the decimal ids joined by ',' to `key`.
absl::Status TokenIds(const Json& array, absl::string_view field, std::string* key) {
  if (array.empty()) return FieldError(field, "must not be empty");
  for (size_t i = 0; i < array.size(); ++i) {
    if (!IsTokenId(array[i])) {
      return FieldError(absl::StrCat(field, "[", i, "]"),
                        absl::StrCat("must be a token id (an integer >= 0), got ", Describe(array[i])));
    }
    if (i > 0) key->push_back(',');
    absl::StrAppend(key, *IntegerValue(array[i]));
  }
  return absl::OkStatus();
}

constexpr absl::string_view kPromptRule =
    "must be a non-empty string, a non-empty array of token ids, or an array holding exactly one of those";

absl::Status ParsePrompt(const Json& body, std::string* key) {
  const auto it = body.find("prompt");
  if (it == body.end()) return absl::InvalidArgumentError("prompt is required");
  const Json& prompt = *it;
  if (prompt.is_string()) {
    if (prompt.get_ref<const std::string&>().empty()) return FieldError("prompt", "must not be empty");
    *key = prompt.get<std::string>();
    return absl::OkStatus();
  }
  if (!prompt.is_array()) return FieldError("prompt", absl::StrCat(kPromptRule, ", got ", Describe(prompt)));
  if (prompt.empty()) return FieldError("prompt", "must not be empty");
  if (IsTokenId(prompt[0]) || !(prompt[0].is_string() || prompt[0].is_array())) {
    return TokenIds(prompt, "prompt", key);
  }
  // An array of prompts: only one is served.
  if (prompt.size() != 1) {
    return FieldError("prompt", absl::StrFormat("holds %d prompts; the prefill/decode proxy serves one prompt per "
                                                "request (send them as separate requests)",
                                                prompt.size()));
  }
  const Json& only = prompt[0];
  if (only.is_string()) {
    if (only.get_ref<const std::string&>().empty()) return FieldError("prompt[0]", "must not be empty");
    *key = only.get<std::string>();
    return absl::OkStatus();
  }
  return TokenIds(only, "prompt[0]", key);
}

absl::Status ParseMessages(const Json& body, std::string* key) {
  const auto it = body.find("messages");
  if (it == body.end()) return absl::InvalidArgumentError("messages is required");
  const Json& messages = *it;
  if (!messages.is_array()) {
    return FieldError("messages", absl::StrCat("must be an array of message objects, got ", Describe(messages)));
  }
  if (messages.empty()) return FieldError("messages", "must not be empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const Json& message = messages[i];
    const std::string field = absl::StrCat("messages[", i, "]");
    if (!message.is_object()) return FieldError(field, absl::StrCat("must be an object, got ", Describe(message)));
    const auto role = message.find("role");
    if (role == message.end()) return absl::InvalidArgumentError(absl::StrCat(field, ".role is required"));
    if (!role->is_string()) {
      return FieldError(absl::StrCat(field, ".role"), absl::StrCat("must be a string, got ", Describe(*role)));
    }
    absl::StrAppend(key, role->get_ref<const std::string&>(), "\n");
    const auto content = message.find("content");
    if (content == message.end() || content->is_null()) {
      if (role->get_ref<const std::string&>() == "assistant") {
        key->push_back('\n');
        continue;
      }
      return absl::InvalidArgumentError(absl::StrCat(field,
                                                     ".content is required (only an assistant message may "
                                                     "omit it)"));
    }
    if (content->is_string()) {
      absl::StrAppend(key, content->get_ref<const std::string&>(), "\n");
      continue;
    }
    if (!content->is_array()) {
      return FieldError(absl::StrCat(field, ".content"),
                        absl::StrCat("must be a string or an array of content parts, got ", Describe(*content)));
    }
    for (size_t p = 0; p < content->size(); ++p) {
      const Json& part = (*content)[p];
      const std::string part_field = absl::StrCat(field, ".content[", p, "]");
      if (!part.is_object()) {
        return FieldError(part_field, absl::StrCat("must be a content part object, got ", Describe(part)));
      }
      const auto type = part.find("type");
      if (type == part.end() || !type->is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(part_field, ".type must be a string"));
      }
      if (type->get_ref<const std::string&>() != "text") continue;
      const auto text = part.find("text");
      if (text == part.end() || !text->is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(part_field, ".text must be a string (a \"text\" part)"));
      }
      absl::StrAppend(key, text->get_ref<const std::string&>());
    }
    key->push_back('\n');
  }
  return absl::OkStatus();
}

// nlohmann's parser is iterative, but its serialiser recurses: the nesting is bounded before
// parsing. Brackets inside strings do not count; the parser rejects whatever else is malformed.
absl::Status CheckJsonDepth(absl::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return absl::InvalidArgumentError(
            absl::StrFormat("arrays and objects are nested more than %d deep (at byte %d)", max_depth, i));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Json> ParseJsonUnchecked(absl::string_view text) {
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    // what() is "[json.exception.parse_error.101] parse error at ...": keep the readable part.
    absl::string_view what = e.what();
    if (const size_t end = what.find("] "); absl::StartsWith(what, "[") && end != absl::string_view::npos) {
      what.remove_prefix(end + 2);
    }
    return absl::InvalidArgumentError(what);
  }
}

// Parses a body: depth first, then syntax, each failure with its own wording after `what`
// ("the request body").
absl::StatusOr<Json> ParseBody(absl::string_view text, absl::string_view what, absl::StatusCode code) {
  if (absl::Status depth = CheckJsonDepth(text, kMaxJsonDepth); !depth.ok()) {
    return absl::Status(code, absl::StrCat(what, " is too deeply nested: ", depth.message()));
  }
  absl::StatusOr<Json> parsed = ParseJsonUnchecked(text);
  if (!parsed.ok()) return absl::Status(code, absl::StrCat(what, " is not valid JSON: ", parsed.status().message()));
  return parsed;
}

std::string Dump(const Json& value) { return value.dump(-1, ' ', false, Json::error_handler_t::replace); }

// A payload of kv_transfer_params holding [layers][experts] values: {"layers", "experts",
// "encoding", "data" (strict base64 of bytes_per_value * layers * experts bytes)}.
struct Payload {
  int32_t layers = 0;
  int32_t experts = 0;
  std::string bytes;
};

// Why the entry `key` is unusable, or its geometry and bytes.
absl::StatusOr<Payload> ReadPayload(const Json& entry, absl::string_view key, absl::string_view encoding_name,
                                    int bytes_per_value, absl::string_view noun, absl::string_view value_name) {
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(key, " must be an object, got ", Describe(entry)));
  }
  int64_t geometry[2] = {0, 0};
  const char* const names[2] = {"layers", "experts"};
  for (int i = 0; i < 2; ++i) {
    const auto it = entry.find(names[i]);
    const std::optional<int64_t> value = it == entry.end() ? std::nullopt : NonNegativeInt64(*it);
    if (!value.has_value() || *value < 1 || *value > kMaxSignatureDimension) {
      return absl::InvalidArgumentError(absl::StrFormat("%s.%s must be an integer in [1, %d], got %s", key, names[i],
                                                        kMaxSignatureDimension,
                                                        it == entry.end() ? std::string("nothing") : Describe(*it)));
    }
    geometry[i] = *value;
  }
  if (geometry[0] * geometry[1] > kMaxSignatureCounts) {
    return absl::InvalidArgumentError(absl::StrFormat("%s has %d x %d %s; at most %d are accepted", key, geometry[0],
                                                      geometry[1], noun, kMaxSignatureCounts));
  }
  const auto encoding = entry.find("encoding");
  if (encoding == entry.end() || !encoding->is_string() || encoding->get_ref<const std::string&>() != encoding_name) {
    return absl::InvalidArgumentError(
        absl::StrCat(key, ".encoding must be \"", encoding_name, "\", got ",
                     encoding == entry.end() ? std::string("nothing")
                     : encoding->is_string() ? absl::StrCat("\"", encoding->get_ref<const std::string&>(), "\"")
                                             : Describe(*encoding)));
  }
  const auto data = entry.find("data");
  if (data == entry.end() || !data->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(key, ".data must be a base64 string"));
  }
  absl::StatusOr<std::string> bytes = Base64DecodeStrict(data->get_ref<const std::string&>());
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(key, ".data: ", bytes.status().message()));
  }
  const int64_t expected = bytes_per_value * geometry[0] * geometry[1];
  if (static_cast<int64_t>(bytes->size()) != expected) {
    return absl::InvalidArgumentError(absl::StrFormat("%s.data holds %d bytes; %d x %d %s need %d", key, bytes->size(),
                                                      geometry[0], geometry[1], value_name, expected));
  }
  Payload payload;
  payload.layers = static_cast<int32_t>(geometry[0]);
  payload.experts = static_cast<int32_t>(geometry[1]);
  payload.bytes = *std::move(bytes);
  return payload;
}

// Why an eldr_expert_counts entry is unusable, or its signature.
absl::StatusOr<Signature> ExpertCountsSignature(const Json& entry) {
  absl::StatusOr<Payload> payload = ReadPayload(entry, "eldr_expert_counts", "int16_le", 2, "counts", "int16 counts");
  if (!payload.ok()) return payload.status();
  Signature signature;
  signature.layers = payload->layers;
  signature.experts = payload->experts;
  signature.int16_le = std::move(payload->bytes);
  signature.source = "eldr_expert_counts";
  return signature;
}

// Why an eldr_gate_prob_sums entry is unusable, or its geometry and float32_le bytes (every value
// finite and >= 0: a corrupt payload is dropped here, as negative counts are).
absl::StatusOr<Payload> GateProbSumsPayload(const Json& entry) {
  absl::StatusOr<Payload> payload =
      ReadPayload(entry, "eldr_gate_prob_sums", "float32_le", 4, "sums", "float32 gate-probability sums");
  if (!payload.ok()) return payload.status();
  const std::string& bytes = payload->bytes;
  for (size_t i = 0; i + 3 < bytes.size(); i += 4) {
    uint32_t bits = 0;
    for (int b = 3; b >= 0; --b) bits = (bits << 8) | static_cast<unsigned char>(bytes[i + b]);
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    if (std::isfinite(value) && value >= 0) continue;
    const size_t index = i / 4;
    return absl::InvalidArgumentError(absl::StrFormat("eldr_gate_prob_sums has a %s sum (%g at layer %d, expert %d)",
                                                      std::isfinite(value) ? "negative" : "non-finite", value,
                                                      index / payload->experts, index % payload->experts));
  }
  return payload;
}

absl::StatusOr<Signature> EldrSigSignature(const Json& entry) {
  if (!entry.is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("eldr_sig must be a base64 string, got ", Describe(entry)));
  }
  absl::StatusOr<std::string> bytes = Base64DecodeStrict(entry.get_ref<const std::string&>());
  if (!bytes.ok()) return absl::InvalidArgumentError(absl::StrCat("eldr_sig: ", bytes.status().message()));
  if (bytes->empty() || bytes->size() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("eldr_sig holds %d bytes; int16 counts need a non-zero, even number of bytes", bytes->size()));
  }
  if (static_cast<int64_t>(bytes->size()) > 2 * kMaxSignatureCounts) {
    return absl::InvalidArgumentError(
        absl::StrFormat("eldr_sig holds %d counts; at most %d are accepted", bytes->size() / 2, kMaxSignatureCounts));
  }
  Signature signature;
  signature.int16_le = *std::move(bytes);
  signature.source = "eldr_sig";
  return signature;
}

// OK when every count is >= 0; else names the first negative one.
absl::Status CheckNonNegative(const Signature& signature) {
  const std::string& bytes = signature.int16_le;
  for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
    const auto low = static_cast<uint16_t>(static_cast<unsigned char>(bytes[i]));
    const auto high = static_cast<uint16_t>(static_cast<unsigned char>(bytes[i + 1]));
    const auto value = static_cast<int16_t>(static_cast<uint16_t>(low | (high << 8)));
    if (value >= 0) continue;
    const size_t index = i / 2;
    if (signature.experts > 0) {
      return absl::InvalidArgumentError(absl::StrFormat("%s has a negative count (%d at layer %d, expert %d)",
                                                        signature.source, value, index / signature.experts,
                                                        index % signature.experts));
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("%s has a negative count (%d at index %d)", signature.source, value, index));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view EndpointPath(Endpoint endpoint) {
  return endpoint == Endpoint::kChatCompletions ? "/v1/chat/completions" : "/v1/completions";
}

absl::StatusOr<ClientRequest> ParseClientRequest(Endpoint endpoint, absl::string_view body, size_t max_body_bytes) {
  if (body.size() > max_body_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("the request body is %d bytes; at most %d are accepted", body.size(), max_body_bytes));
  }
  absl::StatusOr<Json> parsed = ParseBody(body, "the request body", absl::StatusCode::kInvalidArgument);
  if (!parsed.ok()) return parsed.status();
  if (!parsed->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("the request body must be a JSON object, got ", Describe(*parsed)));
  }
  ClientRequest request;
  request.endpoint = endpoint;
  request.body = *std::move(parsed);
  const Json& json = request.body;

  if (!Absent(json, "model")) {
    const Json& model = json.at("model");
    if (!model.is_string()) return FieldError("model", absl::StrCat("must be a string, got ", Describe(model)));
    request.model = model.get<std::string>();
  }

  if (endpoint == Endpoint::kCompletions) {
    if (absl::Status status = ParsePrompt(json, &request.prompt_key); !status.ok()) return status;
  } else {
    if (absl::Status status = ParseMessages(json, &request.prompt_key); !status.ok()) return status;
  }

  if (!Absent(json, "stream")) {
    const Json& stream = json.at("stream");
    if (!stream.is_boolean()) return FieldError("stream", absl::StrCat("must be a boolean, got ", Describe(stream)));
    request.stream = stream.get<bool>();
  }
  if (!Absent(json, "stream_options")) {
    const Json& options = json.at("stream_options");
    if (!options.is_object()) {
      return FieldError("stream_options", absl::StrCat("must be an object, got ", Describe(options)));
    }
    if (!request.stream) return FieldError("stream_options", "can only be set when stream is true");
    if (!Absent(options, "include_usage")) {
      const Json& include_usage = options.at("include_usage");
      if (!include_usage.is_boolean()) {
        return FieldError("stream_options.include_usage",
                          absl::StrCat("must be a boolean, got ", Describe(include_usage)));
      }
      request.include_usage = include_usage.get<bool>();
    }
  }

  absl::StatusOr<std::optional<int64_t>> max_tokens = PositiveIntegerField(json, "max_tokens");
  if (!max_tokens.ok()) return max_tokens.status();
  request.max_tokens = *max_tokens;
  if (endpoint == Endpoint::kChatCompletions) {
    absl::StatusOr<std::optional<int64_t>> max_completion_tokens = PositiveIntegerField(json, "max_completion_tokens");
    if (!max_completion_tokens.ok()) return max_completion_tokens.status();
    if (max_completion_tokens->has_value()) request.max_tokens = *max_completion_tokens;
  }

  if (absl::Status status = SingleChoiceField(json, "n"); !status.ok()) return status;
  if (endpoint == Endpoint::kCompletions) {
    if (absl::Status status = SingleChoiceField(json, "best_of"); !status.ok()) return status;
  }
  return request;
}

std::string MakePrefillBody(const ClientRequest& request) {
  Json body = request.body;
  body["kv_transfer_params"] =
      Json{{"do_remote_decode", true},    {"do_remote_prefill", false}, {"remote_engine_id", nullptr},
           {"remote_block_ids", nullptr}, {"remote_host", nullptr},     {"remote_port", nullptr}};
  body["stream"] = false;
  body["max_tokens"] = 1;
  if (body.contains("max_completion_tokens")) body["max_completion_tokens"] = 1;
  body.erase("stream_options");
  body.erase("min_tokens");
  body.erase("min_completion_tokens");
  return Dump(body);
}

absl::StatusOr<PrefillResult> ParsePrefillResponse(absl::string_view body) {
  absl::StatusOr<Json> parsed = ParseBody(body, "the prefill engine's answer", absl::StatusCode::kInternal);
  if (!parsed.ok()) return parsed.status();
  if (!parsed->is_object()) {
    return absl::InternalError(
        absl::StrCat("the prefill engine's answer must be a JSON object, got ", Describe(*parsed)));
  }
  Json& answer = *parsed;
  const auto params = answer.find("kv_transfer_params");
  if (params == answer.end() || !params->is_object()) {
    return absl::FailedPreconditionError(
        "the prefill engine returned no kv_transfer_params: is it running with a KV connector (kv_role "
        "kv_producer or kv_both)?");
  }
  PrefillResult result;
  result.kv_transfer_params = std::move(*params);
  Json& forwarded = result.kv_transfer_params;

  std::vector<std::string> problems;
  if (const auto counts = forwarded.find("eldr_expert_counts"); counts != forwarded.end()) {
    absl::StatusOr<Signature> signature = ExpertCountsSignature(*counts);
    absl::Status status = signature.ok() ? CheckNonNegative(*signature) : signature.status();
    if (status.ok()) {
      result.signature = *std::move(signature);
    } else {
      problems.emplace_back(status.message());
    }
  }
  if (!result.signature.has_value()) {
    if (const auto sig = forwarded.find("eldr_sig"); sig != forwarded.end()) {
      absl::StatusOr<Signature> signature = EldrSigSignature(*sig);
      absl::Status status = signature.ok() ? CheckNonNegative(*signature) : signature.status();
      if (status.ok()) {
        result.signature = *std::move(signature);
      } else {
        problems.emplace_back(status.message());
      }
    }
  }
  if (const auto gate = forwarded.find("eldr_gate_prob_sums"); gate != forwarded.end()) {
    absl::StatusOr<Payload> payload = GateProbSumsPayload(*gate);
    if (!payload.ok()) {
      problems.emplace_back(payload.status().message());
    } else if (result.signature.has_value() &&
               ((result.signature->experts > 0 &&
                 (result.signature->layers != payload->layers || result.signature->experts != payload->experts)) ||
                result.signature->int16_le.size() != 2 * payload->bytes.size() / 4)) {
      problems.emplace_back(absl::StrFormat("eldr_gate_prob_sums is %d x %d but the counts are %d x %d",
                                            payload->layers, payload->experts, result.signature->layers,
                                            result.signature->experts));
    } else {
      if (!result.signature.has_value()) {
        result.signature.emplace();
        result.signature->source = "eldr_gate_prob_sums";
      }
      result.signature->layers = payload->layers;
      result.signature->experts = payload->experts;
      result.signature->float32_le = std::move(payload->bytes);
    }
  }
  result.signature_problem = absl::StrJoin(problems, "; ");
  forwarded.erase("eldr_expert_counts");
  forwarded.erase("eldr_sig");
  forwarded.erase("eldr_gate_prob_sums");

  if (const auto usage = answer.find("usage"); usage != answer.end() && usage->is_object()) {
    if (const auto prompt_tokens = usage->find("prompt_tokens"); prompt_tokens != usage->end()) {
      result.prompt_tokens = NonNegativeInt64(*prompt_tokens).value_or(0);
    }
  }
  return result;
}

std::string MakeDecodeBody(const ClientRequest& request, const nlohmann::json& kv_transfer_params) {
  Json body = request.body;
  body["kv_transfer_params"] = kv_transfer_params;
  return Dump(body);
}

absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text, int max_depth) {
  if (absl::Status depth = CheckJsonDepth(text, max_depth); !depth.ok()) return depth;
  return ParseJsonUnchecked(text);
}

absl::StatusOr<std::string> Base64DecodeStrict(absl::string_view text) {
  if (text.size() % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("invalid base64: the length %d is not a multiple of 4 (padding missing?)", text.size()));
  }
  const auto value_of = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  size_t padding = 0;
  if (!text.empty() && text.back() == '=') padding = text.size() >= 2 && text[text.size() - 2] == '=' ? 2 : 1;
  const size_t data_end = text.size() - padding;
  for (size_t i = 0; i < data_end; ++i) {
    if (value_of(text[i]) < 0) {
      const unsigned char c = static_cast<unsigned char>(text[i]);
      if (c == '=') return absl::InvalidArgumentError(absl::StrFormat("invalid base64: '=' at position %d", i));
      return absl::InvalidArgumentError(
          absl::StrFormat("invalid base64: character 0x%02x at position %d is not in the alphabet", c, i));
    }
  }
  if (padding > 0) {
    // The last symbol before the padding must leave its unused low bits zero.
    const int last = value_of(text[data_end - 1]);
    const int unused_mask = padding == 2 ? 0x0f : 0x03;
    if ((last & unused_mask) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "invalid base64: non-zero padding bits in the character at position %d (not the canonical encoding)",
          data_end - 1));
    }
  }
  std::string decoded;
  if (!absl::Base64Unescape(text, &decoded)) {
    return absl::InvalidArgumentError("invalid base64");  // not reached after the checks above
  }
  return decoded;
}

}  // namespace eldr::proxy
