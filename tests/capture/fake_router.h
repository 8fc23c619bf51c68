// A tiny in-process DecodeRouter gRPC server for the capture client tests: it decodes the counts it
// receives (int16_le or packed int32, or gate-probability sums as float32_le), remembers the last request, answers with
// a worker derived from the counts, and hands out leases that Complete releases. Listens on 127.0.0.1, port chosen by
// the OS.
#ifndef ELDR_TESTS_CAPTURE_FAKE_ROUTER_H_
#define ELDR_TESTS_CAPTURE_FAKE_ROUTER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "eldr/v1/router.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace eldr::capture::testing {

// Request ids with a special meaning:
//   "sleep-500ms"   the server waits 500 ms before answering (deadline tests)
//   "long-worker"   the worker id is 300 characters long (buffer tests)
//   "reject"        the server answers INVALID_ARGUMENT
class FakeRouterService final : public v1::DecodeRouter::Service {
 public:
  struct Received {
    std::string request_id;
    int64_t prompt_tokens = 0;
    bool has_counts = false;
    std::string encoding;  // "int16_le", "values" or "float32_le" (gate-probability sums)
    int layers = 0;
    int experts = 0;
    std::vector<int32_t> counts;
    std::vector<float> gate_prob_sums;  // decoded float32_le of a gate_prob_sums signature
  };

  grpc::Status Route(grpc::ServerContext* context, const v1::RouteRequest* request,
                     v1::RouteResponse* response) override;
  grpc::Status Complete(grpc::ServerContext* context, const v1::CompleteRequest* request,
                        v1::CompleteResponse* response) override;

  Received last() const;
  int routes() const;

 private:
  mutable absl::Mutex mu_;
  Received last_ ABSL_GUARDED_BY(mu_);
  int routes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_lease_ ABSL_GUARDED_BY(mu_) = 1000;
  std::map<uint64_t, std::string> leases_ ABSL_GUARDED_BY(mu_);
};

class FakeRouter {
 public:
  // Plaintext, or TLS with the given PEM certificate and key when both are non-empty.
  explicit FakeRouter(const std::string& tls_cert_pem = "", const std::string& tls_key_pem = "");
  ~FakeRouter();

  int port() const { return port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  FakeRouterService& service() { return service_; }

 private:
  FakeRouterService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace eldr::capture::testing

#endif  // ELDR_TESTS_CAPTURE_FAKE_ROUTER_H_
