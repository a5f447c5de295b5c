"""The validator's two paths timed on one step: the CUDA kernel's row statistics (with the host
walk, as the service runs them) against the host reference, on random logits of the default
model's vocabulary, for trees of several sizes and each wire format.

    python -m bench.validator_kernel [--vocab-size 49152] [--nodes 8,32,64] [--repeats 50]

Without a CUDA device it times the host path alone and says so. Each figure is the median of
`--repeats` validations of the same step after a warm-up; the decisions of the two paths are
compared on every step (a mismatch stops the run)."""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from specdec.acceptance_mode import AcceptanceMode
from specdec.logits_codec import FORMATS, encode_logits
from specdec.sampling import SamplingParams
from validator_svc.kernel import cuda_device_count
from validator_svc.paths import CudaPath, TorchPath, ValidationInputs, ValidationPath


def chain_step(num_nodes: int, vocab_size: int, fmt: str, seed: int) -> ValidationInputs:
    """A chain whose first half follows the argmax (so the walk goes deep) and then leaves it."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_nodes + 1, vocab_size, generator=generator) * 3  # [N+1, V]
    argmax = logits.argmax(dim=-1).tolist()
    token_ids = [argmax[i] if i < num_nodes // 2 else (argmax[i] + 1) % vocab_size for i in range(num_nodes)]
    parents = [i - 1 for i in range(num_nodes)]
    return ValidationInputs(
        token_ids, parents, encode_logits(logits, fmt), SamplingParams(), AcceptanceMode.GREEDY, argmax_ids=argmax
    )


def median_ms(path: ValidationPath, inputs: ValidationInputs, repeats: int) -> tuple[float, tuple]:
    result = path.validate(inputs)  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        result = path.validate(inputs)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), (tuple(result.accepted_nodes), result.bonus_token)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--nodes", default="8,32,64")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    paths: dict[str, ValidationPath] = {"host": TorchPath()}
    if cuda_device_count() > 0:
        paths["cuda"] = CudaPath()
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CUDA device"
    else:
        device = "none (host path only)"
    for path in paths.values():
        path.warm_up()
    print(f"# validator paths, V = {args.vocab_size}, greedy; CPU {platform.processor() or platform.machine()}")
    print(f"# GPU: {device}; {args.threads} host threads; median of {args.repeats}")
    print("| format | nodes | " + " | ".join(f"{name} ms" for name in paths) + " |")
    print("|---|---|" + "---|" * len(paths))
    for fmt in FORMATS:
        for num_nodes in (int(x) for x in args.nodes.split(",")):
            inputs = chain_step(num_nodes, args.vocab_size, fmt, seed=num_nodes)
            timed = {name: median_ms(path, inputs, args.repeats) for name, path in paths.items()}
            decisions = {decision for _, decision in timed.values()}
            if len(decisions) != 1:
                raise SystemExit(f"the paths disagree on {fmt} with {num_nodes} nodes: {timed}")
            print(f"| {fmt} | {num_nodes} | " + " | ".join(f"{ms:.3f}" for ms, _ in timed.values()) + " |")


if __name__ == "__main__":
    main()
