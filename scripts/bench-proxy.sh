#!/usr/bin/env bash
# eldr-proxy's cost, measured side by side in one run on the same emulated engines
# (docs/benchmarks.md, "eldr-proxy"):
#
#   direct    eldr-loadgen -> a decode engine (it prefills locally: no proxy, no second hop)
#   eldr      eldr-loadgen -> eldr-proxy -> prefill engine, eldr-router, decode engine
#   eldr-unary  the same through a second eldr-proxy with --router_api=unary (Route and Complete as
#             unary RPCs instead of RouteStream messages), same router
#   python    eldr-loadgen -> bench/pd_proxy_baseline.py (aiohttp, round robin, no router) -> the same
#
# Each target gets the same closed-loop load (CONCURRENCY streams, MAX_TOKENS tokens each, the same
# trace requests); the engines' KV transfer time is 0 so that "direct" and the proxied paths do
# the same engine work and differ only by the proxy. Reported per target: TTFT, inter-token gap,
# end-to-end latency (p50/p99), and the CPU seconds of the proxy process per request and per
# token, user and kernel apart (from /proc/<pid>/stat), and eldr-router's CPU per request of the eldr targets.
# Then a hold test: HOLD_STREAMS concurrent streams through eldr-proxy, which must all complete without an
# error (HOLD_STREAMS=0: no hold test).
#
# Usage: scripts/bench-proxy.sh [BUILD_DIR]   (default: build)
# Environment: CONCURRENCY (default "100 1000"), MAX_TOKENS (64), DURATION_S (20), HOLD_STREAMS
# (5000), ROUTER_STREAMS (4, eldr-proxy's default: the eldr target's --router_streams), OUT (BUILD_DIR/bench-proxy: JSON of
# every run and summary.json).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${1:-build}"
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$PWD/$BUILD_DIR" ;; esac
BIN="$BUILD_DIR/bin"
DATA="$ROOT/data/esft-routing"
OUT="${OUT:-$BUILD_DIR/bench-proxy}"
CONCURRENCY="${CONCURRENCY:-100 1000}"
MAX_TOKENS="${MAX_TOKENS:-64}"
DURATION_S="${DURATION_S:-20}"
HOLD_STREAMS="${HOLD_STREAMS:-5000}"
ROUTER_STREAMS="${ROUTER_STREAMS:-4}"
PY=/usr/bin/python3
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.log

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 0.5
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

port_of() {  # port_of FILE KEY: waits for the port file
  for _ in $(seq 1 600); do
    if [[ -s "$1" ]]; then
      $PY -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2" 2>/dev/null && return 0
    fi
    sleep 0.1
  done
  echo "bench-proxy.sh: no port in $1" >&2
  exit 1
}

cpu_seconds() {  # "utime stime" of a process (user and kernel CPU), in seconds
  $PY -c 'import os,sys; f=open(f"/proc/{sys.argv[1]}/stat").read().rsplit(")",1)[1].split(); t=os.sysconf("SC_CLK_TCK"); print(int(f[11])/t, int(f[12])/t)' "$1"
}

# Engines: one prefill, one decode (every target loads the same decode engine the same way); big
# batches so the engines never queue the load.
ENGINE_FLAGS=(--trace="$DATA" --kv_transfer_us=0 --prefill_fixed_us=0 --prefill_token_us=0 --max_batch=4096 --max_waiting=100000)
start_engine() {  # start_engine ROLE NAME
  "$BIN/eldr-engine-emu" --role="$1" --listen=127.0.0.1:0 --port_file="$OUT/$2.json" --engine_id="$2" \
    "${ENGINE_FLAGS[@]}" 2>"$OUT/$2.log" &
  PIDS+=($!)
}
start_engine prefill prefill0
start_engine decode decode0
P0=$(port_of "$OUT/prefill0.json" port)
D0=$(port_of "$OUT/decode0.json" port)

"$BIN/eldr-calibrate" --trace="$DATA" --prefill_fraction=0.5 --clusters=1 --workers=d0 \
  --out="$OUT/centroids.json" >"$OUT/calibrate.log" 2>&1
