"""python -m bench [ARGS...]: the headline suite (bench/suite.py; `python -m bench --help`).
`--scenarios long` is the reference article's setting, batch 1 at sequence length ~2,048: prompts of
1,500-1,900 tokens from specbench/prose/code, 256 new tokens (bench/scenarios.py), e.g.
`python -m bench --scenarios long --num-prompts 3 --peers ""`.

python -m bench {engine,validator,drafts,drafter,quality,masks,auth,http,load,tools,logprobs,penalties,
prediction,sampled,simulate,nodes}
[ARGS...]: one component benchmark (each prints its figures).

    engine     plain decoding vs transformers, verify cost per tree size after 256 and 2,048 tokens of
               context, prefill tok/s of a 512- and a 2,048-token prompt        (bench/engine.py)
    validator  wire bytes, validation time, fp8/bf16 vs fp32 on real logits (bench/validator.py)
    drafts     acceptance per decoder and scenario through the whole pipeline (bench/drafts.py)
    drafter    the feature drafter replayed in process on unseen prompts: agreement with the
               primary's greedy tokens by depth, its ms per step                (bench/drafter.py)
    quality    perplexity and greedy agreement with fp32 per weight format     (bench/quality.py)
    masks      the grammar mask's work per constrained step, packed vs bool rows (bench/masks.py)
    auth       cost of the service token per internal RPC                       (bench/auth.py)
    http       the HTTP front's overhead per request and per streamed token     (bench/http.py)
    load       N clients for a bounded time: req/s, tok/s, TTFT, ITL, errors, RSS (bench/load.py);
               --chaos: the soak with a dependency stopped or killed every minute (bench/chaos_run.py)
    tools      forced tool calls with speculation on and off: tok/s, steps, forced tokens (bench/tools.py)
    logprobs   tok/s with and without logprobs, speculation on/off; prompt scoring (bench/logprobs.py)
    penalties  the primary's cost of penalties and logit_bias per Verify         (bench/penalties.py)
    prediction Predicted Outputs on editing tasks: tok/s with and without the file as prediction
               (bench/prediction.py)
    sampled    seeded sampled answers, speculation off and on: tok/s, tok/step, same tokens (bench/sampled.py)
    simulate   N = 1..64 nodes behind G gateways and Redis under a Poisson load, by discrete-event
               simulation from measured per-node figures (bench/simulate.py)
    nodes      N nodes behind M gateways: prefix-cache hit rate vs one node, time to resume and tokens
               re-prefilled after a node's primary is killed                    (bench/nodes.py)
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = (
    "engine",
    "validator",
    "drafts",
    "drafter",
    "quality",
    "masks",
    "auth",
    "http",
    "load",
    "tools",
    "logprobs",
    "penalties",
    "prediction",
    "sampled",
    "simulate",
    "nodes",
)


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] in BENCHMARKS:
        name = sys.argv.pop(1)
        importlib.import_module(f"bench.{name}").main()
        return
    from bench.suite import main as run_suite

    run_suite(sys.argv[1:])


if __name__ == "__main__":
    main()
