#!/usr/bin/env bash
# eldr-router throughput: the daemon and eldr-bench on one machine, over loopback.
#
# Writes a random centroid artifact of GEOMETRY for WORKERS workers (eldr-bench --write_artifact),
# starts eldr-router on kernel-chosen loopback ports, runs eldr-bench (int16 counts, Complete for
# every lease: two RPCs per route) and reads the server-side decision time from the
# eldr_route_duration_seconds histogram: the difference of two scrapes taken right before and right
# after the load, so warm-up and start-up are not counted. Prints one JSON object per run: the
# client's figures (requests, errors, qps, p50_us, p90_us, p99_us, ...) plus server_decisions,
# server_p50_us, server_p90_us, server_p99_us, server_p999_us (bucket-interpolated upper estimates),
# router_cpu_s (the daemon's user + system CPU between the two scrapes) and
# router_cpu_us_per_route (that over server_decisions: a route and its Complete),
# router_rss_kib and router_peak_rss_kib (VmRSS and VmHWM right after the load), the online
# refit's gauges from the last scrape (refit_last_duration_s, refit_window_signatures,
# refit_window_bytes; null when refit is off or the build does not export them), and run (its
# number).
#
# Placement: with PIN=1 (the default on machines with at least two CPUs) the daemon runs on CPU 0
# and the load generator on CPU 1 (taskset), as a router with a dedicated core would in production
# (Kubernetes' static CPU manager gives a Guaranteed pod exclusive cores). Unpinned, the two
# processes' threads preempt each other on both cores and the decision's tail measures the
# scheduler (docs/benchmarks.md has both).
#
# Client APIs: APIS="cq stream" measures the unary RPCs (eldr-bench --api=cq) and RouteStream
# (--api=stream: the same CONCURRENCY routes in flight, pipelined on one stream) side by side,
# alternating within each run (a fresh daemon for each), so that both see the same machine; every
# line names its `api`. STREAM_BATCH="1 4 16 64" runs --api=stream once per batch size
# (eldr-bench --stream_batch: that many requests per RouteStream message, the same CONCURRENCY
# leases in flight), again each on a fresh daemon within the run; every line names its
# `stream_batch`. Other APIs run once, whatever STREAM_BATCH says.
#
# Usage: scripts/bench-router.sh [BUILD_DIR]
# Transport: TRANSPORT=unix serves the data plane on a Unix socket in the run's scratch folder
# (--listen=unix:PATH) and points eldr-bench at it, as a caller in the same pod could; every line
# names its `transport`.
#
#   env: RUNS (1), APIS (cq), STREAM_BATCH (1), DURATION_S (10), CONCURRENCY (16), GEOMETRY (48x128),
#        WORKERS (16), PIN (auto), TRANSPORT (tcp), ROUTER_ARGS (extra eldr-router flags), BENCH_ARGS (extra
#        eldr-bench flags), PERF_DIR (when set: `perf record --call-graph dwarf` of the daemon
#        during each load at 499 Hz, written there as perf-<api>-<batch>-run<run>.data; about 15 MB
#        a second), PERF_STAT (1: `perf stat` of the
#        daemon during each load, reported per route as router_sendmsg_per_route,
#        router_recvmsg_per_route and router_context_switches_per_route; needs tracepoints)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${1:-$ROOT/build}"
BIN="$BUILD_DIR/bin"
RUNS="${RUNS:-1}"
APIS="${APIS:-cq}"
STREAM_BATCH="${STREAM_BATCH:-1}"
DURATION_S="${DURATION_S:-10}"
CONCURRENCY="${CONCURRENCY:-16}"
GEOMETRY="${GEOMETRY:-48x128}"
WORKERS="${WORKERS:-16}"
TRANSPORT="${TRANSPORT:-tcp}"
[[ "$TRANSPORT" == tcp || "$TRANSPORT" == unix ]] || { echo "bench-router.sh: TRANSPORT is tcp or unix" >&2; exit 2; }
if [[ -z "${PIN:-}" ]]; then
  if [[ "$(nproc)" -ge 2 ]]; then PIN=1; else PIN=0; fi
fi
ROUTER_CPU=()
BENCH_CPU=()
if [[ "$PIN" == 1 ]]; then
  ROUTER_CPU=(taskset -c 0)
  BENCH_CPU=(taskset -c 1)
fi
PYTHON=/usr/bin/python3
[[ -x "$PYTHON" ]] || PYTHON=python3

