"""Renders every Kustomize overlay with `kubectl kustomize` (offline) and checks the objects: the
probes ask the health service on the port the daemon listens on, ports agree with the daemon's
flags and with the Services and monitors that reach them, the security settings are present,
Kubernetes discovery of the decode workers has exactly the access it needs (list and watch pods),
and the overlays whose replicas share a Redis (components/cluster, components/redis) give every
router the address, the pool's name, the password from a Secret and its pod name, next to a Redis
that is locked down, probed, and reachable where the routers dial it."""

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import unittest

import yaml

import deploy_testlib as lib

# The image's numeric user (docker/Dockerfile USER).
IMAGE_UID = 65532

# Overlays whose router finds the decode workers from their pods (--discovery=kubernetes) rather
# than from a static --workers list.
DISCOVERY_OVERLAYS = {"standalone", "sidecar", "tls", "standalone-cluster", "examples/existing-redis"}
# Overlays whose routers agree through a Redis (components/cluster), and those that also run it
# (components/redis).
CLUSTER_OVERLAYS = {"standalone-cluster", "sidecar"}
REDIS_OVERLAYS = {"standalone-cluster", "sidecar"}
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


# ---- router replicas that share a Redis (components/cluster, components/redis) ----

# The ConfigMap an overlay generates for components/cluster, and the Secret it mounts.
CLUSTER_CONFIG_MAP = "eldr-router-cluster"
REDIS_SECRET = "eldr-redis"
REDIS_SECRET_KEY = "password"
# Environment variables components/cluster defines (the arguments refer to them).
CLUSTER_ENV = ("POD_NAME", "ELDR_CLUSTER_REDIS", "ELDR_CLUSTER_NAME")
# Every cluster setting of the daemon (src/server/config.cc) and the defaults the checks below use.
CLUSTER_FLAGS = {"cluster_redis", "cluster_redis_password_file", "cluster_redis_db", "cluster_name",
                 "replica_id", "cluster_leader_lease", "cluster_leader_eligible",
                 "cluster_load_interval", "cluster_centroid_check_interval", "cluster_redis_timeout"}
CLUSTER_DEFAULTS = {"cluster_leader_lease": "3s", "cluster_redis_timeout": "1s"}
# ValidateClusterName (src/cluster/cluster_store.cc).
CLUSTER_NAME = r"[A-Za-z0-9._-]{1,64}"
# The annotation components/cluster selects workloads by, and where each value puts the router.
ROUTER_ANNOTATION = "eldr.io/router"
ROUTER_PLACES = {"container": "containers", "init-container": "initContainers"}
REDIS_NAME = "eldr-redis"


def hashed_name(name, base):
    """Whether `name` is the generated name of `base` (kustomize's 10-character content hash)."""
    return re.fullmatch(rf"{re.escape(base)}-[a-z0-9]{{10}}", name) is not None


def without_name_hashes(obj):
    """A copy of `obj` in which every generated eldr-router-cluster-<hash> name is unhashed (two
    overlays with different settings then compare equal elsewhere)."""
    if isinstance(obj, dict):
        return {k: without_name_hashes(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [without_name_hashes(v) for v in obj]
    if isinstance(obj, str) and hashed_name(obj, CLUSTER_CONFIG_MAP):
        return CLUSTER_CONFIG_MAP
    return obj


def is_cluster_arg(arg):
    return re.match(r"--(cluster_|replica_id=)", arg) is not None


def without_cluster_settings(container, volumes):
    """(container, volumes) without what components/cluster adds: its arguments, its variables,
    the Secret mount of the Redis password."""
    container = copy.deepcopy(container)
    auth = {v["name"] for v in volumes
            if v.get("secret", {}).get("secretName") == REDIS_SECRET}
    container["args"] = [a for a in container["args"] if not is_cluster_arg(a)]
    container["env"] = [e for e in container["env"] if e["name"] not in CLUSTER_ENV]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] not in auth]
    return container, [v for v in volumes if v["name"] not in auth]


def redis_server_options(container):
    """{option: [values]} of the redis-server command line the container's shell script execs,
    and the script itself."""
    command = container["command"]
    if not (os.path.basename(command[0]) == "sh" and command[1] == "-c" and len(command) == 3):
        raise AssertionError(f"unexpected Redis command {command}")
    script = command[2]
    words = shlex.split(script)
    if words[:2] != ["exec", "redis-server"]:
        raise AssertionError(f"the script should exec redis-server (signals reach it): {script!r}")
    options, name = {}, None
    for word in words[2:]:
        if word.startswith("--"):
            name = word[2:]
            options[name] = []
        elif name is None:
            raise AssertionError(f"redis-server takes a config file here: {script!r}")
        else:
            options[name].append(word)
    return options, script


