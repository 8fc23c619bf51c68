"""Renders every Kustomize overlay with `kubectl kustomize` (offline) and checks the objects: the
probes ask the health service on the port the daemon listens on, ports agree with the daemon's
flags and with the Services and monitors that reach them, the security settings are present, and
Kubernetes discovery of the decode workers has exactly the access it needs (list and watch pods)."""

import json
import os
import re
import unittest

import deploy_testlib as lib

# The image's numeric user (docker/Dockerfile USER).
IMAGE_UID = 65532

# Overlays whose router finds the decode workers from their pods (--discovery=kubernetes) rather
# than from a static --workers list.
DISCOVERY_OVERLAYS = {"standalone", "sidecar", "tls"}
# All that discovery may ask the API server, and all that the router's ServiceAccount is granted.
DISCOVERY_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
# Where the kubelet mounts the ServiceAccount token (what in-cluster discovery reads).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# The example decode pool (deploy/examples), labelled and named the way discovery expects.
DECODE_EXAMPLE = "decode-statefulset.yaml"


def container_port_names(container):
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def probe_target(container, probe):
    """(host, port, health service) a probe checks: a gRPC probe's, or eldr-health-probe's flags."""
    if "grpc" in probe:
        return None, probe["grpc"]["port"], probe["grpc"].get("service", "")
    command = probe["exec"]["command"]
    if os.path.basename(command[0]) != "eldr-health-probe":
        raise AssertionError(f"exec probe runs {command[0]}, not eldr-health-probe")
    flags = lib.flag_values(command[1:])
    host, port = lib.split_host_port(flags["addr"])
    return host, port, flags.get("service", "")


# Health service names (src/server/server.cc): "" is SERVING once centroids and workers are loaded
# (readiness); "liveness" while the process runs (a drained pool must not restart it). Startup asks
# "liveness" too: the port opens only after a configured artifact loaded, and with discovery the
# decode pool may take minutes to become ready, which must not restart the router.
PROBE_SERVICE = {"startupProbe": "liveness", "readinessProbe": "", "livenessProbe": "liveness"}


def preStop_seconds(container):
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/bin/sleep", command
    return float(command[1])


def duration_seconds(text):
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not match:
        raise AssertionError(f"unexpected duration {text!r}")
    return float(match.group(1)) * units[match.group(2)]


