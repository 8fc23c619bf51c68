// Pods as discovery sees them, and the mapping from a pod to a worker of the pool.
//
// ParsePod reads the few fields of a Pod object discovery needs; it never throws and never
// crashes, whatever the JSON. WorkerFromPod decides whether a pod is a worker, in which state,
// with which address, capacity, limit and metrics page: the MappingOptions give the defaults (from
// the daemon's flags), and the pod's annotations override them per pod:
//   eldr.io/port          the serving port: a container port name or a number
//   eldr.io/metrics-port  the Prometheus port: a name or a number ("" or "none": no scraping)
//   eldr.io/metrics-path  the Prometheus page's path (starts with '/')
//   eldr.io/capacity      the capacity weight (a number in [kMinWorkerCapacity, kMaxWorkerCapacity])
//   eldr.io/max-inflight  the in-flight limit (an integer in [0, kMaxWorkerInflightLimit])
// An annotation that does not parse or is out of range never drops the pod: the default is used
// and the problem is reported in DiscoveredWorker::annotation_problems.
//
// Thread-safety: the functions are pure.
#ifndef ELDR_DISCOVERY_POD_H_
#define ELDR_DISCOVERY_POD_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "eldr/core/router.h"
#include "nlohmann/json.hpp"

namespace eldr::discovery {

inline constexpr char kPortAnnotation[] = "eldr.io/port";
inline constexpr char kMetricsPortAnnotation[] = "eldr.io/metrics-port";
inline constexpr char kMetricsPathAnnotation[] = "eldr.io/metrics-path";
inline constexpr char kCapacityAnnotation[] = "eldr.io/capacity";
inline constexpr char kMaxInflightAnnotation[] = "eldr.io/max-inflight";

struct PodInfo {
  std::string name;              // metadata.name (never empty)
  std::string namespace_;        // metadata.namespace
  std::string uid;               // metadata.uid: differs between two pods of one name
  std::string resource_version;  // metadata.resourceVersion
  std::string ip;                // status.podIP (else the first of status.podIPs); empty: none yet
  std::string phase;             // status.phase: Pending, Running, Succeeded, Failed, Unknown or ""
  bool ready = false;            // the Ready condition's status is "True" (see DiscoveredWorker::State)
  bool terminating = false;      // metadata.deletionTimestamp is set
  std::map<std::string, std::string> labels;
  std::map<std::string, std::string> annotations;
  // Named TCP container ports of all containers (name -> containerPort); the first container
  // declaring a name wins. Unnamed and UDP/SCTP ports are left out.
  std::map<std::string, int> ports;

  friend bool operator==(const PodInfo&, const PodInfo&) = default;
};

// Reads a Pod object (a watch event's object, or an item of a PodList, which carries no `kind`).
// Missing optional fields take their defaults; a field that is present must have its type.
// INVALID_ARGUMENT naming the field when: the value is not an object; `kind` is present and is not
// "Pod"; metadata or metadata.name is missing, or name is empty; a field read has the wrong type
// (labels and annotations must map strings to strings, ports must be integers in 1-65535).
absl::StatusOr<PodInfo> ParsePod(const nlohmann::json& object);

// Where and how to reach a pod's engine; the annotations above override per pod.
struct MappingOptions {
  std::string port;                       // container port name or number (required)
  std::string metrics_port;               // name or number; empty: no scraping
  std::string metrics_path = "/metrics";  // starts with '/'
  double capacity = 1.0;
  int64_t max_inflight = 0;
};

// Checks the defaults: port set and of a valid form (a number in 1-65535 or a port name of 1-15
// letters, digits and '-'), metrics_port empty or of that form, metrics_path starting with '/'
// without spaces, capacity and max_inflight in ValidateWorkerSpec's ranges. INVALID_ARGUMENT.
absl::Status ValidateMappingOptions(const MappingOptions& options);

struct DiscoveredWorker {
  // id: the pod name; address: podIP:port (an IPv6 address bracketed); metrics_url:
  // http://podIP:metricsport<metrics_path>, or empty.
  WorkerSpec spec;
  // kReady: phase Running, condition Ready "True", an IP, not terminating: it may take routes.
  // kTerminating: deletionTimestamp set (its routes should drain). kNotReady: any other worker.
  enum class State { kReady, kNotReady, kTerminating };
  State state = State::kNotReady;
  std::string uid;                               // the pod's uid (a replaced pod has a new one)
  std::vector<std::string> annotation_problems;  // one sentence per annotation ignored
};

// Whether two specs are equal field by field.
bool SameWorkerSpec(const WorkerSpec& a, const WorkerSpec& b);

absl::string_view WorkerStateLabel(DiscoveredWorker::State state);  // "ready", "not_ready", "terminating"

// The worker a pod is, or why it is none. NOT_FOUND (the pod is not a worker, with the reason) for
// a pod with no IP yet, in phase Pending, Succeeded or Failed (or none), or whose port resolves
// neither from the annotation nor from the options (a name the pod does not declare).
// INVALID_ARGUMENT when the resulting spec fails ValidateWorkerSpec. A metrics port that does not
// resolve is an annotation problem (or, for the default, a problem too) and leaves metrics_url
// empty.
absl::StatusOr<DiscoveredWorker> WorkerFromPod(const PodInfo& pod, const MappingOptions& options);

}  // namespace eldr::discovery

#endif  // ELDR_DISCOVERY_POD_H_
