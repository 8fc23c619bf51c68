#!/usr/bin/env bash
# Sanitizer builds of the unit and integration tests (the same build folders as `make
# sanitize-asan` / `make sanitize-tsan`), with a choice of tests:
#
#   scripts/sanitize.sh asan                 # ASan + UBSan, every test
#   scripts/sanitize.sh tsan -L unit         # TSan, unit tests only (extra arguments go to ctest)
#   scripts/sanitize.sh tsan -R LoadScraper
#
# Environment: JOBS (default nproc). The TSan build makes the system Abseil's mutexes visible to
# TSan (cmake/TsanAbseilSync.cmake); without that every absl::Mutex would look like a data race.
set -euo pipefail
cd "$(dirname "$0")/.."

kind="${1:-}"
shift || true
case "$kind" in
  asan) build_dir=build-asan; sanitize='address;undefined' ;;
  tsan) build_dir=build-tsan; sanitize='thread' ;;
  *) echo "usage: scripts/sanitize.sh asan|tsan [ctest arguments...]" >&2; exit 2 ;;
esac
jobs="${JOBS:-$(nproc)}"

scripts/install-deps.sh
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DELDR_SANITIZE="$sanitize" \
  -DELDR_CUDA=OFF -DELDR_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build_dir" -j "$jobs"

# Sanitizer reports fail the test that triggers them: UBSan aborts (-fno-sanitize-recover), ASan
# and TSan exit non-zero. Stacks are symbolized with llvm-symbolizer when it is installed.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
# The system's Abseil, gRPC, FAISS and OpenMP are not instrumented: accesses TSan intercepts from
# inside them (memcpy, ...) are not ours to judge, and cmake/sanitizers/tsan.supp lists the gRPC
# per-call state its uninstrumented core hands between threads.
export TSAN_OPTIONS="${TSAN_OPTIONS:-ignore_noninstrumented_modules=1:second_deadlock_stack=1:suppressions=$PWD/cmake/sanitizers/tsan.supp}"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900 "$@"
