#include "router_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace eldr::testing {
namespace {}  // namespace

void WriteTextFile(const std::string& path, const std::string& contents) {
  absl::Status status = WriteFileAtomically(path, contents);
  ASSERT_TRUE(status.ok()) << status;
}

std::string ReadTextFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::unique_ptr<RouterProcess>> RouterProcess::Start(const TempDir& dir, std::vector<std::string> args,
                                                                    absl::Duration timeout) {
  absl::StatusOr<RouterChild> child = StartRouter(dir, std::move(args), timeout);
  if (!child.ok()) return child.status();
  std::unique_ptr<RouterProcess> p(new RouterProcess());
  p->process_ = std::move(child->process);
  p->grpc_port_ = child->ports.grpc;
  p->admin_port_ = child->ports.admin;
  p->metrics_port_ = child->ports.metrics;
  return p;
}

void RouterProcess::Signal(int signal) const { process_->Signal(signal); }

std::optional<int> RouterProcess::WaitForExit(absl::Duration timeout) {
  absl::StatusOr<int> code = process_->Wait(timeout);
  if (!code.ok()) return std::nullopt;
  return *code;
}

std::string RouterProcess::Log() const { return process_->Log(size_t{1} << 24); }

std::shared_ptr<grpc::Channel> RouterProcess::Channel() const {
  return grpc::CreateChannel(target(), grpc::InsecureChannelCredentials());
}
std::unique_ptr<eldr::v1::DecodeRouter::Stub> RouterProcess::RouterStub() const {
  return eldr::v1::DecodeRouter::NewStub(Channel());
}
std::unique_ptr<eldr::v1::RouterAdmin::Stub> RouterProcess::AdminStub() const {
  return eldr::v1::RouterAdmin::NewStub(grpc::CreateChannel(admin_target(), grpc::InsecureChannelCredentials()));
}
std::unique_ptr<grpc::health::v1::Health::Stub> RouterProcess::HealthStub() const {
  return grpc::health::v1::Health::NewStub(Channel());
}

std::string ArtifactJson(const std::vector<int>& blocks, const std::vector<std::string>& workers) {
  CentroidArtifact artifact;
  artifact.spec.layers = kLayers;
  artifact.spec.experts = kExperts;
  artifact.spec.variant = SignatureVariant::kCount;
  artifact.k = static_cast<int>(blocks.size());
  const int dim = kLayers * kExperts;
  artifact.centroids.assign(static_cast<size_t>(artifact.k) * dim, 0.f);
  const float v = 1.0f / std::sqrt(static_cast<float>(kLayers * 16));
  for (int r = 0; r < artifact.k; ++r) {
    for (int l = 0; l < kLayers; ++l) {
      for (int j = 0; j < 16; ++j) {
        artifact.centroids[static_cast<size_t>(r) * dim + l * kExperts + blocks[r] * 16 + j] = v;
      }
    }
  }
  artifact.workers = workers;
  artifact.model = "test-26x64";
  artifact.seed = 7;
  return SerializeCentroidArtifact(artifact);
}

std::string WorkerFlag(int n) {
  std::vector<std::string> items;
  for (int i = 0; i < n; ++i) items.push_back(absl::StrCat("w", i, "=10.0.0.", i, ":8000"));
  return absl::StrJoin(items, ",");
}

eldr::v1::RouteRequest BlockRequest(int block, const std::string& request_id) {
  eldr::v1::RouteRequest request;
  request.set_request_id(request_id);
  request.set_prompt_tokens(20);
  auto* counts = request.mutable_counts();
  counts->set_layers(kLayers);
  counts->set_experts(kExperts);
  std::string bytes(static_cast<size_t>(kLayers) * kExperts * 2, '\0');
  for (int l = 0; l < kLayers; ++l) {
    for (int j = 0; j < 4; ++j) {
      const size_t cell = static_cast<size_t>(l) * kExperts + block * 16 + j;
      bytes[2 * cell] = 5;  // little-endian 5
    }
  }
  counts->set_int16_le(std::move(bytes));
  return request;
}

std::optional<double> ParsedMetrics::Value(const std::string& name,
                                           const std::map<std::string, std::string>& labels) const {
  auto it = samples.find(name);
  if (it == samples.end()) return std::nullopt;
  for (const Sample& s : it->second) {
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto l = s.labels.find(k);
      if (l == s.labels.end() || l->second != v) match = false;
    }
    if (match) return s.value;
  }
  return std::nullopt;
}

