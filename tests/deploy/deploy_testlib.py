"""Shared helpers of the packaging tests (tests/deploy): rendering the Kustomize overlays, running a
container of a rendered pod the way the kubelet would (on loopback, in a temporary directory), gRPC
health checks, metric scrapes and the PromQL metric names of the monitoring files.

Run with Debian's /usr/bin/python3 (python3-yaml, python3-grpcio, python3-protobuf).
"""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

SOURCE_DIR = os.environ.get("ELDR_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
BIN_DIR = os.path.abspath(os.environ.get("ELDR_BIN_DIR") or os.path.join(SOURCE_DIR, "build", "bin"))
DEPLOY_DIR = os.path.join(SOURCE_DIR, "deploy")
MONITORING_DIR = os.path.join(DEPLOY_DIR, "monitoring")
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"

OVERLAYS = ("standalone", "sidecar", "tls", "standalone-cluster")
ROUTER_CONTAINER = "eldr-router"
# Where the image puts its binaries (docker/Dockerfile); tests run the build's instead.
IMAGE_BIN_DIR = "/usr/local/bin"
# The daemon's listener flags, each taking host:port.
LISTEN_FLAGS = ("listen", "admin_listen", "metrics_listen")

# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

_render_cache = {}


def render(path):
    """Objects of `kubectl kustomize <path>` (a folder relative to deploy/ or absolute), as dicts."""
    full = path if os.path.isabs(path) else os.path.join(DEPLOY_DIR, path)
    if full not in _render_cache:
        result = subprocess.run([KUBECTL, "kustomize", full], capture_output=True, text=True,
                                timeout=120)
        if result.returncode != 0:
            raise AssertionError(f"kubectl kustomize {full} failed:\n{result.stderr}")
        _render_cache[full] = [o for o in yaml.safe_load_all(result.stdout) if o]
    return _render_cache[full]


def render_overlay(name):
    return render(os.path.join("overlays", name))


def find(objects, kind, name=None):
    """The objects of `kind` (and `name`); a list."""
    return [o for o in objects
            if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]


def find_one(objects, kind, name):
    found = find(objects, kind, name)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} {name}, found {len(found)}")
    return found[0]


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def all_containers(spec):
    """Containers and init containers (native sidecars are init containers) of a pod spec."""
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def router_workload(objects):
    """(workload, pod spec, eldr-router container) of the one workload that runs the router."""
    hits = []
    for workload in find(objects, "Deployment") + find(objects, "StatefulSet"):
        spec = pod_spec(workload)
        for container in all_containers(spec):
            if container["name"] == ROUTER_CONTAINER:
                hits.append((workload, spec, container))
    if len(hits) != 1:
        raise AssertionError(f"expected one workload running {ROUTER_CONTAINER}, found {len(hits)}")
    return hits[0]


def flag_values(args):
    """--name=value arguments as a dict (the daemon's flags all use the = form in the manifests)."""
    values = {}
    for arg in args:
        match = re.fullmatch(r"--([A-Za-z0-9_]+)=(.*)", arg)
        if not match:
            raise AssertionError(f"argument {arg!r} is not of the form --flag=value")
        values[match.group(1)] = match.group(2)
    return values


def config_map_key(objects, ref):
    """The value of a configMapKeyRef ({name, key}) among the rendered objects."""
    config_map = find_one(objects, "ConfigMap", ref["name"])
    data = config_map.get("data", {})
    if ref["key"] not in data:
        raise AssertionError(f"ConfigMap {ref['name']} has no key {ref['key']}")
    return data[ref["key"]]


def container_env(objects, container, pod_name="pod-name", namespace="namespace"):
    """{name: value} of a container's environment as the kubelet resolves it: values, keys of the
    rendered ConfigMaps, the downward API's metadata.name and metadata.namespace, and limits.cpu
    (rounded up, as the kubelet does). A later entry of the same name wins. Raises for a source
    it does not know."""
    env = {}
    limits = container.get("resources", {}).get("limits", {})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand_env(var["value"], env)
            continue
        source = var.get("valueFrom", {})
        if "configMapKeyRef" in source:
            env[var["name"]] = config_map_key(objects, source["configMapKeyRef"])
        elif "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            values = {"metadata.name": pod_name, "metadata.namespace": namespace}
            if field not in values:
                raise AssertionError(f"unsupported fieldRef {field}")
            env[var["name"]] = values[field]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            if ref["resource"] != "limits.cpu" or "cpu" not in limits:
                raise AssertionError(f"unsupported resourceFieldRef {ref}")
            divisor = parse_cpu(ref.get("divisor", "1"))
            env[var["name"]] = str(math.ceil(parse_cpu(limits["cpu"]) / divisor))
        else:
            raise AssertionError(f"unsupported env source in {var}")
    return env


