# Entry points. `make demo` and `make test` work on a fresh Debian bookworm machine: each installs
# what is missing (scripts/install-deps.sh), configures and builds first.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=
# `make build TARGETS="a b"` builds only those CMake targets (and what they need); empty: all.
TARGETS ?=
# ccache keys on paths relative to the checkout, so clones in other folders share the cache.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1

.PHONY: all deps deps-sanitizers configure build test demo demo-sim bench sanitize-asan sanitize-tsan fuzz soak gpu image clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/build.ninja: | deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS) $(if $(strip $(TARGETS)),--target $(TARGETS))

# Every test: unit, integration (real processes on loopback), tool and packaging checks.
test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) --timeout 600

# The main job end to end on the bundled real traces.
demo: build
	scripts/demo.sh $(BUILD_DIR)

# The simulator's comparison of eldr with the four load balancers, routed through eldr-router.
demo-sim: build
	scripts/demo.sh --simulator $(BUILD_DIR)

bench: build
	$(BUILD_DIR)/bin/eldr-microbench --benchmark_min_time=0.2

# Sanitizer builds of the unit and integration tests, each in its own build folder.
deps-sanitizers:
	@scripts/install-deps.sh --sanitizers

sanitize-asan: deps-sanitizers
	$(MAKE) test BUILD_DIR=build-asan BUILD_TYPE=RelWithDebInfo CMAKE_ARGS="-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DELDR_SANITIZE='address;undefined' -DELDR_CUDA=OFF -DELDR_BUILD_BENCHMARKS=OFF"

# The system's Abseil, gRPC, FAISS and OpenMP are not TSan-instrumented: cmake/TsanAbseilSync.cmake
# makes Abseil's mutexes visible, races reported from inside those libraries are ignored, and
# cmake/sanitizers/tsan.supp lists the gRPC per-call state that its uninstrumented core hands over.
sanitize-tsan: deps-sanitizers
	TSAN_OPTIONS="$${TSAN_OPTIONS:-ignore_noninstrumented_modules=1:second_deadlock_stack=1:suppressions=$(CURDIR)/cmake/sanitizers/tsan.supp}" $(MAKE) test BUILD_DIR=build-tsan BUILD_TYPE=RelWithDebInfo CMAKE_ARGS="-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DELDR_SANITIZE=thread -DELDR_CUDA=OFF -DELDR_BUILD_BENCHMARKS=OFF"

# libFuzzer targets (clang, ASan+UBSan) in build-fuzz, each run for FUZZ_SECONDS (scripts/fuzz.sh).
FUZZ_SECONDS ?= 10
fuzz: deps-sanitizers
	scripts/fuzz.sh $(FUZZ_SECONDS)

# The daemon under load with misbehaving workers and inputs for SOAK_SECONDS (tests/soak).
SOAK_SECONDS ?= 300
soak: build
	$(BUILD_DIR)/bin/eldr-soak --bin_dir=$(BUILD_DIR)/bin --data_dir=data --duration_s=$(SOAK_SECONDS)

# Builds the CUDA capture library with the kernels and runs its GPU tests and benchmarks (needs a GPU).
gpu: deps
	scripts/gpu-check.sh

# The container image (docker/Dockerfile) built with podman from debootstrapped Debian base images,
# then smoke-tested (scripts/build-image.sh; needs root). IMAGE_ARGS="--tag NAME --refresh-base ..."
image:
	scripts/build-image.sh $(IMAGE_ARGS)

clean:
	rm -rf $(BUILD_DIR)
