"""EAGLE-2 drafting over the primary's features (Li et al. 2024, "EAGLE-2: Faster Inference of
Language Models with Dynamic Draft Trees"), with the feature drafter of draft_svc/heads/model.py.

Per request the decoder keeps the committed token ids, its OWN draft-side KV (the keys/values of
the drafter inputs u of the committed tokens, the newest `max_window` of them) and f^, the feature
it predicts after the last committed token. The pool hands it the primary's features after each
step (`observe_features`); f^ is current only once the last committed token is paired with its
feature, and `propose` returns () until then.

    observe_features(p, F)   row i of F predicts the token at position p + i:
                             u = fc([F_i ; embed(x_{p+i})]) at position p + i joins the KV window;
                             the last row's layer output gives f^ (the depth-1 logits)
    propose(depth, n)        the dynamic tree, one batched drafter call per depth:
      depth 1                top_k tokens of softmax(logits(f^)), cumulative prob = their prob
      depth t + 1            the `beam` nodes of depth t with the highest cumulative prob (product
                             of probs along the path) run together: u = fc([f^_parent ; embed(node)])
                             at position len(context) + t - 1, each row attending to the committed
                             KV window and its own ancestors' rows (tree attention); top_k children
                             each
      rerank                 keep the `budget` nodes of highest cumulative prob (a closed tree: a
                             child's never exceeds its parent's; ties go to the shallower node) and
                             return its root-to-leaf paths, best leaf first

    # E.g. top_k 2, beam 1, depth 2, budget 3: depth 1 {a: .6, b: .3}; a expands to {c: .5, d: .4}:
    #   cumulative a .6, b .3, ac .3, ad .24 -> keep a, b, ac (b before ac: shallower)
    #   -> candidates (a c) rank 0, (b) rank 1

Draft rows live in scratch rows of the KV buffer past the committed ones: a propose leaves the
committed state unchanged. The buffer is allocated once per request (window + slack + scratch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import structlog
import torch
from torch import Tensor

from draft_svc.heads.file import DrafterFile, DrafterFileError, load
from draft_svc.heads.model import PRIMARY_FIELDS, FeatureDrafter, SharedParts, for_serving, shared_parts
from specdec.model.fingerprint import model_fingerprint
from draft_svc.strategies.base import Candidate, validate_propose_args
from specdec.field_checks import require_at_least_one
from specdec.speculation_bounds import MAX_DRAFT_LENGTH
from specdec.model import native

COMPACT_SLACK = 128  # committed rows appended past the window before the window moves back to row 0
# Feeds of at most this many rows run the whole layer natively on every row (only the last row's output
# is read); a longer one (the prefill's) computes its keys and values alone and finishes its last row
NATIVE_OBSERVE_ROWS = 8
NO_POSITION = -1  # next_position before the first features


@dataclasses.dataclass(frozen=True, slots=True)
class FeatureTreeConfig:
    top_k: int = 4  # children of each expanded node
    beam: int = 4  # nodes expanded per depth
    max_depth: int = MAX_DRAFT_LENGTH  # sizes the scratch rows

    def __post_init__(self) -> None:
        require_at_least_one(self, "top_k", "beam", "max_depth")


class FeatureDecoder:
    """EAGLE-2 dynamic draft trees from one request's features; kind MODEL (reads the primary's
    embedding, final norm and head rows through `shared`)."""

    name: ClassVar[str] = "feature"
    takes_max_nodes: ClassVar[bool] = True  # the pool passes its node budget to propose()

    def __init__(self, drafter: FeatureDrafter, shared: SharedParts, config: FeatureTreeConfig | None = None) -> None:
        self.config = config or FeatureTreeConfig()
        self._drafter, self._shared = drafter, shared
        c = drafter.config
        self._window = c.max_window
        self._max_scratch = self.config.beam * (self.config.max_depth - 1)
        self._kv_shape = (c.num_key_value_heads, c.head_dim)
        self._k: Tensor | None = None  # [Hkv, capacity, D] rotated keys: committed rows, then draft scratch
        self._v: Tensor | None = None
        self._mask: Tensor | None = None  # [max_scratch, window + max_scratch] tree-attention rows
        self._num_kv = 0  # committed rows in the buffer; the newest min(_num_kv, window) are attended
        self._token_ids: list[int] = []
        self._next_position = NO_POSITION  # the position the next feature row predicts
        self._next_features: Tensor | None = None  # [C] f^ after the token at _next_position - 1

    # --- committed state -------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_kv_bytes(self) -> int:
        return 0 if self._k is None or self._v is None else 2 * self._k.numel() * self._k.element_size()

    @property
    def is_current(self) -> bool:
        """Whether f^ follows the last committed token (else propose() has nothing)."""
        return self._next_features is not None and self._next_position == len(self._token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        self._token_ids.extend(int(t) for t in token_ids)

    def release(self) -> None:
        self._k = self._v = self._mask = None
        self._num_kv = 0
        self._next_features = None
        self._next_position = NO_POSITION

    @torch.inference_mode()
    def observe_features(self, position: int, features: np.ndarray | Tensor) -> None:
        """The primary's features: row i predicts the token at absolute position `position + i`.
        A gap (rows past the next expected one) restarts the KV window from these rows; rows already
        seen are skipped; rows of tokens not committed yet are dropped."""
        rows = torch.as_tensor(features, dtype=torch.float32)
        c = self._drafter.config
        if rows.ndim != 2 or rows.shape[1] != c.hidden_size:
            raise ValueError(f"features must be [n, {c.hidden_size}], got {list(rows.shape)}")
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if self._next_position == NO_POSITION or position > self._next_position:
            self._num_kv, self._next_features = 0, None  # a gap: the old window no longer leads here
            self._next_position = position
        first, end = self._next_position, min(position + rows.shape[0], len(self._token_ids))
        if end <= first:
            return
        if end - first >= self._window:  # only the newest `window` rows can be attended again
            first, self._num_kv = end - self._window, 0
        rows = rows[first - position : end - position]
        token_ids = torch.tensor(self._token_ids[first:end], dtype=torch.int64)
        u = self._drafter.inputs(rows, self._shared.embed(token_ids).float())  # [n, C]
        n, layer = end - first, self._drafter.native_layer
        k_buf, v_buf = self._reserve(n)
        start = max(0, self._num_kv + n - self._window)  # the last row sees the newest `window` rows
        if layer is not None and n <= NATIVE_OBSERVE_ROWS:
            # no mask: only the last row's output is read, and it sees every row (keys and values are
            # the rows' own, whatever their rows attend)
            h = layer(u, torch.arange(first, end), k_buf[:, start:], v_buf[:, start:], self._num_kv - start, None)
            self._num_kv += n
            h = h[-1:]
        else:
            q, k, v = self._drafter.keys_values(u, torch.arange(first, end))
            k_buf[:, self._num_kv : self._num_kv + n] = k.transpose(0, 1)
            v_buf[:, self._num_kv : self._num_kv + n] = v.transpose(0, 1)
            self._num_kv += n
            keys, values = self._kv(start, self._num_kv)
            # [1, C]: only the last row's f^ is read, and that row sees the whole window (no mask)
            h = self._drafter.finish(u[-1:], q[-1:], keys, values, None)
        self._next_features = self._shared.features(h)[0]
        self._next_position = end

    def _reserve(self, n: int) -> tuple[Tensor, Tensor]:
        """Room for n more committed rows at _num_kv, moving the window back to row 0 when the slack is
        used; returns the key and value buffers, [Hkv, capacity, D] (the native kernels' cache layout)."""
        if self._k is None or self._v is None:
            capacity = self._window + COMPACT_SLACK + self._max_scratch
            hkv, d = self._kv_shape
            self._k = torch.empty(hkv, capacity, d)
            self._v = torch.empty(hkv, capacity, d)
            self._mask = torch.zeros(self._max_scratch, self._window + self._max_scratch, dtype=torch.bool)
        if self._num_kv + n > self._window + COMPACT_SLACK:
            keep = max(0, min(self._num_kv, self._window - n))
            # clone: source and destination overlap when the window is longer than the slack
            self._k[:, :keep] = self._k[:, self._num_kv - keep : self._num_kv].clone()
            self._v[:, :keep] = self._v[:, self._num_kv - keep : self._num_kv].clone()
            self._num_kv = keep
        return self._k, self._v

    def _kv(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Rows [start, end) of the buffer as [S, Hkv, D] views."""
        assert self._k is not None and self._v is not None
        return self._k[:, start:end].transpose(0, 1), self._v[:, start:end].transpose(0, 1)

    # --- drafting --------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, max_tokens: int, max_candidates: int = 1, *, max_nodes: int = 0) -> tuple[Candidate, ...]:
        """The dynamic tree's root-to-leaf paths, best leaf first; `max_nodes` (0: none) bounds the
        tree's nodes beside max_candidates * max_tokens."""
        validate_propose_args(max_tokens, max_candidates)
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        max_tokens = min(max_tokens, self.config.max_depth)
        if max_tokens == 0 or not self.is_current:
            return ()
        budget = max_candidates * max_tokens if not max_nodes else min(max_candidates * max_tokens, max_nodes)
        head_ids, parents, cum_probs = self._grow(max_tokens)
        return self._paths(head_ids, parents, cum_probs, budget, max_candidates)

    def _grow(self, max_tokens: int) -> tuple[list[int], list[int], Tensor]:
        """Every node the beam search reached, in depth order: (head row, parent node or -1, cumulative
        prob [M])."""
        assert self._next_features is not None and self._mask is not None
        top_k, beam = self.config.top_k, self.config.beam
        probs = torch.softmax(self._shared.logits(self._next_features), dim=-1)  # [N]
        cum, head = probs.topk(min(top_k, probs.shape[-1]))  # depth 1
        level_parent = torch.full_like(head, -1)
        level_scratch = torch.full_like(head, -1)  # scratch row of each node's parent (-1: the root)
        level_features = self._next_features.expand(head.shape[0], -1)  # [n, C] f^ each node pairs with
        all_head, all_parent, all_cum = [head], [level_parent], [cum]
        level_base = 0  # node index of the level's first node
        window = min(self._num_kv, self._window)
        self._mask[:, :window] = True
        self._mask[:, window:] = False
        num_scratch = 0
        for depth in range(1, max_tokens):
            sel = cum.topk(min(beam, cum.shape[0])).indices  # [b] best nodes of this depth
            b = sel.shape[0]
            features, probs = self._step(
                level_features[sel],
                self._shared.vocab[head[sel]],
                len(self._token_ids) + depth - 1,
                level_scratch[sel],
                num_scratch,
                window,
            )
            child_probs, child_head = probs.topk(min(top_k, probs.shape[-1]), dim=-1)  # [b, k]
            k = child_head.shape[1]
            level_parent = (level_base + sel).repeat_interleave(k)
            level_base += cum.shape[0]
            cum = (cum[sel, None] * child_probs).flatten()  # a child's cumulative prob <= its parent's
            head = child_head.flatten()
            level_scratch = torch.arange(num_scratch, num_scratch + b).repeat_interleave(k)
            level_features = features.repeat_interleave(k, dim=0)
            num_scratch += b
            all_head.append(head)
            all_parent.append(level_parent)
            all_cum.append(cum)
        return torch.cat(all_head).tolist(), torch.cat(all_parent).tolist(), torch.cat(all_cum)

    def _step(
        self, features: Tensor, token_ids: Tensor, position: int, parent_rows: Tensor, first_row: int, window: int
    ) -> tuple[Tensor, Tensor]:
        """One batched drafter call for b tree nodes: their inputs (f^ of the parent's prediction, the
        node's token) at `position`, written to scratch rows first_row.. of the buffer; each row attends
        to the committed window and its ancestors' rows. -> (f^ [b, C], probs [b, N])."""
        assert self._mask is not None and self._k is not None and self._v is not None
        b = features.shape[0]
        u = self._drafter.inputs(features, self._shared.embed(token_ids).float())  # [b, C]
        positions = torch.full((b,), position, dtype=torch.int64)
        # E.g. rows 0,1 expanded at depth 1, row 2 a child of row 1: mask row 2 = row 1's scratch bits + itself
        rows = self._mask[first_row : first_row + b]
        if first_row:
            is_child = parent_rows >= 0
            rows[:, window : window + first_row] = self._mask[parent_rows.clamp(min=0), window : window + first_row]
            rows[~is_child, window : window + first_row] = False
        own = torch.arange(b)
        rows[own, window + first_row + own] = True
        mask = rows[:, : window + first_row + b]
        start = self._num_kv - window  # the attended window, then the scratch rows of this propose
        layer = self._drafter.native_layer
        if layer is not None:  # writes the rows' keys and values to scratch rows window + first_row..
            h = layer(u, positions, self._k[:, start:], self._v[:, start:], window + first_row, mask)
        else:
            q, k, v = self._drafter.keys_values(u, positions)
            keys, values = self._kv(start, self._num_kv + first_row + b)
            keys[window + first_row :] = k  # scratch rows: views of the buffer past the committed ones
            values[window + first_row :] = v
            h = self._drafter.finish(u, q, keys, values, mask)
        features = self._shared.features(h)
        return features, torch.softmax(self._shared.logits(features), dim=-1)

    def _paths(
        self, head_ids: list[int], parents: list[int], cum_probs: Tensor, budget: int, max_candidates: int
    ) -> tuple[Candidate, ...]:
        """The budget nodes of highest cumulative prob (stable sort: nodes come in depth order, so ties
        keep the shallower, and a parent always precedes its child); their leaves' paths best first."""
        order = torch.sort(cum_probs, descending=True, stable=True).indices[:budget].tolist()
        kept = set(order)
        has_child = {parents[i] for i in order}
        vocab = self._shared.vocab_ids
        candidates: list[Candidate] = []
        for leaf in order:
            if leaf in has_child:
                continue
            path = []
            node = leaf
            while node >= 0:
                assert node in kept  # the kept set is a closed tree
                path.append(vocab[head_ids[node]])
                node = parents[node]
            candidates.append(Candidate(self.name, tuple(reversed(path)), rank=len(candidates)))
            if len(candidates) == max_candidates:
                break
        return tuple(candidates)

    @torch.inference_mode()
    def features_along(self, token_ids: Sequence[int]) -> Tensor:
        """f^ [len + 1, C] after the committed context and then after each of the draft `token_ids`
        (one chain: the tree's code with a beam of one); for tests against `unrolled`."""
        assert self._next_features is not None and self._mask is not None
        window = min(self._num_kv, self._window)
        self._mask[:, :window] = True
        self._mask[:, window:] = False
        out = [self._next_features[None]]
        for depth, token_id in enumerate(token_ids):
            features, _ = self._step(
                out[-1],
                torch.tensor([token_id]),
                len(self._token_ids) + depth,
                torch.tensor([depth - 1]),
                depth,
                window,
            )
            out.append(features)
        return torch.cat(out)


class FeatureDrafterSource:
    """The drafter file, read once, and the drafter's parts for the attached model: bound when the
    primary's weights attach, refused (logged, the pool serves without the strategy) when the file
    was trained for another model."""

    def __init__(self, path: Path, tree: FeatureTreeConfig | None = None, is_native: bool = True) -> None:
        self.path = Path(path)
        self.tree = tree or FeatureTreeConfig()
        self.is_native = is_native  # int8 products by the native kernels where the CPU has them
        self._log = structlog.get_logger("draft_svc.feature")
        self._file: DrafterFile | None = None
        self._file_error: str | None = None
        try:
            self._file = load(self.path)
        except DrafterFileError as e:
            self._file_error = str(e)
        self._model: Any = None  # the model `_parts` / `_model_error` belong to
        self._parts: tuple[FeatureDrafter, SharedParts] | None = None
        self._model_error: str | None = None

    @property
    def is_loaded(self) -> bool:
        return self._file is not None

    def refusal(self) -> str | None:
        """Why the strategy cannot serve now (no file, or one for another model); None when it can
        (or no model is attached yet: then it has nothing to propose, like any model strategy)."""
        return self._file_error or self._model_error

    def refusal_of(self, name: str) -> str | None:
        """The pool's `refusal` callback: only the feature strategy depends on this file."""
        return self.refusal() if name == FeatureDecoder.name else None

    def bind(self, model: Any) -> tuple[FeatureDrafter, SharedParts] | None:
        """The drafter and shared parts for `model` (built once per model), or None when refused."""
        if model is self._model:
            return self._parts
        self._model, self._parts, self._model_error = model, None, None
        if self._file is None:
            return None
        expected = model_fingerprint(model.config, model.norm.weight)
        if self._file.model_fingerprint != expected:
            self._model_error = (
                f"drafter file {self.path} was trained for model {self._file.model_fingerprint}, "
                f"but the primary serves model {expected}"
            )
            self._log.warning("feature_drafter_refused", path=str(self.path), reason=self._model_error)
            return None
        # The fingerprint binds the file's name for the model, not its config: a config of another
        # shape (its vocabulary ids past the model's, its width not the model's) would fail in the
        # embedding lookup below and take the attach of the weights down with it
        if differing := [
            f"{name} {getattr(self._file.config, name)} (the model's {getattr(model.config, name)})"
            for name in PRIMARY_FIELDS
            if getattr(self._file.config, name) != getattr(model.config, name)
        ]:
            self._model_error = f"drafter file {self.path} does not fit the model: its {', '.join(differing)}"
            self._log.warning("feature_drafter_refused", path=str(self.path), reason=self._model_error)
            return None
        drafter = self._file.drafter()
        # Rotary tables for every position now: requests share the drafter, and a table grown while
        # another thread reads it could hand that thread a mismatched pair
        drafter.rotary.tables(torch.tensor([max(1, getattr(model, "max_positions", 1)) - 1]))
        shared = shared_parts(model, self._file.vocab, drafter.config.rms_norm_eps)
        lib = native.library() if self.is_native and shared.head.device.type == "cpu" else None
        self._parts = for_serving(drafter, shared, lib)
        self._log.info("feature_drafter_bound", path=str(self.path), draft_vocab_size=drafter.config.draft_vocab_size)
        return self._parts

    def create(self, *, model: Any) -> FeatureDecoder:
        parts = self.bind(model)
        if parts is None:
            raise DrafterFileError(self.refusal() or f"drafter file {self.path} is not loaded")
        return FeatureDecoder(*parts, self.tree)
