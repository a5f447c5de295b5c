"""Run in a separate process by test_shared.py: attach to a manifest read from stdin (JSON),
prove the tensors are the owner's pages, and write the model's logits for fixed tokens."""

from __future__ import annotations

import json
import sys

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import config_from_json, model_from_manifest
from specdec.weights.shared import SHM_DIR, attach, manifest_from_dict


def shm_mapping(segment: str) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """Address ranges of the segment in this process, and its smaps counters (kB) summed."""
    ranges, counters, inside = [], {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping header line
                inside = line.rstrip().endswith(str(SHM_DIR / segment))
                if inside:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    ranges.append((lo, hi))
            elif inside and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
                counters[head[0][:-1]] = counters.get(head[0][:-1], 0) + int(head[1])
    return ranges, counters


def main() -> None:
    request = json.loads(sys.stdin.read())
    manifest = manifest_from_dict(request["manifest"])
    model = model_from_manifest(manifest, config_from_json(request["config"]), 256)
    tensors = attach(manifest)
    ranges, _ = shm_mapping(manifest.segment_name)
    is_mapped = all(
        any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for lo, hi in ranges)
        for t in tensors.values()
    )
    engine = Engine(model, KVCache(model.config, model.kv_dtype), 256)
    engine.open("child", request["token_ids"])
    logits = engine.verify("child", request["tree_token_ids"], request["tree_parents"])
    checksum = sum(float(t.float().sum()) for t in tensors.values())
    _, counters = shm_mapping(manifest.segment_name)
    logits.numpy().tofile(request["logits_path"])  # raw fp32, no pickle
    print(json.dumps({"is_mapped": is_mapped, "checksum": checksum, "smaps": counters}))


if __name__ == "__main__":
    main()
