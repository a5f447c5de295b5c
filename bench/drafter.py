"""python -m bench drafter: the feature drafter replayed in process on benchmark prompts it never saw.

    python -m bench drafter [--drafter FILE] [--scenarios json,code,prose] [--num-prompts 3]
                            [--first-prompt 0] [--max-new-tokens 96] [--depth 3] [--precision int4]
                            [--out drafter.json]

The primary (in process, `--precision`) decodes each prompt greedily, one token a step, handing the
drafter (`draft_svc.strategies.feature.FeatureDecoder`, a chain: top 1, beam 1) its features after
every step exactly as the pool's strategy receives them. Before each step the drafter proposes a
chain of `--depth` tokens; the figures compare it with the tokens the primary then chose:

    hit by depth    the share of steps whose chain matched the primary's next d tokens (depth d),
                    of the steps that had d tokens of the replay left
    drafts/step     mean accepted drafts a step would gain from the chain (greedy, verified)
    observe ms      the drafter's work on one step's features (its KV row and next feature)
    propose ms      one chain of --depth tokens

With `--speculate 1,2,3` it also decodes each prompt speculatively in process with the drafter's
chains of each depth (verify the chain, keep its greedy prefix, hand the drafter the kept rows'
features) and prints tok/s against the same loop without drafts (depth 0), tokens per step and
whether the tokens equal plain decoding's: what the drafter could gain inside the primary, with no
RPC, on this CPU's verify curve.

Greedy agreement on prompts outside its training data is what bounds the drafter in the service;
`python -m bench drafts` measures it through the pipeline, with the controller's choices. The json
prompts are decoded without their schema here (the drafter drafts the same either way; the mask
changes the primary's tokens). Figures, not assertions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.prompts import DEFAULT_DATA_DIR, BenchPrompt, check_scenarios, load_prompts
from draft_svc.config import DEFAULT_FEATURE_DRAFTER
from draft_svc.strategies.feature import FeatureDecoder, FeatureDrafterSource, FeatureTreeConfig
from specdec.engine.engine import Engine, VerifyWork
from specdec.engine.kv_cache import KVCache
from specdec.engine.tree import chain_parents
from specdec.engine.loading import load_model
from specdec.flag_spellings import add_spellings
from specdec.logits_codec import row_argmax
from specdec.model.loader import default_cache_dir, resolve_model_dir
from specdec.model.tokenizer import Tokenizer


MAX_CONTEXT = 4096  # prompt + answer (longer prompts are skipped)


@dataclasses.dataclass(slots=True)
class Replay:
    """One prompt's steps: the chain proposed before each step and the token the primary chose."""

    chains: list[list[int]] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    observe_s: list[float] = dataclasses.field(default_factory=list)
    propose_s: list[float] = dataclasses.field(default_factory=list)

    def accepted(self, step: int) -> int:
        """How many drafts of the chain before `step` the primary's next tokens confirm, in a row."""
        n = 0
        for draft, token in zip(self.chains[step], self.tokens[step:]):
            if draft != token:
                break
            n += 1
        return n


def open_prefilled(engine: Engine, decoder: FeatureDecoder | None, request_id: str, prompt_ids: Sequence[int]) -> None:
    """Open and prefill the request; the decoder (if any) takes the prompt and the prefill's last row,
    which predicts the pending last prompt token (position len - 1)."""
    engine.open(request_id, prompt_ids)
    try:
        prefill_features: list[torch.Tensor] = []
        engine.prefill(request_id, features_out=prefill_features)
        if decoder is not None:
            decoder.extend(prompt_ids)
            decoder.observe_features(len(prompt_ids) - 1, prefill_features[0])
    except BaseException:
        engine.release(request_id)
        raise


