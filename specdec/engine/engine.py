"""The primary engine: every request's KV cache, prefill, one-pass tree verify, commit, release.

Per request it keeps the committed token ids and a KV slot whose first `num_cached` rows
hold their keys/values. The invariant between steps is that the last committed token is
*pending*: committed but not yet run through the model. A verify pass runs the uncached
committed tokens (the "chain", usually just the pending token; the whole prompt on the
first step or after a re-prefill; the tokens a grammar forced behind the last bonus token,
committed without a verify of their own) plus a draft token tree, in ONE forward, and returns
logits for the pending token (the tree's root) and for every node:

    logits[0]     next-token logits after the committed context   (decides depth-1 nodes)
    logits[1 + i] next-token logits after draft node i            (decides node i's children)

`commit` then keeps the KV rows of the chain and of the accepted path and appends the new
committed tokens (the accepted drafts and one bonus token), which rolls back everything
else. Until then nothing is committed, so repeating a verify (a retried RPC) is harmless.
Plain autoregressive decoding is the special case of an empty tree.

Lookahead rows (Fu et al. 2024) ride along: a work item's last `num_lookahead` nodes form a second
tree off the same root, whose rows see the context, the root and their own ancestors only. The
draft rows never see them, so their logits are those of a verify without them; the lookahead rows'
logits follow the draft rows', they can never be accepted (`commit` takes paths of the draft tree
only) and their KV rows are dropped with the rest of the step's rejected rows.

Batch invariance: where the model's kernels give a row the same bits whatever the row count (the
packed int4/int8 layers, `Transformer.is_batch_invariant`), the engine also runs attention row by
row in verify (`SequenceSpan.row_paths`), so a k-row verify returns exactly the logits k 1-row
decodes would, and greedy speculation equals greedy decoding token for token. Batched masked
attention (SDPA) rounds differently from a 1-row call (~3e-7 in fp32), which the quantized
activations of the packed kernels amplify into argmax flips at near-ties. The native kernels'
attention (`specdec.model.native`) is row-exact under a mask already, so there the whole tree
runs as one masked call.

Prefix caching (specdec.engine.prefix_cache): with a `PrefixCache`, `open` and `readmit` copy the
rows of the longest cached prefix of the prompt into the slot and prefill only the rest, and every
prefill chunk offers the prompt rows computed so far to the cache. Reuse must not change a bit, so
only rows that a prefill of the new prompt would compute identically are shared, and only within a
tenant (the prefix of the request id, specdec.request_id.tenant_of: a hit is visible to its client):

- only prompt rows of the batched prefill (positions below num_prompt_tokens - 1), never rows of
  generated tokens (decoded row by row) nor uncommitted tree rows; the pending token always runs in
  the verify, so a prompt identical to a cached one still prefills nothing and verifies its last token;
- where a prefill chunk may be cut anywhere (batch-invariant linears and row-exact attention, the
  native int4/int8 kernels: `is_cut_anywhere`), a row's bits depend on its tokens and position only,
  so any number of rows is reused, token for token (a finished prompt prefill also stores its last,
  partial block: an identical prompt then prefills nothing, one diverging at token 100 reuses 100
  rows);
- elsewhere (fp32/bf16 GEMMs round by row count; SDPA by query count) a row's bits also depend on
  the chunk it ran in, so rows are shared and reused only up to a multiple of `prefill_chunk_tokens`
  (the prefill grid every prefill cuts at, see primary_svc.scheduler): a prompt continuing from
  k * prefill_chunk_tokens cached rows runs the very chunks an uninterrupted prefill runs after them.
  Disabling the cache there would lose it on every float deployment; the grid keeps it exact.

The cache holds copies under its own byte budget: the per-request KV accounting (`kv_bytes`,
`max_bytes`) never sees it, and releasing a request never invalidates it.

The engine is not thread-safe: the primary service serialises (and batches) calls.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Sequence

import torch

from specdec.context_room import check_fits, output_room
from specdec.engine import tree as tree_geometry
from specdec.speculation_bounds import MAX_LOOKAHEAD_NODES, MAX_TREE_NODES
from specdec.engine.kv_cache import KVBudgetExceeded, KVCache, KVSlot
from specdec.engine.prefix_cache import PrefixCache
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.logits_codec import row_argmax
from specdec.logprobs import TokenLogprob, token_logprobs
from specdec.model.llama import SequenceSpan, Transformer
from specdec.penalties import penalize
from specdec.request_id import tenant_of
from specdec.sampling import SamplingParams, draw_token

PREFILL_CHUNK_TOKENS = 512  # bounds the [chunk, context] attention mask of long prompts


@dataclasses.dataclass(slots=True)
class _Request:
    token_ids: list[int]
    kv: KVSlot | None  # None: evicted (preempted); re-prefills from token_ids
    num_prompt_tokens: int = 0  # > 0: tokens after the prompt re-prefill row by row (`prefill`)
    # chain rows written by the last verify, after num_cached; 0 once its rows are not in the slot
    # (evicted, or overwritten by a verify that failed): a commit then keeps no row, the tokens re-run
    tree_chain: int = 0
    tree_parents: tuple[int, ...] = ()  # the tree of the last verify, whose rows follow the chain
    tree_token_ids: tuple[int, ...] = ()
    num_reused: int = 0  # prompt tokens whose KV rows came from the prefix cache at the last (re)admission
    scope: str = ""  # the request's tenant: the prefix cache shares rows only within it

    @property
    def slot(self) -> KVSlot:
        """The KV slot of a resident request: callers reach it after checking it is not evicted."""
        assert self.kv is not None, "the request is evicted"
        return self.kv


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyWork:
    request_id: str
    token_ids: Sequence[int]  # draft tree tokens, then lookahead tokens [N + L]
    parents: Sequence[int]  # [N + L], -1 = child of the root; a lookahead node's parent is -1 or a lookahead node
    num_lookahead: int = 0  # L: the last L nodes are lookahead rows, run but never accepted

    @property
    def num_draft(self) -> int:
        return len(self.token_ids) - self.num_lookahead


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillChunk:
    request_id: str
    num_tokens: int  # at most this many; `step` runs up to the next row-by-row boundary


@dataclasses.dataclass(slots=True)
class _StepRows:
    """The rows of one forward as a step gathers them: token ids, positions, each request's attention
    span, and the rows whose logits come back. Indices stay Python ints until the forward, which
    makes one tensor of each: a few small tensors per request cost more than the ints (32 requests:
    ~130 tensor ops a step)."""

    input_ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    spans: list[SequenceSpan] = dataclasses.field(default_factory=list)
    logits_rows: list[int] = dataclasses.field(default_factory=list)
    num_rows: int = 0


class Engine:
    def __init__(
        self,
        model: Transformer,
        kv_cache: KVCache,
        max_context: int,
        prefix_cache: PrefixCache | None = None,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
    ) -> None:
        window = model.config.sliding_window
        if window is not None and max_context > window:
            raise ValueError(
                f"this model uses sliding-window attention ({window} tokens), which the engine does "
                f"not implement: serve it with max_context <= {window}"
            )
        if max_context > model.max_positions:
            raise ValueError(f"max_context {max_context} exceeds the model's {model.max_positions} positions")
        self.model, self.kv_cache, self.max_context = model, kv_cache, max_context
        self.vocab_size = model.config.vocab_size
        # see "Batch invariance" above
        self.is_row_by_row = model.is_batch_invariant and not model.is_attention_row_exact
        self._requests: dict[str, _Request] = {}
        self.prefix_cache, self.prefill_chunk_tokens = prefix_cache, prefill_chunk_tokens
        # see "Prefix caching" above: the multiple of tokens at which cached rows may be reused
        self.is_cut_anywhere = model.is_batch_invariant and model.is_attention_row_exact
        self.prefix_grid_tokens = 1 if self.is_cut_anywhere else prefill_chunk_tokens

    # --- bookkeeping -------------------------------------------------------------------

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    @property
    def kv_bytes(self) -> int:
        return self.kv_cache.num_bytes

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def token_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).token_ids)

    def output_token_ids(self, request_id: str) -> list[int]:
        """The request's committed tokens after its prompt: its output so far, the pending token last."""
        req = self._get(request_id)
        return req.token_ids[req.num_prompt_tokens :]

    def num_tokens(self, request_id: str) -> int:
        """The request's committed tokens, its prompt included."""
        return len(self._get(request_id).token_ids)

    def num_cached(self, request_id: str) -> int:
        kv = self._get(request_id).kv
        return 0 if kv is None else kv.num_cached

    def num_reused_tokens(self, request_id: str) -> int:
        """Prompt tokens whose KV rows came from the prefix cache when the request last got its slot."""
        return self._get(request_id).num_reused

    def resident_request_ids(self) -> list[str]:
        """The requests that hold a KV slot (not evicted)."""
        return [r for r, req in self._requests.items() if req.kv is not None]

    def is_evicted(self, request_id: str) -> bool:
        return self._get(request_id).kv is None

    def reusable_prompt_rows(self, request_id: str, prompt: Sequence[int], other: Sequence[int] | None = None) -> int:
        """Rows of a new request's prompt prefill that its slot would take from the prefix cache: as
        the cache holds it now, or (other given) once the prompt `other` (same scope) has been
        prefilled and shared. Whole blocks on the reuse grid, as `_reuse_prefix` copies them."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        num_rows = len(prompt) - 1
        if other is None:
            num_shared = cache.match(prompt[:num_rows], tenant_of(request_id))[1]
        else:  # `other`'s prompt rows are all cached once it is prefilled (whole blocks and its tail)
            num_shared = 0
            limit = min(num_rows, len(other) - 1)
            while num_shared < limit and prompt[num_shared] == other[num_shared]:
                num_shared += 1
        return num_shared // self.prefix_grid_tokens * self.prefix_grid_tokens

    def num_to_prefill(self, request_id: str) -> int:
        """Committed tokens not yet in the cache, the pending one excepted."""
        return len(self._get(request_id).token_ids) - 1 - self.num_cached(request_id)

    def kv_bytes_of(self, request_id: str) -> int:
        kv = self._get(request_id).kv
        return 0 if kv is None else kv.num_bytes

    def kv_bytes_to_open(self, num_tokens: int) -> int:
        """The bytes a slot for num_tokens committed tokens takes (what `open`/`readmit` allocate)."""
        return self.kv_cache.bytes_for_rows(num_tokens + 1)

    def kv_growth_bytes(self, w: VerifyWork) -> int:
        """The bytes the request's slot grows by to run this verify."""
        req = self._get(w.request_id)
        if req.kv is None:
            return 0
        return self.kv_cache.growth_bytes(req.kv, len(req.token_ids) + len(w.token_ids))

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise NotFound("request_id", f"no active request {request_id!r} on this primary") from None

    def check_token_ids(self, field: str, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise InvalidArgument(field, f"token id {t} is outside the vocabulary [0, {self.vocab_size})")

    # --- lifecycle -----------------------------------------------------------------------

    def open(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> None:
        """Register a request with its committed tokens (prompt, or prompt + output on recovery:
        `num_prompt_tokens` says where the prompt ends; 0: all of them)."""
        self.check_open(request_id, token_ids)
        try:
            slot = self.kv_cache.allocate(len(token_ids) + 1)
        except KVBudgetExceeded as e:
            raise ResourceExhausted("kv_cache", str(e)) from None
        # A fresh request's tokens are all prompt; the mark lets a preempted request re-prefill the
        # tokens it generated row by row (`prefill`), as the steps that decoded them ran.
        req = _Request(list(token_ids), slot, num_prompt_tokens or len(token_ids), scope=tenant_of(request_id))
        self._requests[request_id] = req
        self._reuse_prefix(req)

    def check_open(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Raise the error `open` would raise for these arguments, other than a full KV cache."""
        if not request_id:
            raise InvalidArgument("request_id", "must not be empty")
        if request_id in self._requests:
            raise InvalidArgument("request_id", f"request {request_id!r} is already open")
        if not token_ids:
            raise InvalidArgument("token_ids", "a request needs at least one token")
        check_fits(len(token_ids), self.max_context, "token_ids")
        self.check_token_ids("token_ids", token_ids)

    def release(self, request_id: str) -> int:
        """Forget the request and free its KV slot; returns the bytes freed."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise NotFound("request_id", f"no active request {request_id!r} on this primary")
        return 0 if req.kv is None else self.kv_cache.release(req.kv)

    def evict(self, request_id: str) -> int:
        """Preemption: free the request's KV slot but keep its committed tokens (and its last tree, so
        the next commit is still checked); `readmit` and a prefill bring it back. Returns the bytes freed."""
        req = self._get(request_id)
        if req.kv is None:
            return 0
        freed = self.kv_cache.release(req.kv)
        req.kv = None
        req.tree_chain = 0  # the tree's rows went with the slot (a commit before `readmit` finds none either)
        return freed

    def readmit(self, request_id: str, num_extra_rows: int = 0) -> None:
        """A new KV slot for an evicted request, to re-prefill from its committed tokens, with room
        for `num_extra_rows` more (the tree of the verify it waits to run)."""
        req = self._get(request_id)
        if req.kv is not None:
            return
        try:
            req.kv = self.kv_cache.allocate(len(req.token_ids) + 1 + num_extra_rows)
        except KVBudgetExceeded as e:
            raise ResourceExhausted("kv_cache", str(e)) from None
        self._reuse_prefix(req)

    def prefill(
        self, request_id: str, chunk_tokens: int | None = None, features_out: list[torch.Tensor] | None = None
    ) -> int:
        """Run every committed token but the pending one into the cache; returns num_cached.

        The prompt runs in chunks of `chunk_tokens` (default `prefill_chunk_tokens`). With row-by-row
        verify (`is_row_by_row`), the tokens after the prompt (`open`'s `num_prompt_tokens`: a
        recovered request's generated tokens) run row by row, each exactly as the step that decoded
        it did, so the cache and every later step are bit for bit those of the uninterrupted request.
        The scheduler (primary_svc.worker) runs the same chunks one `step` at a time, interleaved
        with other requests' work. `features_out`, when given, receives the features [1, C] of the last
        prefilled row (step's `prefill_features_out`), when this call computed that row.
        """
        req = self._get(request_id)
        chunk_tokens = chunk_tokens or self.prefill_chunk_tokens
        if self.prefix_cache is not None and not self.is_cut_anywhere and chunk_tokens != self.prefill_chunk_tokens:
            raise ValueError(f"with a prefix cache this engine's prefills cut every {self.prefill_chunk_tokens} tokens")
        last: dict[str, torch.Tensor] | None = {} if features_out is not None else None
        while self.num_to_prefill(request_id) > 0:
            self.step([], [PrefillChunk(request_id, chunk_tokens)], prefill_features_out=last)
        if features_out is not None and last:
            features_out.append(last[request_id])
        return req.slot.num_cached

    def _chunk_end(self, req: _Request, max_tokens: int) -> tuple[int, int, bool]:
        """(start, end, row by row) of the request's next prefill chunk of at most max_tokens."""
        last = len(req.token_ids) - 1  # the pending token stays out
        n = req.num_prompt_tokens
        batched_end = min(last, n - 1) if self.is_row_by_row and n else last
        start = req.slot.num_cached
        is_row_by_row = start >= batched_end
        return start, min(start + max_tokens, last if is_row_by_row else batched_end), is_row_by_row

    def _prompt_rows(self, req: _Request) -> int:
        """Rows of the batched prompt prefill: every prompt token's but the last one's."""
        return min(len(req.token_ids), req.num_prompt_tokens) - 1

    def _reuse_prefix(self, req: _Request) -> None:
        """A fresh slot starts with the rows of the prompt's longest cached prefix (see "Prefix caching")."""
        if self.prefix_cache is None:
            return
        num_rows, grid = self._prompt_rows(req), self.prefix_grid_tokens
        blocks, num_matched = self.prefix_cache.match(req.token_ids[:num_rows], req.scope)
        num_reused = num_matched // grid * grid
        self.prefix_cache.copy_prefix(blocks, num_reused, req.slot.k, req.slot.v)
        req.slot.num_cached = req.num_reused = num_reused
        self.prefix_cache.record_query(num_rows, num_reused)

    def _share_prefix(self, req: _Request) -> None:
        """Offer the prompt rows computed so far to the prefix cache (whole blocks, on the grid; the
        last, partial block too once the prompt is done, where rows are reused at any count)."""
        if self.prefix_cache is None:
            return
        grid, num_prompt_rows = self.prefix_grid_tokens, self._prompt_rows(req)
        num_rows = min(req.slot.num_cached, num_prompt_rows) // grid * grid
        is_done = grid == 1 and num_rows == num_prompt_rows
        self.prefix_cache.insert(req.token_ids[:num_rows], req.slot.k, req.slot.v, req.scope, with_tail=is_done)

    def _reserve(self, req: _Request, num_rows: int) -> None:
        try:
            self.kv_cache.reserve(req.slot, num_rows)
        except KVBudgetExceeded as e:
            raise ResourceExhausted("kv_cache", str(e)) from None

    # --- verify / commit -------------------------------------------------------------------

    def verify(
        self, request_id: str, token_ids: Sequence[int], parents: Sequence[int], num_lookahead: int = 0
    ) -> torch.Tensor:
        """One forward over the uncached chain + the tree; logits [N+L+1, V] fp32 (see module doc)."""
        return self.verify_batch([VerifyWork(request_id, token_ids, parents, num_lookahead)])[0]

    def verify_batch(self, works: Sequence[VerifyWork]) -> list[torch.Tensor]:
        """Verify several requests' trees in one forward (linear layers run once over all rows)."""
        return self.step(works, [])

    def step(
        self,
        works: Sequence[VerifyWork],
        chunks: Sequence[PrefillChunk],
        features_out: list[torch.Tensor] | None = None,
        prefill_features_out: dict[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """One forward over several requests' verify rows and prefill chunks; the verifies' logits.

        A prefill chunk's rows are computed as `prefill` computes them, so mixing them into a forward
        with other rows changes no bit where the model is batch invariant (`model.is_batch_invariant`);
        elsewhere the scheduler runs each chunk in a forward of its own.

        `features_out`, when given, receives per verify (in `works` order) the features of its logits
        rows [N+L+1, C] (`Transformer.forward`'s features_out: the final norm's output).
        `prefill_features_out`, when given, receives for each chunk that ends its request's prefill the
        features [1, C] of its last row (position num_cached - 1, whose next token is the pending
        one), keyed by request id: that row joins the forward's logits rows (its logits are dropped;
        a row's bits do not depend on the other rows there, `Transformer.forward`).
        """
        self._check_step(works, chunks)
        rows = _StepRows()
        reqs = [self._add_verify_rows(rows, w) for w in works]
        prefilled, feature_chunks = [], []
        for chunk in chunks:
            req = self._requests[chunk.request_id]
            end = self._add_chunk_rows(rows, req, chunk.num_tokens)
            if end is None:
                continue
            prefilled.append((req, end))
            if prefill_features_out is not None and end == len(req.token_ids) - 1:
                feature_chunks.append(chunk.request_id)
                rows.logits_rows.append(rows.num_rows - 1)  # the chunk's last row
        if not rows.spans:
            return []
        features: list[torch.Tensor] | None = [] if features_out is not None or feature_chunks else None
        logits = self._forward(rows, features)  # [sum(N+1), V] fp32
        for req, end in prefilled:
            req.slot.num_cached = end
            req.tree_chain, req.tree_parents, req.tree_token_ids = 0, (), ()
            self._share_prefix(req)
        out, row = [], 0
        for req, c, w in reqs:
            # The rows stay uncommitted until `commit`, so a repeated verify (a retry) is harmless.
            req.tree_chain = c
            # only the draft tree's paths can be committed; the lookahead rows after it are dropped
            req.tree_parents, req.tree_token_ids = tuple(w.parents[: w.num_draft]), tuple(w.token_ids[: w.num_draft])
            out.append(logits[row : row + len(w.token_ids) + 1])
            if features_out is not None and features:
                features_out.append(features[0][row : row + len(w.token_ids) + 1].cpu())
            row += len(w.token_ids) + 1
        if prefill_features_out is not None and features:
            for i, request_id in enumerate(feature_chunks):  # their rows follow every verify's
                prefill_features_out[request_id] = features[0][row + i : row + i + 1].cpu()
        return out

    def _forward(self, rows: _StepRows, features: list[torch.Tensor] | None) -> torch.Tensor:
        """The model over a step's rows; the logits of its logits rows [R, V] fp32, on the CPU."""
        logits_rows = torch.tensor(rows.logits_rows, dtype=torch.int64)
        input_ids = torch.tensor(rows.input_ids, dtype=torch.int64)
        positions = torch.tensor(rows.positions, dtype=torch.int64)
        return self.model.forward(input_ids, positions, rows.spans, logits_rows, features_out=features).cpu()

    def _check_step(self, works: Sequence[VerifyWork], chunks: Sequence[PrefillChunk]) -> None:
        """Raise what a step of these items would raise, before any KV row is reserved."""
        ids = [w.request_id for w in works] + [c.request_id for c in chunks]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("request_id", "a request appears twice in one batch")
        for w in works:
            self.check_verify(w)
        for chunk in chunks:
            req = self._get(chunk.request_id)
            if req.kv is None:
                raise FailedPrecondition("request_id", f"request {chunk.request_id!r} holds no KV slot")

    def _add_verify_rows(self, rows: _StepRows, w: VerifyWork) -> tuple[_Request, int, VerifyWork]:
        """A verify's rows: the uncached chain (c tokens), then the tree; its logits rows are the
        chain's last and the tree's. Returns (request, c, w)."""
        req = self._requests[w.request_id]
        chain = req.token_ids[req.slot.num_cached :]
        n, c = len(w.token_ids), len(chain)
        # The last tree's rows are rewritten (or, growing the slot, dropped) from here on, even if the
        # step then fails: its path can still be committed, but no longer by keeping its rows.
        req.tree_chain = 0
        self._reserve(req, req.slot.num_cached + c + n)
        rows.input_ids.extend(chain)
        rows.input_ids.extend(w.token_ids)
        rows.positions.extend(tree_geometry.verify_position_ids(req.slot.num_cached, c, w.parents))
        mask = tree_geometry.verify_mask(req.slot.num_cached, c, w.parents)
        # the prompt's part of the chain attends together, as a prefill would; the output's part
        # (tokens committed behind the last bonus token without a verify: a grammar's forced
        # tokens), the root and the tree row by row, as the steps of plain decoding would run them
        first_row_by_row = min(c - 1, max(0, req.num_prompt_tokens - 1 - req.slot.num_cached))
        paths = tree_geometry.row_paths(c, w.parents)[first_row_by_row:] if self.is_row_by_row and c + n > 1 else None
        rows.spans.append(SequenceSpan(rows.num_rows, c + n, req.slot.num_cached, req.slot.k, req.slot.v, mask, paths))
        rows.logits_rows.extend(range(rows.num_rows + c - 1, rows.num_rows + c + n))
        rows.num_rows += c + n
        return req, c, w

    def _add_chunk_rows(self, rows: _StepRows, req: _Request, num_tokens: int) -> int | None:
        """A prefill chunk's rows, computed as `prefill` computes them; the end of the chunk, or None
        when nothing is left to prefill."""
        start, end, is_row_by_row = self._chunk_end(req, num_tokens)
        if end <= start:
            return None
        self._reserve(req, end)
        mask = tree_geometry.verify_mask(start, end - start, ())
        paths = tree_geometry.row_paths(end - start, ()) if is_row_by_row else None
        rows.spans.append(SequenceSpan(rows.num_rows, end - start, start, req.slot.k, req.slot.v, mask, paths))
        rows.input_ids.extend(req.token_ids[start:end])
        rows.positions.extend(range(start, end))
        rows.num_rows += end - start
        return end

    def check_verify(self, w: VerifyWork, is_evicted_ok: bool = False) -> None:
        """Raise the error `verify_batch` would raise for this work item, without running anything
        (`is_evicted_ok`: but for an evicted request, which can verify once re-prefilled)."""
        req = self._get(w.request_id)
        if req.kv is None and not is_evicted_ok:
            raise FailedPrecondition(
                "request_id", f"request {w.request_id!r} was preempted: it re-prefills before its next verify"
            )
        if req.kv is not None and req.kv.num_cached >= len(req.token_ids):
            raise FailedPrecondition(
                "request_id",
                f"request {w.request_id!r} has no pending token: "
                "commit the last step's bonus token before verifying again",
            )
        assert 0 <= w.num_lookahead <= len(w.token_ids), "num_lookahead counts the tree's last nodes"
        if w.num_draft > MAX_TREE_NODES:
            raise InvalidArgument("tree.token_ids", f"{w.num_draft} nodes exceed the limit of {MAX_TREE_NODES}")
        if w.num_lookahead > MAX_LOOKAHEAD_NODES:
            raise InvalidArgument(
                "lookahead.token_ids",
                f"{w.num_lookahead} nodes exceed the limit of {MAX_LOOKAHEAD_NODES}",
            )
        try:
            tree_geometry.check_tree(w.token_ids, w.parents, self.vocab_size)
        except tree_geometry.TreeError as e:
            raise InvalidArgument(f"tree.{e.field}", str(e)) from None
        if any(p != tree_geometry.ROOT and p < w.num_draft for p in w.parents[w.num_draft :]):
            raise InvalidArgument("lookahead.parents", "a lookahead row may hang off the root or lookahead rows only")
        depths = tree_geometry.node_depths(w.parents)
        for field, part in (("tree", depths[: w.num_draft]), ("lookahead", depths[w.num_draft :])):
            max_depth = max(part, default=0)
            if len(req.token_ids) + max_depth > self.max_context:
                raise InvalidArgument(
                    field, f"context {len(req.token_ids)} + depth {max_depth} exceeds max_context {self.max_context}"
                )

    def commit(self, request_id: str, accepted_nodes: Sequence[int], new_token_ids: Sequence[int]) -> None:
        """Keep the KV rows of `accepted_nodes` (a root-to-node path of the last verified tree) and
        append `new_token_ids` (the accepted tokens followed by the bonus token) to the request."""
        req = self._get(request_id)
        accepted_nodes = list(accepted_nodes)
        if accepted_nodes:
            if not tree_geometry.is_path(req.tree_parents, accepted_nodes):
                raise InvalidArgument(
                    "accepted_nodes", f"{accepted_nodes} is not a root-to-node path of the last verified tree"
                )
            accepted_tokens = [req.tree_token_ids[i] for i in accepted_nodes]
            if list(new_token_ids[: len(accepted_nodes)]) != accepted_tokens:
                raise InvalidArgument("committed_token_ids", "must start with the accepted nodes' tokens")
        if len(req.token_ids) + len(new_token_ids) > self.max_context:
            raise InvalidArgument("committed_token_ids", f"the request would exceed max_context {self.max_context}")
        self.check_token_ids("committed_token_ids", new_token_ids)
        if req.kv is not None and req.tree_chain:  # else the rows are gone: these tokens run again
            self.kv_cache.commit(req.kv, req.tree_chain, accepted_nodes)
        req.token_ids.extend(new_token_ids)
        req.tree_chain, req.tree_parents, req.tree_token_ids = 0, (), ()

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Cut the request's context back to its first `num_tokens` tokens, the last of them pending:
        the tokens a cancelled run committed after what its caller received. Their KV rows are dropped
        (rows past num_cached are rewritten by the next forward); the prompt cannot be cut into.

        E.g. prompt [p0, p1], output [a, b, c] with a and b cached: truncate to 3 -> [p0, p1, a], a
        pending (num_cached 2)."""
        req = self._get(request_id)
        if not req.num_prompt_tokens <= num_tokens <= len(req.token_ids):
            raise InvalidArgument(
                "num_context_tokens",
                f"is {num_tokens}, but request {request_id!r} holds {len(req.token_ids)} tokens of which "
                f"{req.num_prompt_tokens} are its prompt",
            )
        if num_tokens == len(req.token_ids):
            return
        del req.token_ids[num_tokens:]
        if req.kv is not None:
            req.kv.num_cached = min(req.kv.num_cached, num_tokens - 1)
        req.tree_chain, req.tree_parents, req.tree_token_ids = 0, (), ()

    # --- prompt scoring ----------------------------------------------------------------------

    def prompt_logprobs(self, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
        """The log probability of tokens 1 .. n-1 of `token_ids`, each given the tokens before it, with
        `num_top` alternatives (specdec.logprobs): forwards over tokens 0 .. n-2 in chunks of
        `prefill_chunk_tokens`, in a scratch KV slot released at once, apart from every request's
        state and the prefix cache. Row i of a chunk's logits predicts the token after its input i.

        E.g. [a, b, c], chunks of 2: one forward over [a, b] -> logits rows predicting b and c."""
        self.check_token_ids("token_ids", token_ids)
        n = len(token_ids)
        # As `check_open` refuses it: a prompt past the context would be forwarded at positions the
        # model has no rotary rows for (an IndexError deep in the forward, after the work).
        check_fits(n, self.max_context, "token_ids")
        if n < 2:
            return []
        try:
            slot = self.kv_cache.allocate(n)
        except KVBudgetExceeded as e:
            raise ResourceExhausted("kv_cache", str(e)) from None
        out: list[TokenLogprob] = []
        try:
            for start in range(0, n - 1, self.prefill_chunk_tokens):
                end = min(n - 1, start + self.prefill_chunk_tokens)
                rows = end - start
                mask = tree_geometry.verify_mask(start, rows, ())
                span = SequenceSpan(0, rows, start, slot.k, slot.v, mask)
                logits = self.model.forward(
                    torch.tensor(token_ids[start:end], dtype=torch.int64),
                    torch.arange(start, end),
                    [span],
                    torch.arange(rows),
                ).cpu()  # [rows, V] fp32
                out += token_logprobs(logits, token_ids[start + 1 : end + 1], num_top)
        finally:
            self.kv_cache.release(slot)
        return out

    # --- plain autoregressive decoding (the baseline) -------------------------------------------

    def decode(self, request_id: str, sampling: SamplingParams, position: int) -> int:
        """One plain step: the next token after the committed context, committed at once; `position`
        (its index among the generated tokens) selects a seeded draw's stream (make_generator)."""
        logits = self.verify(request_id, (), ())  # [1, V]
        if sampling.has_penalties:  # processed from the context, as the primary's Decode does
            context, output_ids = self.token_ids(request_id), self.output_token_ids(request_id)
            logits = penalize(logits[:1], sampling, context[: len(context) - len(output_ids)], output_ids)
        if sampling.is_greedy:
            token = row_argmax(logits[:1])[0]
        else:
            token = draw_token(logits[:1], sampling, position)
        self.commit(request_id, (), (token,))
        return token

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: Iterable[int] = (),
    ) -> list[int]:
        """Plain autoregressive generation of up to `max_new_tokens` tokens (stops after a stop token)."""
        request_id = f"generate-{time.monotonic_ns()}"
        stop = set(stop_token_ids)
        self.open(request_id, prompt_ids)
        try:
            self.prefill(request_id)
            out: list[int] = []
            for position in range(max_new_tokens):
                out.append(self.decode(request_id, sampling, position))
                if out[-1] in stop or len(out) >= output_room(len(prompt_ids), self.max_context):
                    break
            return out
        finally:
            self.release(request_id)
