"""Self-drafting decoders over the primary's shared weights: the same tokens as the same layers run on
the owner's own tensors, compact per-request KV caches kept in sync with the committed tokens."""

from __future__ import annotations

import pytest
import torch

from draft_svc.strategies.self_draft import (
    EarlyExitDecoder,
    LayerSkipDecoder,
    SelfDraftConfig,
    default_skipped_layers,
    self_draft_registry,
)
from draft_svc.weights import ExportedWeights, WeightAttacher
from specdec.engine import tree as tree_geometry
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import config_to_json, load_model
from specdec.model.llama import SequenceSpan, Transformer

MAX_POSITIONS = 256
PROMPT = [1, 504, 3458, 282, 260, 2114, 30, 365]
EARLY_EXIT_LAYERS = 3
RUN_LAYERS = (0, 2, 5)  # layer skip: a non-prefix subset, so the compact cache has to remap


@pytest.fixture(scope="module", params=["fp32", "int4"])
def owner(default_model_dir, request):
    """fp32, and int4 (its layers native where the kernels build, attention reading the compact cache)."""
    torch.set_num_threads(2)
    loaded = load_model(default_model_dir, request.param, max_positions=MAX_POSITIONS, is_shared=True)
    yield loaded
    loaded.shared.unlink()


@pytest.fixture(scope="module")
def draft_model(owner) -> Transformer:
    """The model as the draft pool builds it: a second mapping of the owner's segment."""
    exported = ExportedWeights(owner.shared.manifest, config_to_json(owner.config), owner.precision, "test")
    model = WeightAttacher().attach(exported, max_positions=MAX_POSITIONS).model
    assert model.embed_tokens.data_ptr() != owner.model.embed_tokens.data_ptr()  # its own mapping
    return model


def greedy_reference(model: Transformer, context: list[int], num_tokens: int, **layers) -> list[int]:
    """The owner's tensors, a fresh full-layer cache: the context in one forward, then token by token."""
    kv = KVCache(model.config, model.kv_dtype)
    slot = kv.allocate(len(context) + num_tokens)
    ids, start, out = list(context), 0, []
    while len(out) < num_tokens:
        span = SequenceSpan(0, len(ids), start, slot.k, slot.v, tree_geometry.verify_mask(start, len(ids), ()))
        logits = model.forward(
            torch.tensor(ids),
            torch.arange(start, start + len(ids)),
            [span],
            logits_rows=torch.tensor([len(ids) - 1]),
            **layers,
        )
        start += len(ids)
        out.append(int(torch.argmax(logits[0])))
        ids = out[-1:]
    return out


def _skipped(model: Transformer) -> list[int]:
    return [i for i in range(len(model.layers)) if i not in RUN_LAYERS]


@pytest.mark.parametrize("kind", ["early_exit", "layer_skip"])
def test_drafts_equal_the_same_layers_on_the_owners_tensors_across_steps(owner, draft_model, kind):
    if kind == "early_exit":
        decoder, layers = EarlyExitDecoder(draft_model, EARLY_EXIT_LAYERS), {"num_layers": EARLY_EXIT_LAYERS}
    else:
        decoder, layers = LayerSkipDecoder(draft_model, _skipped(draft_model)), {"layer_ids": RUN_LAYERS}
        assert decoder.layer_ids == RUN_LAYERS
    context = list(PROMPT)
    decoder.extend(context)
    (first,) = decoder.propose(4)
    assert first.decoder == kind and first.rank == 0
    assert list(first.token_ids) == greedy_reference(owner.model, context, 4, **layers)

    # The primary accepted two drafts and sent a bonus token that differs from the third draft.
    bonus = (first.token_ids[2] + 1) % owner.config.vocab_size
    committed = [*first.token_ids[:2], bonus]
    decoder.extend(committed)
    context += committed
    (second,) = decoder.propose(3)
    assert list(second.token_ids) == greedy_reference(owner.model, context, 3, **layers)

    # Nothing accepted: only a bonus token. And proposing twice without news gives the same drafts.
    decoder.extend([second.token_ids[0] ^ 1])
    context.append(second.token_ids[0] ^ 1)
    (third,) = decoder.propose(2)
    assert decoder.propose(2) == (third,)
    assert list(third.token_ids) == greedy_reference(owner.model, context, 2, **layers)


def test_drafts_survive_the_cache_growing_under_them(owner, draft_model):
    # 61 tokens fill a 64-row slot up to row 60; drafts fed at positions 61..65 make it grow mid-chain.
    context = [(17 * i) % 5000 + 100 for i in range(61)]
    decoder = LayerSkipDecoder(draft_model, _skipped(draft_model))
    decoder.extend(context)
    (candidate,) = decoder.propose(6)
    assert decoder._slot.capacity > 64
    assert list(candidate.token_ids) == greedy_reference(owner.model, context, 6, layer_ids=RUN_LAYERS)


def test_cache_holds_only_the_run_layers_and_only_committed_rows(draft_model):
    config = draft_model.config
    decoder = LayerSkipDecoder(draft_model, _skipped(draft_model))
    decoder.extend(PROMPT)
    decoder.propose(6)
    slot = decoder._slot
    assert slot.num_cached == len(PROMPT)  # the drafts' rows were rolled back
    assert slot.k.shape == (len(RUN_LAYERS), config.num_key_value_heads, slot.capacity, config.head_dim)
    assert decoder.num_kv_bytes == 2 * slot.k.numel() * slot.k.element_size()
    full_bytes = (
        2
        * config.num_hidden_layers
        * config.num_key_value_heads
        * slot.capacity
        * config.head_dim
        * slot.k.element_size()
    )
    assert decoder.num_kv_bytes * config.num_hidden_layers == full_bytes * len(RUN_LAYERS)
    decoder.release()
    assert decoder.num_kv_bytes == 0


def test_drafts_stop_at_the_end_of_the_rotary_table(draft_model):
    decoder = EarlyExitDecoder(draft_model, 1)
    decoder.extend([7] * (MAX_POSITIONS - 3))
    (candidate,) = decoder.propose(10)
    assert len(candidate.token_ids) == 4  # d1..d4 feed positions up to MAX_POSITIONS - 1
    decoder.extend([7] * 4)
    assert decoder.propose(10) == ()  # the context fills the table: nothing to draft
    assert decoder.propose(0) == ()


def test_default_layers_and_registry(draft_model):
    # 30 layers: skip every other layer from 8 to 20, as measured in docs/architecture.md; 4 layers: skip 2.
    assert default_skipped_layers(30) == (8, 10, 12, 14, 16, 18, 20)
    assert default_skipped_layers(4) == (2,)
    registry = self_draft_registry(SelfDraftConfig())
    assert registry.names() == ("early_exit", "layer_skip")
    early = registry.create("early_exit", model=draft_model)
    assert early.layer_ids == tuple(range(22))  # round(0.75 * 30)
    skip = registry.create("layer_skip", model=draft_model)
    assert set(skip.layer_ids) == set(range(30)) - set(default_skipped_layers(30))
    with pytest.raises(ValueError, match="exceeds"):
        self_draft_registry(SelfDraftConfig(early_exit_layers=31)).create("early_exit", model=draft_model)
    with pytest.raises(ValueError, match="not all layers"):
        self_draft_registry(SelfDraftConfig(skipped_layers=(30,))).create("layer_skip", model=draft_model)
