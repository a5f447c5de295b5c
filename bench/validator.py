"""Validator figures on real logits of the default model: wire bytes, validation time, fp8/bf16 vs fp32.

    python -m bench.validator [--num-prompts 3] [--max-new-tokens 48] [--threads 2]

For every position of greedy generations it records the primary's fp32 logits, then compares,
per wire format: the greedy decision (argmax) after a round trip, the total-variation distance
between the softmax of the decoded and the fp32 logits (temperature 1), and the acceptance
decisions of a seeded sample-mode validation of an 8-node chain (fp32 vs decoded logits).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.prompts import DEFAULT_DATA_DIR, load_prompts
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.logits_codec import FORMATS, decode_logits, encode_logits
from specdec.model.loader import default_cache_dir, resolve_model_dir
from specdec.model.tokenizer import Tokenizer
from specdec.acceptance_mode import AcceptanceMode, select_mode
from specdec.sampling import SamplingParams
from validator_svc.acceptance import validate_tree
from validator_svc.paths import TorchPath, ValidationInputs
from specdec.flag_spellings import add_spellings

CHAIN = 8
CHAIN_PARENTS = [-1] + list(range(CHAIN - 1))  # the tree of a chain of CHAIN tokens


def collect_logits(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[torch.Tensor, list]:
    rows, chains = [], []
    for i, ids in enumerate(prompts):
        out = engine.generate(ids, max_new_tokens, SamplingParams())
        engine.open(f"p{i}", ids)
        # One verify of the whole continuation as a chain: the logits a validator sees.
        for start in range(0, len(out) - CHAIN, CHAIN + 1):  # chain, then its bonus token
            chain = out[start : start + CHAIN]
            logits = engine.verify(f"p{i}", chain, [-1] + list(range(CHAIN - 1)))  # [CHAIN+1, V]
            rows.append(logits)
            chains.append(chain)
            engine.commit(f"p{i}", list(range(CHAIN)), chain + [out[start + CHAIN]])
        engine.release(f"p{i}")
    return torch.cat(rows), list(zip(chains, rows))


def wire_formats(all_rows: torch.Tensor, steps: list[tuple[list[int], torch.Tensor]]) -> None:
    """Each logits format on the wire: size, codec time, and what it changes (argmax flips, total
    variation, sample-mode decisions)."""
    p32 = torch.softmax(all_rows, dim=-1)
    argmax32 = all_rows.argmax(-1)
    sampling = SamplingParams(temperature=1.0, seed=7)
    for fmt in FORMATS:
        t = time.perf_counter()
        enc = [encode_logits(rows, fmt) for _, rows in steps]
        encode_ms = (time.perf_counter() - t) * 1000 / len(steps)
        t = time.perf_counter()
        dec = torch.cat([decode_logits(e) for e in enc])
        decode_ms = (time.perf_counter() - t) * 1000 / len(steps)
        tv = 0.5 * (torch.softmax(dec, dim=-1) - p32).abs().sum(-1)
        flips = int((dec.argmax(-1) != argmax32).sum())
        same_sample = 0
        for (chain, rows), e in zip(steps, enc):
            a = validate_tree(chain, CHAIN_PARENTS, rows, sampling, AcceptanceMode.SAMPLE, position=1)
            b = validate_tree(chain, CHAIN_PARENTS, decode_logits(e), sampling, AcceptanceMode.SAMPLE, position=1)
            same_sample += (a.accepted_nodes, a.bonus_token) == (b.accepted_nodes, b.bonus_token)
        print(
            f"{fmt:9s} {enc[0].num_bytes:>9,d} B/step | encode {encode_ms:.2f} ms, decode {decode_ms:.2f} ms | "
            f"argmax flips {flips}/{len(argmax32)} | TV mean {tv.mean():.2e} max {tv.max():.2e} | "
            f"sample-mode decisions identical {same_sample}/{len(steps)}"
        )


def validation_times(steps: list[tuple[list[int], torch.Tensor]]) -> None:
    """The reference validation per step, greedy and sampling."""
    for mode, params in (
        ("greedy", SamplingParams()),
        ("sample T=1", SamplingParams(temperature=1.0, seed=7)),
        ("sample T=0.8 k=50 p=0.9", SamplingParams(0.8, 50, 0.9, seed=3)),
    ):
        times = []
        for chain, rows in steps:
            t = time.perf_counter()
            validate_tree(chain, CHAIN_PARENTS, rows, params, select_mode(params, 0.0), position=1)
            times.append((time.perf_counter() - t) * 1000)
        print(f"validation {mode:24s} median {statistics.median(times):.2f} ms per step ({CHAIN} nodes)")


def greedy_on_fp8(steps: list[tuple[list[int], torch.Tensor]]) -> None:
    """What the service runs on the wire's fp8 bytes: decode + the reference, or the row statistics
    from byte counts that greedy steps take (validator_svc/fp8_stats.py); the primary's fp32 argmax
    comes with every step. Both must decide alike."""
    decoded_ms, counted_ms = [], []
    for chain, rows in steps:
        enc8, argmax = encode_logits(rows, "fp8_e4m3"), rows.argmax(dim=-1).tolist()
        t = time.perf_counter()
        reference = validate_tree(
            chain, CHAIN_PARENTS, decode_logits(enc8), SamplingParams(), AcceptanceMode.GREEDY, argmax_ids=argmax
        )
        decoded_ms.append((time.perf_counter() - t) * 1000)
        inputs = ValidationInputs(
            chain, CHAIN_PARENTS, enc8, SamplingParams(), AcceptanceMode.GREEDY, argmax_ids=argmax
        )
        t = time.perf_counter()
        counted = TorchPath().validate(inputs)
        counted_ms.append((time.perf_counter() - t) * 1000)
        assert (counted.accepted_nodes, counted.bonus_token) == (reference.accepted_nodes, reference.bonus_token)
    print(
        f"validation greedy on fp8 bytes: decoded + reference median {statistics.median(decoded_ms):.2f} ms, "
        f"from byte counts (the service's path) {statistics.median(counted_ms):.2f} ms per step ({CHAIN} nodes)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default=None)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    args = add_spellings(p).parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model_path, default_cache_dir())
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [
        x.token_ids(tokenizer)
        for x in load_prompts(args.data_dir, ["code", "prose", "json"], args.num_prompts, max_chars=1500)
    ]
    loaded = load_model(model_dir, "fp32", max_positions=2048, is_shared=False)
    engine = Engine(loaded.model, KVCache(loaded.config, torch.float32), 2048)
    all_rows, steps = collect_logits(engine, prompts, args.max_new_tokens)
    print(
        f"{all_rows.shape[0]} rows of real fp32 logits ({len(steps)} verify steps of {CHAIN + 1} rows), "
        f"V = {all_rows.shape[1]}"
    )
    wire_formats(all_rows, steps)
    validation_times(steps)
    greedy_on_fp8(steps)


if __name__ == "__main__":
    main()
