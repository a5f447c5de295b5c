"""python -m bench.peer_worker NAME OPTIONS_JSON: one benchmark peer, served over JSON lines.

The child side of `bench.peer_process.PeerProcess`. It loads the peer, writes
`{"systems": [...]}`, then answers one JSON line per request line until stdin closes:

    {"op": "run", "system": "llamacpp", "prompt_ids": [...], "max_new_tokens": 64}
        -> {"token_ids": [...], "seconds": 1.23}
    {"op": "step_curve", "context_ids": [...], "sizes": [1, 2, 4], "repeats": 5}      (llama.cpp only)
        -> {"ms": {"1": 11.0, "2": 19.5, ...}}

A Python exception becomes `{"error": "..."}` and the worker keeps serving; a crash in native
code ends the process, which the parent reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def make_peer(name: str, options: dict[str, Any]) -> Any:
    from bench.peers import LlamaCppPeer, TransformersPeer

    if name == "transformers":
        return TransformersPeer(
            Path(options["model_dir"]), options["precision"], options["num_threads"], options["eos_token_ids"]
        )
    if name == "llamacpp":
        return LlamaCppPeer(
            Path(options["gguf_path"]), options["num_context"], options["num_threads"], options["eos_token_ids"]
        )
    raise ValueError(f"unknown peer {name!r}")


def answer(peer: Any, request: dict[str, Any]) -> dict[str, Any]:
    if request["op"] == "run":
        token_ids, seconds = peer.run(request["system"], request["prompt_ids"], request["max_new_tokens"])
        return {"token_ids": token_ids, "seconds": seconds}
    if request["op"] == "step_curve":
        return {"ms": peer.step_curve(request["context_ids"], request["sizes"], request["repeats"])}
    raise ValueError(f"unknown op {request['op']!r}")


def main() -> None:
    name, options = sys.argv[1], json.loads(sys.argv[2])
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the peer prints must not corrupt the reply stream
    try:
        peer = make_peer(name, options)
    except Exception as e:
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"systems": list(peer.systems)}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = answer(peer, json.loads(line))
        except Exception as e:  # reported to the parent, which records the failure
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
