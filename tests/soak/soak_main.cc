// eldr-soak: the real eldr-router daemon under eldr-bench load while everything around it
// misbehaves, for a chosen duration:
//  - decode workers (in-process fake vLLM metrics endpoints) that go down, hang, serve malformed
//    pages or HTTP errors, and come back, while the daemon scrapes them;
//  - a centroid reload every few seconds (SIGHUP after rewriting the file, admin ReloadCentroids
//    inline, and bad artifacts that must be refused);
//  - malformed requests mixed in (wrong geometry, odd byte counts, negative counts, NaN vectors,
//    oversized messages, unknown leases, bad load reports, raw garbage on the gRPC port);
//  - Routes whose Complete is dropped at random (their leases must expire), and late Completes.
// It passes when the daemon never crashed, answered every bad input with the documented status
// code, released every lease once they expired (in-flight back to zero on every worker), brought
// every worker back to healthy, kept its memory bounded (RSS printed at start and end), and exited
// 0 on SIGTERM. Figures are printed at the end (--json for one JSON object).
//
//   eldr-soak --bin_dir=build/bin --data_dir=data --duration_s=600
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/loadsignals/prom_text.h"
#include "eldr/v1/router.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "loadsignals/fake_metrics_server.h"
#include "nlohmann/json.hpp"
#include "testing/process.h"

ABSL_FLAG(double, duration_s, 25, "Seconds of load (eldr-bench's measured window).");
ABSL_FLAG(std::string, bin_dir, "", "Folder of eldr-router and eldr-bench (default: $ELDR_BIN_DIR).");
ABSL_FLAG(std::string, data_dir, "", "The bundled data folder with esft-routing/ (default: $ELDR_DATA_DIR).");
ABSL_FLAG(int, workers, 4, "Fake decode workers.");
ABSL_FLAG(int, concurrency, 4, "eldr-bench's closed-loop slots.");
ABSL_FLAG(double, lease_ttl_s, 2, "The daemon's --lease_ttl: dropped Completes expire after it.");
ABSL_FLAG(double, reload_every_s, 3, "Seconds between centroid reloads.");
ABSL_FLAG(int, chaos_every_ms, 600, "Milliseconds between two changes of a worker's metrics endpoint.");
ABSL_FLAG(int, malformed_per_s, 20, "Malformed requests per second.");
ABSL_FLAG(double, drop_complete_fraction, 0.3, "Fraction of the soak client's Routes whose Complete is dropped.");
ABSL_FLAG(double, max_rss_growth_mib, 64, "Largest tolerated RSS growth between warm-up and the end.");
ABSL_FLAG(bool, hostile, true,
          "Add the hostile mix: stray HTTP and idle connections on the metrics port, admin calls without "
          "credentials, SIGHUP storms, lease floods without Complete, idle ReportLoad streams, reload paths "
          "outside the artifact folder.");
ABSL_FLAG(bool, json, false, "Print the figures as one JSON object.");
ABSL_FLAG(bool, keep_dir, false, "Keep the scratch folder (logs, artifacts) for inspection.");

namespace {

using eldr::testing::ChildProcess;
using eldr::testing::FakeLoad;
using eldr::testing::FakeMetricsServer;
namespace v1 = eldr::v1;

constexpr int kLayers = 26;  // the bundled DeepSeek-V2-Lite traces that eldr-bench replays
constexpr int kExperts = 64;

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

// Random unit centroids (variant count, every layer) for workers w0..w<n-1>.
eldr::CentroidArtifact RandomArtifact(int workers, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  eldr::CentroidArtifact artifact;
  artifact.spec.layers = kLayers;
  artifact.spec.experts = kExperts;
  artifact.spec.variant = eldr::SignatureVariant::kCount;
  artifact.k = workers;
  artifact.model = "soak";
  artifact.seed = seed;
  const int dim = artifact.spec.dim();
  for (int w = 0; w < workers; ++w) {
    double norm = 0;
    std::vector<float> row(static_cast<size_t>(dim));
    for (float& v : row) {
      v = uniform(rng) < 0.2f ? uniform(rng) : 0.0f;
      norm += static_cast<double>(v) * v;
    }
    if (norm == 0) row[0] = 1, norm = 1;
    for (float& v : row) artifact.centroids.push_back(static_cast<float>(v / std::sqrt(norm)));
    artifact.workers.push_back(absl::StrCat("w", w));
  }
  return artifact;
}

// A valid request: a few experts per layer, as int16 little-endian counts.
v1::RouteRequest ValidRequest(std::mt19937_64& rng, int index) {
  v1::RouteRequest request;
  request.set_request_id(absl::StrCat("soak-", index));
  request.set_prompt_tokens(64);
  v1::ExpertCounts* counts = request.mutable_counts();
  counts->set_layers(kLayers);
  counts->set_experts(kExperts);
  std::string bytes(static_cast<size_t>(kLayers) * kExperts * 2, '\0');
  std::uniform_int_distribution<int> expert(0, kExperts - 1);
  for (int l = 0; l < kLayers; ++l) {
    for (int k = 0; k < 6; ++k) {
      const size_t cell = static_cast<size_t>(l) * kExperts + expert(rng);
      bytes[2 * cell] = static_cast<char>(static_cast<uint8_t>(bytes[2 * cell]) + 10);
    }
  }
  counts->set_int16_le(std::move(bytes));
  return request;
}

// Figures and verdicts, shared by every thread.
class Tally {
 public:
  void Count(const std::string& what, int64_t n = 1) {
    absl::MutexLock lock(&mu_);
    counts_[what] += n;
  }
  // An answer that differs from the documented one.
  void Unexpected(const std::string& what, const grpc::Status& got) {
    absl::MutexLock lock(&mu_);
    counts_["unexpected"] += 1;
    if (unexpected_.size() < 20) {
      unexpected_.push_back(absl::StrCat(what, ": got code ", got.error_code(), " '", got.error_message(), "'"));
    }
  }
  void Fail(const std::string& why) {
    absl::MutexLock lock(&mu_);
    failures_.push_back(why);
  }
  std::map<std::string, int64_t> counts() const {
    absl::MutexLock lock(&mu_);
    return counts_;
  }
  std::vector<std::string> failures() const {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> all = failures_;
    for (const std::string& u : unexpected_) all.push_back("unexpected answer: " + u);
    return all;
  }

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, int64_t> counts_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> unexpected_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> failures_ ABSL_GUARDED_BY(mu_);
};

grpc::Status WithDeadline(const std::function<grpc::Status(grpc::ClientContext*)>& call) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return call(&context);
}