def expand_env(text, env):
    """Kubernetes' expansion of command, args and env values: $(NAME) becomes the variable's value
    when it is defined, and stays as written otherwise; $$ is a literal $."""
    def one(match):
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def env_references(text):
    """Names of the variables $(NAME) refers to in `text` (escaped $$( ) excepted)."""
    return re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text)


def resolved_flags(objects, container, pod_name="pod-name", namespace="namespace"):
    """flag_values of the container's arguments after the kubelet's $(VAR) expansion."""
    env = container_env(objects, container, pod_name, namespace)
    return flag_values([expand_env(arg, env) for arg in container.get("args", [])])


def service_account_name(spec):
    """The ServiceAccount a pod spec runs as (Kubernetes' default: "default")."""
    return spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"


def token_automounted(objects, spec, namespace):
    """Whether the kubelet mounts the ServiceAccount token into the pod: the pod's
    automountServiceAccountToken when set, else the ServiceAccount's, else true."""
    if "automountServiceAccountToken" in spec:
        return spec["automountServiceAccountToken"] is not False
    accounts = [o for o in find(objects, "ServiceAccount", service_account_name(spec))
                if o["metadata"].get("namespace") == namespace]
    if accounts and "automountServiceAccountToken" in accounts[0]:
        return accounts[0]["automountServiceAccountToken"] is not False
    return True


# Kubernetes label selector syntax (equality- and set-based), as --decode_selector takes it.
_SELECTOR_KEY = r"(?:[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_SELECTOR_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_REQUIREMENTS = (
    re.compile(rf"(?P<key>{_SELECTOR_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>{_SELECTOR_VALUE})"),
    re.compile(rf"(?P<key>{_SELECTOR_KEY})\s+(?P<op>in|notin)\s+\((?P<values>[^)]*)\)"),
    re.compile(rf"(?P<op>!?)\s*(?P<key>{_SELECTOR_KEY})"),
)


def parse_label_selector(text):
    """[(key, operator, values)] of a label selector string; operator is one of =, !=, in, notin,
    exists, !exists. Raises AssertionError for text the API server would refuse."""
    parts = re.findall(r"(?:[^,(]|\([^)]*\))+", text)
    if not text.strip() or ",".join(parts) != text:
        raise AssertionError(f"malformed label selector {text!r}")
    requirements = []
    for part in (p.strip() for p in parts):
        match = next((m for m in (r.fullmatch(part) for r in _REQUIREMENTS) if m), None)
        if not match:
            raise AssertionError(f"malformed requirement {part!r} in label selector {text!r}")
        key, op = match.group("key"), match.group("op")
        if op in ("", "!"):
            requirements.append((key, "!exists" if op else "exists", ()))
        elif op in ("in", "notin"):
            values = tuple(v.strip() for v in match.group("values").split(","))
            for value in values:
                if not re.fullmatch(_SELECTOR_VALUE, value):
                    raise AssertionError(f"bad value {value!r} in label selector {text!r}")
            requirements.append((key, op, values))
        else:
            requirements.append((key, "!=" if op == "!=" else "=", (match.group("value"),)))
    return requirements


def selector_matches(text, labels):
    """Whether a pod with `labels` is selected by label selector `text`."""
    for key, op, values in parse_label_selector(text):
        present = key in labels
        if op == "=" and labels.get(key) != values[0]:
            return False
        if op == "!=" and present and labels[key] == values[0]:
            return False
        if op == "in" and labels.get(key) not in values:
            return False
        if op == "notin" and present and labels[key] in values:
            return False
        if op == "exists" and not present:
            return False
        if op == "!exists" and present:
            return False
    return True


