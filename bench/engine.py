"""Primary-engine benchmark, per precision: weight bytes, start-up time, plain greedy decoding
against transformers, the verify-cost curve after 256 and after 2,048 tokens of context, prefill
tokens/s of one 512- and one 2,048-token prompt, the same step inside the running service, and
llama.cpp's own step on the same GGUF (after 256 tokens).

    python -m bench.engine [--model_path PATH] [--precisions int4,int4:torch,fp32] [--num-prompts 3]
                           [--max-new-tokens 64] [--threads 2] [--service-steps 64] [--compiled default]
                           [--out engine.json]

Same model, same prompts, same process, alternating systems per prompt so drift on a noisy
machine hits both alike. `service` (bench/service_step.py) starts the whole stack and compares
the primary's forward per plain step with `Engine.decode` in-process: a gap is overhead of the
service around the engine. `llamacpp` (when llama-cpp-python is installed: `make bench-deps`)
runs in a child process. Prints a table and writes JSON. Figures, not assertions.

Each verify-curve point is one wall time; for the native kernels it is also split, by the timer
inside the one native forward call (specdec/model/native/csrc/profile.c, SPECDEC_NATIVE_PROFILE),
into the products, attention, the rest of the forward and what runs outside it (bench/engine_split.py;
`python -m bench.engine_split` runs the split curves alone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any
from pathlib import Path

import torch

from bench.engine_split import VERIFY_SIZES, format_split, split_curve
from bench.peer_process import PeerProcess
from bench.peers import default_gguf_path, llama_cpp_missing
from bench.prompts import DEFAULT_DATA_DIR, BenchPrompt, load_prompts
from bench.service_step import service_vs_engine
from bench.report import machine_info
from primary_svc.costs import measure_verify_costs, probe_context_tokens
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.model import native
from specdec.model.loader import default_cache_dir, resolve_model_dir
from specdec.model.precision import compute_dtype
from specdec.model.options import QUANTIZED_PRECISIONS
from specdec.model.tokenizer import Tokenizer
from specdec.sampling import SamplingParams
from specdec.flag_spellings import add_spellings

CONTEXT_TOKENS = 256
LONG_CONTEXT_TOKENS = 2048  # the reference article's sequence length
PREFILL_TOKENS = (512, 2048)
_PREFILL_ID = "__prefill_probe__"


def engine_max_context(
    repeats: int, context_tokens: int = LONG_CONTEXT_TOKENS, sizes: tuple[int, ...] = VERIFY_SIZES
) -> int:
    """Context the benchmark's engines hold: the long curve's measurement (primary_svc.costs.
    probe_context_tokens: the context, the one token each verify commits, and the largest tree).

    E.g. repeats 5: 2048 + 1 + 7 * 11 + 64 = 2190.
    """
    return probe_context_tokens(sizes, repeats, context_tokens)


def plain_decoding(engine: Engine, hf_model, prompts: list[list[int]], max_new_tokens: int) -> dict:
    ours, theirs, same = [], [], 0
    for ids in prompts:
        t = time.perf_counter()
        out = engine.generate(ids, max_new_tokens, SamplingParams())
        ours.append(len(out) / (time.perf_counter() - t))
        t = time.perf_counter()
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        theirs.append(len(ref) / (time.perf_counter() - t))
        same += out == ref
    return {
        "specdec_tokens_per_s": statistics.median(ours),
        "transformers_tokens_per_s": statistics.median(theirs),
        "ratio": statistics.median(ours) / statistics.median(theirs),
        "same_tokens": f"{same}/{len(prompts)}",
    }


def verify_curve(engine: Engine, repeats: int, context_tokens: int = CONTEXT_TOKENS) -> dict:
    """Fastest ms of one verify of k nodes (root + k-1 chained drafts) after context_tokens of context;
    on the native forward, with that verify's split into products, attention and the rest."""
    if engine.model.native_stack is None:
        out = measure_verify_costs(engine, repeats, VERIFY_SIZES, context_tokens)
        split = None
    else:
        split = split_curve(engine, repeats, context_tokens, VERIFY_SIZES)
        out = {k: r["ms"] for k, r in split.items()}
    curve = {"context_tokens": context_tokens, "ms": out, "relative_to_1": {k: v / out[1] for k, v in out.items()}}
    return curve | ({"split": split} if split else {})


