// eldr-bench: closed-loop load generator for eldr-router.
//
// --concurrency slots each run Route (and, with --complete, the Complete of its lease) back to
// back, on one or more channels, for --warmup_s + --duration_s. Only answers that arrive inside the
// measured window count. With --rate the slots start their routes on a shared schedule of that
// many routes per second (at most --concurrency in flight): a fixed load instead of the closed
// loop's maximum; latency counts from each route's actual send. Signatures come from the bundled
// real traces (--trace: each sequence's prefill counts) or are random counts of --geometry.
//
// Client APIs (--api): cq and callback send unary Route/Complete RPCs, one slot per RPC in flight;
// stream sends them as messages of --streams RouteStream calls (spread over the channels), the
// --concurrency slots spread over the streams, so a stream has about concurrency/streams messages
// in flight, pipelined (a slot's next message is written as soon as its previous one was
// answered, whatever the others do). Latency is counted from the moment a slot hands its message
// to the stream (queued behind the stream's earlier writes) until its answer is read. With
// --stream_batch=N the slots of a stream go in groups of N that each send their routes as one
// RouteStreamBatch message and their Completes as another (the same leases in flight, N times
// fewer messages); every entry of a message gets that message's latency. --stream_errors_only
// sends the Completes with errors_only: the router answers them only when they fail, so a slot
// sends its next Route right behind its Complete, and Completes have no latency to report.
//
// Also writes fixtures for a benchmark: --write_artifact (random unit centroids of --geometry for
// --workers workers named w0..wN-1) and --write_workers (their worker file).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/trace/trace.h"
#include "eldr/v1/router.grpc.pb.h"
#include "grpcpp/alarm.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "host:port of eldr-router.");
ABSL_FLAG(double, duration_s, 10, "Measured duration in seconds.");
ABSL_FLAG(double, warmup_s, 1, "Unmeasured warm-up before the measured window.");
ABSL_FLAG(int, concurrency, 8, "Closed-loop slots (requests in flight).");
ABSL_FLAG(double, rate, 0,
          "Routes per second in all (scheduled start times shared by the slots); 0: closed loop, as fast as "
          "the slots go.");
ABSL_FLAG(int, channels, 1, "gRPC channels (TCP connections) the slots are spread over.");
ABSL_FLAG(std::string, api, "cq",
          "Client API: cq (unary RPCs on completion queues polled by --client_threads threads; the "
          "cheapest per RPC), callback (unary RPCs on gRPC's callback API and its own threads) or "
          "stream (Route and Complete as messages of --streams RouteStream calls, on completion queues).");
ABSL_FLAG(int, client_threads, 1, "With --api=cq or stream: threads polling completion queues.");
ABSL_FLAG(int, streams, 0,
          "With --api=stream: RouteStream calls, spread over the channels; the --concurrency slots are "
          "spread over them. 0: one per channel.");
ABSL_FLAG(int, stream_batch, 1,
          "With --api=stream: requests per message. 1: each message is one Route or Complete. N > 1: a "
          "stream's slots go in groups of N (the last may be smaller); a group sends its routes as one "
          "RouteStreamBatch message, then the Completes of the leases they got as one more, then its next "
          "routes, so --concurrency leases are still in flight. An entry's latency counts from its "
          "message's write to its answer's read.");
ABSL_FLAG(bool, stream_errors_only, false,
          "With --api=stream and --complete: Completes (or batches of them) go with errors_only, answered "
          "only when they fail; a slot sends its next Route right after its Complete. Completes are "
          "counted as sent and have no latency.");
ABSL_FLAG(std::string, trace, "",
          "Directory of real expert traces (data/esft-routing): signatures are each sequence's "
          "prefill counts. Empty: random counts of --geometry.");
ABSL_FLAG(double, prefill_fraction, 0.5, "With --trace: fraction of each sequence taken as its prompt.");
ABSL_FLAG(std::string, geometry, "48x128", "LxE (layers x experts) of random signatures.");
ABSL_FLAG(std::string, encoding, "int16", "Counts on the wire: int16 (int16_le bytes) or int32 (packed).");
ABSL_FLAG(int, signatures, 1024, "Distinct random signatures to cycle through.");
ABSL_FLAG(bool, complete, false, "Send Complete for every lease (two RPCs per route).");
ABSL_FLAG(bool, json, false, "Print one JSON object instead of text.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random signatures and fixtures.");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle to verify the router (enables TLS).");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate for mutual TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM client key for mutual TLS.");
ABSL_FLAG(std::string, tls_server_name, "", "Expected server name in the certificate (default: target host).");
ABSL_FLAG(std::string, write_artifact, "",
          "Write a random centroid artifact of --geometry for --workers workers here, and exit.");
ABSL_FLAG(std::string, write_workers, "",
          "With --write_artifact: also write the worker file (w<i> at 127.0.0.1:<20000+i>).");
ABSL_FLAG(int, workers, 16, "Workers of --write_artifact.");
ABSL_FLAG(double, connect_timeout_s, 10, "Give up when the router cannot be reached within this time.");

namespace {

using Clock = std::chrono::steady_clock;

absl::StatusOr<std::pair<int, int>> ParseGeometry(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, 'x');
  int layers = 0;
  int experts = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &layers) || !absl::SimpleAtoi(parts[1], &experts) ||
      layers <= 0 || experts <= 0 || layers > 4096 || experts > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("--geometry '", text, "': expected LxE such as 48x128"));
  }
  return std::make_pair(layers, experts);
}

std::string ReadFileOrDie(const std::string& path) {
  auto text = eldr::ReadFile(path);
  if (!text.ok()) {
    std::fprintf(stderr, "eldr-bench: %s\n", std::string(text.status().message()).c_str());
    std::exit(2);
  }
  return *text;
}

