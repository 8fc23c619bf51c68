// Integration tests of eldr-router: the real daemon process on loopback, real gRPC clients.
#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "eldr/core/centroid_index.h"
#include "eldr/v1/router.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "router_harness.h"

namespace eldr::testing {
namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;
using ::testing::Not;

// The standard fixture: 4 workers w0..w3, artifact rows named w0..w3 on blocks 0..3.
HealthCheckResponse::ServingStatus Health(const RouterProcess& router, const std::string& service) {
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  auto ctx = Ctx();
  grpc::Status status = router.HealthStub()->Check(ctx.get(), request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response.status();
}

// Sends `reports` on one ReportLoad stream and returns the summary once the server has applied all.
eldr::v1::ReportLoadResponse Report(const RouterProcess& router, const std::vector<eldr::v1::LoadReport>& reports) {
  auto stub = router.RouterStub();
  auto ctx = Ctx();
  eldr::v1::ReportLoadResponse response;
  auto writer = stub->ReportLoad(ctx.get(), &response);
  for (const auto& r : reports) EXPECT_TRUE(writer->Write(r));
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response;
}

eldr::v1::LoadReport Load(const std::string& worker, double running) {
  eldr::v1::LoadReport r;
  r.set_worker_id(worker);
  r.set_running(running);
  r.set_kv_usage(0.25);
  return r;
}

grpc::Status RouteOnce(eldr::v1::DecodeRouter::Stub* stub, const eldr::v1::RouteRequest& request,
                       eldr::v1::RouteResponse* response) {
  auto ctx = Ctx();
  return stub->Route(ctx.get(), request, response);
}

grpc::Status CompleteLease(eldr::v1::DecodeRouter::Stub* stub, uint64_t lease, std::string* worker = nullptr) {
  eldr::v1::CompleteRequest request;
  request.set_lease_id(lease);
  eldr::v1::CompleteResponse response;
  auto ctx = Ctx();
  grpc::Status status = stub->Complete(ctx.get(), request, &response);
  if (worker != nullptr) *worker = response.worker_id();
  return status;
}

double MetricOr(const ParsedMetrics& m, const std::string& name, const std::map<std::string, std::string>& labels,
                double fallback = -1) {
  return m.Value(name, labels).value_or(fallback);
}

// ---------------------------------------------------------------------------------------------

TEST(RouterIntegration, RoutesByLocalityAndCompletesOnce) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();

  for (int block = 0; block < 4; ++block) {
    eldr::v1::RouteResponse response;
    ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(block), &response).ok());
    EXPECT_EQ(response.worker_id(), absl::StrCat("w", block));
    EXPECT_EQ(response.address(), absl::StrCat("10.0.0.", block, ":8000"));
    EXPECT_NE(response.lease_id(), 0u);
    EXPECT_EQ(response.policy(), "eldr");
    EXPECT_EQ(response.fallback_reason(), "");
    EXPECT_EQ(response.band_size(), 1);
    // 4 of 16 block experts per layer with equal counts: cosine exactly 0.5 (fp16 centroids).
    EXPECT_NEAR(response.similarity(), 0.5, 0.01);
    EXPECT_EQ(response.centroid_generation(), 1u);

    std::string released;
    EXPECT_TRUE(CompleteLease(stub.get(), response.lease_id(), &released).ok());
    EXPECT_EQ(released, response.worker_id());
    grpc::Status again = CompleteLease(stub.get(), response.lease_id());
    EXPECT_EQ(again.error_code(), grpc::StatusCode::NOT_FOUND) << again.error_message();
  }
  EXPECT_EQ(State(*router).live_leases(), 0);
}

// A data plane on a Unix socket (a caller in the same pod): the port file says port 0, Route and
// Complete work over it, and a daemon killed without cleaning up leaves its socket file behind,
// which the next one at the same path replaces.
TEST(RouterIntegration, ServesOnAUnixSocketAndRestartsOverTheFileLeftBehind) {
  TempDir dir;
  const std::string socket_path = dir.File("router.sock");
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--listen=unix:" + socket_path);
  for (int life = 0; life < 2; ++life) {
    auto router = MustStart(dir, args);
    ASSERT_NE(router, nullptr) << "life " << life;
    EXPECT_EQ(router->grpc_port(), 0);
    EXPECT_GT(router->admin_port(), 0);
    struct stat info {};
    ASSERT_EQ(stat(socket_path.c_str(), &info), 0);
    EXPECT_TRUE(S_ISSOCK(info.st_mode));
    auto stub =
        eldr::v1::DecodeRouter::NewStub(grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials()));
    for (int block = 0; block < 4; ++block) {
      eldr::v1::RouteResponse response;
      const grpc::Status routed = RouteOnce(stub.get(), BlockRequest(block), &response);
      ASSERT_TRUE(routed.ok()) << "life " << life << ": " << routed.error_message();
      EXPECT_EQ(response.worker_id(), absl::StrCat("w", block));
      EXPECT_TRUE(CompleteLease(stub.get(), response.lease_id()).ok());
    }
    EXPECT_EQ(State(*router).live_leases(), 0);
    router->Signal(SIGKILL);
    ASSERT_TRUE(router->WaitForExit(absl::Seconds(10)).has_value());
  }
}

