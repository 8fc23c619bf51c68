#include "loadsignals/fake_metrics_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace eldr::testing {
namespace {

// Python's float repr as prometheus_client writes values: "3.0", "0.25", "1e-05", "+Inf", "NaN".
std::string PyFloat(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (value == std::floor(value) && std::fabs(value) < 1e16) return absl::StrFormat("%.1f", value);
  return absl::StrFormat("%.17g", value);
}

std::string Labels(const std::string& model_name, int engine) {
  return absl::StrFormat("engine=\"%d\",model_name=\"%s\"", engine, model_name);
}

void AppendHistogram(std::string* page, const std::string& name, const std::string& help, const std::string& labels,
                     double observed_count, double observed_sum) {
  absl::StrAppend(page, "# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  const double bounds[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0};
  double cumulative = 0;
  for (double bound : bounds) {
    cumulative = std::min(observed_count, cumulative + std::floor(observed_count / 10));
    absl::StrAppend(page, name, "_bucket{", labels, ",le=\"", PyFloat(bound), "\"} ", PyFloat(cumulative), "\n");
  }
  absl::StrAppend(page, name, "_bucket{", labels, ",le=\"+Inf\"} ", PyFloat(observed_count), "\n");
  absl::StrAppend(page, name, "_count{", labels, "} ", PyFloat(observed_count), "\n");
  absl::StrAppend(page, name, "_sum{", labels, "} ", PyFloat(observed_sum), "\n");
}

std::string HttpResponse(int status, absl::string_view reason, absl::string_view content_type, absl::string_view body,
                         bool keep_alive) {
  return absl::StrCat("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: ", keep_alive ? "keep-alive" : "close",
                      "\r\n\r\n", body);
}

}  // namespace

std::string VllmMetricsPage(const FakeLoad& load, const std::string& model_name, int engines) {
  std::string page;
  absl::StrAppend(
      &page,
      "# HELP python_gc_objects_collected_total Objects collected during gc\n"
      "# TYPE python_gc_objects_collected_total counter\n"
      "python_gc_objects_collected_total{generation=\"0\"} 12931.0\n"
      "python_gc_objects_collected_total{generation=\"1\"} 3352.0\n"
      "python_gc_objects_collected_total{generation=\"2\"} 471.0\n"
      "# HELP python_info Python platform information\n"
      "# TYPE python_info gauge\n"
      "python_info{implementation=\"CPython\",major=\"3\",minor=\"12\",patchlevel=\"9\",version=\"3.12.9\"} 1.0\n"
      "# HELP process_virtual_memory_bytes Virtual memory size in bytes.\n"
      "# TYPE process_virtual_memory_bytes gauge\n"
      "process_virtual_memory_bytes 1.3542948864e+10\n"
      "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
      "# TYPE process_start_time_seconds gauge\n"
      "process_start_time_seconds 1.74e+09\n");
  const double engines_d = std::max(1, engines);
  auto gauge = [&](const std::string& name, const std::string& help, double total) {
    absl::StrAppend(&page, "# HELP ", name, " ", help, "\n# TYPE ", name, " gauge\n");
    for (int engine = 0; engine < std::max(1, engines); ++engine) {
      absl::StrAppend(&page, name, "{", Labels(model_name, engine), "} ", PyFloat(total / engines_d), "\n");
    }
  };
  gauge("vllm:num_requests_running", "Number of requests in model execution batches.", load.running);
  gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", load.waiting);
  // Usage is a per-engine fraction: every engine reports the same value here.
  absl::StrAppend(&page, "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n",
                  "# TYPE vllm:kv_cache_usage_perc gauge\n");
  for (int engine = 0; engine < std::max(1, engines); ++engine) {
    absl::StrAppend(&page, "vllm:kv_cache_usage_perc{", Labels(model_name, engine), "} ", PyFloat(load.kv_usage), "\n");
  }
  for (int engine = 0; engine < std::max(1, engines); ++engine) {
    const std::string labels = Labels(model_name, engine);
    absl::StrAppend(&page,
                    "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
                    "# TYPE vllm:prompt_tokens_total counter\n"
                    "vllm:prompt_tokens_total{",
                    labels,
                    "} 48213.0\n"
                    "# HELP vllm:request_success_total Count of successfully processed requests.\n"
                    "# TYPE vllm:request_success_total counter\n"
                    "vllm:request_success_total{",
                    labels,
                    ",finished_reason=\"stop\"} 311.0\n"
                    "vllm:request_success_total{",
                    labels,
                    ",finished_reason=\"length\"} 9.0\n"
                    "# HELP vllm:request_success_created Count of successfully processed requests.\n"
                    "# TYPE vllm:request_success_created gauge\n"
                    "vllm:request_success_created{",
                    labels, ",finished_reason=\"stop\"} 1.7400012345e+09\n");
    AppendHistogram(&page, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
                    320, 41.25);
    AppendHistogram(&page, "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                    labels, 51200, 1433.6);
  }
  absl::StrAppend(&page,
                  "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                  "# TYPE vllm:cache_config_info gauge\n"
                  "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",calculate_kv_scales=\"False\","
                  "enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\","
                  "num_gpu_blocks=\"27138\",prefix_caching_hash_algo=\"builtin\",swap_space=\"4\"} 1.0\n");
  return page;
}

std::string SglangMetricsPage(const FakeLoad& load, const std::string& model_name) {
  const std::string labels = absl::StrFormat("model_name=\"%s\"", model_name);
  return absl::StrCat(
      "# HELP sglang:num_running_reqs The number of running requests.\n"
      "# TYPE sglang:num_running_reqs gauge\n"
      "sglang:num_running_reqs{",
      labels, "} ", PyFloat(load.running), "\n",
      "# HELP sglang:num_used_tokens The number of used tokens.\n"
      "# TYPE sglang:num_used_tokens gauge\n"
      "sglang:num_used_tokens{",
      labels, "} 1873.0\n",
      "# HELP sglang:token_usage The token usage.\n"
      "# TYPE sglang:token_usage gauge\n"
      "sglang:token_usage{",
      labels, "} ", PyFloat(load.kv_usage), "\n",
      "# HELP sglang:gen_throughput The generation throughput (token/s).\n"
      "# TYPE sglang:gen_throughput gauge\n"
      "sglang:gen_throughput{",
      labels, "} 1532.7\n",
      "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
      "# TYPE sglang:num_queue_reqs gauge\n"
      "sglang:num_queue_reqs{",
      labels, "} ", PyFloat(load.waiting), "\n");
}

FakeMetricsServer::FakeMetricsServer(std::string model_name) : model_name_(std::move(model_name)) {
  page_ = VllmMetricsPage({}, model_name_);
}

absl::StatusOr<std::unique_ptr<FakeMetricsServer>> FakeMetricsServer::Start(std::string model_name) {
  std::unique_ptr<FakeMetricsServer> server(new FakeMetricsServer(std::move(model_name)));
  if (pipe2(server->wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  absl::Status listening = server->Listen(0);
  if (!listening.ok()) return listening;
  server->accept_thread_ = std::thread([raw = server.get()] { raw->AcceptLoop(); });
  return server;
}

FakeMetricsServer::~FakeMetricsServer() {
  stopping_.store(true);
  if (wake_pipe_[1] >= 0) (void)!write(wake_pipe_[1], "x", 1);
  if (accept_thread_.joinable()) accept_thread_.join();
  std::vector<Connection> connections;
  {
    absl::MutexLock lock(&mu_);
    connections.swap(connection_threads_);
    if (listen_fd_ >= 0) close(listen_fd_);
    listen_fd_ = -1;
  }
  for (Connection& connection : connections) connection.thread.join();
  for (int fd : wake_pipe_) {
    if (fd >= 0) close(fd);
  }
}

std::string FakeMetricsServer::url() const { return absl::StrCat("http://127.0.0.1:", port_, "/metrics"); }

void FakeMetricsServer::SetLoad(const FakeLoad& load, int engines) {
  SetPage(VllmMetricsPage(load, model_name_, engines));
}

void FakeMetricsServer::SetPage(std::string body) {
  absl::MutexLock lock(&mu_);
  page_ = std::move(body);
}

absl::Status FakeMetricsServer::SetMode(Mode mode) {
  absl::MutexLock lock(&mu_);
  const Mode previous = mode_;
  mode_ = mode;
  if (mode == Mode::kDown && listen_fd_ >= 0) {
    // The accept loop never blocks on the socket without holding mu_ first (it polls a copy with
    // a short timeout), so shutdown() wakes it and it notices the closed socket below.
    shutdown(listen_fd_, SHUT_RDWR);
    close(listen_fd_);
    listen_fd_ = -1;
  } else if (previous == Mode::kDown && mode != Mode::kDown && listen_fd_ < 0) {
    mu_.Unlock();
    absl::Status status = Listen(port_);
    mu_.Lock();
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status FakeMetricsServer::Listen(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || listen(fd, 64) != 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("bind/listen 127.0.0.1:", port, ": ", std::strerror(error)));
  }
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  absl::MutexLock lock(&mu_);
  port_ = ntohs(address.sin_port);
  listen_fd_ = fd;
  return absl::OkStatus();
}

bool FakeMetricsServer::WaitReadable(int fd, int timeout_ms) const {
  pollfd entry{fd, POLLIN, 0};
  return poll(&entry, 1, timeout_ms) > 0;
}

void FakeMetricsServer::AcceptLoop() {
  while (!stopping_.load()) {
    int fd = -1;
    {
      absl::MutexLock lock(&mu_);
      fd = listen_fd_;
    }
    if (fd < 0) {
      pollfd wake{wake_pipe_[0], POLLIN, 0};
      poll(&wake, 1, 20);
      continue;
    }
    pollfd entries[2] = {{fd, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
    if (poll(entries, 2, 20) <= 0 || !(entries[0].revents & POLLIN)) continue;
    absl::MutexLock lock(&mu_);
    // The socket may have been closed (kDown) since the poll; only accept on the current one.
    if (listen_fd_ != fd) continue;
    const int connection = accept4(fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (connection < 0) continue;
    // Join the connections that ended, so a long run that drops many connections stays small.
    for (auto it = connection_threads_.begin(); it != connection_threads_.end();) {
      if (it->done->load()) {
        it->thread.join();
        it = connection_threads_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    connection_threads_.push_back({std::thread([this, connection, done] {
                                     ServeConnection(connection);
                                     done->store(true);
                                   }),
                                   done});
  }
}

void FakeMetricsServer::ServeConnection(int fd) {
  std::string buffer;
  char chunk[4096];
  auto mode_now = [this] {
    absl::MutexLock lock(&mu_);
    return mode_;
  };
  while (!stopping_.load()) {
    size_t header_end = buffer.find("\r\n\r\n");
    if (header_end == std::string::npos) {
      if (mode_now() == Mode::kDown) break;  // a dead worker's connections die with it
      if (!WaitReadable(fd, 20)) continue;
      const ssize_t n = recv(fd, chunk, sizeof(chunk), 0);
      if (n == 0) break;
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        break;
      }
      buffer.append(chunk, static_cast<size_t>(n));
      if (buffer.size() > 64 * 1024) break;
      continue;
    }
    const std::string request = buffer.substr(0, header_end);
    buffer.erase(0, header_end + 4);
    requests_received_.fetch_add(1);
    const bool keep_alive = absl::AsciiStrToLower(request).find("\r\nconnection: close") == std::string::npos;
    const size_t first_space = request.find(' ');
    const size_t second_space = request.find(' ', first_space + 1);
    const std::string path = first_space == std::string::npos || second_space == std::string::npos
                                 ? ""
                                 : request.substr(first_space + 1, second_space - first_space - 1);
    Mode mode = mode_now();
    if (mode == Mode::kHang) {
      // Hold the request unanswered until the mode changes; then drop the connection.
      while (!stopping_.load() && mode_now() == Mode::kHang) {
        if (WaitReadable(fd, 20)) {
          const ssize_t n = recv(fd, chunk, sizeof(chunk), 0);
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) break;  // the client gave up
        }
      }
      break;
    }
    if (mode == Mode::kDown) break;
    std::string response;
    if (mode == Mode::kHttpError) {
      response = HttpResponse(503, "Service Unavailable", "text/plain", "engine overloaded\n", keep_alive);
    } else if (path != "/metrics") {
      response = HttpResponse(404, "Not Found", "text/plain", "not found\n", keep_alive);
    } else if (mode == Mode::kMalformed) {
      response = HttpResponse(200, "OK", "text/plain; version=0.0.4; charset=utf-8",
                              "# TYPE vllm:num_requests_running gauge\n"
                              "vllm:num_requests_running{model_name=\"test-model\" 3.0\n",
                              keep_alive);
      pages_served_.fetch_add(1);
    } else {
      std::string page;
      {
        absl::MutexLock lock(&mu_);
        page = page_;
      }
      response = HttpResponse(200, "OK", "text/plain; version=0.0.4; charset=utf-8", page, keep_alive);
      pages_served_.fetch_add(1);
    }
    // The socket is non-blocking: wait for room when the client reads slowly.
    size_t sent = 0;
    bool failed = false;
    while (sent < response.size() && !stopping_.load()) {
      const ssize_t n = send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        pollfd entry{fd, POLLOUT, 0};
        poll(&entry, 1, 20);
      } else {
        failed = true;
        break;
      }
    }
    if (failed || !keep_alive) break;
  }
  close(fd);
}

}  // namespace eldr::testing
