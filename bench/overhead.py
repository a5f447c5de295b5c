"""Where a step's time goes, from the gateway's per-request statistics (bench.stack.stats_dict):
the share outside model compute and the mean time per step of each stage.

    outside_fraction(stats)    # (total - forward - model-based drafting) / total, over requests
    stage_ms_per_step(stats)   # {"draft": ..., "forward": ..., "verify_minus_forward": ..., ...}

Model compute is the primary's forward passes (StageTimes.forward_ms) and the draft decoders that
run a model over the primary's weights (their DecoderStats.time_ms); everything else (RPC, queueing,
logits encoding, validation, Redis, cheap drafters, Python) is overhead, the figure docs/architecture.md
(Measurements) asks to report. Pure functions over plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec import strategies
from specdec.candidates import decoder_of

# Draft decoders that run a model (the primary's weights): their time counts as model compute.
MODEL_BASED_DECODERS = strategies.names_of(strategies.MODEL)


def model_draft_ms(stats: dict[str, Any]) -> float:
    """Time of one request's model-based draft decoders (model compute inside the draft stage)."""
    return sum(d["time_ms"] for name, d in stats["decoders"].items() if decoder_of(name) in MODEL_BASED_DECODERS)


def outside_fraction(stats: Sequence[dict[str, Any]]) -> float | None:
    """Share of the total time outside model compute: (total - forward - model-based drafting) / total."""
    total = sum(s["stage_ms"]["total"] for s in stats)
    if total <= 0:
        return None
    model_ms = sum(s["stage_ms"]["forward"] + model_draft_ms(s) for s in stats)
    return max(0.0, total - model_ms) / total


def stage_ms_per_step(stats: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Mean ms per step of each stage, verify split into forward and the rest; None without steps.

    E.g. 2 requests of 5 steps, verify 60 and 40 ms of which forward 50 and 30 -> forward 8.0,
    verify_minus_forward 2.0.
    """
    num_steps = sum(s["num_steps"] for s in stats)
    if not num_steps:
        return None

    def total(key: str) -> float:
        return sum(s["stage_ms"][key] for s in stats)

    out = {
        "draft": total("draft"),
        "draft_model": sum(model_draft_ms(s) for s in stats),
        "forward": total("forward"),
        "verify_minus_forward": total("verify") - total("forward"),
        **{key: total(key) for key in ("validate", "commit", "state", "other", "total")},
    }
    return {key: ms / num_steps for key, ms in out.items()}
