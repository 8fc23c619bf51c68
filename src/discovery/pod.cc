#include "eldr/discovery/pod.h"

#include <cmath>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace eldr::discovery {
namespace {

using Json = nlohmann::json;

// The member `key` of object `parent`, or null when absent or JSON null.
const Json* Member(const Json& parent, const char* key) {
  auto it = parent.find(key);
  if (it == parent.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status WrongType(absl::string_view field, absl::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat("pod field ", field, " must be ", want));
}

// Reads an optional string member into `out`.
absl::Status ReadString(const Json& parent, const char* key, absl::string_view field, std::string* out) {
  const Json* value = Member(parent, key);
  if (value == nullptr) return absl::OkStatus();
  if (!value->is_string()) return WrongType(field, "a string");
  *out = value->get_ref<const std::string&>();
  return absl::OkStatus();
}

absl::Status ReadStringMap(const Json& parent, const char* key, absl::string_view field,
                           std::map<std::string, std::string>* out) {
  const Json* value = Member(parent, key);
  if (value == nullptr) return absl::OkStatus();
  if (!value->is_object()) return WrongType(field, "an object of strings");
  for (auto it = value->begin(); it != value->end(); ++it) {
    if (!it.value().is_string()) return WrongType(absl::StrCat(field, "[\"", it.key(), "\"]"), "a string");
    (*out)[it.key()] = it.value().get_ref<const std::string&>();
  }
  return absl::OkStatus();
}

absl::Status ReadPorts(const Json& spec, PodInfo* pod) {
  const Json* containers = Member(spec, "containers");
  if (containers == nullptr) return absl::OkStatus();
  if (!containers->is_array()) return WrongType("spec.containers", "an array");
  for (const Json& container : *containers) {
    if (!container.is_object()) return WrongType("spec.containers[]", "an object");
    const Json* ports = Member(container, "ports");
    if (ports == nullptr) continue;
    if (!ports->is_array()) return WrongType("spec.containers[].ports", "an array");
    for (const Json& port : *ports) {
      if (!port.is_object()) return WrongType("spec.containers[].ports[]", "an object");
      const Json* number = Member(port, "containerPort");
      if (number == nullptr || !number->is_number_integer()) {
        return WrongType("spec.containers[].ports[].containerPort", "an integer");
      }
      const int64_t value = number->get<int64_t>();
      if (value < 1 || value > 65535) {
        return absl::InvalidArgumentError(
            absl::StrCat("pod field spec.containers[].ports[].containerPort ", value, " is not in 1-65535"));
      }
      std::string name;
      std::string protocol;
      absl::Status read = ReadString(port, "name", "spec.containers[].ports[].name", &name);
      if (!read.ok()) return read;
      read = ReadString(port, "protocol", "spec.containers[].ports[].protocol", &protocol);
      if (!read.ok()) return read;
      if (name.empty() || (!protocol.empty() && protocol != "TCP")) continue;
      pod->ports.try_emplace(name, static_cast<int>(value));
    }
  }
  return absl::OkStatus();
}

absl::Status ReadStatus(const Json& status, PodInfo* pod) {
  absl::Status read = ReadString(status, "phase", "status.phase", &pod->phase);
  if (!read.ok()) return read;
  read = ReadString(status, "podIP", "status.podIP", &pod->ip);
  if (!read.ok()) return read;
  if (const Json* ips = Member(status, "podIPs")) {
    if (!ips->is_array()) return WrongType("status.podIPs", "an array");
    for (const Json& entry : *ips) {
      if (!entry.is_object()) return WrongType("status.podIPs[]", "an object");
      std::string ip;
      read = ReadString(entry, "ip", "status.podIPs[].ip", &ip);
      if (!read.ok()) return read;
      if (pod->ip.empty()) pod->ip = ip;
    }
  }
  if (const Json* conditions = Member(status, "conditions")) {
    if (!conditions->is_array()) return WrongType("status.conditions", "an array");
    for (const Json& condition : *conditions) {
      if (!condition.is_object()) return WrongType("status.conditions[]", "an object");
      std::string type;
      std::string value;
      read = ReadString(condition, "type", "status.conditions[].type", &type);
      if (!read.ok()) return read;
      read = ReadString(condition, "status", "status.conditions[].status", &value);
      if (!read.ok()) return read;
      if (type == "Ready") pod->ready = value == "True";
    }
  }
  return absl::OkStatus();
}

bool AllDigits(absl::string_view text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// A port given as a number (1-65535) or a port name (IANA service name form, loosely: 1-15
// letters, digits and '-', at least one letter).
absl::Status CheckPortForm(absl::string_view text) {
  if (AllDigits(text)) {
    int number = 0;
    if (!absl::SimpleAtoi(text, &number) || number < 1 || number > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("port \"", text, "\" is not in 1-65535"));
    }
    return absl::OkStatus();
  }
  bool letter = false;
  for (char c : text) {
    if (absl::ascii_isalpha(static_cast<unsigned char>(c))) {
      letter = true;
    } else if (!absl::ascii_isdigit(static_cast<unsigned char>(c)) && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat("port \"", absl::CHexEscape(text), "\" is neither a number nor a port name"));
    }
  }
  if (text.empty() || text.size() > 15 || !letter) {
    return absl::InvalidArgumentError(
        absl::StrCat("port \"", absl::CHexEscape(text), "\" is neither a number nor a port name"));
  }
  return absl::OkStatus();
}

// The port number `text` stands for on `pod`: a number, or a named container port of the pod.
absl::StatusOr<int> ResolvePort(const PodInfo& pod, absl::string_view text) {
  absl::Status form = CheckPortForm(text);
  if (!form.ok()) return form;
  if (AllDigits(text)) {
    int number = 0;
    (void)absl::SimpleAtoi(text, &number);
    return number;
  }
  auto it = pod.ports.find(std::string(text));
  if (it == pod.ports.end()) {
    return absl::NotFoundError(absl::StrCat("the pod declares no TCP container port named \"", text, "\""));
  }
  return it->second;
}

absl::Status CheckMetricsPath(absl::string_view path) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics path \"", absl::CHexEscape(path), "\" must start with '/'"));
  }
  if (path.size() > 1024) return absl::InvalidArgumentError("metrics path is longer than 1024 bytes");
  for (char c : path) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics path \"", absl::CHexEscape(path), "\" has a space or a non-printable byte"));
    }
  }
  return absl::OkStatus();
}

