"""Runs the built eldr-router exactly as the rendered Kubernetes containers would run it (command,
args, environment and mounted files; on loopback ports in a temporary folder) and checks that it
passes its startup, readiness and liveness probes, that its metrics page carries every metric the
dashboard and the alert rules use, that an edited centroid ConfigMap is picked up without a
restart, and that SIGTERM drains and exits in time.

The overlays find the decode workers from their pods (--discovery=kubernetes). A pod gets the API
server through its mounted service account; here the daemon gets one more argument,
--kubeconfig=<file>, for a stand-in API server (tests/discovery/fake_kube_apiserver.py) that holds
the example decode pool (deploy/examples/decode-statefulset.yaml) in the overlay's namespace. The
pool then changes the way it does in a cluster: pods turn unready, terminate, are deleted and
created.

The overlays whose routers share a Redis (sidecar, standalone-cluster) run the overlay's own Redis
too: its StatefulSet's container (the shell command, the Secret file, the exec probes) on a
loopback port, which the router's --cluster_redis (the Service's eldr-redis:6379, from the
overlay's ConfigMap) is mapped to. Each router replica gets its pod name from the downward API
(POD_NAME), as in a pod."""

import json
import os
import re
import signal
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import uuid

import numpy as np

import deploy_testlib as lib

DATA_DIR = os.environ.get("ELDR_DATA_DIR") or os.path.join(lib.SOURCE_DIR, "data")