for tool in eldr-router eldr-bench; do
  [[ -x "$BIN/$tool" ]] || { echo "bench-router.sh: $BIN/$tool is missing; build first" >&2; exit 1; }
done

WORK_DIR="$(mktemp -d)"
ROUTER_PID=""
cleanup() {
  if [[ -n "$ROUTER_PID" ]] && kill -0 "$ROUTER_PID" 2>/dev/null; then
    kill -KILL "$ROUTER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK_DIR"
}
trap cleanup EXIT

"$BIN/eldr-bench" --write_artifact="$WORK_DIR/centroids.eldr" --write_workers="$WORK_DIR/workers.json" \
  --geometry="$GEOMETRY" --workers="$WORKERS" >/dev/null

# The daemon's user + system CPU so far, in clock ticks (/proc/PID/stat fields 14 and 15; the
# command name in field 2 has no spaces).
router_cpu_ticks() {
  awk '{print $14 + $15}' "/proc/$ROUTER_PID/stat"
}

# Prints the decision-time percentiles between two scrapes as JSON fields.
histogram_delta() {
  "$PYTHON" - "$1" "$2" <<'EOF'
import json, re, sys

def buckets(path):
    counts = {}
    for line in open(path):
        m = re.match(r'eldr_route_duration_seconds_bucket\{(.*)\} (\S+)', line)
        if m:
            le = re.search(r'le="([^"]+)"', m.group(1)).group(1)
            counts[le] = counts.get(le, 0.0) + float(m.group(2))
    return counts

before, after = buckets(sys.argv[1]), buckets(sys.argv[2])
bounds = sorted(after, key=lambda le: float("inf") if le == "+Inf" else float(le))
delta = [(float("inf") if le == "+Inf" else float(le), after[le] - before.get(le, 0.0)) for le in bounds]
total = delta[-1][1] if delta else 0.0
out = {"server_decisions": int(total)}
for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)):
    value, low, below = None, 0.0, 0.0
    for upper, cumulative in delta:
        if total > 0 and cumulative >= q * total:
            if upper == float("inf"):
                value = low  # beyond the last finite bucket: report its bound
            else:
                value = low + (upper - low) * (q * total - below) / max(cumulative - below, 1e-12)
            break
        low, below = upper, cumulative
    out[f"server_{name}_us"] = None if value is None else round(value * 1e6, 2)
print(json.dumps(out))
EOF
}

# Each (api, batch) of a run: "cq:1 stream:1 stream:4 ...".
CASES=()
for api in $APIS; do
  if [[ "$api" == stream ]]; then
    for batch in $STREAM_BATCH; do CASES+=("$api:$batch"); done
  else
    CASES+=("$api:1")
  fi
done

