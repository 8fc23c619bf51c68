// In-process tests of RouterServer and its services: conversion helpers, lifecycle, health and
// the extension points (background components, signature observers).
#include "server/server.h"
#include "eldr/common/file.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/v1/router.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/service.h"

namespace eldr::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kLayers = 4;
constexpr int kExperts = 8;

// Row i is the unit vector of expert i in every layer.
CentroidArtifact Artifact(int rows) {
  CentroidArtifact a;
  a.spec.layers = kLayers;
  a.spec.experts = kExperts;
  a.spec.variant = SignatureVariant::kCount;
  a.k = rows;
  a.centroids.assign(static_cast<size_t>(rows) * kLayers * kExperts, 0.f);
  for (int r = 0; r < rows; ++r) {
    for (int l = 0; l < kLayers; ++l)
      a.centroids[static_cast<size_t>(r) * kLayers * kExperts + l * kExperts + r] = 0.5f;
  }
  for (int r = 0; r < rows; ++r) a.workers.push_back(absl::StrCat("w", r));
  return a;
}

eldr::v1::RouteRequest ExpertRequest(int expert) {
  eldr::v1::RouteRequest request;
  auto* counts = request.mutable_counts();
  counts->set_layers(kLayers);
  counts->set_experts(kExperts);
  for (int i = 0; i < kLayers * kExperts; ++i) counts->mutable_values()->add_values(i % kExperts == expert ? 3 : 0);
  return request;
}

ServerOptions Options(int workers) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.admin_listen = "127.0.0.1:0";
  o.metrics_http.listen = "";
  o.log_level = LogLevel::kWarning;
  for (int i = 0; i < workers; ++i) o.workers.push_back(WorkerSpec{absl::StrCat("w", i), absl::StrCat("h", i, ":1")});
  o.refit.interval = absl::ZeroDuration();
  return o;
}

TEST(SignatureFromProto, ConvertsEachEncodingAsAView) {
  SignatureInput input;
  std::vector<float> scratch;
  bool present = true;
  ASSERT_TRUE(SignatureFromProto(eldr::v1::RouteRequest(), &input, &present, &scratch).ok());
  EXPECT_FALSE(present);

  eldr::v1::RouteRequest int16;
  int16.mutable_counts()->set_layers(2);
  int16.mutable_counts()->set_experts(3);
  int16.mutable_counts()->set_int16_le(std::string(12, '\0'));
  ASSERT_TRUE(SignatureFromProto(int16, &input, &present, &scratch).ok());
  ASSERT_TRUE(present);
  const auto& bytes = std::get<CountsInt16Le>(input);
  EXPECT_EQ(bytes.layers, 2);
  EXPECT_EQ(bytes.experts, 3);
  EXPECT_EQ(bytes.bytes.data(), int16.counts().int16_le().data());  // no copy

  eldr::v1::RouteRequest packed = ExpertRequest(1);
  ASSERT_TRUE(SignatureFromProto(packed, &input, &present, &scratch).ok());
  EXPECT_EQ(std::get<CountsInt32>(input).values.size(), static_cast<size_t>(kLayers * kExperts));

  eldr::v1::RouteRequest vector;
  vector.mutable_vector()->add_values(1.f);
  vector.mutable_vector()->add_values(2.f);
  ASSERT_TRUE(SignatureFromProto(vector, &input, &present, &scratch).ok());
  EXPECT_EQ(std::get<TransformedVector>(input).values.size(), 2u);
}