def parse_memory(text):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9,
             "kb": 10**3, "mb": 2**20, "gb": 2**30}
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text))
    return int(match.group(1)) * units.get(match.group(2), 1)


class ClusterChecks:
    """The overlays whose routers share a Redis: mixed into their OverlayTestBase tests."""

    def cluster_flags(self):
        """The router's flags after the kubelet's $(VAR) expansion."""
        return lib.resolved_flags(self.objects, self.container, namespace=self.namespace())

    def env_entries(self, name):
        return [e for e in self.container.get("env", []) if e["name"] == name]

    def test_router_is_where_its_annotation_says(self):
        place = self.workload["metadata"].get("annotations", {}).get(ROUTER_ANNOTATION)
        self.assertIn(place, ROUTER_PLACES, f"{ROUTER_ANNOTATION} selects the workload for components/cluster")
        self.assertEqual(self.spec[ROUTER_PLACES[place]][0]["name"], lib.ROUTER_CONTAINER)

    def test_cluster_settings_come_from_the_overlays_config_map(self):
        for flag in ("cluster_redis", "cluster_name", "cluster_redis_password_file"):
            self.assertIn(flag, self.flags)
        self.assertEqual(set(f for f in self.flags if f.startswith("cluster_") or f == "replica_id")
                         - CLUSTER_FLAGS, set(), "not a flag of the daemon")
        # Every $(VAR) of the arguments is defined: the kubelet passes an undefined one literally.
        env = {e["name"] for e in self.container.get("env", [])}
        for arg in self.container["args"]:
            for name in lib.env_references(arg):
                self.assertIn(name, env, f"{arg} refers to an undefined variable")
        maps = set()
        for flag in ("cluster_redis", "cluster_name"):
            (name,) = lib.env_references(self.flags[flag])
            (entry,) = self.env_entries(name)
            ref = entry["valueFrom"]["configMapKeyRef"]
            maps.add(ref["name"])
        (map_name,) = maps
        # The name carries a content hash: a changed address or name rolls the router pods (a
        # variable is read at container start only).
        self.assertTrue(hashed_name(map_name, CLUSTER_CONFIG_MAP), map_name)
        config_map = lib.find_one(self.objects, "ConfigMap", map_name)
        self.assertEqual(config_map["metadata"].get("namespace"), self.namespace())
        self.assertEqual(set(config_map["data"]), {"redis", "name"})
        flags = self.cluster_flags()
        host, port = lib.split_host_port(flags["cluster_redis"])
        self.assertTrue(host)
        self.assertTrue(1 <= port <= 65535)
        self.assertRegex(flags["cluster_name"], rf"^{CLUSTER_NAME}$")
        self.assertNotEqual(flags["cluster_name"], "default", "name the pool")
        # The daemon's rule: three Redis timeouts fit in a leader lease (a renewal must fit).
        lease = duration_seconds(flags.get("cluster_leader_lease", CLUSTER_DEFAULTS["cluster_leader_lease"]))
        timeout = duration_seconds(flags.get("cluster_redis_timeout", CLUSTER_DEFAULTS["cluster_redis_timeout"]))
        self.assertLessEqual(3 * timeout, lease)

    def test_replica_id_is_the_pod_name(self):
        (pod_name,) = self.env_entries("POD_NAME")
        self.assertEqual(pod_name["valueFrom"], {"fieldRef": {"fieldPath": "metadata.name"}})
        # The daemon's replica id: --replica_id, else $POD_NAME. Either way, the pod's name.
        pod = "eldr-router-7d4f9c6b8-x2x8k"
        env = lib.container_env(self.objects, self.container, pod_name=pod)
        flags = lib.resolved_flags(self.objects, self.container, pod_name=pod)
        self.assertEqual(flags.get("replica_id") or env.get("POD_NAME"), pod)

    def router_secret_file(self):
        """(Secret name, key) of the file --cluster_redis_password_file names."""
        path = self.cluster_flags()["cluster_redis_password_file"]
        folder, key = os.path.split(path)
        (mount,) = [m for m in self.container["volumeMounts"] if m["mountPath"] == folder]
        self.assertIs(mount.get("readOnly"), True)
        self.assertNotIn("subPath", mount, "a subPath mount never sees a rotated Secret")
        (volume,) = [v for v in self.spec["volumes"] if v["name"] == mount["name"]]
        self.assertIn("secret", volume, "the Redis password comes from a Secret")
        secret = volume["secret"]
        items = {i["path"]: i["key"] for i in secret.get("items", [])} or {key: key}
        self.assertIn(key, items)
        self.assertFalse(secret.get("optional", False), "a missing Secret must keep the pod waiting")
        return secret["secretName"], items[key]

    def test_redis_password_is_a_mounted_secret_file(self):
        self.assertEqual(self.router_secret_file(), (REDIS_SECRET, REDIS_SECRET_KEY))
        # Not an environment variable (those show in the pod's spec of every describe).
        for entry in self.container.get("env", []):
            self.assertNotIn("secretKeyRef", entry.get("valueFrom", {}), entry["name"])

    # -- the overlay's Redis --
    def require_redis(self):
        if self.overlay not in REDIS_OVERLAYS:
            self.skipTest("uses a Redis outside the overlay")

    def redis(self):
        """(StatefulSet, pod spec, container, redis-server options) of the overlay's Redis."""
        statefulset = lib.find_one(self.objects, "StatefulSet", REDIS_NAME)
        spec = lib.pod_spec(statefulset)
        (container,) = spec["containers"]
        options, _ = redis_server_options(container)
        return statefulset, spec, container, options

    def redis_service(self):
        return lib.find_one(self.objects, "Service", REDIS_NAME)

    def test_no_redis_unless_the_overlay_runs_one(self):
        if self.overlay in REDIS_OVERLAYS:
            self.assertEqual(len(lib.find(self.objects, "StatefulSet", REDIS_NAME)), 1)
        else:
            self.assertEqual(lib.find(self.objects, "StatefulSet", REDIS_NAME), [])
            self.assertEqual(lib.find(self.objects, "Service", REDIS_NAME), [])

    def test_redis_statefulset(self):
        self.require_redis()
        statefulset, spec, container, options = self.redis()
        self.assertEqual(statefulset["metadata"]["namespace"], self.namespace())
        self.assertEqual(statefulset["spec"]["replicas"], 1, "the routers need one primary")
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        selector = statefulset["spec"]["selector"]["matchLabels"]
        self.assertTrue(all(labels.get(k) == v for k, v in selector.items()))
        governing = lib.find_one(self.objects, "Service", statefulset["spec"]["serviceName"])
        self.assertTrue(all(labels.get(k) == v for k, v in governing["spec"]["selector"].items()))
        self.assertIs(spec.get("automountServiceAccountToken"), False, "Redis needs no API token")
        # No persistence: the routers rebuild their state after an empty restart.
        self.assertEqual(options.get("save"), [""])
        self.assertEqual(options.get("appendonly"), ["no"])
        # Its working directory is an emptyDir; nothing else is writable.
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        (folder,) = options["dir"]
        self.assertIn("emptyDir", volumes[mounts[folder]["name"]])
        for mount in mounts.values():
            volume = volumes[mount["name"]]
            self.assertNotIn("hostPath", volume)
            self.assertNotIn("subPath", mount)
            if "secret" in volume or "configMap" in volume:
                self.assertIs(mount.get("readOnly"), True)
        # Memory: Redis refuses writes at --maxmemory (noeviction: never a lost leader key or
        # fence) before the container reaches its limit.
        resources = container["resources"]
        for key in ("cpu", "memory"):
            self.assertIn(key, resources["requests"])
            self.assertIn(key, resources["limits"])
        self.assertLessEqual(lib.parse_cpu(resources["requests"]["cpu"]),
                             lib.parse_cpu(resources["limits"]["cpu"]))
        self.assertEqual(options.get("maxmemory-policy"), ["noeviction"])
        (maxmemory,) = options["maxmemory"]
        self.assertLess(parse_memory(maxmemory), parse_memory(resources["limits"]["memory"]) * 0.9)

    def test_redis_security_context(self):
        self.require_redis()
        _, spec, container, _ = self.redis()
        pod = spec.get("securityContext", {})
        sc = container.get("securityContext", {})
        self.assertTrue(sc.get("runAsNonRoot") or pod.get("runAsNonRoot"))
        self.assertNotEqual(sc.get("runAsUser", pod.get("runAsUser", 0)), 0)
        self.assertNotEqual(sc.get("runAsGroup", pod.get("runAsGroup", 0)), 0)
        self.assertIs(sc.get("readOnlyRootFilesystem"), True)
        self.assertIs(sc.get("allowPrivilegeEscalation"), False)
        self.assertFalse(sc.get("privileged", False))
        self.assertEqual(sc["capabilities"].get("drop"), ["ALL"])
        self.assertNotIn("add", sc["capabilities"])
        self.assertEqual(sc.get("seccompProfile") or pod.get("seccompProfile"), {"type": "RuntimeDefault"})
        self.assertIsNotNone(pod.get("fsGroup"), "the mounted Secret must be readable by the redis user")
        self.assertFalse(spec.get("hostNetwork", False))

    def test_redis_probes_ping_with_the_password(self):
        self.require_redis()
        _, spec, container, options = self.redis()
        (port,) = options["port"]
        password_file = re.fullmatch(r"\$\(cat (\S+)\)", options["requirepass"][0]).group(1)
        for kind in ("readinessProbe", "livenessProbe"):
            with self.subTest(probe=kind):
                command = container[kind]["exec"]["command"]
                self.assertEqual(command[:2], ["/bin/sh", "-c"])
                script = command[2]
                self.assertIn(f'REDISCLI_AUTH="$(cat {password_file})"', script,
                              "an unauthenticated PING answers NOAUTH")
                self.assertRegex(script, rf"redis-cli -p {port} ping \| grep -qx PONG$")
                self.assertGreaterEqual(container[kind]["timeoutSeconds"], 1)
        liveness, readiness = container["livenessProbe"], container["readinessProbe"]
        self.assertGreater(liveness["failureThreshold"] * liveness["periodSeconds"],
                           readiness["failureThreshold"] * readiness["periodSeconds"])

    def test_routers_and_redis_share_the_password(self):
        self.require_redis()
        _, spec, container, options = self.redis()
        password_file = re.fullmatch(r"\$\(cat (\S+)\)", options["requirepass"][0]).group(1)
        folder, key = os.path.split(password_file)
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])} or {key: key}
        self.assertEqual((volume["secret"]["secretName"], items[key]), self.router_secret_file())

    def test_routers_dial_the_overlays_redis(self):
        self.require_redis()
        _, _, container, options = self.redis()
        service = self.redis_service()
        host, port = lib.split_host_port(self.cluster_flags()["cluster_redis"])
        namespace = self.namespace()
        name = service["metadata"]["name"]
        self.assertEqual(service["metadata"]["namespace"], namespace)
        self.assertIn(host, {name, f"{name}.{namespace}", f"{name}.{namespace}.svc",
                             f"{name}.{namespace}.svc.cluster.local"})
        self.assertNotEqual(service["spec"].get("clusterIP"), "None",
                            "a ClusterIP keeps one address across Redis restarts")
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
        ports = container_port_names(container)
        self.assertEqual(ports[service_port["targetPort"]], int(options["port"][0]))

    def test_redis_pods_are_nobody_elses(self):
        # The routers' Services, disruption budget and monitors never reach the Redis pod, and the
        # Redis Service never reaches a router.
        self.require_redis()
        statefulset, _, _, _ = self.redis()
        redis_labels = statefulset["spec"]["template"]["metadata"]["labels"]
        router_labels = self.workload["spec"]["template"]["metadata"]["labels"]

        def selects(selector, labels):
            return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
        for obj in self.objects:
            if obj["kind"] == "Service":
                selector = obj["spec"].get("selector", {})
            elif obj["kind"] == "PodDisruptionBudget":
                selector = obj["spec"]["selector"]["matchLabels"]
            elif obj["kind"] in ("ServiceMonitor", "PodMonitor"):
                selector = obj["spec"]["selector"]["matchLabels"]
            else:
                continue
            with self.subTest(kind=obj["kind"], name=obj["metadata"]["name"]):
                if obj["metadata"]["name"] == REDIS_NAME:
                    self.assertFalse(selects(selector, router_labels))
                    self.assertTrue(selects(selector, redis_labels))
                elif obj["kind"] == "ServiceMonitor":
                    # It selects Services: not the Redis one (no metrics port there).
                    self.assertFalse(selects(selector, self.redis_service()["metadata"]["labels"]))
                else:
                    self.assertFalse(selects(selector, redis_labels))


