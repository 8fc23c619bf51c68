#!/usr/bin/env bash
# Installs the Debian packages that building, testing and the demo need. Idempotent: packages that
# are already installed are left alone, and apt is not touched at all when nothing is missing.
# Assumed present: a C++ toolchain (g++, cmake) and, optionally, the CUDA toolkit under /usr/local/cuda.
#
#   scripts/install-deps.sh               what building, testing and the demo need
#   scripts/install-deps.sh --sanitizers  also clang with its sanitizer and libFuzzer runtimes
#                                         (make fuzz, make sanitize-asan, make sanitize-tsan)
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libfaiss-dev libopenblas-dev prometheus-cpp-dev liblemon-dev libboost-dev
  nlohmann-json3-dev libsimdjson-dev libgtest-dev libgmock-dev libbenchmark-dev libcurl4-openssl-dev
  # yaml-cpp: kubeconfig files (src/discovery).
  libyaml-cpp-dev
  # hiredis + redis-server: replicas sharing state through Redis (src/cluster, its tests).
  libhiredis-dev redis-server
  python3 python3-numpy python3-scipy python3-grpcio python3-matplotlib python3-yaml python3-aiohttp
  openssl curl
  # clang-format 14 (pinned: scripts/check-format.sh, CTest format.check).
  clang-format-14
  # promtool (shipped in the prometheus package): checks the alert rules and dashboard queries
  # and runs the alert unit tests (tests/deploy).
  prometheus
)
if [[ "${1:-}" == "--sanitizers" ]]; then
  # libclang-rt-14-dev holds the ASan/UBSan/TSan runtimes and libFuzzer; llvm-14 the symbolizer.
  PACKAGES+=(clang libclang-rt-14-dev llvm-14)
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