"$BIN/eldr-router" --listen=127.0.0.1:0 --admin_listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --port_file="$OUT/router.json" --workers="d0=127.0.0.1:$D0" \
  --centroids="$OUT/centroids.json" --refit_interval=0 --log_level=warning 2>"$OUT/router.log" &
ROUTER_PID=$!
PIDS+=($ROUTER_PID)
R=$(port_of "$OUT/router.json" grpc_port)

"$BIN/eldr-proxy" --listen=127.0.0.1:0 --port_file="$OUT/eldr-proxy.json" --prefill="127.0.0.1:$P0" \
  --decode="127.0.0.1:$D0" --router="127.0.0.1:$R" --router_streams="$ROUTER_STREAMS" 2>"$OUT/eldr-proxy.log" &
ELDR_PID=$!
PIDS+=($ELDR_PID)
E=$(port_of "$OUT/eldr-proxy.json" port)

"$BIN/eldr-proxy" --listen=127.0.0.1:0 --port_file="$OUT/eldr-unary-proxy.json" --prefill="127.0.0.1:$P0" \
  --decode="127.0.0.1:$D0" --router="127.0.0.1:$R" --router_api=unary 2>"$OUT/eldr-unary-proxy.log" &
UNARY_PID=$!
PIDS+=($UNARY_PID)
U=$(port_of "$OUT/eldr-unary-proxy.json" port)

$PY "$ROOT/bench/pd_proxy_baseline.py" --port=0 --port_file="$OUT/python-proxy.json" --prefill="127.0.0.1:$P0" \
  --decode="127.0.0.1:$D0" 2>"$OUT/python-proxy.log" &
PYTHON_PID=$!
PIDS+=($PYTHON_PID)
Y=$(port_of "$OUT/python-proxy.json" port)

run() {  # run NAME PORT PID CONCURRENCY: one closed-loop run, the proxy's CPU around it
  local name=$1 port=$2 pid=$3 concurrency=$4 before after router_before router_after
  before=$( [[ -n "$pid" ]] && cpu_seconds "$pid" || echo 0 0)
  router_before=$(cpu_seconds "$ROUTER_PID")
  "$BIN/eldr-loadgen" --target="127.0.0.1:$port" --trace="$DATA" --concurrency="$concurrency" \
    --duration_s="$DURATION_S" --warmup_s=2 --max_tokens="$MAX_TOKENS" --json \
    >"$OUT/$name-c$concurrency.json" 2>"$OUT/$name-c$concurrency.log"
  after=$( [[ -n "$pid" ]] && cpu_seconds "$pid" || echo 0 0)
  router_after=$(cpu_seconds "$ROUTER_PID")
  $PY - "$OUT/$name-c$concurrency.json" $before $after $router_before $router_after <<'EOF'
import json, sys
path = sys.argv[1]
user_before, sys_before, user_after, sys_after = (float(v) for v in sys.argv[2:6])
router_before, router_after = sum(float(v) for v in sys.argv[6:8]), sum(float(v) for v in sys.argv[8:10])
run = json.load(open(path))
run["router_cpu_s"] = router_after - router_before
run["proxy_user_s"] = user_after - user_before
run["proxy_sys_s"] = sys_after - sys_before
run["proxy_cpu_s"] = run["proxy_user_s"] + run["proxy_sys_s"]
json.dump(run, open(path, "w"), indent=1)
EOF
  echo "  $name c=$concurrency done"
}

echo "== side by side (closed loop, $MAX_TOKENS tokens per request, ${DURATION_S}s each)"
for c in $CONCURRENCY; do
  run direct "$D0" "" "$c"
  run eldr "$E" "$ELDR_PID" "$c"
  run eldr-unary "$U" "$UNARY_PID" "$c"
  run python "$Y" "$PYTHON_PID" "$c"
done

before=0 after=0 rss_kib=0
if [[ "$HOLD_STREAMS" -gt 0 ]]; then
  echo "== hold: $HOLD_STREAMS concurrent streams through eldr-proxy"
  before=$(cpu_seconds "$ELDR_PID" | awk '{print $1 + $2}')
  "$BIN/eldr-loadgen" --target="127.0.0.1:$E" --trace="$DATA" --concurrency="$HOLD_STREAMS" --requests="$HOLD_STREAMS" \
    --max_tokens=256 --json >"$OUT/hold.json" 2>"$OUT/hold.log"
  after=$(cpu_seconds "$ELDR_PID" | awk '{print $1 + $2}')
  rss_kib=$(awk '/VmHWM/ {print $2}' "/proc/$ELDR_PID/status")
