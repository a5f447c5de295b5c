"""python -m bench tools: forced tool calls (tool_choice required / a named function) with
speculation on and off, on the default model through the gateway's gRPC API (a stack of real
processes, started here).

A forced call is generated under the JSON schema built from the tools (gateway/tools.py), so the
grammar path drafts the schema's fixed parts ({"name": "get_weather", "arguments": {"city": ...)
and commits the tokens it alone allows without a primary forward. Each request runs greedy in both
modes, alternating round by round so that drift on a shared machine hits both alike; the calls
must be identical (greedy exactness). Prints per request and in all: generated tokens, primary
steps, tokens/s (generated tokens / wall time of the call), acceptance and forced tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import grpc

from specdec.launcher import Stack, StackConfig
from specdec.flag_spellings import add_spellings
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
BOOKING = {
    "type": "object",
    "properties": {
        "restaurant": {"type": "string", "maxLength": 32},
        "party_size": {"type": "integer", "minimum": 1, "maximum": 20},
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        "dietary_requirements": {"type": "array", "items": {"enum": ["vegan", "vegetarian", "gluten_free", "none"]}},
    },
    "required": ["restaurant", "party_size", "time", "dietary_requirements"],
    "additionalProperties": False,
}
TOOLS = (
    ("get_weather", "The weather forecast for a city", WEATHER),
    ("book_table", "Book a restaurant table", BOOKING),
)
# (question, tool_choice function name or "" for required)
REQUESTS = (
    ("What will the weather be in Lisbon over the next three days, in celsius?", ""),
    ("Book a table for four at Chez Marie at 19:30; one of us is vegan.", "book_table"),
    ("Is it going to rain in Osaka this week? Use fahrenheit.", "get_weather"),
    ("Reserve a table for two at Noma at 20:00, no dietary requirements, and tell me the weather in Copenhagen.", ""),
)


def request(
    question: str, function_name: str, is_speculating: bool, max_new_tokens: int
) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
    req.chat.messages.add(role="user", content=question)
    for name, description, parameters in TOOLS:
        req.tools.add(name=name, description=description, parameters=json.dumps(parameters))
    if function_name:
        req.tool_choice.mode, req.tool_choice.function_name = gateway_pb2.ToolChoice.MODE_FUNCTION, function_name
    else:
        req.tool_choice.mode = gateway_pb2.ToolChoice.MODE_REQUIRED
    req.speculation.is_enabled = is_speculating
    return req


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench tools", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = add_spellings(parser).parse_args()
    results: dict[bool, list[tuple[int, int, float, float, int]]] = {True: [], False: []}
    with Stack(StackConfig()) as stack, grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        for question, name in REQUESTS:  # warm-up: schema compiles, prefix cache
            stub.Generate(request(question, name, True, 8), timeout=600)
        for round_index in range(args.rounds):
            for i, (question, name) in enumerate(REQUESTS):
                calls = {}
                for is_speculating in (round_index % 2 == 0, round_index % 2 == 1):
                    started = time.perf_counter()
                    answer = stub.Generate(request(question, name, is_speculating, args.max_new_tokens), timeout=600)
                    elapsed_s = time.perf_counter() - started
                    s = answer.stats
                    results[is_speculating].append(
                        (
                            s.num_generated_tokens,
                            s.num_steps,
                            s.num_generated_tokens / elapsed_s,
                            s.acceptance_rate,
                            s.num_forced_tokens,
                        )
                    )
                    calls[is_speculating] = [(c.name, c.arguments) for c in answer.tool_calls]
                    if round_index == 0 and is_speculating:
                        print(f"request {i}: {len(answer.tool_calls)} call(s) {answer.text[:120]!r}")
                assert calls[True] == calls[False], f"request {i}: the calls differ with speculation on and off"
    for is_speculating, rows in results.items():
        tokens, steps, rates, acceptance, forced = zip(*rows)
        print(
            f"speculation {'on ' if is_speculating else 'off'}: {len(rows)} requests, "
            f"{statistics.mean(tokens):.1f} tokens, {statistics.mean(steps):.1f} steps, "
            f"median {statistics.median(rates):.1f} tok/s (mean {statistics.mean(rates):.1f}), "
            f"acceptance {statistics.mean(acceptance):.2f}, forced tokens {statistics.mean(forced):.1f}"
        )
    on, off = (statistics.median(r[2] for r in results[k]) for k in (True, False))
    print(f"speedup (median tok/s): {on / off:.2f}x; calls identical with speculation on and off")


if __name__ == "__main__":
    main()
