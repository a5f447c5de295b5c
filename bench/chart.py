"""The PNG chart of `python -m bench` results: per precision, speedup over the baseline per scenario
and system (bars), and the speculative system's acceptance rate by primary entropy (lines).

    write_chart(results, Path("results/results.png"))
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.report import BASELINE, SPECULATIVE
from bench.tables import SYSTEM_LABELS

# Where the unbounded last entropy bin [lower, inf) is drawn: this far beyond its lower edge.
OPEN_BIN_WIDTH = 1.0


def speedup_series(run: dict[str, Any]) -> tuple[list[str], dict[str, list[float]]]:
    """(scenarios, system -> speedup per scenario, NaN where it did not run), baseline left out."""
    scenarios = list(run["scenarios"])
    systems = [
        s for s in SYSTEM_LABELS if s != BASELINE and any(s in run["scenarios"][n]["systems"] for n in scenarios)
    ]
    series = {}
    for system in systems:
        values = []
        for name in scenarios:
            speedup = run["scenarios"][name]["systems"].get(system, {}).get("speedup")
            values.append(math.nan if speedup is None else speedup)
        series[system] = values
    return scenarios, series


def entropy_series(run: dict[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    """scenario -> (bin midpoints, acceptance rates) of the speculative system, bins with proposals only."""
    out = {}
    for name, scenario in run["scenarios"].items():
        bins = scenario["systems"].get(SPECULATIVE, {}).get("entropy_bins", [])
        points = [
            (
                (b["lower"] + (b["upper"] if b["upper"] is not None else b["lower"] + OPEN_BIN_WIDTH)) / 2,
                b["acceptance_rate"],
            )
            for b in bins
            if b["num_proposed"]
        ]
        if points:
            out[name] = ([x for x, _ in points], [y for _, y in points])
    return out


def write_chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(13, 4.2 * len(runs)), squeeze=False)
    for (precision, run), (ax_speed, ax_entropy) in zip(runs.items(), axes):
        _speedup_bars(ax_speed, run, precision)
        _entropy_lines(ax_entropy, run, precision)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _speedup_bars(ax: Any, run: dict[str, Any], precision: str) -> None:
    scenarios, series = speedup_series(run)
    width = 0.8 / max(len(series), 1)
    for i, (system, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(scenarios))]
        ax.bar(xs, values, width, label=SYSTEM_LABELS.get(system, system))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_ylabel("speedup over baseline (tok/s ratio)")
    ax.set_title(f"{precision}: speedup per scenario")
    if series:
        ax.legend(fontsize=7)


def _entropy_lines(ax: Any, run: dict[str, Any], precision: str) -> None:
    for name, (xs, ys) in entropy_series(run).items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("primary entropy (nats, bin midpoint)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(-0.03, 1.05)  # points at 0 stay visible
    ax.set_title(f"{precision}: specdec acceptance vs entropy")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