absl::StatusOr<ParsedMetrics> ParsePrometheusText(const std::string& text) {
  ParsedMetrics out;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (line.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, " (", why, "): ", line));
    };
    if (line[0] == '#') {
      std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      if (parts.size() >= 4 && parts[1] == "TYPE") out.types[std::string(parts[2])] = std::string(parts[3]);
      continue;
    }
    size_t pos = 0;
    while (pos < line.size() &&
           (std::isalnum(static_cast<unsigned char>(line[pos])) || line[pos] == '_' || line[pos] == ':')) {
      ++pos;
    }
    if (pos == 0) return bad("no metric name");
    Sample sample;
    const std::string name(line.substr(0, pos));
    if (pos < line.size() && line[pos] == '{') {
      ++pos;
      while (pos < line.size() && line[pos] != '}') {
        const size_t eq = line.find('=', pos);
        if (eq == absl::string_view::npos || eq + 1 >= line.size() || line[eq + 1] != '"') return bad("label");
        const std::string key(line.substr(pos, eq - pos));
        std::string value;
        size_t i = eq + 2;
        for (; i < line.size() && line[i] != '"'; ++i) {
          if (line[i] == '\\' && i + 1 < line.size()) ++i;
          value.push_back(line[i]);
        }
        if (i >= line.size()) return bad("unterminated label value");
        sample.labels[key] = value;
        pos = i + 1;
        if (pos < line.size() && line[pos] == ',') ++pos;
      }
      if (pos >= line.size()) return bad("unterminated labels");
      ++pos;
    }
    if (pos >= line.size() || line[pos] != ' ') return bad("no value");
    std::vector<absl::string_view> rest = absl::StrSplit(line.substr(pos + 1), ' ', absl::SkipEmpty());
    if (rest.empty() || rest.size() > 2) return bad("value and optional timestamp expected");
    const absl::string_view v = rest[0];
    if (v == "+Inf") {
      sample.value = INFINITY;
    } else if (v == "-Inf") {
      sample.value = -INFINITY;
    } else if (v == "NaN") {
      sample.value = NAN;
    } else if (!absl::SimpleAtod(v, &sample.value)) {
      return bad("unparsable value");
    }
    out.samples[name].push_back(std::move(sample));
  }
  return out;
}

absl::StatusOr<ParsedMetrics> ScrapeMetrics(int port) {
  auto body = HttpGet(port, "/metrics");
  if (!body.ok()) return body.status();
  return ParsePrometheusText(*body);
}

double MetricSum(const ParsedMetrics& metrics, const std::string& name,
                 const std::map<std::string, std::string>& labels) {
  double sum = 0;
  auto it = metrics.samples.find(name);
  if (it == metrics.samples.end()) return 0;
  for (const Sample& sample : it->second) {
    bool match = true;
    for (const auto& [key, value] : labels) {
      auto label = sample.labels.find(key);
      match = match && label != sample.labels.end() && label->second == value;
    }
    if (match) sum += sample.value;
  }
  return sum;
}

double Scraped(const RouterProcess& router, const std::string& name, const std::map<std::string, std::string>& labels) {
  absl::StatusOr<ParsedMetrics> metrics = ScrapeMetrics(router.metrics_port());
  EXPECT_TRUE(metrics.ok()) << metrics.status();
  return metrics.ok() ? MetricSum(*metrics, name, labels) : -1;
}

absl::StatusOr<CertificateSet> MakeCertificates(const TempDir& dir, const std::string& prefix) {
  CertificateSet set;
  const std::string p = dir.File(prefix);
  set.ca_cert = p + "ca.crt";
  set.server_cert = p + "server.crt";
  set.server_key = p + "server.key";
  set.client_cert = p + "client.crt";
  set.client_key = p + "client.key";
  const std::string ca_key = p + "ca.key";
  const std::vector<std::string> ec = {"-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"};
  auto run = [](std::vector<std::string> args) -> absl::Status {
    ProcessResult r = RunProcess("/usr/bin/openssl", args, absl::Seconds(30));
    if (r.exit_code != 0) {
      return absl::InternalError(absl::StrCat("openssl ", absl::StrJoin(args, " "), " failed: ", r.stderr_text));
    }
    return absl::OkStatus();
  };
  std::vector<std::string> ca_args = {"req", "-x509"};
  ca_args.insert(ca_args.end(), ec.begin(), ec.end());
  ca_args.insert(ca_args.end(),
                 {"-keyout", ca_key, "-out", set.ca_cert, "-days", "2", "-subj", "/CN=eldr-test-ca-" + prefix});
  if (absl::Status s = run(ca_args); !s.ok()) return s;
  struct Leaf {
    std::string cert, key, subject, san;
  };
  for (const Leaf& leaf :
       {Leaf{set.server_cert, set.server_key, "/CN=localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1"},
        Leaf{set.client_cert, set.client_key, "/CN=eldr-test-client", "subjectAltName=DNS:client"}}) {
    const std::string csr = leaf.cert + ".csr";
    std::vector<std::string> req = {"req", "-new"};
    req.insert(req.end(), ec.begin(), ec.end());
    req.insert(req.end(), {"-keyout", leaf.key, "-out", csr, "-subj", leaf.subject, "-addext", leaf.san});
    if (absl::Status s = run(req); !s.ok()) return s;
    if (absl::Status s = run({"x509", "-req", "-in", csr, "-CA", set.ca_cert, "-CAkey", ca_key, "-CAcreateserial",
                              "-out", leaf.cert, "-days", "2", "-copy_extensions", "copy"});
        !s.ok()) {
      return s;
    }
  }
  return set;
}