class OverlayTestBase:
    overlay = None
    # A kustomization folder relative to deploy/ (default: overlays/<overlay>).
    path = None

    @classmethod
    def setUpClass(cls):
        cls.objects = lib.render(cls.path) if cls.path else lib.render_overlay(cls.overlay)
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
        # The router's Services (a Redis of the overlay has its own, checked by ClusterChecks).
        services = [s for s in lib.find(self.objects, "Service")
                    if s["metadata"]["labels"].get("app.kubernetes.io/name") == lib.ROUTER_CONTAINER]
        self.assertTrue(services)
        self.assertEqual({s["metadata"]["name"] for s in lib.find(self.objects, "Service")}
                         - {s["metadata"]["name"] for s in services},
                         {REDIS_NAME} if self.overlay in REDIS_OVERLAYS else set())
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


class StandaloneClusterTest(ClusterChecks, StandaloneTest):
    overlay = "standalone-cluster"

    def test_everything_else_is_the_standalone_overlay(self):
        # standalone-cluster = standalone + components/cluster + components/redis: without the
        # cluster settings, the Redis and the cluster ConfigMap, every object is standalone's.
        def keyed(objects):
            return {(o["kind"], o["metadata"]["name"]): o for o in objects}
        ours = keyed(copy.deepcopy(self.objects))
        theirs = keyed(lib.render_overlay("standalone"))
        added = {k for k in ours if k not in theirs}
        self.assertEqual({k for k in added if k[0] != "ConfigMap"},
                         {("StatefulSet", REDIS_NAME), ("Service", REDIS_NAME)})
        (config_map,) = [k for k in added if k[0] == "ConfigMap"]
        self.assertTrue(hashed_name(config_map[1], CLUSTER_CONFIG_MAP))
        self.assertEqual(set(theirs) - set(ours), set())
        deployment = ours[("Deployment", "eldr-router")]
        spec = lib.pod_spec(deployment)
        (container,) = spec["containers"]
        spec["containers"][0], spec["volumes"] = without_cluster_settings(container, spec["volumes"])
        for key in theirs:
            with self.subTest(object=key):
                self.assertEqual(ours[key], theirs[key])
        # And what was added, in order, at the end.
        self.assertEqual([a for a in self.container["args"] if is_cluster_arg(a)],
                         self.container["args"][-3:])
        self.assertEqual([e["name"] for e in self.container["env"]][-3:], list(CLUSTER_ENV))