def trace_counts(task, count, layers=26, experts=64):
    """Expert counts of the first half (the "prompt") of `count` real sequences of a bundled trace,
    as int16 little-endian bytes, row-major [layers][experts]."""
    topk = np.load(os.path.join(DATA_DIR, "esft-routing", f"{task}_topk.npy"))
    offsets = np.load(os.path.join(DATA_DIR, "esft-routing", f"{task}_offsets.npy"))
    out = []
    for s in range(min(count, len(offsets) - 1)):
        begin, end = int(offsets[s]), int(offsets[s + 1])
        prompt = topk[begin:begin + max(1, (end - begin) // 2)]
        counts = np.zeros((layers, experts), dtype=np.int64)
        for layer in range(layers):
            np.add.at(counts[layer], prompt[:, layer, :].ravel(), 1)
        out.append(counts.astype("<i2").tobytes())
    return out


class RouterClient:
    """Calls of the eldr.v1 API with Python stubs generated from proto/ at test time."""

    def __init__(self, address, credentials=None):
        import grpc
        self.pb = lib.protobuf_modules()
        self.grpc = grpc
        self.channel = (grpc.secure_channel(address, credentials) if credentials
                        else grpc.insecure_channel(address))

    def _unary(self, service, method, response):
        return self.channel.unary_unary(f"/eldr.v1.{service}/{method}",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=response.FromString)

    def route(self, int16_bytes=None, layers=26, experts=64, timeout=5):
        request = self.pb.RouteRequest(request_id="deploy-test", prompt_tokens=64)
        if int16_bytes is not None:
            request.counts.layers = layers
            request.counts.experts = experts
            request.counts.int16_le = int16_bytes
        return self._unary("DecodeRouter", "Route", self.pb.RouteResponse)(request, timeout=timeout)

    def complete(self, lease_id, timeout=5):
        return self._unary("DecodeRouter", "Complete", self.pb.CompleteResponse)(
            self.pb.CompleteRequest(lease_id=lease_id, output_tokens=16), timeout=timeout)

    def report_load(self, reports, timeout=5):
        call = self.channel.stream_unary("/eldr.v1.DecodeRouter/ReportLoad",
                                         request_serializer=lambda m: m.SerializeToString(),
                                         response_deserializer=self.pb.ReportLoadResponse.FromString)
        return call(iter([self.pb.LoadReport(**r) for r in reports]), timeout=timeout)

    def drain_worker(self, worker_id, timeout=5):
        return self._unary("RouterAdmin", "DrainWorker", self.pb.DrainWorkerResponse)(
            self.pb.DrainWorkerRequest(worker_id=worker_id), timeout=timeout)

    def remove_worker(self, worker_id, timeout=5):
        return self._unary("RouterAdmin", "RemoveWorker", self.pb.RemoveWorkerResponse)(
            self.pb.RemoveWorkerRequest(worker_id=worker_id), timeout=timeout)

    def upsert_worker(self, worker, timeout=5):
        return self._unary("RouterAdmin", "UpsertWorker", self.pb.UpsertWorkerResponse)(
            self.pb.UpsertWorkerRequest(worker=self.pb.Worker(**worker)), timeout=timeout)

    def list_workers(self, metadata=None, timeout=5):
        return self._unary("RouterAdmin", "ListWorkers", self.pb.ListWorkersResponse)(
            self.pb.ListWorkersRequest(), metadata=metadata, timeout=timeout)

    def close(self):
        self.channel.close()


def scrape(container, path="/metrics"):
    status, text = lib.http_get(f"http://127.0.0.1:{container.listen_port('metrics_listen')}{path}")
    assert status == 200, status
    return lib.parse_exposition(text)


def gauge(samples, name):
    values = [value for _, value in samples.get(name, [])]
    assert len(values) == 1, f"{name}: {samples.get(name)}"
    return values[0]


def discovery_gauge(samples, name, **labels):
    """The one sample of `name` with role="decode" and `labels`."""
    want = dict(labels, role="decode")
    values = [value for have, value in samples.get(name, [])
              if all(have.get(k) == v for k, v in want.items())]
    assert len(values) == 1, f"{name}{want}: {samples.get(name)}"
    return values[0]


def pool(admin):
    """{worker id: (address, state)} of ListWorkers."""
    return {w.worker.id: (w.worker.address, w.state) for w in admin.list_workers().workers}


# The overlays' Redis (deploy/components/redis) and the Secret that holds its password.
REDIS_NAME = "eldr-redis"
REDIS_SECRET = "eldr-redis"


class LiveDaemonTestBase(unittest.TestCase):
    overlay = "standalone"
    secrets = None
    redis_password = b"deploy-test-redis-password"

    @classmethod
    def setUpClass(cls):
        lib.require_binary("eldr-router")
        lib.require_binary("eldr-health-probe")
        cls.objects = lib.render_overlay(cls.overlay)
        cls.workload, cls.spec, cls.container_spec = lib.router_workload(cls.objects)
        cls.namespace = cls.workload["metadata"]["namespace"]
        cls.flags = lib.flag_values(cls.container_spec["args"])
        # Routers that share a Redis (components/cluster).
        cls.clustered = "cluster_redis" in cls.flags

    def setUp(self):
        self.cluster = None
        self.redis = None

    def pod_secrets(self):
        """The Secrets the overlay's pods mount: the class's, and the Redis password."""
        secrets = dict(self.secrets or {})
        if self.clustered:
            secrets[REDIS_SECRET] = {"password": self.redis_password}
        return secrets

    def start_redis(self):
        """The overlay's Redis (the StatefulSet's one container) on a loopback port, once it passes
        its readiness and liveness probes (redis-cli PING with the Secret's password)."""
        statefulset = lib.find_one(self.objects, "StatefulSet", REDIS_NAME)
        spec = lib.pod_spec(statefulset)
        (container,) = spec["containers"]
        self.redis = lib.start_with_retries(
            lambda: lib.ShellPodContainer(self.objects, spec, container, secrets=self.pod_secrets(),
                                          local_args=["--bind", "127.0.0.1"],
                                          pod_name=f"{REDIS_NAME}-0", namespace=self.namespace))
        self.addCleanup(self.redis.cleanup)
        self.redis.pass_probe("readinessProbe")
        self.redis.pass_probe("livenessProbe")
        return self.redis

    def redis_cli(self, *args):
        """redis-cli against the overlay's Redis, with its password; the reply's lines."""
        result = subprocess.run(["redis-cli", "-p", str(self.redis.port("redis")), *args],
                                capture_output=True, text=True, timeout=10,
                                env={"PATH": "/usr/bin:/bin",
                                     "REDISCLI_AUTH": self.redis_password.decode()})
        self.assertEqual(result.returncode, 0, result.stderr)
        return result.stdout.splitlines()

    def redis_addresses(self):
        """The router's --cluster_redis as the pod dials it (the overlay's Redis Service), mapped to
        the local Redis."""
        if not self.clustered:
            return {}
        if self.redis is None:
            self.start_redis()
        address = lib.resolved_flags(self.objects, self.container_spec)["cluster_redis"]
        service = lib.find_one(self.objects, "Service", REDIS_NAME)
        host, port = lib.split_host_port(address)
        self.assertEqual((host, port), (service["metadata"]["name"], service["spec"]["ports"][0]["port"]))
        return {address: f"127.0.0.1:{self.redis.port('redis')}"}

    def pod_name(self):
        """A name as the Deployment's ReplicaSet gives its pods."""
        return f"{self.workload['metadata']['name']}-7c9d8f6b5-{uuid.uuid4().hex[:5]}"

    def start(self, pod_name=None):
        """The router container of the overlay, discovering the example decode pool (Running and
        Ready, in the overlay's namespace) from a stand-in API server. Two pods it must not take
        are there too: one carrying the router pod's own labels in its namespace, and a decode pod
        of another namespace (the Role is namespaced; so is the watch). With components/cluster,
        the overlay's Redis runs too, and every call starts one more replica (another pod) of the
        same pool."""
        self.assertEqual(self.flags.get("discovery"), "kubernetes")
        if self.cluster is None:
            self.start_pool()
        addresses = self.redis_addresses()
        pod_name = pod_name or self.pod_name()
        container = lib.start_with_retries(
            lambda: lib.PodContainer(self.objects, self.spec, self.container_spec,
                                     secrets=self.pod_secrets(), pod_name=pod_name,
                                     namespace=self.namespace, addresses=addresses,
                                     extra_args=[f"--kubeconfig={self.cluster.kubeconfig}"]))
        self.addCleanup(container.cleanup)
        return container

    def start_pool(self):
        """The stand-in API server with the example decode pool."""
        self.fake_workers = lib.FakeVllmMetrics([], running=5, waiting=2, kv_usage=0.25)
        self.addCleanup(self.fake_workers.close)
        port_names = {self.flags.get("worker_port", "http"),
                      self.flags.get("worker_metrics_port") or self.flags.get("worker_port", "http")}
        self.cluster = lib.DecodePods(self.namespace, self.fake_workers, port_names=port_names)
        self.addCleanup(self.cluster.close)
        self.workers = self.cluster.create_pool()
        self.cluster.control.create_pod(
            f"{self.workload['metadata']['name']}-router", namespace=self.namespace, ip="127.0.0.1",
            labels=dict(self.workload["spec"]["template"]["metadata"]["labels"]), ready=True)
        fields = self.cluster.pod_fields("decode-elsewhere")
        self.cluster.control.create_pod("decode-elsewhere", namespace="default", **fields)

    def pass_all_probes(self, container):
        took = container.pass_probe("startupProbe")
        container.pass_probe("readinessProbe")
        container.pass_probe("livenessProbe")
        return took


class StandaloneLiveTest(LiveDaemonTestBase):
    overlay = "standalone"

    def test_passes_probes_and_serves_the_service_ports(self):
        container = self.start()
        # The overlay's command and arguments as written, plus only --kubeconfig (the stand-in for
        # the service-account mount).
        written = list(self.container_spec["command"]) + list(self.container_spec["args"])
        line = container.command_line()
        self.assertEqual(line[len(written):], [f"--kubeconfig={self.cluster.kubeconfig}"])
        self.assertEqual(len(line), len(written) + 1)
        took = self.pass_all_probes(container)
        self.assertLess(took, 30, "startup took too long for the bundled artifact")
        # The Service's and the ServiceMonitor's named ports reach the daemon.
        service = lib.find_one(self.objects, "Service", "eldr-router")
        ports = {p["name"]: p["containerPort"] for p in self.container_spec["ports"]}
        grpc_port = ports[next(p["targetPort"] for p in service["spec"]["ports"] if p["name"] == "grpc")]
        self.assertEqual(lib.grpc_health(f"127.0.0.1:{container.ports[grpc_port]}"), lib.SERVING)
        monitor = lib.find_one(self.objects, "ServiceMonitor", "eldr-router")
        samples = scrape(container, monitor["spec"]["endpoints"][0]["path"])
        self.assertGreaterEqual(gauge(samples, "eldr_centroid_generation"), 1)
        self.assertEqual(gauge(samples, "eldr_workers"), len(self.workers))
        self.assertEqual(discovery_gauge(samples, "eldr_discovery_synced"), 1)
        self.assertEqual(discovery_gauge(samples, "eldr_discovery_workers", state="ready"),
                         len(self.workers))
        # The admin service answers on the pod's loopback; the pool is the example's decode pods
        # (id = pod name, address = pod IP:the port named --worker_port). Neither the router's own
        # pod nor the decode pod of another namespace is in it.
        admin = RouterClient(f"127.0.0.1:{container.listen_port('admin_listen')}")
        self.addCleanup(admin.close)
        self.assertEqual(pool(admin), {name: (self.cluster.address(), "active") for name in self.workers})
        # All the daemon asked the API server is what the Role grants: list and watch pods in its
        # own namespace, by the label selector (no get, no other resource or namespace).
        stats = self.cluster.control.stats()
        self.assertEqual(set(stats["requests_by_path"]), {f"/api/v1/namespaces/{self.namespace}/pods"})
        self.assertEqual(stats["get_requests"], 0)
        self.assertEqual(stats["unauthorized"], 0)
        self.assertGreaterEqual(stats["list_requests"], 1)
        self.assertGreaterEqual(stats["watch_requests"], 1)
        for query in stats["watch_queries"]:
            self.assertEqual(urllib.parse.parse_qs(query).get("labelSelector"),
                             [self.flags["decode_selector"]], query)

    def test_sigterm_drains_within_the_grace_period(self):
        container = self.start()
        self.pass_all_probes(container)
        client = RouterClient(f"127.0.0.1:{container.listen_port('listen')}")
        self.addCleanup(client.close)
        lease = client.route(trace_counts("law", 1)[0]).lease_id
        self.assertGreater(lease, 0)
        grace = self.spec["terminationGracePeriodSeconds"]
        prestop = float(self.container_spec["lifecycle"]["preStop"]["exec"]["command"][1])
        start = time.monotonic()
        container.process.send_signal(signal.SIGTERM)
        code = container.process.wait(timeout=grace - prestop)
        self.assertEqual(code, 0, container.log())
        self.assertLess(time.monotonic() - start, grace - prestop)

    def test_admin_pool_changes_are_refused(self):
        # The pool is the pods': RouterAdmin's pool mutations answer FAILED_PRECONDITION and change
        # nothing; ListWorkers still answers.
        import grpc
        container = self.start()
        self.pass_all_probes(container)
        admin = RouterClient(f"127.0.0.1:{container.listen_port('admin_listen')}")
        self.addCleanup(admin.close)
        before = pool(admin)
        calls = {
            "UpsertWorker": lambda: admin.upsert_worker(
                {"id": "decode-9", "address": "127.0.0.1:9", "capacity": 1}),
            "DrainWorker": lambda: admin.drain_worker(self.workers[0]),
            "RemoveWorker": lambda: admin.remove_worker(self.workers[0]),
        }
        for method, call in calls.items():
            with self.subTest(method=method):
                with self.assertRaises(grpc.RpcError) as refused:
                    call()
                self.assertEqual(refused.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
                self.assertIn("discovered from Kubernetes", refused.exception.details())
        self.assertEqual(pool(admin), before)

    def test_pod_changes_drive_the_pool_and_readiness(self):
        container = self.start()
        self.pass_all_probes(container)
        admin = RouterClient(f"127.0.0.1:{container.listen_port('admin_listen')}")
        self.addCleanup(admin.close)
        readiness = self.container_spec["readinessProbe"]
        liveness = self.container_spec["livenessProbe"]
        first, second, third, fourth = self.workers

        def pool_is(expected, what):
            lib.wait_until(lambda: pool(admin) == expected or pool(admin), timeout=10, what=what)

        address = self.cluster.address()
        expected = {name: (address, "active") for name in self.workers}
        # Not ready: drained (no new routes, its leases finish); the router stays ready.
        self.cluster.set_ready(first, False)
        expected[first] = (address, "draining")
        pool_is(expected, f"{first} drained when not ready")
        # Terminating: drained too.
        self.cluster.terminate(second)
        expected[second] = (address, "draining")
        pool_is(expected, f"{second} drained when terminating")
        # Deleted: removed.
        self.cluster.delete(third)
        del expected[third]
        pool_is(expected, f"{third} removed when deleted")
        self.assertIs(container.run_probe(readiness), True, "one active worker is left")
        # The last one turns unready: no worker takes routes, readiness fails, liveness does not.
        self.cluster.set_ready(fourth, False)
        expected[fourth] = (address, "draining")
        pool_is(expected, "every worker drained")
        lib.wait_until(lambda: container.run_probe(readiness) is not True, timeout=5,
                       what="readiness to fail with every worker drained")
        self.assertIs(container.run_probe(liveness), True,
                      "a drained router must not be restarted by its liveness probe")
        # A new ready pod joins (after --discovery_settle) and readiness returns; a pod ready
        # again is active again.
        joined = f"{self.cluster.prefix}-{len(self.workers)}"
        self.cluster.create(joined)
        expected[joined] = (address, "active")
        pool_is(expected, f"{joined} added when created ready")
        container.pass_probe("readinessProbe")
        self.cluster.set_ready(first, True)
        expected[first] = (address, "active")
        pool_is(expected, f"{first} active again when ready")
        # A pod relabelled out of the selector leaves the pool like a deleted one.
        key = lib.parse_label_selector(self.flags["decode_selector"])[0][0]
        self.cluster.control.patch_pod(joined, namespace=self.namespace, labels={key: None})
        del expected[joined]
        pool_is(expected, f"{joined} removed when it no longer matches the selector")
        changes = {labels["action"]: v for labels, v in scrape(container)["eldr_discovery_pool_changes_total"]
                   if labels.get("role") == "decode"}
        self.assertEqual(changes, {"upsert": len(self.workers) + 2, "drain": 3, "remove": 2})

    def test_metrics_cover_dashboard_and_alerts(self):
        container = self.start()
        self.pass_all_probes(container)
        client = RouterClient(f"127.0.0.1:{container.listen_port('listen')}")
        self.addCleanup(client.close)
        workers = self.workers
        # Real signatures (routes with locality), a request without signature (fallback), bad
        # input (rejection), completions, and a load report per worker.
        leases = []
        for task in ("intent", "law", "summary", "translation"):
            for counts in trace_counts(task, 5):
                response = client.route(counts)
                self.assertIn(response.worker_id, workers)
                leases.append(response.lease_id)
        self.assertTrue(client.route(None).fallback_reason)
        import grpc
        with self.assertRaises(grpc.RpcError) as bad:
            client.route(b"\x01\x00" * 10, layers=2, experts=5)
        self.assertEqual(bad.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        for lease in leases[::2]:
            client.complete(lease)
        result = client.report_load([{"worker_id": w, "running": 3, "waiting": 1, "kv_usage": 0.5}
                                     for w in workers])
        self.assertEqual(result.accepted, len(workers))

        samples = scrape(container)
        used = {}
        for title, expr in lib.dashboard_exprs(lib.load_dashboard()):
            for name in lib.metric_names(expr):
                used.setdefault(name, f"dashboard panel '{title}'")
        for alert, expr in lib.rule_exprs(lib.load_rules()):
            for name in lib.metric_names(expr):
                used.setdefault(name, f"alert {alert}")
        # The eldr_cluster_* series exist on routers run with --cluster_redis only
        # (StandaloneClusterLiveTest checks them).
        missing = {name: where for name, where in used.items()
                   if name not in samples and name not in lib.PROMETHEUS_SYNTHETIC
                   and not name.startswith("eldr_cluster_")}
        self.assertEqual(missing, {}, "metrics used by the monitoring files but not scraped")
        # Literal label values the alerts and panels select on exist too.
        for alert, expr in list(lib.rule_exprs(lib.load_rules())) + [
                (t, e) for t, e in lib.dashboard_exprs(lib.load_dashboard())]:
            for metric, matchers in re.findall(r"([a-z_]+)\{([^}]*)\}", expr):
                if metric.startswith("eldr_cluster_"):
                    continue
                for label, op, value in re.findall(r'(\w+)\s*(=~|=)\s*"([^"$]*)"', matchers):
                    if label in ("namespace", "job", "pod") or not value:
                        continue
                    seen = {labels.get(label) for labels, _ in samples.get(metric, [])}
                    for alternative in value.split("|") if op == "=~" else [value]:
                        with self.subTest(where=alert, metric=metric, label=label, value=alternative):
                            self.assertIn(alternative, seen)
        # Per-worker series carry what was driven: the leases still open, and the load scraped
        # from the workers' (fake vLLM) pages, which replaces the pushed snapshots within a scrape
        # interval.
        inflight = {labels["worker"]: v for labels, v in samples["eldr_worker_inflight"]}
        self.assertEqual(sum(inflight.values()), len(leases) - len(leases[::2]) + 1)

        def scraped_load():
            reported = {labels["worker"]: v for labels, v in scrape(container)["eldr_worker_reported_load"]}
            return True if reported == {w: 7.0 for w in workers} else reported
        lib.wait_until(scraped_load, timeout=10, what="the scraped vLLM load (5 running + 2 waiting)")

        # The dashboard's Discovery row: each of its metrics is exported with role="decode" and
        # every value of its closed label sets, from the start (a rate of a series that appears
        # only on its first error would hide that error).
        panels = lib.load_dashboard()["panels"]
        (row,) = [i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Discovery"]
        discovery_panels = list(panels[row].get("panels", []))   # a collapsed row keeps its panels
        for panel in panels[row + 1:]:
            if panel["type"] == "row":
                break
            discovery_panels.append(panel)
        row_metrics = {name for panel in discovery_panels for target in panel.get("targets", [])
                       for name in lib.metric_names(target["expr"])}
        self.assertTrue({n for n in row_metrics if n.startswith("eldr_discovery_")},
                        "the Discovery row shows no eldr_discovery_* metric")
        label_sets = {
            "eldr_discovery_workers": ("state", {"ready", "not_ready", "terminating"}),
            "eldr_discovery_watch_restarts_total": ("reason", {"closed", "gone", "error", "silence", "parse"}),
            "eldr_discovery_errors_total": ("kind", {"unreachable", "http", "auth", "parse", "annotation", "sink"}),
            "eldr_discovery_pool_changes_total": ("action", {"upsert", "drain", "remove"}),
        }
        samples = scrape(container)
        for name in sorted(row_metrics | set(label_sets)):
            with self.subTest(metric=name):
                self.assertIn(name, samples, "shown on the Discovery row but not scraped")
                if not name.startswith("eldr_discovery_"):
                    continue
                series = [labels for labels, _ in samples[name]]
                self.assertTrue(all(labels.get("role") == "decode" for labels in series), series)
                if name in label_sets:
                    label, values = label_sets[name]
                    self.assertEqual({labels[label] for labels in series}, values)
        # And they say what happened: the four ready pods added, nothing failed, in sync.
        self.assertEqual(discovery_gauge(samples, "eldr_discovery_workers", state="ready"), len(workers))
        self.assertEqual(discovery_gauge(samples, "eldr_discovery_workers", state="not_ready"), 0)
        self.assertEqual(discovery_gauge(samples, "eldr_discovery_pool_changes_total", action="upsert"),
                         len(workers))
        self.assertEqual(sum(v for _, v in samples["eldr_discovery_errors_total"]), 0,
                         samples["eldr_discovery_errors_total"])
        self.assertEqual(discovery_gauge(samples, "eldr_discovery_synced"), 1)
        self.assertLess(discovery_gauge(samples, "eldr_discovery_last_sync_age_seconds"), 10)

    def test_edited_config_map_reloads_centroids(self):
        container = self.start()
        self.pass_all_probes(container)
        centroids = lib.flag_values(self.container_spec["args"])["centroids"]
        folder = container.local_path(os.path.dirname(centroids))
        key = os.path.basename(centroids)
        with open(os.path.join(folder, key)) as f:
            artifact = json.load(f)
        before = gauge(scrape(container), "eldr_centroid_generation")

        # The kubelet's update of an edited ConfigMap: a new data folder swapped in atomically.
        edited = dict(artifact, seed=artifact.get("seed", 0) + 1)
        lib.update_projected_volume(folder, {key: json.dumps(edited).encode()})
        def generation_moved():
            generation = gauge(scrape(container), "eldr_centroid_generation")
            return True if generation > before else f"generation {generation}"
        lib.wait_until(generation_moved, timeout=15, what="the edited artifact to be loaded")
        after = gauge(scrape(container), "eldr_centroid_generation")
        self.assertGreater(after, before)

        # A broken edit is refused; the loaded centroids stay in service and health stays SERVING.
        errors_before = sum(v for labels, v in scrape(container)["eldr_centroid_reloads_total"]
                            if labels["outcome"] == "error")
        broken = dict(artifact, centroids=artifact["centroids"][:-1])
        lib.update_projected_volume(folder, {key: json.dumps(broken).encode()})

        def refused():
            samples = scrape(container)
            errors = sum(v for labels, v in samples["eldr_centroid_reloads_total"]
                         if labels["outcome"] == "error")
            return True if errors > errors_before else f"{errors} reload errors"
        lib.wait_until(refused, timeout=15, what="the broken artifact to be refused")
        self.assertEqual(gauge(scrape(container), "eldr_centroid_generation"), after)
        self.assertIs(container.run_probe(self.container_spec["readinessProbe"]), True)


class SidecarLiveTest(LiveDaemonTestBase):
    overlay = "sidecar"

    def test_passes_exec_probes_and_serves_the_engine(self):
        container = self.start()
        self.pass_all_probes(container)
        engine = self.spec["containers"][0]
        target = {e["name"]: e["value"] for e in engine["env"]}["ELDR_ROUTER_TARGET"]
        # What the engine dials, after the same port mapping as the router's flags.
        address = container.rewrite(target.replace("localhost", "127.0.0.1"))
        client = RouterClient(address)
        self.addCleanup(client.close)
        response = client.route(trace_counts("translation", 1)[0])
        self.assertTrue(response.worker_id)
        self.assertEqual(response.fallback_reason, "")
        # The PodMonitor's port serves /metrics, and they follow the lease.
        def inflight():
            return {labels["worker"]: v for labels, v in scrape(container)["eldr_worker_inflight"]}
        self.assertEqual(inflight()[response.worker_id], 1)
        client.complete(response.lease_id)
        self.assertEqual(inflight()[response.worker_id], 0)


    def test_health_probe_exit_codes(self):
        container = self.start()
        self.pass_all_probes(container)
        probe = lib.require_binary("eldr-health-probe")
        address = f"127.0.0.1:{container.listen_port('listen')}"

        def exit_code(*flags):
            return subprocess.run([probe, *flags], capture_output=True, text=True, timeout=10).returncode
        self.assertEqual(exit_code(f"--addr={address}"), 0)
        self.assertEqual(exit_code(f"--addr={address}", "--service=liveness"), 0)
        self.assertEqual(exit_code(f"--addr={address}", "--service=no.such.Service"), 3)
        self.assertEqual(exit_code(f"--addr=127.0.0.1:{lib.free_port()}", "--timeout=500ms"), 2)
        self.assertEqual(exit_code(f"--addr={address}", "--tls_cert=/nonexistent"), 1)
        # Every decode pod turns unready: all drained.
        for worker in self.workers:
            self.cluster.set_ready(worker, False)
        lib.wait_until(lambda: exit_code(f"--addr={address}") == 4 or "still serving", timeout=5,
                       what="NOT_SERVING (exit 4) with every worker drained")
        self.assertEqual(exit_code(f"--addr={address}", "--service=liveness"), 0)


def cluster_view(container):
    """What a replica says of its cluster (the eldr_cluster_* gauges of its metrics page)."""
    samples = scrape(container)

    def value(name, **labels):
        values = [v for have, v in samples.get(name, [])
                  if all(have.get(k) == want for k, want in labels.items())]
        assert len(values) == 1, f"{name}{labels}: {samples.get(name)}"
        return values[0]
    return {"leader": value("eldr_cluster_role", role="leader"),
            "installed": value("eldr_cluster_centroid_generation", kind="installed"),
            "published": value("eldr_cluster_centroid_generation", kind="published"),
            "fence": value("eldr_cluster_fencing_generation"),
            "redis_up": value("eldr_cluster_redis_up"),
            "peers": value("eldr_cluster_peers")}


class StandaloneClusterLiveTest(LiveDaemonTestBase):
    """The standalone Deployment's replicas (2) of standalone-cluster against the overlay's Redis."""
    overlay = "standalone-cluster"

    def start_replicas(self):
        """Every replica of the Deployment, each a pod of its own name, past its probes."""
        names = [self.pod_name() for _ in range(self.workload["spec"]["replicas"])]
        replicas = [self.start(pod_name=name) for name in names]
        for replica in replicas:
            self.pass_all_probes(replica)
        return names, replicas

    def wait_agreement(self, replicas, above=0, timeout=15):
        """Waits until the replicas agree: one leader, the others following, all reaching Redis,
        each seeing the others, one installed generation, above `above`. Returns the views."""
        def agreed():
            views = [cluster_view(r) for r in replicas]
            generations = {v["installed"] for v in views}
            ok = (sum(v["leader"] for v in views) == 1 and len(generations) == 1
                  and min(generations) > above
                  and all(v["redis_up"] == 1 and v["peers"] == len(replicas) - 1
                          and v["published"] == v["installed"] for v in views))
            return True if ok else views
        lib.wait_until(agreed, timeout=timeout, interval=0.1, what="the replicas to agree")
        return [cluster_view(r) for r in replicas]

    def test_replicas_agree_through_the_overlays_redis(self):
        names, replicas = self.start_replicas()
        redis_port = self.redis.port("redis")
        cluster_name = lib.resolved_flags(self.objects, self.container_spec)["cluster_name"]
        for replica in replicas:
            # The overlay's arguments with the ConfigMap's values, the Service mapped to the local
            # Redis, and the password file from the Secret mount.
            flags = lib.flag_values(replica.command_line()[1:])
            self.assertEqual(flags["cluster_redis"], f"127.0.0.1:{redis_port}")
            self.assertEqual(flags["cluster_name"], cluster_name)
            with open(flags["cluster_redis_password_file"], "rb") as f:
                self.assertEqual(f.read(), self.redis_password)
        views = self.wait_agreement(replicas)
        generation = views[0]["installed"]
        # The replica ids are the pod names (POD_NAME): the members of the pool's replica set.
        prefix = f"eldr:{{{cluster_name}}}"
        self.assertEqual(sorted(self.redis_cli("ZRANGE", f"{prefix}:replicas", "0", "-1")), sorted(names))
        (leader_value,) = self.redis_cli("GET", f"{prefix}:leader")
        leader = names[[v["leader"] for v in views].index(1)]
        self.assertEqual(leader_value.split("|")[0], leader)

        # A lease taken on one replica is published for the other's load.
        client = RouterClient(f"127.0.0.1:{replicas[0].listen_port('listen')}")
        self.addCleanup(client.close)
        response = client.route(trace_counts("law", 1)[0])

        def published():
            fields = self.redis_cli("HGETALL", f"{prefix}:leases:{names[0]}")
            counts = dict(zip(fields[::2], fields[1::2]))
            return True if counts.get(response.worker_id, "").startswith("1,") else counts
        lib.wait_until(published, timeout=5, what="the lease in the replica's load hash")
        client.complete(response.lease_id)

        # Every eldr_cluster_* series the dashboard and the alerts use is scraped, with the label
        # values they select on.
        used = {}
        for title, expr in lib.dashboard_exprs(lib.load_dashboard()):
            used.update({n: f"panel '{title}'" for n in lib.metric_names(expr) if n.startswith("eldr_cluster_")})
        for alert, expr in lib.rule_exprs(lib.load_rules()):
            used.update({n: f"alert {alert}" for n in lib.metric_names(expr) if n.startswith("eldr_cluster_")})
        self.assertTrue(used)
        for replica in replicas:
            samples = scrape(replica)
            self.assertEqual({n: w for n, w in used.items() if n not in samples}, {},
                             "used by the monitoring files but not scraped")
            for _, expr in list(lib.rule_exprs(lib.load_rules())) + list(lib.dashboard_exprs(lib.load_dashboard())):
                for metric, matchers in re.findall(r"(eldr_cluster_[a-z_]+)\{([^}]*)\}", expr):
                    for label, op, value in re.findall(r'(\w+)\s*(=~|=)\s*"([^"$]*)"', matchers):
                        if label in ("namespace", "job", "pod") or not value:
                            continue
                        seen = {labels.get(label) for labels, _ in samples[metric]}
                        for alternative in value.split("|") if op == "=~" else [value]:
                            self.assertIn(alternative, seen, f"{metric}{{{label}}}")

        # An edited centroid ConfigMap reaches every pod's mount (the kubelet updates each one):
        # the leader publishes what it installed and both replicas end on one newer generation.
        centroids = self.flags["centroids"]
        key = os.path.basename(centroids)
        with open(os.path.join(replicas[0].local_path(os.path.dirname(centroids)), key)) as f:
            artifact = json.load(f)
        edited = json.dumps(dict(artifact, seed=artifact.get("seed", 0) + 1)).encode()
        for replica in replicas:
            lib.update_projected_volume(replica.local_path(os.path.dirname(centroids)), {key: edited})
        self.wait_agreement(replicas, above=generation)

    def test_redis_restarted_empty(self):
        # Redis is killed (the pod's container dies) and comes back empty, at the same address:
        # the replicas route on meanwhile, and afterwards agree again on a generation no older
        # than before, with their state rebuilt in Redis.
        names, replicas = self.start_replicas()
        before = self.wait_agreement(replicas)[0]["installed"]
        self.redis.stop(signal.SIGKILL)

        def cut_off():
            views = [cluster_view(r) for r in replicas]
            return True if all(v["redis_up"] == 0 for v in views) else views
        lib.wait_until(cut_off, timeout=10, what="every replica to notice that Redis is gone")
        for replica in replicas:
            client = RouterClient(f"127.0.0.1:{replica.listen_port('listen')}")
            self.addCleanup(client.close)
            started = time.monotonic()
            response = client.route(trace_counts("summary", 1)[0])
            self.assertLess(time.monotonic() - started, 1.0, "a Route never waits for Redis")
            self.assertEqual(response.fallback_reason, "", "fail-static: the last centroids route")
            client.complete(response.lease_id)
        self.redis.start()
        self.redis.pass_probe("readinessProbe")
        restarted = time.monotonic()
        after = self.wait_agreement(replicas, above=before - 1)[0]["installed"]
        self.assertGreaterEqual(after, before, "generations never go back")
        self.assertLess(time.monotonic() - restarted, 10)
        cluster_name = lib.resolved_flags(self.objects, self.container_spec)["cluster_name"]
        self.assertEqual(sorted(self.redis_cli("ZRANGE", f"eldr:{{{cluster_name}}}:replicas", "0", "-1")),
                         sorted(names))


def make_test_pki(folder, server_name):
    """A CA and one certificate (server and client auth, named `server_name`) signed by it."""
    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder, timeout=60)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=eldr test CA",
            "-keyout", "ca.key", "-out", "ca.crt")
    with open(os.path.join(folder, "ext.cnf"), "w") as f:
        f.write(f"subjectAltName=DNS:{server_name}\nextendedKeyUsage=serverAuth,clientAuth\n"
                "keyUsage=digitalSignature,keyEncipherment\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={server_name}",
            "-keyout", "tls.key", "-out", "tls.csr")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "tls.crt")
    files = {}
    for name in ("ca.crt", "tls.crt", "tls.key"):
        with open(os.path.join(folder, name), "rb") as f:
            files[name] = f.read()
    return files


class TlsLiveTest(LiveDaemonTestBase):
    overlay = "tls"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        probe = cls.container_spec["readinessProbe"]["exec"]["command"]
        cls.server_name = lib.flag_values(probe[1:])["tls_server_name"]
        cls.pki_dir = tempfile.mkdtemp(prefix="eldr-pki-")
        tls = make_test_pki(cls.pki_dir, cls.server_name)
        cls.token = b"deploy-test-admin-token"
        cls.secrets = {"eldr-router-tls": tls, "eldr-router-admin": {"token": cls.token + b"\n"}}

    @classmethod
    def tearDownClass(cls):
        import shutil
        shutil.rmtree(cls.pki_dir, ignore_errors=True)

    def test_passes_tls_probes_and_refuses_plaintext_and_anonymous_clients(self):
        import grpc
        container = self.start()
        self.pass_all_probes(container)
        address = f"127.0.0.1:{container.listen_port('listen')}"
        # Plaintext is refused.
        self.assertNotEqual(lib.grpc_health(address), lib.SERVING)
        tls = self.secrets["eldr-router-tls"]
        options = (("grpc.ssl_target_name_override", self.server_name),)
        # TLS without a client certificate is refused (mutual TLS).
        anonymous = grpc.ssl_channel_credentials(root_certificates=tls["ca.crt"])
        channel = grpc.secure_channel(address, anonymous, options=options)
        with self.assertRaises(grpc.RpcError):
            channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=3)
        channel.close()
        # With the certificate, health answers SERVING.
        mutual = grpc.ssl_channel_credentials(root_certificates=tls["ca.crt"],
                                              private_key=tls["tls.key"],
                                              certificate_chain=tls["tls.crt"])
        channel = grpc.secure_channel(address, mutual, options=options)
        self.assertEqual(lib.decode_health_response(
            channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=3)), lib.SERVING)
        channel.close()
        # The admin service wants the token from the Secret.
        admin = f"127.0.0.1:{container.listen_port('admin_listen')}"
        pb = lib.protobuf_modules()
        channel = grpc.secure_channel(admin, mutual, options=options)
        list_workers = channel.unary_unary("/eldr.v1.RouterAdmin/ListWorkers",
                                           request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=pb.ListWorkersResponse.FromString)
        with self.assertRaises(grpc.RpcError) as refused:
            list_workers(pb.ListWorkersRequest(), timeout=3)
        self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        listed = list_workers(pb.ListWorkersRequest(), timeout=3,
                              metadata=(("authorization", "Bearer " + self.token.decode()),))
        self.assertTrue(listed.workers)
        channel.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
