#!/usr/bin/env python3
"""Markdown tables of eldr-sim --seeds runs (their --json_out files), for docs/evaluation.md "Drift".

For every file (one drift scenario each) and rate: each policy that is not a load balancer, its
median / P99 TPOT against the best load balancer (mean +- standard error over the seeds, in %) for
the whole run and per phase, and the paired per-seed difference of eldr_refit's median TPOT from
static eldr's in each phase. Usage:

  scripts/sim_drift_tables.py build/drift/none.json build/drift/mix_shift.json ...
"""
import argparse
import json
import math
import sys

LOAD_BALANCERS = {"rr", "random", "jsq", "p2c"}


def mean_se(values):
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, sd / math.sqrt(n)


def pm(mean, se, signed=True):
    return f"{mean:+.1f} ± {se:.1f}" if signed else f"{mean:.2f} ± {se:.2f}"


def phase_metrics(result, phase):
    if phase == "all":
        return result
    for item in result.get("phases", []):
        if item["phase"] == phase:
            return item
    raise KeyError(phase)


def refit_gain(runs, rate, phase):
    """Per seed: 100 * (eldr_refit p50 / eldr p50 - 1) in `phase`; mean and SE."""
    values = []
    for run in runs:
        cells = {r["policy"]: r for r in run["results"] if r["rate_rps"] == rate and r["replicas"] == 1}
        if "eldr" not in cells or "eldr_refit" not in cells:
            return None
        a = phase_metrics(cells["eldr_refit"], phase)["tpot_p50_ms"]
        b = phase_metrics(cells["eldr"], phase)["tpot_p50_ms"]
        values.append(100 * (a / b - 1))
    return mean_se(values)


def table(path):
    with open(path) as f:
        data = json.load(f)
    runs = data["runs"]
    scenario = runs[0].get("drift", {}).get("scenario", "none")
    phases = ["all"] + list(runs[0].get("drift", {}).get("phases", []))
    lines = [f"**{scenario}** ({len(data['seeds'])} seeds: {', '.join(str(s) for s in data['seeds'])})", ""]
    header = "| rate | policy | " + " | ".join(
        ("whole run" if p == "all" else p) + " p50 / p99 vs best LB (%)" for p in phases) + " |"
    lines += [header, "| " + " | ".join(["---"] * (2 + len(phases))) + " |"]
    aggregate = [c for c in data["aggregate"] if c["replicas"] == 1]
    for rate in runs[0]["rates"]:
        for policy in [c["policy"] for c in aggregate if c["rate_rps"] == rate and c["phase"] == "all"]:
            if policy in LOAD_BALANCERS or policy == "best LB":
                continue
            cells = []
            for phase in phases:
                cell = next(c for c in aggregate
                            if c["rate_rps"] == rate and c["policy"] == policy and c["phase"] == phase)
                cells.append(pm(cell["p50_vs_best_lb_pct_mean"], cell["p50_vs_best_lb_pct_se"]) + " / " +
                             pm(cell["p99_vs_best_lb_pct_mean"], cell["p99_vs_best_lb_pct_se"]))
            lines.append(f"| {rate:g} | {policy} | " + " | ".join(cells) + " |")
        best = []
        for phase in phases:
            cell = next(c for c in aggregate if c["rate_rps"] == rate and c["best_load_balancer"] and c["phase"] == phase)
            best.append(pm(cell["tpot_p50_ms_mean"], cell["tpot_p50_ms_se"], False) + " / " +
                        pm(cell["tpot_p99_ms_mean"], cell["tpot_p99_ms_se"], False) + " ms")
        lines.append(f"| {rate:g} | best LB (p50 / p99) | " + " | ".join(best) + " |")
    lines.append("")
    gains = []
    for rate in runs[0]["rates"]:
        parts = []
        for phase in phases:
            gain = refit_gain(runs, rate, phase)
            if gain is None:
                break
            parts.append(f"{'whole run' if phase == 'all' else phase} {pm(*gain)}%")
        if parts:
            gains.append(f"{rate:g} req/s: " + ", ".join(parts))
    if gains:
        lines.append("eldr_refit's median TPOT against static eldr's (paired per seed, mean ± SE): " +
                     "; ".join(gains) + ".")
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="eldr-sim --seeds --json_out files")
    args = parser.parse_args()
    for path in args.inputs:
        print(table(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