def replay(
    engine: Engine, decoder: FeatureDecoder, prompt_ids: Sequence[int], max_new_tokens: int, depth: int
) -> Replay:
    """Greedy decoding of one prompt with a fresh decoder following it (module doc)."""
    request_id = f"drafter-replay-{time.monotonic_ns()}"
    out = Replay()
    open_prefilled(engine, decoder, request_id, prompt_ids)
    try:
        for _ in range(max_new_tokens):
            start = time.perf_counter()
            chain = decoder.propose(depth, 1)
            out.propose_s.append(time.perf_counter() - start)
            out.chains.append(list(chain[0].token_ids) if chain else [])
            features: list[torch.Tensor] = []
            logits = engine.step([VerifyWork(request_id, (), ())], [], features_out=features)[0]
            token = row_argmax(logits[:1])[0]
            engine.commit(request_id, (), (token,))
            out.tokens.append(token)
            decoder.extend([token])
            start = time.perf_counter()
            decoder.observe_features(len(prompt_ids) - 1 + len(out.tokens), features[0])
            out.observe_s.append(time.perf_counter() - start)
    finally:
        engine.release(request_id)
        decoder.release()
    return out


@dataclasses.dataclass(slots=True)
class Speculated:
    tokens: list[int]
    steps: int
    seconds: float


def speculate(
    engine: Engine, decoder: FeatureDecoder | None, prompt_ids: Sequence[int], max_new_tokens: int, depth: int
) -> Speculated:
    """Greedy speculative decoding of one prompt with the drafter's chains of `depth` tokens (None or
    depth 0: plain decoding through the same loop), timed from the prefill's end."""
    request_id = f"drafter-speculate-{time.monotonic_ns()}"
    open_prefilled(engine, decoder, request_id, prompt_ids)
    try:
        out: list[int] = []
        steps, start = 0, time.perf_counter()
        while len(out) < max_new_tokens:
            room = max_new_tokens - len(out) - 1
            chain = decoder.propose(min(depth, room), 1) if decoder is not None and depth and room else ()
            drafts = list(chain[0].token_ids) if chain else []
            features: list[torch.Tensor] | None = [] if decoder is not None else None
            logits = engine.step([VerifyWork(request_id, drafts, chain_parents(len(drafts)))], [], features)[0]
            argmax = row_argmax(logits)
            n = 0
            while n < len(drafts) and drafts[n] == argmax[n]:
                n += 1
            committed = [*drafts[:n], argmax[n]]
            engine.commit(request_id, list(range(n)), committed)
            if decoder is not None and features is not None:
                decoder.extend(committed)
                decoder.observe_features(len(prompt_ids) + len(out), features[0][: n + 1])
            out.extend(committed)
            steps += 1
        return Speculated(out, steps, time.perf_counter() - start)
    finally:
        engine.release(request_id)
        if decoder is not None:
            decoder.release()


