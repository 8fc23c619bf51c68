"""Helpers for tests that need a Kubernetes API server: the stand-in (fake_kube_apiserver.py) run as
a subprocess, its control API, a small HTTPS client of the API port, and the real kubectl pointed
at it (isolated from the user's kubeconfig and caches).

    with kube_testlib.FakeKubeApiServer(token="t0") as kube:
        kube.control.create_pod("decode-0", labels={"app": "decode"}, ready=True)
        out = kube.kubectl("get", "pods").stdout
        status, obj = kube.client().get_json("/api/v1/namespaces/default/pods")

Run with Debian's /usr/bin/python3 (standard library only).
"""

import http.client
import json
import os
import queue
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_APISERVER = os.path.join(HERE, "fake_kube_apiserver.py")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
KUBECTL = "/usr/bin/kubectl" if os.path.exists("/usr/bin/kubectl") else (
    shutil.which("kubectl") or "kubectl")

_last_server = None


class ControlError(Exception):
    def __init__(self, code, body):
        super().__init__(f"control API answered {code}: {body}")
        self.code = code
        self.body = body


class Control:
    """The stand-in's control API (plain HTTP on 127.0.0.1:control_port)."""

    def __init__(self, port, host="127.0.0.1", timeout=30):
        self.base = f"http://{host}:{port}"
        self.timeout = timeout

    def call(self, method, path, body=None, expect=(200, 201)):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                code, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            code, raw = e.code, e.read()
        obj = json.loads(raw) if raw else None
        if expect is not None and code not in expect:
            raise ControlError(code, obj)
        return obj

    @staticmethod
    def _q(s):
        return urllib.parse.quote(s, safe="")

    def create_pod(self, name, namespace="default", **fields):
        """fields: ip, labels, annotations, ready, phase, ports, container, image, node, hostIP,
        restartCount. Returns the Pod."""
        return self.call("POST", "/pods", dict(fields, name=name, namespace=namespace))

    def bulk_create(self, pods):
        return self.call("POST", "/pods/bulk", {"pods": pods})

    def patch_pod(self, name, namespace="default", **fields):
        """Labels/annotations merge; a None value deletes the key."""
        return self.call("PATCH", f"/pods/{self._q(namespace)}/{self._q(name)}", fields)

    def terminate_pod(self, name, namespace="default", grace_period_seconds=None):
        body = {} if grace_period_seconds is None else {"gracePeriodSeconds": grace_period_seconds}
        return self.call("POST", f"/pods/{self._q(namespace)}/{self._q(name)}/terminate", body)

    def delete_pod(self, name, namespace="default"):
        return self.call("DELETE", f"/pods/{self._q(namespace)}/{self._q(name)}")

    def replace_pod(self, name, namespace="default", ip=None, **fields):
        body = dict(fields, name=name, namespace=namespace)
        if ip is not None:
            body["ip"] = ip
        return self.call("POST", "/replace", body)

    def faults(self, **faults):
        """down, drop_watches, compact, garbage, stall_watches, delay_ms, status_code,
        bookmark_now."""
        return self.call("POST", "/faults", faults)

    def bookmark_now(self):
        return self.faults(bookmark_now=True)

    def stats(self):
        return self.call("GET", "/stats")

    def reset_stats(self):
        return self.call("POST", "/stats/reset", {})

    def pods(self):
        """Every pod (full objects), sorted by namespace and name."""
        return self.call("GET", "/pods")["items"]

    def pod(self, name, namespace="default"):
        return self.call("GET", f"/pods/{self._q(namespace)}/{self._q(name)}")

    def resource_version(self):
        return self.stats()["resource_version"]


class Response:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)


