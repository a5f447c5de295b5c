"""Grammar-forced drafts: the protocol, hand-computed proposals, catching up on late creation, and
constrained speculative decoding with these drafts giving exactly constrained plain decoding's
tokens with the real default model (fp32, greedy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draft_svc.strategies.base import DecoderRegistry, DraftDecoder
from draft_svc.strategies.grammar_forced import GrammarForcedDecoder, register_grammar_decoder
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.errors import InvalidArgument
from specdec.grammar import GrammarCache, GrammarTokenizerInfo, ResponseFormat, apply_token_mask
from specdec.model.tokenizer import Tokenizer
from tests.schemas import NAME_AGE_SCHEMA

PERSON = ResponseFormat("json_schema", NAME_AGE_SCHEMA)
PROMPT_IDS = [1, 9690, 198]  # any prompt: the grammar starts after it
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer) -> GrammarCache:
    return GrammarCache(GrammarTokenizerInfo.from_tokenizer(tokenizer))


def _texts(tokenizer, candidates) -> list[str]:
    return [tokenizer.decode(c.token_ids) for c in candidates]


def test_follows_the_protocol_and_registers_as_grammar(grammars):
    registry = DecoderRegistry()
    register_grammar_decoder(registry, grammars)
    decoder = registry.create("grammar", response_format=PERSON)
    assert isinstance(decoder, GrammarForcedDecoder) and isinstance(decoder, DraftDecoder)
    assert registry.names() == ("grammar",) and decoder.name == "grammar"


def test_proposes_the_forced_text_by_hand(grammars, tokenizer):
    decoder = GrammarForcedDecoder(grammars, response_format=PERSON)
    decoder.extend(PROMPT_IDS)  # the prompt is not grammar input
    # The forced text is `{"name": "`; its last token ` "` is held back: the model writes ` "Al` at once.
    assert _texts(tokenizer, decoder.propose(16)) == ['{"name":']
    # rank 0 the canonical tokens; then the other first piece `{` (module doc), nothing learned yet
    candidate, other = decoder.propose(2, max_candidates=3)
    assert tokenizer.decode(candidate.token_ids) == '{"' + "name" and candidate.rank == 0
    assert _pieces(tokenizer, other) == ["{", '"'] and other.rank == 1
    assert candidate.decoder == other.decoder == "grammar"
    decoder.extend(tokenizer.encode('{"name": "Al'))
    assert decoder.propose(16) == ()  # inside a string: nothing forced
    decoder.extend(tokenizer.encode('"'))
    assert _texts(tokenizer, decoder.propose(16)) == [', "age":']  # forced `, "age": ` less ` `
    decoder.extend(tokenizer.encode(', "age": 7'))
    assert _texts(tokenizer, decoder.propose(16)) == []  # `}` or more digits: not forced
    decoder.extend(tokenizer.encode("}"))
    decoder.extend([EOS])
    assert decoder.propose(16) == () and decoder.propose(0) == ()
    with pytest.raises(ValueError, match="max_candidates"):
        decoder.propose(4, max_candidates=0)


def _pieces(tokenizer, candidate) -> list[str]:
    return [tokenizer.decode([t]) for t in candidate.token_ids]


def test_a_text_never_written_before_is_offered_with_each_first_piece_shortest_first(grammars, tokenizer):
    schema = {"type": "object", "properties": {"clean_hello": {"type": "array"}}, "required": ["clean_hello"]}
    decoder = GrammarForcedDecoder(grammars, response_format=ResponseFormat("json_schema", json.dumps(schema)))
    decoder.extend(PROMPT_IDS)
    decoder.extend(tokenizer.encode('{"'))
    # forced `clean_hello": [`: the grammar allows `c`, `cl`, `cle` and `clean` first; the last ` [` held back
    spellings = [_pieces(tokenizer, c) for c in decoder.propose(16, max_candidates=4)]
    assert spellings == [
        ["clean", "_", "hello", '":'],
        ["c", "lean", "_", "hello", '":'],
        ["cl", "ean", "_", "hello", '":'],
        ["cle", "an", "_", "hello", '":'],
    ]
    assert [_pieces(tokenizer, c) for c in decoder.propose(2, max_candidates=2)] == [["clean", "_"], ["c", "lean"]]
    decoder.extend(tokenizer.encode("cl"))  # the model took `cl`: `ean_hello": [` is forced now
    assert [_pieces(tokenizer, c)[0] for c in decoder.propose(16, max_candidates=4)] == ["ean", "e", "ea"]


def test_late_creation_catches_up_on_the_output(grammars, tokenizer):
    output = tokenizer.encode('{"name": "Al"')
    decoder = GrammarForcedDecoder(grammars, response_format=PERSON, num_prompt_tokens=len(PROMPT_IDS))
    decoder.extend(PROMPT_IDS + output)  # the pool's first call: prompt + output
    assert decoder.num_output_tokens == len(output)
    assert _texts(tokenizer, decoder.propose(16)) == [', "age":']


ROOMS = ResponseFormat(
    "json_schema",
    json.dumps(
        {
            "type": "object",
            "required": ["rooms"],
            "properties": {
                "rooms": {
                    "type": "array",
                    "items": {"type": "object", "required": ["clean"], "properties": {"clean": {"type": "boolean"}}},
                }
            },
        }
    ),
)


def test_proposes_the_models_own_spelling_of_a_repeated_key_first(grammars, tokenizer):
    decoder = GrammarForcedDecoder(grammars, response_format=ROOMS)
    decoder.extend(PROMPT_IDS)
    # The model writes the first object's key in pieces: `cl` `e` `an` rather than `clean`.
    for piece in ['{"', "rooms", '":', ' [{"', "cl", "e", "an", '":', " true", "},"]:
        decoder.extend(tokenizer.encode(piece))
    # Forced now: ` {"clean": `. Rank 0: its own pieces where `clean":` starts; rank 1: canonical.
    # (The last canonical token ` ` is held back as before: the model writes ` true` at once.)
    spellings = [[tokenizer.decode([t]) for t in c.token_ids] for c in decoder.propose(16, max_candidates=2)]
    assert spellings == [[' {"', "cl", "e", "an", '":'], [' {"', "clean", '":']]
    assert [c.rank for c in decoder.propose(16, max_candidates=2)] == [0, 1]
    [best] = decoder.propose(16)
    assert tokenizer.decode(best.token_ids) == ' {"clean":' and len(best.token_ids) == 5
    assert [tokenizer.decode(c.token_ids) for c in decoder.propose(3, max_candidates=2)] == [' {"cle', ' {"clean":']


def test_a_request_drafts_the_spellings_other_requests_taught_the_pool(grammars, tokenizer):
    """Two requests of one registry (one pool) and tenant: the first wrote its output's opening `{"name": "` as
    `{` `"` `name` `":` ` "`; the second, which has spelled nothing yet, drafts that spelling first
    (the model's own last token too). Without sharing it drafts the canonical tokens, the last held
    back."""

    def taught_registry(is_sharing_spellings: bool) -> DecoderRegistry:
        registry = DecoderRegistry()
        register_grammar_decoder(registry, grammars, is_sharing_spellings)
        first = registry.create("grammar", response_format=PERSON)
        first.extend(PROMPT_IDS)
        for piece in ["{", '"', "name", '":', ' "Al']:
            first.extend(tokenizer.encode(piece))
        return registry

    def first_draft(registry: DecoderRegistry, tenant: str = "") -> list[str]:
        decoder = registry.create("grammar", response_format=PERSON, tenant=tenant)
        decoder.extend(PROMPT_IDS)
        [best] = decoder.propose(16)
        return [tokenizer.decode([t]) for t in best.token_ids]

    shared = taught_registry(is_sharing_spellings=True)
    assert first_draft(shared) == ["{", '"', "name", '":', ' "']
    # another tenant's request learns nothing from these (its drafts must not reveal their outputs)
    assert first_draft(shared, tenant="b") == ['{"', "name", '":']
    assert first_draft(taught_registry(is_sharing_spellings=False)) == ['{"', "name", '":']


def test_output_outside_the_grammar_silences_the_decoder(grammars, tokenizer):
    decoder = GrammarForcedDecoder(grammars, response_format=PERSON)
    decoder.extend(PROMPT_IDS)
    decoder.extend(tokenizer.encode("Sure! Here is"))
    assert decoder.is_diverged and decoder.propose(16) == ()


def test_invalid_schema_fails_at_creation(grammars):
    with pytest.raises(InvalidArgument) as info:
        GrammarForcedDecoder(grammars, response_format=ResponseFormat("json_schema", '{"type": 7}'))
    assert info.value.field == "response_format.json_schema"


# --- constrained speculative decoding == constrained plain decoding (real model) -------------------

PROMPTS_FILE = Path(__file__).resolve().parents[2] / "bench" / "data" / "json.jsonl"
SCHEMA_PROMPT_IDS = ("bfcl-live_simple_10-3-6", "bfcl-simple_python_149")  # short answers: a fast suite
MAX_NEW_TOKENS = 40
DRAFT_LENGTH = 8


def _plain(engine, prompt_ids, grammar) -> list[int]:
    state, out = grammar.new_state(), []
    engine.open("plain", prompt_ids)
    engine.prefill("plain")
    while len(out) < MAX_NEW_TOKENS and not state.is_terminated:
        logits = engine.verify("plain", (), ())  # [1, V]
        token = int(apply_token_mask(logits, state.allowed_mask().to_bool()).argmax(dim=-1)[0])
        assert state.accept_tokens([token])
        engine.commit("plain", (), (token,))
        out.append(token)
    engine.release("plain")
    return out


def _speculative(engine, prompt_ids, grammar, grammars, response_format) -> tuple[list[int], int]:
    """Greedy chain speculation: the grammar decoder drafts, the masked primary decides."""
    state, out, num_steps = grammar.new_state(), [], 0
    decoder = GrammarForcedDecoder(grammars, response_format=response_format)
    decoder.extend(prompt_ids)
    engine.open("spec", prompt_ids)
    engine.prefill("spec")
    while len(out) < MAX_NEW_TOKENS and not state.is_terminated:
        candidates = decoder.propose(DRAFT_LENGTH)
        draft = list(candidates[0].token_ids) if candidates else []
        parents = list(range(-1, len(draft) - 1))  # a chain
        logits = engine.verify("spec", draft, parents)  # [N+1, V]
        chosen = state.tree_masks(draft, parents).allowed.argmax(logits)  # [N+1], packed
        num_accepted = 0
        while num_accepted < len(draft) and int(chosen[num_accepted]) == draft[num_accepted]:
            num_accepted += 1
        committed = draft[:num_accepted] + [int(chosen[num_accepted])]
        engine.commit("spec", list(range(num_accepted)), committed)
        assert state.accept_tokens(committed)
        decoder.extend(committed)
        out.extend(committed)
        num_steps += 1
    engine.release("spec")
    return out, num_steps


@pytest.mark.slow
def test_speculation_with_grammar_drafts_equals_constrained_plain_decoding(fp32_model, grammars, tokenizer, one_thread):
    if not PROMPTS_FILE.is_file():
        pytest.skip(f"{PROMPTS_FILE} is not on this machine")
    lines = PROMPTS_FILE.read_text(encoding="utf-8").split("\n")  # "\n" only: prompts hold U+2028
    rows = {r["id"]: r for r in map(json.loads, filter(str.strip, lines))}
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32), 1024)
    for prompt_id in SCHEMA_PROMPT_IDS:
        row = rows[prompt_id]
        response_format = ResponseFormat("json_schema", json.dumps(row["schema"]))
        grammar = grammars.compile(response_format)
        messages = [{"role": "user", "content": "Answer with JSON only. " + row["prompt"]}]
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        plain = _plain(engine, prompt_ids, grammar)
        speculative, num_steps = _speculative(engine, prompt_ids, grammar, grammars, response_format)
        assert speculative == plain, (tokenizer.decode(speculative), tokenizer.decode(plain))
        assert plain[-1] == EOS
        json.loads(tokenizer.decode(plain))
        # forced keys and punctuation were accepted: fewer primary steps than tokens
        assert num_steps < 0.8 * len(plain), (num_steps, len(plain))
