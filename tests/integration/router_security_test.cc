// Security of eldr-router: TLS, mutual TLS, certificate reload, the admin bearer token and the
// separate admin listener.
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "router_harness.h"

namespace eldr::testing {
namespace {

using ::testing::HasSubstr;

// Every RPC of these tests is bounded by this (a refused handshake must fail fast).
constexpr absl::Duration kRpcTimeout = absl::Seconds(5);

grpc::Status Route(const std::shared_ptr<grpc::Channel>& channel, eldr::v1::RouteResponse* response) {
  auto stub = eldr::v1::DecodeRouter::NewStub(channel);
  auto ctx = Ctx(kRpcTimeout);
  return stub->Route(ctx.get(), BlockRequest(1), response);
}

TEST(RouterSecurity, TlsServesTlsClientsOnly) {
  TempDir dir;
  auto certs = MakeCertificates(dir, "a-");
  ASSERT_TRUE(certs.ok()) << certs.status();
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--tls_cert=" + certs->server_cert);
  args.push_back("--tls_key=" + certs->server_key);
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);

  eldr::v1::RouteResponse response;
  grpc::Status tls = Route(TlsChannel(router->grpc_port(), certs->ca_cert), &response);
  ASSERT_TRUE(tls.ok()) << tls.error_message();
  EXPECT_EQ(response.worker_id(), "w1");

  grpc::Status plaintext = Route(router->Channel(), &response);
  EXPECT_EQ(plaintext.error_code(), grpc::StatusCode::UNAVAILABLE);

  // A client that trusts another CA refuses the server.
  auto other = MakeCertificates(dir, "b-");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(Route(TlsChannel(router->grpc_port(), other->ca_cert), &response).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST(RouterSecurity, MutualTlsRefusesClientsWithoutAValidCertificate) {
  TempDir dir;
  auto certs = MakeCertificates(dir, "a-");
  ASSERT_TRUE(certs.ok()) << certs.status();
  auto foreign = MakeCertificates(dir, "b-");
  ASSERT_TRUE(foreign.ok()) << foreign.status();
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--tls_cert=" + certs->server_cert);
  args.push_back("--tls_key=" + certs->server_key);
  args.push_back("--tls_client_ca=" + certs->ca_cert);
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);

  eldr::v1::RouteResponse response;
  grpc::Status without = Route(TlsChannel(router->grpc_port(), certs->ca_cert), &response);
  EXPECT_EQ(without.error_code(), grpc::StatusCode::UNAVAILABLE) << without.error_message();

  grpc::Status wrong_ca =
      Route(TlsChannel(router->grpc_port(), certs->ca_cert, foreign->client_cert, foreign->client_key), &response);
  EXPECT_EQ(wrong_ca.error_code(), grpc::StatusCode::UNAVAILABLE) << wrong_ca.error_message();

  grpc::Status with =
      Route(TlsChannel(router->grpc_port(), certs->ca_cert, certs->client_cert, certs->client_key), &response);
  ASSERT_TRUE(with.ok()) << with.error_message();
  EXPECT_EQ(response.worker_id(), "w1");
}

TEST(RouterSecurity, CertificatesReloadWhenTheFilesChange) {
  TempDir dir;
  auto first = MakeCertificates(dir, "a-");
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MakeCertificates(dir, "b-");
  ASSERT_TRUE(second.ok()) << second.status();
  const std::string cert = dir.File("live.crt");
  const std::string key = dir.File("live.key");
  WriteTextFile(cert, ReadTextFile(first->server_cert));
  WriteTextFile(key, ReadTextFile(first->server_key));
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--tls_cert=" + cert);
  args.push_back("--tls_key=" + key);
  args.push_back("--tls_reload_interval=1s");
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);

  eldr::v1::RouteResponse response;
  ASSERT_TRUE(Route(TlsChannel(router->grpc_port(), first->ca_cert), &response).ok());
  EXPECT_FALSE(Route(TlsChannel(router->grpc_port(), second->ca_cert), &response).ok());

  // Rotate to the second CA's certificate: new connections get it within the reload interval.
  WriteTextFile(key, ReadTextFile(second->server_key));
  WriteTextFile(cert, ReadTextFile(second->server_cert));
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  while (!Route(TlsChannel(router->grpc_port(), second->ca_cert), &response).ok()) {
    ASSERT_LT(absl::Now(), deadline) << "the new certificate was never served";
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_FALSE(Route(TlsChannel(router->grpc_port(), first->ca_cert), &response).ok());
}

class AdminTokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    token_file_ = dir_.File("admin.token");
    WriteTextFile(token_file_, "s3cret-token\n");
    std::vector<std::string> args = StandardArgs(dir_);
    args.push_back("--admin_token_file=" + token_file_);
    router_ = MustStart(dir_, args);
    ASSERT_NE(router_, nullptr);
    admin_ = router_->AdminStub();
  }

  grpc::Status GetState(const std::string& authorization) {
    auto ctx = Ctx(kRpcTimeout);
    if (!authorization.empty()) ctx->AddMetadata("authorization", authorization);
    eldr::v1::GetStateResponse state;
    return admin_->GetState(ctx.get(), {}, &state);
  }

