#!/usr/bin/env bash
# The README's first command (`make demo`) ends here, after the build: the whole stack of a
# prefill/decode-disaggregated deployment, end to end on the bundled real traces
# (data/esft-routing), as real processes on loopback:
#
#   1. core_routing  the core library routes every request of the traces in-process (a glance at
#                    what ELDR decides and how fast);
#   2. calibrate     one centroid per decode worker, fitted on the calibration half of the traces
#                    (eldr-loadgen sends requests of the other half);
#   3. start_stack   eldr-engine-emu engines (2 prefill, 4 decode: continuous batching whose step
#                    time follows the cost model on the real experts of each request), two
#                    eldr-router daemons (policy eldr with the centroids, and jsq) and an eldr-proxy
#                    in front of each;
#   4. drive         eldr-loadgen sends the same streamed requests at the same Poisson arrival times
#                    through each proxy (real HTTP clients, server-sent events) and measures what a
#                    client observes: time to first token, time per output token;
#   5. report        the eldr vs jsq table and a figure (build/demo/full-stack.png);
#   6. stop_stack    every process is stopped with SIGTERM (also on any failure, by a trap).
# About two minutes on two cores. The simulator's comparison of the four load balancers is its own
# command: scripts/demo.sh --simulator (make demo-sim).
#
# Usage: scripts/demo.sh [--simulator] [BUILD_DIR]   (default: build; executables in BUILD_DIR/bin)
# Environment: ELDR_DEMO_RATE (requests/s, default 130), ELDR_DEMO_SECONDS (per policy, default 35),
# ELDR_DEMO_ROUTE_ARGS (extra flags of the core routing stage), ELDR_DEMO_SIM_ARGS (of eldr-sim).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE=stack
if [[ "${1:-}" == "--simulator" ]]; then
  MODE=simulator
  shift
