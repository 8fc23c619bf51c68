#!/usr/bin/python3
"""Tests of the stand-in Kubernetes API server (fake_kube_apiserver.py): the real kubectl against it
(tables, selectors, JSON, errors, auth, watches), and a raw HTTPS client for the protocol details
(resourceVersion replay, bookmarks, 410 Expired, chunking, faults, token rotation, pagination).

Run: /usr/bin/python3 tests/discovery/fake_kube_apiserver_test.py [-v]
"""

import http.client
import json
import os
import queue
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kube_testlib  # noqa: E402

_TLS_DIR = None
POD_PATH = "/api/v1/namespaces/default/pods"
TABLE_ACCEPT = ("application/json;as=Table;v=v1;g=meta.k8s.io,"
                "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json")


def setUpModule():
    global _TLS_DIR
    _TLS_DIR = tempfile.mkdtemp(prefix="fake-kube-test-tls-")


def tearDownModule():
    shutil.rmtree(_TLS_DIR, ignore_errors=True)


def wait_until(pred, timeout=10, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def names_of(events):
    return [(e["type"], e["object"]["metadata"]["name"]) for e in events]


class ServerTestCase(unittest.TestCase):
    server_kwargs = {}

    def setUp(self):
        kw = dict(token="token-1", tls_dir=_TLS_DIR, bookmark_interval_s=0.2)
        kw.update(self.server_kwargs)
        self.kube = kube_testlib.FakeKubeApiServer(**kw).start()
        self.ctl = self.kube.control
        self.api = self.kube.client()
        self.watches = []

    def tearDown(self):
        for w in self.watches:
            w.close()
        if self._outcome_failed():
            sys.stderr.write(self.kube.stderr_text()[-4000:])
        self.kube.stop()

    def _outcome_failed(self):
        outcome = getattr(self, "_outcome", None)
        errors = getattr(outcome, "errors", None) or []
        return any(exc for _, exc in errors)

    def watch(self, query, path=POD_PATH, **kw):
        w = self.api.watch(f"{path}?{query}", **kw)
        self.watches.append(w)
        self.assertEqual(w.status, 200)
        return w

    def wait_open_watches(self, n):
        wait_until(lambda: self.ctl.stats()["open_watches"] == n, what=f"{n} open watches")

    def seed(self):
        self.ctl.create_pod("decode-0", labels={"app": "decode", "rank": "0"}, ready=True,
                            ip="10.1.0.10", ports=[{"name": "http", "containerPort": 8000}])
        self.ctl.create_pod("decode-1", labels={"app": "decode", "rank": "1"}, ready=True,
                            ip="10.1.0.11")
        self.ctl.create_pod("prefill-0", labels={"app": "prefill"}, ready=False, ip="10.1.0.20")


# ---------------------------------------------------------------------------------------------
# The real kubectl
# ---------------------------------------------------------------------------------------------

class KubectlTest(ServerTestCase):
    def test_get_pods_table(self):
        self.seed()
        r = self.kube.kubectl("get", "pods", check=True)
        lines = r.stdout.strip().splitlines()
        self.assertEqual(lines[0].split(), ["NAME", "READY", "STATUS", "RESTARTS", "AGE"])
        rows = {l.split()[0]: l.split() for l in lines[1:]}
        self.assertEqual(sorted(rows), ["decode-0", "decode-1", "prefill-0"])
        self.assertEqual(rows["decode-0"][1:4], ["1/1", "Running", "0"])
        self.assertEqual(rows["prefill-0"][1:3], ["0/1", "Running"])
        # -o wide shows the priority-1 columns; the short name and -A work.
        wide = self.kube.kubectl("get", "po", "-o", "wide", check=True).stdout
        self.assertIn("10.1.0.10", wide)
        self.assertIn("node-1", wide)
        every = self.kube.kubectl("get", "pods", "-A", check=True).stdout
        self.assertTrue(every.startswith("NAMESPACE"), every)
        # Terminating pods print as such.
        self.ctl.terminate_pod("decode-1")
        out = self.kube.kubectl("get", "pods", check=True).stdout
        self.assertRegex(out, r"decode-1\s+0/1\s+Terminating")

    def test_label_and_field_selectors(self):
        self.seed()
        self.ctl.create_pod("other", namespace="kube-system", labels={"app": "decode"})

        def names(*args):
            out = self.kube.kubectl("get", "pods", "-o", "name", *args, check=True).stdout
            return sorted(out.split())

        self.assertEqual(names("-l", "app=decode"), ["pod/decode-0", "pod/decode-1"])
        self.assertEqual(names("-l", "app in (prefill)"), ["pod/prefill-0"])
        self.assertEqual(names("-l", "app,rank!=0"), ["pod/decode-1", "pod/prefill-0"])
        self.assertEqual(names("-l", "!rank"), ["pod/prefill-0"])
        self.assertEqual(names("--field-selector", "metadata.name=decode-1"), ["pod/decode-1"])
        self.assertEqual(names("-A", "-l", "app=decode"),
                         ["pod/decode-0", "pod/decode-1", "pod/other"])
        r = self.kube.kubectl("get", "pods", "-l", "app in (decode")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("BadRequest", r.stderr)

    def test_get_pods_json_and_yaml_equal_control(self):
        self.seed()
        r = self.kube.kubectl("get", "pods", "-o", "json", check=True)
        self.assertEqual(json.loads(r.stdout)["items"], self.ctl.pods())
        one = json.loads(self.kube.kubectl("get", "pod", "decode-0", "-o", "json",
                                           check=True).stdout)
        self.assertEqual(one, self.ctl.pod("decode-0"))
        y = self.kube.kubectl("get", "pod", "decode-0", "-o", "yaml", check=True).stdout
        self.assertIn("name: decode-0", y)
        self.assertIn("containerPort: 8000", y)

    def test_chunked_list(self):
        self.ctl.bulk_create([{"name": f"p-{i:02d}"} for i in range(7)])
        self.ctl.reset_stats()
        out = self.kube.kubectl("get", "pods", "--chunk-size=2", "-o", "name", check=True).stdout
        self.assertEqual(out.split(), [f"pod/p-{i:02d}" for i in range(7)])
        self.assertEqual(self.ctl.stats()["list_requests"], 4)

    def test_get_missing_pod(self):
        r = self.kube.kubectl("get", "pod", "nope")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('Error from server (NotFound): pods "nope" not found', r.stderr)

    def test_wrong_token(self):
        # With no discovery cache, kubectl's discovery client reads the 401 without decoding its
        # Status (as against a real server): "the server has asked for the client to provide
        # credentials".
        r = self.kube.kubectl("get", "pods", token="wrong")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("You must be logged in to the server", r.stderr)
        # With discovery cached, the pods request's 401 Status reaches the user.
        self.kube.kubectl("get", "pods", check=True)
        r = self.kube.kubectl("get", "pods", token="wrong")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("error: You must be logged in to the server (Unauthorized)", r.stderr)
        self.assertGreaterEqual(self.ctl.stats()["unauthorized"], 2)

    def test_watch_json_events(self):
        self.ctl.create_pod("decode-0", labels={"app": "decode"}, ready=True)
        with self.kube.kubectl_popen("get", "pods", "-w", "--output-watch-events",
                                     "-o", "json") as k:
            out = k.out
            self.wait_open_watches(1)
            self.ctl.create_pod("decode-1", labels={"app": "decode"})
            self.ctl.patch_pod("decode-1", ready=True)
            self.ctl.terminate_pod("decode-0")
            self.ctl.delete_pod("decode-0")
            want = [("ADDED", "decode-0"), ("ADDED", "decode-1"), ("MODIFIED", "decode-1"),
                    ("MODIFIED", "decode-0"), ("DELETED", "decode-0")]
            text = out.wait_for(lambda t: len(kube_testlib.json_stream(t)[0]) >= len(want))
            events = kube_testlib.json_stream(text)[0]
            self.assertEqual(names_of(events), want)
            self.assertIn("deletionTimestamp", events[3]["object"]["metadata"])
            self.assertEqual(events[2]["object"]["status"]["conditions"][2],
                             {**events[2]["object"]["status"]["conditions"][2],
                              "type": "Ready", "status": "True"})

    def test_watch_table(self):
        self.ctl.create_pod("decode-0", labels={"app": "decode"}, ready=True)
        with self.kube.kubectl_popen("get", "pods", "-w") as k:
            out = k.out
            out.wait_for(lambda t: "decode-0" in t)
            self.wait_open_watches(1)
            self.ctl.create_pod("decode-7", labels={"app": "decode"}, ready=True)
            text = out.wait_for(lambda t: "decode-7" in t)
            lines = text.strip().splitlines()
            self.assertEqual(lines[0].split(), ["NAME", "READY", "STATUS", "RESTARTS", "AGE"])
            self.assertEqual(sum(1 for l in lines if l.startswith("NAME")), 1)
            self.assertRegex(text, r"decode-7\s+1/1\s+Running\s+0")


# ---------------------------------------------------------------------------------------------
# The protocol, with a raw HTTPS client
# ---------------------------------------------------------------------------------------------

class ProtocolTest(ServerTestCase):
    def test_discovery(self):
        st, v = self.api.get_json("/version")
        self.assertEqual(st, 200)
        self.assertTrue(v["gitVersion"].startswith("v1."))
        st, a = self.api.get_json("/api")
        self.assertEqual((a["kind"], a["versions"]), ("APIVersions", ["v1"]))
        st, g = self.api.get_json("/apis")
        self.assertEqual(g["kind"], "APIGroupList")
        st, r = self.api.get_json("/api/v1")
        pods = [x for x in r["resources"] if x["name"] == "pods"][0]
        self.assertEqual((pods["kind"], pods["namespaced"], pods["shortNames"]),
                         ("Pod", True, ["po"]))
        self.assertEqual(sorted(pods["verbs"]), ["get", "list", "watch"])

    def test_tls(self):
        r = self.api.request("/version")
        self.assertEqual(r.status, 200)
        for host in ("127.0.0.1", "localhost"):
            ctx = ssl.create_default_context(cafile=self.kube.ca_file)
            ctx.set_alpn_protocols(["h2", "http/1.1"])     # as Go clients offer
            with socket.create_connection(("127.0.0.1", self.kube.port)) as raw:
                with ctx.wrap_socket(raw, server_hostname=host) as s:
                    self.assertIn(s.version(), ("TLSv1.2", "TLSv1.3"))
                    self.assertEqual(s.selected_alpn_protocol(), "http/1.1")
        # TLS 1.1 is refused.
        old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        old.load_verify_locations(self.kube.ca_file)
        old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        old.maximum_version = ssl.TLSVersion.TLSv1_1
        with socket.create_connection(("127.0.0.1", self.kube.port)) as raw:
            with self.assertRaises(ssl.SSLError):
                old.wrap_socket(raw, server_hostname="127.0.0.1")
        # Plain HTTP on the API port gets no HTTP answer.
        conn = http.client.HTTPConnection("127.0.0.1", self.kube.port, timeout=5)
        with self.assertRaises((ConnectionError, http.client.HTTPException, OSError)):
            conn.request("GET", "/version")
            conn.getresponse().read()
        conn.close()
        # A client that does not trust the CA fails verification.
        bad = ssl.create_default_context()
        with socket.create_connection(("127.0.0.1", self.kube.port)) as raw:
            with self.assertRaises(ssl.SSLCertVerificationError):
                bad.wrap_socket(raw, server_hostname="127.0.0.1")

    def test_pod_object(self):
        self.ctl.create_pod("decode-0", labels={"app": "decode"}, annotations={"a": "b"},
                            ready=True, ip="10.9.0.1",
                            ports=[{"name": "http", "containerPort": 8000},
                                   {"name": "metrics", "containerPort": 9464}])
        st, pod = self.api.get_json(f"{POD_PATH}/decode-0")
        self.assertEqual(st, 200)
        self.assertEqual((pod["apiVersion"], pod["kind"]), ("v1", "Pod"))
        m = pod["metadata"]
        self.assertEqual((m["name"], m["namespace"], m["labels"], m["annotations"]),
                         ("decode-0", "default", {"app": "decode"}, {"a": "b"}))
        self.assertEqual(len(m["uid"]), 36)
        self.assertRegex(m["creationTimestamp"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        c = pod["spec"]["containers"][0]
        self.assertEqual(c["name"], "engine")
        self.assertEqual(c["ports"], [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                                      {"name": "metrics", "containerPort": 9464,
                                       "protocol": "TCP"}])
        s = pod["status"]
        self.assertEqual((s["phase"], s["podIP"], s["podIPs"]), ("Running", "10.9.0.1",
                                                                 [{"ip": "10.9.0.1"}]))
        conds = {x["type"]: x["status"] for x in s["conditions"]}
        self.assertEqual((conds["Ready"], conds["ContainersReady"]), ("True", "True"))
        self.assertTrue(s["containerStatuses"][0]["ready"])
        # terminate: deletionTimestamp + grace, not ready.
        t = self.ctl.terminate_pod("decode-0", grace_period_seconds=5)
        self.assertEqual(t["metadata"]["deletionGracePeriodSeconds"], 5)
        self.assertIn("deletionTimestamp", t["metadata"])
        self.assertEqual({x["type"]: x["status"] for x in t["status"]["conditions"]}["Ready"],
                         "False")
        # A no-op patch changes nothing (no new resourceVersion), as the real server.
        rv = self.ctl.resource_version()
        self.ctl.patch_pod("decode-0", labels={"app": "decode"})
        self.assertEqual(self.ctl.resource_version(), rv)

    def test_errors(self):
        r = self.api.request(f"{POD_PATH}/nope")
        self.assertEqual(r.status, 404)
        self.assertEqual(r.json(), {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                    "status": "Failure", "message": 'pods "nope" not found',
                                    "reason": "NotFound",
                                    "details": {"name": "nope", "kind": "pods"}, "code": 404})
        r = self.api.request("/api/v1/namespaces/default/services")
        self.assertEqual((r.status, r.json()["reason"]), (404, "NotFound"))
        r = self.api.request(POD_PATH, method="POST", body=b"{}")
        self.assertEqual((r.status, r.json()["reason"]), (405, "MethodNotAllowed"))
        r = self.api.request(f"{POD_PATH}?resourceVersion=abc")
        self.assertEqual((r.status, r.json()["reason"]), (400, "BadRequest"))
        r = self.api.request(f"{POD_PATH}?watch=1&resourceVersion=abc")
        self.assertEqual((r.status, r.json()["reason"]), (400, "BadRequest"))
        r = self.api.request(POD_PATH, headers={"Accept": "application/vnd.kubernetes.protobuf"})
        self.assertEqual((r.status, r.json()["reason"]), (406, "NotAcceptable"))
        r = self.api.request(f"{POD_PATH}?watch=1&sendInitialEvents=true"
                             "&resourceVersionMatch=NotOlderThan")
        self.assertEqual((r.status, r.json()["reason"]), (422, "Invalid"))
        r = self.api.request(f"{POD_PATH}?fieldSelector=spec.bogus%3Dx")
        self.assertEqual((r.status, r.json()["reason"]), (400, "BadRequest"))
        # Injected statuses.
        self.ctl.faults(status_code=429)
        r = self.api.request(POD_PATH)
        self.assertEqual((r.status, r.json()["reason"], r.headers["Retry-After"]),
                         (429, "TooManyRequests", "1"))
        self.ctl.faults(status_code=500)
        r = self.api.request(f"{POD_PATH}?watch=1")
        self.assertEqual((r.status, r.json()["reason"]), (500, "InternalError"))
        self.ctl.faults(status_code=0, delay_ms=300)
        t0 = time.monotonic()
        self.assertEqual(self.api.request(POD_PATH).status, 200)
        self.assertGreaterEqual(time.monotonic() - t0, 0.3)
        self.ctl.faults(delay_ms=0)
        # A list newer than the server waits, then answers 504 (as the watch cache).
        rv = int(self.ctl.resource_version())
        r = self.api.request(f"{POD_PATH}?resourceVersion={rv + 5}")
        self.assertEqual((r.status, r.json()["reason"]), (504, "Timeout"))

    def test_label_selector_parse_errors(self):
        for bad in ("app in (decode", "app=decode=x", "=x", "app in decode", "app,", "a b",
                    "app notin", "-bad=x", "app==(x)", "rank>x", "!app=x"):
            with self.subTest(selector=bad):
                q = urllib.parse.urlencode({"labelSelector": bad})
                for path in (f"{POD_PATH}?{q}", f"{POD_PATH}?watch=1&{q}", f"/api/v1/pods?{q}"):
                    r = self.api.request(path)
                    self.assertEqual(r.status, 400, (bad, r.body))
                    self.assertEqual(r.json()["reason"], "BadRequest")
                    self.assertEqual(r.json()["kind"], "Status")

    def test_label_selectors(self):
        self.seed()
        self.ctl.create_pod("gpu-0", labels={"app": "decode", "gpu": "h200", "rank": "7"})

        def names(sel):
            q = urllib.parse.urlencode({"labelSelector": sel})
            st, lst = self.api.get_json(f"{POD_PATH}?{q}")
            self.assertEqual(st, 200, lst)
            return [p["metadata"]["name"] for p in lst["items"]]

        self.assertEqual(names(""), ["decode-0", "decode-1", "gpu-0", "prefill-0"])
        self.assertEqual(names("app==decode"), ["decode-0", "decode-1", "gpu-0"])
        self.assertEqual(names("app = decode , gpu"), ["gpu-0"])
        self.assertEqual(names("app notin (decode)"), ["prefill-0"])
        self.assertEqual(names("app in (decode, prefill),!gpu"),
                         ["decode-0", "decode-1", "prefill-0"])
        self.assertEqual(names("rank>0"), ["decode-1", "gpu-0"])
        self.assertEqual(names("rank<1"), ["decode-0"])
        self.assertEqual(names("gpu!=h200"), ["decode-0", "decode-1", "prefill-0"])

        def fnames(sel):
            q = urllib.parse.urlencode({"fieldSelector": sel})
            st, lst = self.api.get_json(f"/api/v1/pods?{q}")
            self.assertEqual(st, 200, lst)
            return [p["metadata"]["name"] for p in lst["items"]]

        self.ctl.patch_pod("gpu-0", phase="Pending")
        self.assertEqual(fnames("status.phase=Pending"), ["gpu-0"])
        self.assertEqual(fnames("status.phase!=Pending,metadata.name!=decode-0"),
                         ["decode-1", "prefill-0"])

    def test_list_then_watch_from_rv(self):
        self.seed()
        st, lst = self.api.get_json(POD_PATH)
        self.assertEqual((st, lst["kind"], lst["apiVersion"]), (200, "PodList", "v1"))
        rv = int(lst["metadata"]["resourceVersion"])
        self.assertEqual([p["metadata"]["name"] for p in lst["items"]],
                         ["decode-0", "decode-1", "prefill-0"])
        self.assertEqual(max(int(p["metadata"]["resourceVersion"]) for p in lst["items"]), rv)
        # Changes after the list, before the watch: replayed from history.
        self.ctl.create_pod("decode-2", labels={"app": "decode"})
        self.ctl.patch_pod("decode-0", labels={"rank": None, "x": "y"})
        deleted = self.ctl.delete_pod("prefill-0")
        w = self.watch(f"watch=1&resourceVersion={rv}")
        self.assertEqual(w.headers["Content-Type"], "application/json")
        self.assertEqual(w.headers["Transfer-Encoding"], "chunked")
        ev = w.events(3)
        self.assertEqual(names_of(ev), [("ADDED", "decode-2"), ("MODIFIED", "decode-0"),
                                        ("DELETED", "prefill-0")])
        rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in ev]
        self.assertEqual(rvs, [rv + 1, rv + 2, rv + 3])
        self.assertEqual(ev[1]["object"]["metadata"]["labels"], {"app": "decode", "x": "y"})
        self.assertEqual(ev[2]["object"], deleted)
        # Then live events.
        self.ctl.replace_pod("decode-1", ip="10.1.0.99")
        ev = w.events(2)
        self.assertEqual(names_of(ev), [("DELETED", "decode-1"), ("ADDED", "decode-1")])
        self.assertNotEqual(ev[0]["object"]["metadata"]["uid"], ev[1]["object"]["metadata"]["uid"])
        self.assertEqual(ev[1]["object"]["status"]["podIP"], "10.1.0.99")
        self.assertEqual(int(ev[1]["object"]["metadata"]["resourceVersion"]), rv + 5)
        self.assertEqual(self.ctl.resource_version(), str(rv + 5))

    def test_watch_without_rv_sends_initial_added(self):
        self.seed()
        for query in ("watch=1", "watch=true&resourceVersion=0"):
            w = self.watch(query)
            self.assertEqual(names_of(w.events(3)), [("ADDED", "decode-0"), ("ADDED", "decode-1"),
                                                     ("ADDED", "prefill-0")])
        # All namespaces and the legacy watch path.
        self.ctl.create_pod("x", namespace="other")
        w = self.watch("resourceVersion=0", path="/api/v1/watch/pods")
        self.assertEqual(len(w.events(4)), 4)
        w = self.watch("", path="/api/v1/watch/namespaces/other/pods")
        self.assertEqual(names_of(w.events(1)), [("ADDED", "x")])
        w = self.watch("", path="/api/v1/watch/namespaces/default/pods/decode-1")
        self.assertEqual(names_of(w.events(1)), [("ADDED", "decode-1")])
        self.ctl.patch_pod("decode-0", ready=False)
        self.ctl.patch_pod("decode-1", ready=False)
        self.assertEqual(names_of(w.events(1)), [("MODIFIED", "decode-1")])

    def test_send_initial_events(self):
        self.seed()
        w = self.watch("watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"
                       "&allowWatchBookmarks=true&labelSelector=app%3Ddecode")
        ev = [w.next_event(skip_bookmarks=False) for _ in range(3)]
        self.assertEqual(names_of(ev[:2]), [("ADDED", "decode-0"), ("ADDED", "decode-1")])
        self.assertEqual(ev[2], {"type": "BOOKMARK", "object": {
            "kind": "Pod", "apiVersion": "v1", "metadata": {
                "resourceVersion": self.ctl.resource_version(),
                "annotations": {"k8s.io/initial-events-end": "true"}}}})

    def test_selector_semantics_on_watch(self):
        self.seed()
        w = self.watch("watch=1&labelSelector=app%3Ddecode")
        self.assertEqual(len(w.events(2)), 2)
        before = self.ctl.pod("decode-1")
        self.ctl.patch_pod("prefill-0", ready=True)                # never matches: nothing
        self.ctl.patch_pod("decode-1", labels={"app": "prefill"})  # leaves: DELETED
        self.ctl.patch_pod("decode-1", labels={"app": "decode"})   # enters: ADDED
        self.ctl.patch_pod("decode-1", ready=False)                # MODIFIED
        ev = w.events(3)
        self.assertEqual(names_of(ev), [("DELETED", "decode-1"),
                                        ("ADDED", "decode-1"), ("MODIFIED", "decode-1")])
        # The DELETED carries the state before the change at the change's resourceVersion.
        self.assertEqual(ev[0]["object"]["metadata"]["labels"], before["metadata"]["labels"])
        rv = int(self.ctl.resource_version())
        self.assertEqual(int(ev[0]["object"]["metadata"]["resourceVersion"]), rv - 2)

    def test_bookmarks(self):
        self.seed()
        w = self.watch(f"watch=1&allowWatchBookmarks=true&resourceVersion="
                       f"{self.ctl.resource_version()}")
        ev = w.next_event(skip_bookmarks=False)
        self.assertEqual(ev, {"type": "BOOKMARK", "object": {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"resourceVersion": self.ctl.resource_version()}}})
        self.ctl.create_pod("decode-9")
        rv = self.ctl.resource_version()
        ev = w.next_event()
        self.assertEqual(names_of([ev]), [("ADDED", "decode-9")])
        ev = w.next_event(skip_bookmarks=False)
        self.assertEqual((ev["type"], ev["object"]["metadata"]["resourceVersion"]),
                         ("BOOKMARK", rv))
        # Without allowWatchBookmarks there are none, even when asked for.
        plain = self.watch(f"watch=1&resourceVersion={rv}")
        time.sleep(0.5)
        self.ctl.bookmark_now()
        self.ctl.create_pod("decode-10")
        self.assertEqual(names_of([plain.next_event(skip_bookmarks=False)]),
                         [("ADDED", "decode-10")])

    def test_bookmark_now(self):
        srv = kube_testlib.FakeKubeApiServer(token=None, tls_dir=_TLS_DIR,
                                             bookmark_interval_s=3600).start()
        try:
            w = srv.client().watch(f"{POD_PATH}?watch=1&allowWatchBookmarks=true")
            self.watches.append(w)
            wait_until(lambda: srv.control.stats()["open_watches"] == 1)
            with self.assertRaises(queue.Empty):
                w.next(timeout=0.5)
            srv.control.bookmark_now()
            self.assertEqual(w.next_event(skip_bookmarks=False)["type"], "BOOKMARK")
        finally:
            srv.stop()

    def test_one_chunk_per_event(self):
        self.seed()
        ctx = ssl.create_default_context(cafile=self.kube.ca_file)
        with socket.create_connection(("127.0.0.1", self.kube.port)) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(f"GET {POD_PATH}?watch=1&timeoutSeconds=1 HTTP/1.1\r\nHost: x\r\n"
                          f"Authorization: Bearer {self.kube.token}\r\n\r\n".encode())
                data = b""
                while not data.endswith(b"0\r\n\r\n"):
                    b = s.recv(65536)
                    if not b:
                        break
                    data += b
        head, _, body = data.partition(b"\r\n\r\n")
        self.assertIn(b"HTTP/1.1 200", head)
        self.assertIn(b"Transfer-Encoding: chunked", head)
        chunks = []
        while body:
            size, _, rest = body.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                self.assertEqual(rest, b"\r\n")
                break
            chunks.append(rest[:n])
            self.assertEqual(rest[n:n + 2], b"\r\n")
            body = rest[n + 2:]
        self.assertEqual(len(chunks), 3)
        for c in chunks:
            self.assertTrue(c.endswith(b"\n"))
            self.assertEqual(c.count(b"\n"), 1)
            self.assertEqual(json.loads(c)["type"], "ADDED")

    def test_timeout_seconds(self):
        t0 = time.monotonic()
        w = self.watch("watch=1&timeoutSeconds=1")
        how, _ = w.wait_end(timeout=5)
        self.assertEqual(how, "end")
        self.assertLess(time.monotonic() - t0, 3)

    def test_table_watch_and_list(self):
        self.seed()
        st, t = self.api.get_json(f"{POD_PATH}?limit=2", headers={"Accept": TABLE_ACCEPT})
        self.assertEqual((t["kind"], t["apiVersion"]), ("Table", "meta.k8s.io/v1"))
        self.assertEqual([c["name"] for c in t["columnDefinitions"]][:5],
                         ["Name", "Ready", "Status", "Restarts", "Age"])
        self.assertEqual([r["cells"][0] for r in t["rows"]], ["decode-0", "decode-1"])
        self.assertEqual(t["rows"][0]["object"]["kind"], "PartialObjectMetadata")
        self.assertIn("continue", t["metadata"])
        w = self.watch("watch=1&includeObject=Object", headers={"Accept": TABLE_ACCEPT})
        ev = w.events(3)
        self.assertEqual([e["object"]["kind"] for e in ev], ["Table"] * 3)
        self.assertIsNotNone(ev[0]["object"]["columnDefinitions"])
        self.assertIsNone(ev[1]["object"]["columnDefinitions"])
        self.assertEqual(ev[2]["object"]["rows"][0]["object"]["kind"], "Pod")

    def test_compact_gives_410(self):
        self.seed()
        old = self.ctl.resource_version()
        self.ctl.create_pod("decode-2")
        self.ctl.faults(compact=True)
        # A list never 410s.
        self.assertEqual(self.api.request(POD_PATH).status, 200)
        w = self.watch(f"watch=1&resourceVersion={old}")
        ev = w.next_event()
        self.assertEqual(ev, {"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f"too old resource version: {old} ({self.ctl.resource_version()})",
            "reason": "Expired", "code": 410}})
        self.assertEqual(w.wait_end()[0], "end")
        # The current version still works.
        w = self.watch(f"watch=1&resourceVersion={self.ctl.resource_version()}")
        self.ctl.delete_pod("decode-2")
        self.assertEqual(names_of([w.next_event()]), [("DELETED", "decode-2")])

    def test_history_window(self):
        srv = kube_testlib.FakeKubeApiServer(token=None, tls_dir=_TLS_DIR, history=5).start()
        try:
            rv0 = srv.control.resource_version()
            for i in range(10):
                srv.control.create_pod(f"p{i}")
            api = srv.client()
            w = api.watch(f"{POD_PATH}?watch=1&resourceVersion={rv0}")
            self.watches.append(w)
            ev = w.next_event()
            self.assertEqual((ev["type"], ev["object"]["code"], ev["object"]["reason"]),
                             ("ERROR", 410, "Expired"))
            # The last 5 changes are kept: a watch from 5 before now replays them.
            w = api.watch(f"{POD_PATH}?watch=1&resourceVersion={int(rv0) + 5}")
            self.watches.append(w)
            self.assertEqual([n for _, n in names_of(w.events(5))], [f"p{i}" for i in range(5, 10)])
            # An expired continue token is 410 too.
            st, lst = api.get_json(f"{POD_PATH}?limit=3")
            for i in range(10, 17):
                srv.control.create_pod(f"p{i}")
            r = api.request(f"{POD_PATH}?limit=3&continue="
                            f"{urllib.parse.quote(lst['metadata']['continue'])}")
            self.assertEqual((r.status, r.json()["reason"]), (410, "Expired"))
        finally:
            srv.stop()

    def test_drop_watches(self):
        w = self.watch("watch=1")
        self.wait_open_watches(1)
        self.ctl.faults(drop_watches=True)
        how, _ = w.wait_end()
        self.assertEqual(how, "incomplete")
        self.wait_open_watches(0)
        self.assertEqual(self.api.request(POD_PATH).status, 200)

    def test_down_up(self):
        self.seed()
        w = self.watch("watch=1")
        self.assertEqual(len(w.events(3)), 3)
        self.ctl.faults(down=True)
        how = w.wait_end()[0]
        self.assertTrue(how == "incomplete" or how.startswith("error"), how)
        with self.assertRaises(ConnectionRefusedError):
            self.api.request(POD_PATH)
        self.ctl.create_pod("while-down")
        self.ctl.faults(down=False)
        st, lst = self.api.get_json(POD_PATH)
        self.assertEqual(st, 200)
        self.assertIn("while-down", [p["metadata"]["name"] for p in lst["items"]])
        self.assertEqual(self.kube.kubectl("get", "pod", "while-down").returncode, 0)

    def test_garbage(self):
        self.seed()
        self.ctl.faults(garbage="list")
        bodies = [self.api.request(POD_PATH) for _ in range(2)]
        for r in bodies:
            self.assertEqual(r.status, 200)
            with self.assertRaises(ValueError):
                json.loads(r.body)
        self.assertNotEqual(bodies[0].body[:1], bodies[1].body[:1])   # not JSON, then truncated
        self.ctl.faults(garbage="watch")
        self.assertEqual(self.api.request(POD_PATH).status, 200)
        self.api.request(POD_PATH).json()
        w = self.watch("watch=1")
        kinds = [w.next()[0] for _ in range(4)]
        self.assertEqual(kinds, ["event", "event", "event", "garbage"])
        self.ctl.create_pod("after-garbage")
        self.assertEqual(names_of([w.next_event()]), [("ADDED", "after-garbage")])
        self.ctl.faults(garbage="off")
        self.api.request(POD_PATH).json()

    def test_stall(self):
        rv = self.ctl.resource_version()
        w = self.watch(f"watch=1&allowWatchBookmarks=true&resourceVersion={rv}")
        self.assertEqual(w.next_event(skip_bookmarks=False)["type"], "BOOKMARK")
        self.ctl.faults(stall_watches=True)
        time.sleep(0.3)
        while True:   # a bookmark may have been on its way
            try:
                w.next(timeout=0.1)
            except queue.Empty:
                break
        self.ctl.create_pod("stalled-0")
        w2 = self.watch(f"watch=1&resourceVersion={rv}")
        with self.assertRaises(queue.Empty):
            w.next(timeout=1.0)
        with self.assertRaises(queue.Empty):
            w2.next(timeout=0.1)
        self.ctl.faults(stall_watches=False)
        self.assertEqual(names_of([w.next_event()]), [("ADDED", "stalled-0")])
        self.assertEqual(names_of([w2.next_event()]), [("ADDED", "stalled-0")])
        w3 = self.watch(f"watch=1&resourceVersion={rv}")
        self.assertEqual(names_of([w3.next_event()]), [("ADDED", "stalled-0")])

    def test_token_rotation(self):
        self.assertEqual(self.api.request(POD_PATH).status, 200)
        self.kube.set_token("token-2")
        r = self.api.request(POD_PATH)
        self.assertEqual(r.status, 401)
        self.assertEqual(r.json(), {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                    "status": "Failure", "message": "Unauthorized",
                                    "reason": "Unauthorized", "code": 401})
        self.assertEqual(self.kube.client("token-2").request(POD_PATH).status, 200)
        self.assertEqual(self.api.request(POD_PATH, token="").status, 401)
        self.assertEqual(self.kube.client("token-2").request(f"{POD_PATH}?watch=1&"
                                                             "timeoutSeconds=1").status, 200)
        self.assertEqual(self.api.request(f"{POD_PATH}?watch=1").status, 401)
        self.assertEqual(self.api.request("/version").status, 401)
        self.assertEqual(self.kube.kubectl("get", "pods", token="token-2").returncode, 0)
        self.assertGreaterEqual(self.ctl.stats()["unauthorized"], 3)

    def test_bulk_and_pagination(self):
        watchers = [self.watch(f"watch=1&resourceVersion={self.ctl.resource_version()}")
                    for _ in range(12)]
        selective = self.watch("watch=1&labelSelector=shard%3D3")
        self.wait_open_watches(13)
        pods = [{"name": f"engine-{i:04d}", "labels": {"app": "decode", "shard": str(i % 10)},
                 "ready": True} for i in range(1000)]
        t0 = time.monotonic()
        self.assertEqual(self.ctl.bulk_create(pods)["created"], 1000)
        names, cont, pages, rv = [], None, 0, None
        while True:
            path = f"{POD_PATH}?limit=100" + (f"&continue={urllib.parse.quote(cont)}"
                                              if cont else "")
            st, page = self.api.get_json(path)
            self.assertEqual(st, 200)
            pages += 1
            if rv is None:
                rv = page["metadata"]["resourceVersion"]
                self.ctl.create_pod("engine-9999")      # after the snapshot: not in this list
            self.assertEqual(page["metadata"]["resourceVersion"], rv)
            names += [p["metadata"]["name"] for p in page["items"]]
            cont = page["metadata"].get("continue")
            if not cont:
                break
            self.assertEqual(page["metadata"]["remainingItemCount"], 1000 - len(names))
        self.assertEqual(pages, 10)
        self.assertEqual(names, [p["name"] for p in pods])
        # Every watcher got every event, in order.
        for w in watchers:
            ev = w.events(1001, timeout=30)
            self.assertEqual([n for _, n in names_of(ev)][:1000], [p["name"] for p in pods])
        self.assertEqual(len(selective.events(100, timeout=30)), 100)
        # resourceVersion=0 is served whole (the watch cache ignores limit).
        st, whole = self.api.get_json(f"{POD_PATH}?limit=100&resourceVersion=0")
        self.assertEqual((len(whole["items"]), whole["metadata"].get("continue")), (1001, None))
        # Selectors with pagination: no remainingItemCount.
        st, page = self.api.get_json(f"{POD_PATH}?limit=10&labelSelector=shard%3D3")
        self.assertEqual(len(page["items"]), 10)
        self.assertNotIn("remainingItemCount", page["metadata"])
        self.assertLess(time.monotonic() - t0, 60)

    def test_client_disconnects(self):
        self.seed()
        ws = [self.watch("watch=1&allowWatchBookmarks=true") for _ in range(20)]
        self.wait_open_watches(20)
        for w in ws:
            w.close()
        self.wait_open_watches(0)
        # Half-read responses, resets and garbage do not hurt the server.
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", self.kube.port)) as s:
                s.sendall(b"\x16\x03\x01garbage")
            with socket.create_connection(("127.0.0.1", self.kube.port)) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.assertEqual(self.api.request(POD_PATH).status, 200)
        self.assertEqual(self.kube.kubectl("get", "pods").returncode, 0)

    def test_sigterm_exits_promptly(self):
        self.watch("watch=1")
        self.wait_open_watches(1)
        t0 = time.monotonic()
        self.kube.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.kube.proc.wait(5), 0)
        self.assertLess(time.monotonic() - t0, 3)

    def test_control_api_errors(self):
        self.ctl.create_pod("a")
        with self.assertRaises(kube_testlib.ControlError) as e:
            self.ctl.create_pod("a")
        self.assertEqual(e.exception.code, 409)
        with self.assertRaises(kube_testlib.ControlError) as e:
            self.ctl.patch_pod("missing", ready=True)
        self.assertEqual(e.exception.code, 404)
        with self.assertRaises(kube_testlib.ControlError) as e:
            self.ctl.patch_pod("a", raedy=True)
        self.assertEqual(e.exception.code, 400)
        with self.assertRaises(kube_testlib.ControlError) as e:
            self.ctl.faults(bogus=True)
        self.assertEqual(e.exception.code, 400)


if __name__ == "__main__":
    unittest.main()
