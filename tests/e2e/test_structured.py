"""Structured output end to end: JSON prompts from the shared data set (BFCL function arguments)
with their schemas as response_format, through the four real services.

Constrained speculative decoding (grammar-forced drafts + prompt lookup + suffix index, adaptive)
equals constrained plain decoding token for token (greedy, default precision); every finished output parses and
validates against its schema (jsonschema); JSON mode gives a JSON object; a bad schema is refused
with INVALID_ARGUMENT naming the problem.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import jsonschema
import pytest

from bench.masks import SCHEMA as ROOMS_SCHEMA
from specdec.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.e2e

DATA_DIR = Path(__file__).resolve().parents[2] / "bench" / "data"
# A sample of json.jsonl whose answers are short (the benchmark runs all of them).
SAMPLE_IDS = ("bfcl-live_simple_100-59-1", "bfcl-live_simple_101-60-0", "bfcl-live_simple_105-62-0")
MAX_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def json_prompts() -> list[dict]:
    path = DATA_DIR / "json.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is not here (the shared prompt sets sit beside the repository)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    by_id = {row["id"]: row for row in rows}
    return [by_id[i] for i in SAMPLE_IDS]


def request(
    row: dict,
    *,
    is_speculative: bool,
    kind=common_pb2.ResponseFormat.TYPE_JSON_SCHEMA,
    schema: str | None = None,
    **speculation,
) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(max_new_tokens=MAX_NEW_TOKENS)
    if row.get("system"):
        req.chat.messages.add(role="system", content=row["system"])
    req.chat.messages.add(role="user", content=row["prompt"])
    req.response_format.type = kind
    if kind == common_pb2.ResponseFormat.TYPE_JSON_SCHEMA:
        req.response_format.json_schema = schema if schema is not None else json.dumps(row["schema"])
    req.speculation.is_enabled = is_speculative
    for name, value in speculation.items():
        if name == "strategies":
            req.speculation.strategies.extend(value)
        else:
            setattr(req.speculation, name, value)
    return req


def test_constrained_speculation_equals_constrained_plain_decoding_and_validates(gateway_stub, json_prompts):
    """Adaptive speculation (whatever the controller picks on this machine) and a fixed plan that always
    drafts with the grammar give the plain tokens; the fixed plan's grammar drafts are accepted."""
    num_forced_accepted = num_forced_tokens = 0
    fixed = {
        "is_adaptive": False,
        "speculative_degree": 2,
        "draft_length": 6,
        "strategies": ["grammar", "prompt_lookup"],
    }
    for row in json_prompts:
        plain = gateway_stub.Generate(request(row, is_speculative=False), timeout=300)
        assert plain.finish_reason == gateway_pb2.FINISH_REASON_EOS, (row["id"], plain.text)
        assert plain.stats.num_forced_tokens == 0  # speculation off: plain runs, the baseline
        adaptive = gateway_stub.Generate(request(row, is_speculative=True), timeout=300)
        assert adaptive.stats.task_type == "structured"  # the controller's task class (a fixed plan has none)
        for spec in (
            adaptive,
            gateway_stub.Generate(request(row, is_speculative=True, **fixed), timeout=300),
        ):
            assert list(spec.token_ids) == list(plain.token_ids), row["id"]
            assert spec.text == plain.text
            jsonschema.validate(json.loads(spec.text), row["schema"])
            num_forced_tokens += spec.stats.num_forced_tokens
        num_forced_accepted += sum(d.num_accepted for d in spec.stats.decoders if d.name == "grammar")
    assert num_forced_accepted > 0, "the grammar-forced decoder never contributed"
    # e.g. the `_` after `faq` in a key the model spells `f` `a` `q` `_` ...: committed without a draft
    assert num_forced_tokens > 0, "no token the grammar allows alone was committed undrafted"


def test_fixed_grammar_and_lookup_drafts_give_the_same_tokens(gateway_stub, json_prompts):
    row = json_prompts[0]
    plain = gateway_stub.Generate(request(row, is_speculative=False), timeout=300)
    spec = gateway_stub.Generate(
        request(
            row,
            is_speculative=True,
            is_adaptive=False,
            speculative_degree=2,
            draft_length=6,
            strategies=["grammar", "prompt_lookup"],
        ),
        timeout=300,
    )
    assert list(spec.token_ids) == list(plain.token_ids)
    assert {d.name for d in spec.stats.decoders} >= {"grammar"}


# Repeated keys (an array of objects): from the second object on, the grammar decoder proposes the
# spellings the model used for them before beside the canonical ones, as a small tree.
ROOMS = {
    "id": "rooms",
    "prompt": "List three rooms of a house and say for each whether it is clean.",
    "schema": ROOMS_SCHEMA,  # the mask benchmark's: a JSON array of objects
}


def test_grammar_spelling_trees_give_the_same_tokens(gateway_stub):
    plain = gateway_stub.Generate(request(ROOMS, is_speculative=False), timeout=300)
    for strategies, degree in ((["grammar"], 2), (["grammar", "prompt_lookup"], 4)):
        spec = gateway_stub.Generate(
            request(
                ROOMS,
                is_speculative=True,
                is_adaptive=False,
                speculative_degree=degree,
                draft_length=8,
                strategies=strategies,
            ),
            timeout=300,
        )
        assert list(spec.token_ids) == list(plain.token_ids), (strategies, spec.text, plain.text)
        accepted = {d.name: d.num_accepted for d in spec.stats.decoders}
        assert accepted.get("grammar", 0) > 0, accepted
    adaptive = gateway_stub.Generate(request(ROOMS, is_speculative=True), timeout=300)
    assert list(adaptive.token_ids) == list(plain.token_ids)


def test_json_mode_gives_a_json_object(gateway_stub, json_prompts):
    reply = gateway_stub.Generate(
        request(json_prompts[0], is_speculative=True, kind=common_pb2.ResponseFormat.TYPE_JSON_OBJECT), timeout=300
    )
    if reply.finish_reason == gateway_pb2.FINISH_REASON_EOS:
        assert isinstance(json.loads(reply.text), dict)
    else:  # cut at max_new_tokens: still a prefix of JSON object text
        assert reply.text.startswith("{")


@pytest.mark.parametrize(
    "schema, words",
    [
        ('{"type": "object", "properties": {"a": {"type": "nonsense"}}}', "not a valid JSON Schema"),
        ("{oops", "not valid JSON"),
    ],
)
def test_an_invalid_schema_is_refused_naming_the_problem(gateway_stub, json_prompts, schema, words):
    with pytest.raises(grpc.RpcError) as e:
        gateway_stub.Generate(request(json_prompts[0], is_speculative=True, schema=schema), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format.json_schema" in e.value.details() and words in e.value.details()
