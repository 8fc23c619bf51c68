#!/usr/bin/env bash
# The README's first command (`make demo`) ends here, after the build: run the main job end to end
# on the bundled real traces (data/esft-routing) and print what ELDR decided and how fast.
#
#   1. core_routing  the core library routes every request of the traces in-process;
#   2. calibrate     eldr-calibrate fits one centroid per decode worker on the traces;
#   3. start_router  eldr-router starts on loopback (kernel-chosen ports) with those centroids;
#   4. simulate      eldr-sim replays the traces onto simulated decode workers, every Route and
#                    Complete of eldr going through the daemon over gRPC, and prints the
#                    comparison table with the load balancers and where the figure was written;
#   5. stop_router   the daemon is stopped with SIGTERM (also on any failure, by a trap).
# It takes a few minutes on two cores.
#
# Usage: scripts/demo.sh [BUILD_DIR]   (default: build; executables are in BUILD_DIR/bin)
#
# Each stage is a function named stage_<name>; STAGES lists them in order. To grow the demo, add a
# function and append its name to STAGES. Extra arguments for the core routing stage can be passed
# in ELDR_DEMO_ROUTE_ARGS (e.g. "--tau=0.2 --rounds=50"), for the simulation in ELDR_DEMO_SIM_ARGS
# (e.g. "--rates=40,80 --requests=2000").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${1:-build}"
case "$BUILD_DIR" in
  /*) ;;
  *) BUILD_DIR="$PWD/$BUILD_DIR" ;;
esac
BIN="$BUILD_DIR/bin"
DATA_DIR="$ROOT/data/esft-routing"

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

# Stage 1: the core library alone. Every request of the bundled traces is routed in-process by
# each policy on the same arrival order; prints per-domain routing, fallbacks and decision latency.
stage_core_routing() {
  banner "Core library: routing the bundled real MoE traces"
  need eldr-route-demo
  # shellcheck disable=SC2086  # word splitting of the optional extra flags is intended
  "$BIN/eldr-route-demo" --data_dir="$DATA_DIR" ${ELDR_DEMO_ROUTE_ARGS:-}
}

# The simulated pool: four decode workers, one centroid each. The bundled traces hold 213 sequences,
# half of which calibrate eldr-sim's centroids; four centroids keep ~27 calibration sequences each
# (docs/evaluation.md explains the choice). Each worker's overload guard is its batch limit, as
# eldr-sim assumes (--max_batch 64).
DEMO_WORKERS=4
DEMO_MAX_BATCH=64
WORK_DIR="$BUILD_DIR/demo"
ROUTER_PID=""

stop_router_quietly() {
  if [[ -n "$ROUTER_PID" ]] && kill -0 "$ROUTER_PID" 2>/dev/null; then
    kill -TERM "$ROUTER_PID" 2>/dev/null || true
    for _ in $(seq 1 100); do
      kill -0 "$ROUTER_PID" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$ROUTER_PID" 2>/dev/null || true
  fi
  ROUTER_PID=""
}
trap stop_router_quietly EXIT

# Stage 2: calibration with the offline tool, on the bundled traces.
stage_calibrate() {
  banner "Calibration: eldr-calibrate on the bundled real traces"
  need eldr-calibrate
  mkdir -p "$WORK_DIR"
  local workers=()
  for ((i = 0; i < DEMO_WORKERS; i++)); do workers+=("decode-$i"); done
  "$BIN/eldr-calibrate" --trace="$DATA_DIR" --prefill_fraction=0.5 --clusters="$DEMO_WORKERS" \
    --workers="$(IFS=,; echo "${workers[*]}")" --out="$WORK_DIR/centroids.json" \
    --report="$WORK_DIR/calibration-report.json"
  echo "centroids written to $WORK_DIR/centroids.json"
}

# Stage 3: the daemon on loopback. Port 0 lets the kernel pick free ports; --port_file tells which.
stage_start_router() {
  banner "eldr-router on loopback"
  need eldr-router
  local workers_file="$WORK_DIR/workers.json" port_file="$WORK_DIR/ports.json"
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
    --port_file="$port_file" \
    --centroids="$WORK_DIR/centroids.json" --workers="$workers_file" --policy=eldr --tau=0.1 \
    --log_level=warning 2>"$WORK_DIR/eldr-router.log" &
  ROUTER_PID=$!
  for _ in $(seq 1 200); do
    [[ -s "$port_file" ]] && break
    if ! kill -0 "$ROUTER_PID" 2>/dev/null; then
      echo "demo.sh: eldr-router exited at start:" >&2
      cat "$WORK_DIR/eldr-router.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  if [[ ! -s "$port_file" ]]; then
    echo "demo.sh: eldr-router did not report its ports within 20 s" >&2
    exit 1
  fi
  ROUTER_PORT=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["grpc_port"])' "$port_file")
  METRICS_PORT=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["metrics_port"])' "$port_file")
  ADMIN_PORT=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["admin_port"])' "$port_file")
  echo "eldr-router (pid $ROUTER_PID) serves gRPC on 127.0.0.1:$ROUTER_PORT, metrics on http://127.0.0.1:$METRICS_PORT/metrics"
}

# Stage 4: the simulator, routing through the daemon.
stage_simulate() {
  banner "eldr-sim: the bundled traces on $DEMO_WORKERS simulated decode workers, routed by eldr-router over gRPC"
  need eldr-sim
  local figure="$WORK_DIR/eldr-sim-real-traces.png"
  # shellcheck disable=SC2086  # word splitting of the optional extra flags is intended
  "$BIN/eldr-sim" --trace="$DATA_DIR" --prefill_fraction=0.5 --router="grpc://127.0.0.1:$ROUTER_PORT" \
    --router_admin="grpc://127.0.0.1:$ADMIN_PORT" \
    --max_batch="$DEMO_MAX_BATCH" --plot="$figure" --json_out="$WORK_DIR/eldr-sim-real-traces.json" \
    ${ELDR_DEMO_SIM_ARGS:-}
  echo "results (JSON) written to $WORK_DIR/eldr-sim-real-traces.json"
}

# Stage 5: SIGTERM drains and stops the daemon.
stage_stop_router() {
  banner "Stopping eldr-router"
  local pid="$ROUTER_PID"
  stop_router_quietly
  echo "eldr-router (pid $pid) stopped"
}

STAGES=(core_routing calibrate start_router simulate stop_router)

if [[ ! -d "$DATA_DIR" ]]; then
  echo "demo.sh: bundled traces not found at $DATA_DIR" >&2
  exit 1
fi
for stage in "${STAGES[@]}"; do
  "stage_$stage"
done
