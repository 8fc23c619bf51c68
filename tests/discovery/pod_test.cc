#include "eldr/discovery/pod.h"

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace eldr::discovery {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;
using Json = nlohmann::json;

// A pod as kube-apiserver (v1.29) sends it, trimmed of nothing that matters.
constexpr char kRealPod[] = R"({
  "kind": "Pod", "apiVersion": "v1",
  "metadata": {
    "name": "decode-7f9c4-x2x8q", "generateName": "decode-7f9c4-", "namespace": "inference",
    "uid": "5b7a0c3e-2f4e-4d7e-9d53-1f0e6a2b8c11", "resourceVersion": "123456",
    "creationTimestamp": "2024-03-01T10:00:00Z",
    "labels": {"app": "decode", "pod-template-hash": "7f9c4"},
    "annotations": {"eldr.io/capacity": "2", "kubectl.kubernetes.io/restartedAt": "2024-03-01T09:59:00Z"},
    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "decode-7f9c4",
                         "uid": "0d9a", "controller": true, "blockOwnerDeletion": true}],
    "managedFields": [{"manager": "kubelet", "operation": "Update", "fieldsType": "FieldsV1",
                       "fieldsV1": {"f:status": {}}}]
  },
  "spec": {
    "containers": [
      {"name": "engine", "image": "vllm/vllm-openai:v0.4.0",
       "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                 {"name": "metrics", "containerPort": 9090, "protocol": "TCP"},
                 {"containerPort": 5557, "protocol": "TCP"},
                 {"name": "kv-udp", "containerPort": 5600, "protocol": "UDP"}],
       "resources": {"limits": {"nvidia.com/gpu": "8"}}},
      {"name": "sidecar", "image": "envoy", "ports": [{"name": "http", "containerPort": 9999},
                                                      {"name": "admin", "containerPort": 9901}]}
    ],
    "nodeName": "gpu-node-3", "restartPolicy": "Always"
  },
  "status": {
    "phase": "Running",
    "conditions": [
      {"type": "Initialized", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2024-03-01T10:00:00Z"},
      {"type": "Ready", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2024-03-01T10:02:00Z"},
      {"type": "ContainersReady", "status": "True", "lastProbeTime": null},
      {"type": "PodScheduled", "status": "True", "lastProbeTime": null}
    ],
    "hostIP": "172.18.0.2", "hostIPs": [{"ip": "172.18.0.2"}],
    "podIP": "10.244.1.17", "podIPs": [{"ip": "10.244.1.17"}, {"ip": "fd00:10:244:1::11"}],
    "startTime": "2024-03-01T10:00:00Z",
    "containerStatuses": [{"name": "engine", "ready": true, "restartCount": 0, "state": {"running": {}}}],
    "qosClass": "Guaranteed"
  }
})";

PodInfo RunningPod(const std::string& name = "decode-0", const std::string& ip = "10.0.0.5") {
  PodInfo pod;
  pod.name = name;
  pod.namespace_ = "default";
  pod.uid = absl::StrCat("uid-", name);
  pod.resource_version = "1";
  pod.ip = ip;
  pod.phase = "Running";
  pod.ready = true;
  pod.ports = {{"http", 8000}, {"metrics", 9090}};
  return pod;
}

MappingOptions Mapping() {
  MappingOptions options;
  options.port = "http";
  options.metrics_port = "metrics";
  return options;
}

TEST(ParsePodTest, RealPod) {
  auto pod = ParsePod(Json::parse(kRealPod));
  ASSERT_TRUE(pod.ok()) << pod.status();
  EXPECT_EQ(pod->name, "decode-7f9c4-x2x8q");
  EXPECT_EQ(pod->namespace_, "inference");
  EXPECT_EQ(pod->uid, "5b7a0c3e-2f4e-4d7e-9d53-1f0e6a2b8c11");
  EXPECT_EQ(pod->resource_version, "123456");
  EXPECT_EQ(pod->ip, "10.244.1.17");
  EXPECT_EQ(pod->phase, "Running");
  EXPECT_TRUE(pod->ready);
  EXPECT_FALSE(pod->terminating);
  EXPECT_THAT(pod->labels, ElementsAre(Pair("app", "decode"), Pair("pod-template-hash", "7f9c4")));
  EXPECT_EQ(pod->annotations.at("eldr.io/capacity"), "2");
  // Named TCP ports only; the first container declaring a name wins.
  EXPECT_THAT(pod->ports, ElementsAre(Pair("admin", 9901), Pair("http", 8000), Pair("metrics", 9090)));
}