// An admin RPC with the soak's bearer token.
grpc::Status AsAdmin(const std::function<grpc::Status(grpc::ClientContext*)>& call) {
  return WithDeadline([&](grpc::ClientContext* context) {
    context->AddMetadata("authorization", "Bearer soak-admin-token");
    return call(context);
  });
}

// Sends one malformed input of kind `kind`; checks the documented answer.
void SendMalformed(int kind, v1::DecodeRouter::Stub& stub, int grpc_port, std::mt19937_64& rng, Tally& tally) {
  v1::RouteResponse response;
  auto route = [&](const v1::RouteRequest& request) {
    return WithDeadline([&](grpc::ClientContext* c) { return stub.Route(c, request, &response); });
  };
  auto expect = [&](const std::string& what, const grpc::Status& status, grpc::StatusCode code) {
    tally.Count(absl::StrCat("malformed.", what));
    if (status.error_code() != code) tally.Unexpected(what, status);
  };
  v1::RouteRequest request = ValidRequest(rng, -1);
  switch (kind) {
    case 0: {  // wrong geometry
      request.mutable_counts()->set_layers(kLayers - 1);
      expect("geometry", route(request), grpc::StatusCode::INVALID_ARGUMENT);
      break;
    }
    case 1: {  // odd int16 byte count
      request.mutable_counts()->mutable_int16_le()->pop_back();
      expect("odd_bytes", route(request), grpc::StatusCode::INVALID_ARGUMENT);
      break;
    }
    case 2: {  // negative packed count
      v1::RouteRequest negative;
      negative.mutable_counts()->set_layers(kLayers);
      negative.mutable_counts()->set_experts(kExperts);
      auto* values = negative.mutable_counts()->mutable_values()->mutable_values();
      values->Resize(kLayers * kExperts, 1);
      values->Set(static_cast<int>(rng() % (kLayers * kExperts)), -5);
      expect("negative", route(negative), grpc::StatusCode::INVALID_ARGUMENT);
      break;
    }
    case 3: {  // NaN in a transformed vector
      v1::RouteRequest nan;
      auto* values = nan.mutable_vector()->mutable_values();
      values->Resize(kLayers * kExperts, 0.01f);
      values->Set(7, std::numeric_limits<float>::quiet_NaN());
      expect("nan_vector", route(nan), grpc::StatusCode::INVALID_ARGUMENT);
      break;
    }
    case 4: {  // vector of the wrong dimension
      v1::RouteRequest short_vector;
      short_vector.mutable_vector()->mutable_values()->Resize(13, 0.5f);
      expect("vector_dim", route(short_vector), grpc::StatusCode::INVALID_ARGUMENT);
      break;
    }
    case 5: {  // larger than --max_message_bytes (1 MiB by default): refused by the handler, or
               // beyond 4 MiB by gRPC's transport
      if (rng() % 2 == 0) {
        request.mutable_counts()->mutable_int16_le()->assign(2 << 20, '\1');
        expect("oversized", route(request), grpc::StatusCode::INVALID_ARGUMENT);
      } else {
        request.mutable_counts()->mutable_int16_le()->assign(5 << 20, '\1');
        expect("oversized_transport", route(request), grpc::StatusCode::RESOURCE_EXHAUSTED);
      }
      break;
    }
    case 6: {  // unknown lease
      v1::CompleteRequest complete;
      complete.set_lease_id((uint64_t{1} << 62) + rng() % 1000);
      v1::CompleteResponse done;
      expect("unknown_lease", WithDeadline([&](grpc::ClientContext* c) { return stub.Complete(c, complete, &done); }),
             grpc::StatusCode::NOT_FOUND);
      break;
    }
    case 7: {  // request id over the limit, negative prompt length
      request.set_request_id(std::string(300, 'x'));
      expect("long_request_id", route(request), grpc::StatusCode::INVALID_ARGUMENT);
      request.set_request_id("neg");
      request.set_prompt_tokens(-1);
      expect("negative_prompt", route(request), grpc::StatusCode::INVALID_ARGUMENT);
      break;
    }
    case 8: {  // load reports: unknown worker and NaN values are rejected, the stream goes on
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      v1::ReportLoadResponse summary;
      auto writer = stub.ReportLoad(&context, &summary);
      v1::LoadReport report;
      report.set_worker_id("no-such-worker");
      report.set_running(1);
      writer->Write(report);
      report.set_worker_id("w0");
      report.set_running(std::numeric_limits<double>::quiet_NaN());
      writer->Write(report);
      writer->WritesDone();
      const grpc::Status status = writer->Finish();
      tally.Count("malformed.load_reports");
      if (!status.ok()) {
        tally.Unexpected("load_reports", status);
      } else if (summary.rejected() != 2 || summary.accepted() != 0) {
        tally.Fail(absl::StrCat("ReportLoad with 2 bad reports answered accepted=", summary.accepted(),
                                " rejected=", summary.rejected()));
      }
      break;
    }
    default: {  // raw garbage on the gRPC port: not HTTP/2 at all
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in address{};
      address.sin_family = AF_INET;
      address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      address.sin_port = htons(static_cast<uint16_t>(grpc_port));
      if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
        std::string garbage(256 + rng() % 4096, '\0');
        for (char& c : garbage) c = static_cast<char>(rng());
        (void)!send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL);
        tally.Count("malformed.raw_garbage");
      }
      if (fd >= 0) close(fd);
      break;
    }
  }
}