def load_example(name):
    """The objects of deploy/examples/<name> (plain manifests, not a Kustomization)."""
    with open(os.path.join(DEPLOY_DIR, "examples", name)) as f:
        return [o for o in yaml.safe_load_all(f) if o]


def split_host_port(text):
    match = re.fullmatch(r"(\[[^\]]*\]|[^:]*):(\d+)", text)
    if not match:
        raise AssertionError(f"{text!r} is not host:port")
    return match.group(1), int(match.group(2))


# ---------------------------------------------------------------------------------------------
# Ports, processes, health, scrapes
# ---------------------------------------------------------------------------------------------

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def encode_health_request(service):
    data = service.encode()
    if not data:
        return b""
    return b"\x0a" + _varint(len(data)) + data


def _varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_health_response(data):
    """ServingStatus of a HealthCheckResponse (0 UNKNOWN, 1 SERVING, 2 NOT_SERVING, 3 SERVICE_UNKNOWN)."""
    status, pos = 0, 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
            if field == 1:
                status = value
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        else:
            raise ValueError(f"unexpected wire type {wire} in HealthCheckResponse")
    return status


def _read_varint(data, pos):
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


SERVING = 1
NOT_SERVING = 2


def grpc_health(address, service="", timeout=2.0, credentials=None):
    """What a kubelet gRPC probe sees: the ServingStatus, or an exception text when the call fails."""
    import grpc  # python3-grpcio
    channel = (grpc.secure_channel(address, credentials) if credentials
               else grpc.insecure_channel(address))
    try:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        response = check(encode_health_request(service), timeout=timeout)
        return decode_health_response(response)
    except grpc.RpcError as error:
        return f"{error.code().name}: {error.details()}"
    finally:
        channel.close()


def http_get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode()


def parse_exposition(text):
    """{sample name: [(labels dict, value)]} of a Prometheus text page; raises on a malformed line."""
    samples = {}
    line_re = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\d+)?$')
    label_re = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = line_re.match(line)
        if not match:
            raise AssertionError(f"malformed exposition line: {line!r}")
        labels = {}
        body = match.group(3) or ""
        pos = 0
        while pos < len(body):
            label = label_re.match(body, pos)
            if not label:
                raise AssertionError(f"malformed labels in: {line!r}")
            labels[label.group(1)] = label.group(2)
            pos = label.end()
        samples.setdefault(match.group(1), []).append((labels, float(match.group(4))))
    return samples


def wait_until(predicate, timeout, interval=0.1, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last is True:
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last})")


# ---------------------------------------------------------------------------------------------
# Running a container of a rendered pod like the kubelet would, on loopback
# ---------------------------------------------------------------------------------------------

def write_projected_volume(directory, files):
    """Writes `files` {name: bytes} the way the kubelet's atomic writer lays out ConfigMap and
    Secret volumes: the data lives in a timestamped folder, `..data` links to it and each key is a
    link through `..data`. update_projected_volume swaps `..data` atomically, like a ConfigMap edit."""
    os.makedirs(directory, exist_ok=True)
    _write_generation(directory, files)
    for name in files:
        os.symlink(os.path.join("..data", name), os.path.join(directory, name))


def update_projected_volume(directory, files):
    old = os.readlink(os.path.join(directory, "..data"))
    _write_generation(directory, files)
    shutil.rmtree(os.path.join(directory, old))


def _write_generation(directory, files):
    generation = tempfile.mkdtemp(prefix="..%s." % time.strftime("%Y_%m_%d_%H_%M_%S"), dir=directory)
    for name, data in files.items():
        with open(os.path.join(generation, name), "wb") as out:
            out.write(data)
    link = os.path.join(directory, "..data_tmp")
    os.symlink(os.path.basename(generation), link)
    os.rename(link, os.path.join(directory, "..data"))


