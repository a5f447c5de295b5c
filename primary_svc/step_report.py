"""The scheduler's step composition from a primary's Prometheus metrics: rows of verify vs prefill
per engine step, and preemptions.

    python -m primary_svc.step_report http://127.0.0.1:9100/metrics            # totals so far
    python -m primary_svc.step_report URL --interval_s 60                       # over the next minute

Reads the `specdec_engine_step_rows` histograms (primary_svc.worker records one observation per
step and kind), `specdec_engine_step_seconds` (the mean step time) and `specdec_preemptions_total`;
with --interval_s, the difference of two scrapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from primary_svc.metrics import STEP_ROW_KINDS
from specdec.flag_spellings import add_spellings

FETCH_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class StepComposition:
    num_steps: int
    rows: dict[str, float]  # kind -> rows over those steps
    steps_with: dict[str, float]  # kind -> steps that had rows of that kind
    num_preemptions: float
    step_seconds: float = 0.0  # wall time of the steps' forwards, summed (specdec_engine_step_seconds)

    def minus(self, earlier: "StepComposition") -> "StepComposition":
        return StepComposition(
            self.num_steps - earlier.num_steps,
            {k: v - earlier.rows[k] for k, v in self.rows.items()},
            {k: v - earlier.steps_with[k] for k, v in self.steps_with.items()},
            self.num_preemptions - earlier.num_preemptions,
            self.step_seconds - earlier.step_seconds,
        )

    def summary(self) -> dict:
        n = max(self.num_steps, 1)
        return {
            "steps": self.num_steps,
            "preemptions": self.num_preemptions,
            "mean_step_ms": round(1000 * self.step_seconds / self.num_steps, 2) if self.num_steps else None,
            **{f"{k}_rows_per_step": round(self.rows[k] / n, 2) for k in STEP_ROW_KINDS},
            **{f"steps_with_{k}": self.steps_with[k] for k in STEP_ROW_KINDS},
        }


def parse(metrics_text: str) -> StepComposition:
    """The step composition in one scrape of a primary's /metrics text."""
    rows = {k: 0.0 for k in STEP_ROW_KINDS}
    zero = {k: 0.0 for k in STEP_ROW_KINDS}  # steps with no rows of the kind: the le="0.0" bucket
    count = {k: 0.0 for k in STEP_ROW_KINDS}
    num_steps, preemptions, step_seconds = 0, 0.0, 0.0
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            kind = s.labels.get("kind")
            if s.name == "specdec_engine_step_rows_sum" and kind in rows:
                rows[kind] = s.value
            elif s.name == "specdec_engine_step_rows_count" and kind in count:
                count[kind] = s.value
            elif s.name == "specdec_engine_step_rows_bucket" and kind in zero and float(s.labels["le"]) == 0:
                zero[kind] = s.value
            elif s.name == "specdec_engine_steps_total":
                num_steps = int(s.value)
            elif s.name == "specdec_preemptions_total":
                preemptions = s.value
            elif s.name == "specdec_engine_step_seconds_sum":
                step_seconds = s.value
    steps_with = {k: count[k] - zero[k] for k in STEP_ROW_KINDS}
    return StepComposition(num_steps, rows, steps_with, preemptions, step_seconds)


def scrape(url: str) -> StepComposition:
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 - the caller's URL
        return parse(response.read().decode())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m primary_svc.step_report", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics_url", help="the primary's metrics endpoint, e.g. http://127.0.0.1:9100/metrics")
    p.add_argument("--interval_s", type=float, default=0.0, help="report the steps of this interval only")
    a = add_spellings(p).parse_args(argv)
    first = scrape(a.metrics_url)
    if a.interval_s > 0:
        time.sleep(a.interval_s)
        first = scrape(a.metrics_url).minus(first)
    print(json.dumps(first.summary()))


if __name__ == "__main__":
    main()
