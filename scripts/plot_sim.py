#!/usr/bin/python3
"""Draws eldr-sim's figure: per arrival rate, the CDF of TPOT per policy, and median / P99 bars.

eldr-sim --plot FILE calls this with a temporary JSON file (eldr-sim's --json object plus each
result's "tpot_ms_samples"). Run it by hand the same way:

  /usr/bin/python3 scripts/plot_sim.py --input results.json --out figure.png

Needs Debian's python3-matplotlib (and numpy); uses the non-interactive Agg backend.
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# One colour per policy, stable across figures; load balancers in greys/blues, eldr in oranges.
COLOURS = {
    "rr": "#7f7f7f",
    "random": "#bcbd22",
    "jsq": "#1f77b4",
    "p2c": "#17becf",
    "eldr": "#d62728",
    "eldr_refit": "#ff7f0e",
}


def load(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if "results" not in data or not isinstance(data["results"], list):
        raise ValueError(f"{path}: no 'results' list (is it eldr-sim's JSON?)")
    for result in data["results"]:
        for key in ("rate_rps", "policy", "tpot_p50_ms", "tpot_p99_ms"):
            if key not in result:
                raise ValueError(f"{path}: a result lacks '{key}'")
    return data


def label(result):
    """A result's row label: its policy, or with router replicas e.g. "eldr R16 shared"."""
    return result.get("label", result["policy"])


def draw(data, out_path):
    rates = sorted({r["rate_rps"] for r in data["results"]})
    policies = []  # labels, in the order of the results
    policy_of = {}
    for r in data["results"]:
        if label(r) not in policies:
            policies.append(label(r))
            policy_of[label(r)] = r["policy"]
    fig, axes = plt.subplots(len(rates), 2, figsize=(12, 3.4 * len(rates)), squeeze=False)
    capacity = data.get("capacity", {}).get("requests_per_s", 0)
    for row, rate in enumerate(rates):
        cells = {label(r): r for r in data["results"] if r["rate_rps"] == rate}
        load_note = f" ({100 * rate / capacity:.0f}% of capacity)" if capacity else ""
        cdf_axis, bar_axis = axes[row]
        for policy in policies:
            cell = cells.get(policy)
            if cell is None:
                continue
            samples = np.sort(np.asarray(cell.get("tpot_ms_samples", []), dtype=float))
            if samples.size == 0:
                continue
            y = np.arange(1, samples.size + 1) / samples.size
            # eldr_refit dashed: where it equals eldr (no drift) both stay visible. Router
            # replicas dash-dotted with shared state, dotted without.
            kind = policy_of[policy]
            if cell.get("replicas", 1) > 1:
                style = "-." if cell.get("shared_state") else ":"
            else:
                style = "--" if kind == "eldr_refit" else "-"
            cdf_axis.plot(samples, y, label=policy, color=COLOURS.get(kind),
                          linewidth=2.2 if kind.startswith("eldr") else 1.4, linestyle=style)
        cdf_axis.set_title(f"TPOT CDF, {rate:g} req/s{load_note}")
        cdf_axis.set_xlabel("TPOT per request (ms)")
        cdf_axis.set_ylabel("fraction of requests")
        cdf_axis.grid(alpha=0.3)
        cdf_axis.legend(fontsize=8, loc="lower right")

        present = [p for p in policies if p in cells]
        x = np.arange(len(present))
        medians = [cells[p]["tpot_p50_ms"] for p in present]
        tails = [cells[p]["tpot_p99_ms"] for p in present]
        colours = [COLOURS.get(policy_of[p], "#333333") for p in present]
        bar_axis.bar(x - 0.2, medians, width=0.4, color=colours, label="median")
        bar_axis.bar(x + 0.2, tails, width=0.4, color=colours, alpha=0.45, hatch="//", label="P99")
        low = min(medians) * 0.9
        bar_axis.set_ylim(low, max(tails) * 1.03)
        for xi, value in zip(x, medians):
            bar_axis.text(xi - 0.2, value, f"{value:.1f}", ha="center", va="bottom", fontsize=7)
        for xi, value in zip(x, tails):
            bar_axis.text(xi + 0.2, value, f"{value:.1f}", ha="center", va="bottom", fontsize=7)
        bar_axis.set_xticks(x)
        crowded = len(present) > 6 or any(len(p) > 10 for p in present)
        bar_axis.set_xticklabels(present, fontsize=8, rotation=30 if crowded else 0,
                                 ha="right" if crowded else "center")
        bar_axis.set_ylabel("TPOT (ms)")
        bar_axis.set_title(f"median (solid) and P99 (hatched), {rate:g} req/s; axis from {low:.0f} ms",
                           fontsize=10)
        bar_axis.grid(axis="y", alpha=0.3)
    fig.suptitle(data.get("workload", ""), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="eldr-sim JSON with tpot_ms_samples")
    parser.add_argument("--out", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    try:
        data = load(args.input)
        draw(data, args.out)
    except (OSError, ValueError) as error:
        print(f"plot_sim.py: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