TEST(SignatureFromProto, RejectsUnusableShapes) {
  SignatureInput input;
  std::vector<float> scratch;
  bool present = false;
  eldr::v1::RouteRequest no_data;
  no_data.mutable_counts()->set_layers(2);
  no_data.mutable_counts()->set_experts(2);
  absl::Status s = SignatureFromProto(no_data, &input, &present, &scratch);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RejectReasonOf(s), RejectReason::kMalformed);

  eldr::v1::RouteRequest zero = no_data;
  zero.mutable_counts()->set_layers(0);
  zero.mutable_counts()->set_int16_le("");
  s = SignatureFromProto(zero, &input, &present, &scratch);
  EXPECT_EQ(RejectReasonOf(s), RejectReason::kGeometry);

  eldr::v1::RouteRequest huge = no_data;
  huge.mutable_counts()->set_layers(1 << 16);
  huge.mutable_counts()->set_experts(1 << 16);
  huge.mutable_counts()->set_int16_le("");
  s = SignatureFromProto(huge, &input, &present, &scratch);
  EXPECT_EQ(RejectReasonOf(s), RejectReason::kGeometry);
  EXPECT_THAT(s.message(), HasSubstr("65536x65536"));
}

std::string Float32Le(const std::vector<float>& values) {
  std::string bytes;
  for (float v : values) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<char>((bits >> (8 * b)) & 0xff));
  }
  return bytes;
}

TEST(SignatureFromProto, DecodesGateProbSumsLittleEndian) {
  SignatureInput input;
  std::vector<float> scratch;
  bool present = false;
  eldr::v1::RouteRequest request;
  request.mutable_gate_prob_sums()->set_layers(1);
  request.mutable_gate_prob_sums()->set_experts(3);
  request.mutable_gate_prob_sums()->set_float32_le(Float32Le({0.5f, 0.f, 1.25f}));
  ASSERT_TRUE(SignatureFromProto(request, &input, &present, &scratch).ok());
  ASSERT_TRUE(present);
  const auto& sums = std::get<GateProbSums>(input);
  EXPECT_EQ(sums.layers, 1);
  EXPECT_EQ(sums.experts, 3);
  EXPECT_THAT(std::vector<float>(sums.values.begin(), sums.values.end()), ElementsAre(0.5f, 0.f, 1.25f));
  // The exact bytes of 0.5f (0x3f000000), little-endian.
  request.mutable_gate_prob_sums()->set_experts(1);
  request.mutable_gate_prob_sums()->set_float32_le(std::string("\x00\x00\x00\x3f", 4));
  ASSERT_TRUE(SignatureFromProto(request, &input, &present, &scratch).ok());
  EXPECT_EQ(std::get<GateProbSums>(input).values[0], 0.5f);
}

TEST(SignatureFromProto, RejectsGateProbSumsOfPartialFloats) {
  SignatureInput input;
  std::vector<float> scratch;
  bool present = false;
  eldr::v1::RouteRequest request;
  request.mutable_gate_prob_sums()->set_layers(1);
  request.mutable_gate_prob_sums()->set_experts(2);
  request.mutable_gate_prob_sums()->set_float32_le(std::string(7, '\0'));
  const absl::Status s = SignatureFromProto(request, &input, &present, &scratch);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RejectReasonOf(s), RejectReason::kGeometry);
  EXPECT_THAT(s.message(), HasSubstr("7 bytes"));
  request.mutable_gate_prob_sums()->set_layers(-1);
  request.mutable_gate_prob_sums()->set_float32_le(std::string(8, '\0'));
  EXPECT_EQ(RejectReasonOf(SignatureFromProto(request, &input, &present, &scratch)), RejectReason::kGeometry);
}

