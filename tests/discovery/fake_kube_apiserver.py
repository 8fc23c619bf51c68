#!/usr/bin/python3
"""A stand-in Kubernetes API server for tests: Pods (core/v1) only, list + get + watch.

It speaks the Kubernetes API protocol as the real kube-apiserver does, so that the real kubectl and
our C++ discovery client can be tested against it on loopback:

  * HTTPS only (TLS 1.2+, HTTP/1.1, a CA of its own made with the openssl CLI), bearer-token auth
    against a token file re-read on every request.
  * GET /api/v1/pods, /api/v1/namespaces/{ns}/pods (PodList; labelSelector, fieldSelector, limit +
    continue, resourceVersion, resourceVersionMatch), /api/v1/namespaces/{ns}/pods/{name}.
  * Watch (?watch=1, or the legacy /api/v1/watch/... paths): newline-delimited JSON events in a
    chunked response, one chunk per event; resourceVersion replay from a bounded history, 410
    Expired as an ERROR event, BOOKMARKs, sendInitialEvents, timeoutSeconds, selector semantics
    (a pod leaving a label selector is DELETED for that watcher, one entering it ADDED).
  * Server-side printing (meta.k8s.io/v1 Table) for `kubectl get`, and the discovery documents
    kubectl asks for.

A plain-HTTP control API on a second port lets tests play the cluster (create, modify, terminate,
delete, replace pods) and inject faults (down, dropped watches, compaction, garbage, stalls,
delays, error statuses). See tests/discovery/kube_testlib.py for a client of both.

Standard library only; run with Debian's /usr/bin/python3.

Usage:
  fake_kube_apiserver.py --port_file=F [--port=0] [--control_port=0] [--tls_dir=DIR]
                         [--token_file=PATH] [--bookmark_interval_s=1.0] [--history=10000] [--quiet]
"""

import argparse
import base64
import collections
import datetime
import fcntl
import http.server
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid

GIT_VERSION = "v1.29.0"
VERSION_INFO = {
    "major": "1",
    "minor": "29",
    "gitVersion": GIT_VERSION,
    "gitCommit": "3f7a50f38688eb332e2a1b013678c6435d539ae6",
    "gitTreeState": "clean",
    "buildDate": "2023-12-13T08:43:41Z",
    "goVersion": "go1.21.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}

# The first resourceVersion the cluster reports; watches from older versions are 410 Expired.
INITIAL_RESOURCE_VERSION = 1000
# How long a list with a resourceVersion newer than the current one waits before 504 (as the
# watch cache does).
TOO_LARGE_RV_WAIT_S = 3.0
DEFAULT_IMAGE = "eldr/engine:test"
DEFAULT_PORTS = [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
DEFAULT_NODE = "node-1"
DEFAULT_HOST_IP = "172.18.0.2"
DEFAULT_GRACE_S = 30
INITIAL_EVENTS_END = "k8s.io/initial-events-end"

QUIET = False


def log(msg):
    if not QUIET:
        try:
            sys.stderr.write(f"[fake-kube-apiserver] {msg}\n")
            sys.stderr.flush()
        except Exception:
            pass


def dumps(obj):
    return json.dumps(obj, separators=(",", ":")).encode()


def rfc3339(t):
    return datetime.datetime.fromtimestamp(int(t), datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------
# Status objects and errors
# ---------------------------------------------------------------------------------------------

REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
    405: "MethodNotAllowed", 406: "NotAcceptable", 409: "Conflict", 410: "Expired",
    415: "UnsupportedMediaType", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
    503: "ServiceUnavailable", 504: "Timeout",
}


def status_object(code, reason, message, details=None, metadata=None):
    obj = {"kind": "Status", "apiVersion": "v1", "metadata": metadata or {}, "status": "Failure",
           "message": message, "reason": reason}
    if details is not None:
        obj["details"] = details
    obj["code"] = code
    return obj


class ApiError(Exception):
    """An answer with a Status body."""

    def __init__(self, code, message, reason=None, details=None, headers=None):
        super().__init__(message)
        self.code = code
        self.status = status_object(code, reason or REASONS.get(code, "Unknown"), message, details)
        self.headers = headers or {}


def bad_request(message):
    return ApiError(400, message, "BadRequest")


def invalid_list_options(field, message, cause_reason="FieldValueForbidden"):
    """422 Invalid on ListOptions, as ValidateListOptions answers."""
    return ApiError(
        422, f'ListOptions.meta.k8s.io "" is invalid: {field}: {message}', "Invalid",
        {"group": "meta.k8s.io", "kind": "ListOptions",
         "causes": [{"reason": cause_reason, "message": message, "field": field}]})


def expired(message):
    return ApiError(410, message, "Expired")


def not_found_pod(name):
    return ApiError(404, f'pods "{name}" not found', "NotFound", {"name": name, "kind": "pods"})


def parse_bool(name, value):
    """strconv.ParseBool, as the API server parses boolean query parameters."""
    if value in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if value in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise bad_request(f'invalid value for {name}: strconv.ParseBool: parsing "{value}": '
                      "invalid syntax")


def parse_int(name, value):
    try:
        return int(value, 10)
    except ValueError:
        raise bad_request(f'invalid value for {name}: strconv.ParseInt: parsing "{value}": '
                          "invalid syntax") from None


def parse_rv(value):
    try:
        rv = int(value, 10)
        if rv < 0:
            raise ValueError
        return rv
    except ValueError:
        raise bad_request(f'invalid resource version "{value}": resourceVersion must be an '
                          "unsigned integer") from None


# ---------------------------------------------------------------------------------------------
# Label selectors (k8s.io/apimachinery/pkg/labels grammar) and field selectors
# ---------------------------------------------------------------------------------------------

_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS1123_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def label_key_error(key):
    """None when `key` is a valid label key (a qualified name), else why not."""
    prefix, slash, name = key.rpartition("/")
    if slash:
        if not prefix:
            return f'prefix part must be non-empty (key "{key}")'
        if len(prefix) > 253 or not _DNS1123_SUBDOMAIN_RE.match(prefix):
            return (f'prefix part a lowercase RFC 1123 subdomain must consist of lower case '
                    f"alphanumeric characters, '-' or '.' (key \"{key}\")")
    if not name:
        return f'name part must be non-empty (key "{key}")'
    if len(name) > 63:
        return f'name part must be no more than 63 characters (key "{key}")'
    if not _NAME_RE.match(name):
        return (f"name part must consist of alphanumeric characters, '-', '_' or '.', and must "
                f"start and end with an alphanumeric character (key \"{key}\")")
    return None


def label_value_error(value):
    if len(value) > 63:
        return f'must be no more than 63 characters (value "{value}")'
    if not _VALUE_RE.match(value):
        return (f"a valid label must be an empty string or consist of alphanumeric characters, "
                f"'-', '_' or '.', and must start and end with an alphanumeric character "
                f"(value \"{value}\")")
    return None


class SelectorError(Exception):
    pass


_SPECIAL = "=!(),<>"


def _lex(s):
    toks = []
    i = 0
    while i < len(s):
        c = s[i]
        if c.isspace():
            i += 1
            continue
        if c in _SPECIAL:
            two = s[i:i + 2]
            if two in ("==", "!="):
                toks.append((two, two))
                i += 2
            else:
                toks.append((c, c))
                i += 1
            continue
        j = i
        while j < len(s) and not s[j].isspace() and s[j] not in _SPECIAL:
            j += 1
        lit = s[i:j]
        toks.append((lit if lit in ("in", "notin") else "ID", lit))
        i = j
    toks.append(("EOS", ""))
    return toks


class LabelSelector:
    """A parsed label selector: a list of (key, op, values); empty matches everything."""

    def __init__(self, text):
        self.text = text
        self.reqs = self._parse(text)

    def _parse(self, text):
        toks = _lex(text)
        pos = [0]

        def peek(values_mode):
            t, lit = toks[pos[0]]
            if values_mode and t in ("in", "notin"):
                t = "ID"
            return t, lit

        def consume(values_mode):
            r = peek(values_mode)
            if pos[0] < len(toks) - 1:
                pos[0] += 1
            return r

        reqs = []
        while True:
            t, lit = peek(False)
            if t == "EOS":
                return reqs
            if t not in ("ID", "!"):
                raise SelectorError(f"found '{lit}', expected: !, identifier, or 'end of string'")
            reqs.append(self._requirement(peek, consume))
            t, lit = consume(True)
            if t == "EOS":
                return reqs
            if t == ",":
                t2, l2 = peek(True)
                if t2 not in ("ID", "!"):
                    raise SelectorError(f"found '{l2}', expected: identifier after ','")
                continue
            raise SelectorError(f"found '{lit}', expected: ',' or 'end of string'")

    @staticmethod
    def _requirement(peek, consume):
        op = None
        t, lit = consume(True)
        if t == "!":
            op = "!"
            t, lit = consume(True)
        if t != "ID":
            raise SelectorError(f"found '{lit}', expected: identifier")
        key = lit
        err = label_key_error(key)
        if err:
            raise SelectorError(f"unable to parse requirement: invalid label key: {err}")
        if op == "!":
            return (key, "!", ())
        t, _ = peek(True)
        if t in ("EOS", ","):
            return (key, "exists", ())
        t, lit = consume(False)
        ops = {"=": "=", "==": "=", "!=": "!=", "in": "in", "notin": "notin", ">": "gt", "<": "lt"}
        if t not in ops:
            raise SelectorError(
                f"found '{lit}', expected: in, notin, =, ==, !=, gt, lt")
        op = ops[t]
        if op in ("in", "notin"):
            values = LabelSelector._values(peek, consume)
        else:
            t, lit = peek(True)
            if t in ("EOS", ","):
                values = {""}
            else:
                t, lit = consume(True)
                if t != "ID":
                    raise SelectorError(f"found '{lit}', expected: identifier")
                values = {lit}
        for v in values:
            err = label_value_error(v)
            if err:
                raise SelectorError(f"unable to parse requirement: invalid label value: {err}")
        if op in ("gt", "lt"):
            (v,) = values
            try:
                int(v)
            except ValueError:
                raise SelectorError(
                    "unable to parse requirement: for 'Gt', 'Lt' operators, the value must be an "
                    f"integer (value \"{v}\")") from None
        return (key, op, frozenset(values))

    @staticmethod
    def _values(peek, consume):
        t, lit = consume(True)
        if t != "(":
            raise SelectorError(f"found '{lit}', expected: '('")
        t, lit = peek(True)
        if t == ")":
            consume(True)
            return {""}
        if t not in ("ID", ","):
            raise SelectorError(f"found '{lit}', expected: ',', ')' or identifier")
        s = set()
        while True:
            t, lit = consume(True)
            if t == "ID":
                s.add(lit)
                t2, l2 = peek(True)
                if t2 == ",":
                    consume(True)
                    t3, _ = peek(True)
                    if t3 == ")":
                        s.add("")
                        break
                    continue
                if t2 == ")":
                    break
                raise SelectorError(f"found '{l2}', expected: ',' or ')'")
            if t == ",":
                s.add("")
                t2, _ = peek(True)
                if t2 == ")":
                    break
                continue
            raise SelectorError(f"found '{lit}', expected: ',', or identifier")
        t, lit = consume(True)
        if t != ")":
            raise SelectorError(f"found '{lit}', expected: ')'")
        return s

    def matches(self, labels):
        for key, op, values in self.reqs:
            has = key in labels
            v = labels.get(key)
            if op == "exists":
                ok = has
            elif op == "!":
                ok = not has
            elif op == "=":
                ok = has and v in values
            elif op == "!=":
                ok = not has or v not in values
            elif op == "in":
                ok = has and v in values
            elif op == "notin":
                ok = not has or v not in values
            else:
                (bound,) = values
                try:
                    n = int(v) if has else None
                except ValueError:
                    n = None
                ok = n is not None and (n > int(bound) if op == "gt" else n < int(bound))
            if not ok:
                return False
        return True


def _pod_field(obj, field):
    meta, spec, st = obj["metadata"], obj.get("spec", {}), obj.get("status", {})
    if field == "metadata.name":
        return meta.get("name", "")
    if field == "metadata.namespace":
        return meta.get("namespace", "")
    if field == "spec.nodeName":
        return spec.get("nodeName", "")
    if field == "spec.restartPolicy":
        return spec.get("restartPolicy", "")
    if field == "spec.schedulerName":
        return spec.get("schedulerName", "")
    if field == "spec.serviceAccountName":
        return spec.get("serviceAccountName", "")
    if field == "spec.hostNetwork":
        return "true" if spec.get("hostNetwork") else "false"
    if field == "status.phase":
        return st.get("phase", "")
    if field == "status.podIP":
        return st.get("podIP", "")
    if field == "status.nominatedNodeName":
        return st.get("nominatedNodeName", "")
    raise KeyError(field)


POD_FIELDS = ("metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy",
              "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork", "status.phase",
              "status.podIP", "status.nominatedNodeName")


def _split_unescaped(s, sep):
    out, cur, i = [], [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            cur.append(s[i:i + 2])
            i += 2
            continue
        if s[i] == sep:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(s[i])
        i += 1
    out.append("".join(cur))
    return out


def _unescape(v):
    out, i = [], 0
    while i < len(v):
        if v[i] == "\\":
            if i + 1 >= len(v) or v[i + 1] not in "\\,=":
                raise SelectorError(f"invalid field selector: invalid escape sequence in {v!r}")
            out.append(v[i + 1])
            i += 2
            continue
        out.append(v[i])
        i += 1
    return "".join(out)


class FieldSelector:
    def __init__(self, text):
        self.text = text
        self.reqs = []
        for term in _split_unescaped(text, ","):
            if not term:
                continue
            for i in range(len(term)):
                op = next((o for o in ("!=", "==", "=") if term.startswith(o, i)), None)
                if op:
                    break
            else:
                raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
            field, value = term[:i], _unescape(term[i + len(op):])
            if field not in POD_FIELDS:
                raise SelectorError(f'field label not supported: {field}')
            self.reqs.append((field, op != "!=", value))

    def matches(self, obj):
        return all((_pod_field(obj, f) == v) == eq for f, eq, v in self.reqs)

    def names(self):
        return [v for f, eq, v in self.reqs if f == "metadata.name" and eq]


class Filter:
    """Namespace scope + label selector + field selector of one request."""

    def __init__(self, namespace, label_text, field_text):
        self.namespace = namespace
        try:
            self.labels = LabelSelector(label_text or "")
        except SelectorError as e:
            raise bad_request(f"unable to parse labelSelector {label_text!r}: {e}") from None
        try:
            self.fields = FieldSelector(field_text or "")
        except SelectorError as e:
            raise bad_request(str(e)) from None
        self.trivial_selectors = not self.labels.reqs and not self.fields.reqs

    def matches(self, obj):
        meta = obj["metadata"]
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels") or {}) and self.fields.matches(obj)


# ---------------------------------------------------------------------------------------------
# Pods: the control API's parameters and the objects served
# ---------------------------------------------------------------------------------------------

POD_PARAMS = {"name", "namespace", "ip", "labels", "annotations", "ready", "phase", "ports",
              "container", "image", "node", "hostIP", "restartCount"}
PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")


class ControlError(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def _check_labels(kind, d):
    if not isinstance(d, dict):
        raise ControlError(400, f"{kind} must be an object")
    for k, v in d.items():
        err = label_key_error(k)
        if err:
            raise ControlError(400, f"invalid {kind} key: {err}")
        if v is not None and not isinstance(v, str):
            raise ControlError(400, f"{kind} value of {k} must be a string or null")
        if kind == "labels" and v is not None:
            err = label_value_error(v)
            if err:
                raise ControlError(400, f"invalid label value: {err}")


def _normalize_ports(ports):
    if not isinstance(ports, list):
        raise ControlError(400, "ports must be a list")
    out = []
    for p in ports:
        if not isinstance(p, dict) or not isinstance(p.get("containerPort"), int):
            raise ControlError(400, "each port needs an integer containerPort")
        q = {}
        if p.get("name"):
            q["name"] = str(p["name"])
        q["containerPort"] = p["containerPort"]
        q["protocol"] = p.get("protocol", "TCP")
        out.append(q)
    return out


def apply_params(params, body, creating):
    """params updated by a control API body (labels/annotations merged, null deletes a key)."""
    unknown = set(body) - POD_PARAMS
    if unknown:
        raise ControlError(400, f"unknown pod fields: {sorted(unknown)}")
    p = dict(params)
    for key in ("labels", "annotations"):
        if key in body and body[key] is not None:
            _check_labels(key, body[key])
            merged = dict(p.get(key) or {})
            for k, v in body[key].items():
                if v is None:
                    merged.pop(k, None)
                else:
                    merged[k] = v
            p[key] = merged
    if "ready" in body:
        if not isinstance(body["ready"], bool):
            raise ControlError(400, "ready must be a boolean")
        p["ready"] = body["ready"]
    if "phase" in body:
        if body["phase"] not in PHASES:
            raise ControlError(400, f"phase must be one of {PHASES}")
        p["phase"] = body["phase"]
    if "ports" in body:
        p["ports"] = _normalize_ports(body["ports"] or [])
    for key in ("container", "image", "node", "hostIP"):
        if key in body:
            if not isinstance(body[key], str) or not body[key]:
                raise ControlError(400, f"{key} must be a non-empty string")
            p[key] = body[key]
    if "ip" in body:
        if body["ip"] is not None and not isinstance(body["ip"], str):
            raise ControlError(400, "ip must be a string or null")
        p["ip"] = body["ip"] or None
    if "restartCount" in body:
        if not isinstance(body["restartCount"], int):
            raise ControlError(400, "restartCount must be an integer")
        p["restartCount"] = body["restartCount"]
    if not creating:
        for key in ("name", "namespace"):
            if key in body and body[key] != params[key]:
                raise ControlError(400, f"{key} cannot be changed")
    return p


def _effective_ready(p):
    return bool(p["ready"]) and p["phase"] == "Running" and not p.get("deletionTimestamp")


def render_pod(p, rv):
    """The Pod object of params `p` at resourceVersion `rv`."""
    created = p["created"]
    meta = {"name": p["name"], "namespace": p["namespace"], "uid": p["uid"],
            "resourceVersion": str(rv), "creationTimestamp": rfc3339(created)}
    if p.get("labels"):
        meta["labels"] = dict(p["labels"])
    if p.get("annotations"):
        meta["annotations"] = dict(p["annotations"])
    if p.get("deletionTimestamp"):
        meta["deletionTimestamp"] = rfc3339(p["deletionTimestamp"])
        meta["deletionGracePeriodSeconds"] = p["deletionGracePeriodSeconds"]
    container = {"name": p["container"], "image": p["image"], "resources": {},
                 "terminationMessagePath": "/dev/termination-log",
                 "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}
    if p["ports"]:
        container["ports"] = [dict(x) for x in p["ports"]]
    spec = {"containers": [container], "restartPolicy": "Always",
            "terminationGracePeriodSeconds": DEFAULT_GRACE_S, "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default", "serviceAccount": "default",
            "nodeName": p["node"], "securityContext": {}, "schedulerName": "default-scheduler",
            "enableServiceLinks": True, "preemptionPolicy": "PreemptLowerPriority", "priority": 0}
    ready = _effective_ready(p)
    started = rfc3339(created)
    rt = rfc3339(p["readyTransition"])
    not_ready = {"reason": "ContainersNotReady",
                 "message": f"containers with unready status: [{p['container']}]"}
    ready_cond = {"type": "Ready", "status": "True" if ready else "False",
                  "lastProbeTime": None, "lastTransitionTime": rt}
    cready_cond = {"type": "ContainersReady", "status": "True" if ready else "False",
                   "lastProbeTime": None, "lastTransitionTime": rt}
    if not ready:
        ready_cond.update(not_ready)
        cready_cond.update(not_ready)
    phase = p["phase"]
    conditions = [
        {"type": "PodReadyToStartContainers", "status": "False" if phase == "Pending" else "True",
         "lastProbeTime": None, "lastTransitionTime": started},
        {"type": "Initialized", "status": "True", "lastProbeTime": None,
         "lastTransitionTime": started},
        ready_cond, cready_cond,
        {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
         "lastTransitionTime": started},
    ]
    cs = {"name": p["container"], "ready": ready, "restartCount": p["restartCount"],
          "image": p["image"], "imageID": "", "containerID": "containerd://" + p["containerID"]}
    if phase == "Pending":
        cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
        cs["started"] = False
        cs.pop("containerID")
    elif phase in ("Succeeded", "Failed"):
        cs["state"] = {"terminated": {
            "exitCode": 0 if phase == "Succeeded" else 1,
            "reason": "Completed" if phase == "Succeeded" else "Error",
            "startedAt": started, "finishedAt": rfc3339(p["phaseTime"]),
            "containerID": "containerd://" + p["containerID"]}}
        cs["started"] = False
    else:
        cs["state"] = {"running": {"startedAt": started}}
        cs["started"] = True
    cs["lastState"] = {}
    status = {"phase": phase, "conditions": conditions, "hostIP": p["hostIP"],
              "hostIPs": [{"ip": p["hostIP"]}]}
    if p.get("ip"):
        status["podIP"] = p["ip"]
        status["podIPs"] = [{"ip": p["ip"]}]
    status["startTime"] = started
    status["containerStatuses"] = [cs]
    status["qosClass"] = "BestEffort"
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": spec, "status": status}


def with_rv(obj, rv):
    """A shallow copy of `obj` with metadata.resourceVersion = rv."""
    out = dict(obj)
    out["metadata"] = dict(obj["metadata"], resourceVersion=str(rv))
    return out


# ---------------------------------------------------------------------------------------------
# Server-side printing (meta.k8s.io Table)
# ---------------------------------------------------------------------------------------------

POD_COLUMNS = [
    {"name": "Name", "type": "string", "format": "name", "priority": 0,
     "description": "Name must be unique within a namespace."},
    {"name": "Ready", "type": "string", "format": "", "priority": 0,
     "description": "The aggregate readiness state of this pod for accepting traffic."},
    {"name": "Status", "type": "string", "format": "", "priority": 0,
     "description": "The aggregate status of the containers in this pod."},
    {"name": "Restarts", "type": "string", "format": "", "priority": 0,
     "description": "The number of times the containers in this pod have been restarted and when "
                    "the last container in this pod has restarted."},
    {"name": "Age", "type": "string", "format": "", "priority": 0,
     "description": "CreationTimestamp is a timestamp representing the server time when this "
                    "object was created."},
    {"name": "IP", "type": "string", "format": "", "priority": 1,
     "description": "podIP address allocated to the pod."},
    {"name": "Node", "type": "string", "format": "", "priority": 1,
     "description": "NodeName is a request to schedule this pod onto a specific node."},
    {"name": "Nominated Node", "type": "string", "format": "", "priority": 1,
     "description": "nominatedNodeName is set only when this pod preempts other pods on the node."},
    {"name": "Readiness Gates", "type": "string", "format": "", "priority": 1,
     "description": "If specified, all readiness gates will be evaluated for pod readiness."},
]


def human_duration(seconds):
    s = int(seconds)
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = s // 3600
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if h < 24 * 8:
        return f"{h // 24}d{h % 24}h" if h % 24 else f"{h // 24}d"
    if h < 24 * 365 * 2:
        return f"{h // 24}d"
    return f"{h // (24 * 365)}y{(h // 24) % 365}d"


def _parse_ts(ts):
    return datetime.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def pod_row(obj, include_object, meta_version):
    meta, st = obj["metadata"], obj.get("status", {})
    statuses = st.get("containerStatuses") or []
    total = len(obj.get("spec", {}).get("containers", []))
    ready = sum(1 for c in statuses if c.get("ready"))
    restarts = sum(c.get("restartCount", 0) for c in statuses)
    reason = st.get("reason") or st.get("phase") or "Unknown"
    for c in statuses:
        state = c.get("state", {})
        if state.get("waiting", {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif state.get("terminated", {}).get("reason"):
            reason = state["terminated"]["reason"]
    if meta.get("deletionTimestamp"):
        reason = "Terminating"
    age = human_duration(time.time() - _parse_ts(meta["creationTimestamp"]))
    row = {"cells": [meta["name"], f"{ready}/{total}", reason, str(restarts), age,
                     st.get("podIP") or "<none>", obj.get("spec", {}).get("nodeName") or "<none>",
                     "<none>", "<none>"]}
    if include_object == "Object":
        row["object"] = obj
    elif include_object == "Metadata":
        row["object"] = {"kind": "PartialObjectMetadata",
                         "apiVersion": f"meta.k8s.io/{meta_version}", "metadata": meta}
    return row


def make_table(objs, meta, include_object, meta_version, with_columns=True):
    return {"kind": "Table", "apiVersion": f"meta.k8s.io/{meta_version}", "metadata": meta,
            "columnDefinitions": POD_COLUMNS if with_columns else None,
            "rows": [pod_row(o, include_object, meta_version) for o in objs]}


class Format:
    """What the client accepts: plain JSON, or a meta.k8s.io Table."""

    def __init__(self, accept, query):
        self.table = None
        self.include_object = query.get("includeObject", "Metadata") or "Metadata"
        if self.include_object not in ("None", "Metadata", "Object"):
            raise bad_request(f'invalid value for includeObject: "{self.include_object}"')
        if not accept:
            return
        for part in accept.split(","):
            fields = [x.strip() for x in part.split(";")]
            mt = fields[0].lower()
            params = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
            if mt not in ("application/json", "*/*", "application/*"):
                continue
            if "as" not in params:
                return
            if (params["as"] == "Table" and params.get("g") == "meta.k8s.io"
                    and params.get("v") in ("v1", "v1beta1")):
                self.table = params["v"]
                return
        raise ApiError(406, "only the following media types are accepted: application/json, "
                            "application/json;as=Table;v=v1;g=meta.k8s.io", "NotAcceptable")


# ---------------------------------------------------------------------------------------------
# The cluster: pods, the global resourceVersion, the event history, open watches, faults
# ---------------------------------------------------------------------------------------------

class Event:
    __slots__ = ("rv", "type", "obj", "prev", "key", "_plain")

    def __init__(self, rv, type_, obj, prev, key):
        self.rv, self.type, self.obj, self.prev, self.key = rv, type_, obj, prev, key
        self._plain = {}


class Watcher:
    def __init__(self, cluster, flt, fmt, bookmarks, conn):
        self.cond = threading.Condition(cluster.lock)
        self.queue = collections.deque()
        self.filter = flt
        self.format = fmt
        self.bookmarks = bookmarks
        self.conn = conn
        self.bookmark_requested = False
        self.min_rv = 0            # events at or below this resourceVersion are not sent
        self.dropped = False
        self.sent_columns = False


class Cluster:
    def __init__(self, history):
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.pods = {}            # (namespace, name) -> Pod object (never mutated once stored)
        self.params = {}          # (namespace, name) -> control parameters
        self.rv = INITIAL_RESOURCE_VERSION
        self.history = collections.deque()
        self.history_max = max(1, history)
        self.compacted_rv = INITIAL_RESOURCE_VERSION   # history holds every event with rv > this
        self.watchers = set()
        self.ip_counter = 0
        self.faults = {"down": False, "garbage": "off", "stall_watches": False, "delay_ms": 0,
                       "status_code": 0}
        self.garbage_lists = 0
        self.stats = {"list_requests": 0, "watch_requests": 0, "get_requests": 0,
                      "unauthorized": 0, "requests": 0, "connections": 0,
                      "requests_by_path": collections.Counter(),
                      "watch_queries": collections.deque(maxlen=50)}

    # --- changes (call with the lock held) ---
    def _record(self, type_, key, obj, prev):
        ev = Event(self.rv, type_, obj, prev, key)
        self.history.append(ev)
        while len(self.history) > self.history_max:
            self.compacted_rv = self.history.popleft().rv
        for w in self.watchers:
            w.queue.append(("EVENT", ev))
            w.cond.notify()
        self.changed.notify_all()

    def _store(self, key, params, type_):
        self.rv += 1
        obj = render_pod(params, self.rv)
        prev = self.pods.get(key)
        self.pods[key] = obj
        self.params[key] = params
        self._record(type_, key, obj, prev)
        return obj

    def _new_params(self, body):
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise ControlError(400, "name is required")
        ns = body.get("namespace") or "default"
        if not isinstance(ns, str):
            raise ControlError(400, "namespace must be a string")
        now = time.time()
        base = {"name": name, "namespace": ns, "uid": str(uuid.uuid4()), "labels": {},
                "annotations": {}, "ready": False, "phase": "Running",
                "ports": [dict(x) for x in DEFAULT_PORTS], "container": "engine",
                "image": DEFAULT_IMAGE, "node": DEFAULT_NODE, "hostIP": DEFAULT_HOST_IP,
                "restartCount": 0, "ip": None, "created": now, "readyTransition": now,
                "phaseTime": now, "containerID": secrets.token_hex(32)}
        p = apply_params(base, body, creating=True)
        if "ip" not in body and p["phase"] != "Pending":
            self.ip_counter += 1
            p["ip"] = f"10.244.{(self.ip_counter // 250) % 250}.{self.ip_counter % 250 + 1}"
        return (ns, name), p

    def create(self, bodies):
        with self.lock:
            made = []
            for body in bodies:
                if not isinstance(body, dict):
                    raise ControlError(400, "a pod must be an object")
                made.append(self._new_params(body))
            keys = [k for k, _ in made]
            if len(set(keys)) != len(keys):
                raise ControlError(400, "duplicate pods in one request")
            for k in keys:
                if k in self.pods:
                    raise ControlError(409, f'pods "{k[1]}" already exists in namespace {k[0]}')
            return [self._store(k, p, "ADDED") for k, p in made]

    def _get_params(self, key):
        if key not in self.params:
            raise ControlError(404, f'pods "{key[1]}" not found in namespace {key[0]}')
        return self.params[key]

    def patch(self, key, body):
        with self.lock:
            old = self._get_params(key)
            p = apply_params(old, body, creating=False)
            if _effective_ready(p) != _effective_ready(old):
                p["readyTransition"] = time.time()
            if p["phase"] != old["phase"]:
                p["phaseTime"] = time.time()
            if render_pod(p, 0) == render_pod(old, 0):
                return self.pods[key]          # a no-op update: no new resourceVersion, no event
            return self._store(key, p, "MODIFIED")

    def terminate(self, key, grace):
        with self.lock:
            old = self._get_params(key)
            if old.get("deletionTimestamp"):
                return self.pods[key]
            p = dict(old)
            now = time.time()
            p["deletionTimestamp"] = now + grace
            p["deletionGracePeriodSeconds"] = grace
            p["ready"] = False
            if _effective_ready(old):
                p["readyTransition"] = now
            return self._store(key, p, "MODIFIED")

    def _delete_locked(self, key):
        self._get_params(key)
        prev = self.pods.pop(key)
        del self.params[key]
        self.rv += 1
        obj = with_rv(prev, self.rv)
        self._record("DELETED", key, obj, prev)
        return obj

    def delete(self, key):
        with self.lock:
            return self._delete_locked(key)

    def replace(self, key, body):
        with self.lock:
            old = self._get_params(key)
            self._delete_locked(key)
            now = time.time()
            p = dict(old, uid=str(uuid.uuid4()), created=now, readyTransition=now, phaseTime=now,
                     containerID=secrets.token_hex(32), restartCount=0)
            p.pop("deletionTimestamp", None)
            p.pop("deletionGracePeriodSeconds", None)
            extra = {k: v for k, v in body.items() if k not in ("name", "namespace")}
            p = apply_params(p, extra, creating=False)
            if "ip" not in body:
                self.ip_counter += 1
                p["ip"] = f"10.244.{(self.ip_counter // 250) % 250}.{self.ip_counter % 250 + 1}"
            return self._store(key, p, "ADDED")

    def compact(self):
        with self.lock:
            self.history.clear()
            self.compacted_rv = self.rv

    # --- reads (call with the lock held) ---
    def state_at(self, rv):
        """The pods as they were at `rv` (rolled back through the history), or None if compacted."""
        if rv < self.compacted_rv:
            return None
        state = dict(self.pods)
        for ev in reversed(self.history):
            if ev.rv <= rv:
                break
            if ev.type == "ADDED":
                state.pop(ev.key, None)
            else:
                state[ev.key] = ev.prev
        return state

    def stats_snapshot(self):
        with self.lock:
            s = dict(self.stats)
            s["requests_by_path"] = dict(self.stats["requests_by_path"])
            s["watch_queries"] = list(self.stats["watch_queries"])
            s["open_watches"] = len(self.watchers)
            s["resource_version"] = str(self.rv)
            s["compacted_resource_version"] = str(self.compacted_rv)
            s["history"] = len(self.history)
            s["pods"] = len(self.pods)
            s["faults"] = dict(self.faults)
            return s


def _b64(s):
    return base64.urlsafe_b64encode(s.encode()).decode().rstrip("=")


def encode_continue(rv, key):
    return base64.b64encode(dumps({"v": "meta.k8s.io/v1", "rv": rv,
                                   "start": f"{key[0]}/{key[1]}\u0000"})).decode()


def decode_continue(token):
    try:
        d = json.loads(base64.b64decode(token + "=" * (-len(token) % 4), validate=False))
        if d.get("v") != "meta.k8s.io/v1":
            raise ValueError("unsupported version")
        rv = int(d["rv"])
        start = d["start"]
        if not start.endswith("\u0000"):
            raise ValueError("bad start")
        ns, _, name = start[:-1].partition("/")
        return rv, (ns, name)
    except Exception as e:
        raise bad_request(f"continue key is not valid: {e}") from None


# ---------------------------------------------------------------------------------------------
# TLS material, made with the openssl CLI
# ---------------------------------------------------------------------------------------------

TLS_FILES = ("ca.crt", "ca.key", "server.crt", "server.key")


def ensure_tls(tls_dir):
    os.makedirs(tls_dir, exist_ok=True)
    with open(os.path.join(tls_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(os.path.exists(os.path.join(tls_dir, f)) for f in TLS_FILES):
            return
        work = tempfile.mkdtemp(prefix=".gen-", dir=tls_dir)
        try:
            def run(*args):
                subprocess.run(["openssl", *args], cwd=work, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
            run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
                "-subj", "/CN=fake-kube-apiserver-ca",
                "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
                "-addext", "subjectKeyIdentifier=hash")
            run("req", "-new", *ec, "-keyout", "server.key", "-out", "server.csr",
                "-subj", "/CN=kube-apiserver")
            with open(os.path.join(work, "ext.cnf"), "w") as f:
                f.write("[v3]\n"
                        "basicConstraints=critical,CA:FALSE\n"
                        "keyUsage=critical,digitalSignature,keyEncipherment\n"
                        "extendedKeyUsage=serverAuth\n"
                        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                        "subjectKeyIdentifier=hash\n"
                        "authorityKeyIdentifier=keyid,issuer\n")
            run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-set_serial", "0x" + secrets.token_hex(16), "-days", "3650",
                "-extfile", "ext.cnf", "-extensions", "v3", "-out", "server.crt")
            for f in TLS_FILES:
                os.chmod(os.path.join(work, f), 0o600 if f.endswith(".key") else 0o644)
                os.replace(os.path.join(work, f), os.path.join(tls_dir, f))
        finally:
            shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The API port (HTTPS)
# ---------------------------------------------------------------------------------------------

class ApiServer:
    """Owns the listening socket (closed and reopened on the same port by the `down` fault) and
    every open API connection."""

    def __init__(self, cluster, args, port):
        self.cluster = cluster
        self.args = args
        self.port = port
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self.ctx.load_cert_chain(os.path.join(args.tls_dir, "server.crt"),
                                 os.path.join(args.tls_dir, "server.key"))
        self.ctx.set_alpn_protocols(["http/1.1"])
        self.sock = None
        self.accept_thread = None
        self.conns = set()
        self.conns_lock = threading.Lock()
        self.listen_lock = threading.Lock()

    def listen(self):
        with self.listen_lock:
            if self.sock is not None:
                return
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", self.port))
            except OSError:
                s.close()
                raise
            s.listen(256)
            self.port = s.getsockname()[1]
            self.sock = s
            self.accept_thread = threading.Thread(target=self._accept_loop, args=(s,), daemon=True)
            self.accept_thread.start()

    def close(self):
        """Close the listening socket and every open connection at once."""
        with self.listen_lock:
            s, self.sock = self.sock, None
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            t, self.accept_thread = self.accept_thread, None
        if t is not None:
            t.join(2)
        with self.conns_lock:
            conns = list(self.conns)
        for c in conns:
            abort_socket(c)

    def _accept_loop(self, s):
        while True:
            try:
                conn, addr = s.accept()
            except OSError:
                return
            if self.sock is not s:
                conn.close()
                return
            threading.Thread(target=self._serve_conn, args=(conn, addr), daemon=True).start()

    def _serve_conn(self, raw, addr):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.cluster.lock:
            self.cluster.stats["connections"] += 1
        try:
            raw.settimeout(10)
            conn = self.ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except OSError:
            raw.close()
            return
        with self.conns_lock:
            self.conns.add(conn)
        try:
            if self.sock is None:      # went down while this connection was being accepted
                return
            conn.do_handshake()
            conn.settimeout(None)
            ApiHandler(conn, addr, self)
        except Exception as e:  # noqa: BLE001 - a broken client must not break the server
            if not isinstance(e, (OSError, ssl.SSLError, ValueError)):
                log(f"connection error: {e!r}")
        finally:
            with self.conns_lock:
                self.conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass


def abort_socket(sock):
    """Shut the connection down from another thread (the owner thread closes the fd)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _client_gone(conn):
    """True if the peer closed the connection (checked between watch events)."""
    try:
        r, _, _ = select.select([conn], [], [], 0)
    except (OSError, ValueError):
        return True
    if not r:
        return False
    try:
        conn.settimeout(0.01)
        data = conn.recv(1)
        return data == b""
    except (socket.timeout, ssl.SSLWantReadError):
        return False
    except OSError:
        return True
    finally:
        try:
            conn.settimeout(None)
        except OSError:
            pass


_POD_LIST_RE = re.compile(r"^/api/v1(?:/watch)?(?:/namespaces/([^/]+))?/pods/?$")
_POD_ITEM_RE = re.compile(r"^/api/v1(/watch)?/namespaces/([^/]+)/pods/([^/]+)/?$")


class ApiHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-kube-apiserver"
    sys_version = ""

    def __init__(self, conn, addr, api):
        self.api = api
        self.cluster = api.cluster
        super().__init__(conn, addr, api)

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass

    def log_request(self, code="-", size="-"):
        log(f"{self.command} {self.path} {code}")

    # --- answers ---
    def _send_body(self, code, body, content_type="application/json", headers=None):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Audit-Id", str(uuid.uuid4()))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_json(self, code, obj, headers=None):
        self._send_body(code, dumps(obj), headers=headers)

    def send_error(self, code, message=None, explain=None):
        # Malformed requests (the base class's parser): answer a Status, close the connection.
        self.close_connection = True
        try:
            self.send_json(code, status_object(code, REASONS.get(code, "BadRequest"),
                                               message or "bad request"))
        except OSError:
            pass

    def _drain_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n > 0:
            self.rfile.read(n)

    # --- dispatch ---
    def do_GET(self):
        try:
            self._handle()
        except ApiError as e:
            self.send_json(e.code, e.status, e.headers)

    def do_HEAD(self):
        self._not_allowed()

    def _not_allowed(self):
        try:
            self._drain_body()
            self._gate()
            raise ApiError(405, "the server does not allow this method on the requested resource",
                           "MethodNotAllowed")
        except ApiError as e:
            self.send_json(e.code, e.status, e.headers)

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _not_allowed

    def _gate(self):
        """Counting, the delay fault, bearer-token auth, the status-code fault."""
        path = urllib.parse.urlsplit(self.path).path
        c = self.cluster
        with c.lock:
            c.stats["requests"] += 1
            c.stats["requests_by_path"][path] += 1
            delay = c.faults["delay_ms"]
            code = c.faults["status_code"]
        if delay:
            time.sleep(delay / 1000.0)
        if self.api.args.token_file:
            try:
                with open(self.api.args.token_file) as f:
                    token = f.read().strip()
            except OSError:
                token = None
            auth = self.headers.get("Authorization", "")
            scheme, _, presented = auth.strip().partition(" ")
            ok = bool(token) and scheme.lower() == "bearer" and presented.strip() == token
            if not ok:
                with c.lock:
                    c.stats["unauthorized"] += 1
                raise ApiError(401, "Unauthorized", "Unauthorized")
        if code:
            if code == 429:
                raise ApiError(429, "Too many requests, please try again later.",
                               "TooManyRequests", {"retryAfterSeconds": 1}, {"Retry-After": "1"})
            if code == 500:
                raise ApiError(500, "Internal error occurred: injected fault", "InternalError",
                               {"causes": [{"message": "injected fault"}]})
            raise ApiError(code, f"injected fault (status {code})", REASONS.get(code, "Unknown"))

    def _handle(self):
        self._drain_body()
        self._gate()
        parts = urllib.parse.urlsplit(self.path)
        path = parts.path
        raw_query = parts.query
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(raw_query, keep_blank_values=True).items()}

        if path in ("/version", "/version/"):
            return self.send_json(200, VERSION_INFO)
        if path in ("/api", "/api/"):
            return self.send_json(200, {
                "kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                                "serverAddress": f"127.0.0.1:{self.api.port}"}]})
        if path in ("/apis", "/apis/"):
            return self.send_json(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": []})
        if path in ("/api/v1", "/api/v1/"):
            return self.send_json(200, {
                "kind": "APIResourceList", "groupVersion": "v1",
                "resources": [{"name": "pods", "singularName": "pod", "namespaced": True,
                               "kind": "Pod", "verbs": ["get", "list", "watch"],
                               "shortNames": ["po"], "categories": ["all"],
                               "storageVersionHash": "xPOwRZ+Yhw8="}]})
        if path in ("/healthz", "/livez", "/readyz"):
            return self._send_body(200, b"ok", "text/plain; charset=utf-8")

        m = _POD_LIST_RE.match(path)
        if m:
            ns = m.group(1)
            legacy_watch = "/api/v1/watch/" in path + "/"
            watch = legacy_watch or (parse_bool("watch", q["watch"]) if q.get("watch") else False)
            if watch:
                return self._watch(ns, q, raw_query)
            return self._list(ns, q)
        m = _POD_ITEM_RE.match(path)
        if m:
            legacy_watch, ns, name = m.group(1), m.group(2), m.group(3)
            if legacy_watch:
                fs = q.get("fieldSelector")
                q["fieldSelector"] = f"metadata.name={name}" + (f",{fs}" if fs else "")
                return self._watch(ns, q, raw_query)
            return self._get(ns, name, q)
        raise ApiError(404, "the server could not find the requested resource", "NotFound", {})

    # --- get ---
    def _get(self, ns, name, q):
        fmt = Format(self.headers.get("Accept"), q)
        with self.cluster.lock:
            self.cluster.stats["get_requests"] += 1
            obj = self.cluster.pods.get((ns, name))
        if obj is None:
            raise not_found_pod(name)
        if fmt.table:
            return self.send_json(200, make_table(
                [obj], {"resourceVersion": obj["metadata"]["resourceVersion"]},
                fmt.include_object, fmt.table))
        self.send_json(200, obj)

    # --- list ---
    def _list(self, ns, q):
        c = self.cluster
        fmt = Format(self.headers.get("Accept"), q)
        flt = Filter(ns, q.get("labelSelector"), q.get("fieldSelector"))
        limit = parse_int("limit", q["limit"]) if q.get("limit") else 0
        cont = q.get("continue", "")
        rv_text = q.get("resourceVersion", "")
        rvm = q.get("resourceVersionMatch", "")
        if "sendInitialEvents" in q:
            raise invalid_list_options("sendInitialEvents", "Forbidden: sendInitialEvents is "
                                                            "forbidden for list")
        if rvm:
            if rvm not in ("NotOlderThan", "Exact"):
                raise invalid_list_options(
                    "resourceVersionMatch", f'Unsupported value: "{rvm}": supported values: '
                                            '"Exact", "NotOlderThan"', "FieldValueNotSupported")
            if not rv_text:
                raise invalid_list_options("resourceVersionMatch", "Forbidden: resourceVersionMatch "
                                           "is forbidden unless resourceVersion is provided")
            if cont:
                raise invalid_list_options("resourceVersionMatch", "Forbidden: resourceVersionMatch "
                                           "is forbidden when continue is provided")
            if rvm == "Exact" and rv_text == "0":
                raise invalid_list_options("resourceVersionMatch", 'Forbidden: resourceVersionMatch '
                                           '"exact" is forbidden for resourceVersion "0"')
        if cont and rv_text and rv_text != "0":
            raise bad_request("specifying resource version is not allowed when using continue")
        rv = parse_rv(rv_text) if rv_text else None
        token = decode_continue(cont) if cont else None

        with c.lock:
            c.stats["list_requests"] += 1
            if token is not None:
                list_rv, start = token
                state = c.state_at(list_rv)
                if state is None:
                    raise expired("The provided continue parameter is too old to display a "
                                  "consistent list result. You can start a new list without the "
                                  "continue parameter.")
            elif rvm == "Exact":
                state = c.state_at(rv)
                if state is None or rv > c.rv:
                    if rv > c.rv:
                        raise _too_large(rv, c.rv)
                    raise expired(f"The resourceVersion for the provided list is too old.")
                list_rv, start = rv, None
            else:
                if rv:
                    deadline = time.monotonic() + TOO_LARGE_RV_WAIT_S
                    while c.rv < rv and time.monotonic() < deadline:
                        c.changed.wait(deadline - time.monotonic())
                    if c.rv < rv:
                        raise _too_large(rv, c.rv)
                state = dict(c.pods)
                list_rv, start = c.rv, None
            garbage = c.faults["garbage"] in ("list", "both")
            if garbage:
                c.garbage_lists += 1
                garbage_kind = c.garbage_lists % 2
        # resourceVersion=0 is served from the watch cache, which ignores limit (as the real one).
        if rv_text == "0" and not cont:
            limit = 0
        keys = sorted(k for k in state if start is None or k > start)
        items = [state[k] for k in keys if flt.matches(state[k])]
        meta = {"resourceVersion": str(list_rv)}
        if limit > 0 and len(items) > limit:
            rest = len(items) - limit
            items = items[:limit]
            last = items[-1]["metadata"]
            meta["continue"] = encode_continue(list_rv, (last["namespace"], last["name"]))
            if flt.trivial_selectors:
                meta["remainingItemCount"] = rest
        if fmt.table:
            body = dumps(make_table(items, meta, fmt.include_object, fmt.table))
        else:
            body = dumps({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items})
        if garbage:
            body = b"<html><body>this is not JSON</body></html>" if garbage_kind else \
                body[:max(1, len(body) // 2)]
        self._send_body(200, body)

    # --- watch ---
    def _watch(self, ns, q, raw_query):
        c = self.cluster
        fmt = Format(self.headers.get("Accept"), q)
        flt = Filter(ns, q.get("labelSelector"), q.get("fieldSelector"))
        bookmarks = parse_bool("allowWatchBookmarks", q["allowWatchBookmarks"]) \
            if q.get("allowWatchBookmarks") else False
        timeout_s = parse_int("timeoutSeconds", q["timeoutSeconds"]) \
            if q.get("timeoutSeconds") else 0
        rv_text = q.get("resourceVersion", "")
        rvm = q.get("resourceVersionMatch", "")
        send_initial = parse_bool("sendInitialEvents", q["sendInitialEvents"]) \
            if q.get("sendInitialEvents") else None
        if send_initial is None:
            if rvm:
                raise invalid_list_options("resourceVersionMatch", "Forbidden: resourceVersionMatch "
                                           "is forbidden for watch unless sendInitialEvents is "
                                           "provided")
        else:
            if rvm != "NotOlderThan":
                raise invalid_list_options("resourceVersionMatch", "Forbidden: sendInitialEvents "
                                           "requires setting resourceVersionMatch to NotOlderThan")
            if not bookmarks:
                raise invalid_list_options("allowWatchBookmarks", "Forbidden: sendInitialEvents "
                                           "requires setting allowWatchBookmarks to true")
        rv = parse_rv(rv_text) if rv_text and rv_text != "0" else None
        if q.get("continue"):
            raise bad_request("continue is not supported for watch")

        with c.lock:
            c.stats["watch_requests"] += 1
            c.stats["watch_queries"].append(raw_query)
        w = Watcher(c, flt, fmt, bookmarks, self.connection)
        error_event = None
        with c.lock:
            if send_initial is True or (send_initial is None and rv is None):
                for k in sorted(c.pods):
                    w.queue.append(("SYNTH", c.pods[k]))
                if send_initial:
                    w.queue.append(("INITIAL_END", c.rv))
            elif rv is not None:
                w.min_rv = rv
                if rv < c.compacted_rv:
                    error_event = {"type": "ERROR", "object": status_object(
                        410, "Expired", f"too old resource version: {rv} ({c.compacted_rv})")}
                else:
                    for ev in c.history:
                        if ev.rv > rv:
                            w.queue.append(("EVENT", ev))
            if error_event is None:
                if c.faults["garbage"] in ("watch", "both"):
                    w.queue.append(("GARBAGE", None))
                c.watchers.add(w)

        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Audit-Id", str(uuid.uuid4()))
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if error_event is not None:
            try:
                self._chunk(dumps(error_event) + b"\n")
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True
            return
        try:
            clean = self._stream(w, timeout_s)
            if clean:
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.close_connection = True
                abort_socket(self.connection)
        except OSError:
            self.close_connection = True
        finally:
            with c.lock:
                c.watchers.discard(w)

    def _chunk(self, data):
        self.wfile.write(b"%x\r\n" % len(data) + data + b"\r\n")

    def _stream(self, w, timeout_s):
        """Write the watcher's events until the timeout (True) or an abort (False)."""
        c = self.cluster
        interval = max(0.01, self.api.args.bookmark_interval_s)
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        next_bookmark = time.monotonic() + interval
        last_check = time.monotonic()
        while True:
            batch = None
            with c.lock:
                while True:
                    if w.dropped:
                        return False
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        return True
                    stalled = c.faults["stall_watches"]
                    if not stalled and w.queue:
                        batch = list(w.queue)
                        w.queue.clear()
                        break
                    if not stalled and w.bookmarks and (w.bookmark_requested
                                                        or now >= next_bookmark):
                        w.bookmark_requested = False
                        next_bookmark = now + interval
                        batch = [("BOOKMARK", c.rv)]
                        break
                    if now - last_check >= 0.5:
                        break
                    wait = 0.5 - (now - last_check)
                    if deadline is not None:
                        wait = min(wait, deadline - now)
                    if w.bookmarks and not stalled:
                        wait = min(wait, next_bookmark - now)
                    w.cond.wait(max(0.001, wait))
            if batch is None:
                last_check = time.monotonic()
                if _client_gone(self.connection):
                    return False
                continue
            for item in batch:
                data = self._encode(w, item)
                if data is not None:
                    self._chunk(data)

    def _encode(self, w, item):
        kind, x = item
        if kind == "GARBAGE":
            return b"this is not JSON {\"type\": \n"
        if kind in ("BOOKMARK", "INITIAL_END"):
            meta = {"resourceVersion": str(x)}
            if kind == "INITIAL_END":
                meta["annotations"] = {INITIAL_EVENTS_END: "true"}
            if w.format.table:
                obj = make_table([], meta, w.format.include_object, w.format.table, False)
            else:
                obj = {"kind": "Pod", "apiVersion": "v1", "metadata": meta}
            return dumps({"type": "BOOKMARK", "object": obj}) + b"\n"
        if kind == "SYNTH":
            if not w.filter.matches(x):
                return None
            type_, obj, ev = "ADDED", x, None
        else:
            ev = x
            if ev.rv <= w.min_rv:
                return None
            if ev.type == "DELETED":
                if not w.filter.matches(ev.obj):
                    return None
                type_, obj = "DELETED", ev.obj
            else:
                cur = w.filter.matches(ev.obj)
                old = ev.prev is not None and w.filter.matches(ev.prev)
                if cur and old:
                    type_, obj = "MODIFIED", ev.obj
                elif cur:
                    type_, obj = "ADDED", ev.obj
                elif old:
                    # Leaving the selector: DELETED with the previous state at the event's version.
                    type_, obj = "DELETED", with_rv(ev.prev, ev.rv)
                else:
                    return None
        if w.format.table:
            table = make_table([obj], {"resourceVersion": obj["metadata"]["resourceVersion"]},
                               w.format.include_object, w.format.table, not w.sent_columns)
            w.sent_columns = True
            return dumps({"type": type_, "object": table}) + b"\n"
        if ev is not None:
            cached = ev._plain.get(type_)
            if cached is None:
                cached = ev._plain[type_] = dumps({"type": type_, "object": obj}) + b"\n"
            return cached
        return dumps({"type": type_, "object": obj}) + b"\n"


def _too_large(rv, current):
    return ApiError(504, f"Too large resource version: {rv}, current: {current}", "Timeout",
                    {"causes": [{"reason": "ResourceVersionTooLarge",
                                 "message": "Too large resource version"}],
                     "retryAfterSeconds": 1}, {"Retry-After": "1"})


# ---------------------------------------------------------------------------------------------
# The control API (plain HTTP)
# ---------------------------------------------------------------------------------------------

class ControlHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-kube-apiserver-control"
    sys_version = ""

    def log_message(self, format, *args):  # noqa: A002
        pass

    def log_request(self, code="-", size="-"):
        log(f"control {self.command} {self.path} {code}")

    def _reply(self, code, obj):
        body = dumps(obj)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n == 0:
            return {}
        try:
            body = json.loads(self.rfile.read(n))
        except ValueError as e:
            raise ControlError(400, f"body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ControlError(400, "body must be a JSON object")
        return body

    def _dispatch(self):
        srv = self.server.app
        c = srv.cluster
        path = urllib.parse.urlsplit(self.path).path.rstrip("/") or "/"
        segs = [urllib.parse.unquote(s) for s in path.strip("/").split("/")] if path != "/" else []
        body = self._body() if self.command in ("POST", "PATCH", "PUT") else {}
        m = self.command
        if m == "GET" and segs == ["stats"]:
            return 200, c.stats_snapshot()
        if m == "GET" and segs == ["pods"]:
            with c.lock:
                items = [c.pods[k] for k in sorted(c.pods)]
                return 200, {"kind": "PodList", "apiVersion": "v1",
                             "metadata": {"resourceVersion": str(c.rv)}, "items": items}
        if m == "GET" and len(segs) == 3 and segs[0] == "pods":
            with c.lock:
                obj = c.pods.get((segs[1], segs[2]))
            if obj is None:
                raise ControlError(404, f'pods "{segs[2]}" not found in namespace {segs[1]}')
            return 200, obj
        if m == "POST" and segs == ["pods"]:
            return 201, c.create([body])[0]
        if m == "POST" and segs == ["pods", "bulk"]:
            pods = body.get("pods")
            if not isinstance(pods, list):
                raise ControlError(400, "pods must be a list")
            made = c.create(pods)
            return 201, {"created": len(made),
                         "resourceVersion": made[-1]["metadata"]["resourceVersion"] if made
                         else c.stats_snapshot()["resource_version"]}
        if m == "PATCH" and len(segs) == 3 and segs[0] == "pods":
            return 200, c.patch((segs[1], segs[2]), body)
        if m == "POST" and len(segs) == 4 and segs[0] == "pods" and segs[3] == "terminate":
            grace = body.get("gracePeriodSeconds", DEFAULT_GRACE_S)
            if not isinstance(grace, int) or grace < 0:
                raise ControlError(400, "gracePeriodSeconds must be a non-negative integer")
            return 200, c.terminate((segs[1], segs[2]), grace)
        if m == "DELETE" and len(segs) == 3 and segs[0] == "pods":
            return 200, c.delete((segs[1], segs[2]))
        if m == "POST" and segs == ["replace"]:
            name = body.get("name")
            if not isinstance(name, str) or not name:
                raise ControlError(400, "name is required")
            return 200, c.replace((body.get("namespace") or "default", name), body)
        if m == "POST" and segs == ["faults"]:
            return 200, srv.apply_faults(body)
        if m == "POST" and segs == ["stats", "reset"]:
            with c.lock:
                for k in ("list_requests", "watch_requests", "get_requests", "unauthorized",
                          "requests", "connections"):
                    c.stats[k] = 0
                c.stats["requests_by_path"].clear()
                c.stats["watch_queries"].clear()
            return 200, {}
        raise ControlError(404, f"no control endpoint {m} {path}")

    def _handle(self):
        try:
            code, obj = self._dispatch()
        except ControlError as e:
            code, obj = e.code, {"error": str(e)}
        except Exception as e:  # noqa: BLE001
            code, obj = 500, {"error": repr(e)}
        self._reply(code, obj)

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _handle


class ControlServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


# ---------------------------------------------------------------------------------------------
# The process
# ---------------------------------------------------------------------------------------------

class App:
    def __init__(self, args):
        self.args = args
        self.cluster = Cluster(args.history)
        self.api = ApiServer(self.cluster, args, args.port)
        self.control = ControlServer(("127.0.0.1", args.control_port), ControlHandler)
        self.control.app = self
        self.faults_lock = threading.Lock()

    def apply_faults(self, body):
        known = {"down", "drop_watches", "compact", "garbage", "stall_watches", "delay_ms",
                 "status_code", "bookmark_now"}
        unknown = set(body) - known
        if unknown:
            raise ControlError(400, f"unknown faults: {sorted(unknown)}")
        c = self.cluster
        if "garbage" in body and body["garbage"] not in ("off", "list", "watch", "both"):
            raise ControlError(400, "garbage must be off, list, watch or both")
        if "status_code" in body and body["status_code"] not in (0, None) and not (
                isinstance(body["status_code"], int) and 400 <= body["status_code"] <= 599):
            raise ControlError(400, "status_code must be 0 or 400..599")
        with self.faults_lock:
            if "down" in body:
                if body["down"]:
                    with c.lock:
                        c.faults["down"] = True
                    self.api.close()
                else:
                    try:
                        self.api.listen()
                    except OSError as e:
                        raise ControlError(500, f"cannot listen again on {self.api.port}: {e}")
                    with c.lock:
                        c.faults["down"] = False
            with c.lock:
                for k in ("garbage", "delay_ms"):
                    if k in body:
                        c.faults[k] = body[k] or (0 if k == "delay_ms" else "off")
                if "status_code" in body:
                    c.faults["status_code"] = body["status_code"] or 0
                if "stall_watches" in body:
                    c.faults["stall_watches"] = bool(body["stall_watches"])
                    for w in c.watchers:
                        w.cond.notify()
                if body.get("bookmark_now"):
                    for w in c.watchers:
                        w.bookmark_requested = True
                        w.cond.notify()
                if body.get("drop_watches"):
                    for w in c.watchers:
                        w.dropped = True
                        abort_socket(w.conn)
                        w.cond.notify()
            if body.get("compact"):
                c.compact()
            with c.lock:
                return dict(c.faults, resource_version=str(c.rv))

    def run(self, port_file):
        self.api.listen()
        threading.Thread(target=self.control.serve_forever, kwargs={"poll_interval": 0.2},
                         daemon=True).start()
        info = {"port": self.api.port, "control_port": self.control.server_address[1],
                "pid": os.getpid(), "ca_file": os.path.join(self.args.tls_dir, "ca.crt"),
                "server": f"https://127.0.0.1:{self.api.port}", "tls_dir": self.args.tls_dir}
        tmp = f"{port_file}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, port_file)
        log(f"listening on {info['server']} (control http://127.0.0.1:{info['control_port']})")


def main(argv=None):
    global QUIET
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port_file", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--control_port", type=int, default=0)
    ap.add_argument("--tls_dir", default="")
    ap.add_argument("--token_file", default="")
    ap.add_argument("--bookmark_interval_s", type=float, default=1.0)
    ap.add_argument("--history", type=int, default=10000)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    QUIET = args.quiet
    made_tls_dir = None
    if not args.tls_dir:
        made_tls_dir = args.tls_dir = tempfile.mkdtemp(prefix="fake-kube-apiserver-tls-")
    args.tls_dir = os.path.abspath(args.tls_dir)
    ensure_tls(args.tls_dir)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    app = App(args)
    app.run(args.port_file)
    while not stop.wait(0.5):
        pass
    log("stopping")
    if made_tls_dir:
        shutil.rmtree(made_tls_dir, ignore_errors=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