for run in $(seq 1 "$RUNS"); do
for case in "${CASES[@]}"; do
  api="${case%%:*}"
  batch="${case##*:}"
  rm -f "$WORK_DIR/ports.json"
  # shellcheck disable=SC2086  # word splitting of the optional extra flags is intended
  listen=127.0.0.1:0
  if [[ "$TRANSPORT" == unix ]]; then listen="unix:$WORK_DIR/router.sock"; fi
  "${ROUTER_CPU[@]}" "$BIN/eldr-router" --listen="$listen" --admin_listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
    --port_file="$WORK_DIR/ports.json" --centroids="$WORK_DIR/centroids.eldr" \
    --workers="$WORK_DIR/workers.json" --policy=eldr --log_level=warning ${ROUTER_ARGS:-} \
    2>"$WORK_DIR/router.log" &
  ROUTER_PID=$!
  for _ in $(seq 1 200); do
    [[ -s "$WORK_DIR/ports.json" ]] && break
    kill -0 "$ROUTER_PID" 2>/dev/null || { cat "$WORK_DIR/router.log" >&2; exit 1; }
    sleep 0.05
  done
  grpc_port="$(grep -o '"grpc_port":[0-9]*' "$WORK_DIR/ports.json" | cut -d: -f2)"
  target="127.0.0.1:$grpc_port"
  if [[ "$TRANSPORT" == unix ]]; then target="$listen"; fi
  metrics_port="$(grep -o '"metrics_port":[0-9]*' "$WORK_DIR/ports.json" | cut -d: -f2)"
  # The two scrapes bracket the whole eldr-bench run, its warm-up included: the histogram delta
  # holds about warmup_s / duration_s more decisions than the client's `requests`.
  curl -sf "http://127.0.0.1:$metrics_port/metrics" >"$WORK_DIR/before.txt"
  cpu_before="$(router_cpu_ticks)"
  PERF_PID=""
  STAT_PID=""
  rm -f "$WORK_DIR/perf-stat.csv"
  if [[ "${PERF_STAT:-0}" == 1 ]]; then
    perf stat -x, -e context-switches,syscalls:sys_enter_sendmsg,syscalls:sys_enter_recvmsg -p "$ROUTER_PID" \
      -o "$WORK_DIR/perf-stat.csv" 2>"$WORK_DIR/perf-stat.log" &
    STAT_PID=$!
  fi
  if [[ -n "${PERF_DIR:-}" ]]; then
    mkdir -p "$PERF_DIR"
    # DWARF unwinding: Debian's gRPC, protobuf and libc have no frame pointers.
    perf record --call-graph dwarf,16384 -F 499 -o "$PERF_DIR/perf-$api-$batch-run$run.data" -p "$ROUTER_PID" \
      2>"$WORK_DIR/perf.log" &
    PERF_PID=$!
  fi
  # shellcheck disable=SC2086
  client_json="$("${BENCH_CPU[@]}" "$BIN/eldr-bench" --target="$target" \
    --duration_s="$DURATION_S" --concurrency="$CONCURRENCY" --geometry="$GEOMETRY" \
    --encoding=int16 --complete --json --api="$api" --stream_batch="$batch" ${BENCH_ARGS:-})"
  for pid in $PERF_PID $STAT_PID; do
    kill -INT "$pid"
    wait "$pid" || true
  done
  curl -sf "http://127.0.0.1:$metrics_port/metrics" >"$WORK_DIR/after.txt"
  cpu_after="$(router_cpu_ticks)"
  rss_kib="$(awk '/^VmRSS:/ {print $2}' "/proc/$ROUTER_PID/status")"
  peak_rss_kib="$(awk '/^VmHWM:/ {print $2}' "/proc/$ROUTER_PID/status")"
  server_json="$(histogram_delta "$WORK_DIR/before.txt" "$WORK_DIR/after.txt")"
  kill -TERM "$ROUTER_PID"
  wait "$ROUTER_PID" || { echo "bench-router.sh: eldr-router exited with $?" >&2; exit 1; }
  ROUTER_PID=""
  "$PYTHON" - "$client_json" "$server_json" "$rss_kib" "$peak_rss_kib" "$PIN" "$WORK_DIR/after.txt" "$run" \
    "$(( cpu_after - cpu_before ))" "$(getconf CLK_TCK)" "$WORK_DIR/perf-stat.csv" "$TRANSPORT" <<'EOF'
import json, re, sys

c = json.loads(sys.argv[1])
c.update(json.loads(sys.argv[2]))
c["router_rss_kib"] = int(sys.argv[3])
c["router_peak_rss_kib"] = int(sys.argv[4])
c["pinned"] = sys.argv[5] == "1"
c["run"] = int(sys.argv[7])
c["transport"] = sys.argv[11]
c["router_cpu_s"] = int(sys.argv[8]) / int(sys.argv[9])
decisions = c.get("server_decisions") or 0
c["router_cpu_us_per_route"] = round(c["router_cpu_s"] * 1e6 / decisions, 2) if decisions else None
try:
    for line in open(sys.argv[10]):
        fields = line.strip().split(",")
        if len(fields) < 3 or not fields[0].replace(".", "").isdigit() or not decisions:
            continue
        name = {"context-switches": "router_context_switches_per_route",
                "syscalls:sys_enter_sendmsg": "router_sendmsg_per_route",
                "syscalls:sys_enter_recvmsg": "router_recvmsg_per_route"}.get(fields[2])
        if name:
            c[name] = round(float(fields[0]) / decisions, 3)
except FileNotFoundError:
    pass
gauges = {}
for line in open(sys.argv[6]):
    m = re.match(r"(eldr_refit_[a-z_]+) (\S+)$", line)
    if m:
        gauges[m.group(1)] = float(m.group(2))
for field, metric in (("refit_last_duration_s", "eldr_refit_last_duration_seconds"),
                      ("refit_window_signatures", "eldr_refit_window_signatures"),
                      ("refit_window_bytes", "eldr_refit_window_bytes")):
    c[field] = gauges.get(metric)
print(json.dumps(c))
EOF
done
done
