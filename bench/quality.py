"""What a weight format costs in quality: perplexity on a fixed text, and agreement with fp32.

    python -m bench quality [--precisions fp32,bf16,int8,int4] [--num-tokens 1024] [--threads 2]

The text is fixed: the first prose prompts of the shared data set (`prose.jsonl`, in file order),
concatenated and cut to --num-tokens tokens. Each precision runs the whole text through the
engine's model in chunks (teacher forcing) and reports

* perplexity: exp(mean negative log-likelihood of each next token);
* argmax agreement: how often its greedy next token equals fp32's at the same position.

fp32 on a GGUF source is the file's own weights dequantized exactly, so the quantized formats'
figures say what serving them costs against that reference. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from bench.prompts import DEFAULT_DATA_DIR
from specdec.engine import tree as tree_geometry
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.model.llama import SequenceSpan
from specdec.model.loader import default_cache_dir, resolve_model_dir
from specdec.model.tokenizer import Tokenizer
from specdec.flag_spellings import add_spellings

CHUNK_TOKENS = 256


def fixed_text_ids(data_dir: Path, tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    ids: list[int] = []
    for line in (data_dir / "prose.jsonl").read_text(encoding="utf-8").split("\n"):
        if line.strip() and len(ids) < num_tokens:
            ids += tokenizer.encode(json.loads(line)["prompt"] + "\n\n")
    return ids[:num_tokens]


@torch.inference_mode()
def next_token_logits(model_dir: Path, precision: str, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [T-1, V]: row t predicts token t+1, from one left-to-right pass in chunks."""
    loaded = load_model(model_dir, precision, max_positions=len(token_ids) + 1, is_shared=False)
    kv = KVCache(loaded.config, loaded.model.kv_dtype).allocate(len(token_ids))
    rows = []
    for start in range(0, len(token_ids) - 1, CHUNK_TOKENS):
        chunk = token_ids[start : min(start + CHUNK_TOKENS, len(token_ids) - 1)]
        span = SequenceSpan(0, len(chunk), start, kv.k, kv.v, tree_geometry.verify_mask(start, len(chunk), ()))
        rows.append(loaded.model.forward(torch.tensor(chunk), torch.arange(start, start + len(chunk)), [span]))
    return torch.cat(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default=None)
    p.add_argument("--precisions", default="fp32,bf16,int8,int4")
    p.add_argument("--num-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=None)
    args = add_spellings(p).parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model_path, default_cache_dir())
    token_ids = fixed_text_ids(Path(args.data_dir), Tokenizer.from_dir(model_dir), args.num_tokens)
    targets = torch.tensor(token_ids[1:])
    reference = None
    results = {"num_tokens": len(token_ids), "model_dir": str(model_dir)}
    for precision in ["fp32"] + [x for x in args.precisions.split(",") if x != "fp32"]:
        logits = next_token_logits(model_dir, precision, token_ids)  # [T-1, V]
        nll = torch.nn.functional.cross_entropy(logits, targets).item()
        argmax = logits.argmax(-1)
        reference = argmax if reference is None else reference
        agree = (argmax == reference).float().mean().item()
        results[precision] = {"perplexity": math.exp(nll), "argmax_agreement_with_fp32": agree}
        print(
            f"[{precision}] perplexity {math.exp(nll):.3f}, greedy agreement with fp32 {agree:.1%} "
            f"over {len(targets)} positions",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