std::string Host(const std::string& ip) { return ip.find(':') != std::string::npos ? absl::StrCat("[", ip, "]") : ip; }

const std::string* Annotation(const PodInfo& pod, const char* key) {
  auto it = pod.annotations.find(key);
  return it == pod.annotations.end() ? nullptr : &it->second;
}

std::string Problem(const char* key, const std::string& value, absl::string_view why, absl::string_view fallback) {
  return absl::StrCat("annotation ", key, "=\"", absl::CHexEscape(value.substr(0, 64)), "\" ignored (", why,
                      "); using ", fallback);
}

}  // namespace

absl::StatusOr<PodInfo> ParsePod(const nlohmann::json& object) {
  if (!object.is_object()) return absl::InvalidArgumentError("a pod must be a JSON object");
  PodInfo pod;
  std::string kind;
  absl::Status read = ReadString(object, "kind", "kind", &kind);
  if (!read.ok()) return read;
  if (!kind.empty() && kind != "Pod") {
    return absl::InvalidArgumentError(absl::StrCat("object of kind \"", absl::CHexEscape(kind), "\" is not a Pod"));
  }
  const Json* metadata = Member(object, "metadata");
  if (metadata == nullptr) return absl::InvalidArgumentError("pod has no metadata");
  if (!metadata->is_object()) return WrongType("metadata", "an object");
  read = ReadString(*metadata, "name", "metadata.name", &pod.name);
  if (!read.ok()) return read;
  if (pod.name.empty()) return absl::InvalidArgumentError("pod has no metadata.name");
  for (auto [key, field, out] :
       {std::tuple{"namespace", "metadata.namespace", &pod.namespace_}, std::tuple{"uid", "metadata.uid", &pod.uid},
        std::tuple{"resourceVersion", "metadata.resourceVersion", &pod.resource_version}}) {
    read = ReadString(*metadata, key, field, out);
    if (!read.ok()) return read;
  }
  std::string deletion;
  read = ReadString(*metadata, "deletionTimestamp", "metadata.deletionTimestamp", &deletion);
  if (!read.ok()) return read;
  pod.terminating = !deletion.empty();
  read = ReadStringMap(*metadata, "labels", "metadata.labels", &pod.labels);
  if (!read.ok()) return read;
  read = ReadStringMap(*metadata, "annotations", "metadata.annotations", &pod.annotations);
  if (!read.ok()) return read;
  if (const Json* spec = Member(object, "spec")) {
    if (!spec->is_object()) return WrongType("spec", "an object");
    read = ReadPorts(*spec, &pod);
    if (!read.ok()) return read;
  }
  if (const Json* status = Member(object, "status")) {
    if (!status->is_object()) return WrongType("status", "an object");
    read = ReadStatus(*status, &pod);
    if (!read.ok()) return read;
  }
  return pod;
}