def prefill_rate(engine: Engine, num_tokens: int, repeats: int) -> dict:
    """Fastest of `repeats` prefills of one num_tokens prompt, alone, through the engine's own open /
    prefill / release (chunks of engine.prefill_chunk_tokens, as the service runs them).

    The prefill runs every token but the pending last one (num_cached = num_tokens - 1: that one
    enters with the first verify), so tokens/s = num_cached / seconds. Each run has tokens of its
    own, so no run finds another's rows in a prefix cache.
    """
    vocab, times, num_cached = engine.vocab_size, [], 0
    for r in range(repeats + 1):  # the first run warms the chunk shapes up
        engine.open(_PREFILL_ID, [(1000 + 131 * r + i) % vocab for i in range(num_tokens)])
        try:
            assert engine.num_reused_tokens(_PREFILL_ID) == 0
            start = time.perf_counter()
            num_cached = engine.prefill(_PREFILL_ID)
            if r:
                times.append(time.perf_counter() - start)
        finally:
            engine.release(_PREFILL_ID)
    return {
        "num_tokens": num_tokens,
        "num_prefilled": num_cached,
        "chunk_tokens": engine.prefill_chunk_tokens,
        "ms": min(times) * 1000,
        "tokens_per_s": num_cached / min(times),
    }


def compiled_curve(engine: Engine, repeats: int, mode: str) -> dict:
    """The same curve with the compiled step (specdec.model.compiled), after compiling each size's bucket."""
    from specdec.model.compiled import CompiledStep, CompileSettings

    step = CompiledStep(engine.model, CompileSettings(buckets=VERIFY_SIZES, mode=mode))
    compile_s = {k: step.compile_bucket(k) for k in VERIFY_SIZES}
    engine.model.fast_path = step
    try:
        return {"compile_s": compile_s, "mode": mode, **verify_curve(engine, repeats)}
    finally:
        engine.model.fast_path = None


def llama_cpp_curve(context_tokens: int, repeats: int, num_threads: int) -> dict:
    """llama.cpp's ms for a forward of k tokens (all logits kept) after `context_tokens`, same GGUF."""
    if reason := llama_cpp_missing():
        return {"skipped": reason}
    peer = PeerProcess(
        "llamacpp",
        {"gguf_path": str(default_gguf_path()), "num_context": 2048, "num_threads": num_threads, "eos_token_ids": []},
    )
    try:
        ms = peer.call(
            {
                "op": "step_curve",
                "context_ids": [(1000 + i) % 49152 for i in range(context_tokens)],
                "sizes": list(VERIFY_SIZES),
                "repeats": repeats,
            }
        )["ms"]
    except Exception as e:  # a crashing peer is a figure of this run too
        return {"failed": f"{type(e).__name__}: {e}"}
    finally:
        peer.close()
    ms = {int(k): v for k, v in ms.items()}
    return {"ms": ms, "relative_to_1": {k: v / ms[1] for k, v in ms.items()}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default=None)
    p.add_argument(
        "--precisions",
        default="int4,int4:torch,fp32",
        help="comma-separated; 'int4:torch'/'int8:torch' run torch's packed kernels instead of the native ones",
    )
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="runs per verify-curve point (the fastest counts)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="runs per prefill length (the fastest counts)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--compiled",
        default="",
        help="also the compiled step in this torch.compile mode "
        "(default or max-autotune-no-cudagraphs); empty: eager only",
    )
    p.add_argument("--service-steps", type=int, default=64, help="plain steps in the service vs in-process; 0: skip")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=None)
    return add_spellings(p).parse_args()


def print_llama_cpp(result: dict[str, Any]) -> None:
    if "ms" not in result:
        print(f"[llama.cpp] {result}")
        return
    print("[llama.cpp] verify ms  " + "  ".join(f"k={k}: {v:.1f}" for k, v in result["ms"].items()))
    print("[llama.cpp] vs k=1     " + "  ".join(f"k={k}: {v:.2f}x" for k, v in result["relative_to_1"].items()))


