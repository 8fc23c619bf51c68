#include "eldr/proxy/stream_accounting.h"

#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "eldr/proxy/openai_protocol.h"
#include "nlohmann/json.hpp"
#include "simdjson.h"

namespace eldr::proxy {
namespace {

using Json = nlohmann::json;

std::optional<int64_t> NonNegativeInt64(const Json& value) {
  if (value.is_number_unsigned()) {
    if (value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(value.get<uint64_t>());
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) return value.get<int64_t>();
  return std::nullopt;
}

// The helpers below read simdjson DOM values (the per-event path; see OnEventData).
using SimdResult = simdjson::simdjson_result<simdjson::dom::element>;

std::optional<int64_t> NonNegativeInt64(SimdResult value) {
  int64_t signed_value = 0;
  if (value.get_int64().get(signed_value) == simdjson::SUCCESS) {
    return signed_value >= 0 ? std::optional<int64_t>(signed_value) : std::nullopt;
  }
  return std::nullopt;  // larger than int64 (uint64 only), a float, or not a number
}

bool NonEmptyString(SimdResult value) {
  std::string_view text;
  return value.get_string().get(text) == simdjson::SUCCESS && !text.empty();
}

// Whether a streamed choice carries generated output.
bool ChoiceHasToken(simdjson::dom::element choice) {
  simdjson::dom::object object;
  if (choice.get_object().get(object) != simdjson::SUCCESS) return false;
  if (NonEmptyString(object["text"])) return true;
  simdjson::dom::object delta;
  if (object["delta"].get_object().get(delta) != simdjson::SUCCESS) return false;
  if (NonEmptyString(delta["content"]) || NonEmptyString(delta["reasoning_content"]) ||
      NonEmptyString(delta["reasoning"])) {
    return true;
  }
  simdjson::dom::array tool_calls;
  return delta["tool_calls"].get_array().get(tool_calls) == simdjson::SUCCESS && tool_calls.size() > 0;
}

// The message of an error object (either shape), or empty when it has none.
std::string ErrorMessage(simdjson::dom::object event) {
  std::string_view text;
  if (event["error"].get_string().get(text) == simdjson::SUCCESS) return std::string(text);
  simdjson::dom::object error;
  if (event["error"].get_object().get(error) == simdjson::SUCCESS &&
      error["message"].get_string().get(text) == simdjson::SUCCESS) {
    return std::string(text);
  }
  if (event["message"].get_string().get(text) == simdjson::SUCCESS) return std::string(text);
  return "";
}

bool IsError(simdjson::dom::object event) {
  simdjson::dom::element error;
  if (event["error"].get(error) == simdjson::SUCCESS && !error.is_null()) return true;
  std::string_view object;
  return event["object"].get_string().get(object) == simdjson::SUCCESS && object == "error";
}

}  // namespace

DecodeEventInfo DecodeStreamObserver::OnEventData(absl::string_view data) {
  DecodeEventInfo info;
  ++events_;
  const absl::string_view trimmed = absl::StripAsciiWhitespace(data);
  if (trimmed == "[DONE]") {
    info.done = true;
    done_seen_ = true;
    return info;
  }
  // Every token of every stream passes here: simdjson's DOM parser (reused per thread, so no
  // allocation once warm) reads an OpenAI chunk in well under a microsecond, where building an
  // nlohmann value took several; its tape is built without recursion, so depth is no hazard.
  thread_local simdjson::dom::parser parser;
  simdjson::dom::element parsed;
  simdjson::dom::object event;
  if (parser.parse(trimmed.data(), trimmed.size()).get(parsed) != simdjson::SUCCESS ||
      parsed.get_object().get(event) != simdjson::SUCCESS) {
    info.malformed = true;
    ++malformed_events_;
    return info;
  }
  if (IsError(event)) {
    info.error = true;
    if (!error_seen_) {
      error_seen_ = true;
      error_message_ = ErrorMessage(event);
      if (error_message_.empty()) error_message_ = std::string(trimmed);
    }
    return info;
  }
  simdjson::dom::array choices;
  if (event["choices"].get_array().get(choices) == simdjson::SUCCESS) {
    bool first = true;
    for (simdjson::dom::element choice : choices) {
      if (ChoiceHasToken(choice)) info.token = true;
      simdjson::dom::object first_choice;
      if (first && choice.get_object().get(first_choice) == simdjson::SUCCESS) {
        std::string_view reason;
        if (first_choice["finish_reason"].get_string().get(reason) == simdjson::SUCCESS) {
          finish_reason_ = std::string(reason);
        }
      }
      first = false;
    }
  }
  if (info.token) {
    info.first_token = token_events_ == 0;
    ++token_events_;
  }
  simdjson::dom::object usage;
  if (event["usage"].get_object().get(usage) == simdjson::SUCCESS) {
    if (const std::optional<int64_t> value = NonNegativeInt64(usage["completion_tokens"]); value.has_value()) {
      info.usage = true;
      usage_completion_tokens_ = *value;
    }
    if (const std::optional<int64_t> value = NonNegativeInt64(usage["prompt_tokens"]); value.has_value()) {
      usage_prompt_tokens_ = *value;
    }
  }
  return info;
}

absl::StatusOr<ResponseTokens> OutputTokensOfResponse(absl::string_view body) {
  absl::StatusOr<Json> parsed = ParseJson(body, kMaxJsonDepth);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the decode engine's answer is not valid JSON: ", parsed.status().message()));
  }
  if (!parsed->is_object()) return absl::InvalidArgumentError("the decode engine's answer is not a JSON object");
  ResponseTokens tokens;
  if (const auto usage = parsed->find("usage"); usage != parsed->end() && usage->is_object()) {
    if (const auto completion = usage->find("completion_tokens"); completion != usage->end()) {
      if (const std::optional<int64_t> value = NonNegativeInt64(*completion); value.has_value()) {
        tokens.output_tokens = *value;
        tokens.from_usage = true;
      }
    }
  }
  return tokens;
}

}  // namespace eldr::proxy