TEST(ParsePodTest, MinimalAndOptionalFields) {
  auto pod = ParsePod(Json::parse(R"({"metadata": {"name": "p"}})"));
  ASSERT_TRUE(pod.ok()) << pod.status();
  EXPECT_EQ(pod->name, "p");
  EXPECT_TRUE(pod->ip.empty());
  EXPECT_TRUE(pod->phase.empty());
  EXPECT_FALSE(pod->ready);
  EXPECT_THAT(pod->ports, IsEmpty());
  // Nulls are absent fields; a PodList item carries no kind.
  pod = ParsePod(Json::parse(
      R"({"metadata": {"name": "p", "labels": null, "deletionTimestamp": "2024-01-01T00:00:00Z"},
          "spec": null, "status": {"podIP": null, "podIPs": [{"ip": "fd00::5"}], "conditions": null}})"));
  ASSERT_TRUE(pod.ok()) << pod.status();
  EXPECT_TRUE(pod->terminating);
  EXPECT_EQ(pod->ip, "fd00::5");
}

TEST(ParsePodTest, ReadyConditionFalseOrUnknown) {
  Json pod = Json::parse(kRealPod);
  pod["status"]["conditions"][1]["status"] = "False";
  EXPECT_FALSE(ParsePod(pod)->ready);
  pod["status"]["conditions"][1]["status"] = "Unknown";
  EXPECT_FALSE(ParsePod(pod)->ready);
  pod["status"]["conditions"] = Json::array();
  EXPECT_FALSE(ParsePod(pod)->ready);
}

