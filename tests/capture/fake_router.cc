#include "capture/fake_router.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

namespace eldr::capture::testing {

grpc::Status FakeRouterService::Route(grpc::ServerContext* /*context*/, const v1::RouteRequest* request,
                                      v1::RouteResponse* response) {
  if (request->request_id() == "sleep-500ms") {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  if (request->request_id() == "reject") {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "counts rejected by the fake router");
  }
  Received received;
  received.request_id = request->request_id();
  received.prompt_tokens = request->prompt_tokens();
  if (request->has_counts()) {
    const v1::ExpertCounts& counts = request->counts();
    received.has_counts = true;
    received.layers = counts.layers();
    received.experts = counts.experts();
    const int64_t cells = int64_t{counts.layers()} * counts.experts();
    if (counts.has_values()) {
      received.encoding = "values";
      received.counts.assign(counts.values().values().begin(), counts.values().values().end());
    } else {
      received.encoding = "int16_le";
      const std::string& bytes = counts.int16_le();
      if (static_cast<int64_t>(bytes.size()) != 2 * cells) {
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("int16_le has ", bytes.size(), " bytes for ", counts.layers(), " x ", counts.experts()));
      }
      for (int64_t i = 0; i < cells; ++i) {
        const auto lo = static_cast<uint8_t>(bytes[2 * i]);
        const auto hi = static_cast<uint8_t>(bytes[2 * i + 1]);
        received.counts.push_back(static_cast<int16_t>(lo | (hi << 8)));
      }
    }
    if (static_cast<int64_t>(received.counts.size()) != cells) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "counts do not match L x E");
    }
  }
  if (request->has_gate_prob_sums()) {
    const v1::GateProbSums& sums = request->gate_prob_sums();
    received.has_counts = true;
    received.encoding = "float32_le";
    received.layers = sums.layers();
    received.experts = sums.experts();
    const std::string& bytes = sums.float32_le();
    if (static_cast<int64_t>(bytes.size()) != 4 * int64_t{sums.layers()} * sums.experts()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "float32_le does not match L x E");
    }
    for (size_t i = 0; i < bytes.size() / 4; ++i) {
      uint32_t bits = 0;
      for (int b = 3; b >= 0; --b) bits = (bits << 8) | static_cast<uint8_t>(bytes[4 * i + b]);
      float value;
      std::memcpy(&value, &bits, sizeof(value));
      received.gate_prob_sums.push_back(value);
    }
  }
  absl::MutexLock lock(&mu_);
  ++routes_;
  const uint64_t lease = next_lease_++;
  std::string worker;
  if (request->request_id() == "long-worker") {
    worker = std::string(300, 'w');
  } else if (!received.gate_prob_sums.empty()) {
    const auto it = std::max_element(received.gate_prob_sums.begin(), received.gate_prob_sums.end());
    worker = absl::StrCat("decode-", (it - received.gate_prob_sums.begin()) % 3);
  } else if (received.has_counts && !received.counts.empty()) {
    // The worker is the argmax cell modulo 3, so tests can check the counts arrived intact.
    const auto it = std::max_element(received.counts.begin(), received.counts.end());
    worker = absl::StrCat("decode-", (it - received.counts.begin()) % 3);
  } else {
    worker = "decode-0";
    response->set_fallback_reason("no_signature");
  }
  response->set_worker_id(worker);
  response->set_address(absl::StrCat("10.0.0.", lease % 250, ":8000"));
  response->set_lease_id(lease);
  response->set_policy(received.has_counts ? "eldr" : "jsq");
  response->set_similarity(received.has_counts ? 0.75f : 0.0f);
  response->set_band_size(received.has_counts ? 2 : 0);
  response->set_centroid_generation(7);
  leases_[lease] = worker;
  last_ = std::move(received);
  return grpc::Status::OK;
}

grpc::Status FakeRouterService::Complete(grpc::ServerContext* /*context*/, const v1::CompleteRequest* request,
                                         v1::CompleteResponse* response) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(request->lease_id());
  if (it == leases_.end()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("unknown lease ", request->lease_id()));
  }
  response->set_worker_id(it->second);
  leases_.erase(it);
  return grpc::Status::OK;
}

FakeRouterService::Received FakeRouterService::last() const {
  absl::MutexLock lock(&mu_);
  return last_;
}

int FakeRouterService::routes() const {
  absl::MutexLock lock(&mu_);
  return routes_;
}

FakeRouter::FakeRouter(const std::string& tls_cert_pem, const std::string& tls_key_pem) {
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (!tls_cert_pem.empty() && !tls_key_pem.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({tls_key_pem, tls_cert_pem});
    credentials = grpc::SslServerCredentials(ssl);
  } else {
    credentials = grpc::InsecureServerCredentials();
  }
  builder.AddListeningPort("127.0.0.1:0", credentials, &port_);
  builder.RegisterService(&service_);
  server_ = builder.BuildAndStart();
}

FakeRouter::~FakeRouter() {
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
}

}  // namespace eldr::capture::testing
