#include "engine_emu/request.h"

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "eldr/openai/errors.h"
#include "nlohmann/json.hpp"

namespace eldr::engine_emu {
namespace {

using nlohmann::json;

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

// The prompt text (see ParseEngineRequest) of a request object.
absl::StatusOr<std::string> PromptTextOf(ApiKind api, const json& object) {
  if (api == ApiKind::kCompletions) {
    const auto it = object.find("prompt");
    if (it == object.end() || it->is_null()) return Invalid("the request has no prompt");
    if (it->is_string()) {
      std::string text = it->get<std::string>();
      if (text.empty()) return Invalid("the prompt is empty");
      return text;
    }
    if (it->is_array()) {
      if (it->empty()) return Invalid("the prompt is an empty array");
      const json& first = it->front();
      if (!first.is_string()) {
        return Invalid("the prompt must be a string or an array of strings (token ids are not supported)");
      }
      std::string text = first.get<std::string>();
      if (text.empty()) return Invalid("the prompt is empty");
      return text;
    }
    return Invalid("the prompt must be a string or an array of strings");
  }

  const auto it = object.find("messages");
  if (it == object.end() || it->is_null()) return Invalid("the request has no messages");
  if (!it->is_array()) return Invalid("'messages' must be an array");
  if (it->empty()) return Invalid("'messages' is empty");
  std::vector<std::string> parts;
  for (const json& message : *it) {
    if (!message.is_object()) return Invalid("every element of 'messages' must be an object");
    const auto content = message.find("content");
    if (content == message.end() || content->is_null()) continue;  // e.g. an assistant tool call
    if (content->is_string()) {
      parts.push_back(content->get<std::string>());
    } else if (content->is_array()) {
      // OpenAI's content parts: the text parts count, others (images, audio) do not.
      for (const json& part : *content) {
        if (!part.is_object()) return Invalid("every content part of a message must be an object");
        const auto text = part.find("text");
        if (text != part.end() && text->is_string()) parts.push_back(text->get<std::string>());
      }
    } else {
      return Invalid("a message's 'content' must be a string or an array of content parts");
    }
  }
  std::string text = absl::StrJoin(parts, "\n");
  if (text.empty()) return Invalid("the messages hold no prompt text");
  return text;
}

// `object[name]` as a bool: absent or null gives `fallback`.
absl::StatusOr<bool> OptionalBool(const json& object, const char* name, absl::string_view path, bool fallback) {
  const auto it = object.find(name);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return Invalid(absl::StrCat("'", path, "' must be a boolean"));
  return it->get<bool>();
}

// `object[name]` as a positive int: absent or null gives nullopt.
absl::StatusOr<std::optional<int>> OptionalTokens(const json& object, const char* name) {
  const auto it = object.find(name);
  if (it == object.end() || it->is_null()) return std::optional<int>();
  if (!it->is_number_integer()) return Invalid(absl::StrCat("'", name, "' must be an integer"));
  // A value beyond int64 is stored as uint64 by the parser; both compare correctly here.
  if (it->is_number_unsigned() ? it->get<uint64_t>() < 1 : it->get<int64_t>() < 1) {
    return Invalid(absl::StrCat("'", name, "' must be at least 1, got ", it->dump()));
  }
  if (it->is_number_unsigned() ? it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int>::max())
                               : it->get<int64_t>() > std::numeric_limits<int>::max()) {
    return Invalid(absl::StrCat("'", name, "' is too large: ", it->dump()));
  }
  return std::optional<int>(it->get<int>());
}

absl::StatusOr<std::string> RequiredString(const json& params, const char* name) {
  const auto it = params.find(name);
  if (it == params.end() || !it->is_string() || it->get_ref<const std::string&>().empty()) {
    return Invalid(absl::StrCat("kv_transfer_params.", name, " must be a non-empty string"));
  }
  return it->get<std::string>();
}

absl::StatusOr<RemotePrefill> ParseRemotePrefill(const json& params) {
  RemotePrefill remote;
  absl::StatusOr<std::string> engine_id = RequiredString(params, "remote_engine_id");
  if (!engine_id.ok()) return engine_id.status();
  remote.engine_id = *std::move(engine_id);
  absl::StatusOr<std::string> request_id = RequiredString(params, "remote_request_id");
  if (!request_id.ok()) return request_id.status();
  remote.request_id = *std::move(request_id);
  absl::StatusOr<std::string> host = RequiredString(params, "remote_host");
  if (!host.ok()) return host.status();
  remote.host = *std::move(host);

  const auto port = params.find("remote_port");
  if (port == params.end() || !port->is_number_integer() || port->get<int64_t>() < 1 || port->get<int64_t>() > 65535) {
    return Invalid("kv_transfer_params.remote_port must be an integer in [1, 65535]");
  }
  remote.port = port->get<int>();

  const auto blocks = params.find("remote_block_ids");
  if (blocks == params.end() || !blocks->is_array()) {
    return Invalid("kv_transfer_params.remote_block_ids must be an array of integers");
  }
  remote.block_ids.reserve(blocks->size());
  for (const json& block : *blocks) {
    if (!block.is_number_integer() ||
        (block.is_number_unsigned() &&
         block.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
      return Invalid("kv_transfer_params.remote_block_ids must be an array of integers");
    }
    remote.block_ids.push_back(block.get<int64_t>());
  }
  return remote;
}

}  // namespace

absl::string_view RoleName(EngineRole role) { return role == EngineRole::kPrefill ? "prefill" : "decode"; }

absl::string_view ApiName(ApiKind api) { return api == ApiKind::kChat ? "chat" : "completions"; }

absl::StatusOr<EngineRequest> ParseEngineRequest(const RequestParserOptions& options, const TraceCatalog& catalog,
                                                 ApiKind api, absl::string_view body) {
  json object;
  try {
    object = json::parse(body.begin(), body.end());
  } catch (const json::parse_error& e) {
    return Invalid(absl::StrCat("the request body is not valid JSON (at byte ", e.byte, ")"));
  }
  if (!object.is_object()) return Invalid("the request body must be a JSON object");

  EngineRequest request;
  request.api = api;

  if (const auto model = object.find("model"); model != object.end() && !model->is_null()) {
    if (!model->is_string()) return Invalid("'model' must be a string");
    if (model->get_ref<const std::string&>() != options.model) {
      return absl::NotFoundError(
          absl::StrCat("The model `", model->get_ref<const std::string&>(), "` does not exist."));
    }
  }

  absl::StatusOr<std::string> prompt = PromptTextOf(api, object);
  if (!prompt.ok()) return prompt.status();
  request.trace_index = catalog.IndexForPrompt(*prompt);

  // vLLM's chat API prefers the newer max_completion_tokens over the deprecated max_tokens.
  absl::StatusOr<std::optional<int>> max_tokens = OptionalTokens(object, "max_tokens");
  if (!max_tokens.ok()) return max_tokens.status();
  request.max_tokens = *max_tokens;
  if (api == ApiKind::kChat) {
    absl::StatusOr<std::optional<int>> max_completion = OptionalTokens(object, "max_completion_tokens");
    if (!max_completion.ok()) return max_completion.status();
    if (max_completion->has_value()) request.max_tokens = *max_completion;
  }
  if (request.max_tokens.has_value()) {
    const int64_t prompt_tokens = catalog.request(request.trace_index).prompt_tokens;
    if (prompt_tokens + *request.max_tokens > options.max_model_len) {
      return Invalid(absl::StrCat("This model's maximum context length is ", options.max_model_len,
                                  " tokens. However, you requested ", prompt_tokens + *request.max_tokens, " tokens (",
                                  prompt_tokens, " in the prompt, ", *request.max_tokens,
                                  " in the completion). Please reduce the length of the prompt or completion."));
    }
  }

  absl::StatusOr<bool> stream = OptionalBool(object, "stream", "stream", false);
  if (!stream.ok()) return stream.status();
  request.stream = *stream;
  if (const auto stream_options = object.find("stream_options");
      stream_options != object.end() && !stream_options->is_null()) {
    if (!stream_options->is_object()) return Invalid("'stream_options' must be an object");
    absl::StatusOr<bool> usage = OptionalBool(*stream_options, "include_usage", "stream_options.include_usage", false);
    if (!usage.ok()) return usage.status();
    request.include_usage = *usage;
  }

  const json* params = nullptr;
  if (const auto it = object.find("kv_transfer_params"); it != object.end() && !it->is_null()) {
    if (!it->is_object()) return Invalid("'kv_transfer_params' must be an object");
    params = &*it;
  }
  const json empty = json::object();
  const json& kv = params != nullptr ? *params : empty;
  absl::StatusOr<bool> remote_decode =
      OptionalBool(kv, "do_remote_decode", "kv_transfer_params.do_remote_decode", false);
  if (!remote_decode.ok()) return remote_decode.status();
  absl::StatusOr<bool> remote_prefill =
      OptionalBool(kv, "do_remote_prefill", "kv_transfer_params.do_remote_prefill", false);
  if (!remote_prefill.ok()) return remote_prefill.status();

  if (options.role == EngineRole::kPrefill) {
    if (!*remote_decode) {
      return Invalid(
          "this emulator's prefill role serves disaggregated prefill only (kv_transfer_params.do_remote_decode)");
    }
    // The proxy never streams a prefill; a streamed prefill request is answered in one piece.
    request.stream = false;
    request.include_usage = false;
  } else if (*remote_prefill) {
    absl::StatusOr<RemotePrefill> remote = ParseRemotePrefill(kv);
    if (!remote.ok()) return remote.status();
    request.remote_prefill = *std::move(remote);
  }
  return request;
}

int HttpStatusForError(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      return 400;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kFailedPrecondition:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

std::string ErrorBody(const absl::Status& status) {
  return openai::ErrorBody(HttpStatusForError(status), status.message());
}

http::HttpResponse JsonResponse(int status, std::string body, absl::string_view request_id) {
  http::HttpResponse response;
  response.status = status;
  response.content_type = "application/json";
  response.body = std::move(body);
  if (!request_id.empty()) response.headers.emplace_back("X-Request-Id", std::string(request_id));
  return response;
}

http::HttpResponse ErrorResponse(const absl::Status& status, absl::string_view request_id) {
  return JsonResponse(HttpStatusForError(status), ErrorBody(status), request_id);
}

std::string JsonEscape(absl::string_view text) {
  const std::string quoted =
      nlohmann::json(std::string(text)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return quoted.substr(1, quoted.size() - 2);
}

}  // namespace eldr::engine_emu