eldr::v1::RouteRequest MakeRequest(int layers, int experts, const std::vector<int32_t>& counts, bool int16,
                                   int64_t prompt_tokens, int index) {
  eldr::v1::RouteRequest request;
  request.set_request_id(absl::StrCat("bench-", index));
  request.set_prompt_tokens(prompt_tokens);
  eldr::v1::ExpertCounts* c = request.mutable_counts();
  c->set_layers(layers);
  c->set_experts(experts);
  if (int16) {
    std::string bytes(counts.size() * 2, '\0');
    for (size_t i = 0; i < counts.size(); ++i) {
      const auto v = static_cast<uint16_t>(std::min<int32_t>(counts[i], INT16_MAX));
      bytes[2 * i] = static_cast<char>(v & 0xff);
      bytes[2 * i + 1] = static_cast<char>(v >> 8);
    }
    c->set_int16_le(std::move(bytes));
  } else {
    c->mutable_values()->mutable_values()->Add(counts.begin(), counts.end());
  }
  return request;
}

// Random counts shaped like top-k routing: per layer a few popular experts take most tokens.
std::vector<eldr::v1::RouteRequest> RandomRequests(int layers, int experts, int n, bool int16, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<eldr::v1::RouteRequest> out;
  out.reserve(n);
  std::vector<int32_t> counts(static_cast<size_t>(layers) * experts);
  for (int i = 0; i < n; ++i) {
    const int tokens = std::uniform_int_distribution<int>(32, 1024)(rng);
    std::fill(counts.begin(), counts.end(), 0);
    for (int l = 0; l < layers; ++l) {
      // 12 hot experts per layer share the tokens; the rest get a few.
      for (int h = 0; h < 12; ++h) {
        const int e = std::uniform_int_distribution<int>(0, experts - 1)(rng);
        counts[static_cast<size_t>(l) * experts + e] += std::uniform_int_distribution<int>(1, tokens / 2 + 1)(rng);
      }
      for (int e = 0; e < experts; e += 7) counts[static_cast<size_t>(l) * experts + e] += 1;
    }
    out.push_back(MakeRequest(layers, experts, counts, int16, tokens, i));
  }
  return out;
}

absl::StatusOr<std::vector<eldr::v1::RouteRequest>> TraceRequests(const std::string& dir, double fraction, bool int16,
                                                                  std::string* geometry) {
  auto trace = eldr::LoadExpertTrace(dir);
  if (!trace.ok()) return trace.status();
  std::vector<eldr::v1::RouteRequest> out;
  std::vector<int32_t> counts(static_cast<size_t>(trace->layers) * trace->experts);
  int index = 0;
  for (const eldr::TraceSequence& seq : trace->sequences) {
    std::fill(counts.begin(), counts.end(), 0);
    const int prompt = eldr::PrefillTokens(seq.tokens, fraction);
    eldr::AccumulateCounts(*trace, seq, 0, prompt, absl::Span<int32_t>(counts));
    out.push_back(MakeRequest(trace->layers, trace->experts, counts, int16, prompt, index++));
  }
  if (out.empty()) return absl::NotFoundError(absl::StrCat(dir, ": no sequences"));
  *geometry = absl::StrCat(trace->layers, "x", trace->experts);
  return out;
}

