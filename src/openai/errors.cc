#include "eldr/openai/errors.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace eldr::openai {

using Json = nlohmann::ordered_json;

absl::string_view ErrorTypeForStatus(int http_status) {
  switch (http_status) {
    case 401:
      return "AuthenticationError";
    case 403:
      return "PermissionDeniedError";
    case 404:
      return "NotFoundError";
    case 409:
      return "ConflictError";
    case 429:
      return "TooManyRequestsError";
    case 502:
    case 503:
    case 504:
      return "ServiceUnavailableError";
    default:
      break;
  }
  if (http_status >= 400 && http_status < 500) return "BadRequestError";
  return "InternalServerError";
}

std::string ErrorBody(int http_status, absl::string_view message) {
  Json body;
  body["object"] = "error";
  body["message"] = std::string(message);
  body["type"] = std::string(ErrorTypeForStatus(http_status));
  body["param"] = nullptr;
  body["code"] = http_status;
  return body.dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string SseErrorEvent(absl::string_view message, absl::string_view type, int code) {
  Json error;
  error["message"] = std::string(message);
  error["type"] = std::string(type);
  error["param"] = nullptr;
  error["code"] = code;
  Json event;
  event["error"] = std::move(error);
  return absl::StrCat("data: ", event.dump(-1, ' ', false, Json::error_handler_t::replace), "\n\ndata: [DONE]\n\n");
}

}  // namespace eldr::openai
