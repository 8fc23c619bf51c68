#!/usr/bin/env python3
"""The table of docs/evaluation.md's "Through the daemon" (pool_change): from the JSON files that
scripts/sim-drift-daemon.sh writes (one per seed, rate and mode), eldr's median and P99 TPOT in % of
the best load balancer (the best of rr/random/jsq/p2c of the same seed, rate and phase), mean and
standard error over the seeds, for the in-process eldr and eldr_refit and for eldr served by the
daemon in each mode.

Usage: scripts/sim_drift_daemon_table.py DIR
"""
import glob
import json
import math
import os
import re
import sys
from collections import defaultdict

LBS = ("rr", "random", "jsq", "p2c")
PHASES = ("whole run", "before", "after")


def metrics(result, phase):
    if phase == "whole run":
        return result
    for item in result.get("phases", []):
        if item["phase"] == phase:
            return item
    raise KeyError(phase)


def mean_se(values):
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def main():
    directory = sys.argv[1]
    # (rate, row label, phase, stat) -> [% vs best LB per seed]
    figures = defaultdict(list)
    seeds = set()
    for path in sorted(glob.glob(os.path.join(directory, "*-s*-r*.json"))):
        match = re.match(r"(inprocess|daemon-(\w+))-s(\d+)-r([\d.]+)\.json", os.path.basename(path))
        if not match:
            continue
        mode, seed, rate = match.group(2), int(match.group(3)), float(match.group(4))
        seeds.add(seed)
        results = json.load(open(path))["results"]
        for phase in PHASES:
            for stat in ("tpot_p50_ms", "tpot_p99_ms"):
                best = min(metrics(r, phase)[stat] for r in results if r["policy"] in LBS)
                for r in results:
                    if r["policy"] not in ("eldr", "eldr_refit"):
                        continue
                    label = r["policy"] + " (in-process)" if mode is None else f"eldr (daemon, {mode})"
                    figures[(rate, label, phase, stat)].append(100 * (metrics(r, phase)[stat] / best - 1))
    order = ["eldr (in-process)", "eldr (daemon, static)", "eldr_refit (in-process)", "eldr (daemon, refit)",
             "eldr (daemon, unpaced)"]
    print(f"pool_change, {len(seeds)} seeds ({', '.join(map(str, sorted(seeds)))}): p50 / p99 TPOT vs best LB (%)\n")
    print("| rate | router | " + " | ".join(PHASES) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in PHASES) + " |")
    for rate in sorted({key[0] for key in figures}):
        for label in order:
            if (rate, label, "whole run", "tpot_p50_ms") not in figures:
                continue
            cells = []
            for phase in PHASES:
                p50 = mean_se(figures[(rate, label, phase, "tpot_p50_ms")])
                p99 = mean_se(figures[(rate, label, phase, "tpot_p99_ms")])
                cells.append(f"{p50[0]:+.1f} ± {p50[1]:.1f} / {p99[0]:+.1f} ± {p99[1]:.1f}")
            print(f"| {rate:g} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