class PodContainer:
    """One container of a rendered pod, run as a local process.

    Like the kubelet: each volume is materialised at its mount path (below a temporary root);
    environment variables are resolved (values and resourceFieldRef); command and args are used
    as written, with only these rewrites: image paths of binaries point at the build's bin folder,
    mount paths point below the temporary root, and every host:port the daemon listens on becomes
    127.0.0.1 with a free port (the same mapping applies to the probes).

    `extra_args` are appended verbatim after the container's: what the kubelet gives a pod that a
    local process cannot get the same way. Kubernetes discovery reads the in-cluster service-account
    mount at a fixed path (/var/run/secrets/kubernetes.io/serviceaccount), so a test points it at a
    fake API server with --kubeconfig=<file> instead.

    `pod_name` and `namespace` are what the downward API gives (metadata.name, metadata.namespace).
    `addresses` maps a Service's host:port as the container dials it (after $(VAR) expansion,
    e.g. eldr-redis:6379) to where the test serves it on loopback; a --cluster_redis that is not
    loopback after the mapping is refused, like a URL leaving loopback.
    """

    def __init__(self, objects, spec, container, secrets=None, rewrite_files=None, extra_args=(),
                 pod_name="eldr-router-test-0", namespace="default", addresses=None):
        self.objects = objects
        self.spec = spec
        self.container = container
        self.secrets = secrets or {}
        self.extra_args = list(extra_args)
        self.pod_name = pod_name
        self.namespace = namespace
        self.addresses = dict(addresses or {})
        self.root = tempfile.mkdtemp(prefix="eldr-pod-")
        self.mounts = {}    # mountPath -> local folder
        self.ports = {}     # container port -> local port
        self.process = None
        self.log_path = os.path.join(self.root, "container.log")
        self._materialise_volumes(rewrite_files or {})
        self._map_ports()

    # -- volumes --
    def _volume(self, name):
        for volume in self.spec.get("volumes", []):
            if volume["name"] == name:
                return volume
        raise AssertionError(f"volume {name} mounted by {self.container['name']} is not in the pod")

    def _materialise_volumes(self, rewrite_files):
        for mount in self.container.get("volumeMounts", []):
            if "subPath" in mount:
                raise AssertionError(f"{mount['name']} is mounted with subPath: it would never be "
                                     "updated when its ConfigMap or Secret changes")
            local = os.path.join(self.root, mount["mountPath"].lstrip("/"))
            volume = self._volume(mount["name"])
            if "configMap" in volume:
                config_map = find_one(self.objects, "ConfigMap", volume["configMap"]["name"])
                files = {k: v.encode() for k, v in config_map.get("data", {}).items()}
            elif "secret" in volume:
                name = volume["secret"]["secretName"]
                if name not in self.secrets:
                    raise AssertionError(f"the test provides no Secret {name}")
                files = dict(self.secrets[name])
            elif "emptyDir" in volume:
                files = None
            else:
                raise AssertionError(f"unsupported volume type in {volume}")
            source = volume.get("configMap") or volume.get("secret") or {}
            if files is not None and "items" in source:
                # Only the listed keys, at their paths (a missing key fails the pod's start).
                projected = {}
                for item in source["items"]:
                    if item["key"] not in files:
                        raise AssertionError(f"volume {mount['name']}: no key {item['key']}")
                    projected[item["path"]] = files[item["key"]]
                files = projected
            if files is None:
                os.makedirs(local, exist_ok=True)
            else:
                for name, rewrite in rewrite_files.items():
                    if name in files:
                        files[name] = rewrite(files[name])
                for name, data in files.items():
                    if re.search(rb"https?://(?!127\.0\.0\.1[:/])", data):
                        raise AssertionError(f"{name} would make the daemon leave loopback: "
                                             "rewrite its URLs (rewrite_files)")
                write_projected_volume(local, files)
            self.mounts[mount["mountPath"]] = local

    def local_path(self, path):
        """The local path of a path inside the container."""
        for mount_path in sorted(self.mounts, key=len, reverse=True):
            if path == mount_path or path.startswith(mount_path.rstrip("/") + "/"):
                return self.mounts[mount_path] + path[len(mount_path):]
        if path.startswith(IMAGE_BIN_DIR + "/"):
            return os.path.join(BIN_DIR, os.path.basename(path))
        return path

    # -- ports --
    def _map_ports(self):
        flags = flag_values(self.container.get("args", []))
        for flag in LISTEN_FLAGS:
            if flag in flags and flags[flag]:
                _, port = split_host_port(flags[flag])
                self.ports.setdefault(port, free_port())

    def listen_port(self, flag):
        """Local port of the listener of --<flag>."""
        _, port = split_host_port(flag_values(self.container["args"])[flag])
        return self.ports[port]

    def rewrite(self, text):
        def host_port(match):
            port = int(match.group(2))
            if port not in self.ports:
                return match.group(0)
            return f"127.0.0.1:{self.ports[port]}"
        text = re.sub(r"(0\.0\.0\.0|127\.0\.0\.1|localhost|\[::\]):(\d+)\b", host_port, text)
        # Paths: anything after `=` or a whole argument that is an absolute container path.
        def path(match):
            return match.group(1) + self.local_path(match.group(2))
        return re.sub(r"(^|=)(/[^\s,]*)", path, text)

    def map_addresses(self, text):
        for address, local in self.addresses.items():
            text = re.sub(rf"(?<![\w.-]){re.escape(address)}(?![\w.:-])", local, text)
        return text

    def command_line(self):
        env = self.container_env()
        line = [self.rewrite(self.map_addresses(expand_env(arg, env))) for arg in
                list(self.container.get("command", [])) + list(self.container.get("args", []))]
        line += self.extra_args
        for arg in line:
            if re.search(r"https?://(?!127\.0\.0\.1[:/])", arg):
                raise AssertionError(f"argument {arg!r} would make the daemon leave loopback")
            redis = re.fullmatch(r"--cluster_redis=(.*)", arg)
            if redis and redis.group(1) and not redis.group(1).startswith("127.0.0.1:"):
                raise AssertionError(f"argument {arg!r} would make the daemon leave loopback: "
                                     "map the address (addresses=)")
        return line

    def container_env(self):
        """The container's own variables, as the kubelet resolves them."""
        return container_env(self.objects, self.container, self.pod_name, self.namespace)

    def environment(self):
        env = {"PATH": "/usr/bin:/bin", "HOME": self.root}
        env.update(self.container_env())
        # Not part of the container: the sanitizer runtimes' settings of a sanitizer build's test run.
        for name in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS", "TSAN_OPTIONS"):
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    # -- lifecycle --
    def start(self):
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.command_line(), env=self.environment(), cwd=self.root,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        log.close()
        return self

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout=20.0):
        """Signals the process; returns its exit code (kills it when it outlives `timeout`)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"{self.container['name']} did not exit within {timeout} s "
                                     f"of signal {sig}\n{self.log()}")
        return self.process.returncode

    def cleanup(self):
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- probes --
    def run_probe(self, probe):
        """One probe attempt, as the kubelet makes it: True, or the reason it failed."""
        timeout = float(probe.get("timeoutSeconds", 1))
        if "grpc" in probe:
            port = probe["grpc"]["port"]
            if port not in self.ports:
                return f"gRPC probe port {port} is not a port the daemon listens on {sorted(self.ports)}"
            status = grpc_health(f"127.0.0.1:{self.ports[port]}", probe["grpc"].get("service", ""),
                                 timeout)
            return True if status == SERVING else f"health status {status}"
        if "exec" in probe:
            command = [self.rewrite(arg) for arg in probe["exec"]["command"]]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                        env=self.environment(), cwd=self.root)
            except subprocess.TimeoutExpired:
                return f"exec probe timed out after {timeout} s"
            if result.returncode == 0:
                return True
            return f"exit {result.returncode}: {result.stderr.strip()}"
        raise AssertionError(f"unsupported probe {probe}")

    def pass_probe(self, kind):
        """Runs probe `kind` (startupProbe, ...) until it succeeds, within the time the kubelet would
        allow before acting on it (failureThreshold x periodSeconds, at least one attempt). Attempts
        come faster than periodSeconds to keep the test short. Returns the seconds it took."""
        probe = self.container[kind]
        budget = float(probe.get("failureThreshold", 3)) * float(probe.get("periodSeconds", 10))
        start = time.monotonic()
        last = None
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"{self.container['name']} exited with {self.process.returncode} "
                                     f"before its {kind} passed\n{self.log()}")
            last = self.run_probe(probe)
            if last is True:
                return time.monotonic() - start
            if time.monotonic() - start > budget:
                raise AssertionError(f"{kind} still failing after {budget} s: {last}\n{self.log()}")
            time.sleep(0.2)


class ShellPodContainer(PodContainer):
    """A container whose command is a shell script (the Redis of deploy/components/redis), run like
    PodContainer runs the router: its volumes materialised below a temporary root, its container
    ports mapped to free loopback ports. The script and its exec probes are rewritten as text:
    every mount path becomes its local folder, every `--port N` / `-p N` of a declared container
    port the local port, and `local_args` (e.g. --bind 127.0.0.1: in a pod Redis listens on the pod
    IP, here on loopback only) are appended to the script's last line, the exec'd server's."""

    def __init__(self, objects, spec, container, secrets=None, local_args=(), **kwargs):
        self.local_args = list(local_args)
        super().__init__(objects, spec, container, secrets=secrets, **kwargs)

    def _map_ports(self):
        for port in self.container.get("ports", []):
            self.ports.setdefault(port["containerPort"], free_port())

    def port(self, name):
        """The local port of the container port named `name`."""
        (number,) = [p["containerPort"] for p in self.container["ports"] if p["name"] == name]
        return self.ports[number]

    def rewrite(self, text):
        for mount_path in sorted(self.mounts, key=len, reverse=True):
            text = re.sub(rf"{re.escape(mount_path.rstrip('/'))}(?=/|\b|$)", self.mounts[mount_path], text)

        def port(match):
            number = int(match.group(3))
            return match.group(1) + match.group(2) + str(self.ports.get(number, number))
        return re.sub(r"(--port|-p)(\s+|=)(\d+)\b", port, text)

    def command_line(self):
        line = [self.rewrite(arg) for arg in
                list(self.container.get("command", [])) + list(self.container.get("args", []))]
        if self.local_args:
            line[-1] = line[-1].rstrip() + " " + " ".join(self.local_args)
        return line