absl::Status ValidateMappingOptions(const MappingOptions& options) {
  if (options.port.empty()) return absl::InvalidArgumentError("discovery needs the workers' port (name or number)");
  absl::Status form = CheckPortForm(options.port);
  if (!form.ok()) return absl::InvalidArgumentError(absl::StrCat("worker port: ", form.message()));
  if (!options.metrics_port.empty()) {
    form = CheckPortForm(options.metrics_port);
    if (!form.ok()) return absl::InvalidArgumentError(absl::StrCat("worker metrics port: ", form.message()));
  }
  form = CheckMetricsPath(options.metrics_path);
  if (!form.ok()) return form;
  if (!std::isfinite(options.capacity) || options.capacity < kMinWorkerCapacity ||
      options.capacity > kMaxWorkerCapacity) {
    return absl::InvalidArgumentError(absl::StrCat("worker capacity ", options.capacity, " is not in [",
                                                   kMinWorkerCapacity, ", ", kMaxWorkerCapacity, "]"));
  }
  if (options.max_inflight < 0 || options.max_inflight > kMaxWorkerInflightLimit) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker max_inflight ", options.max_inflight, " is not in [0, ", kMaxWorkerInflightLimit, "]"));
  }
  return absl::OkStatus();
}

absl::string_view WorkerStateLabel(DiscoveredWorker::State state) {
  switch (state) {
    case DiscoveredWorker::State::kReady:
      return "ready";
    case DiscoveredWorker::State::kNotReady:
      return "not_ready";
    case DiscoveredWorker::State::kTerminating:
      return "terminating";
  }
  return "unknown";
}

bool SameWorkerSpec(const WorkerSpec& a, const WorkerSpec& b) {
  return a.id == b.id && a.address == b.address && a.capacity == b.capacity && a.max_inflight == b.max_inflight &&
         a.metrics_url == b.metrics_url;
}

