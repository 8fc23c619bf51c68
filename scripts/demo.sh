#!/usr/bin/env bash
# The README's first command (`make demo`) ends here, after the build: run the main job end to end
# on the bundled real traces (data/esft-routing) and print what ELDR decided and how fast.
#
# Usage: scripts/demo.sh [BUILD_DIR]   (default: build; executables are in BUILD_DIR/bin)
#
# Each stage is a function named stage_<name>; STAGES lists them in order. To grow the demo, add a
# function and append its name to STAGES. Extra arguments for the core routing stage can be passed
# in ELDR_DEMO_ROUTE_ARGS (e.g. "--tau=0.2 --rounds=50").
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

STAGES=(core_routing)

if [[ ! -d "$DATA_DIR" ]]; then
  echo "demo.sh: bundled traces not found at $DATA_DIR" >&2
  exit 1
fi
for stage in "${STAGES[@]}"; do
  "stage_$stage"
done
