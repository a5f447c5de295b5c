"""End to end with every mix of draft decoders: greedy output (at the default precision) equals speculation off
whichever decoders propose, the model-based ones (early exit, layer skip over the primary's weights, mapped
by the draft pool; the feature decoder's EAGLE-2 trees over the primary's features, which the gateway
forwards), the corpus decoder and lookahead (whose Jacobi window rides in the primary's verify)
included, alone, beside a model-free one, all seven at once, and all seven under the adaptive controller;
and under a JSON schema, the feature decoder beside grammar-forced drafts.

One stack for the module, offering all seven strategies, the corpus decoder over a tiny corpus
(TINY_CORPUS, indexed in a second at start-up) and the feature decoder with a RANDOM drafter
(tests/conftest.py's feature_drafter_path): it drafts garbage, and the output must not change. The
stack is used only once the draft pool has attached the primary's weights and opened the corpus index
(before that those decoders propose nothing, and a test could pass without them). The fixed mixes check
that the model-based decoders did propose, and the corpus and lookahead decoders in some mix (they
propose where their corpus or n-gram pool matches the output).

    .venv/bin/pytest -q tests/e2e/test_decoder_mix.py
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.drafts import BACKGROUND_DECODERS, MODEL_DECODERS, wait_for_model_decoders
from specdec.launcher import DRAFT, Stack, StackConfig, service_specs
from specdec.strategies import FEATURE_STRATEGIES
from specdec.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.e2e

STRATEGIES = ("prompt_lookup", "suffix_index", "corpus", "lookahead", "early_exit", "layer_skip", "feature")
MIXES = (
    ("early_exit",),
    ("layer_skip",),
    ("feature",),
    ("corpus",),
    ("lookahead",),
    ("prompt_lookup", "early_exit"),
    ("suffix_index", "layer_skip"),
    ("prompt_lookup", "lookahead"),
    # the feature decoder hears the rows of whichever candidate's path was accepted, beside lookahead's window rows
    ("prompt_lookup", "feature"),
    ("lookahead", "feature"),
    STRATEGIES,
)
# A constrained request: grammar-forced drafts (the gateway's masks) with the feature decoder's.
SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string"}, "thing": {"type": "string"}},
    "required": ["color", "thing"],
    "additionalProperties": False,
}
SCHEMA_PROMPT = "Name one primary color and one thing that has that color, as JSON."
SCHEMA_MIXES = (("grammar", "feature"), ("grammar", "prompt_lookup", "feature"))
# The corpus decoder's corpus: a little Python and prose, so that it matches, and is both
# accepted and rejected, on both prompts.
TINY_CORPUS = {
    "strings.py": 'def is_palindrome(text: str) -> bool:\n    """Return True when text is a palindrome."""\n'
    "    text = text.lower()\n    return text == text[::-1]\n\n\n"
    "def reverse(text: str) -> str:\n    return text[::-1]\n",
    "colors.md": "The three primary colors are red, blue, and yellow. Here is one thing that has each color:\n\n"
    "1. **Red**: an apple, a strawberry or a fire truck.\n2. **Blue**: the sky, the ocean or a "
    "blueberry.\n3. **Yellow**: the sun, a banana or a lemon.\n\nThese colors cannot be made by "
    "mixing other colors, and every other color is a mix of them.\n",
}
MAX_NEW_TOKENS = 24
DRAFT_LENGTH = 4
ATTACH_TIMEOUT_S = 120.0
PROMPTS = {  # name -> (is_chat, text): one chat request, one raw completion of a code stub
    "chat": (True, "Name three primary colors and one thing that has each color."),
    "completion": (
        False,
        'def is_palindrome(text: str) -> bool:\n    """Return True when text reads the same '
        'backwards, ignoring case."""\n',
    ),
}


@pytest.fixture(scope="module")
def stack(
    redis_server,  # noqa: ANN001 - RedisServer from tests/conftest.py
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer,
    feature_drafter_path: Path,
) -> Iterator[Stack]:
    """tests/e2e/conftest.py's stack, offering the model-based, feature and corpus strategies too, once they
    propose."""
    log_dir = tmp_path_factory.mktemp("stack-test_decoder_mix")
    corpus_dir = tmp_path_factory.mktemp("corpus")
    for name, text in TINY_CORPUS.items():
        (corpus_dir / name).write_text(text)
    config = StackConfig(
        redis_url=redis_server.url,
        strategies=STRATEGIES,
        log_dir=log_dir,
        extra_env={
            "SPECDEC_DRAFT_CORPUS_SOURCES": "",
            "SPECDEC_DRAFT_CORPUS_PATHS": str(corpus_dir),
            "SPECDEC_DRAFT_CORPUS_CACHE_DIR": str(tmp_path_factory.mktemp("corpus-index")),
        },
    )
    specs = tuple(
        dataclasses.replace(s, command=(*s.command, "--feature_drafter", str(feature_drafter_path)))
        if s.name == DRAFT
        else s
        for s in service_specs(config)
    )
    with Stack(config, specs=specs) as started:
        # A probe sends no features, so a feature decoder never proposes to one; it is bound with the
        # others when the weights attach (or refused: then a mix naming it fails with the reason).
        wait_for_model_decoders(
            started,
            [s for s in BACKGROUND_DECODERS if s not in FEATURE_STRATEGIES],
            timeout_s=ATTACH_TIMEOUT_S,
            probe_token_ids=tokenizer.encode("def reverse(text"),
        )
        yield started


