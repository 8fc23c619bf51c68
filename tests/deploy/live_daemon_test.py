"""Runs the built eldr-router exactly as the rendered Kubernetes containers would run it (command,
args, environment and mounted files; on loopback ports in a temporary folder) and checks that it
passes its startup, readiness and liveness probes, that its metrics page carries every metric the
dashboard and the alert rules use, that an edited centroid ConfigMap is picked up without a
restart, and that SIGTERM drains and exits in time."""

import json
import os
import re
import signal
import subprocess
import tempfile
import time
import unittest

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


class LiveDaemonTestBase(unittest.TestCase):
    overlay = "standalone"
    secrets = None

    @classmethod
    def setUpClass(cls):
        lib.require_binary("eldr-router")
        lib.require_binary("eldr-health-probe")
        cls.objects = lib.render_overlay(cls.overlay)
        cls.workload, cls.spec, cls.container_spec = lib.router_workload(cls.objects)

    def start(self):
        # Decode workers' metrics pages on loopback, in place of the cluster URLs of workers.json.
        config_map = next(o for o in lib.find(self.objects, "ConfigMap")
                          if o["metadata"]["name"].startswith("eldr-router-workers"))
        workers = [w["id"] for w in json.loads(config_map["data"]["workers.json"])["workers"]]
        self.fake_workers = lib.FakeVllmMetrics(workers, running=5, waiting=2, kv_usage=0.25)
        self.addCleanup(self.fake_workers.close)
        container = lib.start_with_retries(
            lambda: lib.PodContainer(self.objects, self.spec, self.container_spec,
                                     secrets=self.secrets,
                                     rewrite_files={"workers.json": self.fake_workers.rewrite_workers_json}))
        self.addCleanup(container.cleanup)
        return container

    def pass_all_probes(self, container):
        took = container.pass_probe("startupProbe")
        container.pass_probe("readinessProbe")
        container.pass_probe("livenessProbe")
        return took


class StandaloneLiveTest(LiveDaemonTestBase):
    overlay = "standalone"

    def test_passes_probes_and_serves_the_service_ports(self):
        container = self.start()
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
        self.assertEqual(gauge(samples, "eldr_workers"),
                         len(self.workers_in_config_map()))
        # The admin service answers on the pod's loopback.
        client = RouterClient(f"127.0.0.1:{container.listen_port('admin_listen')}")
        self.addCleanup(client.close)
        listed = client.list_workers()
        self.assertEqual(sorted(w.worker.id for w in listed.workers),
                         sorted(w["id"] for w in self.workers_in_config_map()))

    def workers_in_config_map(self):
        config_map = next(o for o in lib.find(self.objects, "ConfigMap")
                          if o["metadata"]["name"].startswith("eldr-router-workers"))
        return json.loads(config_map["data"]["workers.json"])["workers"]

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

    def test_drained_pool_fails_readiness_but_not_liveness(self):
        container = self.start()
        self.pass_all_probes(container)
        admin = RouterClient(f"127.0.0.1:{container.listen_port('admin_listen')}")
        self.addCleanup(admin.close)
        workers = self.workers_in_config_map()
        for worker in workers:
            admin.drain_worker(worker["id"])
        readiness = self.container_spec["readinessProbe"]
        liveness = self.container_spec["livenessProbe"]
        lib.wait_until(lambda: container.run_probe(readiness) is not True, timeout=5,
                       what="readiness to fail with every worker drained")
        self.assertIs(container.run_probe(liveness), True,
                      "a drained router must not be restarted by its liveness probe")
        admin.upsert_worker({"id": workers[0]["id"], "address": workers[0]["address"], "capacity": 1})
        container.pass_probe("readinessProbe")

    def test_metrics_cover_dashboard_and_alerts(self):
        container = self.start()
        self.pass_all_probes(container)
        client = RouterClient(f"127.0.0.1:{container.listen_port('listen')}")
        self.addCleanup(client.close)
        workers = [w["id"] for w in self.workers_in_config_map()]
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
        missing = {name: where for name, where in used.items()
                   if name not in samples and name not in lib.PROMETHEUS_SYNTHETIC}
        self.assertEqual(missing, {}, "metrics used by the monitoring files but not scraped")
        # Literal label values the alerts and panels select on exist too.
        for alert, expr in list(lib.rule_exprs(lib.load_rules())) + [
                (t, e) for t, e in lib.dashboard_exprs(lib.load_dashboard())]:
            for metric, matchers in re.findall(r"([a-z_]+)\{([^}]*)\}", expr):
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
        admin = RouterClient(f"127.0.0.1:{container.listen_port('admin_listen')}")
        self.addCleanup(admin.close)
        for worker in admin.list_workers().workers:
            admin.drain_worker(worker.worker.id)
        lib.wait_until(lambda: exit_code(f"--addr={address}") == 4 or "still serving", timeout=5,
                       what="NOT_SERVING (exit 4) with every worker drained")
        self.assertEqual(exit_code(f"--addr={address}", "--service=liveness"), 0)


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
