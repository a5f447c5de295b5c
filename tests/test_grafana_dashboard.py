"""deploy/grafana/specdec.json queries only metric families the services export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from draft_svc.metrics import DraftMetrics
from gateway.metrics import GatewayMetrics
from http_svc.metrics import HttpMetrics
from primary_svc.metrics import PrimaryMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "specdec.json"


def _exported_samples() -> set[str]:
    registries = [CollectorRegistry() for _ in range(4)]  # one per service, as they run
    GatewayMetrics(registries[0]), PrimaryMetrics(registries[1]), DraftMetrics(registries[2])
    HttpMetrics(registries[3])
    names = set()
    for r in registries:
        for family in r.collect():
            names |= {family.name, f"{family.name}_total", f"{family.name}_bucket", f"{family.name}_sum"}
            names |= {f"{family.name}_count"}
    return names


def test_every_query_names_an_exported_family() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bspecdec_[a-z0-9_]+", expr)}
    assert used and not used - _exported_samples(), sorted(used - _exported_samples())
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
