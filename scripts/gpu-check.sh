#!/usr/bin/env bash
# GPU check of the capture library, in one command, for a machine with an NVIDIA GPU:
#   1. configures a Release build with the CUDA kernels (sm_80 and sm_90),
#   2. builds the capture targets only,
#   3. runs the GPU tests (the CUDA path against the CPU reference, bit for bit) and fails if they
#      were skipped (no usable GPU) or failed,
#   4. runs the capture benchmarks (record for 8192 tokens x top-8 x 48 layers, finish for 64
#      requests; CPU and GPU) and prints them, also saved as JSON in the build folder.
#
# Usage: scripts/gpu-check.sh [build-dir]      (default: build-gpu)
# Environment: NVCC (default: nvcc on PATH or /usr/local/cuda/bin/nvcc), CUDA_ARCHS (default
# "80;90"), JOBS (default: all cores), SKIP_BUILD=1 to reuse an existing build.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-$ROOT/build-gpu}
JOBS=${JOBS:-$(nproc)}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
CUDA_ARCHS=${CUDA_ARCHS:-80;90}

section() { printf '\n== %s\n' "$*"; }

section "GPU"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
else
  echo "nvidia-smi not found"
fi
"$NVCC" --version | tail -n 1

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  section "configure + build (CUDA ON, architectures $CUDA_ARCHS) in $BUILD"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DELDR_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" >/dev/null
  ninja -C "$BUILD" -j "$JOBS" eldr_capture eldr_capture_gpu_test eldr-capture-bench
fi
ninja -C "$BUILD" -t commands eldr_capture_static | grep -o 'arch=compute_[0-9]*,code=\[[^]]*\]' |
  sort -u | sed 's/^/kernels built for: /'

section "GPU tests (CUDA path vs CPU reference, bit for bit)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
ELDR_DATA_DIR="$ROOT/data" "$BUILD/bin/eldr_capture_gpu_test" --gtest_brief=1 2>&1 | tee "$log" ||
  status=$?
if grep -q 'SKIPPED' "$log"; then
  echo "gpu-check: GPU tests were skipped: no usable GPU (reason above)" >&2
  exit 2
fi
if [[ $status -ne 0 ]]; then
  echo "gpu-check: GPU tests failed" >&2
  exit "$status"
fi
grep -E '^\[  PASSED  \]' "$log" || true

section "Benchmarks (record: GPU time per layer call; finish: until the counts are in host memory)"
"$BUILD/bin/eldr-capture-bench" --benchmark_min_time=0.5 \
  --benchmark_out="$BUILD/capture-bench.json" --benchmark_out_format=json
echo "saved: $BUILD/capture-bench.json"