class WatchStream:
    """A watch read on a thread: events (dicts) in a queue; the stream's end as a final item."""

    def __init__(self, conn, resp):
        self.conn = conn
        self.resp = resp
        self.status = resp.status
        self.headers = resp.headers
        self.items = queue.Queue()
        self.ended = None          # "end" (terminating chunk), "incomplete", or "error: ..."
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        # read1, not readline: HTTPResponse.readline (through peek) reports a stream cut short
        # mid-chunk as a clean end; read1 raises IncompleteRead.
        buf = b""
        try:
            while True:
                data = self.resp.read1(65536)
                if not data:
                    if buf:
                        self.items.put(("garbage", buf))
                    self.ended = "end"
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    try:
                        self.items.put(("event", json.loads(line)))
                    except ValueError:
                        self.items.put(("garbage", line + b"\n"))
        except http.client.IncompleteRead:
            self.ended = "incomplete"
        except Exception as e:  # noqa: BLE001
            self.ended = f"error: {e!r}"
        self.items.put(("end", self.ended))

    def next(self, timeout=10):
        """The next ("event", dict) / ("garbage", bytes) / ("end", how); raises queue.Empty."""
        return self.items.get(timeout=timeout)

    def next_event(self, timeout=10, skip_bookmarks=True):
        """The next event dict, skipping BOOKMARKs (by default). AssertionError at the end."""
        deadline = time.monotonic() + timeout
        while True:
            kind, x = self.items.get(timeout=max(0.01, deadline - time.monotonic()))
            if kind == "end":
                self.items.put((kind, x))
                raise AssertionError(f"watch ended ({x}) while waiting for an event")
            if kind == "event" and skip_bookmarks and x.get("type") == "BOOKMARK":
                continue
            if kind == "event":
                return x

    def events(self, n, timeout=10, skip_bookmarks=True):
        return [self.next_event(timeout, skip_bookmarks) for _ in range(n)]

    def wait_end(self, timeout=10):
        """Reads until the end; returns (how, [events read meanwhile])."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            kind, x = self.items.get(timeout=max(0.01, deadline - time.monotonic()))
            if kind == "end":
                self.items.put((kind, x))
                return x, seen
            seen.append(x)

    def close(self):
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except Exception:  # noqa: BLE001
            pass
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001
            pass


class ApiClient:
    """HTTPS (verifying the stand-in's CA) with a bearer token; one connection per request."""

    def __init__(self, port, ca_file, token=None, host="127.0.0.1", timeout=30):
        self.host, self.port, self.token, self.timeout = host, port, token, timeout
        self.ctx = ssl.create_default_context(cafile=ca_file)

    def _conn(self, timeout=None):
        return http.client.HTTPSConnection(self.host, self.port, context=self.ctx,
                                           timeout=timeout or self.timeout)

    def _headers(self, headers, token):
        h = {"Accept": "application/json"}
        tok = self.token if token is None else token
        if tok:
            h["Authorization"] = f"Bearer {tok}"
        h.update(headers or {})
        return h

    def request(self, path, method="GET", headers=None, token=None, body=None):
        conn = self._conn()
        try:
            conn.request(method, path, body=body, headers=self._headers(headers, token))
            resp = conn.getresponse()
            return Response(resp.status, resp.headers, resp.read())
        finally:
            conn.close()

    def get_json(self, path, **kw):
        r = self.request(path, **kw)
        return r.status, r.json()

    def watch(self, path, headers=None, token=None):
        """Starts a watch (path with ?watch=1...); the stream's status/headers are read before
        returning."""
        conn = self._conn(timeout=None)
        conn.request("GET", path, headers=self._headers(headers, token))
        resp = conn.getresponse()
        return WatchStream(conn, resp)


def _free_token_file(directory, token):
    path = os.path.join(directory, "token")
    write_file_atomic(path, token + "\n")
    return path


def write_file_atomic(path, text):
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class FakeKubeApiServer:
    """The stand-in as a subprocess. token=None: no auth; else a token file holding it."""

    def __init__(self, token="test-token", tls_dir=None, bookmark_interval_s=1.0, history=10000,
                 port=0, control_port=0, quiet=True, extra_args=(), start_timeout=30):
        self.workdir = tempfile.mkdtemp(prefix="fake-kube-")
        self.token = token
        self.token_file = _free_token_file(self.workdir, token) if token is not None else None
        self.tls_dir = tls_dir or os.path.join(self.workdir, "tls")
        self.args = [f"--port={port}", f"--control_port={control_port}",
                     f"--tls_dir={self.tls_dir}", f"--bookmark_interval_s={bookmark_interval_s}",
                     f"--history={history}"]
        if self.token_file:
            self.args.append(f"--token_file={self.token_file}")
        if quiet:
            self.args.append("--quiet")
        self.args += list(extra_args)
        self.start_timeout = start_timeout
        self.proc = None
        self.info = None
        self.home = os.path.join(self.workdir, "home")
        self.kubeconfig = os.path.join(self.workdir, "kubeconfig")

    # --- lifecycle ---
    def start(self):
        global _last_server
        port_file = os.path.join(self.workdir, "port.json")
        self.stderr_path = os.path.join(self.workdir, "stderr.log")
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([PYTHON, FAKE_APISERVER, f"--port_file={port_file}",
                                      *self.args], stdout=subprocess.DEVNULL, stderr=self._stderr)
        deadline = time.monotonic() + self.start_timeout
        while not os.path.exists(port_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake_kube_apiserver exited {self.proc.returncode}: "
                                   f"{self.stderr_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("fake_kube_apiserver did not write its port file")
            time.sleep(0.02)
        with open(port_file) as f:
            self.info = json.load(f)
        self.port = self.info["port"]
        self.control_port = self.info["control_port"]
        self.ca_file = self.info["ca_file"]
        self.server = self.info["server"]
        self.pid = self.info["pid"]
        self.control = Control(self.control_port)
        os.makedirs(self.home, exist_ok=True)
        with open(self.kubeconfig, "w"):
            pass
        _last_server = self
        return self

    def stop(self):
        global _last_server
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_stderr", None):
            self._stderr.close()
            self._stderr = None
        if _last_server is self:
            _last_server = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def stderr_text(self):
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # --- credentials ---
    def set_token(self, token):
        """Rewrites the token file (the server re-reads it on every request)."""
        self.token = token
        write_file_atomic(self.token_file, token + "\n")

    def client(self, token=None):
        return ApiClient(self.port, self.ca_file, self.token if token is None else token)

    # --- kubectl ---
    def kubectl_env(self):
        env = dict(os.environ)
        env.update({"HOME": self.home, "KUBECONFIG": self.kubeconfig,
                    "KUBECACHEDIR": os.path.join(self.home, ".kube", "cache")})
        return env

    def kubectl_argv(self, *args, token=None):
        tok = self.token if token is None else token
        argv = [KUBECTL, f"--server={self.server}", f"--certificate-authority={self.ca_file}"]
        if tok:
            argv.append(f"--token={tok}")
        return argv + list(args)

    def kubectl(self, *args, token=None, timeout=60, check=False):
        """Runs kubectl to the end; a CompletedProcess with text stdout/stderr."""
        result = subprocess.run(self.kubectl_argv(*args, token=token), env=self.kubectl_env(),
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stderr}")
        return result

    def kubectl_popen(self, *args, token=None):
        """kubectl as a running process (for -w): a KubectlProcess (a context manager) whose
        .out and .err are StreamReaders of its stdout and stderr."""
        return KubectlProcess(self.kubectl_argv(*args, token=token), self.kubectl_env())


def kubectl(*args, server=None, **kw):
    """The real kubectl against `server` (default: the last FakeKubeApiServer started)."""
    srv = server or _last_server
    if srv is None:
        raise RuntimeError("no FakeKubeApiServer is running")
    return srv.kubectl(*args, **kw)


class KubectlProcess:
    def __init__(self, argv, env):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.out = StreamReader(self.proc.stdout)
        self.err = StreamReader(self.proc.stderr)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for r in (self.out, self.err):
            r.thread.join(5)
            r.pipe.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class StreamReader:
    """Reads a pipe on a thread; text() is what arrived so far; wait_for(pred) polls it."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.chunks = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while True:
            b = self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(4096)
            if not b:
                return
            with self.lock:
                self.chunks.append(b)

    def text(self):
        with self.lock:
            return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, pred, timeout=15):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.text()
            if pred(t):
                return t
            time.sleep(0.05)
        raise AssertionError(f"timed out; output so far:\n{self.text()}")


def json_stream(text):
    """The JSON values concatenated (whitespace-separated) in `text`, and the unparsed tail."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out, ""
        try:
            obj, j = dec.raw_decode(text, i)
        except ValueError:
            return out, text[i:]
        out.append(obj)
        i = j