class OverlayTestBase:
    overlay = None

    @classmethod
    def setUpClass(cls):
        cls.objects = lib.render_overlay(cls.overlay)
        cls.workload, cls.spec, cls.container = lib.router_workload(cls.objects)
        cls.flags = lib.flag_values(cls.container["args"])

    # ---- general shape ----
    def test_objects_are_namespaced_and_labelled(self):
        for obj in self.objects:
            with self.subTest(kind=obj["kind"], name=obj["metadata"]["name"]):
                self.assertIn("apiVersion", obj)
                if obj["kind"] != "Namespace":
                    self.assertTrue(obj["metadata"].get("namespace"), "overlays set the namespace")

    def test_image_and_command(self):
        self.assertRegex(self.container["image"], r"^eldr-router:\d+\.\d+\.\d+$")
        self.assertEqual(self.container["command"], ["/usr/local/bin/eldr-router"])

    # ---- probes ----
    def test_probes_check_the_health_service_on_the_listen_port(self):
        listen_host, listen_port = lib.split_host_port(self.flags["listen"])
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            with self.subTest(probe=kind):
                probe = self.container[kind]
                host, port, service = probe_target(self.container, probe)
                self.assertEqual(port, listen_port, f"{kind} checks a port the daemon does not serve")
                self.assertEqual(service, PROBE_SERVICE[kind])
                if "grpc" in probe:
                    # The kubelet dials the pod IP: the daemon must listen on every address.
                    self.assertEqual(listen_host, "0.0.0.0")
                    self.assertIn(port, container_port_names(self.container).values())
                else:
                    self.assertIn(host, {"127.0.0.1", "localhost"})
                self.assertGreaterEqual(probe["timeoutSeconds"], 1)
        startup = self.container["startupProbe"]
        self.assertGreaterEqual(startup["failureThreshold"] * startup["periodSeconds"], 60,
                                "a large artifact needs time to load")
        liveness = self.container["livenessProbe"]
        readiness = self.container["readinessProbe"]
        self.assertGreater(liveness["failureThreshold"] * liveness["periodSeconds"],
                           readiness["failureThreshold"] * readiness["periodSeconds"],
                           "liveness must be more patient than readiness")

    # ---- ports ----
    def test_ports_match_the_daemon_flags(self):
        ports = container_port_names(self.container)
        _, metrics_port = lib.split_host_port(self.flags["metrics_listen"])
        self.assertIn(metrics_port, ports.values(), "metrics port not declared")
        metrics_host, _ = lib.split_host_port(self.flags["metrics_listen"])
        self.assertEqual(metrics_host, "0.0.0.0", "Prometheus scrapes the pod IP")
        admin_host, admin_port = lib.split_host_port(self.flags["admin_listen"])
        self.assertEqual(admin_host, "127.0.0.1", "the admin service stays on the pod's loopback")
        self.assertNotIn(admin_port, ports.values(), "a loopback-only port must not be declared")
        listen_host, listen_port = lib.split_host_port(self.flags["listen"])
        self.assertEqual(len({listen_port, admin_port, metrics_port}), 3)
        if listen_host == "0.0.0.0":
            self.assertEqual(ports.get("grpc"), listen_port)

    # ---- security ----
    def test_security_context(self):
        pod = self.spec.get("securityContext", {})
        sc = self.container["securityContext"]
        self.assertTrue(sc.get("runAsNonRoot") or pod.get("runAsNonRoot"))
        self.assertEqual(sc.get("runAsUser", pod.get("runAsUser")), IMAGE_UID)
        self.assertNotEqual(sc.get("runAsGroup", pod.get("runAsGroup")), 0)
        self.assertIs(sc.get("readOnlyRootFilesystem"), True)
        self.assertIs(sc.get("allowPrivilegeEscalation"), False)
        self.assertFalse(sc.get("privileged", False))
        self.assertEqual(sc["capabilities"].get("drop"), ["ALL"])
        self.assertNotIn("add", sc["capabilities"])
        seccomp = sc.get("seccompProfile") or pod.get("seccompProfile")
        self.assertEqual(seccomp, {"type": "RuntimeDefault"})
        self.assertEqual(pod.get("fsGroup"), IMAGE_UID, "mounted files readable by the router")
        self.assertFalse(self.spec.get("hostNetwork", False))

    def test_writable_paths_are_volumes(self):
        mounts = {m["mountPath"]: m for m in self.container["volumeMounts"]}
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        self.assertIn("emptyDir", volumes[mounts["/tmp"]["name"]])
        if "state_dir" in self.flags:
            self.assertIn("emptyDir", volumes[mounts[self.flags["state_dir"]]["name"]])
        for mount in mounts.values():
            volume = volumes[mount["name"]]
            self.assertNotIn("subPath", mount, "subPath mounts never see ConfigMap/Secret updates")
            if "configMap" in volume or "secret" in volume:
                self.assertIs(mount.get("readOnly"), True)
            self.assertNotIn("hostPath", volume)

    def test_resources(self):
        resources = self.container["resources"]
        for key in ("cpu", "memory"):
            self.assertIn(key, resources["requests"])
            self.assertIn(key, resources["limits"])
        self.assertLessEqual(lib.parse_cpu(resources["requests"]["cpu"]),
                             lib.parse_cpu(resources["limits"]["cpu"]))

    # ---- configuration ----
    def config_map_file(self, flag):
        """(ConfigMap, key) that the file named by --<flag> comes from."""
        path = self.flags[flag]
        folder, key = os.path.split(path)
        mount = next(m for m in self.container["volumeMounts"] if m["mountPath"] == folder)
        volume = next(v for v in self.spec["volumes"] if v["name"] == mount["name"])
        config_map = lib.find_one(self.objects, "ConfigMap", volume["configMap"]["name"])
        self.assertIn(key, config_map["data"])
        return config_map, key

    def centroid_artifact(self):
        centroids_map, centroids_key = self.config_map_file("centroids")
        # The centroid ConfigMap keeps its name across edits so the mounted file is updated in
        # place and the daemon reloads it.
        self.assertEqual(centroids_map["metadata"]["name"], "eldr-router-centroids")
        return json.loads(centroids_map["data"][centroids_key])

    def test_centroids_come_from_a_config_map(self):
        artifact = self.centroid_artifact()
        dim = len(artifact.get("layer_mask") or range(artifact["L"])) * artifact["e"]
        for row in artifact["centroids"]:
            self.assertEqual(len(row), dim)
            self.assertAlmostEqual(sum(v * v for v in row), 1.0, delta=2e-3)

    def test_worker_source(self):
        discovery = self.flags.get("discovery", "static")
        self.assertEqual(discovery == "kubernetes", self.overlay in DISCOVERY_OVERLAYS,
                         f"--discovery={discovery}")
        artifact = self.centroid_artifact()
        if discovery == "kubernetes":
            # A discovered worker's id is its pod name; a row named after a pod is that pod's
            # (the others go to the pods in pool order), so names must be names a pod can have.
            names = artifact.get("workers", [])
            self.assertEqual(len(names), len(set(names)))
            if names:
                self.assertEqual(len(artifact["centroids"]), len(names))
            for name in names:
                self.assertRegex(name, r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", "not a pod name")
            return
        workers_map, workers_key = self.config_map_file("workers")
        # The worker list's name carries a content hash so a change rolls the pods.
        self.assertRegex(workers_map["metadata"]["name"], r"^eldr-router-workers-[a-z0-9]{10}$")
        workers = json.loads(workers_map["data"][workers_key])["workers"]
        ids = [w["id"] for w in workers]
        self.assertEqual(len(ids), len(set(ids)))
        self.assertEqual(len(artifact["centroids"]), len(workers),
                         "one centroid row per worker, or the daemon refuses to start")
        if "workers" in artifact:
            self.assertEqual(sorted(artifact["workers"]), sorted(ids))

    # ---- Kubernetes discovery ----
    def require_discovery(self):
        if self.flags.get("discovery") != "kubernetes":
            self.skipTest("static worker list")

    def namespace(self):
        return self.workload["metadata"]["namespace"]

    def test_discovery_flags(self):
        self.require_discovery()
        self.assertFalse([a for a in self.container["args"] if a.startswith("--workers")],
                         "--workers and --discovery=kubernetes cannot be mixed")
        selector = self.flags.get("decode_selector", "")
        self.assertTrue(selector, "--decode_selector is required with --discovery=kubernetes")
        lib.parse_label_selector(selector)
        self.assertRegex(self.flags.get("worker_port", "http"),
                         r"^([1-9][0-9]{0,4}|[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?)$")
        # The Role is in the router's namespace, so that is the one it may watch; in-cluster
        # credentials (the mounted token), not a kubeconfig file.
        self.assertIn(self.flags.get("kube_namespace", ""), ("", self.namespace()))
        self.assertEqual(self.flags.get("kubeconfig", ""), "")
        # No worker list is mounted any more.
        for volume in self.spec.get("volumes", []):
            name = volume.get("configMap", {}).get("name", "")
            self.assertFalse(name.startswith("eldr-router-workers"), volume)

    def test_discovery_selects_no_pod_of_the_overlay(self):
        # The overlay's own pods (routers, prefill engines) must never become decode workers.
        self.require_discovery()
        selector = self.flags["decode_selector"]
        workloads = lib.find(self.objects, "Deployment") + lib.find(self.objects, "StatefulSet")
        for workload in workloads:
            labels = workload["spec"]["template"]["metadata"].get("labels", {})
            self.assertFalse(lib.selector_matches(selector, labels),
                             f"{selector} selects the pods of {workload['metadata']['name']}")

    def test_discovery_role_grants_exactly_list_and_watch_pods(self):
        self.require_discovery()
        namespace = self.namespace()
        account = lib.service_account_name(self.spec)
        self.assertEqual([o["metadata"].get("namespace") for o in
                          lib.find(self.objects, "ServiceAccount", account)], [namespace],
                         f"the pod's ServiceAccount {account} is not in the overlay")
        self.assertEqual(lib.find(self.objects, "ClusterRole"), [], "no cluster-wide role")
        self.assertEqual(lib.find(self.objects, "ClusterRoleBinding"), [], "no cluster-wide role")
        bindings = [b for b in lib.find(self.objects, "RoleBinding")
                    if any(s.get("kind") == "ServiceAccount" and s.get("name") == account
                           and s.get("namespace", b["metadata"].get("namespace")) == namespace
                           for s in b.get("subjects", []))]
        self.assertEqual(len(bindings), 1, f"RoleBindings of ServiceAccount {account}: {bindings}")
        (binding,) = bindings
        self.assertEqual(binding["metadata"].get("namespace"), namespace)
        self.assertEqual(binding["roleRef"]["apiGroup"], "rbac.authorization.k8s.io")
        self.assertEqual(binding["roleRef"]["kind"], "Role")
        roles = [r for r in lib.find(self.objects, "Role", binding["roleRef"]["name"])
                 if r["metadata"].get("namespace") == namespace]
        self.assertEqual(len(roles), 1, "the bound Role is not in the router's namespace")
        self.assertEqual(roles[0]["rules"], DISCOVERY_RULES)
        # And nothing else is granted in the overlay.
        for role in lib.find(self.objects, "Role"):
            self.assertEqual(role["rules"], DISCOVERY_RULES, role["metadata"]["name"])

    def test_discovery_token_is_mounted(self):
        self.require_discovery()
        self.assertTrue(lib.token_automounted(self.objects, self.spec, self.namespace()),
                        "discovery authenticates with the ServiceAccount token")
        for mount in self.container.get("volumeMounts", []):
            path = mount["mountPath"].rstrip("/")
            clash = path == SERVICE_ACCOUNT_DIR or path.startswith(SERVICE_ACCOUNT_DIR + "/")
            self.assertFalse(clash, f"{path} clashes with the ServiceAccount token mount")

    def test_discovery_finds_the_example_decode_pods(self):
        # deploy/examples' decode pool, applied in the router's namespace, is what the router
        # discovers: selected by the label, serving on the named port, one pod per centroid row.
        self.require_discovery()
        (statefulset,) = lib.find(lib.load_example(DECODE_EXAMPLE), "StatefulSet")
        template = statefulset["spec"]["template"]
        self.assertTrue(lib.selector_matches(self.flags["decode_selector"],
                                             template["metadata"]["labels"]))
        ports = {}
        for container in template["spec"]["containers"]:
            for port in container.get("ports", []):
                ports.setdefault(port.get("name"), port["containerPort"])
        worker_port = self.flags.get("worker_port", "http")
        self.assertTrue(worker_port in ports or worker_port.isdigit(),
                        f"no container port {worker_port}")
        metrics_port = self.flags.get("worker_metrics_port", worker_port)
        self.assertTrue(metrics_port in ports or metrics_port.isdigit())
        name, replicas = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
        names = {f"{name}-{i}" for i in range(replicas)}
        self.assertEqual(names, set(self.centroid_artifact().get("workers", names)),
                         "the artifact's rows are named after the example's decode pods")

    def test_shutdown_fits_the_grace_period(self):
        grace = self.spec["terminationGracePeriodSeconds"]
        drain = duration_seconds(self.flags["shutdown_grace"])
        self.assertGreater(grace, preStop_seconds(self.container) + drain,
                           "SIGKILL would cut the drain short")

    def test_thread_pools_follow_the_cpu_limit(self):
        env = {e["name"]: e for e in self.container["env"]}
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            self.assertEqual(env[name]["valueFrom"]["resourceFieldRef"]["resource"], "limits.cpu")


class StandaloneTest(OverlayTestBase, unittest.TestCase):
    overlay = "standalone"

    def pod_labels(self):
        return self.workload["spec"]["template"]["metadata"]["labels"]

    def selects_pods(self, selector):
        return all(self.pod_labels().get(k) == v for k, v in selector.items())

    def test_deployment(self):
        self.assertEqual(self.workload["kind"], "Deployment")
        self.assertEqual(self.workload["spec"]["replicas"], 2)
        self.assertTrue(self.selects_pods(self.workload["spec"]["selector"]["matchLabels"]))
        self.assertEqual(self.workload["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0)

    def test_services_reach_the_daemon_ports(self):
        container_ports = container_port_names(self.container)
        _, listen_port = lib.split_host_port(self.flags["listen"])
        _, metrics_port = lib.split_host_port(self.flags["metrics_listen"])
        services = lib.find(self.objects, "Service")
        self.assertTrue(services)
        for service in services:
            with self.subTest(service=service["metadata"]["name"]):
                self.assertTrue(self.selects_pods(service["spec"]["selector"]))
                for port in service["spec"]["ports"]:
                    target = port["targetPort"]
                    self.assertIn(target, container_ports, "named targetPort must exist")
                    expected = {"grpc": listen_port, "metrics": metrics_port}[port["name"]]
                    self.assertEqual(container_ports[target], expected)
        main = lib.find_one(self.objects, "Service", "eldr-router")
        self.assertEqual({p["name"] for p in main["spec"]["ports"]}, {"grpc", "metrics"})

    def test_pod_disruption_budget(self):
        pdb = lib.find_one(self.objects, "PodDisruptionBudget", "eldr-router")
        self.assertTrue(self.selects_pods(pdb["spec"]["selector"]["matchLabels"]))
        self.assertGreaterEqual(pdb["spec"]["minAvailable"], 1)
        self.assertLess(pdb["spec"]["minAvailable"], self.workload["spec"]["replicas"],
                        "a PDB that allows no eviction blocks node drains")

    def test_service_monitor_scrapes_metrics(self):
        monitor = lib.find_one(self.objects, "ServiceMonitor", "eldr-router")
        service = lib.find_one(self.objects, "Service", "eldr-router")
        labels = service["metadata"]["labels"]
        self.assertTrue(all(labels.get(k) == v
                            for k, v in monitor["spec"]["selector"]["matchLabels"].items()))
        (endpoint,) = monitor["spec"]["endpoints"]
        self.assertIn(endpoint["port"], {p["name"] for p in service["spec"]["ports"]})
        self.assertEqual(endpoint["path"], "/metrics")

    def test_namespace_enforces_restricted_pod_security(self):
        namespace = lib.find_one(self.objects, "Namespace", "eldr")
        self.assertEqual(namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
                         "restricted")

    def test_base_renders_on_its_own(self):
        kinds = sorted(o["kind"] for o in lib.render("base"))
        for kind in ("ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceMonitor",
                     "ServiceAccount", "Role", "RoleBinding"):
            self.assertIn(kind, kinds)


class SidecarTest(OverlayTestBase, unittest.TestCase):
    overlay = "sidecar"

    def test_native_sidecar_of_the_prefill_pod(self):
        self.assertEqual(self.workload["metadata"]["name"], "prefill")
        init_names = [c["name"] for c in self.spec.get("initContainers", [])]
        self.assertIn(lib.ROUTER_CONTAINER, init_names)
        self.assertEqual(self.container["restartPolicy"], "Always",
                         "a native sidecar starts before the engine and stops after it")
        self.assertEqual([c["name"] for c in self.spec["containers"]], ["engine"])
        self.assertEqual(lib.find(self.objects, "Deployment", "eldr-router"), [])
        self.assertEqual(lib.find(self.objects, "Service"), [])

    def test_engine_calls_the_router_on_localhost(self):
        engine = self.spec["containers"][0]
        target = {e["name"]: e["value"] for e in engine.get("env", [])}["ELDR_ROUTER_TARGET"]
        host, port = lib.split_host_port(target)
        self.assertEqual(host, "localhost")
        listen_host, listen_port = lib.split_host_port(self.flags["listen"])
        self.assertEqual(port, listen_port)
        self.assertEqual(listen_host, "127.0.0.1", "only the engine in the pod can call it")
        engine_ports = {p["containerPort"] for p in engine.get("ports", [])}
        self.assertFalse(engine_ports & {listen_port}, "port clash with the engine")

    def test_pod_monitor_scrapes_the_sidecar(self):
        monitor = lib.find_one(self.objects, "PodMonitor", "eldr-router")
        labels = self.workload["spec"]["template"]["metadata"]["labels"]
        self.assertTrue(all(labels.get(k) == v
                            for k, v in monitor["spec"]["selector"]["matchLabels"].items()))
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        self.assertEqual(container_port_names(self.container)[endpoint["port"]],
                         lib.split_host_port(self.flags["metrics_listen"])[1])
        self.assertEqual(endpoint["path"], "/metrics")

    def test_same_router_as_standalone(self):
        # The sidecar repeats the standalone container; everything but the listen address and
        # the probes (exec instead of kubelet gRPC) must stay the same.
        _, _, standalone = lib.router_workload(lib.render_overlay("standalone"))
        for key in ("image", "command", "env", "resources", "lifecycle"):
            self.assertEqual(self.container[key], standalone[key], key)
        ours = {k: v for k, v in self.flags.items() if k != "listen"}
        theirs = {k: v for k, v in lib.flag_values(standalone["args"]).items() if k != "listen"}
        self.assertEqual(ours, theirs)
        self.assertEqual(sorted(m["mountPath"] for m in self.container["volumeMounts"]),
                         sorted(m["mountPath"] for m in standalone["volumeMounts"]))
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            for key in ("periodSeconds", "failureThreshold"):
                self.assertEqual(self.container[kind][key], standalone[kind][key], (kind, key))
        ours_sc = dict(self.container["securityContext"])
        ours_sc.pop("seccompProfile", None)  # set on the pod in the standalone Deployment
        self.assertEqual(ours_sc, standalone["securityContext"])


class TlsTest(OverlayTestBase, unittest.TestCase):
    overlay = "tls"

    def secret_files(self):
        """{container path: (secret name, key)} of the Secret volumes."""
        files = {}
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        for mount in self.container["volumeMounts"]:
            secret = volumes[mount["name"]].get("secret")
            if secret:
                for key in ("tls.crt", "tls.key", "ca.crt", "token"):
                    files[f"{mount['mountPath']}/{key}"] = (secret["secretName"], key)
        return files

    def test_tls_material_from_secrets(self):
        files = self.secret_files()
        for flag in ("tls_cert", "tls_key", "tls_client_ca", "admin_token_file"):
            self.assertIn(self.flags[flag], files, f"--{flag} is not in a mounted Secret")
        self.assertEqual(files[self.flags["tls_cert"]][0], "eldr-router-tls")

    def test_probes_speak_mutual_tls(self):
        files = self.secret_files()
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            with self.subTest(probe=kind):
                probe = self.container[kind]
                self.assertIn("exec", probe, "kubelet gRPC probes cannot speak TLS")
                flags = lib.flag_values(probe["exec"]["command"][1:])
                self.assertEqual(flags["tls_ca"], self.flags["tls_client_ca"])
                self.assertEqual(flags["tls_cert"], self.flags["tls_cert"])
                self.assertEqual(flags["tls_key"], self.flags["tls_key"])
                self.assertIn(flags["tls_ca"], files)
                self.assertTrue(flags["tls_server_name"].startswith("eldr-router."))

    def test_services_announce_tls(self):
        for service in lib.find(self.objects, "Service"):
            grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
            self.assertEqual(grpc_port["appProtocol"], "https")

    def test_everything_else_is_the_standalone_router(self):
        _, _, standalone = lib.router_workload(lib.render_overlay("standalone"))
        theirs = lib.flag_values(standalone["args"])
        ours = {k: v for k, v in self.flags.items() if k in theirs}
        self.assertEqual(ours, theirs)


class OverlaysTest(unittest.TestCase):
    def test_every_overlay_folder_is_tested(self):
        folders = sorted(os.listdir(os.path.join(lib.DEPLOY_DIR, "overlays")))
        self.assertEqual(folders, sorted(lib.OVERLAYS))


if __name__ == "__main__":
    unittest.main(verbosity=2)
