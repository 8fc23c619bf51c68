#!/usr/bin/env bash
# The pool_change drift figures of docs/evaluation.md ("Drift", "Through the daemon"): eldr-sim's
# pool_change scenario on the bundled real traces with policy eldr served by a real eldr-router
# (the load balancers rr/random/jsq/p2c run in-process in the same invocation, on the same arrivals),
# for each seed and rate on a fresh daemon, in three daemon modes:
#   static   --refit_interval=0 (no online refit: static eldr), replayed as fast as the daemon answers
#   refit    the daemon's online refit, replayed at --pace=4 (4 simulated seconds per wall-clock
#            second) with --refit_interval=1250ms --refit_window=7500ms: the in-process eldr_refit's
#            5 s / 30 s of simulated time (the 250 ms settle after a pool change becomes 1 s simulated)
#   unpaced  the daemon's online refit with its defaults (10 s, 1 min), replayed as fast as the daemon
#            answers (~35x simulated time here): what an unpaced run measures
# and the same seeds and rates in-process (eldr and eldr_refit) for comparison; then the table
# (scripts/sim_drift_daemon_table.py).
#
# Usage: scripts/sim-drift-daemon.sh [BUILD_DIR]   (default: build; writes BUILD_DIR/drift-daemon/).
# Environment: ELDR_DRIFT_SEEDS (default "1 2 3 4 5 6"; about 6 minutes on two cores), ELDR_DRIFT_RATES (default "47 87 130", the
# in-process figures' rates), ELDR_DAEMON_PORT (default 51051; +1 admin, +2 metrics),
# ELDR_DRIFT_ARGS (more eldr-sim flags, e.g. --requests=2000).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${1:-build}"
SIM="$BUILD_DIR/bin/eldr-sim"
ROUTER="$BUILD_DIR/bin/eldr-router"
OUT="$BUILD_DIR/drift-daemon"
SEEDS="${ELDR_DRIFT_SEEDS:-1 2 3 4 5 6}"
RATES="${ELDR_DRIFT_RATES:-47 87 130}"
PORT="${ELDR_DAEMON_PORT:-51051}"
ADMIN=$((PORT + 1))
METRICS=$((PORT + 2))
for binary in "$SIM" "$ROUTER"; do
  if [[ ! -x "$binary" ]]; then
    echo "sim-drift-daemon.sh: $binary is missing; build first" >&2
    exit 1
  fi
done
mkdir -p "$OUT"
# The simulator's pool: decode-0..3 with its overload guard (--max_inflight -1: --max_batch 64).
cat >"$OUT/workers.json" <<'JSON'
{"workers": [{"id": "decode-0", "address": "127.0.0.1:9000", "max_inflight": 64},
             {"id": "decode-1", "address": "127.0.0.1:9001", "max_inflight": 64},
             {"id": "decode-2", "address": "127.0.0.1:9002", "max_inflight": 64},
             {"id": "decode-3", "address": "127.0.0.1:9003", "max_inflight": 64}]}
JSON
COMMON=(--trace="$ROOT/data/esft-routing" --prefill_fraction=0.5 --decoders=4 --drift=pool_change --quiet)

router_pid=""
stop_router() {
  if [[ -n "$router_pid" ]]; then
    kill "$router_pid" 2>/dev/null || true
    wait "$router_pid" 2>/dev/null || true
    router_pid=""
  fi
}
trap stop_router EXIT

for seed in $SEEDS; do
  for rate in $RATES; do
    echo "in-process seed $seed rate $rate" >&2
    # shellcheck disable=SC2086  # word splitting of the optional extra flags is intended
    "$SIM" "${COMMON[@]}" --seed="$seed" --rates="$rate" --policies=rr,random,jsq,p2c,eldr,eldr_refit \
      --json_out="$OUT/inprocess-s$seed-r$rate.json" ${ELDR_DRIFT_ARGS:-} >/dev/null
    for mode in static refit unpaced; do
      case "$mode" in
        static) refit_flags=(--refit_interval=0) pace=0 ;;
        refit) refit_flags=(--refit_interval=1250ms --refit_window=7500ms) pace=4 ;;
        unpaced) refit_flags=() pace=0 ;;
      esac
      echo "daemon $mode seed $seed rate $rate" >&2
      # A fresh daemon per cell: its tie-breaking generator and refit window start as an in-process
      # router's do.
      "$ROUTER" --listen="127.0.0.1:$PORT" --admin_listen="127.0.0.1:$ADMIN" --metrics_listen="127.0.0.1:$METRICS" \
        --workers="$OUT/workers.json" --policy=eldr --tau=0.1 --log_level=warning "${refit_flags[@]}" \
        >"$OUT/router-$mode-s$seed-r$rate.log" 2>&1 &
      router_pid=$!
      # shellcheck disable=SC2086
      "$SIM" "${COMMON[@]}" --seed="$seed" --rates="$rate" --policies=rr,random,jsq,p2c,eldr \
        --router="grpc://127.0.0.1:$PORT" --router_admin="grpc://127.0.0.1:$ADMIN" --pace="$pace" \
        --json_out="$OUT/daemon-$mode-s$seed-r$rate.json" ${ELDR_DRIFT_ARGS:-} >/dev/null
      # The daemon's own refits (the simulator does not see them).
      curl -s "http://127.0.0.1:$METRICS/metrics" | grep -E '^eldr_refits_' \
        >"$OUT/daemon-$mode-s$seed-r$rate.refits" || true
      stop_router
    done
  done
done
/usr/bin/python3 "$ROOT/scripts/sim_drift_daemon_table.py" "$OUT"
