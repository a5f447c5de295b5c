"""Run in a separate process by test_shared_cuda.py: build the model on a CUDA IPC manifest read
from stdin (JSON) and write its verify logits for fixed tokens (raw fp32, no pickle)."""

from __future__ import annotations

import json
import sys

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import config_from_json, model_from_manifest
from specdec.weights.shared import manifest_from_dict


def main() -> None:
    request = json.loads(sys.stdin.read())
    model = model_from_manifest(manifest_from_dict(request["manifest"]), config_from_json(request["config"]), 64)
    engine = Engine(model, KVCache(model.config, model.kv_dtype, device="cuda"), 64)
    engine.open("peer", request["token_ids"])
    logits = engine.verify("peer", request["tree_token_ids"], request["tree_parents"])
    logits.float().cpu().numpy().tofile(request["logits_path"])


if __name__ == "__main__":
    main()
