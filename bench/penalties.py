"""What the penalties and logit_bias cost the primary per Verify of a request that has them (requests
without pay nothing: `penalize` returns its input untouched).

    python -m bench penalties [--vocab 49152] [--rows 1,9,33] [--context 256,2048] [--repeats 20]

Per tree of R rows (a chain: row i's path is i tokens deep) after a context of C tokens (half
prompt, half output, token ids drawn from a 4,000-token slice of the vocabulary, so the history
has many repeats as text does), with every control on (repetition, frequency, presence, 300 logit
bias entries), on random fp32 logits [R, V]. Each figure is the fastest of --repeats calls (a shared
machine's preemptions are not cost), in milliseconds, beside a plain copy of the logits [R, V] for
scale (the least any processing that writes a new tensor costs).
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.penalties import penalize
from specdec.sampling import SamplingParams

ID_SPAN = 4000  # history tokens come from this many distinct ids


def fastest_ms(fn, repeats: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench penalties", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default="1,9,33")
    parser.add_argument("--context", default="256,2048")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias=tuple((t, -1.0) for t in range(0, args.vocab, args.vocab // 300)[:300]),
    )
    print(f"torch threads {torch.get_num_threads()}, vocab {args.vocab}, every control on")
    print(f"{'context':>8} {'rows':>5} {'penalize ms':>12} {'copy ms':>8}")
    for context in (int(c) for c in args.context.split(",")):
        history = torch.randint(0, ID_SPAN, (context,), generator=g).tolist()
        prompt, output = history[: context // 2], history[context // 2 :]
        for num_rows in (int(r) for r in args.rows.split(",")):
            logits = torch.randn(num_rows, args.vocab, generator=g)
            tree_ids = torch.randint(0, ID_SPAN, (num_rows - 1,), generator=g).tolist()
            parents = list(range(-1, num_rows - 2))  # a chain
            ms = fastest_ms(lambda: penalize(logits, params, prompt, output, tree_ids, parents), args.repeats)
            copy_ms = fastest_ms(logits.clone, args.repeats)
            print(f"{context:>8} {num_rows:>5} {ms:>12.3f} {copy_ms:>8.3f}")


if __name__ == "__main__":
    main()