TEST(ParsePodTest, WrongTypesAreRefusedNeverThrown) {
  const std::vector<std::string> bad = {
      R"([])",
      R"("pod")",
      R"(42)",
      R"(null)",
      R"({})",
      R"({"kind": "Service", "metadata": {"name": "p"}})",
      R"({"kind": 7, "metadata": {"name": "p"}})",
      R"({"metadata": "p"})",
      R"({"metadata": {"name": ""}})",
      R"({"metadata": {"name": 5}})",
      R"({"metadata": {"name": "p", "uid": 5}})",
      R"({"metadata": {"name": "p", "labels": ["a"]}})",
      R"({"metadata": {"name": "p", "labels": {"a": 1}}})",
      R"({"metadata": {"name": "p", "annotations": {"a": {"b": "c"}}}})",
      R"({"metadata": {"name": "p", "resourceVersion": 12}})",
      R"({"metadata": {"name": "p", "deletionTimestamp": true}})",
      R"({"metadata": {"name": "p"}, "spec": []})",
      R"({"metadata": {"name": "p"}, "spec": {"containers": {}}})",
      R"({"metadata": {"name": "p"}, "spec": {"containers": [5]}})",
      R"({"metadata": {"name": "p"}, "spec": {"containers": [{"ports": {}}]}})",
      R"({"metadata": {"name": "p"}, "spec": {"containers": [{"ports": [7]}]}})",
      R"({"metadata": {"name": "p"}, "spec": {"containers": [{"ports": [{"containerPort": "80"}]}]}})",
      R"({"metadata": {"name": "p"}, "spec": {"containers": [{"ports": [{"containerPort": 80.5}]}]}})",
      R"({"metadata": {"name": "p"}, "spec": {"containers": [{"ports": [{"containerPort": 0}]}]}})",
      R"({"metadata": {"name": "p"}, "spec": {"containers": [{"ports": [{"containerPort": 70000}]}]}})",
      R"({"metadata": {"name": "p"}, "spec": {"containers": [{"ports": [{"containerPort": 80, "name": 1}]}]}})",
      R"({"metadata": {"name": "p"}, "status": "Running"})",
      R"({"metadata": {"name": "p"}, "status": {"phase": 1}})",
      R"({"metadata": {"name": "p"}, "status": {"podIP": ["10.0.0.1"]}})",
      R"({"metadata": {"name": "p"}, "status": {"podIPs": "10.0.0.1"}})",
      R"({"metadata": {"name": "p"}, "status": {"podIPs": [{"ip": 1}]}})",
      R"({"metadata": {"name": "p"}, "status": {"conditions": {}}})",
      R"({"metadata": {"name": "p"}, "status": {"conditions": ["Ready"]}})",
      R"({"metadata": {"name": "p"}, "status": {"conditions": [{"type": "Ready", "status": true}]}})",
  };
  for (const std::string& text : bad) {
    auto pod = ParsePod(Json::parse(text));
    EXPECT_EQ(pod.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

TEST(ParsePodTest, FuzzedMutationsNeverCrash) {
  // Every field of the real pod replaced, in turn, by values of every JSON type.
  const Json original = Json::parse(kRealPod);
  const std::vector<Json> values = {
      nullptr, true, 1, -1, 1.5, "x", Json::array(), Json::object(), Json::array({1, "a"}), Json{{"k", "v"}}};
  int parsed = 0;
  std::function<void(Json&, const std::function<void()>&)> visit = [&](Json& node, const std::function<void()>& check) {
    if (!node.is_object() && !node.is_array()) return;
    for (auto it = node.begin(); it != node.end(); ++it) {
      Json& child = it.value();
      const Json saved = child;
      for (const Json& value : values) {
        child = value;
        check();
      }
      child = saved;
      visit(child, check);
    }
  };
  Json pod = original;
  visit(pod, [&] {
    auto result = ParsePod(pod);
    if (result.ok()) {
      ++parsed;
      (void)WorkerFromPod(*result, Mapping());
    }
  });
  EXPECT_GT(parsed, 0);
  EXPECT_EQ(pod, original);
}

TEST(WorkerFromPodTest, ReadyWorker) {
  auto worker = WorkerFromPod(RunningPod(), Mapping());
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->spec.id, "decode-0");
  EXPECT_EQ(worker->spec.address, "10.0.0.5:8000");
  EXPECT_EQ(worker->spec.metrics_url, "http://10.0.0.5:9090/metrics");
  EXPECT_EQ(worker->spec.capacity, 1.0);
  EXPECT_EQ(worker->spec.max_inflight, 0);
  EXPECT_EQ(worker->state, DiscoveredWorker::State::kReady);
  EXPECT_EQ(worker->uid, "uid-decode-0");
  EXPECT_THAT(worker->annotation_problems, IsEmpty());
}

TEST(WorkerFromPodTest, RealPodWithNumericPorts) {
  MappingOptions options;
  options.port = "5557";  // an unnamed port, by number
  options.metrics_port = "9090";
  options.metrics_path = "/stats";
  options.capacity = 3;
  options.max_inflight = 64;
  auto worker = WorkerFromPod(*ParsePod(Json::parse(kRealPod)), options);
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->spec.address, "10.244.1.17:5557");
  EXPECT_EQ(worker->spec.metrics_url, "http://10.244.1.17:9090/stats");
  EXPECT_EQ(worker->spec.capacity, 2.0);  // the annotation wins
  EXPECT_EQ(worker->spec.max_inflight, 64);
}

TEST(WorkerFromPodTest, Ipv6IsBracketed) {
  auto worker = WorkerFromPod(RunningPod("p", "fd00:10:244::7"), Mapping());
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->spec.address, "[fd00:10:244::7]:8000");
  EXPECT_EQ(worker->spec.metrics_url, "http://[fd00:10:244::7]:9090/metrics");
}