def generate(stub, prompt: str, speculation: gateway_pb2.SpeculationConfig) -> gateway_pb2.GenerateResponse:
    is_chat, text = PROMPTS[prompt]
    req = gateway_pb2.GenerateRequest(max_new_tokens=MAX_NEW_TOKENS, speculation=speculation)
    if is_chat:
        req.chat.messages.add(role="user", content=text)
    else:
        req.prompt = text
    return stub.Generate(req, timeout=300)


def fixed(mix: tuple[str, ...]) -> gateway_pb2.SpeculationConfig:
    """Every decoder of the mix proposes draft_length tokens at every step."""
    return gateway_pb2.SpeculationConfig(
        is_enabled=True, strategies=mix, speculative_degree=len(mix), draft_length=DRAFT_LENGTH, is_adaptive=False
    )


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_greedy_output_is_the_primarys_with_every_decoder_mix(gateway_stub, prompt):
    baseline = generate(gateway_stub, prompt, gateway_pb2.SpeculationConfig(is_enabled=False))
    assert len(baseline.token_ids) > 0
    assert baseline.stats.num_proposed_tokens == 0
    num_proposed = {"corpus": 0, "lookahead": 0}
    for mix in MIXES:
        out = generate(gateway_stub, prompt, fixed(mix))
        assert list(out.token_ids) == list(baseline.token_ids), (prompt, mix, out.text, baseline.text)
        assert out.text == baseline.text
        proposed = {d.name: d.num_proposed for d in out.stats.decoders}
        assert set(proposed) <= set(mix), (mix, proposed)
        for name in set(mix) & set(MODEL_DECODERS):  # the model-based decoders really ran
            assert proposed.get(name, 0) > 0, (prompt, mix, proposed)
        for name in num_proposed:
            num_proposed[name] += proposed.get(name, 0)
        assert out.stats.num_generated_tokens == len(out.token_ids)
        assert out.stats.num_steps <= baseline.stats.num_steps
    # The corpus and lookahead decoders propose where their corpus or n-gram pool matches the output,
    # which depends on the mix's steps.
    assert all(num_proposed.values()), (prompt, num_proposed)

    adaptive = generate(
        gateway_stub,
        prompt,
        gateway_pb2.SpeculationConfig(
            is_enabled=True,
            strategies=STRATEGIES,
            speculative_degree=len(STRATEGIES),
            draft_length=DRAFT_LENGTH,
            is_adaptive=True,
        ),
    )
    assert list(adaptive.token_ids) == list(baseline.token_ids), (prompt, "adaptive", adaptive.text, baseline.text)
    assert adaptive.text == baseline.text


def test_greedy_constrained_output_is_the_primarys_with_feature_drafts(gateway_stub):
    """Under a JSON schema the verify is masked and the grammar forces tokens; the feature decoder's
    drafts (cut where the grammar refuses them) change nothing."""

    def constrained(speculation: gateway_pb2.SpeculationConfig) -> gateway_pb2.GenerateResponse:
        req = gateway_pb2.GenerateRequest(max_new_tokens=MAX_NEW_TOKENS, speculation=speculation)
        req.chat.messages.add(role="user", content=SCHEMA_PROMPT)
        req.response_format.type = common_pb2.ResponseFormat.TYPE_JSON_SCHEMA
        req.response_format.json_schema = json.dumps(SCHEMA)
        return gateway_stub.Generate(req, timeout=300)

    baseline = constrained(gateway_pb2.SpeculationConfig(is_enabled=False))
    assert len(baseline.token_ids) > 0 and baseline.stats.num_proposed_tokens == 0
    for mix in SCHEMA_MIXES:
        out = constrained(fixed(mix))
        assert list(out.token_ids) == list(baseline.token_ids), (mix, out.text, baseline.text)
        assert out.text == baseline.text
        proposed = {d.name: d.num_proposed for d in out.stats.decoders}
        assert set(proposed) <= set(mix) and proposed.get("grammar", 0) > 0, (mix, proposed)