// What a proxy needs of Route: counts without their geometry (the reference's bare `eldr_sig`),
// re-routing without a worker it could not reach, and a baseline policy for an A/B arm.
TEST(RouterIntegration, ProxyRouteOptionsExcludePolicyAndBareCounts) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();

  eldr::v1::RouteRequest bare = BlockRequest(2);
  bare.mutable_counts()->set_layers(0);
  bare.mutable_counts()->set_experts(0);
  eldr::v1::RouteResponse response;
  grpc::Status status = RouteOnce(stub.get(), bare, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.worker_id(), "w2");
  EXPECT_EQ(response.policy(), "eldr");

  eldr::v1::RouteRequest rerouted = BlockRequest(2);
  rerouted.add_exclude_workers("w2");
  ASSERT_TRUE(RouteOnce(stub.get(), rerouted, &response).ok());
  EXPECT_NE(response.worker_id(), "w2");
  for (int w = 0; w < 4; ++w) rerouted.add_exclude_workers(absl::StrCat("w", w));
  EXPECT_EQ(RouteOnce(stub.get(), rerouted, &response).error_code(), grpc::StatusCode::UNAVAILABLE);
  eldr::v1::RouteRequest long_id = BlockRequest(2);
  long_id.add_exclude_workers(std::string(300, 'x'));
  EXPECT_EQ(RouteOnce(stub.get(), long_id, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  eldr::v1::RouteRequest baseline = BlockRequest(2);
  baseline.set_policy("rr");
  ASSERT_TRUE(RouteOnce(stub.get(), baseline, &response).ok());
  EXPECT_EQ(response.policy(), "rr");
  EXPECT_EQ(response.band_size(), 0);
  baseline.set_policy("fastest");
  status = RouteOnce(stub.get(), baseline, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("fastest"));
}

TEST(RouterIntegration, RequestsWithoutUsableSignatureFallBackToJsq) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();

  eldr::v1::RouteRequest none;
  none.set_request_id("no-signature");
  eldr::v1::RouteResponse response;
  ASSERT_TRUE(RouteOnce(stub.get(), none, &response).ok());
  EXPECT_EQ(response.policy(), "jsq");
  EXPECT_EQ(response.fallback_reason(), "no_signature");
  EXPECT_EQ(response.band_size(), 0);

  eldr::v1::RouteRequest zero = BlockRequest(0);
  zero.mutable_counts()->set_int16_le(std::string(kLayers * kExperts * 2, '\0'));
  ASSERT_TRUE(RouteOnce(stub.get(), zero, &response).ok());
  EXPECT_EQ(response.policy(), "jsq");
  EXPECT_EQ(response.fallback_reason(), "zero_signature");
}

TEST(RouterIntegration, ReportedLoadChangesTheChoiceWithinTheBand) {
  TempDir dir;
  const std::string artifact = dir.File("artifact.json");
  // w0 and w1 share block 0: both are in the band of a block-0 request; load decides.
  WriteTextFile(artifact, ArtifactJson({0, 0, 2, 3}, {"w0", "w1", "w2", "w3"}));
  auto router = MustStart(dir, {"--workers=" + WorkerFlag(4), "--centroids=" + artifact});
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();

  auto route_block0 = [&](int n) {
    std::set<std::string> chosen;
    for (int i = 0; i < n; ++i) {
      eldr::v1::RouteResponse response;
      EXPECT_TRUE(RouteOnce(stub.get(), BlockRequest(0), &response).ok());
      EXPECT_EQ(response.band_size(), 2);
      chosen.insert(response.worker_id());
      EXPECT_TRUE(CompleteLease(stub.get(), response.lease_id()).ok());
    }
    return chosen;
  };

  eldr::v1::ReportLoadResponse summary = Report(*router, {Load("w0", 50), Load("w1", 0)});
  EXPECT_EQ(summary.accepted(), 2);
  EXPECT_EQ(summary.rejected(), 0);
  EXPECT_EQ(route_block0(10), std::set<std::string>{"w1"});

  const auto state = State(*router);
  const auto* w0 = FindWorker(state, "w0");
  ASSERT_NE(w0, nullptr);
  EXPECT_DOUBLE_EQ(w0->reported_load(), 50);
  EXPECT_DOUBLE_EQ(w0->reported_kv_usage(), 0.25);
  EXPECT_GE(w0->report_age_seconds(), 0);
  EXPECT_GE(w0->effective_load(), 50);

  summary = Report(*router, {Load("w0", 0), Load("w1", 50)});
  EXPECT_EQ(summary.accepted(), 2);
  EXPECT_EQ(route_block0(10), std::set<std::string>{"w0"});
}

TEST(RouterIntegration, AdminAddsDrainsAndRemovesWorkers) {
  TempDir dir;
  // Online refit off (it is on by default, every 10 s): every pool change below wakes the refitter,
  // which drops the rows of workers that are not active (a draining w2) even from an empty window,
  // and gives a worker that comes back no row until a fit; this test checks the exact worker of
  // each route around those changes.
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--refit_interval=0");
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();
  auto admin = router->AdminStub();

  // Add a fifth worker, then update it.
  eldr::v1::UpsertWorkerRequest upsert;
  upsert.mutable_worker()->set_id("w4");
  upsert.mutable_worker()->set_address("10.0.0.4:8000");
  upsert.mutable_worker()->set_capacity(2);
  eldr::v1::UpsertWorkerResponse upserted;
  {
    auto ctx = Ctx();
    ASSERT_TRUE(admin->UpsertWorker(ctx.get(), upsert, &upserted).ok());
  }
  EXPECT_TRUE(upserted.created());
  upsert.mutable_worker()->set_address("10.0.0.44:8000");
  {
    auto ctx = Ctx();
    ASSERT_TRUE(admin->UpsertWorker(ctx.get(), upsert, &upserted).ok());
  }
  EXPECT_FALSE(upserted.created());
  eldr::v1::ListWorkersResponse list;
  {
    auto ctx = Ctx();
    ASSERT_TRUE(admin->ListWorkers(ctx.get(), {}, &list).ok());
  }
  ASSERT_EQ(list.workers_size(), 5);
  EXPECT_EQ(list.workers(4).worker().id(), "w4");
  EXPECT_EQ(list.workers(4).worker().address(), "10.0.0.44:8000");
  EXPECT_DOUBLE_EQ(list.workers(4).worker().capacity(), 2);
  EXPECT_FALSE(list.workers(4).has_centroid());
  EXPECT_TRUE(list.workers(0).has_centroid());

  // Drain w2 while it holds a lease: new block-2 requests go elsewhere, the lease completes.
  eldr::v1::RouteResponse held;
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(2), &held).ok());
  ASSERT_EQ(held.worker_id(), "w2");
  eldr::v1::DrainWorkerRequest drain;
  drain.set_worker_id("w2");
  eldr::v1::DrainWorkerResponse drained;
  {
    auto ctx = Ctx();
    ASSERT_TRUE(admin->DrainWorker(ctx.get(), drain, &drained).ok());
  }
  EXPECT_EQ(drained.inflight(), 1);
  EXPECT_EQ(FindWorker(State(*router), "w2")->state(), "draining");
  for (int i = 0; i < 8; ++i) {
    eldr::v1::RouteResponse response;
    ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(2), &response).ok());
    EXPECT_NE(response.worker_id(), "w2");
    EXPECT_TRUE(CompleteLease(stub.get(), response.lease_id()).ok());
  }
  EXPECT_TRUE(CompleteLease(stub.get(), held.lease_id()).ok());

  // Upserting a draining worker makes it active again.
  eldr::v1::UpsertWorkerRequest reactivate;
  reactivate.mutable_worker()->set_id("w2");
  reactivate.mutable_worker()->set_address("10.0.0.2:8000");
  {
    auto ctx = Ctx();
    ASSERT_TRUE(admin->UpsertWorker(ctx.get(), reactivate, &upserted).ok());
  }
  eldr::v1::RouteResponse back;
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(2), &back).ok());
  EXPECT_EQ(back.worker_id(), "w2");
  EXPECT_TRUE(CompleteLease(stub.get(), back.lease_id()).ok());

  // Remove w3 with a live lease: the lease is dropped with it.
  eldr::v1::RouteResponse on_w3;
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(3), &on_w3).ok());
  ASSERT_EQ(on_w3.worker_id(), "w3");
  eldr::v1::RemoveWorkerRequest remove;
  remove.set_worker_id("w3");
  eldr::v1::RemoveWorkerResponse removed;
  {
    auto ctx = Ctx();
    ASSERT_TRUE(admin->RemoveWorker(ctx.get(), remove, &removed).ok());
  }
  EXPECT_EQ(removed.dropped_leases(), 1);
  // Its request completes late: OK once (counted), NOT_FOUND after.
  std::string late_worker;
  EXPECT_TRUE(CompleteLease(stub.get(), on_w3.lease_id(), &late_worker).ok());
  EXPECT_EQ(late_worker, "w3");
  EXPECT_EQ(CompleteLease(stub.get(), on_w3.lease_id()).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Scraped(*router, "eldr_completes_after_removal_total"), 1);
  {
    auto ctx = Ctx();
    EXPECT_EQ(admin->RemoveWorker(ctx.get(), remove, &removed).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  EXPECT_EQ(FindWorker(State(*router), "w3"), nullptr);
  eldr::v1::RouteResponse response;
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(3), &response).ok());
  EXPECT_NE(response.worker_id(), "w3");
}