struct Figures {
  int64_t rss_start_kib = 0;
  int64_t rss_warm_kib = 0;
  int64_t rss_max_kib = 0;
  int64_t rss_end_kib = 0;
  double bench_routes = 0;
  double bench_rps = 0;
  double bench_errors = 0;
  double bench_p99_us = 0;
  int64_t live_leases_end = -1;
  int64_t leases_expired = 0;
  double seconds_to_drain = 0;
  std::map<std::string, double> daemon_metrics;
};

// Sums the samples of `name` on a Prometheus page whose labels include `label`=`value` (all
// samples when `label` is empty).
double SumOf(const eldr::PromPage& page, const std::string& name, const std::string& label = "",
             const std::string& value = "") {
  double sum = 0;
  for (const eldr::PromSample& sample : page.samples) {
    if (sample.name != name) continue;
    if (!label.empty()) {
      const std::string* got = sample.Label(label);
      if (got == nullptr || *got != value) continue;
    }
    sum += sample.value;
  }
  return sum;
}

int Run() {
  const std::string bin_dir =
      absl::GetFlag(FLAGS_bin_dir).empty() ? EnvOr("ELDR_BIN_DIR", "") : absl::GetFlag(FLAGS_bin_dir);
  const std::string data_dir =
      absl::GetFlag(FLAGS_data_dir).empty() ? EnvOr("ELDR_DATA_DIR", "data") : absl::GetFlag(FLAGS_data_dir);
  const double duration_s = absl::GetFlag(FLAGS_duration_s);
  const int workers = absl::GetFlag(FLAGS_workers);
  const absl::Duration lease_ttl = absl::Seconds(absl::GetFlag(FLAGS_lease_ttl_s));
  if (bin_dir.empty() || workers < 1 || duration_s <= 0) {
    std::fprintf(stderr, "eldr-soak: need --bin_dir (or ELDR_BIN_DIR), --workers >= 1, --duration_s > 0\n");
    return 2;
  }
  eldr::testing::TempDir dir;
  Tally tally;
  Figures figures;
  std::mt19937_64 rng(20240601);

  // ---- Fake decode workers and their metrics endpoints ----
  std::vector<std::unique_ptr<FakeMetricsServer>> servers;
  std::vector<std::string> worker_flag, metrics_flag;
  for (int w = 0; w < workers; ++w) {
    auto server = FakeMetricsServer::Start("soak-model");
    if (!server.ok()) {
      std::fprintf(stderr, "eldr-soak: %s\n", std::string(server.status().message()).c_str());
      return 1;
    }
    (*server)->SetLoad({static_cast<double>(w), 0, 0.1});
    worker_flag.push_back(absl::StrCat("w", w, "=10.0.0.", w + 1, ":8000"));
    metrics_flag.push_back(absl::StrCat("w", w, "=", (*server)->url()));
    servers.push_back(std::move(*server));
  }

  // ---- Centroid artifacts: two good ones to alternate, one bad ----
  const std::string artifact_a = eldr::SerializeCentroidArtifact(RandomArtifact(workers, 1));
  const std::string artifact_b = eldr::SerializeCentroidArtifact(RandomArtifact(workers, 2));
  const std::string centroids_path = dir.File("centroids.json");
  if (!eldr::WriteFileAtomically(centroids_path, artifact_a).ok()) return 1;

  // ---- The daemon ----
  const std::string port_file = dir.File("ports.json");
  const std::string admin_token_file = dir.File("admin.token");
  if (!eldr::WriteFileAtomically(admin_token_file, "soak-admin-token\n").ok()) return 1;
  std::vector<std::string> router_args = {
      bin_dir + "/eldr-router",
      "--listen=127.0.0.1:0",
      "--admin_listen=127.0.0.1:0",
      "--metrics_listen=127.0.0.1:0",
      "--port_file=" + port_file,
      "--centroids=" + centroids_path,
      "--workers=" + absl::StrJoin(worker_flag, ","),
      "--policy=eldr",
      "--tau=0.1",
      absl::StrCat("--lease_ttl=", absl::FormatDuration(lease_ttl)),
      "--lease_expiry_interval=200ms",
      "--snapshot_staleness=1s",
      "--worker_metrics=" + absl::StrJoin(metrics_flag, ","),
      "--scrape_interval=50ms",
      "--scrape_timeout=250ms",
      "--unhealthy_after_failures=3",
      "--admin_token_file=" + admin_token_file,
      "--report_stream_idle_timeout=2s",
      "--max_report_streams_per_peer=16",
      "--log_level=warning",
  };
  auto router = ChildProcess::Spawn(router_args, dir.File("router.log"));
  if (!router.ok()) {
    std::fprintf(stderr, "eldr-soak: %s\n", std::string(router.status().message()).c_str());
    return 1;
  }
  auto ports = eldr::testing::WaitForPortFile(port_file, **router);
  if (!ports.ok()) {
    std::fprintf(stderr, "eldr-soak: %s\n", std::string(ports.status().message()).c_str());
    return 1;
  }
  figures.rss_start_kib = (*router)->RssKib().value_or(0);
  // Printed as it is taken (stderr: --json keeps stdout to the one report object), so a run that
  // dies midway still shows where memory started.
  std::fprintf(stderr, "eldr-soak: eldr-router RSS at start %lld KiB\n", static_cast<long long>(figures.rss_start_kib));
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", ports->grpc), grpc::InsecureChannelCredentials());
  auto stub = v1::DecodeRouter::NewStub(channel);
  auto admin = v1::RouterAdmin::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", ports->admin), grpc::InsecureChannelCredentials()));

  // ---- Load ----
  const std::string bench_json = dir.File("bench.json");
  auto bench = ChildProcess::Spawn({bin_dir + "/eldr-bench", absl::StrCat("--target=127.0.0.1:", ports->grpc),
                                    absl::StrCat("--duration_s=", duration_s), "--warmup_s=1",
                                    absl::StrCat("--concurrency=", absl::GetFlag(FLAGS_concurrency)),
                                    "--trace=" + data_dir + "/esft-routing", "--complete", "--json"},
                                   dir.File("bench.log"), bench_json);
  if (!bench.ok()) {
    std::fprintf(stderr, "eldr-soak: %s\n", std::string(bench.status().message()).c_str());
    return 1;
  }

  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;

  // Workers' metrics endpoints misbehave, one change at a time.
  threads.emplace_back([&] {
    std::mt19937_64 local(7);
    const FakeMetricsServer::Mode modes[] = {FakeMetricsServer::Mode::kServe,    FakeMetricsServer::Mode::kServe,
                                             FakeMetricsServer::Mode::kServe,    FakeMetricsServer::Mode::kDown,
                                             FakeMetricsServer::Mode::kHang,     FakeMetricsServer::Mode::kMalformed,
                                             FakeMetricsServer::Mode::kHttpError};
    while (!stop.load()) {
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_chaos_every_ms)));
      FakeMetricsServer& server = *servers[local() % servers.size()];
      server.SetLoad({static_cast<double>(local() % 20), static_cast<double>(local() % 5), (local() % 100) / 100.0});
      const absl::Status changed = server.SetMode(modes[local() % std::size(modes)]);
      tally.Count(changed.ok() ? "chaos.metrics_changes" : "chaos.rebind_failures");
    }
  });

  // Centroid reloads: SIGHUP after rewriting the file, admin inline, and refused bad ones.
  threads.emplace_back([&] {
    int round = 0;
    while (!stop.load()) {
      absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_reload_every_s)));
      if (stop.load()) break;
      const std::string& next = (round % 2 == 0) ? artifact_b : artifact_a;
      switch (round % 4) {
        case 0:
        case 2: {
          if (eldr::WriteFileAtomically(centroids_path, next).ok()) {
            (*router)->Signal(SIGHUP);
            tally.Count("reload.sighup");
          }
          break;
        }
        case 1: {
          v1::ReloadCentroidsRequest request;
          request.set_artifact_json(next);
          v1::ReloadCentroidsResponse response;
          const grpc::Status status =
              AsAdmin([&](grpc::ClientContext* c) { return admin->ReloadCentroids(c, request, &response); });
          // The reload queue holds one running and one waiting load; a third is refused at once.
          if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
            tally.Count("reload.busy_refused");
          } else {
            tally.Count("reload.admin_inline");
            if (!status.ok()) tally.Unexpected("admin reload of a good artifact", status);
          }
          break;
        }
        default: {
          v1::ReloadCentroidsRequest bad;
          bad.set_artifact_json(R"({"L": 26, "e": 64, "centroids": [[1, 2]]})");
          v1::ReloadCentroidsResponse response;
          grpc::Status status =
              AsAdmin([&](grpc::ClientContext* c) { return admin->ReloadCentroids(c, bad, &response); });
          tally.Count("reload.bad_refused");
          if (status.error_code() != grpc::StatusCode::INVALID_ARGUMENT &&
              status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
            tally.Unexpected("bad artifact", status);
          }
          v1::ReloadCentroidsRequest missing;
          missing.set_path(dir.File("no-such-artifact.json"));
          status = AsAdmin([&](grpc::ClientContext* c) { return admin->ReloadCentroids(c, missing, &response); });
          // A path that does not resolve inside the artifact folder: one answer whatever the cause.
          if (status.error_code() != grpc::StatusCode::PERMISSION_DENIED &&
              status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
            tally.Unexpected("missing artifact file", status);
          }
          break;
        }
      }
      ++round;
    }
  });

  // Malformed requests.
  threads.emplace_back([&] {
    std::mt19937_64 local(11);
    const int per_second = std::max(1, absl::GetFlag(FLAGS_malformed_per_s));
    int sent = 0;
    while (!stop.load()) {
      SendMalformed(static_cast<int>(sent % 10), *stub, ports->grpc, local, tally);
      ++sent;
      absl::SleepFor(absl::Seconds(1) / per_second);
    }
  });

  // Routes with dropped and late Completes.
  threads.emplace_back([&] {
    std::mt19937_64 local(13);
    std::bernoulli_distribution drop(absl::GetFlag(FLAGS_drop_complete_fraction));
    std::vector<std::pair<uint64_t, absl::Time>> dropped;
    int index = 0;
    while (!stop.load()) {
      v1::RouteResponse response;
      const v1::RouteRequest request = ValidRequest(local, index++);
      grpc::Status status = WithDeadline([&](grpc::ClientContext* c) { return stub->Route(c, request, &response); });
      if (!status.ok()) {
        tally.Unexpected("valid Route", status);
        continue;
      }
      tally.Count("client.routes");
      if (!response.fallback_reason().empty()) tally.Count("client.fallback." + response.fallback_reason());
      v1::CompleteRequest complete;
      complete.set_lease_id(response.lease_id());
      v1::CompleteResponse done;
      if (drop(local)) {
        tally.Count("client.completes_dropped");
        dropped.push_back({response.lease_id(), absl::Now()});
      } else {
        status = WithDeadline([&](grpc::ClientContext* c) { return stub->Complete(c, complete, &done); });
        tally.Count("client.completes");
        if (!status.ok()) tally.Unexpected("Complete of a live lease", status);
        // A second Complete of the same lease is never a double release.
        if (local() % 8 == 0) {
          status = WithDeadline([&](grpc::ClientContext* c) { return stub->Complete(c, complete, &done); });
          tally.Count("client.double_completes");
          if (status.error_code() != grpc::StatusCode::NOT_FOUND) tally.Unexpected("double Complete", status);
        }
      }
      // A Complete that arrives after its lease expired is NOT_FOUND.
      if (!dropped.empty() && absl::Now() - dropped.front().second > lease_ttl + absl::Seconds(1)) {
        complete.set_lease_id(dropped.front().first);
        dropped.erase(dropped.begin());
        status = WithDeadline([&](grpc::ClientContext* c) { return stub->Complete(c, complete, &done); });
        tally.Count("client.late_completes");
        if (status.error_code() != grpc::StatusCode::NOT_FOUND) tally.Unexpected("late Complete", status);
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  });

  // The hostile mix: what a port scan, a careless operator or an attacker does to a daemon.
  if (absl::GetFlag(FLAGS_hostile)) {
    threads.emplace_back([&] {
      std::mt19937_64 local(17);
      const char* methods[] = {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "CONNECT", "BREW"};
      const char* paths[] = {"/", "/metrics", "/healthz",     "/readyz",     "/favicon.ico", "/../../etc/passwd",
                             "*", "/%00",     "http://evil/", "/metrics?x=1"};
      std::vector<int> idle_http;
      struct IdleStream {
        std::unique_ptr<grpc::ClientContext> context;
        v1::ReportLoadResponse response;
        std::unique_ptr<grpc::ClientWriter<v1::LoadReport>> writer;
      };
      std::vector<std::unique_ptr<IdleStream>> idle_streams;
      int round = 0;
      while (!stop.load()) {
        ++round;
        // Stray HTTP: every request answered with a status, the daemon alive.
        const std::string request =
            absl::StrCat(methods[local() % std::size(methods)], " ", paths[local() % std::size(paths)],
                         " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        absl::StatusOr<std::string> answer = eldr::testing::HttpExchange(ports->metrics, request, absl::Seconds(5));
        const int code = answer.ok() ? eldr::testing::HttpStatusOf(*answer) : -1;
        tally.Count("hostile.stray_http");
        if (code < 200 || code >= 600)
          tally.Fail(absl::StrCat("stray HTTP '", request.substr(0, 40), "' got no status"));
        // Idle HTTP connections, up to 20 at a time, replaced now and then.
        if (idle_http.size() < 20) {
          const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
          sockaddr_in address{};
          address.sin_family = AF_INET;
          address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          address.sin_port = htons(static_cast<uint16_t>(ports->metrics));
          if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
            idle_http.push_back(fd);
            tally.Count("hostile.idle_http");
          } else if (fd >= 0) {
            close(fd);
          }
        } else {
          close(idle_http.front());
          idle_http.erase(idle_http.begin());
        }
        // Admin calls without credentials or with a wrong token.
        {
          v1::UpsertWorkerRequest upsert;
          upsert.mutable_worker()->set_id("w0");
          upsert.mutable_worker()->set_address("attacker:6666");
          v1::UpsertWorkerResponse response;
          const bool with_wrong_token = local() % 2 == 0;
          const grpc::Status status = WithDeadline([&](grpc::ClientContext* c) {
            if (with_wrong_token) c->AddMetadata("authorization", "Bearer guessed");
            return admin->UpsertWorker(c, upsert, &response);
          });
          tally.Count("hostile.admin_without_credentials");
          const grpc::StatusCode expected =
              with_wrong_token ? grpc::StatusCode::PERMISSION_DENIED : grpc::StatusCode::UNAUTHENTICATED;
          if (status.error_code() != expected) tally.Unexpected("admin call without credentials", status);
        }
        // Reload paths outside the artifact folder.
        if (round % 5 == 0) {
          v1::ReloadCentroidsRequest outside;
          outside.set_path(round % 10 == 0 ? "/dev/zero" : "/etc/shadow");
          v1::ReloadCentroidsResponse response;
          const grpc::Status status =
              AsAdmin([&](grpc::ClientContext* c) { return admin->ReloadCentroids(c, outside, &response); });
          tally.Count("hostile.reload_outside");
          if (status.error_code() != grpc::StatusCode::PERMISSION_DENIED &&
              status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
            tally.Unexpected("reload of a path outside the folder", status);
          }
        }
        // A SIGHUP storm now and then.
        if (round % 40 == 0) {
          for (int i = 0; i < 2000; ++i) (*router)->Signal(SIGHUP);
          tally.Count("hostile.sighup", 2000);
        }
        // A lease flood without Complete (expires after --lease_ttl).
        if (round % 20 == 0) {
          for (int i = 0; i < 200; ++i) {
            v1::RouteResponse response;
            const v1::RouteRequest flood = ValidRequest(local, -2);
            if (WithDeadline([&](grpc::ClientContext* c) { return stub->Route(c, flood, &response); }).ok()) {
              tally.Count("hostile.flood_routes");
            }
          }
        }
        // Idle ReportLoad streams: ended by the daemon after --report_stream_idle_timeout.
        if (idle_streams.size() < 8) {
          auto stream = std::make_unique<IdleStream>();
          stream->context = std::make_unique<grpc::ClientContext>();
          stream->context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
          stream->writer = stub->ReportLoad(stream->context.get(), &stream->response);
          idle_streams.push_back(std::move(stream));
          tally.Count("hostile.idle_streams");
        } else {
          const grpc::Status status = idle_streams.front()->writer->Finish();
          tally.Count(status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ? "hostile.idle_streams_ended"
                                                                                 : "hostile.idle_streams_other");
          idle_streams.erase(idle_streams.begin());
        }
        absl::SleepFor(absl::Milliseconds(50));
      }
      for (int fd : idle_http) close(fd);
      for (auto& stream : idle_streams) stream->context->TryCancel();
      for (auto& stream : idle_streams) (void)stream->writer->Finish();
    });
  }

  // Memory, sampled every second; the warm figure is taken once the load runs.
  const absl::Time load_start = absl::Now();
  bool warm_taken = false;
  bool router_died = false;
  while ((*bench)->Running()) {
    absl::SleepFor(absl::Milliseconds(500));
    if (!(*router)->Running()) {
      router_died = true;
      break;
    }
    const int64_t rss = (*router)->RssKib().value_or(0);
    figures.rss_max_kib = std::max(figures.rss_max_kib, rss);
    if (!warm_taken && absl::Now() - load_start > absl::Seconds(3)) {
      figures.rss_warm_kib = rss;
      warm_taken = true;
    }
    if (absl::Now() - load_start > absl::Seconds(duration_s + 60)) {
      tally.Fail("eldr-bench did not finish in time");
      break;
    }
  }
  stop.store(true);
  for (std::thread& thread : threads) thread.join();
  if (!warm_taken) figures.rss_warm_kib = figures.rss_start_kib;

  absl::StatusOr<int> bench_exit = (*bench)->Wait(absl::Seconds(10));
  if (router_died || !(*router)->Running()) {
    tally.Fail(absl::StrCat("eldr-router died during the soak; its log:\n", (*router)->Log()));
  }
  if (!bench_exit.ok() || *bench_exit != 0) {
    tally.Fail(
        absl::StrCat("eldr-bench failed (exit ", bench_exit.ok() ? *bench_exit : -1, "): ", (*bench)->Log(4000)));
  } else {
    std::string text;
    if (auto read = eldr::ReadFile(bench_json); read.ok()) text = *read;
    const nlohmann::json result = nlohmann::json::parse(text, nullptr, false);
    if (result.is_object()) {
      figures.bench_routes = result.value("requests", 0.0);
      figures.bench_rps = result.value("qps", 0.0);
      figures.bench_errors = result.value("errors", 0.0);
      figures.bench_p99_us = result.value("p99_us", 0.0);
    }
    if (figures.bench_routes <= 0) tally.Fail("eldr-bench routed nothing: " + text);
    // Its requests are all valid: whatever else goes on, none may fail.
    if (figures.bench_errors > 0) tally.Fail("eldr-bench saw errors: " + text);
  }

  // ---- Recovery: every worker answers again, every lease expires ----
  for (auto& server : servers) {
    server->SetLoad({0, 0, 0});
    if (!server->SetMode(FakeMetricsServer::Mode::kServe).ok()) tally.Fail("a fake worker could not listen again");
  }
  const absl::Time drain_start = absl::Now();
  bool drained = false;
  bool healthy = false;
  v1::GetStateResponse state;
  while (true) {
    v1::GetStateRequest request;
    const grpc::Status status = AsAdmin([&](grpc::ClientContext* c) { return admin->GetState(c, request, &state); });
    if (status.ok()) {
      drained = state.live_leases() == 0 && std::all_of(state.workers().begin(), state.workers().end(),
                                                        [](const v1::WorkerState& w) { return w.inflight() == 0; });
      healthy = std::all_of(state.workers().begin(), state.workers().end(),
                            [](const v1::WorkerState& w) { return w.healthy(); });
      if (drained && healthy) break;
    }
    if (absl::Now() - drain_start > lease_ttl + absl::Seconds(15) || !(*router)->Running()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  figures.seconds_to_drain = absl::ToDoubleSeconds(absl::Now() - drain_start);
  figures.live_leases_end = state.live_leases();
  figures.leases_expired = state.leases_expired_total();
  if (!drained) {
    std::string inflight;
    for (const v1::WorkerState& w : state.workers())
      absl::StrAppend(&inflight, " ", w.worker().id(), "=", w.inflight());
    tally.Fail(absl::StrCat("in-flight did not return to zero: live_leases=", state.live_leases(), inflight));
  }
  if (!healthy) tally.Fail("not every worker is healthy again after its metrics came back");
  if (figures.leases_expired <= 0 && tally.counts()["client.completes_dropped"] > 0) {
    tally.Fail("Completes were dropped but no lease expired");
  }

  // The daemon's own account of the run.
  if (auto page = eldr::testing::HttpGet(ports->metrics, "/metrics"); page.ok()) {
    auto parsed = eldr::ParsePromText(*page);
    if (!parsed.ok()) {
      tally.Fail(absl::StrCat("the daemon's /metrics page does not parse: ", parsed.status().message()));
    } else {
      figures.daemon_metrics["scrape_errors"] = SumOf(*parsed, "eldr_scrape_errors_total");
      figures.daemon_metrics["scrapes_ok"] = SumOf(*parsed, "eldr_scrapes_total", "outcome", "ok");
      figures.daemon_metrics["fail_open_routes"] = SumOf(*parsed, "eldr_fallback_total", "reason", "all_unhealthy");
      figures.daemon_metrics["rejected_inputs"] = SumOf(*parsed, "eldr_rejected_total");
      figures.daemon_metrics["reloads_ok"] = SumOf(*parsed, "eldr_centroid_reloads_total", "outcome", "ok");
      figures.daemon_metrics["reloads_error"] = SumOf(*parsed, "eldr_centroid_reloads_total", "outcome", "error");
      figures.daemon_metrics["complete_not_found"] =
          SumOf(*parsed, "eldr_complete_requests_total", "outcome", "not_found");
      // Every reload the driver attempted was counted: the good ones ok, the refused ones error.
      if (figures.daemon_metrics["reloads_ok"] <= 0) tally.Fail("no centroid reload succeeded");
    }
  } else {
    tally.Fail(absl::StrCat("GET /metrics failed: ", page.status().message()));
  }

  figures.rss_end_kib = (*router)->RssKib().value_or(0);
  std::fprintf(stderr, "eldr-soak: eldr-router RSS at end %lld KiB\n", static_cast<long long>(figures.rss_end_kib));
  const double growth_mib = (figures.rss_end_kib - figures.rss_warm_kib) / 1024.0;
  if (growth_mib > absl::GetFlag(FLAGS_max_rss_growth_mib)) {
    tally.Fail(absl::StrCat("RSS grew by ", growth_mib, " MiB (limit ", absl::GetFlag(FLAGS_max_rss_growth_mib), ")"));
  }

  // ---- Graceful exit ----
  (*router)->Signal(SIGTERM);
  absl::StatusOr<int> router_exit = (*router)->Wait(absl::Seconds(20));
  if (!router_exit.ok() || *router_exit != 0) {
    tally.Fail(absl::StrCat("eldr-router did not exit 0 on SIGTERM (",
                            router_exit.ok() ? absl::StrCat("exit ", *router_exit) : "still running", ")"));
  }

  // ---- Report ----
  const std::vector<std::string> failures = tally.failures();
  const std::map<std::string, int64_t> counts = tally.counts();
  nlohmann::json report = {
      {"duration_s", duration_s},
      {"workers", workers},
      {"passed", failures.empty()},
      {"rss_kib",
       {{"start", figures.rss_start_kib},
        {"warm", figures.rss_warm_kib},
        {"max", figures.rss_max_kib},
        {"end", figures.rss_end_kib}}},
      {"bench",
       {{"routes", figures.bench_routes},
        {"routes_per_s", figures.bench_rps},
        {"errors", figures.bench_errors},
        {"p99_us", figures.bench_p99_us}}},
      {"leases",
       {{"expired_total", figures.leases_expired},
        {"live_at_end", figures.live_leases_end},
        {"seconds_to_drain", figures.seconds_to_drain}}},
      {"daemon", figures.daemon_metrics},
      {"driver", counts},
      {"failures", failures},
  };
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", report.dump().c_str());
  } else {
    std::printf("eldr-soak: %.0f s, %d workers, %s\n", duration_s, workers, failures.empty() ? "PASSED" : "FAILED");
    std::printf("  RSS (KiB): start %lld, warm %lld, max %lld, end %lld (growth %.1f MiB)\n",
                static_cast<long long>(figures.rss_start_kib), static_cast<long long>(figures.rss_warm_kib),
                static_cast<long long>(figures.rss_max_kib), static_cast<long long>(figures.rss_end_kib), growth_mib);
    std::printf("  eldr-bench: %.0f routes (%.0f/s, p99 %.0f us), %.0f errors\n", figures.bench_routes,
                figures.bench_rps, figures.bench_p99_us, figures.bench_errors);
    std::printf("  leases: %lld expired, %lld live at the end (drained in %.1f s)\n",
                static_cast<long long>(figures.leases_expired), static_cast<long long>(figures.live_leases_end),
                figures.seconds_to_drain);
    for (const auto& [name, value] : figures.daemon_metrics) std::printf("  daemon %s: %.0f\n", name.c_str(), value);
    for (const auto& [name, value] : counts)
      std::printf("  driver %s: %lld\n", name.c_str(), static_cast<long long>(value));
    for (const std::string& failure : failures) std::printf("  FAILURE: %s\n", failure.c_str());
  }
  if (absl::GetFlag(FLAGS_keep_dir)) {
    std::fprintf(stderr, "eldr-soak: logs kept in %s\n", dir.path().c_str());
    // Keep the folder by moving it out of the TempDir's reach.
    const std::string kept = dir.path() + "-kept";
    (void)!std::rename(dir.path().c_str(), kept.c_str());
    std::fprintf(stderr, "eldr-soak: moved to %s\n", kept.c_str());
  }
  return failures.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Soak test of eldr-router under eldr-bench load with misbehaving workers and inputs.");
  absl::ParseCommandLine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  return Run();
}
