#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan+UBSan, coverage-instrumented libraries) in their own
# build folder and runs each for a bounded time on its seed corpus.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS per target (default 10; run longer by hand, e.g. 600). TARGETs are names such as
# prom_text or centroid_artifact (default: all). Environment: FUZZ_BUILD_DIR (default build-fuzz),
# FUZZ_JOBS (ninja -j, default nproc).
# New corpus inputs stay in $FUZZ_BUILD_DIR/fuzz-corpus/<target>/; crashing inputs are written to
# $FUZZ_BUILD_DIR/fuzz-artifacts/ and make the script exit non-zero. After fixing a crash, copy its
# input to fuzz/regressions/<target>/ so fuzz_replay_test keeps it fixed in every build.
set -euo pipefail

cd "$(dirname "$0")/.."
SECONDS_PER_TARGET="${1:-10}"
shift || true
BUILD_DIR="${FUZZ_BUILD_DIR:-build-fuzz}"
JOBS="${FUZZ_JOBS:-$(nproc)}"

if ! [[ "$SECONDS_PER_TARGET" =~ ^[0-9]+$ ]]; then
  echo "usage: scripts/fuzz.sh [SECONDS] [TARGET...]" >&2
  exit 2
fi

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DELDR_BUILD_FUZZERS=ON -DELDR_SANITIZE='address;undefined' -DELDR_CUDA=OFF \
  -DELDR_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target fuzzers

if (($# == 0)); then
  targets=()
  for binary in "$BUILD_DIR"/bin/fuzz_*; do targets+=("$(basename "$binary" | sed 's/^fuzz_//')"); done
else
  targets=("$@")
fi

status=0
summary=()
for target in "${targets[@]}"; do
  binary="$BUILD_DIR/bin/fuzz_$target"
  [[ -x "$binary" ]] || { echo "fuzz.sh: no fuzz target '$target' ($binary)" >&2; exit 2; }
  corpus="$BUILD_DIR/fuzz-corpus/$target"
  artifacts="$BUILD_DIR/fuzz-artifacts"
  mkdir -p "$corpus" "$artifacts"
  dict=()
  [[ -f "fuzz/dict/$target.dict" ]] && dict=("-dict=fuzz/dict/$target.dict")
  log="$BUILD_DIR/fuzz-$target.log"
  echo "== fuzz_$target for ${SECONDS_PER_TARGET}s"
  if "$binary" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="$artifacts/$target-" "${dict[@]}" "$corpus" "fuzz/corpus/$target" >"$log" 2>&1; then
    result="ok"
  else
    result="CRASH (see $log and $artifacts/$target-*)"
    status=1
    tail -n 40 "$log" >&2
  fi
  # libFuzzer's last status line: "#<execs> DONE cov: <edges> ft: <features> corp: <units>/<bytes> ..."
  done_line=$(grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED)' "$log" | tail -n 1 || true)
  execs=$(grep -E '^stat::number_of_executed_units:' "$log" | awk '{print $2}' || true)
  cov=$(sed -nE 's/.*cov: ([0-9]+).*/\1/p' <<<"$done_line")
  ft=$(sed -nE 's/.*ft: ([0-9]+).*/\1/p' <<<"$done_line")
  corp=$(sed -nE 's/.*corp: ([0-9]+)\/.*/\1/p' <<<"$done_line")
  rate=$(grep -E '^stat::average_exec_per_sec:' "$log" | awk '{print $2}' || true)
  summary+=("$(printf '%-18s %10s execs %8s/s  cov %6s  ft %7s  corpus %6s  %s' \
    "$target" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$result")")
done

echo
echo "== fuzz summary (${SECONDS_PER_TARGET}s per target)"
printf '%s\n' "${summary[@]}"
exit $status
