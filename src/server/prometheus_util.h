// Building blocks for scrape-time metric families (prometheus::Collectable::Collect), shared by
// every collector of the daemon: one family, its samples, their labels. Values that are not finite
// are never exported: a sample whose value is NaN or infinite is dropped (Prometheus would accept
// them, and one bad input must not poison a dashboard).
#ifndef ELDR_SERVER_PROMETHEUS_UTIL_H_
#define ELDR_SERVER_PROMETHEUS_UTIL_H_

#include <string>
#include <utility>
#include <vector>

#include "prometheus/metric_family.h"
#include "prometheus/metric_type.h"

namespace eldr::server {

using MetricLabels = std::vector<prometheus::ClientMetric::Label>;

prometheus::ClientMetric::Label MetricLabel(std::string name, std::string value);

prometheus::MetricFamily MetricFamily(std::string name, std::string help, prometheus::MetricType type);

// Adds one counter or gauge sample (by the family's type); dropped when `value` is not finite.
void AddSample(prometheus::MetricFamily* family, double value, MetricLabels labels = {});

// A family holding a single unlabelled sample.
prometheus::MetricFamily SingleSample(std::string name, std::string help, prometheus::MetricType type, double value);

}  // namespace eldr::server

#endif  // ELDR_SERVER_PROMETHEUS_UTIL_H_
