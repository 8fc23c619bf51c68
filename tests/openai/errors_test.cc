#include "eldr/openai/errors.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace eldr::openai {
namespace {

using Json = nlohmann::json;

TEST(ErrorTypeForStatusTest, VllmTypes) {
  struct Case {
    int status;
    const char* type;
  };
  const Case cases[] = {
      {400, "BadRequestError"},         {401, "AuthenticationError"},     {403, "PermissionDeniedError"},
      {404, "NotFoundError"},           {405, "BadRequestError"},         {409, "ConflictError"},
      {413, "BadRequestError"},         {422, "BadRequestError"},         {429, "TooManyRequestsError"},
      {500, "InternalServerError"},     {501, "InternalServerError"},     {502, "ServiceUnavailableError"},
      {503, "ServiceUnavailableError"}, {504, "ServiceUnavailableError"}, {200, "InternalServerError"},
  };
  for (const Case& c : cases) EXPECT_EQ(ErrorTypeForStatus(c.status), c.type) << c.status;
}

TEST(ErrorBodyTest, VllmShapeInVllmOrder) {
  EXPECT_EQ(ErrorBody(400, "prompt is required"),
            R"({"object":"error","message":"prompt is required","type":"BadRequestError","param":null,"code":400})");
  const Json body = Json::parse(ErrorBody(400, "prompt is required"));
  EXPECT_EQ(body, Json({{"object", "error"},
                        {"message", "prompt is required"},
                        {"type", "BadRequestError"},
                        {"param", nullptr},
                        {"code", 400}}));
  const Json unavailable = Json::parse(ErrorBody(503, "no prefill instance is configured"));
  EXPECT_EQ(unavailable["type"], "ServiceUnavailableError");
  EXPECT_EQ(unavailable["code"], 503);
  // Messages are escaped, and invalid UTF-8 is replaced rather than breaking the body.
  const Json quoted = Json::parse(ErrorBody(400, "bad \"x\"\n\xff"));
  EXPECT_EQ(quoted["message"], "bad \"x\"\n\xef\xbf\xbd");
}

}  // namespace
}  // namespace eldr::openai