TEST(RouterIntegration, HealthFollowsCentroidsAndWorkers) {
  TempDir dir;
  const std::string artifact = dir.File("artifact.json");
  WriteTextFile(artifact, ArtifactJson({0, 1, 2, 3}, {"w0", "w1", "w2", "w3"}));
  // Policy eldr without centroids: not ready, but routes are answered (jsq, no_centroids). Path
  // reloads read from --centroids_dir. Online refit off (on by default): a refit woken by the pool
  // changes below installs from its own thread, and while it delivers the router's events an admin
  // change's event (and so the health it sets) may be delivered after the RPC was answered.
  auto router = MustStart(dir, {"--workers=" + WorkerFlag(4), "--centroids_dir=" + dir.path(), "--refit_interval=0"});
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(Health(*router, ""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Health(*router, "eldr.v1.DecodeRouter"), HealthCheckResponse::NOT_SERVING);
  auto stub = router->RouterStub();
  eldr::v1::RouteResponse response;
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(1), &response).ok());
  EXPECT_EQ(response.fallback_reason(), "no_centroids");
  EXPECT_EQ(response.centroid_generation(), 0u);

  auto admin = router->AdminStub();
  eldr::v1::ReloadCentroidsRequest reload;
  reload.set_path(artifact);
  eldr::v1::ReloadCentroidsResponse reloaded;
  {
    auto ctx = Ctx();
    grpc::Status status = admin->ReloadCentroids(ctx.get(), reload, &reloaded);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_EQ(reloaded.centroid_generation(), 1u);
  EXPECT_EQ(reloaded.rows(), 4);
  EXPECT_EQ(Health(*router, ""), HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(*router, "eldr.v1.DecodeRouter"), HealthCheckResponse::SERVING);

  // No active worker left: not ready again.
  for (int i = 0; i < 4; ++i) {
    eldr::v1::RemoveWorkerRequest remove;
    remove.set_worker_id(absl::StrCat("w", i));
    eldr::v1::RemoveWorkerResponse removed;
    auto ctx = Ctx();
    ASSERT_TRUE(admin->RemoveWorker(ctx.get(), remove, &removed).ok());
  }
  EXPECT_EQ(Health(*router, ""), HealthCheckResponse::NOT_SERVING);
  {
    auto ctx = Ctx();
    EXPECT_EQ(stub->Route(ctx.get(), BlockRequest(1), &response).error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  eldr::v1::UpsertWorkerRequest upsert;
  upsert.mutable_worker()->set_id("w1");
  upsert.mutable_worker()->set_address("10.0.0.1:8000");
  eldr::v1::UpsertWorkerResponse upserted;
  {
    auto ctx = Ctx();
    ASSERT_TRUE(admin->UpsertWorker(ctx.get(), upsert, &upserted).ok());
  }
  EXPECT_EQ(Health(*router, ""), HealthCheckResponse::SERVING);

  // An unknown service name is NOT_FOUND, as the protocol says.
  HealthCheckRequest unknown;
  unknown.set_service("no.such.Service");
  HealthCheckResponse unknown_response;
  auto ctx = Ctx();
  EXPECT_EQ(router->HealthStub()->Check(ctx.get(), unknown, &unknown_response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST(RouterIntegration, LoadBalancingPolicyIsReadyWithoutCentroids) {
  TempDir dir;
  auto router = MustStart(dir, {"--workers=" + WorkerFlag(3), "--policy=jsq"});
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(Health(*router, ""), HealthCheckResponse::SERVING);
  auto stub = router->RouterStub();
  std::set<std::string> chosen;
  std::vector<uint64_t> leases;
  for (int i = 0; i < 3; ++i) {
    eldr::v1::RouteResponse response;
    ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(0), &response).ok());
    EXPECT_EQ(response.policy(), "jsq");
    EXPECT_EQ(response.fallback_reason(), "");
    chosen.insert(response.worker_id());
    leases.push_back(response.lease_id());
  }
  // Join-shortest-queue with leases held: three requests land on three different workers.
  EXPECT_EQ(chosen.size(), 3u);
}

TEST(RouterIntegration, SigtermDrainsAndExitsZero) {
  TempDir dir;
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--shutdown_drain_delay=500ms");
  args.push_back("--shutdown_grace=5s");
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);

  // A health watcher sees the transition to NOT_SERVING.
  auto health_stub = router->HealthStub();
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  auto watch = health_stub->Watch(&watch_ctx, HealthCheckRequest());
  HealthCheckResponse seen;
  ASSERT_TRUE(watch->Read(&seen));
  ASSERT_EQ(seen.status(), HealthCheckResponse::SERVING);

  // An in-flight ReportLoad stream with applied reports.
  auto stub = router->RouterStub();
  grpc::ClientContext stream_ctx;
  stream_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  eldr::v1::ReportLoadResponse summary;
  auto writer = stub->ReportLoad(&stream_ctx, &summary);
  ASSERT_TRUE(writer->Write(Load("w0", 1)));
  ASSERT_TRUE(writer->Write(Load("w1", 2)));
  ASSERT_TRUE(writer->Write(Load("w2", 3)));
  const absl::Time applied_deadline = absl::Now() + absl::Seconds(10);
  while (true) {
    const eldr::v1::GetStateResponse state = State(*router);  // FindWorker points into it
    const auto* w2 = FindWorker(state, "w2");
    if (w2 != nullptr && w2->reported_load() == 3) break;
    ASSERT_LT(absl::Now(), applied_deadline) << "reports were not applied";
    absl::SleepFor(absl::Milliseconds(5));
  }

  // Traffic runs while the signal arrives, from a client that stops sending when health turns
  // NOT_SERVING (as a load balancer does): every one of its RPCs, including those in flight when
  // the signal came, is answered OK during the drain delay.
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0};
  std::atomic<int> failed{0};
  std::string failure_message;
  std::thread traffic([&] {
    auto traffic_stub = router->RouterStub();
    while (!stop.load()) {
      eldr::v1::RouteResponse response;
      grpc::Status status = RouteOnce(traffic_stub.get(), BlockRequest(1), &response);
      if (status.ok()) status = CompleteLease(traffic_stub.get(), response.lease_id());
      if (status.ok()) {
        ++ok;
      } else if (failed++ == 0) {
        failure_message = absl::StrCat(status.error_code(), ": ", status.error_message());
      }
    }
  });
  while (ok.load() < 20) absl::SleepFor(absl::Milliseconds(1));

  const absl::Time signalled = absl::Now();
  router->Signal(SIGTERM);
  ASSERT_TRUE(watch->Read(&seen));
  EXPECT_EQ(seen.status(), HealthCheckResponse::NOT_SERVING);
  stop = true;
  traffic.join();
  watch_ctx.TryCancel();

  // The open stream is answered with its summary.
  grpc::Status stream_status = writer->Finish();
  EXPECT_TRUE(stream_status.ok()) << stream_status.error_message();
  EXPECT_EQ(summary.accepted(), 3);
  writer.reset();  // a client releases its call once it has the status

  auto code = router->WaitForExit(absl::Seconds(8));
  ASSERT_TRUE(code.has_value()) << "did not exit after SIGTERM";
  EXPECT_EQ(*code, 0) << router->Log();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(8));
  EXPECT_EQ(failed.load(), 0) << failure_message;
  EXPECT_GT(ok.load(), 20);
  EXPECT_THAT(router->Log(), HasSubstr("event=shutdown_complete"));
}

