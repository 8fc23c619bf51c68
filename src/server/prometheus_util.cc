#include "server/prometheus_util.h"

#include <cmath>

namespace eldr::server {

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

}  // namespace eldr::server