class SidecarTest(ClusterChecks, OverlayTestBase, unittest.TestCase):
    overlay = "sidecar"

    def test_native_sidecar_of_the_prefill_pod(self):
        self.assertEqual(self.workload["metadata"]["name"], "prefill")
        init_names = [c["name"] for c in self.spec.get("initContainers", [])]
        self.assertIn(lib.ROUTER_CONTAINER, init_names)
        self.assertEqual(self.container["restartPolicy"], "Always",
                         "a native sidecar starts before the engine and stops after it")
        self.assertEqual([c["name"] for c in self.spec["containers"]], ["engine"])
        self.assertEqual(lib.find(self.objects, "Deployment", "eldr-router"), [])
        # No Service reaches the routers (only the Redis of components/redis has one).
        labels = self.workload["spec"]["template"]["metadata"]["labels"]
        for service in lib.find(self.objects, "Service"):
            self.assertEqual(service["metadata"]["name"], REDIS_NAME)
            self.assertFalse(all(labels.get(k) == v for k, v in service["spec"]["selector"].items()))

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
        # the probes (exec instead of kubelet gRPC) must stay the same. Both share a Redis: the
        # standalone overlay to compare with is standalone-cluster (its ConfigMap's hash differs).
        _, _, standalone = lib.router_workload(lib.render_overlay("standalone-cluster"))
        standalone = without_name_hashes(standalone)
        for key in ("image", "command", "env", "resources", "lifecycle"):
            self.assertEqual(without_name_hashes(self.container[key]), standalone[key], key)
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