def measure_precision(
    name: str,
    args: argparse.Namespace,
    model_dir: Path,
    bench_prompts: list[BenchPrompt],
    tokenizer: Tokenizer,
    max_context: int,
) -> dict[str, Any]:
    """One weight format's figures. `name`: a precision, or "int4:torch" for int4 on torch's packed
    kernels instead of the native ones, for comparison."""
    from transformers import AutoModelForCausalLM

    precision, _, kernels = name.partition(":")
    prompts = [p.token_ids(tokenizer) for p in bench_prompts]
    start = time.perf_counter()
    with native.disabled() if kernels == "torch" else contextlib.nullcontext():
        loaded = load_model(model_dir, precision, max_positions=max_context, is_shared=False)
    engine = Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype), max_context)
    load_s = time.perf_counter() - start
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=compute_dtype(precision)).eval()
    result = {
        "weight_bytes": loaded.weight_bytes,
        "load_s": load_s,
        "kernels": "torch" if kernels == "torch" or precision not in QUANTIZED_PRECISIONS else native.status(),
        "plain": plain_decoding(engine, hf, prompts, args.max_new_tokens),
        "verify": verify_curve(engine, args.repeats),
        "verify_long": verify_curve(engine, args.repeats, LONG_CONTEXT_TOKENS),
        "prefill": [prefill_rate(engine, n, args.prefill_repeats) for n in PREFILL_TOKENS],
    }
    if args.compiled and not any(block.native is not None for block in loaded.model.layers):
        result["compiled"] = compiled_curve(engine, args.repeats, args.compiled)
    del hf, engine, loaded
    if args.service_steps and not kernels:
        result["service"] = service_vs_engine(precision, args.threads, bench_prompts[0], tokenizer, args.service_steps)
    return result


def print_precision(name: str, r: dict[str, Any]) -> None:
    print(f"[{name}] kernels {r['kernels']}")
    print(
        f"[{name}] weights {r['weight_bytes'] / 1e6:.0f} MB, loaded in {r['load_s']:.2f} s | plain greedy: specdec "
        f"{r['plain']['specdec_tokens_per_s']:.1f} tok/s, "
        f"transformers {r['plain']['transformers_tokens_per_s']:.1f} tok/s ({r['plain']['ratio']:.2f}x), "
        f"same tokens {r['plain']['same_tokens']}"
    )
    for curve in (r["verify"], r["verify_long"]):
        head = f"[{name}] context {curve['context_tokens']}:"
        print(f"{head} verify ms  " + "  ".join(f"k={k}: {v:.1f}" for k, v in curve["ms"].items()))
        print(f"{head} vs k=1     " + "  ".join(f"k={k}: {v:.2f}x" for k, v in curve["relative_to_1"].items()))
        for line in format_split(curve["split"])[1:-1] if "split" in curve else []:
            print(f"{head} {line.strip()}")
    print(
        f"[{name}] prefill, one prompt alone (chunks of {r['prefill'][0]['chunk_tokens']}): "
        + ", ".join(f"{f['num_tokens']} tokens {f['tokens_per_s']:.0f} tok/s ({f['ms']:.0f} ms)" for f in r["prefill"])
    )
    if "compiled" in r:
        c = r["compiled"]
        print(
            f"[{name}] compiled ({c['mode']}; compile s "
            + ", ".join(f"k={k}: {v:.0f}" for k, v in c["compile_s"].items())
            + ")"
        )
        print(f"[{name}] compiled verify ms  " + "  ".join(f"k={k}: {v:.1f}" for k, v in c["ms"].items()))
    if "service" in r:
        sv = r["service"]
        print(
            f"[{name}] plain step: in the service {sv['service_forward_ms']:.1f} ms forward "
            f"({sv['service_rpc_ms']:.1f} ms per Decode RPC, {sv['gateway_forward_ms']:.1f} ms through the "
            f"gateway), in-process {sv['engine_ms']:.1f} ms: {sv['service_over_engine']:.2f}x"
        )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model_path, default_cache_dir())
    tokenizer = Tokenizer.from_dir(model_dir)
    bench_prompts = load_prompts(args.data_dir, ["code", "prose", "json"], args.num_prompts, max_chars=2000)
    results: dict[str, Any] = {
        "model_dir": str(model_dir),
        "num_prompts": len(bench_prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": machine_info(),
    }
    results["llamacpp"] = llama_cpp_curve(CONTEXT_TOKENS, args.repeats, args.threads)
    print_llama_cpp(results["llamacpp"])
    max_context = engine_max_context(args.repeats)
    for name in args.precisions.split(","):
        results[name] = measure_precision(name, args, model_dir, bench_prompts, tokenizer, max_context)
        print_precision(name, results[name])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