int WriteFixtures(int layers, int experts) {
  const int k = absl::GetFlag(FLAGS_workers);
  if (k <= 0) {
    std::fprintf(stderr, "eldr-bench: --workers must be positive\n");
    return 2;
  }
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> idf(0.5f, 3.0f);
  eldr::CentroidArtifact artifact;
  artifact.spec.layers = layers;
  artifact.spec.experts = experts;
  artifact.spec.variant = eldr::SignatureVariant::kCountIdf;
  artifact.spec.idf.resize(static_cast<size_t>(layers) * experts);
  for (float& w : artifact.spec.idf) w = idf(rng);
  artifact.k = k;
  artifact.centroids.resize(static_cast<size_t>(k) * layers * experts);
  const size_t dim = static_cast<size_t>(layers) * experts;
  for (int r = 0; r < k; ++r) {
    double norm = 0;
    for (size_t j = 0; j < dim; ++j) {
      const float v = std::abs(normal(rng));
      artifact.centroids[r * dim + j] = v;
      norm += double{v} * v;
    }
    const float inv = static_cast<float>(1.0 / std::sqrt(norm));
    for (size_t j = 0; j < dim; ++j) artifact.centroids[r * dim + j] *= inv;
    artifact.workers.push_back(absl::StrCat("w", r));
  }
  artifact.model = absl::StrCat("random-", layers, "x", experts);
  artifact.seed = absl::GetFlag(FLAGS_seed);
  if (absl::Status s = eldr::SaveCentroidArtifact(artifact, absl::GetFlag(FLAGS_write_artifact)); !s.ok()) {
    std::fprintf(stderr, "eldr-bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  if (const std::string path = absl::GetFlag(FLAGS_write_workers); !path.empty()) {
    nlohmann::json workers = nlohmann::json::array();
    for (int r = 0; r < k; ++r) {
      workers.push_back({{"id", absl::StrCat("w", r)}, {"address", absl::StrCat("127.0.0.1:", 20000 + r)}});
    }
    if (absl::Status s = eldr::WriteFileAtomically(path, workers.dump(2) + "\n"); !s.ok()) {
      std::fprintf(stderr, "eldr-bench: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  return 0;
}

// Per-slot results; a slot's chain of callbacks is sequential, so no locking inside a slot.
struct SlotStats {
  std::vector<int64_t> route_ns;
  std::vector<int64_t> complete_ns;
  int64_t routes = 0;
  int64_t completes = 0;
  int64_t errors = 0;
  std::map<std::string, int64_t> error_codes;
  std::string last_error;
};

class Run;

// What a completion-queue tag points to: the poller hands it the event.
class CqTag {
 public:
  virtual ~CqTag() = default;
  virtual void OnCqEvent(bool ok) = 0;
};

// One closed-loop slot: Route, then (with --complete) Complete of its lease, then the next Route.
// With a completion queue the slot is the tag of its one outstanding RPC; otherwise gRPC's
// callback threads drive it.
class Slot final : public CqTag {
 public:
  Slot(Run* run, eldr::v1::DecodeRouter::Stub* stub, grpc::CompletionQueue* cq, size_t first)
      : run_(run), stub_(stub), cq_(cq), next_(first) {}
  void Start() { StartRoute(); }
  // Completion-queue mode: the outstanding RPC finished (its status says how).
  void OnCqEvent(bool /*ok*/) override {
    if (phase_ == Phase::kWait) {
      SendRoute();
    } else if (phase_ == Phase::kRoute) {
      OnRoute(status_);
    } else {
      OnComplete(status_);
    }
  }
  SlotStats& stats() { return stats_; }

 private:
  enum class Phase { kWait, kRoute, kComplete };

  void StartRoute();
  void SendRoute();
  void OnRoute(const grpc::Status& status);
  void OnComplete(const grpc::Status& status);
  void RecordError(const grpc::Status& status);

  Run* const run_;
  eldr::v1::DecodeRouter::Stub* const stub_;
  grpc::CompletionQueue* const cq_;  // null: callback API
  size_t next_;
  Phase phase_ = Phase::kRoute;
  grpc::Status status_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientAsyncResponseReader<eldr::v1::RouteResponse>> route_reader_;
  std::unique_ptr<grpc::ClientAsyncResponseReader<eldr::v1::CompleteResponse>> complete_reader_;
  eldr::v1::RouteResponse route_response_;
  eldr::v1::CompleteRequest complete_request_;
  eldr::v1::CompleteResponse complete_response_;
  Clock::time_point sent_;
  grpc::Alarm alarm_;  // --rate: wakes the slot at its scheduled start
  SlotStats stats_;
};

class Run {
 public:
  Run(const std::vector<eldr::v1::RouteRequest>* requests, bool complete, Clock::time_point measure_from,
      Clock::time_point measure_to)
      : requests_(requests), complete_(complete), from_(measure_from), to_(measure_to) {}

  const eldr::v1::RouteRequest& request(size_t i) const { return (*requests_)[i % requests_->size()]; }
  // With a rate: the start time of the next route on the shared schedule (claimed by the caller);
  // without one: nullopt (start now).
  std::optional<Clock::time_point> ClaimStart() {
    if (interval_ns_ <= 0) return std::nullopt;
    const int64_t offset = next_offset_ns_.fetch_add(interval_ns_, std::memory_order_relaxed);
    return schedule_start_ + std::chrono::nanoseconds(offset);
  }
  void SetRate(double routes_per_s, Clock::time_point start) {
    interval_ns_ = routes_per_s > 0 ? static_cast<int64_t>(1e9 / routes_per_s) : 0;
    schedule_start_ = start;
  }
  // When a slot's next route starts: now, or later on the --rate schedule; nullopt once the run
  // is over (the slot is then done).
  std::optional<Clock::time_point> NextStart(Clock::time_point now) {
    if (stopping(now)) return std::nullopt;
    const std::optional<Clock::time_point> due = ClaimStart();
    if (!due.has_value() || *due <= now) return now;
    if (stopping(*due)) return std::nullopt;
    return due;
  }
  bool complete() const { return complete_; }
  bool stopping(Clock::time_point now) const { return now >= to_; }
  bool measured(Clock::time_point t) const { return t >= from_ && t < to_; }

  void SlotFinished() {
    std::lock_guard<std::mutex> lock(mu_);
    ++finished_;
    cv_.notify_all();
  }
  void WaitForSlots(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return finished_ == n; });
  }

 private:
  const std::vector<eldr::v1::RouteRequest>* requests_;
  const bool complete_;
  const Clock::time_point from_;
  const Clock::time_point to_;
  int64_t interval_ns_ = 0;
  Clock::time_point schedule_start_;
  std::atomic<int64_t> next_offset_ns_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  int finished_ = 0;
};

void Slot::StartRoute() {
  const Clock::time_point now = Clock::now();
  const std::optional<Clock::time_point> due = run_->NextStart(now);
  if (!due.has_value()) {
    run_->SlotFinished();
    return;
  }
  if (*due > now) {
    phase_ = Phase::kWait;
    const auto deadline = std::chrono::system_clock::now() + (*due - now);
    if (cq_ != nullptr) {
      alarm_.Set(cq_, deadline, this);
    } else {
      alarm_.Set(deadline, [this](bool) { SendRoute(); });
    }
    return;
  }
  SendRoute();
}

void Slot::SendRoute() {
  context_ = std::make_unique<grpc::ClientContext>();
  route_response_.Clear();
  phase_ = Phase::kRoute;
  sent_ = Clock::now();
  const eldr::v1::RouteRequest& request = run_->request(next_++);
  if (cq_ != nullptr) {
    route_reader_ = stub_->AsyncRoute(context_.get(), request, cq_);
    route_reader_->Finish(&route_response_, &status_, this);
    return;
  }
  stub_->async()->Route(context_.get(), &request, &route_response_, [this](grpc::Status status) { OnRoute(status); });
}

void RecordError(SlotStats* stats, int code, const std::string& message) {
  ++stats->errors;
  ++stats->error_codes[absl::StrCat(code)];
  stats->last_error = message;
}

void Slot::RecordError(const grpc::Status& status) {
  ::RecordError(&stats_, status.error_code(), status.error_message());
}

void Slot::OnRoute(const grpc::Status& status) {
  const Clock::time_point done = Clock::now();
  const bool measured = run_->measured(done);
  if (measured) {
    ++stats_.routes;
    stats_.route_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(done - sent_).count());
    if (!status.ok()) RecordError(status);
  }
  if (status.ok() && run_->complete()) {
    context_ = std::make_unique<grpc::ClientContext>();
    complete_request_.set_lease_id(route_response_.lease_id());
    complete_response_.Clear();
    phase_ = Phase::kComplete;
    sent_ = Clock::now();
    if (cq_ != nullptr) {
      complete_reader_ = stub_->AsyncComplete(context_.get(), complete_request_, cq_);
      complete_reader_->Finish(&complete_response_, &status_, this);
      return;
    }
    stub_->async()->Complete(context_.get(), &complete_request_, &complete_response_,
                             [this](grpc::Status s) { OnComplete(s); });
    return;
  }
  StartRoute();
}

void Slot::OnComplete(const grpc::Status& status) {
  const Clock::time_point done = Clock::now();
  if (run_->measured(done)) {
    ++stats_.completes;
    stats_.complete_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(done - sent_).count());
    if (!status.ok()) RecordError(status);
  }
  StartRoute();
}

