#include "eldr/metrics/prometheus.h"

#include <dirent.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <iterator>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace eldr::metrics {
namespace {

class ProcessCollector final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    std::vector<prometheus::MetricFamily> out;
    std::ifstream stat_file("/proc/self/stat");
    std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
    // Fields after the parenthesised command name (which may contain spaces).
    const size_t close = stat.rfind(')');
    if (close == std::string::npos || close + 2 > stat.size()) return out;
    std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ', absl::SkipEmpty());
    // fields[0] is field 3 (state): field n is fields[n - 3].
    if (fields.size() < 22) return out;
    const auto field = [&fields](int n) {
      double value = 0;
      return absl::SimpleAtod(fields[static_cast<size_t>(n - 3)], &value) ? value : std::nan("");
    };
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
    auto cpu =
        MetricFamily("process_cpu_seconds_total", "User and system CPU time spent in seconds.", MetricType::Counter);
    AddSample(&cpu, (field(14) + field(15)) / ticks);
    out.push_back(std::move(cpu));
    auto rss = MetricFamily("process_resident_memory_bytes", "Resident memory size in bytes.", MetricType::Gauge);
    AddSample(&rss, field(24) * page);
    out.push_back(std::move(rss));
    auto vms = MetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", MetricType::Gauge);
    AddSample(&vms, field(23));
    out.push_back(std::move(vms));
    if (boot_time_ > 0) {
      auto start = MetricFamily("process_start_time_seconds", "Start time of the process since the Unix epoch.",
                                MetricType::Gauge);
      AddSample(&start, boot_time_ + field(22) / ticks);
      out.push_back(std::move(start));
    }
    auto fds = MetricFamily("process_open_fds", "Open file descriptors.", MetricType::Gauge);
    AddSample(&fds, CountOpenFds());
    out.push_back(std::move(fds));
    return out;
  }

 private:
  static double ReadBootTime() {
    std::ifstream in("/proc/stat");
    std::string line;
    while (std::getline(in, line)) {
      double value = 0;
      if (line.rfind("btime ", 0) == 0 && absl::SimpleAtod(line.substr(6), &value)) return value;
    }
    return 0;
  }
  static double CountOpenFds() {
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return 0;
    double n = 0;
    while (dirent* entry = readdir(dir)) {
      if (entry->d_name[0] != '.') ++n;
    }
    closedir(dir);
    return n - 1;  // the descriptor opendir itself holds
  }

  const double boot_time_ = ReadBootTime();
};

}  // namespace

prometheus::ClientMetric::Label MetricLabel(std::string name, std::string value) {
  prometheus::ClientMetric::Label label;
  label.name = std::move(name);
  label.value = std::move(value);
  return label;
}

prometheus::MetricFamily MetricFamily(std::string name, std::string help, prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = type;
  return family;
}

void AddSample(prometheus::MetricFamily* family, double value, MetricLabels labels) {
  if (!std::isfinite(value)) return;
  prometheus::ClientMetric metric;
  metric.label = std::move(labels);
  if (family->type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family->metric.push_back(std::move(metric));
}

prometheus::MetricFamily SingleSample(std::string name, std::string help, prometheus::MetricType type, double value) {
  prometheus::MetricFamily family = MetricFamily(std::move(name), std::move(help), type);
  AddSample(&family, value);
  return family;
}

std::shared_ptr<prometheus::Collectable> NewProcessCollector() { return std::make_shared<ProcessCollector>(); }

class HttpServerCollector::Impl {
 public:
  Impl(std::string prefix, std::string what) : prefix_(std::move(prefix)), what_(std::move(what)) {}

  void Attach(const http::HttpServer* server) {
    absl::MutexLock lock(&mu_);
    server_ = server;
  }

  std::vector<prometheus::MetricFamily> Collect() const {
    absl::MutexLock lock(&mu_);
    if (server_ == nullptr) return {};
    const http::HttpServerStats stats = server_->stats();
    using prometheus::MetricType;
    auto requests =
        MetricFamily(absl::StrCat(prefix_, "_requests_total"),
                     absl::StrCat("Requests answered by ", what_, ", by status class."), MetricType::Counter);
    AddSample(&requests, static_cast<double>(stats.responses_2xx), {MetricLabel("code", "2xx")});
    AddSample(&requests, static_cast<double>(stats.responses_4xx), {MetricLabel("code", "4xx")});
    AddSample(&requests, static_cast<double>(stats.responses_5xx), {MetricLabel("code", "5xx")});
    auto connections = MetricFamily(absl::StrCat(prefix_, "_connections_total"),
                                    absl::StrCat("Connections of ", what_,
                                                 ": accepted, refused (over the connection limit), timed_out (idle "
                                                 "or too slow)."),
                                    MetricType::Counter);
    AddSample(&connections, static_cast<double>(stats.connections_accepted), {MetricLabel("outcome", "accepted")});
    AddSample(&connections, static_cast<double>(stats.connections_refused), {MetricLabel("outcome", "refused")});
    AddSample(&connections, static_cast<double>(stats.connections_timed_out), {MetricLabel("outcome", "timed_out")});
    auto bad = MetricFamily(absl::StrCat(prefix_, "_bad_requests_total"),
                            "Requests refused before routing: malformed (400) or over a size limit (413/414/431).",
                            MetricType::Counter);
    AddSample(&bad, static_cast<double>(stats.malformed_requests), {MetricLabel("reason", "malformed")});
    AddSample(&bad, static_cast<double>(stats.oversized_requests), {MetricLabel("reason", "oversized")});
    std::vector<prometheus::MetricFamily> out;
    out.push_back(std::move(requests));
    out.push_back(std::move(connections));
    out.push_back(std::move(bad));
    out.push_back(SingleSample(absl::StrCat(prefix_, "_open_connections"),
                               absl::StrCat("Open connections of ", what_, "."), MetricType::Gauge,
                               static_cast<double>(stats.open_connections)));
    return out;
  }

 private:
  const std::string prefix_;
  const std::string what_;
  mutable absl::Mutex mu_;
  const http::HttpServer* server_ ABSL_GUARDED_BY(mu_) = nullptr;
};

HttpServerCollector::HttpServerCollector(std::string prefix, std::string what)
    : impl_(std::make_shared<Impl>(std::move(prefix), std::move(what))) {}

void HttpServerCollector::Attach(const http::HttpServer* server) { impl_->Attach(server); }

std::vector<prometheus::MetricFamily> HttpServerCollector::Collect() const { return impl_->Collect(); }

}  // namespace eldr::metrics
