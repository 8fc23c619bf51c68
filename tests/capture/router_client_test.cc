// RouterClient (C++ API) against an in-process fake DecodeRouter on a loopback port: the counts
// arrive intact in both encodings, the decision comes back, errors keep their codes and messages,
// deadlines and unreachable routers fail fast, and TLS works with a certificate made for the test.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "capture/fake_router.h"
#include "eldr/capture/capture.hpp"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::capture {
namespace {

using testing::FakeRouter;
using ::testing::HasSubstr;

std::unique_ptr<RouterClient> MustConnect(const std::string& target, RouterClientOptions options = {}) {
  absl::StatusOr<std::unique_ptr<RouterClient>> client = RouterClient::Create(target, options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// A 3 x 4 count matrix whose largest cell is `argmax`.
std::vector<int16_t> Counts(int argmax) {
  std::vector<int16_t> counts = {3, 0, 7, 1, 30000, 2, 0, 0, 9, 4, 4, 5};
  std::swap(counts[argmax], counts[4]);
  return counts;
}

TEST(RouterClientTest, SendsInt16CountsAndReturnsTheDecision) {
  FakeRouter router;
  ASSERT_GT(router.port(), 0);
  auto client = MustConnect(router.target());
  ASSERT_NE(client, nullptr);
  const std::vector<int16_t> counts = Counts(8);
  absl::StatusOr<RouteDecision> decision = client->RouteInt16("req-1", 321, counts, 3, 4);
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->worker_id, "decode-2");  // argmax 8 % 3
  EXPECT_EQ(decision->lease_id, 1000u);
  EXPECT_EQ(decision->address, "10.0.0.0:8000");
  EXPECT_EQ(decision->policy, "eldr");
  EXPECT_FLOAT_EQ(decision->similarity, 0.75f);
  EXPECT_EQ(decision->band_size, 2);
  EXPECT_EQ(decision->centroid_generation, 7u);
  const auto received = router.service().last();
  EXPECT_EQ(received.request_id, "req-1");
  EXPECT_EQ(received.prompt_tokens, 321);
  EXPECT_EQ(received.encoding, "int16_le");
  EXPECT_EQ(received.layers, 3);
  EXPECT_EQ(received.experts, 4);
  EXPECT_EQ(received.counts, std::vector<int32_t>(counts.begin(), counts.end()));
}

TEST(RouterClientTest, SendsInt32CountsAsPackedValues) {
  FakeRouter router;
  auto client = MustConnect(router.target());
  ASSERT_NE(client, nullptr);
  const std::vector<int32_t> counts = {1, 2, 3, 100000, 5, 6};
  absl::StatusOr<RouteDecision> decision = client->RouteInt32("", 0, counts, 2, 3);
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->worker_id, "decode-0");  // argmax 3 % 3
  EXPECT_EQ(router.service().last().encoding, "values");
  EXPECT_EQ(router.service().last().counts, counts);
}

TEST(RouterClientTest, RoutesWithoutASignatureAndCompletesTheLease) {
  FakeRouter router;
  auto client = MustConnect(router.target());
  ASSERT_NE(client, nullptr);
  absl::StatusOr<RouteDecision> decision = client->RouteWithoutSignature("r", 10);
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->fallback_reason, "no_signature");
  EXPECT_FALSE(router.service().last().has_counts);
  absl::StatusOr<std::string> worker = client->Complete(decision->lease_id, 42);
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(*worker, "decode-0");
  // A lease completes once.
  absl::StatusOr<std::string> again = client->Complete(decision->lease_id, 42);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(again.status().message(), HasSubstr("unknown lease 1000"));
}

