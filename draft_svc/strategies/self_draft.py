"""Self-drafting over the primary's own weights: early exit and layer skipping, no second model.

A draft decoder runs a subset of the primary's layers, then the shared final norm and lm_head,
over the SAME tensors (mapped zero-copy from the primary, `draft_svc.weights`), greedily:

    early exit  (LayerSkip, Elhoushi et al. 2024):  layers 0 .. L'-1
    layer skip  (Draft & Verify, Zhang et al. 2023): every layer but a skipped set

Without fine-tuning such drafts agree with the full model on few positions (docs/architecture.md,
Measurements: 7-39 % for SmolLM2) at 60-90 % of a full step's cost, so the controller's cost model decides
whether they run; they are here so that it can.

Per request a decoder keeps the committed context and its OWN KV slot holding the keys/values
of ONLY the layers it runs (compact: an early exit at 22 of 30 layers needs 22/30 of a full
slot). The layer-skip slot is indexed through `_CompactLayers`, which maps the absolute layer
index a Block writes to onto the compact row. The primary's KV cache is never touched.

    extend(committed)          append to the context; rows are computed lazily
    propose(k)                 1. catch up: run the uncached committed tokens in one forward
                                  (chunked for long prompts), giving the next-token logits
                               2. draft greedily token by token: d1 = argmax, feed d1, d2 = argmax, ...
                               3. roll back: the slot keeps only the committed rows

Rows of drafts that the primary then accepts are recomputed in the next catch-up (one forward
of accepted + bonus tokens), which keeps the cache equal to the committed context at rest.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from draft_svc.strategies.base import Candidate, DecoderRegistry, validate_propose_args
from specdec.engine import tree as tree_geometry
from specdec.engine.kv_cache import KVCache, KVSlot
from specdec.model.llama import LayerCache, SequenceSpan, Transformer

CATCH_UP_CHUNK_TOKENS = 512  # bounds the [chunk, context] attention mask of a long prompt's catch-up
EARLY_EXIT_FRACTION = 0.75  # default L' / L: 22 of SmolLM2's 30 layers (24 % agreement, 0.79 cost)
NO_TOKENS = 0  # num_cached of an empty slot


@dataclasses.dataclass(frozen=True, slots=True)
class SelfDraftConfig:
    early_exit_layers: int = 0  # L'; 0 = round(EARLY_EXIT_FRACTION * num_layers)
    skipped_layers: tuple[int, ...] = ()  # () = default_skipped_layers(num_layers)

    def __post_init__(self) -> None:
        if self.early_exit_layers < 0:
            raise ValueError(f"early_exit_layers must be >= 0, got {self.early_exit_layers}")
        if any(i < 0 for i in self.skipped_layers) or len(set(self.skipped_layers)) != len(self.skipped_layers):
            raise ValueError(f"skipped_layers must be distinct non-negative layer ids, got {self.skipped_layers}")


def default_skipped_layers(num_layers: int) -> tuple[int, ...]:
    """Every other layer from ~L/4 to 2L/3; for 30 layers 8, 10, ..., 20 (the set in docs/architecture.md)."""
    first = (num_layers // 4 + 1) & ~1
    return tuple(range(first, 2 * num_layers // 3 + 1, 2))


class _CompactLayers:
    """A KV tensor indexed by absolute layer id, stored with only the layers that run.

    E.g. layer_ids (0, 2, 5): view[5, :, a:b] is storage[2, :, a:b]. Attention reads and writes
    its cache as `cache[layer_idx, :, rows]`, so this is all the indexing it needs.
    """

    __slots__ = ("storage", "_row_of")

    def __init__(self, storage: torch.Tensor, row_of: Mapping[int, int]) -> None:
        self.storage, self._row_of = storage, row_of  # storage: [len(layer_ids), Hkv, capacity, D]

    def __getitem__(self, key: tuple[Any, ...]) -> torch.Tensor:
        return self.storage[(self._row_of[key[0]], *key[1:])]

    def __setitem__(self, key: tuple[Any, ...], value: torch.Tensor) -> None:
        self.storage[(self._row_of[key[0]], *key[1:])] = value


class SelfDraftDecoder:
    """Greedy drafts from `layer_ids` of a shared model, with a compact per-request KV slot."""

    name: ClassVar[str] = "self_draft"

    def __init__(self, model: Transformer, layer_ids: Sequence[int]) -> None:
        num_model_layers = len(model.layers)
        self.layer_ids = tuple(layer_ids)
        if (
            not self.layer_ids
            or list(self.layer_ids) != sorted(set(self.layer_ids))
            or not 0 <= self.layer_ids[0] <= self.layer_ids[-1] < num_model_layers
        ):
            raise ValueError(
                f"layer_ids must be ascending, distinct ids in [0, {num_model_layers}), got {self.layer_ids}"
            )
        self._model = model
        self._is_prefix = self.layer_ids == tuple(range(len(self.layer_ids)))  # no remapping needed
        self._row_of = {layer: row for row, layer in enumerate(self.layer_ids)}
        compact = dataclasses.replace(model.config, num_hidden_layers=len(self.layer_ids))
        self._kv_cache = KVCache(compact, model.kv_dtype, device=model.embed_tokens.device)
        self._slot: KVSlot | None = None  # allocated at the first catch-up
        self._token_ids: list[int] = []  # the committed context

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_kv_bytes(self) -> int:
        return self._kv_cache.num_bytes

    def extend(self, token_ids: Sequence[int]) -> None:
        self._token_ids.extend(int(t) for t in token_ids)

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        """One greedy chain (rank 0) whatever max_candidates: a second chain would cost a second run."""
        validate_propose_args(max_tokens, max_candidates)
        context_len = len(self._token_ids)
        # Drafts d1..dk need positions up to context_len + k - 2 in the rotary table.
        max_tokens = min(max_tokens, self._model.max_positions - context_len + 1)
        if max_tokens <= 0 or context_len == 0:
            return ()
        logits = self._catch_up()  # [V]
        draft_ids = [int(torch.argmax(logits))]
        for _ in range(max_tokens - 1):
            logits = self._run(draft_ids[-1:], context_len + len(draft_ids) - 1)
            draft_ids.append(int(torch.argmax(logits)))
        assert self._slot is not None  # _catch_up allocated it
        self._slot.num_cached = context_len  # roll back the drafts' rows
        return (Candidate(self.name, tuple(draft_ids)),)

    def release(self) -> None:
        if self._slot is not None:
            self._kv_cache.release(self._slot)
            self._slot = None

    def _catch_up(self) -> torch.Tensor:
        """Run the committed tokens the slot lacks; the next-token logits [V] after the context."""
        if self._slot is None:
            self._slot = self._kv_cache.allocate(len(self._token_ids) + 1)
        start = self._slot.num_cached
        if start == len(self._token_ids):
            # Every committed token is cached (no extend since the last propose): re-run the last one
            # to get its logits back; its row is rewritten with the same values.
            start -= 1
        while True:
            end = min(start + CATCH_UP_CHUNK_TOKENS, len(self._token_ids))
            logits = self._run(self._token_ids[start:end], start)
            if end == len(self._token_ids):
                return logits
            start = end

    def _run(self, input_ids: list[int], start: int) -> torch.Tensor:
        """Forward `input_ids` at positions start.. over the chosen layers; logits [V] of the last one."""
        num_new = len(input_ids)
        slot = self._slot
        assert slot is not None  # _catch_up allocated it
        self._kv_cache.reserve(slot, start + num_new)
        k: LayerCache = slot.k  # [len(layer_ids), Hkv, capacity, D]
        v: LayerCache = slot.v
        if not self._is_prefix:
            k, v = _CompactLayers(slot.k, self._row_of), _CompactLayers(slot.v, self._row_of)
        mask = tree_geometry.verify_mask(start, num_new, ())  # causal over the new rows
        span = SequenceSpan(0, num_new, start, k, v, mask)
        device = self._model.embed_tokens.device
        logits = self._model.forward(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.arange(start, start + num_new, device=device),
            [span],
            logits_rows=torch.tensor([num_new - 1], device=device),
            **self._layer_args(),
        )
        # Count the new rows as cached, drafts included, so that a slot growing mid-chain copies them
        # too; propose() rolls the drafts back afterwards.
        slot.num_cached = start + num_new
        return logits[0]  # [V]

    def _layer_args(self) -> dict[str, Any]:
        return {"layer_ids": self.layer_ids}


class EarlyExitDecoder(SelfDraftDecoder):
    """The first `num_layers` layers, then the shared norm and lm_head."""

    name: ClassVar[str] = "early_exit"

    def __init__(self, model: Transformer, num_layers: int) -> None:
        super().__init__(model, range(num_layers))

    def _layer_args(self) -> dict[str, Any]:
        return {"num_layers": len(self.layer_ids)}


class LayerSkipDecoder(SelfDraftDecoder):
    """Every layer but `skipped_layers`, then the shared norm and lm_head."""

    name: ClassVar[str] = "layer_skip"

    def __init__(self, model: Transformer, skipped_layers: Sequence[int]) -> None:
        skipped = set(skipped_layers)
        if not skipped <= set(range(len(model.layers))):
            raise ValueError(
                f"skipped_layers {sorted(skipped)} are not all layers of a {len(model.layers)}-layer model"
            )
        super().__init__(model, [i for i in range(len(model.layers)) if i not in skipped])


def self_draft_registry(config: SelfDraftConfig) -> DecoderRegistry:
    """The model-based strategies; each decoder is created per request with `create(name, model=...)`,
    and the configured layers are resolved against that model."""
    registry = DecoderRegistry()
    registry.register(EarlyExitDecoder.name, functools.partial(_make_early_exit, config))
    registry.register(LayerSkipDecoder.name, functools.partial(_make_layer_skip, config))
    return registry


def _make_early_exit(config: SelfDraftConfig, *, model: Transformer) -> EarlyExitDecoder:
    num_layers = len(model.layers)
    num_exit = config.early_exit_layers or max(1, round(EARLY_EXIT_FRACTION * num_layers))
    if num_exit > num_layers:
        raise ValueError(f"early_exit_layers {num_exit} exceeds the model's {num_layers} layers")
    return EarlyExitDecoder(model, num_exit)


def _make_layer_skip(config: SelfDraftConfig, *, model: Transformer) -> LayerSkipDecoder:
    return LayerSkipDecoder(model, config.skipped_layers or default_skipped_layers(len(model.layers)))
