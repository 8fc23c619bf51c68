#!/usr/bin/python3
"""eldr-router replicas sharing one redis-server (--cluster_redis), on this machine, over loopback.

Measures what docs/benchmarks.md ("Router replicas through Redis") reports:
  1. Route latency of one replica under eldr-bench load (RATE routes/s, int16 counts, Complete for every lease,
     daemon pinned to CPU 0, the load generator, the other replicas and Redis on CPU 1), with and
     without --cluster_redis, the arms alternating RUNS times; client p50/p99 and the server's
     decision p50/p99 (eldr_route_duration_seconds delta between two scrapes).
  2. Redis traffic: bytes in + out per second (INFO stats) while one replica routes at full rate
     and the others idle, and with every replica idle; a routing replica's share is the loaded
     total minus the idle replicas' shares.
  3. Convergence: after an admin reload on the leader (the path a refit's install takes) and
     after the leader's own periodic refits, the time until every follower serves the leader's
     generation (eldr_cluster_centroid_generation polled every few ms).
  4. Leader change: SIGKILL (the lease runs out) and SIGTERM (released) of the leader, the time
     until another replica reports the leader role.

Usage: scripts/bench-cluster.py [BUILD_DIR]    (default: build)
  env: RUNS (3), DURATION_S (10), IDLE_S (20), RATE (10000 routes/s; 0: closed loop), CONCURRENCY (16), REPLICAS (3),
       RELOADS (10), KILLS (3)
Prints one JSON object per measurement, then a summary object.
"""

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
BIN = os.path.join(BUILD, "bin")
RUNS = int(os.environ.get("RUNS", "3"))
RATE = float(os.environ.get("RATE", "10000"))
DURATION_S = float(os.environ.get("DURATION_S", "10"))
CONCURRENCY = int(os.environ.get("CONCURRENCY", "16"))
REPLICAS = int(os.environ.get("REPLICAS", "3"))
RELOADS = int(os.environ.get("RELOADS", "10"))
KILLS = int(os.environ.get("KILLS", "3"))
REFIT_WATCH_S = float(os.environ.get("REFIT_WATCH_S", "35"))
IDLE_S = float(os.environ.get("IDLE_S", "20"))
PIN = os.cpu_count() is not None and os.cpu_count() >= 2
REDIS_SERVER = os.environ.get("ELDR_REDIS_SERVER", shutil.which("redis-server") or "/usr/bin/redis-server")
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def emit(obj):
    print(json.dumps(obj), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def taskset(cpu):
    return ["taskset", "-c", str(cpu)] if PIN else []


class Redis:
    def __init__(self, work):
        self.port = free_port()
        self.dir = os.path.join(work, "redis")
        os.makedirs(self.dir, exist_ok=True)
        self.proc = subprocess.Popen(
            taskset(1) + [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            if self.cli("PING") == "PONG":
                return
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer")

    def cli(self, *args):
        done = subprocess.run([REDIS_CLI, "-p", str(self.port)] + list(args), capture_output=True, text=True)
        return done.stdout.strip()

    def net_bytes(self):
        info = self.cli("INFO", "stats")
        get = lambda key: int(re.search(key + r":(\d+)", info).group(1))
        return get("total_net_input_bytes") + get("total_net_output_bytes")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class Router:
    def __init__(self, work, name, cpu, args):
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir, exist_ok=True)
        ports = os.path.join(self.dir, "ports.json")
        self.log = open(os.path.join(self.dir, "router.log"), "w")
        self.proc = subprocess.Popen(
            taskset(cpu) + [os.path.join(BIN, "eldr-router"), "--listen=127.0.0.1:0", "--admin_listen=127.0.0.1:0",
                            "--metrics_listen=127.0.0.1:0", "--port_file=" + ports, "--log_level=warning"] + args,
            stdout=subprocess.DEVNULL, stderr=self.log)
        for _ in range(400):
            if os.path.exists(ports) and os.path.getsize(ports) > 0:
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: " + open(self.log.name).read())
            time.sleep(0.025)
        p = json.load(open(ports))
        self.grpc_port, self.admin_port, self.metrics_port = p["grpc_port"], p["admin_port"], p["metrics_port"]

    def metrics(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
            return r.read().decode()

    def value(self, name, labels=""):
        text = self.metrics()
        m = re.search("^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)$",
                      text, re.M)
        return float(m.group(1)) if m else None

    def leader(self):
        try:
            return self.value("eldr_cluster_role", 'role="leader"') == 1
        except OSError:
            return False

    def generation(self):
        return self.value("eldr_cluster_centroid_generation", 'kind="installed"')

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)
        self.log.close()


def decision_percentiles(before, after):
    def buckets(text):
        counts = {}
        for m in re.finditer(r'^eldr_route_duration_seconds_bucket\{(.*)\} (\S+)$', text, re.M):
            le = re.search(r'le="([^"]+)"', m.group(1)).group(1)
            counts[le] = counts.get(le, 0.0) + float(m.group(2))
        return counts
    b, a = buckets(before), buckets(after)
    bounds = sorted(a, key=lambda le: float("inf") if le == "+Inf" else float(le))
    delta = [(float("inf") if le == "+Inf" else float(le), a[le] - b.get(le, 0.0)) for le in bounds]
    total = delta[-1][1] if delta else 0
    out = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        low, below, value = 0.0, 0.0, None
        for upper, cumulative in delta:
            if total > 0 and cumulative >= q * total:
                value = low if upper == float("inf") else low + (upper - low) * (q * total - below) / max(
                    cumulative - below, 1e-12)
                break
            low, below = upper, cumulative
        out["server_" + name + "_us"] = None if value is None else round(value * 1e6, 2)
    return out


def bench(router, duration=DURATION_S):
    before = router.metrics()
    out = subprocess.run(
        taskset(1) + [os.path.join(BIN, "eldr-bench"), f"--target=127.0.0.1:{router.grpc_port}",
                      f"--duration_s={duration}", f"--concurrency={CONCURRENCY}", "--geometry=48x128",
                      "--encoding=int16", "--complete", "--json", f"--rate={RATE}"],
        capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    result.update(decision_percentiles(before, router.metrics()))
    return result


def wait_for(condition, timeout, step=0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return False


def main():
    for tool in ("eldr-router", "eldr-bench"):
        if not os.access(os.path.join(BIN, tool), os.X_OK):
            sys.exit(f"bench-cluster.py: {BIN}/{tool} is missing; build first")
    work = tempfile.mkdtemp(prefix="eldr-bench-cluster-")
    routers = []
    redis = None
    try:
        subprocess.run([os.path.join(BIN, "eldr-bench"), "--write_artifact=" + os.path.join(work, "a.eldr"),
                        "--write_workers=" + os.path.join(work, "workers.json"), "--geometry=48x128",
                        "--workers=16"], check=True, capture_output=True)
        subprocess.run([os.path.join(BIN, "eldr-bench"), "--write_artifact=" + os.path.join(work, "b.eldr"),
                        "--write_workers=" + os.path.join(work, "workers_b.json"), "--geometry=48x128",
                        "--workers=16", "--seed=2"], check=True, capture_output=True)
        base = ["--centroids=" + os.path.join(work, "a.eldr"), "--workers=" + os.path.join(work, "workers.json"),
                "--policy=eldr"]
        redis = Redis(work)
        cluster = ["--cluster_redis=127.0.0.1:%d" % redis.port, "--cluster_name=bench"]
        # The peers (r1 leads: it starts first), on CPU 1 with the load generator and Redis.
        for i in range(1, REPLICAS):
            routers.append(Router(work, f"r{i}", 1, base + cluster + [f"--replica_id=r{i}"]))
            if i == 1:
                assert wait_for(routers[0].leader, 10, 0.05), "r1 did not become leader"
        peers = list(routers)

        # 1. Route latency, with and without the cluster, arms alternating.
        arms = {"alone": [], "cluster": []}
        for run in range(RUNS):
            for arm in ("alone", "cluster"):
                args = base + ([*cluster, "--replica_id=r0"] if arm == "cluster" else [])
                r0 = Router(work, f"r0-{arm}-{run}", 0, args)
                if arm == "cluster":
                    assert wait_for(lambda: r0.value("eldr_cluster_peers") == REPLICAS - 1, 10, 0.05)
                redis_before = redis.net_bytes()
                t0 = time.monotonic()
                result = bench(r0)
                redis_rate = (redis.net_bytes() - redis_before) / (time.monotonic() - t0)
                rss = int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{r0.proc.pid}/status").read()).group(1))
                r0.stop()
                row = {"measure": "route_latency", "arm": arm, "run": run + 1, "qps": result.get("qps"),
                       "p50_us": result.get("p50_us"), "p99_us": result.get("p99_us"),
                       "server_p50_us": result["server_p50_us"], "server_p99_us": result["server_p99_us"],
                       "errors": result.get("errors"), "router_rss_kib": rss,
                       "redis_bytes_per_s_all_replicas": round(redis_rate)}
                arms[arm].append(row)
                emit(row)

        # 2. Redis traffic with every replica idle (the peers only), per replica. The leader still
        # refits every 10 s on its window and publishes each new set, which every follower fetches:
        # that share is reported apart (set size x (1 + followers) per generation).
        time.sleep(1)
        set_bytes = int(redis.cli("HSTRLEN", "eldr:{bench}:centroids", "data") or 0)
        before, t0, generation0 = redis.net_bytes(), time.monotonic(), peers[0].generation()
        time.sleep(IDLE_S)
        elapsed = time.monotonic() - t0
        total = (redis.net_bytes() - before) / elapsed
        generations = peers[0].generation() - generation0
        publication_rate = generations * set_bytes * len(peers) / elapsed
        idle_per_replica = (total - publication_rate) / len(peers)
        routing = statistics.median(r["redis_bytes_per_s_all_replicas"] for r in arms["cluster"])
        routing_replica = routing - total  # the others idle, publications included in both
        emit({"measure": "redis_traffic", "replicas": REPLICAS,
              "idle_replica_bytes_per_s_without_publications": round(idle_per_replica),
              "centroid_set_bytes": set_bytes, "generations_published_while_idle": generations,
              "publication_bytes_per_s_all_replicas": round(publication_rate),
              "routing_replica_extra_bytes_per_s": round(routing_replica),
              "routing_replica_routes_per_s": statistics.median(r["qps"] for r in arms["cluster"])})

        # 3. Convergence after admin reloads on the leader.
        leader = peers[0]
        followers = peers[1:]
        r0 = Router(work, "r0-conv", 0, base + cluster + ["--replica_id=r0"])
        routers.append(r0)
        followers.append(r0)
        reload_ms = []
        for n in range(RELOADS):
            target = leader.generation() + 1
            artifact = os.path.join(work, "b.eldr" if n % 2 == 0 else "a.eldr")
            t0 = time.monotonic()
            reload(leader, artifact)
            assert wait_for(lambda: all(f.generation() >= target for f in followers), 5), "followers lag"
            reload_ms.append((time.monotonic() - t0) * 1e3)
            time.sleep(0.3)
        # The leader's own refits (every 10 s by default), fed by r0's routed signatures through
        # the shared window: the time from the leader serving a new generation to every follower
        # serving it (the leader's install is seen by polling, so this is a lower bound by at most
        # the polling period).
        load = subprocess.Popen(
            taskset(1) + [os.path.join(BIN, "eldr-bench"), f"--target=127.0.0.1:{r0.grpc_port}",
                          f"--duration_s={REFIT_WATCH_S}", "--concurrency=4", "--geometry=48x128",
                          "--encoding=int16", "--complete", "--json", "--rate=2000"],
            stdout=subprocess.DEVNULL)
        refit_ms = []
        seen = leader.generation()
        deadline = time.monotonic() + REFIT_WATCH_S
        while time.monotonic() < deadline:
            now_generation = leader.generation()
            if now_generation > seen:
                t0 = time.monotonic()
                if wait_for(lambda: all(f.generation() >= now_generation for f in followers), 5):
                    refit_ms.append((time.monotonic() - t0) * 1e3)
                seen = now_generation
            time.sleep(0.005)
        load.wait()
        emit({"measure": "convergence_after_refit", "samples_ms": [round(x, 1) for x in refit_ms],
              "refits_completed_on_leader": leader.value("eldr_refits_completed_total"),
              "median_ms": round(statistics.median(refit_ms), 1) if refit_ms else None})
        emit({"measure": "convergence_after_reload", "samples_ms": [round(x, 1) for x in reload_ms],
              "median_ms": round(statistics.median(reload_ms), 1), "max_ms": round(max(reload_ms), 1)})

        # 4. Leader change: SIGKILL (lease expiry) and SIGTERM (release).
        takeovers = {"SIGKILL": [], "SIGTERM": []}
        for n in range(KILLS):
            for sig in (signal.SIGKILL, signal.SIGTERM):
                current = [r for r in routers if r.proc.poll() is None and r.leader()]
                assert len(current) == 1, "no single leader"
                old = current[0]
                t0 = time.monotonic()
                old.stop(sig)
                routers.remove(old)
                assert wait_for(lambda: any(r.leader() for r in routers), 15, 0.01), "no takeover"
                takeovers[sig.name].append((time.monotonic() - t0) * 1e3)
                name = f"r-new-{n}-{sig.name}"
                routers.append(Router(work, name, 1, base + cluster + [f"--replica_id={name}"]))
                time.sleep(0.5)
        for name, samples in takeovers.items():
            emit({"measure": "leader_takeover", "signal": name, "samples_ms": [round(x) for x in samples],
                  "median_ms": round(statistics.median(samples))})

        def med(arm, key):
            return statistics.median(r[key] for r in arms[arm])
        emit({"measure": "summary", "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0]
              .strip(": \t"), "pinned": PIN,
              "alone_p50_us": med("alone", "p50_us"), "cluster_p50_us": med("cluster", "p50_us"),
              "alone_p99_us": med("alone", "p99_us"), "cluster_p99_us": med("cluster", "p99_us"),
              "alone_server_p50_us": med("alone", "server_p50_us"),
              "cluster_server_p50_us": med("cluster", "server_p50_us"),
              "alone_server_p99_us": med("alone", "server_p99_us"),
              "cluster_server_p99_us": med("cluster", "server_p99_us"),
              "alone_qps": med("alone", "qps"), "cluster_qps": med("cluster", "qps")})
    finally:
        for r in routers:
            try:
                r.stop(signal.SIGKILL)
            except Exception:
                pass
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)


def reload(router, artifact):
    """RouterAdmin.ReloadCentroids with the artifact's path, through grpcio's generic call."""
    import grpc  # python3-grpcio
    channel = grpc.insecure_channel(f"127.0.0.1:{router.admin_port}")
    request = reload_request(artifact)
    call = channel.unary_unary("/eldr.v1.RouterAdmin/ReloadCentroids", request_serializer=lambda x: x,
                               response_deserializer=lambda x: x)
    call(request, timeout=10)
    channel.close()


def reload_request(path):
    """A ReloadCentroidsRequest with `path` in its path field, encoded by hand (field number from
    proto/eldr/v1/router.proto)."""
    data = path.encode()
    return bytes([(RELOAD_PATH_FIELD << 3) | 2]) + varint(len(data)) + data


def varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


RELOAD_PATH_FIELD = 1

if __name__ == "__main__":
    main()