  TempDir dir_;
  std::string token_file_;
  std::unique_ptr<RouterProcess> router_;
  std::unique_ptr<eldr::v1::RouterAdmin::Stub> admin_;
};

TEST_F(AdminTokenTest, AdminRpcsNeedTheToken) {
  EXPECT_EQ(GetState("").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(GetState("Basic czNjcmV0").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(GetState("Bearer wrong").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(GetState("Bearer s3cret-token-and-more").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(GetState("Bearer s3cret-toke").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(GetState("Bearer s3cret-token").ok());
  EXPECT_TRUE(GetState("bearer s3cret-token").ok());

  // Every admin method is guarded, not only GetState.
  {
    auto ctx = Ctx(kRpcTimeout);
    eldr::v1::RemoveWorkerRequest remove;
    remove.set_worker_id("w0");
    eldr::v1::RemoveWorkerResponse removed;
    EXPECT_EQ(admin_->RemoveWorker(ctx.get(), remove, &removed).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    auto ctx = Ctx(kRpcTimeout);
    eldr::v1::ReloadCentroidsRequest reload;
    eldr::v1::ReloadCentroidsResponse reloaded;
    ctx->AddMetadata("authorization", "Bearer nope");
    EXPECT_EQ(admin_->ReloadCentroids(ctx.get(), reload, &reloaded).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }

  // The data plane needs no token.
  eldr::v1::RouteResponse response;
  ASSERT_TRUE(Route(router_->Channel(), &response).ok());

  auto metrics = ScrapeMetrics(router_->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->Value("eldr_admin_refused_total", {{"code", "unauthenticated"}}), 3);
  EXPECT_EQ(metrics->Value("eldr_admin_refused_total", {{"code", "permission_denied"}}), 4);
  // The refused RemoveWorker did nothing.
  auto ctx = Ctx(kRpcTimeout);
  ctx->AddMetadata("authorization", "Bearer s3cret-token");
  eldr::v1::GetStateResponse state;
  ASSERT_TRUE(admin_->GetState(ctx.get(), {}, &state).ok());
  EXPECT_EQ(state.workers_size(), 4);
}

TEST_F(AdminTokenTest, TokenIsReloadedOnSighup) {
  WriteTextFile(token_file_, "rotated-token");
  router_->Signal(SIGHUP);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!GetState("Bearer rotated-token").ok()) {
    ASSERT_LT(absl::Now(), deadline) << router_->Log();
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(GetState("Bearer s3cret-token").error_code(), grpc::StatusCode::PERMISSION_DENIED);

  // An empty token file is refused and the current token stays.
  WriteTextFile(token_file_, "  \n");
  router_->Signal(SIGHUP);
  const absl::Time logged = absl::Now() + absl::Seconds(10);
  while (router_->Log().find("admin_token_reload_failed") == std::string::npos) {
    ASSERT_LT(absl::Now(), logged) << router_->Log();
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(GetState("Bearer rotated-token").ok());
}

TEST(RouterSecurity, AdminCanLiveOnItsOwnListener) {
  TempDir dir;
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--admin_listen=127.0.0.1:0");
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);
  ASSERT_NE(router->admin_port(), router->grpc_port());

  // Not on the data plane...
  auto data_plane_admin = eldr::v1::RouterAdmin::NewStub(router->Channel());
  eldr::v1::GetStateResponse state;
  {
    auto ctx = Ctx(kRpcTimeout);
    EXPECT_EQ(data_plane_admin->GetState(ctx.get(), {}, &state).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  // ...but on its own port, which in turn does not serve Route.
  {
    auto ctx = Ctx(kRpcTimeout);
    ASSERT_TRUE(router->AdminStub()->GetState(ctx.get(), {}, &state).ok());
  }
  EXPECT_EQ(state.workers_size(), 4);
  auto admin_channel = grpc::CreateChannel(router->admin_target(), grpc::InsecureChannelCredentials());
  eldr::v1::RouteResponse response;
  EXPECT_EQ(Route(admin_channel, &response).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  ASSERT_TRUE(Route(router->Channel(), &response).ok());
}

TEST(RouterSecurity, UnreadableTlsOrTokenFilesAreStartupErrors) {
  TempDir dir;
  const std::string router = BinaryPath("eldr-router");
  const std::string empty_token = dir.File("empty.token");
  WriteTextFile(empty_token, "\n");
  const std::string not_pem = dir.File("not.pem");
  WriteTextFile(not_pem, "hello");
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {{"--admin_token_file=" + dir.File("missing.token")}, "missing.token"},
           {{"--admin_token_file=" + empty_token}, "token is empty"},
           {{"--tls_cert=" + not_pem, "--tls_key=" + not_pem}, "holds no PEM certificate"},
           {{"--tls_client_ca=" + not_pem}, "mutual TLS needs tls_cert"},
       }) {
    std::vector<std::string> args = c.args;
    args.push_back("--workers=" + WorkerFlag(2));
    args.push_back("--listen=127.0.0.1:0");
    args.push_back("--metrics_listen=");
    ProcessResult result = RunProcess(router, args, absl::Seconds(30));
    EXPECT_EQ(result.exit_code, 1) << result.stderr_text;
    EXPECT_THAT(result.stderr_text, HasSubstr(c.message));
  }
}

}  // namespace
}  // namespace eldr::testing