TEST(RouterIntegration, ReloadsDuringTrafficWithoutFailingAnRpc) {
  TempDir dir;
  const std::string a = dir.File("a.json");
  const std::string b = dir.File("b.json");
  WriteTextFile(a, ArtifactJson({0, 1, 2, 3}, {"w0", "w1", "w2", "w3"}));
  WriteTextFile(b, ArtifactJson({3, 2, 1, 0}, {"w0", "w1", "w2", "w3"}));
  // Online refit off (on by default, every 10 s): a refit of the traffic's window would be one more
  // generation than the reloads this test counts exactly.
  auto router = MustStart(dir, {"--workers=" + WorkerFlag(4), "--centroids=" + a, "--refit_interval=0"});
  ASSERT_NE(router, nullptr);

  std::atomic<bool> stop{false};
  std::atomic<int64_t> routes{0};
  std::atomic<int64_t> failures{0};
  std::mutex generations_mu;
  std::set<uint64_t> generations;
  std::vector<std::thread> clients;
  for (int t = 0; t < 2; ++t) {
    clients.emplace_back([&, t] {
      auto stub = router->RouterStub();
      std::set<uint64_t> local;
      for (int i = 0; !stop.load(); ++i) {
        eldr::v1::RouteResponse response;
        grpc::Status status = RouteOnce(stub.get(), BlockRequest((i + t) % 4), &response);
        if (!status.ok() || !CompleteLease(stub.get(), response.lease_id()).ok()) {
          ++failures;
          continue;
        }
        ++routes;
        local.insert(response.centroid_generation());
      }
      std::lock_guard<std::mutex> lock(generations_mu);
      generations.insert(local.begin(), local.end());
    });
  }

  auto admin = router->AdminStub();
  uint64_t expected_generation = 1;
  for (int i = 0; i < 12; ++i) {
    eldr::v1::ReloadCentroidsRequest request;
    if (i % 3 == 2) {
      request.set_artifact_json(ArtifactJson({i % 4, (i + 1) % 4, (i + 2) % 4, (i + 3) % 4}, {"w0", "w1", "w2", "w3"}));
    } else {
      request.set_path(i % 2 == 0 ? b : a);
    }
    eldr::v1::ReloadCentroidsResponse response;
    auto ctx = Ctx();
    grpc::Status status = admin->ReloadCentroids(ctx.get(), request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.centroid_generation(), ++expected_generation);
    absl::SleepFor(absl::Milliseconds(40));
  }
  // SIGHUP reloads the configured file the same way.
  for (int i = 0; i < 3; ++i) {
    router->Signal(SIGHUP);
    ++expected_generation;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (State(*router).centroid_generation() < expected_generation) {
      ASSERT_LT(absl::Now(), deadline) << "SIGHUP reload did not happen";
      absl::SleepFor(absl::Milliseconds(10));
    }
    absl::SleepFor(absl::Milliseconds(40));
  }
  stop = true;
  for (auto& c : clients) c.join();

  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(routes.load(), 100);
  EXPECT_GT(generations.size(), 3u) << "routes did not observe the reloads";
  EXPECT_EQ(State(*router).centroid_generation(), expected_generation);
}

