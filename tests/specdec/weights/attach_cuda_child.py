"""Run in a separate process by test_shared_cuda.py: attach to a CUDA IPC manifest read from the
first line of stdin (JSON), report each tensor's checksum and device, then, once told, read one
byte again to show that a write by the owner is seen here (the same device memory, no copy)."""

from __future__ import annotations

import json
import sys

import torch

from specdec.weights.shared import attach, manifest_from_dict


def checksum(t: torch.Tensor) -> int:
    return int(t.reshape(-1).view(torch.uint8).to(torch.int64).sum())


def main() -> None:
    manifest = manifest_from_dict(json.loads(sys.stdin.readline()))
    weights = attach(manifest)
    tensors = dict(weights.tensors)
    print(
        json.dumps(
            {
                "checksums": {name: checksum(t) for name, t in tensors.items()},
                "devices": sorted({str(t.device) for t in tensors.values()}),
            }
        ),
        flush=True,
    )
    name = sys.stdin.readline().strip()  # the owner has written a byte of this tensor
    print(json.dumps({"first_byte": int(tensors[name].reshape(-1).view(torch.uint8)[0])}), flush=True)


if __name__ == "__main__":
    main()