def summarize(replays: Sequence[Replay], depth: int) -> dict[str, Any]:
    """A scenario's figures over its replays; without a step (no prompt fit, or none past
    --first-prompt), 0 steps and no times, so that the other scenarios still run.

    Depth d is counted over the steps that had d of the replay's tokens left to match: a replay's
    last d - 1 steps could not confirm d drafts whatever the chain, and counting them as misses
    pulled the deeper depths down (by the share of such steps, more for short replays). Drafts a
    step is the sum of those rates (the mean of a count is the sum over d of P(count >= d)), so it
    is not cut short at the replays' ends either."""
    steps = [(r, i) for r in replays for i in range(len(r.tokens))]
    accepted = [(r.accepted(i), len(r.tokens) - i) for r, i in steps]  # (drafts confirmed, tokens left)
    hits = []
    for d in range(1, depth + 1):
        measurable = [a for a, left in accepted if left >= d]
        hits.append(sum(a >= d for a in measurable) / len(measurable) if measurable else 0.0)
    observe_s = [s for r in replays for s in r.observe_s]
    propose_s = [s for r in replays for s in r.propose_s]
    return {
        "steps": len(steps),
        "hit_by_depth": [round(h, 4) for h in hits],
        "drafts_per_step": round(sum(hits), 3),
        "observe_ms": round(1000 * statistics.median(observe_s), 3) if observe_s else None,
        "propose_ms": round(1000 * statistics.median(propose_s), 3) if propose_s else None,
    }


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def scenario_ids(
    args: argparse.Namespace, prompts: Sequence[BenchPrompt], scenario: str, tokenizer: Tokenizer
) -> list[list[int]]:
    """The token ids of the scenario's prompts after --first-prompt whose answer fits MAX_CONTEXT (the
    rest skipped, and said so)."""
    rows = [p.token_ids(tokenizer) for p in prompts if p.scenario == scenario][args.first_prompt :]
    fits = [ids for ids in rows if len(ids) + args.max_new_tokens + args.depth + 1 <= MAX_CONTEXT]
    if len(fits) < len(rows):
        print(f"({scenario}: {len(rows) - len(fits)} of {len(rows)} prompts skipped: longer than {MAX_CONTEXT} tokens)")
    return fits


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default=None)
    p.add_argument("--drafter", type=Path, default=DEFAULT_FEATURE_DRAFTER, help="the drafter file")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--scenarios", default="json,code,prose")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--first-prompt", type=int, default=0, help="skip this many rows of each file first")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--depth", type=int, default=3, help="tokens of each proposed chain")
    p.add_argument(
        "--speculate", default="", help="comma-separated chain depths to decode speculatively in process (see doc)"
    )
    p.add_argument("--precision", default="int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = add_spellings(p).parse_args(argv)
    check_scenarios(p, args.scenarios, args.data_dir)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model_path, default_cache_dir())
    loaded = load_model(model_dir, args.precision, max_positions=MAX_CONTEXT, is_shared=False)
    engine = Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype), MAX_CONTEXT)
    tokenizer = Tokenizer.from_dir(model_dir)
    source = FeatureDrafterSource(args.drafter, FeatureTreeConfig(top_k=1, beam=1))
    scenarios = args.scenarios.split(",")
    prompts = load_prompts(args.data_dir, scenarios, args.first_prompt + args.num_prompts)
    results: dict[str, Any] = {"drafter": str(args.drafter), "precision": args.precision, "scenarios": {}}
    print(f"drafter {args.drafter}, primary {args.precision}, chains of {args.depth}, {args.max_new_tokens} tokens")
    print("| scenario | steps | hit by depth | drafts/step | observe ms | propose ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for scenario in scenarios:
        chosen = scenario_ids(args, prompts, scenario, tokenizer)
        model = loaded.model
        replays = [replay(engine, source.create(model=model), i, args.max_new_tokens, args.depth) for i in chosen]
        row = summarize(replays, args.depth)
        results["scenarios"][scenario] = row
        hits = " / ".join(f"{h:.3f}" for h in row["hit_by_depth"])
        print(
            f"| {scenario} | {row['steps']} | {hits} | {row['drafts_per_step']:.2f} | "
            f"{_ms(row['observe_ms'])} | {_ms(row['propose_ms'])} |",
            flush=True,
        )
    if args.speculate:
        depths = [int(d) for d in args.speculate.split(",")]
        results["speculate"] = speculate_table(args, engine, source, loaded.model, tokenizer, prompts, depths)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


def speculate_table(
    args: argparse.Namespace,
    engine: Engine,
    source: FeatureDrafterSource,
    model: Any,
    tokenizer: Tokenizer,
    prompts: Sequence[BenchPrompt],
    depths: Sequence[int],
) -> dict[str, Any]:
    """Per scenario and depth: tok/s summed over the prompts, tokens a step, tokens equal to depth 0's."""
    print("\n| scenario | depth | tok/s | vs plain | tokens/step | same tokens as plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    table: dict[str, Any] = {}
    for scenario in args.scenarios.split(","):
        chosen = scenario_ids(args, prompts, scenario, tokenizer)
        if not chosen:  # nothing to time
            continue
        runs = {
            d: [speculate(engine, source.create(model=model) if d else None, i, args.max_new_tokens, d) for i in chosen]
            for d in (0, *depths)
        }
        plain_rate = sum(len(r.tokens) for r in runs[0]) / sum(r.seconds for r in runs[0])
        table[scenario] = {}
        for d, rs in runs.items():
            rate = sum(len(r.tokens) for r in rs) / sum(r.seconds for r in rs)
            same = sum(r.tokens == p.tokens for r, p in zip(rs, runs[0]))
            per_step = sum(len(r.tokens) for r in rs) / sum(r.steps for r in rs)
            table[scenario][d] = {"tok_s": round(rate, 1), "tokens_per_step": round(per_step, 3), "same": same}
            print(
                f"| {scenario} | {d} | {rate:.1f} | {rate / plain_rate:.2f}x | {per_step:.2f} | {same}/{len(rs)} |",
                flush=True,
            )
    return table


if __name__ == "__main__":
    main()