absl::StatusOr<DiscoveredWorker> WorkerFromPod(const PodInfo& pod, const MappingOptions& options) {
  if (pod.phase.empty() || pod.phase == "Pending" || pod.phase == "Succeeded" || pod.phase == "Failed") {
    return absl::NotFoundError(
        absl::StrCat("pod ", pod.name, " is not a worker: phase ", pod.phase.empty() ? "not reported yet" : pod.phase));
  }
  if (pod.ip.empty()) return absl::NotFoundError(absl::StrCat("pod ", pod.name, " is not a worker: no IP yet"));

  DiscoveredWorker worker;
  worker.uid = pod.uid;
  worker.spec.id = pod.name;
  const std::string host = Host(pod.ip);

  std::optional<int> port;
  if (const std::string* value = Annotation(pod, kPortAnnotation)) {
    absl::StatusOr<int> resolved = ResolvePort(pod, *value);
    if (resolved.ok()) {
      port = *resolved;
    } else {
      worker.annotation_problems.push_back(
          Problem(kPortAnnotation, *value, resolved.status().message(), absl::StrCat("port ", options.port)));
    }
  }
  if (!port.has_value()) {
    absl::StatusOr<int> resolved = ResolvePort(pod, options.port);
    if (!resolved.ok()) {
      return absl::NotFoundError(absl::StrCat("pod ", pod.name, " is not a worker: port \"", options.port,
                                              "\" does not resolve (", resolved.status().message(), ")"));
    }
    port = *resolved;
  }
  worker.spec.address = absl::StrCat(host, ":", *port);

  // Metrics: the annotation (a port, or ""/"none" for no scraping), else the default.
  std::optional<int> metrics_port;
  bool metrics_decided = false;
  if (const std::string* value = Annotation(pod, kMetricsPortAnnotation)) {
    if (value->empty() || *value == "none") {
      metrics_decided = true;
    } else {
      absl::StatusOr<int> resolved = ResolvePort(pod, *value);
      if (resolved.ok()) {
        metrics_port = *resolved;
        metrics_decided = true;
      } else {
        worker.annotation_problems.push_back(Problem(kMetricsPortAnnotation, *value, resolved.status().message(),
                                                     options.metrics_port.empty()
                                                         ? std::string("no scraping")
                                                         : absl::StrCat("metrics port ", options.metrics_port)));
      }
    }
  }
  if (!metrics_decided && !options.metrics_port.empty()) {
    absl::StatusOr<int> resolved = ResolvePort(pod, options.metrics_port);
    if (resolved.ok()) {
      metrics_port = *resolved;
    } else {
      worker.annotation_problems.push_back(absl::StrCat("metrics port \"", options.metrics_port,
                                                        "\" does not resolve (", resolved.status().message(),
                                                        "); no scraping"));
    }
  }
  if (metrics_port.has_value()) {
    std::string path = options.metrics_path;
    if (const std::string* value = Annotation(pod, kMetricsPathAnnotation)) {
      absl::Status valid = CheckMetricsPath(*value);
      if (valid.ok()) {
        path = *value;
      } else {
        worker.annotation_problems.push_back(
            Problem(kMetricsPathAnnotation, *value, valid.message(), absl::StrCat("path ", options.metrics_path)));
      }
    }
    worker.spec.metrics_url = absl::StrCat("http://", host, ":", *metrics_port, path);
  }

  worker.spec.capacity = options.capacity;
  if (const std::string* value = Annotation(pod, kCapacityAnnotation)) {
    double capacity = 0;
    if (!absl::SimpleAtod(*value, &capacity) || !std::isfinite(capacity)) {
      worker.annotation_problems.push_back(
          Problem(kCapacityAnnotation, *value, "not a number", absl::StrCat("capacity ", options.capacity)));
    } else if (capacity < kMinWorkerCapacity || capacity > kMaxWorkerCapacity) {
      worker.annotation_problems.push_back(Problem(
          kCapacityAnnotation, *value, absl::StrCat("not in [", kMinWorkerCapacity, ", ", kMaxWorkerCapacity, "]"),
          absl::StrCat("capacity ", options.capacity)));
    } else {
      worker.spec.capacity = capacity;
    }
  }
  worker.spec.max_inflight = options.max_inflight;
  if (const std::string* value = Annotation(pod, kMaxInflightAnnotation)) {
    int64_t limit = 0;
    if (!absl::SimpleAtoi(*value, &limit)) {
      worker.annotation_problems.push_back(Problem(kMaxInflightAnnotation, *value, "not an integer",
                                                   absl::StrCat("max-inflight ", options.max_inflight)));
    } else if (limit < 0 || limit > kMaxWorkerInflightLimit) {
      worker.annotation_problems.push_back(Problem(kMaxInflightAnnotation, *value,
                                                   absl::StrCat("not in [0, ", kMaxWorkerInflightLimit, "]"),
                                                   absl::StrCat("max-inflight ", options.max_inflight)));
    } else {
      worker.spec.max_inflight = limit;
    }
  }

  if (pod.terminating) {
    worker.state = DiscoveredWorker::State::kTerminating;
  } else if (pod.phase == "Running" && pod.ready) {
    worker.state = DiscoveredWorker::State::kReady;
  } else {
    worker.state = DiscoveredWorker::State::kNotReady;
  }

  absl::Status valid = ValidateWorkerSpec(worker.spec);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("pod ", pod.name, " is not a valid worker: ", valid.message()));
  }
  return worker;
}

}  // namespace eldr::discovery