// Protobuf wire encoding of the few fields a RouteStreamRequest frame needs, so that a frame is a
// small header slice plus the shared, pre-serialized RouteRequest slice (no copy per message).
void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// Field numbers of eldr.v1.RouteStreamRequest / CompleteRequest (proto/eldr/v1/router.proto).
constexpr char kTagId = 0x08;          // id = 1, varint
constexpr char kTagRoute = 0x12;       // route = 2, length-delimited
constexpr char kTagComplete = 0x1a;    // complete = 3, length-delimited
constexpr char kTagLease = 0x08;       // CompleteRequest.lease_id = 1, varint
constexpr char kTagErrorsOnly = 0x28;  // RouteStreamRequest.errors_only = 5, varint

// Marks the ids of errors_only messages, so that an error answer to one is never taken for the
// answer of the group's next message (which has the group's plain id).
constexpr uint64_t kErrorsOnlyIdBit = uint64_t{1} << 62;

grpc::ByteBuffer RouteFrame(uint64_t id, const grpc::Slice& route) {
  std::string header;
  header.push_back(kTagId);
  AppendVarint(id, &header);
  header.push_back(kTagRoute);
  AppendVarint(route.size(), &header);
  grpc::Slice slices[2] = {grpc::Slice(header), route};
  return grpc::ByteBuffer(slices, 2);
}

grpc::ByteBuffer CompleteFrame(uint64_t id, uint64_t lease, bool errors_only) {
  std::string inner;
  inner.push_back(kTagLease);
  AppendVarint(lease, &inner);
  std::string frame;
  frame.push_back(kTagId);
  AppendVarint(id, &frame);
  frame.push_back(kTagComplete);
  AppendVarint(inner.size(), &frame);
  frame += inner;
  if (errors_only) frame += {kTagErrorsOnly, 1};
  grpc::Slice slice(frame);
  return grpc::ByteBuffer(&slice, 1);
}

// A RouteStreamBatch message: the header of the outer RouteStreamRequest, then per entry a small
// header slice and the shared, pre-serialized RouteRequest slice (no copy of any request).
constexpr char kTagBatch = 0x22;       // RouteStreamRequest.batch = 4, length-delimited
constexpr char kTagBatchEntry = 0x0a;  // RouteStreamBatch.requests = 1, length-delimited