def parse_cpu(text):
    text = str(text)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@contextlib.contextmanager
def running(pod_container):
    try:
        yield pod_container.start()
    finally:
        pod_container.cleanup()


def start_with_retries(make, attempts=3):
    """Starts the container made by `make()`; a port taken between probing and binding (tests run in
    parallel) makes the daemon exit at once, so that case is retried with new ports."""
    for attempt in range(attempts):
        container = make().start()
        time.sleep(0.3)
        if container.process.poll() is None or attempt == attempts - 1:
            return container
        log = container.log()
        container.cleanup()
        if "address" not in log.lower() and "bind" not in log.lower():
            raise AssertionError(f"daemon exited at start:\n{log}")
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Decode workers' metrics pages, faked on loopback
# ---------------------------------------------------------------------------------------------

class FakeVllmMetrics:
    """An HTTP server on 127.0.0.1 serving each worker's Prometheus page the way vLLM does
    (`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` with a
    model_name label), at /<worker id>/metrics. `load[worker] = (running, waiting, kv_usage)`."""

    def __init__(self, workers, running=3, waiting=1, kv_usage=0.5):
        import http.server
        import threading
        self.default = (running, waiting, kv_usage)
        self.load = {w: self.default for w in workers}
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                worker = self.path.strip("/").split("/")[0]
                if worker not in fake.load or not self.path.endswith("/metrics"):
                    self.send_error(404)
                    return
                body = fake.page(*fake.load[worker]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the daemon stopped mid-scrape (shutdown)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def page(running, waiting, kv_usage):
        labels = 'engine="0",model_name="deepseek-ai/DeepSeek-V2-Lite"'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {float(kv_usage)}\n")

    def url(self, worker):
        return f"http://127.0.0.1:{self.port}{self.path(worker)}"

    @property
    def port(self):
        return self.server.server_address[1]

    def path(self, worker):
        return f"/{worker}/metrics"

    def add(self, worker):
        """Serves a page for one more worker (with the load given at construction)."""
        self.load.setdefault(worker, self.default)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------------------------
# Kubernetes discovery: the decode pods, on a stand-in API server
# ---------------------------------------------------------------------------------------------

DISCOVERY_TEST_DIR = os.path.join(SOURCE_DIR, "tests", "discovery")
# The example decode pool (deploy/examples): what the overlays' routers are meant to discover.
DECODE_EXAMPLE = "decode-statefulset.yaml"
# The pod annotation that overrides --worker_metrics_path (deploy/README.md).
METRICS_PATH_ANNOTATION = "eldr.io/metrics-path"

_kube_tls_dir = None


def kube_testlib():
    """tests/discovery/kube_testlib.py (the stand-in API server and its control API)."""
    if DISCOVERY_TEST_DIR not in sys.path:
        sys.path.insert(0, DISCOVERY_TEST_DIR)
    import kube_testlib as module  # noqa: E402  (found through the path just set)
    return module


def _shared_kube_tls_dir():
    """One CA and server certificate for every stand-in of this process (made once by openssl)."""
    global _kube_tls_dir
    if _kube_tls_dir is None:
        import atexit
        _kube_tls_dir = tempfile.mkdtemp(prefix="eldr-kube-tls-")
        atexit.register(shutil.rmtree, _kube_tls_dir, True)
    return _kube_tls_dir


class DecodePods:
    """The Kubernetes API server a discovering router pod reaches, on loopback: the stand-in of
    tests/discovery (HTTPS with its own CA, a bearer token, list and watch of pods), holding the
    decode pool of deploy/examples/decode-statefulset.yaml in the router's namespace.

    Each pod is the example's pod template as the StatefulSet controller makes it (its labels,
    annotations and named container ports; name <statefulset>-<ordinal>), with IP 127.0.0.1. The
    container ports named by `port_names` (the router's --worker_port and --worker_metrics_port)
    are `metrics`' port (a FakeVllmMetrics), and each pod's eldr.io/metrics-path annotation is its
    page there: vLLM serves /metrics on its API port, here one server holds every pod's page.

    `kubeconfig` is the file for the daemon's --kubeconfig. In a pod the daemon reads the mounted
    service account instead (token, CA, namespace); the kubeconfig carries the same three: the
    stand-in's CA, a token file, and the router's namespace as its context's namespace.

    Pod changes go through `control` (kube_testlib.Control) or the methods below."""

    def __init__(self, namespace, metrics, port_names=("http",), token="eldr-router-sa-token"):
        self.namespace = namespace
        self.metrics = metrics
        (statefulset,) = find(load_example(DECODE_EXAMPLE), "StatefulSet")
        self.prefix = statefulset["metadata"]["name"]
        self.replicas = statefulset["spec"]["replicas"]
        self.template = statefulset["spec"]["template"]
        ports = [p for c in self.template["spec"]["containers"] for p in c.get("ports", [])]
        for name in port_names:
            if name not in {p.get("name") for p in ports}:
                raise AssertionError(f"the example decode pods have no container port named {name}")
        self.ports = [{"name": p["name"],
                       "containerPort": metrics.port if p.get("name") in port_names else p["containerPort"],
                       "protocol": p.get("protocol", "TCP")} for p in ports]
        self.container = self.template["spec"]["containers"][0]["name"]
        self.kube = kube_testlib().FakeKubeApiServer(token=token, tls_dir=_shared_kube_tls_dir())
        self.kube.start()
        self.control = self.kube.control
        self.kubeconfig = os.path.join(self.kube.workdir, "router-kubeconfig")
        with open(self.kubeconfig, "w") as f:
            yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "router",
                "clusters": [{"name": "stand-in", "cluster": {
                    "server": self.kube.server, "certificate-authority": self.kube.ca_file}}],
                "users": [{"name": "eldr-router", "user": {"tokenFile": self.kube.token_file}}],
                "contexts": [{"name": "router", "context": {
                    "cluster": "stand-in", "user": "eldr-router", "namespace": namespace}}],
            }, f)

    def names(self):
        """The example's pod names: decode-0 .. decode-<replicas - 1>."""
        return [f"{self.prefix}-{i}" for i in range(self.replicas)]

    def pod_fields(self, name, ready=True):
        annotations = dict(self.template["metadata"].get("annotations") or {})
        annotations[METRICS_PATH_ANNOTATION] = self.metrics.path(name)
        return {"ip": "127.0.0.1", "labels": dict(self.template["metadata"]["labels"]),
                "annotations": annotations, "ports": self.ports, "container": self.container,
                "ready": ready}

    def create(self, name, ready=True):
        self.metrics.add(name)
        return self.control.create_pod(name, namespace=self.namespace,
                                       **self.pod_fields(name, ready))

    def create_pool(self):
        """The StatefulSet's pods, Running and Ready."""
        for name in self.names():
            self.metrics.add(name)
        self.control.bulk_create([dict(self.pod_fields(name), name=name, namespace=self.namespace)
                                  for name in self.names()])
        return self.names()

    def set_ready(self, name, ready):
        return self.control.patch_pod(name, namespace=self.namespace, ready=ready)

    def terminate(self, name):
        return self.control.terminate_pod(name, namespace=self.namespace)

    def delete(self, name):
        return self.control.delete_pod(name, namespace=self.namespace)

    def address(self):
        """What Route answers for every pod: podIP:<the port named --worker_port>."""
        return f"127.0.0.1:{self.metrics.port}"

    def close(self):
        self.kube.stop()