// ---- Bad input: one test per kind, each with its status code and its metric ----

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    router_ = MustStart(dir_, StandardArgs(dir_));
    ASSERT_NE(router_, nullptr);
    stub_ = router_->RouterStub();
  }

  grpc::Status Route(const eldr::v1::RouteRequest& request) {
    eldr::v1::RouteResponse response;
    return RouteOnce(stub_.get(), request, &response);
  }

  double Rejected(const std::string& reason) {
    auto metrics = ScrapeMetrics(router_->metrics_port());
    EXPECT_TRUE(metrics.ok()) << metrics.status();
    return metrics.ok() ? MetricOr(*metrics, "eldr_rejected_total", {{"reason", reason}}) : -1;
  }

  // The router still serves normally afterwards.
  void ExpectStillRouting() {
    eldr::v1::RouteResponse response;
    ASSERT_TRUE(RouteOnce(stub_.get(), BlockRequest(2), &response).ok());
    EXPECT_EQ(response.worker_id(), "w2");
  }

  TempDir dir_;
  std::unique_ptr<RouterProcess> router_;
  std::unique_ptr<eldr::v1::DecodeRouter::Stub> stub_;
};

TEST_F(BadInputTest, WrongGeometryIsInvalidArgument) {
  eldr::v1::RouteRequest request;
  request.mutable_counts()->set_layers(10);
  request.mutable_counts()->set_experts(10);
  request.mutable_counts()->set_int16_le(std::string(200, '\1'));
  grpc::Status status = Route(request);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("10"));
  EXPECT_EQ(Rejected("geometry"), 1);

  eldr::v1::RouteRequest vector;
  vector.mutable_vector()->add_values(1.0f);
  EXPECT_EQ(Route(vector).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Rejected("geometry"), 2);
  ExpectStillRouting();
}

TEST_F(BadInputTest, NanIsInvalidArgument) {
  eldr::v1::RouteRequest request;
  for (int i = 0; i < kLayers * kExperts; ++i) request.mutable_vector()->add_values(i == 7 ? NAN : 0.5f);
  grpc::Status status = Route(request);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Rejected("non_finite"), 1);
  ExpectStillRouting();
}

TEST_F(BadInputTest, NegativeCountIsInvalidArgument) {
  eldr::v1::RouteRequest request;
  request.mutable_counts()->set_layers(kLayers);
  request.mutable_counts()->set_experts(kExperts);
  for (int i = 0; i < kLayers * kExperts; ++i)
    request.mutable_counts()->mutable_values()->add_values(i == 100 ? -3 : 1);
  grpc::Status status = Route(request);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Rejected("negative_count"), 1);

  // A negative int16 (0xffff = -1) is rejected the same way.
  eldr::v1::RouteRequest int16 = BlockRequest(1);
  (*int16.mutable_counts()->mutable_int16_le())[10] = '\xff';
  (*int16.mutable_counts()->mutable_int16_le())[11] = '\xff';
  EXPECT_EQ(Route(int16).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Rejected("negative_count"), 2);

  eldr::v1::RouteRequest tokens = BlockRequest(1);
  tokens.set_prompt_tokens(-1);
  EXPECT_EQ(Route(tokens).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectStillRouting();
}

TEST_F(BadInputTest, OddByteLengthIsInvalidArgument) {
  eldr::v1::RouteRequest request = BlockRequest(1);
  request.mutable_counts()->mutable_int16_le()->pop_back();
  grpc::Status status = Route(request);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("even byte length"));
  EXPECT_EQ(Rejected("wrong_encoding"), 1);
  ExpectStillRouting();
}

