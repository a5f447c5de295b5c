"""python -m bench logprobs: what log probabilities cost a request, on a live stack.

One stack (the default model, --precision, real processes and an in-memory state store) serves
greedy gRPC requests for --num_tokens tokens of a repetitive prompt (prompt lookup drafts from it),
with speculation on and off, each without logprobs and with --top_logprobs alternatives; the four
variants alternate round by round so that drift hits them alike. Then prompt scoring as
lm-eval-harness asks for it (echo + logprobs: the prompt's log probabilities and one new token) of
a --score_tokens-token prompt.

Prints per variant the median tokens/s and mean accepted length over --rounds, and for scoring the
median ms per request and prompt tokens/s. Greedy output is checked identical across variants.
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc

from specdec.launcher import Stack, StackConfig
from specdec.flag_spellings import add_spellings
from specdec.v1 import gateway_pb2, gateway_pb2_grpc, logprobs_pb2

PROMPT = "Copy the list exactly.\n" + "red, green, blue, " * 12
SCORE_TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def _request(is_speculative: bool, num_top: int | None, num_tokens: int) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT,
        max_new_tokens=num_tokens,
        speculation=gateway_pb2.SpeculationConfig(is_enabled=is_speculative, is_adaptive=False),
    )
    if num_top is not None:
        request.logprobs.CopyFrom(logprobs_pb2.LogprobsOptions(num_top_logprobs=num_top))
    return request


def _timed(stub, request: gateway_pb2.GenerateRequest) -> tuple[float, gateway_pb2.GenerateResponse]:
    start = time.perf_counter()
    answer = stub.Generate(request, timeout=600)
    return time.perf_counter() - start, answer


def run(args: argparse.Namespace) -> None:
    config = StackConfig(precision=args.precision, max_context=4096)
    with Stack(config) as stack, grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        variants = {
            (spec, top): _request(spec, top, args.num_tokens)
            for spec in (True, False)
            for top in (None, args.top_logprobs)
        }
        for request in variants.values():  # warm-up: compile paths, fill caches
            stub.Generate(request, timeout=600)
        rates: dict = {key: [] for key in variants}
        lengths: dict = {key: [] for key in variants}
        outputs: set[tuple[int, ...]] = set()
        for _ in range(args.rounds):
            for key, request in variants.items():
                seconds, answer = _timed(stub, request)
                rates[key].append(answer.stats.num_generated_tokens / seconds)
                lengths[key].append(answer.stats.mean_accepted_length)
                outputs.add(tuple(answer.token_ids))
        assert len(outputs) == 1, "greedy output differs between variants"
        print(f"greedy, {args.num_tokens} new tokens, {args.rounds} rounds (median tokens/s, mean accepted length)")
        for (spec, top), values in rates.items():
            label = f"speculation {'on ' if spec else 'off'}  logprobs {'-' if top is None else f'top {top}'}"
            print(f"  {label:34s} {statistics.median(values):7.1f} tok/s   {statistics.mean(lengths[(spec, top)]):.2f}")
        score = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(
                ids=list(stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=SCORE_TEXT), timeout=60).token_ids)[
                    : args.score_tokens
                ]
            ),
            max_new_tokens=1,
            logprobs=logprobs_pb2.LogprobsOptions(num_top_logprobs=1, include_prompt=True),
        )
        stub.Generate(score, timeout=600)
        score_seconds = [_timed(stub, score)[0] for _ in range(args.rounds)]
        ms = statistics.median(score_seconds) * 1000
        print(
            f"scoring (echo + logprobs 1), {len(score.token_ids.ids)} prompt tokens: {ms:.1f} ms/request, "
            f"{len(score.token_ids.ids) / (ms / 1000):.0f} prompt tok/s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--num_tokens", type=int, default=64)
    p.add_argument("--top_logprobs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--score_tokens", type=int, default=256)
    run(add_spellings(p).parse_args())