# ---------------------------------------------------------------------------------------------
# Monitoring files
# ---------------------------------------------------------------------------------------------

def load_rules():
    """The PrometheusRule object of deploy/monitoring."""
    with open(os.path.join(MONITORING_DIR, "prometheusrule.yaml")) as f:
        return yaml.safe_load(f)


def load_dashboard():
    with open(os.path.join(MONITORING_DIR, "eldr-router-dashboard.json")) as f:
        return json.load(f)


def dashboard_panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        for inner in panel.get("panels", []):
            yield inner


def dashboard_exprs(dashboard):
    """(panel title, expr) of every query of the dashboard."""
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def rule_exprs(rule_object):
    for group in rule_object["spec"]["groups"]:
        for rule in group["rules"]:
            yield rule.get("alert") or rule.get("record"), rule["expr"]


# Series Prometheus makes itself rather than scraping them.
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}

_PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right", "and",
    "or", "unless", "bool", "offset", "rate", "irate", "increase", "delta", "idelta", "deriv",
    "histogram_quantile", "clamp_min", "clamp_max", "clamp", "abs", "absent", "absent_over_time",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "count_over_time",
    "last_over_time", "changes", "resets", "time", "vector", "scalar", "label_replace", "label_join",
    "round", "ceil", "floor", "sort", "sort_desc", "timestamp", "predict_linear", "inf", "nan",
}


