"""A node profile: the measured per-node figures the scale-out simulation (bench/simulate.py) runs on.

A profile is a JSON file:

    {"machine": "...",
     "figures": {
        "verify_ms":             {"rows": [1, 2, ...], "value": [3.7, 4.2, ...], "source": "..."},
        "prefill_ms_per_token":  {"value": 0.51, "source": "..."},
        "gateway_ms_per_token":  {"value": 1.65, "source": "..."},
        "redis_step_ops_per_s":  {"value": 72072, "source": "..."},
        "redis_index_ops_per_s": {"value": 249377, "source": "..."}}}

verify_ms: one engine step (a KV-cached forward) of k rows, as `python -m bench engine` measures it;
prefill_ms_per_token: a prompt token's share of a step; gateway_ms_per_token: gateway CPU per
generated token (one core's event loop); redis_*_ops_per_s: what one Redis server completes a second
of the state store's step script (EVALSHA) and of its index commands (ZADD / ZREM). Every figure
names, in `source`, the measurement it comes from; a profile without one is refused.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCALAR_FIGURES = (
    "prefill_ms_per_token",
    "gateway_ms_per_token",
    "redis_step_ops_per_s",
    "redis_index_ops_per_s",
)
DEFAULT_PROFILE = Path(__file__).resolve().parent / "data" / "node_profile_xeon.json"


class ProfileError(ValueError):
    """A node profile that is missing a figure, a source, or holds an impossible value."""


@dataclass(frozen=True)
class NodeProfile:
    machine: str
    verify_rows: tuple[int, ...]  # ascending, >= 1
    verify_ms: tuple[float, ...]  # one per row count, > 0
    prefill_ms_per_token: float
    gateway_ms_per_token: float
    redis_step_ops_per_s: float
    redis_index_ops_per_s: float
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.verify_rows or len(self.verify_rows) != len(self.verify_ms):
            raise ProfileError("verify_ms: rows and value must be non-empty and of the same length")
        if self.verify_rows[0] < 1 or any(a >= b for a, b in zip(self.verify_rows, self.verify_rows[1:])):
            raise ProfileError(f"verify_ms: rows must ascend from >= 1, got {list(self.verify_rows)}")
        if any(ms <= 0 for ms in self.verify_ms):
            raise ProfileError(f"verify_ms: every value must be > 0, got {list(self.verify_ms)}")
        for name in SCALAR_FIGURES:
            if not getattr(self, name) > 0:
                raise ProfileError(f"{name} must be > 0, got {getattr(self, name)}")

    def step_ms(self, num_rows: int) -> float:
        """ms of one engine step of num_rows decode rows: piecewise linear between the measured row
        counts, the first point below them (a step costs at least a one-row forward), the last
        segment's slope above them. 0 rows: no step."""
        if num_rows <= 0:
            return 0.0
        rows, ms = self.verify_rows, self.verify_ms
        if num_rows <= rows[0] or len(rows) == 1:
            return ms[0] if num_rows <= rows[0] else ms[0] * num_rows / rows[0]
        i = min(bisect.bisect_left(rows, num_rows), len(rows) - 1)
        slope = (ms[i] - ms[i - 1]) / (rows[i] - rows[i - 1])
        return ms[i - 1] + slope * (num_rows - rows[i - 1])

    def to_json(self) -> dict[str, Any]:
        figures: dict[str, Any] = {
            "verify_ms": {
                "rows": list(self.verify_rows),
                "value": list(self.verify_ms),
                "source": self.sources.get("verify_ms", ""),
            }
        }
        for name in SCALAR_FIGURES:
            figures[name] = {"value": getattr(self, name), "source": self.sources.get(name, "")}
        return {"machine": self.machine, "figures": figures}

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("sources")
        return out


def _figure(figures: dict[str, Any], name: str) -> dict[str, Any]:
    entry = figures.get(name)
    if not isinstance(entry, dict) or "value" not in entry:
        raise ProfileError(f"figures.{name}: missing (an object with value and source)")
    if not isinstance(entry.get("source"), str) or not entry["source"].strip():
        raise ProfileError(f"figures.{name}.source: every figure must name the measurement it comes from")
    return entry


def profile_from_json(data: Any) -> NodeProfile:
    if not isinstance(data, dict) or not isinstance(data.get("figures"), dict):
        raise ProfileError("a node profile is an object with 'machine' and 'figures'")
    figures = data["figures"]
    verify = _figure(figures, "verify_ms")
    try:
        scalars = {name: float(_figure(figures, name)["value"]) for name in SCALAR_FIGURES}
        rows = tuple(int(r) for r in verify["rows"])
        ms = tuple(float(v) for v in verify["value"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"figures: a value is not a number ({e})") from e
    sources = {name: str(figures[name]["source"]) for name in ("verify_ms", *SCALAR_FIGURES)}
    return NodeProfile(str(data.get("machine", "")), rows, ms, sources=sources, **scalars)


def load_profile(path: Path) -> NodeProfile:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"--node-profile {path}: {e}") from e
    return profile_from_json(data)