fi

$PY - "$OUT" "$CONCURRENCY" "$before" "$after" "$rss_kib" <<'EOF'
import json, os, sys
out, levels = sys.argv[1], [int(c) for c in sys.argv[2].split()]
hold_cpu = float(sys.argv[4]) - float(sys.argv[3])
summary = {"runs": [], "hold": {}}
for c in levels:
    direct = json.load(open(os.path.join(out, f"direct-c{c}.json")))
    for name in ("direct", "eldr", "eldr-unary", "python"):
        run = json.load(open(os.path.join(out, f"{name}-c{c}.json")))
        requests, tokens = max(run["requests_ok"], 1), max(run["tokens"], 1)
        row = {
            "target": name, "concurrency": c, "requests_ok": run["requests_ok"],
            "errors": run["requests_error"], "tokens_per_s": round(run["tokens_per_s"]),
            "ttft_p50_ms": run["ttft_ms"]["p50"], "ttft_p99_ms": run["ttft_ms"]["p99"],
            "itl_p50_ms": run["inter_token_ms"]["p50"], "itl_p99_ms": run["inter_token_ms"]["p99"],
            "e2e_p50_ms": run["e2e_ms"]["p50"], "e2e_p99_ms": run["e2e_ms"]["p99"],
        }
        if name != "direct":
            # The run's whole window (warm-up included) for CPU; requests and tokens of that window.
            all_requests = run["requests_ok"] + run.get("warmup_requests", 0)
            cpu = run["proxy_cpu_s"]
            row["proxy_cpu_s"] = cpu
            row["cpu_us_per_request"] = 1e6 * cpu / max(all_requests, 1)
            all_tokens = max(run["tokens"] * all_requests / requests, 1)
            row["cpu_us_per_token"] = 1e6 * cpu / all_tokens
            row["user_us_per_token"] = 1e6 * run["proxy_user_s"] / all_tokens
            row["kernel_us_per_token"] = 1e6 * run["proxy_sys_s"] / all_tokens
            row["added_ttft_p50_ms"] = run["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"]
            row["added_ttft_p99_ms"] = run["ttft_ms"]["p99"] - direct["ttft_ms"]["p99"]
            row["added_itl_p50_ms"] = run["inter_token_ms"]["p50"] - direct["inter_token_ms"]["p50"]
            row["added_itl_p99_ms"] = run["inter_token_ms"]["p99"] - direct["inter_token_ms"]["p99"]
        if name.startswith("eldr"):
            row["router_cpu_us_per_request"] = 1e6 * run["router_cpu_s"] / max(all_requests, 1)
        summary["runs"].append(row)
hold_file = os.path.join(out, "hold.json")
hold = json.load(open(hold_file)) if os.path.exists(hold_file) else None
summary["hold"] = None if hold is None else {"streams": hold["requests_sent"], "ok": hold["requests_ok"], "errors": hold["requests_error"],
                   "error_kinds": hold["errors"], "max_concurrent_streams": hold["max_concurrent_streams"],
                   "tokens": hold["tokens"], "proxy_cpu_s": hold_cpu, "proxy_peak_rss_mib": int(sys.argv[5]) / 1024}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
cols = ["target", "concurrency", "requests_ok", "errors", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
        "itl_p50_ms", "itl_p99_ms", "added_itl_p99_ms", "cpu_us_per_request", "cpu_us_per_token",
        "user_us_per_token", "kernel_us_per_token", "router_cpu_us_per_request"]
print(" ".join(f"{c:>14}" for c in cols))
for row in summary["runs"]:
    print(" ".join(f"{row.get(c, ''):>14.2f}" if isinstance(row.get(c), float) else f"{str(row.get(c, '-')):>14}"
                   for c in cols))
print("hold:", json.dumps(summary["hold"]))
EOF
echo "results: $OUT/summary.json"