TEST_F(BadInputTest, MalformedRequestFieldsAreInvalidArgument) {
  eldr::v1::RouteRequest no_data;
  no_data.mutable_counts()->set_layers(kLayers);
  no_data.mutable_counts()->set_experts(kExperts);
  EXPECT_EQ(Route(no_data).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Rejected("malformed"), 1);

  eldr::v1::RouteRequest long_id = BlockRequest(1);
  long_id.set_request_id(std::string(300, 'x'));
  const grpc::Status long_id_status = Route(long_id);
  EXPECT_EQ(long_id_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(long_id_status.error_message(), HasSubstr("300 bytes"));
  EXPECT_EQ(Rejected("oversized"), 1);

  eldr::v1::RouteRequest huge = BlockRequest(1);
  huge.mutable_counts()->set_layers(1 << 20);
  huge.mutable_counts()->set_experts(1 << 20);
  EXPECT_EQ(Route(huge).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Rejected("geometry"), 1);  // beyond the largest supported geometry
  ExpectStillRouting();
}

TEST_F(BadInputTest, UnknownLeaseIsNotFound) {
  EXPECT_EQ(CompleteLease(stub_.get(), 987654321).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(CompleteLease(stub_.get(), 0).error_code(), grpc::StatusCode::NOT_FOUND);
  auto metrics = ScrapeMetrics(router_->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(MetricOr(*metrics, "eldr_complete_requests_total", {{"outcome", "not_found"}}), 2);
}

TEST_F(BadInputTest, UnknownWorkerIsNotFound) {
  auto admin = router_->AdminStub();
  eldr::v1::DrainWorkerRequest drain;
  drain.set_worker_id("nope");
  eldr::v1::DrainWorkerResponse drained;
  {
    auto ctx = Ctx();
    EXPECT_EQ(admin->DrainWorker(ctx.get(), drain, &drained).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  eldr::v1::RemoveWorkerRequest remove;
  remove.set_worker_id("nope");
  eldr::v1::RemoveWorkerResponse removed;
  {
    auto ctx = Ctx();
    EXPECT_EQ(admin->RemoveWorker(ctx.get(), remove, &removed).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  // On the report stream an unknown worker is counted and the stream goes on.
  eldr::v1::ReportLoadResponse summary = Report(*router_, {Load("nope", 3), Load("w1", 4)});
  EXPECT_EQ(summary.accepted(), 1);
  EXPECT_EQ(summary.rejected(), 1);
  EXPECT_THAT(summary.last_error(), HasSubstr("nope"));
  EXPECT_EQ(Rejected("unknown_worker"), 3);

  eldr::v1::ReportLoadResponse bad_values = Report(*router_, {Load("w1", -1), Load("w1", NAN)});
  EXPECT_EQ(bad_values.rejected(), 2);

  eldr::v1::UpsertWorkerRequest upsert;
  upsert.mutable_worker()->set_id("");
  upsert.mutable_worker()->set_address("10.0.0.9:1");
  eldr::v1::UpsertWorkerResponse upserted;
  {
    auto ctx = Ctx();
    EXPECT_EQ(admin->UpsertWorker(ctx.get(), upsert, &upserted).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  upsert.mutable_worker()->set_id("w9");
  upsert.mutable_worker()->set_capacity(-1);
  {
    auto ctx = Ctx();
    EXPECT_EQ(admin->UpsertWorker(ctx.get(), upsert, &upserted).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
}

TEST_F(BadInputTest, BadArtifactReloadIsRejectedAndOldCentroidsStay) {
  auto admin = router_->AdminStub();
  auto reload = [&](const eldr::v1::ReloadCentroidsRequest& request) {
    eldr::v1::ReloadCentroidsResponse response;
    auto ctx = Ctx();
    return admin->ReloadCentroids(ctx.get(), request, &response);
  };
  eldr::v1::ReloadCentroidsRequest garbage;
  garbage.set_artifact_json("{ not json");
  EXPECT_EQ(reload(garbage).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  eldr::v1::ReloadCentroidsRequest three_rows;
  three_rows.set_artifact_json(ArtifactJson({0, 1, 2}));  // 3 unnamed rows for 4 workers
  grpc::Status mismatch = reload(three_rows);
  EXPECT_EQ(mismatch.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_FALSE(mismatch.error_message().empty());

  eldr::v1::ReloadCentroidsRequest unknown_names;
  unknown_names.set_artifact_json(ArtifactJson({0, 1, 2, 3}, {"w0", "w1", "w2", "zz"}));
  EXPECT_EQ(reload(unknown_names).error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  eldr::v1::ReloadCentroidsRequest missing;
  missing.set_path(dir_.File("does-not-exist.json"));
  grpc::Status not_found = reload(missing);
  // One answer whatever the cause (missing, outside the folder, a loop), so a caller learns nothing
  // about the router's file system.
  EXPECT_EQ(not_found.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(not_found.error_message(), HasSubstr("not a file inside the allowed directory"));

  // SIGHUP with a broken configured file: rejected as well.
  WriteTextFile(dir_.File("artifact.json"), "[1, 2");
  router_->Signal(SIGHUP);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (router_->Log().find("event=centroids_rejected source=sighup") == std::string::npos) {
    ASSERT_LT(absl::Now(), deadline) << router_->Log();
    absl::SleepFor(absl::Milliseconds(10));
  }

  EXPECT_EQ(State(*router_).centroid_generation(), 1u);
  ExpectStillRouting();
  auto metrics = ScrapeMetrics(router_->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  // Four RPCs and the SIGHUP; the --centroids file watch may have tried the broken file as well.
  // Every refusal is counted by its source; only the startup artifact was ever installed.
  EXPECT_EQ(MetricOr(*metrics, "eldr_centroid_reloads_total", {{"outcome", "error"}, {"source", "admin"}}), 4);
  EXPECT_EQ(MetricOr(*metrics, "eldr_centroid_reloads_total", {{"outcome", "error"}, {"source", "sighup"}}), 1);
  EXPECT_EQ(MetricOr(*metrics, "eldr_centroid_reloads_total", {{"outcome", "ok"}, {"source", "startup"}}), 1);
  for (const char* source : {"admin", "sighup", "file_watch", "refit"}) {
    EXPECT_EQ(MetricOr(*metrics, "eldr_centroid_reloads_total", {{"outcome", "ok"}, {"source", source}}), 0) << source;
  }
}

// Over --max_message_bytes: INVALID_ARGUMENT with the sizes, counted as oversized. Over four times
// the limit gRPC's transport refuses the message before any handler (RESOURCE_EXHAUSTED).
TEST(RouterIntegration, OversizedMessageIsInvalidArgumentAndCounted) {
  TempDir dir;
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--max_message_bytes=65536");
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();
  eldr::v1::RouteRequest request;
  for (int i = 0; i < 40000; ++i) request.mutable_vector()->add_values(0.5f);  // 160 kB
  eldr::v1::RouteResponse response;
  grpc::Status status = RouteOnce(stub.get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("at most 65536"));
  // Packed int32 counts over the limit as well (the handler's size bound is not the exact size).
  eldr::v1::RouteRequest counts;
  counts.mutable_counts()->set_layers(kLayers);
  counts.mutable_counts()->set_experts(kExperts);
  for (int i = 0; i < 30000; ++i) counts.mutable_counts()->mutable_values()->add_values(1 << 28);  // 150 kB
  EXPECT_EQ(RouteOnce(stub.get(), counts, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  eldr::v1::RouteRequest huge;
  for (int i = 0; i < 80000; ++i) huge.mutable_vector()->add_values(0.5f);  // 320 kB > 4 x 64 KiB
  EXPECT_EQ(RouteOnce(stub.get(), huge, &response).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  auto metrics = ScrapeMetrics(router->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(MetricOr(*metrics, "eldr_rejected_total", {{"reason", "oversized"}}), 2);
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(2), &response).ok());
  EXPECT_EQ(response.worker_id(), "w2");
}

TEST(RouterIntegration, LeasesExpireAndLateCompleteIsNotFound) {
  TempDir dir;
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--lease_ttl=200ms");
  args.push_back("--lease_expiry_interval=50ms");
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();
  eldr::v1::RouteResponse response;
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(0), &response).ok());
  EXPECT_EQ(State(*router).live_leases(), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (State(*router).live_leases() != 0) {
    ASSERT_LT(absl::Now(), deadline);
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(State(*router).leases_expired_total(), 1);
  EXPECT_EQ(CompleteLease(stub.get(), response.lease_id()).error_code(), grpc::StatusCode::NOT_FOUND);
  auto metrics = ScrapeMetrics(router->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(MetricOr(*metrics, "eldr_leases_expired_total", {}), 1);
  EXPECT_EQ(MetricOr(*metrics, "eldr_worker_inflight", {{"worker", "w0"}}), 0);
}

TEST(RouterIntegration, MetricsScrapeHasEveryDocumentedMetric) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();
  eldr::v1::RouteResponse response;
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(2), &response).ok());           // lease left open on w2
  ASSERT_TRUE(RouteOnce(stub.get(), eldr::v1::RouteRequest(), &response).ok());  // fallback
  ASSERT_TRUE(CompleteLease(stub.get(), response.lease_id()).ok());
  eldr::v1::RouteRequest bad;
  bad.mutable_counts()->set_layers(3);
  bad.mutable_counts()->set_experts(3);
  bad.mutable_counts()->set_int16_le(std::string(18, '\0'));
  ASSERT_FALSE(RouteOnce(stub.get(), bad, &response).ok());
  Report(*router, {Load("w1", 7)});

  auto body = HttpGet(router->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  auto parsed = ParsePrometheusText(*body);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << *body;
  const ParsedMetrics& m = *parsed;

  for (const char* family :
       {"eldr_route_requests_total", "eldr_route_duration_seconds", "eldr_band_size", "eldr_route_similarity",
        "eldr_worker_inflight", "eldr_worker_reported_load", "eldr_worker_report_age_seconds", "eldr_fallback_total",
        "eldr_rejected_total", "eldr_leases_expired_total", "eldr_centroid_generation", "eldr_complete_requests_total",
        "eldr_load_reports_total", "eldr_centroid_reloads_total", "eldr_admin_refused_total",
        "process_resident_memory_bytes", "process_cpu_seconds_total"}) {
    EXPECT_TRUE(m.types.count(family)) << "no # TYPE line for " << family;
  }
  EXPECT_EQ(m.types.at("eldr_route_duration_seconds"), "histogram");
  EXPECT_EQ(m.types.at("eldr_route_requests_total"), "counter");
  EXPECT_EQ(m.types.at("eldr_worker_inflight"), "gauge");

  EXPECT_EQ(MetricOr(m, "eldr_route_requests_total", {{"policy", "eldr"}, {"outcome", "ok"}}), 1);
  EXPECT_EQ(MetricOr(m, "eldr_route_requests_total", {{"policy", "jsq"}, {"outcome", "fallback"}}), 1);
  EXPECT_EQ(MetricOr(m, "eldr_route_requests_total", {{"policy", "eldr"}, {"outcome", "invalid"}}), 1);
  EXPECT_EQ(MetricOr(m, "eldr_route_duration_seconds_count", {}), 3);
  EXPECT_EQ(MetricOr(m, "eldr_route_duration_seconds_bucket", {{"le", "1e-06"}}, -1) >= 0, true);
  EXPECT_EQ(MetricOr(m, "eldr_route_duration_seconds_bucket", {{"le", "0.01"}}), 3);
  EXPECT_EQ(MetricOr(m, "eldr_band_size_count", {}), 1);
  EXPECT_EQ(MetricOr(m, "eldr_route_similarity_count", {}), 1);
  EXPECT_NEAR(MetricOr(m, "eldr_route_similarity_sum", {}), 0.5, 0.01);
  EXPECT_EQ(MetricOr(m, "eldr_worker_inflight", {{"worker", "w2"}}), 1);
  EXPECT_EQ(MetricOr(m, "eldr_worker_inflight", {{"worker", "w0"}}), 0);
  EXPECT_EQ(MetricOr(m, "eldr_worker_reported_load", {{"worker", "w1"}}), 7);
  EXPECT_GE(MetricOr(m, "eldr_worker_report_age_seconds", {{"worker", "w1"}}), 0);
  EXPECT_FALSE(m.Value("eldr_worker_report_age_seconds", {{"worker", "w3"}}).has_value())
      << "a worker that never reported has no report age";
  EXPECT_EQ(MetricOr(m, "eldr_fallback_total", {{"reason", "no_signature"}}), 1);
  EXPECT_EQ(MetricOr(m, "eldr_rejected_total", {{"reason", "geometry"}}), 1);
  EXPECT_EQ(MetricOr(m, "eldr_leases_expired_total", {}), 0);
  EXPECT_EQ(MetricOr(m, "eldr_centroid_generation", {}), 1);
  EXPECT_EQ(MetricOr(m, "eldr_load_reports_total", {{"outcome", "accepted"}}), 1);
  EXPECT_GT(MetricOr(m, "process_resident_memory_bytes", {}), 1e6);
}

TEST(RouterIntegration, ConfigFileSettingsAreOverriddenByFlags) {
  TempDir dir;
  const std::string config = dir.File("router.json");
  WriteTextFile(config, R"({
    "policy": "eldr",
    "tau": 0.3,
    "lease_ttl": "30s",
    "log_format": "json",
    "workers": [{"id": "a", "address": "10.1.0.1:8000", "capacity": 2},
                {"id": "b", "address": "10.1.0.2:8000", "max_inflight": 8}]
  })");
  auto router = MustStart(dir, {"--config=" + config, "--tau=0.2"});
  ASSERT_NE(router, nullptr);
  const auto state = State(*router);
  EXPECT_DOUBLE_EQ(state.tau(), 0.2);
  EXPECT_EQ(state.policy(), "eldr");
  ASSERT_EQ(state.workers_size(), 2);
  EXPECT_DOUBLE_EQ(state.workers(0).worker().capacity(), 2);
  EXPECT_EQ(state.workers(1).worker().max_inflight(), 8);
  // JSON logs: every line is one object.
  EXPECT_THAT(router->Log(), HasSubstr("{\"ts\":"));
  EXPECT_THAT(router->Log(), HasSubstr("\"event\":\"router_started\""));
  // The scan's instruction-set path, as this machine runs it.
  EXPECT_THAT(router->Log(), HasSubstr(absl::StrCat("\"simd\":\"", ScoringKernelsName(), "\"")));
}

TEST(RouterIntegration, AcceptsEveryLimitAndKeepaliveFlag) {
  TempDir dir;
  std::vector<std::string> args = StandardArgs(dir);
  for (const char* flag :
       {"--max_message_bytes=262144", "--admin_max_message_bytes=1048576", "--max_concurrent_streams=16",
        "--keepalive_time=30s", "--keepalive_timeout=5s", "--keepalive_min_ping_interval=5s",
        "--keepalive_permit_without_calls=false", "--max_connection_idle=10m", "--max_connection_age=1h",
        "--max_connection_age_grace=30s", "--snapshot_staleness=2s", "--seed=42", "--log_level=debug"}) {
    args.push_back(flag);
  }
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();
  eldr::v1::RouteResponse response;
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(3), &response).ok());
  EXPECT_EQ(response.worker_id(), "w3");
}

// --max_concurrent_streams is enforced per connection: with a limit of 1, a Route on the connection
// of an open ReportLoad stream waits (the client queues it) until the stream ends.
TEST(RouterIntegration, MaxConcurrentStreamsIsEnforcedPerConnection) {
  TempDir dir;
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--max_concurrent_streams=1");
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();
  eldr::v1::RouteResponse response;
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(1), &response).ok());  // connected, limit known

  grpc::ClientContext stream_ctx;
  stream_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  eldr::v1::ReportLoadResponse summary;
  auto writer = stub->ReportLoad(&stream_ctx, &summary);
  ASSERT_TRUE(writer->Write(Load("w0", 1)));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
    EXPECT_EQ(stub->Route(&ctx, BlockRequest(1), &response).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  ASSERT_TRUE(writer->WritesDone());
  ASSERT_TRUE(writer->Finish().ok());
  EXPECT_EQ(summary.accepted(), 1);
  ASSERT_TRUE(RouteOnce(stub.get(), BlockRequest(1), &response).ok());
  EXPECT_EQ(response.worker_id(), "w1");
}

TEST(RouterIntegration, StartupErrorsSayWhatIsWrong) {
  TempDir dir;
  const std::string router = BinaryPath("eldr-router");
  const std::string three = dir.File("three.json");
  WriteTextFile(three, ArtifactJson({0, 1, 2}));
  const std::string named = dir.File("named.json");
  WriteTextFile(named, ArtifactJson({0, 1, 2, 3}, {"w0", "w1", "w2", "zz"}));
  const std::string bad_config = dir.File("bad.json");
  WriteTextFile(bad_config, R"({"tua": 0.2})");

  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--workers=" + WorkerFlag(4), "--centroids=" + three, "--listen=127.0.0.1:0"}, "does not fit --workers"},
      {{"--workers=" + WorkerFlag(4), "--centroids=" + named, "--listen=127.0.0.1:0"}, "zz"},
      {{"--workers=" + WorkerFlag(2), "--policy=fastest", "--listen=127.0.0.1:0"}, "policy"},
      {{"--config=" + bad_config, "--listen=127.0.0.1:0"}, "tua"},
      {{"--workers=a=1.2.3.4:5,a=1.2.3.4:6", "--listen=127.0.0.1:0"}, "duplicate worker id 'a'"},
      {{"--workers=" + WorkerFlag(2), "--tau=1.5", "--listen=127.0.0.1:0"}, "tau"},
      {{"--workers=" + WorkerFlag(2), "--tls_cert=" + three, "--listen=127.0.0.1:0"}, "tls_cert and tls_key"},
      {{"--workers=" + WorkerFlag(2), "--centroids=" + dir.File("missing.json"), "--listen=127.0.0.1:0"},
       "missing.json"},
      {{"--workers=" + WorkerFlag(2), "--listen=256.0.0.1:99999", "--metrics_listen="}, "cannot listen"},
  };
  for (Case c : cases) {
    if (c.args.back() != "--metrics_listen=") c.args.push_back("--metrics_listen=");
    ProcessResult result = RunProcess(router, c.args, absl::Seconds(30));
    EXPECT_EQ(result.exit_code, 1) << absl::StrJoin(c.args, " ") << "\n" << result.stderr_text;
    EXPECT_THAT(result.stderr_text, HasSubstr(c.message)) << absl::StrJoin(c.args, " ");
    EXPECT_THAT(result.stderr_text, HasSubstr("level=error"));
  }
}

// grpcurl-style discovery: the reflection service lists the API.
// The services `target` lists through reflection (a grpcurl-style list_services).
std::string ReflectedServices(const std::string& target) {
  grpc::GenericStub generic(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto call = generic.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](intptr_t expected) {
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), expected);
    return ok;
  };
  std::string text;
  call->StartCall(reinterpret_cast<void*>(1));
  if (step(1)) {
    // ServerReflectionRequest{list_services: "*"}: field 7, length-delimited.
    const std::string request_bytes = std::string("\x3a\x01*", 3);
    grpc::Slice slice(request_bytes);
    grpc::ByteBuffer request(&slice, 1);
    call->Write(request, reinterpret_cast<void*>(2));
    step(2);
    grpc::ByteBuffer reply;
    call->Read(&reply, reinterpret_cast<void*>(3));
    if (step(3)) {
      std::vector<grpc::Slice> slices;
      EXPECT_TRUE(reply.Dump(&slices).ok());
      for (const auto& s : slices) text.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    call->WritesDone(reinterpret_cast<void*>(4));
    step(4);
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  EXPECT_TRUE(status.ok()) << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return text;
}

// grpcurl-style discovery: the reflection service lists the API on each listener, and the admin
// service only on its own (loopback) listener.
TEST(RouterIntegration, ReflectionListsTheServices) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  const std::string data = ReflectedServices(router->target());
  EXPECT_THAT(data, HasSubstr("eldr.v1.DecodeRouter"));
  EXPECT_THAT(data, HasSubstr("grpc.health.v1.Health"));
  EXPECT_THAT(data, Not(HasSubstr("eldr.v1.RouterAdmin")));
  const std::string admin = ReflectedServices(router->admin_target());
  EXPECT_THAT(admin, HasSubstr("eldr.v1.RouterAdmin"));
  EXPECT_THAT(admin, HasSubstr("grpc.health.v1.Health"));
}

}  // namespace
}  // namespace eldr::testing