def metric_names(expr):
    """Metric names an expression selects (PromQL: strings, label matchers, ranges and the label
    lists of by/without/on/ignoring are skipped; what is left and is not a keyword or function is a
    metric name)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)        # strings
    text = re.sub(r"\{[^}]*\}", " ", text)                  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)                 # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = match.group(0)
        if word in _PROMQL_WORDS or word.startswith("$"):
            continue
        before = text[:match.start()]
        if before.endswith("$"):                              # Grafana variables ($__rate_interval)
            continue
        if re.match(r"\s*\(", text[match.end():]):            # a function call
            continue
        if re.fullmatch(r"\d+[smhdwy]?", word):
            continue
        names.add(word)
    return names


def grafana_to_promql(expr):
    """Replaces Grafana's variables with values Prometheus accepts, to check an expression."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    return re.sub(r"\$\{?[a-zA-Z_]+\}?", ".*", expr)


def run(command, timeout=120, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def require_binary(name):
    path = os.path.join(BIN_DIR, name)
    if not os.access(path, os.X_OK):
        raise AssertionError(f"{path} is not built (build the {name} target first)")
    return path


_router_pb2 = None


def protobuf_modules():
    """The eldr.v1 protobuf messages for Python, generated by protoc (once per process) into a
    temporary folder that is removed at exit."""
    global _router_pb2
    if _router_pb2 is None:
        import atexit
        out = tempfile.mkdtemp(prefix="eldr-pb-")
        atexit.register(shutil.rmtree, out, True)
        result = run(["protoc", f"--proto_path={SOURCE_DIR}/proto", f"--python_out={out}",
                      os.path.join(SOURCE_DIR, "proto", "eldr", "v1", "router.proto")])
        if result.returncode != 0:
            raise AssertionError(f"protoc failed: {result.stderr}")
        sys.path.insert(0, out)
        from eldr.v1 import router_pb2  # noqa: E402  (generated just above)
        _router_pb2 = router_pb2
    return _router_pb2