TEST(ConstantTimeEquals, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("token", "token"));
  EXPECT_FALSE(ConstantTimeEquals("token", "tokem"));
  EXPECT_FALSE(ConstantTimeEquals("token", "toke"));
  EXPECT_FALSE(ConstantTimeEquals("token", "token2"));
  EXPECT_FALSE(ConstantTimeEquals("token", ""));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(BearerTokenFile, NeedsAReadableNonEmptyTokenAndKeepsTheOldOneOnABadReload) {
  EXPECT_FALSE(BearerTokenFile::Create("admin_token_file", absl::StrCat(::testing::TempDir(), "/no-token")).ok());
  EXPECT_THAT(BearerTokenFile::Create("admin_token_file", "/dev/zero").status().message(),
              HasSubstr("admin_token_file"));
  const std::string path = absl::StrCat(::testing::TempDir(), "/token");
  ASSERT_TRUE(WriteFileAtomically(path, "  abc \n").ok());
  auto auth = BearerTokenFile::Create("admin_token_file", path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE((*auth)->enabled());
  ASSERT_TRUE(WriteFileAtomically(path, "\n").ok());
  EXPECT_THAT((*auth)->Reload().message(), HasSubstr("empty"));
  auto disabled = BearerTokenFile::Create("admin_token_file", "");
  ASSERT_TRUE(disabled.ok());
  EXPECT_FALSE((*disabled)->enabled());
}

// Records the order of Start/Stop calls across components.
struct Journal {
  absl::Mutex mu;
  std::vector<std::string> events;
  void Add(std::string e) {
    absl::MutexLock lock(&mu);
    events.push_back(std::move(e));
  }
};

class RecordingComponent : public BackgroundComponent {
 public:
  RecordingComponent(std::string name, Journal* journal, bool fail)
      : name_(std::move(name)), journal_(journal), fail_(fail) {}
  std::string name() const override { return name_; }
  absl::Status Start() override {
    journal_->Add("start " + name_);
    return fail_ ? absl::InternalError("cannot start") : absl::OkStatus();
  }
  void Stop() override { journal_->Add("stop " + name_); }

 private:
  const std::string name_;
  Journal* const journal_;
  const bool fail_;
};

ComponentFactory Recording(std::string name, Journal* journal, bool fail = false) {
  return [name, journal, fail](const ComponentContext&) -> absl::StatusOr<std::unique_ptr<BackgroundComponent>> {
    return std::make_unique<RecordingComponent>(name, journal, fail);
  };
}

TEST(RouterServer, ServesRoutesAndTracksHealthInProcess) {
  auto server = RouterServer::Create(Options(3));
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  EXPECT_FALSE((*server)->serving()) << "policy eldr without centroids is not ready";

  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->grpc_port()), grpc::InsecureChannelCredentials());
  auto stub = eldr::v1::DecodeRouter::NewStub(channel);
  eldr::v1::RouteResponse response;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Route(&ctx, ExpertRequest(2), &response).ok());
  }
  EXPECT_EQ(response.fallback_reason(), "no_centroids");

  auto admin = eldr::v1::RouterAdmin::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->admin_port()), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    eldr::v1::ReloadCentroidsRequest reload;
    reload.set_path("");
    eldr::v1::ReloadCentroidsResponse reloaded;
    EXPECT_EQ(admin->ReloadCentroids(&ctx, reload, &reloaded).error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << "no --centroids configured";
  }
  {
    grpc::ClientContext ctx;
    eldr::v1::ReloadCentroidsRequest reload;
    reload.set_artifact_json(SerializeCentroidArtifact(Artifact(3)));
    eldr::v1::ReloadCentroidsResponse reloaded;
    const grpc::Status status = admin->ReloadCentroids(&ctx, reload, &reloaded);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(reloaded.centroid_generation(), 1u);
    EXPECT_EQ(reloaded.rows(), 3);
  }
  EXPECT_TRUE((*server)->serving());
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Route(&ctx, ExpertRequest(2), &response).ok());
  }
  EXPECT_EQ(response.worker_id(), "w2");
  EXPECT_EQ(response.centroid_generation(), 1u);

  (*server)->Shutdown();
  (*server)->Shutdown();  // idempotent
  (*server)->Wait();
  EXPECT_FALSE((*server)->serving());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  EXPECT_FALSE(stub->Route(&ctx, ExpertRequest(2), &response).ok());
}

TEST(RouterServer, ComponentsStartInOrderAndStopInReverse) {
  Journal journal;
  ServerExtensions extensions;
  extensions.components = {Recording("a", &journal), Recording("b", &journal)};
  auto server = RouterServer::Create(Options(1), std::move(extensions));
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  (*server)->Shutdown();
  EXPECT_THAT(journal.events, ElementsAre("start a", "start b", "stop b", "stop a"));
}