TEST(WorkerFromPodTest, States) {
  PodInfo pod = RunningPod();
  pod.ready = false;
  EXPECT_EQ(WorkerFromPod(pod, Mapping())->state, DiscoveredWorker::State::kNotReady);
  pod.ready = true;
  pod.phase = "Unknown";  // the node stopped reporting
  EXPECT_EQ(WorkerFromPod(pod, Mapping())->state, DiscoveredWorker::State::kNotReady);
  pod.phase = "Running";
  pod.terminating = true;
  EXPECT_EQ(WorkerFromPod(pod, Mapping())->state, DiscoveredWorker::State::kTerminating);
  EXPECT_EQ(WorkerStateLabel(DiscoveredWorker::State::kTerminating), "terminating");
  EXPECT_EQ(WorkerStateLabel(DiscoveredWorker::State::kNotReady), "not_ready");
}

TEST(WorkerFromPodTest, NotAWorker) {
  for (const char* phase : {"", "Pending", "Succeeded", "Failed"}) {
    PodInfo pod = RunningPod();
    pod.phase = phase;
    auto worker = WorkerFromPod(pod, Mapping());
    EXPECT_EQ(worker.status().code(), absl::StatusCode::kNotFound) << phase;
    EXPECT_THAT(worker.status().message(), HasSubstr("phase")) << phase;
  }
  PodInfo no_ip = RunningPod();
  no_ip.ip.clear();
  EXPECT_THAT(WorkerFromPod(no_ip, Mapping()).status().message(), HasSubstr("no IP"));
  PodInfo no_port = RunningPod();
  no_port.ports.erase("http");
  auto worker = WorkerFromPod(no_port, Mapping());
  EXPECT_EQ(worker.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(worker.status().message(), HasSubstr("no TCP container port named \"http\""));
  PodInfo bad_ip = RunningPod("p", "10.0.0.1 ; rm");
  EXPECT_EQ(WorkerFromPod(bad_ip, Mapping()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(WorkerFromPodTest, AnnotationsOverride) {
  PodInfo pod = RunningPod();
  pod.ports["grpc"] = 50051;
  pod.annotations = {{kPortAnnotation, "grpc"},
                     {kMetricsPortAnnotation, "9100"},
                     {kMetricsPathAnnotation, "/engine/metrics"},
                     {kCapacityAnnotation, "0.5"},
                     {kMaxInflightAnnotation, "128"}};
  auto worker = WorkerFromPod(pod, Mapping());
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->spec.address, "10.0.0.5:50051");
  EXPECT_EQ(worker->spec.metrics_url, "http://10.0.0.5:9100/engine/metrics");
  EXPECT_EQ(worker->spec.capacity, 0.5);
  EXPECT_EQ(worker->spec.max_inflight, 128);
  EXPECT_THAT(worker->annotation_problems, IsEmpty());
}

TEST(WorkerFromPodTest, MetricsCanBeTurnedOffOrOn) {
  PodInfo pod = RunningPod();
  pod.annotations[kMetricsPortAnnotation] = "none";
  EXPECT_EQ(WorkerFromPod(pod, Mapping())->spec.metrics_url, "");
  pod.annotations[kMetricsPortAnnotation] = "";
  EXPECT_EQ(WorkerFromPod(pod, Mapping())->spec.metrics_url, "");
  MappingOptions no_scraping = Mapping();
  no_scraping.metrics_port.clear();
  pod.annotations.clear();
  EXPECT_EQ(WorkerFromPod(pod, no_scraping)->spec.metrics_url, "");
  pod.annotations[kMetricsPortAnnotation] = "metrics";
  EXPECT_EQ(WorkerFromPod(pod, no_scraping)->spec.metrics_url, "http://10.0.0.5:9090/metrics");
}

TEST(WorkerFromPodTest, BadAnnotationsFallBackWithProblems) {
  PodInfo pod = RunningPod();
  pod.annotations = {{kPortAnnotation, "no-such-port"},
                     {kMetricsPortAnnotation, "99999"},
                     {kMetricsPathAnnotation, "metrics"},
                     {kCapacityAnnotation, "lots"},
                     {kMaxInflightAnnotation, "-3"}};
  auto worker = WorkerFromPod(pod, Mapping());
  ASSERT_TRUE(worker.ok()) << worker.status();  // never dropped for an annotation
  EXPECT_EQ(worker->spec.address, "10.0.0.5:8000");
  EXPECT_EQ(worker->spec.metrics_url, "http://10.0.0.5:9090/metrics");
  EXPECT_EQ(worker->spec.capacity, 1.0);
  EXPECT_EQ(worker->spec.max_inflight, 0);
  ASSERT_EQ(worker->annotation_problems.size(), 5u);
  EXPECT_THAT(worker->annotation_problems[0], HasSubstr("eldr.io/port=\"no-such-port\""));
  EXPECT_THAT(worker->annotation_problems[1], HasSubstr("not in 1-65535"));
  EXPECT_THAT(worker->annotation_problems[2], HasSubstr("must start with '/'"));
  EXPECT_THAT(worker->annotation_problems[3], HasSubstr("not a number"));
  EXPECT_THAT(worker->annotation_problems[4], HasSubstr("not in [0,"));

  for (const char* capacity : {"0", "1e9", "nan", "inf", "-1", ""}) {
    pod.annotations = {{kCapacityAnnotation, capacity}};
    auto result = WorkerFromPod(pod, Mapping());
    ASSERT_TRUE(result.ok());
    EXPECT_EQ(result->spec.capacity, 1.0) << capacity;
    EXPECT_EQ(result->annotation_problems.size(), 1u) << capacity;
  }
  for (const char* limit : {"1.5", "99999999999999999999", "2000000000", "ten"}) {
    pod.annotations = {{kMaxInflightAnnotation, limit}};
    auto result = WorkerFromPod(pod, Mapping());
    EXPECT_EQ(result->spec.max_inflight, 0) << limit;
    EXPECT_EQ(result->annotation_problems.size(), 1u) << limit;
  }
  pod.annotations = {{kMetricsPathAnnotation, "/a b"}};
  EXPECT_EQ(WorkerFromPod(pod, Mapping())->annotation_problems.size(), 1u);
  pod.annotations = {{kPortAnnotation, std::string("ht\x01tp")}};
  EXPECT_EQ(WorkerFromPod(pod, Mapping())->annotation_problems.size(), 1u);
}

TEST(WorkerFromPodTest, UnresolvableDefaultMetricsPortIsAProblem) {
  PodInfo pod = RunningPod();
  pod.ports.erase("metrics");
  auto worker = WorkerFromPod(pod, Mapping());
  ASSERT_TRUE(worker.ok());
  EXPECT_EQ(worker->spec.metrics_url, "");
  ASSERT_EQ(worker->annotation_problems.size(), 1u);
  EXPECT_THAT(worker->annotation_problems[0], HasSubstr("no scraping"));
}

TEST(ValidateMappingOptionsTest, Rules) {
  EXPECT_TRUE(ValidateMappingOptions(Mapping()).ok());
  MappingOptions options = Mapping();
  options.port.clear();
  EXPECT_FALSE(ValidateMappingOptions(options).ok());
  options.port = "0";
  EXPECT_FALSE(ValidateMappingOptions(options).ok());
  options.port = "a-very-long-port-name";
  EXPECT_FALSE(ValidateMappingOptions(options).ok());
  options.port = "8000";
  options.metrics_port = "no_underscores";
  EXPECT_FALSE(ValidateMappingOptions(options).ok());
  options.metrics_port.clear();
  EXPECT_TRUE(ValidateMappingOptions(options).ok());
  options.metrics_path = "metrics";
  EXPECT_FALSE(ValidateMappingOptions(options).ok());
  options.metrics_path = "/metrics";
  options.capacity = 0;
  EXPECT_FALSE(ValidateMappingOptions(options).ok());
  options.capacity = 1;
  options.max_inflight = -1;
  EXPECT_FALSE(ValidateMappingOptions(options).ok());
}

}  // namespace
}  // namespace eldr::discovery
