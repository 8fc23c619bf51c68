#!/usr/bin/env bash
# The drift figures of docs/evaluation.md ("Drift"): eldr-sim on the bundled real traces (the demo's
# real-trace command) over seeds 1-6, without drift and with each drift scenario, then the Markdown
# tables of the section (scripts/sim_drift_tables.py). About 70 s on two cores after the build.
#
# Usage: scripts/sim-drift.sh [BUILD_DIR]   (default: build; writes BUILD_DIR/drift/<scenario>.json,
#        .csv and .txt). Environment: ELDR_DRIFT_SEEDS (default 1-6), ELDR_DRIFT_ARGS (more eldr-sim
#        flags, e.g. --rates=87).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${1:-build}"
SIM="$BUILD_DIR/bin/eldr-sim"
OUT="$BUILD_DIR/drift"
SEEDS="${ELDR_DRIFT_SEEDS:-1-6}"
if [[ ! -x "$SIM" ]]; then
  echo "sim-drift.sh: $SIM is missing; build first" >&2
  exit 1
fi
mkdir -p "$OUT"
for scenario in none mix_shift new_domain pool_change; do
  echo "eldr-sim --drift=$scenario --seeds=$SEEDS" >&2
  # shellcheck disable=SC2086  # word splitting of the optional extra flags is intended
  "$SIM" --trace="$ROOT/data/esft-routing" --prefill_fraction=0.5 --decoders=4 --seeds="$SEEDS" \
    --policies=rr,random,jsq,p2c,eldr,eldr_refit,oracle --drift="$scenario" --quiet \
    --json_out="$OUT/$scenario.json" --csv_out="$OUT/$scenario.csv" ${ELDR_DRIFT_ARGS:-} >"$OUT/$scenario.txt"
done
/usr/bin/python3 "$ROOT/scripts/sim_drift_tables.py" "$OUT"/{none,mix_shift,new_domain,pool_change}.json
