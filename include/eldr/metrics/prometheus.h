// Prometheus building blocks shared by ELDR's daemons (eldr-router, eldr-proxy,
// eldr-engine-emu): scrape-time metric families and their samples, the process_* collector, and
// the collector of an eldr::http::HttpServer's counters. The metrics themselves stay with each
// daemon; this module holds only what every one of them needs the same way.
//
// Values that are not finite are never exported: a sample whose value is NaN or infinite is
// dropped (Prometheus would accept them, and one bad input must not poison a dashboard).
//
// Thread-safety: the functions are pure; the collectors' Collect may run concurrently with
// everything (they read /proc, or the server's thread-safe stats()).
#ifndef ELDR_METRICS_PROMETHEUS_H_
#define ELDR_METRICS_PROMETHEUS_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "eldr/http/http_server.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/metric_type.h"

namespace eldr::metrics {

using MetricLabels = std::vector<prometheus::ClientMetric::Label>;

// The Content-Type of the Prometheus text exposition format 0.0.4.
inline constexpr char kPrometheusTextType[] = "text/plain; version=0.0.4; charset=utf-8";

prometheus::ClientMetric::Label MetricLabel(std::string name, std::string value);

prometheus::MetricFamily MetricFamily(std::string name, std::string help, prometheus::MetricType type);

// Adds one counter or gauge sample (by the family's type); dropped when `value` is not finite.
void AddSample(prometheus::MetricFamily* family, double value, MetricLabels labels = {});

// A family holding a single unlabelled sample.
prometheus::MetricFamily SingleSample(std::string name, std::string help, prometheus::MetricType type, double value);

// process_cpu_seconds_total, process_resident_memory_bytes, process_virtual_memory_bytes,
// process_start_time_seconds, process_open_fds from /proc/self (the names the Prometheus client
// libraries use).
std::shared_ptr<prometheus::Collectable> NewProcessCollector();

// <prefix>_requests_total{code="2xx|4xx|5xx"}, <prefix>_connections_total{outcome="accepted|
// refused|timed_out"}, <prefix>_bad_requests_total{reason="malformed|oversized"} and
// <prefix>_open_connections of one HttpServer, read from its stats() at scrape time. `what` names
// the server in the help texts ("the operations HTTP endpoint"). The server is attached later
// (Attach), and detached before it is destroyed; unattached, the collector exports nothing.
class HttpServerCollector final : public prometheus::Collectable {
 public:
  HttpServerCollector(std::string prefix, std::string what);
  void Attach(const http::HttpServer* server);
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace eldr::metrics

#endif  // ELDR_METRICS_PROMETHEUS_H_
