"""The verify curve split by the native forward's timer: of each k-row verify, the milliseconds in
the layers' products, in attention, in the rest of the fused forward ("row work": norms,
quantization, RoPE, the KV write, SiLU, residuals, and each phase's wait for its slowest thread)
and outside it (almost all of it the head's product over the k rows; then the embedding, the final
norm and the engine's Python). "non-matmul" is attention + row work.

    python -m bench.engine_split [--model_path PATH] [--precisions int4,int8_token]
                                 [--contexts 256,2048] [--repeats 5] [--threads 2] [--amx-rows 16,32,0]
                                 [--out split.json]

`python -m bench.engine` prints the same split beside its curves; this runs only the curves, for
before/after comparisons of the kernels. Each point is the fastest of `repeats` verifies, with the
split of that same verify (csrc/profile.c times it from inside the one native call). Figures, not
assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.model import native
from specdec.model.loader import default_cache_dir, resolve_model_dir
from primary_svc.costs import fastest_per_size, probe_context_tokens

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
_REQUEST_ID = "__split_probe__"


def _timed_verify(engine: Engine, lib, k: int) -> dict[str, float]:
    """One verify of k rows (root + k-1 chained drafts), then a commit of one token; its split in ms."""
    vocab = engine.vocab_size
    drafts = [(2000 + j) % vocab for j in range(k - 1)]
    native.forward_profile(lib, reset=True)
    start = time.perf_counter()
    engine.verify(_REQUEST_ID, drafts, [-1] + list(range(k - 2)) if drafts else [])
    wall_ms = (time.perf_counter() - start) * 1000
    p = native.forward_profile(lib, reset=True)
    engine.commit(_REQUEST_ID, (), (7,))
    return {
        "ms": wall_ms,
        "products_ms": p.products_s * 1000,
        "attention_ms": p.attention_s * 1000,
        "forward_rest_ms": p.rest_s * 1000,
        "outside_ms": wall_ms - p.total_s * 1000,
        "num_forwards": p.num_forwards,
    }


def split_curve(
    engine: Engine, repeats: int, context_tokens: int, sizes: tuple[int, ...] = VERIFY_SIZES
) -> dict[int, dict[str, float]]:
    """For each k: the fastest of `repeats` verifies after context_tokens of context, with its split.
    Turns the native timer on for the measurement and back off after it."""
    lib = native.library()
    assert lib is not None, native.status()
    native.set_profile(lib, True)
    try:
        return fastest_per_size(
            engine,
            _REQUEST_ID,
            sizes,
            repeats,
            context_tokens,
            lambda k: _timed_verify(engine, lib, k),
            lambda run: run["ms"],
        )
    finally:
        native.set_profile(lib, False)


def format_split(curve: dict[int, dict[str, float]]) -> list[str]:
    """The curve as lines: ms per k, its parts, and the step relative to k = 1's."""
    one = curve[min(curve)]
    lines = []
    for label, key in (
        ("verify ms", "ms"),
        ("layer products", "products_ms"),
        ("outside forward", "outside_ms"),
        ("attention", "attention_ms"),
        ("row work", "forward_rest_ms"),
    ):
        lines.append(f"{label:>16}  " + "  ".join(f"k={k}: {r[key]:6.2f}" for k, r in curve.items()))
    non_matmul = {k: r["attention_ms"] + r["forward_rest_ms"] for k, r in curve.items()}
    lines.append(f"{'non-matmul':>16}  " + "  ".join(f"k={k}: {v:6.2f}" for k, v in non_matmul.items()))
    lines.append(f"{'vs k=1':>16}  " + "  ".join(f"k={k}: {r['ms'] / one['ms']:5.2f}x" for k, r in curve.items()))
    return lines


@contextlib.contextmanager
def _amx_from(min_rows: int | None) -> Iterator[None]:
    """4-bit products on AMX tiles from `min_rows` rows (0: never) within; None: as the library has it."""
    lib = native.library()
    assert lib is not None
    before = lib.qgemm_amx_min_rows()
    if min_rows is not None:
        lib.qgemm_set_amx(min_rows)
    try:
        yield
    finally:
        lib.qgemm_set_amx(before)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default=None)
    p.add_argument("--precisions", default="int4,int8_token", help="comma-separated native precisions")
    p.add_argument("--contexts", default="256,2048", help="comma-separated tokens of context before each curve")
    p.add_argument("--repeats", type=int, default=5, help="verifies per point (the fastest counts)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--amx-rows",
        default="",
        help="comma-separated row counts from which 4-bit products run on AMX tiles (0: never), one curve "
        "each, in turn (the same bits at every value); empty: the library's own",
    )
    p.add_argument("--out", default=None, help="write the curves as JSON here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model_path, default_cache_dir())
    contexts = [int(c) for c in args.contexts.split(",")]
    max_context = probe_context_tokens(VERIFY_SIZES, args.repeats, max(contexts))
    print(f"kernels {native.identity()}, threads {args.threads}")
    results: dict[str, Any] = {"kernels": native.identity(), "threads": args.threads}
    for precision in args.precisions.split(","):
        loaded = load_model(model_dir, precision, max_positions=max_context, is_shared=False)
        engine = Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype), max_context)
        for context_tokens in contexts:
            for amx_rows in [int(r) for r in args.amx_rows.split(",")] if args.amx_rows else [None]:
                label = f"{precision}@{context_tokens}" + ("" if amx_rows is None else f" tiles from {amx_rows}")
                with _amx_from(amx_rows):
                    results[label] = split_curve(engine, args.repeats, context_tokens)
                print(f"[{label}]:")
                for line in format_split(results[label]):
                    print(f"  {line}")
        del engine, loaded
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