fi
BUILD_DIR="${1:-build}"
case "$BUILD_DIR" in
  /*) ;;
  *) BUILD_DIR="$PWD/$BUILD_DIR" ;;
esac
BIN="$BUILD_DIR/bin"
DATA_DIR="$ROOT/data/esft-routing"
WORK_DIR="$BUILD_DIR/demo"
PY=/usr/bin/python3
RATE="${ELDR_DEMO_RATE:-130}"
SECONDS_PER_POLICY="${ELDR_DEMO_SECONDS:-35}"

# Four decode workers, one centroid each. The bundled traces hold 213 sequences, half of which
# calibrate the centroids; four centroids keep ~27 calibration sequences each (docs/evaluation.md
# explains the choice). A worker batches at most 64 requests, its overload guard in the router.
DEMO_WORKERS=4
DEMO_PREFILL=2
DEMO_MAX_BATCH=64

banner() {
  printf '\n==== %s ====\n\n' "$*"
}

need() {
  local tool="$BIN/$1"
  if [[ ! -x "$tool" ]]; then
    echo "demo.sh: $tool is missing; build first (make demo builds everything)" >&2
    exit 1
  fi
}

PIDS=()
stop_all() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 100); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive -eq 0 ]] && break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT

# Waits for a daemon's port file and prints the port under `key`; shows the log if it died first.
# Only a file written by that very process counts (its "pid"): a port file left by an earlier run
# in the same folder would name a port nobody listens on any more.
wait_port() {  # wait_port PID PORT_FILE KEY LOG
  local pid=$1 file=$2 key=$3 log=$4
  for _ in $(seq 1 600); do
    if [[ -s "$file" ]]; then
      if $PY -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["pid"] == int(sys.argv[3]); print(d[sys.argv[2]])' \
        "$file" "$key" "$pid" 2>/dev/null; then
        return 0
      fi
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "demo.sh: a process exited at start; its log ($log):" >&2
      cat "$log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "demo.sh: no port in $file after 60 s" >&2
  exit 1
}

# Stage 1: the core library alone. Every request of the bundled traces is routed in-process by
# each policy on the same arrival order; prints per-domain routing, fallbacks and decision latency.
stage_core_routing() {
  banner "Core library: routing the bundled real MoE traces"
  need eldr-route-demo
  # shellcheck disable=SC2086  # word splitting of the optional extra flags is intended
  "$BIN/eldr-route-demo" --data_dir="$DATA_DIR" ${ELDR_DEMO_ROUTE_ARGS:-}
}

# Stage 2: eldr's centroids, one per decode worker, calibrated on the calibration half of the
# traces (the split eldr-sim and eldr-loadgen share: the requests sent later are the other half,
# so no request is routed by centroids it helped to fit).
stage_calibrate() {
  banner "Calibration: one centroid per decode worker on the calibration half of the bundled traces"
  need eldr-sim
  mkdir -p "$WORK_DIR"
  "$BIN/eldr-sim" --trace="$DATA_DIR" --prefill_fraction=0.5 --decoders="$DEMO_WORKERS" --policies=eldr \
    --rates=10 --requests=50 --centroids_out="$WORK_DIR/centroids.json" 2>&1 | grep -E "^(workload|calibrated)"
  echo "centroids written to $WORK_DIR/centroids.json"
}

# Stage 2b: the simulator's comparison on the same traces and pool, in-process, over six seeds
# (mean ± standard error): static eldr and eldr_refit (the daemon's online refitter) against the
# four load balancers (docs/evaluation.md; a few seconds).
stage_simulate_seeds() {
  banner "eldr-sim: eldr and eldr_refit against the load balancers, seeds 1-6 (mean ± SE), in-process"
  need eldr-sim
  # shellcheck disable=SC2086  # word splitting of the optional extra flags is intended
  "$BIN/eldr-sim" --trace="$DATA_DIR" --prefill_fraction=0.5 --decoders="$DEMO_WORKERS" --seeds=1-6 \
    --policies=rr,random,jsq,p2c,eldr,eldr_refit --quiet ${ELDR_DEMO_SIM_ARGS:-}
}

PROXY_PORTS=()
# Stage 3: engines, two routers (eldr, jsq), a proxy in front of each.
stage_start_stack() {
  banner "The stack on loopback: $DEMO_PREFILL prefill and $DEMO_WORKERS decode engines, eldr-router (eldr, jsq), eldr-proxy"
  need eldr-engine-emu
  need eldr-router
  need eldr-proxy
  local prefill=() workers=() port pid
  for ((i = 0; i < DEMO_WORKERS; i++)); do
    "$BIN/eldr-engine-emu" --role=decode --listen=127.0.0.1:0 --port_file="$WORK_DIR/decode-$i.json" \
      --engine_id="decode-$i" --trace="$DATA_DIR" --max_batch="$DEMO_MAX_BATCH" 2>"$WORK_DIR/decode-$i.log" &
    pid=$!
    PIDS+=($pid)
    port=$(wait_port "$pid" "$WORK_DIR/decode-$i.json" port "$WORK_DIR/decode-$i.log")
    workers+=("{\"id\": \"decode-$i\", \"address\": \"127.0.0.1:$port\", \"max_inflight\": $DEMO_MAX_BATCH, \"metrics_url\": \"http://127.0.0.1:$port/metrics\"}")
  done
  for ((i = 0; i < DEMO_PREFILL; i++)); do
    "$BIN/eldr-engine-emu" --role=prefill --listen=127.0.0.1:0 --port_file="$WORK_DIR/prefill-$i.json" \
      --engine_id="prefill-$i" --trace="$DATA_DIR" 2>"$WORK_DIR/prefill-$i.log" &
    pid=$!
    PIDS+=($pid)
    port=$(wait_port "$pid" "$WORK_DIR/prefill-$i.json" port "$WORK_DIR/prefill-$i.log")
    prefill+=("127.0.0.1:$port")
  done
  (
    IFS=,
    echo "{\"workers\": [${workers[*]}]}"
  ) >"$WORK_DIR/workers.json"
  PROXY_PORTS=()
  for policy in eldr jsq; do
    local centroids=()
    [[ $policy == eldr ]] && centroids=(--centroids="$WORK_DIR/centroids.json")
    rm -f "$WORK_DIR/router-$policy.json" "$WORK_DIR/proxy-$policy.json"
    # The router scrapes each engine's vllm:* load series, as it does with vLLM.
    "$BIN/eldr-router" --listen=127.0.0.1:0 --admin_listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
      --port_file="$WORK_DIR/router-$policy.json" --workers="$WORK_DIR/workers.json" --policy="$policy" \
      "${centroids[@]}" --tau=0.1 --refit_interval=0 --log_level=warning 2>"$WORK_DIR/router-$policy.log" &
    pid=$!
    PIDS+=($pid)
    local router_port
    router_port=$(wait_port "$pid" "$WORK_DIR/router-$policy.json" grpc_port "$WORK_DIR/router-$policy.log")
    "$BIN/eldr-proxy" --listen=127.0.0.1:0 --port_file="$WORK_DIR/proxy-$policy.json" \
      --prefill="$(IFS=,; echo "${prefill[*]}")" --router="127.0.0.1:$router_port" 2>"$WORK_DIR/proxy-$policy.log" &
    pid=$!
    PIDS+=($pid)
    PROXY_PORTS+=("$(wait_port "$pid" "$WORK_DIR/proxy-$policy.json" port "$WORK_DIR/proxy-$policy.log")")
    echo "policy $policy: eldr-proxy on http://127.0.0.1:${PROXY_PORTS[-1]}/v1/completions -> eldr-router :$router_port"
  done
}

# Stage 4: the same requests, at the same times, through each proxy.
stage_drive() {
  banner "eldr-loadgen: $RATE requests/s for ${SECONDS_PER_POLICY}s through each proxy (streamed, real HTTP)"
  need eldr-loadgen
  local i=0
  for policy in eldr jsq; do
    "$BIN/eldr-loadgen" --target="127.0.0.1:${PROXY_PORTS[$i]}" --trace="$DATA_DIR" --rate="$RATE" \
      --duration_s="$SECONDS_PER_POLICY" --warmup_s=5 --seed=7 --json \
      --out_requests="$WORK_DIR/requests-$policy.jsonl" >"$WORK_DIR/loadgen-$policy.json" 2>"$WORK_DIR/loadgen-$policy.log"
    echo "policy $policy: $($PY -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%d requests ok, %d errors, %.0f tokens/s" % (r["requests_ok"], r["requests_error"], r["tokens_per_s"]))' "$WORK_DIR/loadgen-$policy.json")"
    i=$((i + 1))
    sleep 3  # the engines drain before the next policy
  done
}

# Stage 5: what clients observed, eldr against jsq.
stage_report() {
  banner "What clients observed (client-side, eldr-loadgen), same arrivals for both policies"
  "$PY" - "$WORK_DIR" "${PROXY_PORTS[0]}" <<'EOF'
import json, os, sys, urllib.request
work = sys.argv[1]
# How eldr-router decided the eldr run's requests, from that proxy's own metrics.
page = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[2]}/metrics", timeout=5).read().decode()
decisions = {}
for line in page.splitlines():
    if line.startswith("eldr_proxy_e2e_seconds_count{"):
        labels, value = line[len("eldr_proxy_e2e_seconds_count{"):].split("} ")
        decision = dict(part.split("=") for part in labels.split(","))["decision"].strip('"')
        decisions[decision] = decisions.get(decision, 0) + int(float(value))
print("eldr run, decisions of eldr-router:", ", ".join(f"{k} {v}" for k, v in sorted(decisions.items())))
runs = {p: json.load(open(os.path.join(work, f"loadgen-{p}.json"))) for p in ("eldr", "jsq")}
print(f"{'policy':8} {'TPOT p50':>9} {'p90':>7} {'p99 ms':>7} {'TTFT p50':>9} {'p99 ms':>7} {'e2e p50 ms':>11} {'ok':>6} {'errors':>6}")
for policy, run in runs.items():
    t, f, e = run["tpot_ms"], run["ttft_ms"], run["e2e_ms"]
    print(f"{policy:8} {t['p50']:9.2f} {t['p90']:7.2f} {t['p99']:7.2f} {f['p50']:9.1f} {f['p99']:7.1f} {e['p50']:11.1f} "
          f"{run['requests_ok']:6d} {run['requests_error']:6d}")
for q in ("p50", "p90", "p99"):
    delta = runs["eldr"]["tpot_ms"][q] / runs["jsq"]["tpot_ms"][q] - 1
    print(f"eldr vs jsq, TPOT {q}: {100 * delta:+.1f}%")
json.dump({p: {"tpot_ms": r["tpot_ms"], "ttft_ms": r["ttft_ms"], "e2e_ms": r["e2e_ms"], "requests_ok": r["requests_ok"],
               "requests_error": r["requests_error"]} for p, r in runs.items()},
          open(os.path.join(work, "full-stack.json"), "w"), indent=1)
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy, color in (("eldr", "tab:blue"), ("jsq", "tab:orange")):
        rows = [json.loads(line) for line in open(os.path.join(work, f"requests-{policy}.jsonl"))]
        for ax, key in ((axes[0], "tpot_ms"), (axes[1], "ttft_ms")):
            values = sorted(r[key] for r in rows if r.get(key) is not None and not r.get("warmup"))
            if values:
                ax.plot(values, [i / len(values) for i in range(1, len(values) + 1)], label=policy, color=color)
    axes[0].set_xlabel("TPOT (ms), per request")
    axes[1].set_xlabel("TTFT (ms), per request")
    for ax in axes:
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Full stack on the bundled traces: eldr-proxy + eldr-router + emulated engines")
    fig.tight_layout()
    fig.savefig(os.path.join(work, "full-stack.png"), dpi=120)
    print("figure written to", os.path.join(work, "full-stack.png"))
except ImportError:
    print("matplotlib is not installed: no figure")
EOF
  echo "results (JSON) written to $WORK_DIR/full-stack.json"
}

stage_stop_stack() {
  banner "Stopping the stack"
  stop_all
  echo "every process stopped"
}

# --simulator, stage 1: calibration with the offline tool, on the bundled traces.
stage_calibrate_offline() {
  banner "Calibration: eldr-calibrate on the bundled real traces"
  need eldr-calibrate
  local workers=()
  for ((i = 0; i < DEMO_WORKERS; i++)); do workers+=("decode-$i"); done
  "$BIN/eldr-calibrate" --trace="$DATA_DIR" --prefill_fraction=0.5 --clusters="$DEMO_WORKERS" \
    --workers="$(IFS=,; echo "${workers[*]}")" --out="$WORK_DIR/centroids.json" \
    --report="$WORK_DIR/calibration-report.json"
  echo "centroids written to $WORK_DIR/centroids.json"
}

# --simulator: eldr-sim replays the traces onto simulated decode workers, every Route and Complete
# of eldr going through eldr-router over gRPC, against the four load balancers.
stage_start_router() {
  banner "eldr-router on loopback"
  need eldr-router
  local workers_file="$WORK_DIR/workers.json" port_file="$WORK_DIR/ports.json" pid
  {
    echo '{"workers": ['
    for ((i = 0; i < DEMO_WORKERS; i++)); do
      [[ $i -gt 0 ]] && echo ','
      printf '  {"id": "decode-%d", "address": "127.0.0.1:%d", "max_inflight": %d}' \
        "$i" $((18000 + i)) "$DEMO_MAX_BATCH"
    done
    echo ']}'
  } >"$workers_file"
  rm -f "$port_file"
  "$BIN/eldr-router" --listen=127.0.0.1:0 --admin_listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
    --port_file="$port_file" --centroids="$WORK_DIR/centroids.json" --workers="$workers_file" --policy=eldr \
    --tau=0.1 --log_level=warning 2>"$WORK_DIR/eldr-router.log" &
  pid=$!
  PIDS+=($pid)
  SIM_ROUTER_PORT=$(wait_port "$pid" "$port_file" grpc_port "$WORK_DIR/eldr-router.log")
  SIM_ADMIN_PORT=$(wait_port "$pid" "$port_file" admin_port "$WORK_DIR/eldr-router.log")
  echo "eldr-router (pid $pid) serves gRPC on 127.0.0.1:$SIM_ROUTER_PORT"
}

stage_simulate() {
  banner "eldr-sim: the bundled traces on $DEMO_WORKERS simulated decode workers, routed by eldr-router over gRPC"
  need eldr-sim
  # shellcheck disable=SC2086  # word splitting of the optional extra flags is intended
  "$BIN/eldr-sim" --trace="$DATA_DIR" --prefill_fraction=0.5 --router="grpc://127.0.0.1:$SIM_ROUTER_PORT" \
    --router_admin="grpc://127.0.0.1:$SIM_ADMIN_PORT" \
    --max_batch="$DEMO_MAX_BATCH" --plot="$WORK_DIR/eldr-sim-real-traces.png" \
    --json_out="$WORK_DIR/eldr-sim-real-traces.json" ${ELDR_DEMO_SIM_ARGS:-}
  echo "results (JSON) written to $WORK_DIR/eldr-sim-real-traces.json"
}

if [[ $MODE == stack ]]; then
  STAGES=(core_routing calibrate simulate_seeds start_stack drive report stop_stack)
else
  STAGES=(calibrate_offline start_router simulate stop_stack)
fi

if [[ ! -d "$DATA_DIR" ]]; then
  echo "demo.sh: bundled traces not found at $DATA_DIR" >&2
  exit 1
fi
mkdir -p "$WORK_DIR"
for stage in "${STAGES[@]}"; do
  "stage_$stage"
done