TEST(RouterServer, AFailingComponentAbortsStartAndStopsTheOthers) {
  Journal journal;
  ServerExtensions extensions;
  extensions.components = {Recording("a", &journal), Recording("broken", &journal, /*fail=*/true),
                           Recording("c", &journal)};
  auto server = RouterServer::Create(Options(1), std::move(extensions));
  ASSERT_TRUE(server.ok()) << server.status();
  const absl::Status started = (*server)->Start();
  EXPECT_THAT(started.message(), HasSubstr("component broken: cannot start"));
  EXPECT_THAT(journal.events, ElementsAre("start a", "start broken", "stop a"));
}

TEST(RouterServer, ComponentsInstallCentroidsAndObserveTheRouter) {
  struct SignatureCounter : RouterObserver {
    std::atomic<int> observed{0};
    std::atomic<int> observed_dim{0};
    void OnSignatureRouted(const RoutedSignature& routed) override {
      observed_dim = static_cast<int>(routed.signature().size());
      if (routed.worker_id == "w1") ++observed;
    }
  } counter;
  ComponentContext captured;
  ServerExtensions extensions;
  extensions.components.push_back(
      [&captured](const ComponentContext& context) -> absl::StatusOr<std::unique_ptr<BackgroundComponent>> {
        captured = context;
        return std::unique_ptr<BackgroundComponent>();  // nothing to run: skipped
      });
  auto server = RouterServer::Create(Options(2), std::move(extensions));
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_NE(captured.router, nullptr);
  ASSERT_NE(captured.metrics, nullptr);
  ASSERT_NE(captured.options, nullptr);
  ASSERT_NE(captured.loader, nullptr);
  captured.router->AddObserver(&counter);
  // Components install through the one door; the server logs, counts and re-evaluates health.
  auto generation = captured.router->InstallCentroids(Artifact(2), CentroidSource::kApi);
  ASSERT_TRUE(generation.ok()) << generation.status();
  EXPECT_EQ(*generation, 1u);
  ASSERT_TRUE((*server)->Start().ok());
  EXPECT_TRUE((*server)->serving());

  auto stub = eldr::v1::DecodeRouter::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->grpc_port()), grpc::InsecureChannelCredentials()));
  eldr::v1::RouteResponse response;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub->Route(&ctx, ExpertRequest(1), &response).ok());
  EXPECT_EQ(response.worker_id(), "w1");
  EXPECT_EQ(counter.observed.load(), 1);
  EXPECT_EQ(counter.observed_dim.load(), kLayers * kExperts);
  // Components register metrics on the shared registry.
  EXPECT_THAT(captured.metrics->RenderText(),
              HasSubstr("eldr_centroid_reloads_total{outcome=\"ok\",source=\"api\"} 1"));
  (*server)->Shutdown();
  captured.router->RemoveObserver(&counter);
}

TEST(RouterServer, CreateReportsConfigurationErrors) {
  ServerOptions bad_tau = Options(1);
  bad_tau.router.tau = 2;
  EXPECT_THAT(RouterServer::Create(bad_tau).status().message(), HasSubstr("'tau'"));

  ServerOptions mismatch = Options(2);
  const std::string path = absl::StrCat(::testing::TempDir(), "/three_rows.json");
  CentroidArtifact three = Artifact(3);
  three.workers.clear();
  ASSERT_TRUE(SaveCentroidArtifact(three, path).ok());
  mismatch.centroids = path;
  const absl::Status s = RouterServer::Create(mismatch).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("does not fit --workers"));

  ServerOptions busy = Options(1);
  auto first = RouterServer::Create(Options(1));
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->Start().ok());
  busy.listen = absl::StrCat("127.0.0.1:", (*first)->grpc_port());
  auto second = RouterServer::Create(busy);
  ASSERT_TRUE(second.ok());
  EXPECT_THAT((*second)->Start().message(), HasSubstr("cannot listen"));
  (*first)->Shutdown();
}

}  // namespace
}  // namespace eldr::server