TEST(RouterClientTest, KeepsTheRoutersErrorCodeAndMessage) {
  FakeRouter router;
  auto client = MustConnect(router.target());
  ASSERT_NE(client, nullptr);
  absl::StatusOr<RouteDecision> decision = client->RouteInt16("reject", 1, Counts(0), 3, 4);
  ASSERT_FALSE(decision.ok());
  EXPECT_EQ(decision.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(decision.status().message(), HasSubstr("counts rejected by the fake router"));
  EXPECT_THAT(decision.status().message(), HasSubstr(router.target()));
}

TEST(RouterClientTest, RejectsBadCountsBeforeSending) {
  FakeRouter router;
  auto client = MustConnect(router.target());
  ASSERT_NE(client, nullptr);
  const std::vector<int16_t> five(5, 1);
  EXPECT_THAT(client->RouteInt16("", 0, five, 3, 4).status().message(),
              HasSubstr("5 counts for layers * experts = 3 * 4"));
  std::vector<int16_t> negative = Counts(0);
  negative[6] = -2;
  EXPECT_THAT(client->RouteInt16("", 0, negative, 3, 4).status().message(), HasSubstr("count [1][2] = -2 is negative"));
  EXPECT_THAT(client->RouteInt16(std::string(300, 'x'), 0, Counts(0), 3, 4).status().message(),
              HasSubstr("request_id has 300 bytes, at most 256"));
  EXPECT_THAT(client->RouteInt16("", -1, Counts(0), 3, 4).status().message(), HasSubstr("prompt_tokens must be >= 0"));
  EXPECT_EQ(router.service().routes(), 0);
}

TEST(RouterClientTest, TimesOutAndReportsAnUnreachableRouter) {
  FakeRouter router;
  RouterClientOptions options;
  options.timeout_ms = 100;
  auto client = MustConnect(router.target(), options);
  ASSERT_NE(client, nullptr);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<RouteDecision> slow = client->RouteInt16("sleep-500ms", 1, Counts(0), 3, 4);
  EXPECT_EQ(slow.status().code(), absl::StatusCode::kDeadlineExceeded) << slow.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(450));

  // A port nobody listens on: take one from a server that then goes away.
  int closed_port = 0;
  {
    FakeRouter gone;
    closed_port = gone.port();
  }
  auto unreachable = MustConnect("127.0.0.1:" + std::to_string(closed_port), options);
  ASSERT_NE(unreachable, nullptr);
  absl::StatusOr<RouteDecision> nobody = unreachable->RouteInt16("", 1, Counts(0), 3, 4);
  ASSERT_FALSE(nobody.ok());
  EXPECT_TRUE(nobody.status().code() == absl::StatusCode::kUnavailable ||
              nobody.status().code() == absl::StatusCode::kDeadlineExceeded)
      << nobody.status();
}

TEST(RouterClientTest, RejectsInconsistentOptions) {
  RouterClientOptions options;
  EXPECT_THAT(RouterClient::Create("", options).status().message(), HasSubstr("target is empty"));
  options.timeout_ms = 0;
  EXPECT_THAT(RouterClient::Create("127.0.0.1:1", options).status().message(), HasSubstr("timeout_ms must be > 0"));
  options.timeout_ms = 100;
  options.tls_client_cert_pem = "x";
  EXPECT_THAT(RouterClient::Create("127.0.0.1:1", options).status().message(), HasSubstr("without tls_root_certs_pem"));
  options.tls_root_certs_pem = "y";
  EXPECT_THAT(RouterClient::Create("127.0.0.1:1", options).status().message(),
              HasSubstr("needs both tls_client_cert_pem and tls_client_key_pem"));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(RouterClientTest, TalksTlsToARouterWithACertificate) {
  char dir_template[] = "/tmp/eldr_capture_tls_XXXXXX";
  const char* dir = mkdtemp(dir_template);
  ASSERT_NE(dir, nullptr);
  const std::string key = std::string(dir) + "/key.pem";
  const std::string cert = std::string(dir) + "/cert.pem";
  const std::string command =
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 "
      "-subj /CN=localhost -addext subjectAltName=DNS:localhost -keyout " +
      key + " -out " + cert + " >/dev/null 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const std::string cert_pem = ReadFile(cert);
  const std::string key_pem = ReadFile(key);
  std::remove(key.c_str());
  std::remove(cert.c_str());
  std::remove(dir);
  ASSERT_FALSE(cert_pem.empty());

  FakeRouter router(cert_pem, key_pem);
  ASSERT_GT(router.port(), 0);
  RouterClientOptions options;
  options.tls_root_certs_pem = cert_pem;
  options.tls_server_name = "localhost";
  auto client = MustConnect(router.target(), options);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<RouteDecision> decision = client->RouteInt16("tls", 1, Counts(5), 3, 4);
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->worker_id, "decode-2");

  // A plaintext client cannot talk to it.
  RouterClientOptions plaintext;
  plaintext.timeout_ms = 500;
  auto insecure = MustConnect(router.target(), plaintext);
  ASSERT_NE(insecure, nullptr);
  EXPECT_FALSE(insecure->RouteInt16("plain", 1, Counts(5), 3, 4).ok());
}

}  // namespace
}  // namespace eldr::capture