size_t VarintSize(uint64_t value) {
  size_t n = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

grpc::ByteBuffer RouteBatchFrame(uint64_t id, const std::vector<std::pair<uint64_t, const grpc::Slice*>>& entries) {
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * entries.size() + 1);
  slices.emplace_back();  // the outer header, once the batch's length is known
  size_t batch_bytes = 0;
  for (const auto& [entry_id, route] : entries) {
    const size_t entry_bytes = 1 + VarintSize(entry_id) + 1 + VarintSize(route->size()) + route->size();
    std::string header;
    header.push_back(kTagBatchEntry);
    AppendVarint(entry_bytes, &header);
    header.push_back(kTagId);
    AppendVarint(entry_id, &header);
    header.push_back(kTagRoute);
    AppendVarint(route->size(), &header);
    batch_bytes += 1 + VarintSize(entry_bytes) + entry_bytes;
    slices.emplace_back(header);
    slices.push_back(*route);
  }
  std::string outer;
  outer.push_back(kTagId);
  AppendVarint(id, &outer);
  outer.push_back(kTagBatch);
  AppendVarint(batch_bytes, &outer);
  slices[0] = grpc::Slice(outer);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer CompleteBatchFrame(uint64_t id, const std::vector<std::pair<uint64_t, uint64_t>>& entries,
                                    bool errors_only) {
  std::string batch;
  for (const auto& [entry_id, lease] : entries) {
    const size_t inner_bytes = 1 + VarintSize(lease);
    const size_t entry_bytes = 1 + VarintSize(entry_id) + 1 + VarintSize(inner_bytes) + inner_bytes;
    batch.push_back(kTagBatchEntry);
    AppendVarint(entry_bytes, &batch);
    batch.push_back(kTagId);
    AppendVarint(entry_id, &batch);
    batch.push_back(kTagComplete);
    AppendVarint(inner_bytes, &batch);
    batch.push_back(kTagLease);
    AppendVarint(lease, &batch);
  }
  std::string frame;
  frame.push_back(kTagId);
  AppendVarint(id, &frame);
  frame.push_back(kTagBatch);
  AppendVarint(batch.size(), &frame);
  frame += batch;
  if (errors_only) frame += {kTagErrorsOnly, 1};
  grpc::Slice slice(frame);
  return grpc::ByteBuffer(&slice, 1);
}

// One RouteStream call driving its share of the slots (--api=stream). Every event of the call
// arrives on one completion queue polled by one thread, so nothing here is locked. The slots go in
// groups of --stream_batch; a group has one message in flight, whose id is the group's index + 1:
// with --stream_batch=1 a group is one slot and its message a Route or a Complete; otherwise the
// message is a RouteStreamBatch of its slots' routes (entry ids: the slots' indices + 1), then one
// of the Completes of the leases those got. Writes go out one at a time, in the order the groups
// queue them; one read is always outstanding. With errors_only the Completes go with an id of
// their own (kErrorsOnlyIdBit set) and the group goes straight on to its next routes: an answer
// with such an id reports failed Completes.
class StreamCall {
 public:
  StreamCall(Run* run, grpc::GenericStub* stub, grpc::CompletionQueue* cq, const std::vector<grpc::Slice>* routes,
             const std::vector<size_t>& first_requests, size_t batch, bool errors_only)
      : run_(run), stub_(stub), cq_(cq), routes_(routes), batched_(batch > 1), errors_only_(errors_only) {
    uint64_t slot_id = 0;
    for (size_t i = 0; i < first_requests.size(); i += batch) {
      auto group = std::make_unique<StreamGroup>(this, groups_.size() + 1);
      for (size_t j = i; j < std::min(first_requests.size(), i + batch); ++j) {
        group->entries.push_back(Entry{++slot_id, first_requests[j]});
      }
      groups_.push_back(std::move(group));
    }
    active_ = groups_.size();
  }

  void Start() {
    call_ = stub_->PrepareCall(&context_, "/eldr.v1.DecodeRouter/RouteStream", cq_);
    call_->StartCall(&start_tag_);
  }
  SlotStats& stats() { return stats_; }

 private:
  enum class Op { kStart, kRead, kWrite, kWritesDone, kFinish };
  struct OpTag final : CqTag {
    OpTag(StreamCall* c, Op o) : call(c), op(o) {}
    void OnCqEvent(bool ok) override { call->OnEvent(op, ok); }
    StreamCall* call;
    Op op;
  };
  // One slot of a group: one lease at a time.
  struct Entry {
    uint64_t id;  // of its requests: the slot's index + 1
    size_t next;  // index of its next request
    uint64_t lease = 0;
  };
  struct StreamGroup final : CqTag {
    StreamGroup(StreamCall* c, uint64_t i) : call(c), id(i) {}
    void OnCqEvent(bool ok) override { call->OnAlarm(this, ok); }  // --rate: its start time came
    StreamCall* call;
    const uint64_t id;  // of its messages: its index + 1
    std::vector<Entry> entries;
    std::vector<size_t> sent;  // indices of the entries in the message in flight, in its order
    bool in_flight = false;    // a message of this group awaits its answer
    bool routing = false;      // that message holds Routes (else Completes)
    Clock::time_point sent_at;
    grpc::Alarm alarm;
  };

  void OnEvent(Op op, bool ok) {
    switch (op) {
      case Op::kStart:
        if (!ok) {
          Fail();
          return;
        }
        call_->Read(&read_buffer_, &read_tag_);
        for (auto& group : groups_) NextRoutes(group.get());
        return;
      case Op::kRead:
        if (!ok) {  // the server ended the stream
          read_closed_ = true;
          call_->Finish(&status_, &finish_tag_);
          return;
        }
        OnAnswer();
        call_->Read(&read_buffer_, &read_tag_);
        return;
      case Op::kWrite:
        writing_ = false;
        outbox_.pop_front();
        if (ok) WriteNext();
        return;
      case Op::kWritesDone:
        return;
      case Op::kFinish:
        if (!status_.ok()) RecordError(&stats_, status_.error_code(), "stream: " + status_.error_message());
        run_->SlotFinished();
        return;
    }
  }

  void OnAlarm(StreamGroup* group, bool ok) {
    if (ok && !read_closed_) SendRoutes(group);
  }

  // The group's next routes now, or with --rate once the latest of their scheduled times came;
  // none once the run is over.
  void NextRoutes(StreamGroup* group) {
    const Clock::time_point now = Clock::now();
    Clock::time_point latest = now;
    for (size_t i = 0; i < group->entries.size(); ++i) {
      const std::optional<Clock::time_point> due = run_->NextStart(now);
      if (!due.has_value()) {
        GroupDone();
        return;
      }
      latest = std::max(latest, *due);
    }
    if (latest > now) {
      group->alarm.Set(cq_, std::chrono::system_clock::now() + (latest - now), group);
    } else {
      SendRoutes(group);
    }
  }

  void SendRoutes(StreamGroup* group) {
    group->in_flight = true;
    group->routing = true;
    group->sent.clear();
    group->sent_at = Clock::now();
    if (!batched_) {
      Entry& entry = group->entries.front();
      group->sent.push_back(0);
      Send(RouteFrame(group->id, (*routes_)[entry.next++ % routes_->size()]));
      return;
    }
    std::vector<std::pair<uint64_t, const grpc::Slice*>> entries;
    for (size_t i = 0; i < group->entries.size(); ++i) {
      Entry& entry = group->entries[i];
      group->sent.push_back(i);
      entries.emplace_back(entry.id, &(*routes_)[entry.next++ % routes_->size()]);
    }
    Send(RouteBatchFrame(group->id, entries));
  }

  // The Completes of the entries whose routes got a lease (group->sent lists them). With
  // errors_only no answer is awaited: they count as sent, and the group goes on.
  void SendCompletes(StreamGroup* group) {
    if (!errors_only_) {
      group->in_flight = true;
      group->routing = false;
      group->sent_at = Clock::now();
    }
    const uint64_t id = errors_only_ ? group->id | kErrorsOnlyIdBit : group->id;
    if (!batched_) {
      Send(CompleteFrame(id, group->entries.front().lease, errors_only_));
    } else {
      std::vector<std::pair<uint64_t, uint64_t>> entries;
      for (size_t i : group->sent) entries.emplace_back(group->entries[i].id, group->entries[i].lease);
      Send(CompleteBatchFrame(id, entries, errors_only_));
    }
    if (errors_only_) {
      if (run_->measured(Clock::now())) stats_.completes += static_cast<int64_t>(group->sent.size());
      NextRoutes(group);
    }
  }

  // An answer to errors_only Completes: some failed. Each error is recorded.
  void OnErrorsOnlyAnswer() {
    if (answer_.has_error()) {
      RecordError(&stats_, answer_.error().code(), "Complete (errors_only): " + answer_.error().message());
    }
    for (const eldr::v1::RouteStreamResponse& entry : answer_.batch().responses()) {
      if (entry.has_error()) {
        RecordError(&stats_, entry.error().code(), "Complete (errors_only): " + entry.error().message());
      }
    }
  }

  void OnAnswer() {
    const Clock::time_point done = Clock::now();
    grpc::ProtoBufferReader reader(&read_buffer_);
    const bool parsed = answer_.ParseFromZeroCopyStream(&reader);
    const uint64_t id = answer_.id();
    if (parsed && errors_only_ && (id & kErrorsOnlyIdBit) != 0) {
      OnErrorsOnlyAnswer();
      return;
    }
    if (!parsed || id == 0 || id > groups_.size() || !groups_[id - 1]->in_flight) {
      RecordError(&stats_, -1, absl::StrCat("stream: an answer for no message in flight (id ", id, ")"));
      return;
    }
    StreamGroup* group = groups_[id - 1].get();
    group->in_flight = false;
    const bool measured = run_->measured(done);
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(done - group->sent_at).count();
    // The answer of each entry of the message: the message's own, or its batch's entries.
    const bool whole =
        !batched_ || (answer_.has_batch() && answer_.batch().responses_size() == static_cast<int>(group->sent.size()));
    std::vector<size_t> leased;  // entries whose route got a lease
    for (size_t k = 0; k < group->sent.size(); ++k) {
      Entry& entry = group->entries[group->sent[k]];
      const eldr::v1::RouteStreamResponse& r = !batched_ ? answer_ : whole ? answer_.batch().responses(k) : answer_;
      if (measured) {
        if (group->routing) {
          ++stats_.routes;
          stats_.route_ns.push_back(ns);
        } else {
          ++stats_.completes;
          stats_.complete_ns.push_back(ns);
        }
        if (!whole) {
          RecordError(&stats_, r.has_error() ? r.error().code() : -1,
                      r.has_error() ? r.error().message() : "stream: a batch answered without its entries");
        } else if (batched_ && r.id() != entry.id) {
          RecordError(&stats_, -1,
                      absl::StrCat("stream: batch entry ", k, " answered with id ", r.id(), ", not ", entry.id));
        } else if (r.has_error()) {
          RecordError(&stats_, r.error().code(), r.error().message());
        }
      }
      if (whole && group->routing && r.has_route()) {
        entry.lease = r.route().lease_id();
        leased.push_back(group->sent[k]);
      }
    }
    if (group->routing && run_->complete() && !leased.empty()) {
      group->sent = std::move(leased);
      SendCompletes(group);
      return;
    }
    NextRoutes(group);
  }

  void Send(grpc::ByteBuffer frame) {
    outbox_.push_back(std::move(frame));
    WriteNext();
  }

  void WriteNext() {
    if (writing_) return;
    if (!outbox_.empty()) {
      writing_ = true;
      call_->Write(outbox_.front(), &write_tag_);
    } else if (active_ == 0 && !writes_done_) {
      writes_done_ = true;  // every group is done: half-close; the server answers the rest and ends OK
      call_->WritesDone(&writes_done_tag_);
    }
  }

  void GroupDone() {
    --active_;
    WriteNext();
  }

  // The call could not start: nothing more will happen on it.
  void Fail() {
    RecordError(&stats_, static_cast<int>(grpc::StatusCode::UNAVAILABLE), "stream: the call did not start");
    read_closed_ = true;
    call_->Finish(&status_, &finish_tag_);
  }

  Run* const run_;
  grpc::GenericStub* const stub_;
  grpc::CompletionQueue* const cq_;
  const std::vector<grpc::Slice>* const routes_;
  const bool batched_;      // --stream_batch > 1: every message is a RouteStreamBatch
  const bool errors_only_;  // --stream_errors_only
  std::vector<std::unique_ptr<StreamGroup>> groups_;
  size_t active_ = 0;  // groups that will still send routes
  grpc::ClientContext context_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  OpTag start_tag_{this, Op::kStart};
  OpTag read_tag_{this, Op::kRead};
  OpTag write_tag_{this, Op::kWrite};
  OpTag writes_done_tag_{this, Op::kWritesDone};
  OpTag finish_tag_{this, Op::kFinish};
  grpc::ByteBuffer read_buffer_;
  eldr::v1::RouteStreamResponse answer_;  // scratch of OnAnswer (its batch's entries are reused)
  std::deque<grpc::ByteBuffer> outbox_;   // front() is being written while writing_
  bool writing_ = false;
  bool writes_done_ = false;
  bool read_closed_ = false;
  grpc::Status status_;
  SlotStats stats_;
};

double PercentileUs(std::vector<int64_t>& ns, double q) {
  if (ns.empty()) return 0;
  const size_t i = std::min(ns.size() - 1, static_cast<size_t>(std::ceil(q * ns.size())) - (q > 0 ? 1 : 0));
  std::nth_element(ns.begin(), ns.begin() + i, ns.end());
  return ns[i] / 1000.0;
}

std::shared_ptr<grpc::ChannelCredentials> MakeCredentials() {
  const std::string ca = absl::GetFlag(FLAGS_tls_ca);
  if (ca.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadFileOrDie(ca);
  if (const std::string cert = absl::GetFlag(FLAGS_tls_cert); !cert.empty()) {
    ssl.pem_cert_chain = ReadFileOrDie(cert);
    ssl.pem_private_key = ReadFileOrDie(absl::GetFlag(FLAGS_tls_key));
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

int main(int argc, char** argv) {
  // gRPC's own locks are absl::Mutex; Debian's Abseil records a deadlock graph on each of them
  // unless told not to, which would make the load generator measure itself.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage("Load generator for eldr-router: eldr-bench --target=host:port [--complete] [--json]");
  absl::ParseCommandLine(argc, argv);

  auto geometry = ParseGeometry(absl::GetFlag(FLAGS_geometry));
  if (!geometry.ok()) {
    std::fprintf(stderr, "eldr-bench: %s\n", std::string(geometry.status().message()).c_str());
    return 2;
  }
  if (!absl::GetFlag(FLAGS_write_artifact).empty()) return WriteFixtures(geometry->first, geometry->second);

  const std::string encoding = absl::GetFlag(FLAGS_encoding);
  const std::string api = absl::GetFlag(FLAGS_api);
  if (api != "cq" && api != "callback" && api != "stream") {
    std::fprintf(stderr, "eldr-bench: --api must be cq, callback or stream\n");
    return 2;
  }
  if (encoding != "int16" && encoding != "int32") {
    std::fprintf(stderr, "eldr-bench: --encoding must be int16 or int32\n");
    return 2;
  }
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const int channels = absl::GetFlag(FLAGS_channels);
  const double duration_s = absl::GetFlag(FLAGS_duration_s);
  const double warmup_s = absl::GetFlag(FLAGS_warmup_s);
  if (!(absl::GetFlag(FLAGS_rate) >= 0)) {
    std::fprintf(stderr, "eldr-bench: --rate must be >= 0\n");
    return 2;
  }
  if (concurrency <= 0 || channels <= 0 || !(duration_s > 0) || !(warmup_s >= 0)) {
    std::fprintf(stderr, "eldr-bench: --concurrency, --channels and --duration_s must be positive\n");
    return 2;
  }
  const int streams = api != "stream" ? 0 : absl::GetFlag(FLAGS_streams) == 0 ? channels : absl::GetFlag(FLAGS_streams);
  if (api == "stream" && (streams < 0 || streams > concurrency)) {
    std::fprintf(stderr, "eldr-bench: --streams must be between 0 and --concurrency\n");
    return 2;
  }

  const int stream_batch = absl::GetFlag(FLAGS_stream_batch);
  if (stream_batch < 1 || stream_batch > 4096 || (api != "stream" && stream_batch != 1)) {
    std::fprintf(stderr, "eldr-bench: --stream_batch must be between 1 and 4096, and above 1 only with --api=stream\n");
    return 2;
  }

  const bool stream_errors_only = absl::GetFlag(FLAGS_stream_errors_only);
  if (stream_errors_only && (api != "stream" || !absl::GetFlag(FLAGS_complete))) {
    std::fprintf(stderr, "eldr-bench: --stream_errors_only needs --api=stream and --complete\n");
    return 2;
  }

  std::vector<eldr::v1::RouteRequest> requests;
  std::string geometry_label = absl::GetFlag(FLAGS_geometry);
  if (const std::string dir = absl::GetFlag(FLAGS_trace); !dir.empty()) {
    auto loaded = TraceRequests(dir, absl::GetFlag(FLAGS_prefill_fraction), encoding == "int16", &geometry_label);
    if (!loaded.ok()) {
      std::fprintf(stderr, "eldr-bench: %s\n", std::string(loaded.status().message()).c_str());
      return 2;
    }
    requests = *std::move(loaded);
  } else {
    requests = RandomRequests(geometry->first, geometry->second, std::max(1, absl::GetFlag(FLAGS_signatures)),
                              encoding == "int16", absl::GetFlag(FLAGS_seed));
  }

  const auto credentials = MakeCredentials();
  std::vector<std::shared_ptr<grpc::Channel>> channel_list;
  std::vector<std::unique_ptr<eldr::v1::DecodeRouter::Stub>> stubs;
  std::vector<std::unique_ptr<grpc::GenericStub>> generic_stubs;
  for (int c = 0; c < channels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one connection per channel
    // The load generator should cost as little as possible per RPC: no transparent retries
    // (every failure is counted), no channelz bookkeeping.
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    args.SetInt(GRPC_ARG_ENABLE_CHANNELZ, 0);
    args.SetInt("eldr.bench.channel", c);
    if (const std::string name = absl::GetFlag(FLAGS_tls_server_name); !name.empty()) {
      args.SetSslTargetNameOverride(name);
    }
    auto channel = grpc::CreateCustomChannel(absl::GetFlag(FLAGS_target), credentials, args);
    const auto connect_deadline =
        std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                               std::chrono::duration<double>(absl::GetFlag(FLAGS_connect_timeout_s)));
    if (!channel->WaitForConnected(connect_deadline)) {
      std::fprintf(stderr, "eldr-bench: cannot connect to %s\n", absl::GetFlag(FLAGS_target).c_str());
      return 1;
    }
    stubs.push_back(eldr::v1::DecodeRouter::NewStub(channel));
    generic_stubs.push_back(std::make_unique<grpc::GenericStub>(channel));
    channel_list.push_back(std::move(channel));
  }

  const Clock::time_point start = Clock::now();
  const auto from = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(warmup_s));
  const auto to = from + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(duration_s));
  Run run(&requests, absl::GetFlag(FLAGS_complete), from, to);
  run.SetRate(absl::GetFlag(FLAGS_rate), start);
  const int client_threads = api == "callback" ? 0 : std::max(1, absl::GetFlag(FLAGS_client_threads));
  std::vector<std::unique_ptr<grpc::CompletionQueue>> queues;
  for (int t = 0; t < client_threads; ++t) queues.push_back(std::make_unique<grpc::CompletionQueue>());
  std::vector<std::unique_ptr<Slot>> slots;
  std::vector<std::unique_ptr<StreamCall>> calls;
  std::vector<grpc::Slice> route_slices;  // --api=stream: each request serialized once
  if (api == "stream") {
    for (const eldr::v1::RouteRequest& request : requests) route_slices.emplace_back(request.SerializeAsString());
    for (int c = 0; c < streams; ++c) {
      std::vector<size_t> firsts;  // slots c, c + streams, c + 2 * streams, ...
      for (int i = c; i < concurrency; i += streams)
        firsts.push_back(static_cast<size_t>(i) * requests.size() / concurrency);
      calls.push_back(std::make_unique<StreamCall>(&run, generic_stubs[c % channels].get(),
                                                   queues[c % queues.size()].get(), &route_slices, firsts,
                                                   static_cast<size_t>(stream_batch), stream_errors_only));
    }
  } else {
    for (int i = 0; i < concurrency; ++i) {
      const size_t first = static_cast<size_t>(i) * requests.size() / concurrency;
      grpc::CompletionQueue* cq = queues.empty() ? nullptr : queues[i % queues.size()].get();
      slots.push_back(std::make_unique<Slot>(&run, stubs[i % channels].get(), cq, first));
    }
  }
  std::vector<std::thread> pollers;
  for (auto& queue : queues) {
    pollers.emplace_back([cq = queue.get()] {
      void* tag = nullptr;
      bool ok = false;
      while (cq->Next(&tag, &ok)) static_cast<CqTag*>(tag)->OnCqEvent(ok);
    });
  }
  for (auto& slot : slots) slot->Start();
  for (auto& call : calls) call->Start();
  // A slot reports when it is done; a stream when its call finished (after all its slots).
  run.WaitForSlots(api == "stream" ? streams : concurrency);
  for (auto& queue : queues) queue->Shutdown();
  for (auto& poller : pollers) poller.join();

  SlotStats total;
  std::vector<SlotStats*> parts;
  for (auto& slot : slots) parts.push_back(&slot->stats());
  for (auto& call : calls) parts.push_back(&call->stats());
  for (SlotStats* part : parts) {
    SlotStats& s = *part;
    total.routes += s.routes;
    total.completes += s.completes;
    total.errors += s.errors;
    total.route_ns.insert(total.route_ns.end(), s.route_ns.begin(), s.route_ns.end());
    total.complete_ns.insert(total.complete_ns.end(), s.complete_ns.begin(), s.complete_ns.end());
    for (const auto& [code, n] : s.error_codes) total.error_codes[code] += n;
    if (!s.last_error.empty()) total.last_error = s.last_error;
  }
  const double qps = total.routes / duration_s;
  nlohmann::json out = {
      {"requests", total.routes},
      {"errors", total.errors},
      {"qps", std::round(qps * 10) / 10},
      {"p50_us", PercentileUs(total.route_ns, 0.50)},
      {"p90_us", PercentileUs(total.route_ns, 0.90)},
      {"p99_us", PercentileUs(total.route_ns, 0.99)},
      {"p999_us", PercentileUs(total.route_ns, 0.999)},
      {"max_us", PercentileUs(total.route_ns, 1.0)},
      {"completes", total.completes},
      {"complete_p50_us", PercentileUs(total.complete_ns, 0.50)},
      {"complete_p99_us", PercentileUs(total.complete_ns, 0.99)},
      {"duration_s", duration_s},
      {"concurrency", concurrency},
      {"target_rate", absl::GetFlag(FLAGS_rate)},
      {"channels", channels},
      {"api", api},
      {"streams", streams},
      {"stream_batch", stream_batch},
      {"stream_errors_only", stream_errors_only},
      {"geometry", geometry_label},
      {"encoding", encoding},
      {"signatures", requests.size()},
      {"error_codes", total.error_codes},
  };
  if (!total.last_error.empty()) out["last_error"] = total.last_error;
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("routes %lld in %.1f s: %.0f/s, errors %lld\n", static_cast<long long>(total.routes), duration_s, qps,
                static_cast<long long>(total.errors));
    std::printf("Route latency us: p50 %.1f  p90 %.1f  p99 %.1f  p99.9 %.1f  max %.1f\n", out["p50_us"].get<double>(),
                out["p90_us"].get<double>(), out["p99_us"].get<double>(), out["p999_us"].get<double>(),
                out["max_us"].get<double>());
    if (total.completes > 0) {
      std::printf("Complete latency us: p50 %.1f  p99 %.1f (%lld completes)\n", out["complete_p50_us"].get<double>(),
                  out["complete_p99_us"].get<double>(), static_cast<long long>(total.completes));
    }
    if (total.errors > 0) std::printf("last error: %s\n", total.last_error.c_str());
  }
  return 0;
}
