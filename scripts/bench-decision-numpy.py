#!/usr/bin/python3
"""The reference's route decision in numpy beside eldr-microbench's, in one run (docs/benchmarks.md).

For a 48 x 128 count_idf geometry and K = 16, 256, 1024 decode workers it times, per decision:
  - numpy: the reference implementation's computation on one request's int16 counts: mask the
    layers, multiply by IDF, L2-normalise, matrix-vector product with the K centroid rows, the
    band of rows within tau (0.1) of the best, the least-loaded row of the band (argmin);
  - sgemv: OpenBLAS's fp32 matrix-vector product of the same shape alone (scipy.linalg.blas, one
    thread, no copy of the matrix per call);
  - eldr: eldr-microbench's BM_RouteDecision/48x128/K:<k> (the full decision: int16 counts ->
    signature -> index search -> eldr pick), run by this script in the same session,
and prints the times and the ratios numpy / eldr and sgemv / eldr. Inputs are shaped like
eldr-microbench's (256-token prompts, top-8 routing, clustered worker preferences, IDF from 256
calibration prompts over all layers); the numpy timing does not depend on their values.

Usage: scripts/bench-decision-numpy.py [BUILD_DIR] [--repeats N] [--json FILE]
Needs Debian's python3-numpy and python3-scipy (/usr/bin/python3).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

# One BLAS thread, like one route decision in the daemon (set OPENBLAS_NUM_THREADS to override).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402  (after the thread setting, which OpenBLAS reads at load)
from scipy.linalg import blas  # noqa: E402

LAYERS, EXPERTS, TOP_K, PROMPT_TOKENS, TAU = 48, 128, 8, 256, 0.1
POOLS = (16, 256, 1024)


def sample_counts(rng, weights, prompts):
    """int16 counts [prompts][L][E]: each token draws TOP_K experts without replacement per layer
    from `weights` ([L][E], one row per layer), as Gumbel top-k."""
    out = np.zeros((prompts, LAYERS, EXPERTS), dtype=np.int16)
    logw = np.log(weights)
    for p in range(prompts):
        gumbel = rng.gumbel(size=(PROMPT_TOKENS, LAYERS, EXPERTS))
        chosen = np.argpartition(-(logw[None] + gumbel), TOP_K, axis=2)[:, :, :TOP_K]
        for layer in range(LAYERS):
            out[p, layer] = np.bincount(chosen[:, layer].ravel(), minlength=EXPERTS)
    return out


def make_inputs(k, seed=1):
    rng = np.random.default_rng(seed)
    popularity = rng.gamma(2.0, 1.0, size=(LAYERS, EXPERTS))
    worker_pref = rng.gamma(0.6, 1.0, size=(min(k, 64), LAYERS, EXPERTS))
    calibration = sample_counts(rng, popularity, 32)
    # IDF over all layers (count_idf), from the calibration prompts' document frequencies.
    df = (calibration > 0).sum(axis=0).astype(np.float64)
    idf = np.log((len(calibration) + 1) / (df + 1)).astype(np.float32).ravel()
    centroids = rng.standard_normal((k, LAYERS * EXPERTS)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    queries = [sample_counts(rng, popularity * (1 + worker_pref[q % len(worker_pref)]), 1)[0] for q in range(8)]
    loads = rng.integers(0, 8, size=k).astype(np.int64)
    mask = np.arange(LAYERS)
    return idf, centroids, queries, loads, mask


def numpy_decision(counts, mask, idf, centroids, loads):
    x = counts[mask].astype(np.float32).ravel() * idf
    x /= np.linalg.norm(x)
    scores = centroids @ x
    band = np.flatnonzero(scores >= scores.max() - TAU)
    return band[np.argmin(loads[band])]


def time_per_call_us(fn, repeats, calls):
    """Median over `repeats` of the mean time of `calls` calls, in microseconds."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        samples.append((time.perf_counter_ns() - start) / calls / 1e3)
    return float(np.median(samples))


def eldr_times_us(build_dir):
    binary = os.path.join(build_dir, "bin", "eldr-microbench")
    if not os.access(binary, os.X_OK):
        sys.exit(f"bench-decision-numpy: {binary} is missing; build first (cmake --build {build_dir})")
    pattern = "BM_RouteDecision/48x128/K:(" + "|".join(str(k) for k in POOLS) + ")$"
    run = subprocess.run([binary, f"--benchmark_filter={pattern}", "--benchmark_format=json",
                          "--benchmark_min_time=0.5"], capture_output=True, text=True, check=True)
    report = json.loads(run.stdout)
    times = {}
    for bench in report["benchmarks"]:
        k = int(bench["name"].rsplit("K:", 1)[1])
        scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}[bench.get("time_unit", "ns")]
        times[k] = bench["real_time"] * scale
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir", nargs="?", default="build")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    eldr = eldr_times_us(args.build_dir)
    rows = []
    for k in POOLS:
        idf, centroids, queries, loads, mask = make_inputs(k)
        calls = max(200, 200000 // k)
        numpy_us = time_per_call_us(
            lambda i: numpy_decision(queries[i % len(queries)], mask, idf, centroids, loads), args.repeats, calls)
        vector = (queries[0].astype(np.float32).ravel() * idf)
        vector /= np.linalg.norm(vector)
        # The rows as a Fortran-ordered [dim][K] matrix, transposed in the call: no copy per call.
        rows_f = centroids.T
        sgemv_us = time_per_call_us(lambda i: blas.sgemv(1.0, rows_f, vector, trans=1), args.repeats, calls)
        rows.append({"k": k, "eldr_us": eldr[k], "numpy_us": numpy_us, "sgemv_us": sgemv_us,
                     "numpy_over_eldr": numpy_us / eldr[k], "sgemv_over_eldr": sgemv_us / eldr[k]})

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    isa = "avx512f" if "avx512f" in flags else ("avx2" if "avx2" in flags else "generic")
    print(f"CPU: {cpu} ({isa}); numpy {np.__version__}, OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}; "
          f"48x128 count_idf, tau {TAU}")
    print(f"{'K':>5} {'eldr us':>9} {'numpy us':>9} {'sgemv us':>9} {'numpy/eldr':>11} {'sgemv/eldr':>11}")
    for row in rows:
        print(f"{row['k']:>5} {row['eldr_us']:>9.2f} {row['numpy_us']:>9.2f} {row['sgemv_us']:>9.2f} "
              f"{row['numpy_over_eldr']:>10.1f}x {row['sgemv_over_eldr']:>10.1f}x")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": cpu, "isa": isa, "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