class ExistingRedisExampleTest(ClusterChecks, OverlayTestBase, unittest.TestCase):
    """deploy/examples/existing-redis: the standalone router against a Redis of the user's, by
    address (components/cluster alone)."""
    overlay = "examples/existing-redis"
    path = "examples/existing-redis"

    def test_the_address_is_the_examples(self):
        with open(os.path.join(lib.DEPLOY_DIR, self.path, "kustomization.yaml")) as f:
            kustomization = yaml.safe_load(f)
        (generator,) = kustomization["configMapGenerator"]
        literals = dict(item.split("=", 1) for item in generator["literals"])
        flags = self.cluster_flags()
        self.assertEqual(flags["cluster_redis"], literals["redis"])
        self.assertEqual(flags["cluster_name"], literals["name"])
        self.assertNotIn(lib.split_host_port(flags["cluster_redis"])[0], {REDIS_NAME, "localhost", "127.0.0.1"})
        # Otherwise it is standalone-cluster without its Redis.
        _, spec, container = lib.router_workload(lib.render_overlay("standalone-cluster"))
        self.assertEqual(without_name_hashes(self.container), without_name_hashes(container))
        self.assertEqual(without_name_hashes(self.spec), without_name_hashes(spec))


class ClusterComponentTest(unittest.TestCase):
    """components/cluster on workloads of other shapes (rendered from a temporary kustomization)."""

    def render(self, deployments):
        folder = tempfile.mkdtemp(prefix="eldr-kustomize-")
        self.addCleanup(shutil.rmtree, folder, True)
        with open(os.path.join(folder, "deployments.yaml"), "w") as f:
            yaml.safe_dump_all(deployments, f)
        component = os.path.relpath(os.path.join(lib.DEPLOY_DIR, "components", "cluster"), folder)
        with open(os.path.join(folder, "kustomization.yaml"), "w") as f:
            yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": ["deployments.yaml"], "components": [component],
                "configMapGenerator": [{"name": CLUSTER_CONFIG_MAP,
                                        "literals": ["redis=redis.example:6379", "name=test"]}]}, f)
        return subprocess.run([lib.KUBECTL, "kustomize", folder], capture_output=True, text=True,
                              timeout=120)

    @staticmethod
    def deployment(name, containers, annotation=None, init_containers=()):
        metadata = {"name": name}
        if annotation:
            metadata["annotations"] = {ROUTER_ANNOTATION: annotation}
        def container(n):
            return {"name": n, "image": "x", "args": ["--a=b"], "env": [{"name": "A", "value": "1"}],
                    "volumeMounts": []}
        spec = {"containers": [container(n) for n in containers], "volumes": []}
        if init_containers:
            spec["initContainers"] = [container(n) for n in init_containers]
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata,
                "spec": {"selector": {"matchLabels": {"app": name}},
                         "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}}

    def test_patches_the_annotated_workloads_only(self):
        result = self.render([
            self.deployment("standalone", ["eldr-router", "other"], "container"),
            self.deployment("sidecar", ["engine"], "init-container", ["eldr-router", "fetch"]),
            self.deployment("plain", ["eldr-router"])])
        self.assertEqual(result.returncode, 0, result.stderr)
        objects = {o["metadata"]["name"]: o for o in yaml.safe_load_all(result.stdout) if o}
        def args(name, field, index):
            return lib.pod_spec(objects[name])[field][index]["args"]
        self.assertIn("--cluster_redis=$(ELDR_CLUSTER_REDIS)", args("standalone", "containers", 0))
        self.assertEqual(args("standalone", "containers", 1), ["--a=b"])
        self.assertIn("--cluster_redis=$(ELDR_CLUSTER_REDIS)", args("sidecar", "initContainers", 0))
        self.assertEqual(args("sidecar", "initContainers", 1), ["--a=b"])
        self.assertEqual(args("sidecar", "containers", 0), ["--a=b"])
        self.assertEqual(args("plain", "containers", 0), ["--a=b"])

    def test_refuses_a_pod_laid_out_otherwise(self):
        # The annotation says containers[0], but the router is second: rendering fails rather
        # than patching the engine.
        result = self.render([self.deployment("wrong", ["engine", "eldr-router"], "container")])
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("testing value /spec/template/spec/containers/0/name failed", result.stderr)


class OverlaysTest(unittest.TestCase):
    def test_every_overlay_folder_is_tested(self):
        folders = sorted(os.listdir(os.path.join(lib.DEPLOY_DIR, "overlays")))
        self.assertEqual(folders, sorted(lib.OVERLAYS))

    def test_replicas_share_a_redis_where_intended(self):
        # standalone and tls stay single-replica-state routers; standalone-cluster and sidecar
        # share a Redis, and run one.
        for overlay in lib.OVERLAYS:
            with self.subTest(overlay=overlay):
                objects = lib.render_overlay(overlay)
                _, _, container = lib.router_workload(objects)
                flags = lib.flag_values(container["args"])
                self.assertEqual("cluster_redis" in flags, overlay in CLUSTER_OVERLAYS)
                self.assertEqual(bool(lib.find(objects, "StatefulSet", REDIS_NAME)),
                                 overlay in REDIS_OVERLAYS)


if __name__ == "__main__":
    unittest.main(verbosity=2)