std::unique_ptr<grpc::ClientContext> Ctx(absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return ctx;
}

std::vector<std::string> StandardArgs(const TempDir& dir) {
  const std::string artifact = dir.File("artifact.json");
  WriteTextFile(artifact, ArtifactJson({0, 1, 2, 3}, {"w0", "w1", "w2", "w3"}));
  return {"--workers=" + WorkerFlag(4), "--centroids=" + artifact};
}

std::unique_ptr<RouterProcess> MustStart(const TempDir& dir, std::vector<std::string> args) {
  auto p = RouterProcess::Start(dir, std::move(args));
  if (!p.ok()) {
    ADD_FAILURE() << p.status();
    return nullptr;
  }
  return *std::move(p);
}

eldr::v1::GetStateResponse State(const RouterProcess& router) {
  eldr::v1::GetStateResponse state;
  auto ctx = Ctx();
  grpc::Status status = router.AdminStub()->GetState(ctx.get(), {}, &state);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return state;
}

namespace {

// Route + Complete of BlockRequest(block) on `stub`: the worker, or the failed RPC's message.
struct RouteOutcome {
  std::string worker;  // empty when the Route failed
  std::string error;   // the failed RPC's message (Route or Complete)
};
RouteOutcome RouteAndCompleteOn(eldr::v1::DecodeRouter::Stub* stub, int block) {
  eldr::v1::RouteResponse response;
  grpc::Status routed = stub->Route(Ctx(absl::Seconds(5)).get(), BlockRequest(block), &response);
  if (!routed.ok()) return {"", "Route: " + routed.error_message()};
  eldr::v1::CompleteRequest complete;
  complete.set_lease_id(response.lease_id());
  eldr::v1::CompleteResponse completed;
  grpc::Status done = stub->Complete(Ctx(absl::Seconds(5)).get(), complete, &completed);
  return {response.worker_id(), done.ok() ? "" : "Complete: " + done.error_message()};
}

}  // namespace

std::string RouteAndComplete(const RouterProcess& router, int block) {
  return RouteAndCompleteOn(router.RouterStub().get(), block).worker;
}

RouteTraffic::RouteTraffic(std::vector<const RouterProcess*> targets, absl::Duration pause) : pause_(pause) {
  for (const RouterProcess* target : targets) stubs_.push_back(target->RouterStub());
  thread_ = std::thread([this] { Run(); });
}

void RouteTraffic::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

std::string RouteTraffic::last_error() const {
  absl::MutexLock lock(&mu_);
  return last_error_;
}

double RouteTraffic::TakePercentileUs(double q) {
  std::vector<double> latencies;
  {
    absl::MutexLock lock(&mu_);
    latencies.swap(latencies_us_);
  }
  if (latencies.empty()) return -1;
  std::sort(latencies.begin(), latencies.end());
  return latencies[std::min(latencies.size() - 1, static_cast<size_t>(q * latencies.size()))];
}

void RouteTraffic::Run() {
  for (int n = 0; !stop_.load(); ++n) {
    const absl::Time start = absl::Now();
    const RouteOutcome outcome = RouteAndCompleteOn(stubs_[n % stubs_.size()].get(), n % 4);
    const double us = absl::ToDoubleMicroseconds(absl::Now() - start);
    routes_.fetch_add(1);
    if (!outcome.error.empty()) failures_.fetch_add(1);
    {
      absl::MutexLock lock(&mu_);
      latencies_us_.push_back(us);
      if (!outcome.error.empty()) last_error_ = outcome.error;
    }
    if (pause_ > absl::ZeroDuration()) absl::SleepFor(pause_);
  }
}

const eldr::v1::WorkerState* FindWorker(const eldr::v1::GetStateResponse& state, const std::string& id) {
  for (const auto& w : state.workers()) {
    if (w.worker().id() == id) return &w;
  }
  return nullptr;
}

std::shared_ptr<grpc::Channel> TlsChannel(int port, const std::string& ca, const std::string& cert,
                                          const std::string& key) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadTextFile(ca);
  if (!cert.empty()) {
    ssl.pem_cert_chain = ReadTextFile(cert);
    ssl.pem_private_key = ReadTextFile(key);
  }
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("localhost");
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  static std::atomic<int> unique{0};
  args.SetInt("eldr.test.unique", ++unique);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), grpc::SslCredentials(ssl), args);
}

}  // namespace eldr::testing
