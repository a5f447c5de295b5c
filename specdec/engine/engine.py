"""The primary engine: every request's KV cache, prefill, one-pass tree verify, commit, release.

Per request it keeps the committed token ids and a KV slot whose first `num_cached` rows
hold their keys/values. The invariant between steps is that the last committed token is
*pending*: committed but not yet run through the model. A verify pass runs the uncached
committed tokens (the "chain", usually just the pending token; the whole prompt on the
first step or after a re-prefill) plus a draft token tree, in ONE forward, and returns
logits for the pending token (the tree's root) and for every node:

    logits[0]     next-token logits after the committed context   (decides depth-1 nodes)
    logits[1 + i] next-token logits after draft node i            (decides node i's children)

`commit` then keeps the KV rows of the chain and of the accepted path and appends the new
committed tokens (the accepted drafts and one bonus token), which rolls back everything
else. Until then nothing is committed, so repeating a verify (a retried RPC) is harmless.
Plain autoregressive decoding is the special case of an empty tree.

Batch invariance: where the model's kernels give a row the same bits whatever the row count (the
packed int4/int8 layers, `Transformer.is_batch_invariant`), the engine also runs attention row by
row in verify (`SequenceSpan.row_paths`), so a k-row verify returns exactly the logits k 1-row
decodes would, and greedy speculation equals greedy decoding token for token. Batched masked
attention (SDPA) rounds differently from a 1-row call (~3e-7 in fp32), which the quantized
activations of the packed kernels amplify into argmax flips at near-ties. The native kernels'
attention (`specdec.model.native`) is row-exact under a mask already, so there the whole tree
runs as one masked call.

The engine is not thread-safe: the primary service serialises (and batches) calls.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Sequence

import torch

from specdec.engine import tree as tree_geometry
from specdec.engine.kv_cache import KVBudgetExceeded, KVCache, KVSlot
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.model.llama import SequenceSpan, Transformer
from specdec.sampling import SamplingParams, logits_to_probs, make_generator, sample

PREFILL_CHUNK_TOKENS = 512   # bounds the [chunk, context] attention mask of long prompts
MAX_TREE_NODES = 256


@dataclasses.dataclass(slots=True)
class _Request:
    token_ids: list[int]
    kv: KVSlot
    tree_chain: int = 0                    # chain rows written by the last verify, after num_cached
    tree_parents: tuple[int, ...] = ()     # the tree of the last verify, whose rows follow the chain
    tree_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyWork:
    request_id: str
    token_ids: Sequence[int]     # draft tree tokens [N]
    parents: Sequence[int]       # [N], -1 = child of the root


class Engine:
    def __init__(self, model: Transformer, kv_cache: KVCache, max_context: int) -> None:
        window = model.config.sliding_window
        if window is not None and max_context > window:
            raise ValueError(f"this model uses sliding-window attention ({window} tokens), which the engine does "
                             f"not implement: serve it with max_context <= {window}")
        if max_context > model.max_positions:
            raise ValueError(f"max_context {max_context} exceeds the model's {model.max_positions} positions")
        self.model, self.kv_cache, self.max_context = model, kv_cache, max_context
        self.vocab_size = model.config.vocab_size
        # see "Batch invariance" above
        self.is_row_by_row = model.is_batch_invariant and not model.is_attention_row_exact
        self._requests: dict[str, _Request] = {}

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

    def num_cached(self, request_id: str) -> int:
        return self._get(request_id).kv.num_cached

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise NotFound("request_id", f"no active request {request_id!r} on this primary") from None

    def _check_token_ids(self, field: str, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise InvalidArgument(field, f"token id {t} is outside the vocabulary [0, {self.vocab_size})")

    # --- lifecycle -----------------------------------------------------------------------

    def open(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Register a request with its committed tokens (prompt, or prompt + output on recovery)."""
        if not request_id:
            raise InvalidArgument("request_id", "must not be empty")
        if request_id in self._requests:
            raise InvalidArgument("request_id", f"request {request_id!r} is already open")
        if not token_ids:
            raise InvalidArgument("token_ids", "a request needs at least one token")
        if len(token_ids) >= self.max_context:
            raise InvalidArgument("token_ids", f"{len(token_ids)} tokens do not fit the context of "
                                  f"{self.max_context} with room to generate")
        self._check_token_ids("token_ids", token_ids)
        try:
            slot = self.kv_cache.allocate(len(token_ids) + 1)
        except KVBudgetExceeded as e:
            raise ResourceExhausted("kv_cache", str(e)) from None
        self._requests[request_id] = _Request(list(token_ids), slot)

    def release(self, request_id: str) -> int:
        """Free the request's KV slot; returns the bytes freed."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise NotFound("request_id", f"no active request {request_id!r} on this primary")
        return self.kv_cache.release(req.kv)

    def prefill(self, request_id: str, num_prompt_tokens: int = 0) -> int:
        """Run every committed token but the pending one into the cache; returns num_cached.

        The prompt runs in chunks. With row-by-row verify (`is_row_by_row`), tokens from the
        prompt's last one on (`num_prompt_tokens` > 0: a recovered request's generated tokens) run
        row by row, each exactly as the step that decoded it did, so the cache and every later
        step are bit for bit those of the uninterrupted request.
        """
        req = self._get(request_id)
        last = len(req.token_ids) - 1                      # the pending token stays out
        batched_end = min(last, num_prompt_tokens - 1) if self.is_row_by_row and num_prompt_tokens else last
        while req.kv.num_cached < last:
            start = req.kv.num_cached
            is_row_by_row = start >= batched_end
            end = min(start + PREFILL_CHUNK_TOKENS, last if is_row_by_row else batched_end)
            self._reserve(req, end)
            mask = tree_geometry.verify_mask(start, end - start, ())
            paths = tree_geometry.row_paths(end - start, ()) if is_row_by_row else None
            span = SequenceSpan(0, end - start, start, req.kv.k, req.kv.v, mask, paths)
            self.model.forward(torch.tensor(req.token_ids[start:end], dtype=torch.int64), torch.arange(start, end),
                               [span], logits_rows=torch.empty(0, dtype=torch.int64))
            req.kv.num_cached = end
            req.tree_chain, req.tree_parents, req.tree_token_ids = 0, (), ()
        return req.kv.num_cached

    def _reserve(self, req: _Request, num_rows: int) -> None:
        try:
            self.kv_cache.reserve(req.kv, num_rows)
        except KVBudgetExceeded as e:
            raise ResourceExhausted("kv_cache", str(e)) from None

    # --- verify / commit -------------------------------------------------------------------

    def verify(self, request_id: str, token_ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """One forward over the uncached chain + the tree; logits [N+1, V] fp32 (see module doc)."""
        return self.verify_batch([VerifyWork(request_id, token_ids, parents)])[0]

    def verify_batch(self, works: Sequence[VerifyWork]) -> list[torch.Tensor]:
        """Verify several requests' trees in one forward (linear layers run once over all rows)."""
        if len({w.request_id for w in works}) != len(works):
            raise InvalidArgument("request_id", "a request appears twice in one batch")
        input_ids, positions, spans, logits_rows, reqs = [], [], [], [], []
        num_rows = 0
        for w in works:
            self.check_verify(w)
        for w in works:
            req = self._requests[w.request_id]
            chain = req.token_ids[req.kv.num_cached:]
            n, c = len(w.token_ids), len(chain)
            self._reserve(req, req.kv.num_cached + c + n)
            input_ids.extend(chain)
            input_ids.extend(w.token_ids)
            positions.append(tree_geometry.verify_positions(req.kv.num_cached, c, w.parents))
            mask = tree_geometry.verify_mask(req.kv.num_cached, c, w.parents)
            # the chain before the root attends together, as a prefill would; the root and the tree row by row
            paths = tree_geometry.row_paths(c, w.parents)[c - 1:] if self.is_row_by_row and c + n > 1 else None
            spans.append(SequenceSpan(num_rows, c + n, req.kv.num_cached, req.kv.k, req.kv.v, mask, paths))
            logits_rows.append(torch.arange(num_rows + c - 1, num_rows + c + n))
            num_rows += c + n
            reqs.append((req, c, w))
        logits = self.model.forward(torch.tensor(input_ids, dtype=torch.int64), torch.cat(positions),
                                    spans, torch.cat(logits_rows)).cpu()       # [sum(N+1), V] fp32
        out, row = [], 0
        for req, c, w in reqs:
            # The rows stay uncommitted until `commit`, so a repeated verify (a retry) is harmless.
            req.tree_chain = c
            req.tree_parents, req.tree_token_ids = tuple(w.parents), tuple(w.token_ids)
            out.append(logits[row:row + len(w.token_ids) + 1])
            row += len(w.token_ids) + 1
        return out

    def check_verify(self, w: VerifyWork) -> None:
        """Raise the error `verify_batch` would raise for this work item, without running anything."""
        req = self._get(w.request_id)
        if req.kv.num_cached >= len(req.token_ids):
            raise FailedPrecondition("request_id", f"request {w.request_id!r} has no pending token: "
                                     "commit the last step's bonus token before verifying again")
        n = len(w.token_ids)
        if n > MAX_TREE_NODES:
            raise InvalidArgument("tree.token_ids", f"{n} nodes exceed the limit of {MAX_TREE_NODES}")
        try:
            tree_geometry.check_tree(w.token_ids, w.parents, self.vocab_size)
        except tree_geometry.TreeError as e:
            raise InvalidArgument(f"tree.{e.field}", str(e)) from None
        max_depth = max(tree_geometry.node_depths(w.parents), default=0)
        if len(req.token_ids) + max_depth > self.max_context:
            raise InvalidArgument("tree", f"context {len(req.token_ids)} + tree depth {max_depth} exceeds "
                                  f"max_context {self.max_context}")

    def commit(self, request_id: str, accepted_nodes: Sequence[int], new_token_ids: Sequence[int]) -> None:
        """Keep the KV rows of `accepted_nodes` (a root-to-node path of the last verified tree) and
        append `new_token_ids` (the accepted tokens followed by the bonus token) to the request."""
        req = self._get(request_id)
        accepted_nodes = list(accepted_nodes)
        if accepted_nodes:
            if not tree_geometry.is_path(req.tree_parents, accepted_nodes):
                raise InvalidArgument("accepted_nodes", f"{accepted_nodes} is not a root-to-node path of "
                                      "the last verified tree")
            accepted_tokens = [req.tree_token_ids[i] for i in accepted_nodes]
            if list(new_token_ids[:len(accepted_nodes)]) != accepted_tokens:
                raise InvalidArgument("committed_token_ids", "must start with the accepted nodes' tokens")
        if len(req.token_ids) + len(new_token_ids) > self.max_context:
            raise InvalidArgument("committed_token_ids", f"the request would exceed max_context {self.max_context}")
        self._check_token_ids("committed_token_ids", new_token_ids)
        self.kv_cache.commit(req.kv, req.tree_chain, accepted_nodes)
        req.token_ids.extend(new_token_ids)
        req.tree_chain, req.tree_parents, req.tree_token_ids = 0, (), ()

    # --- plain autoregressive decoding (the baseline) -------------------------------------------

    def decode(self, request_id: str, sampling: SamplingParams, step: int) -> int:
        """One plain step: the next token after the committed context, committed at once."""
        logits = self.verify(request_id, (), ())                               # [1, V]
        if sampling.is_greedy:
            token = int(torch.argmax(logits[0]))
        else:
            token = int(sample(logits_to_probs(logits, sampling), make_generator(sampling.seed, step))[0])
        self.commit(request_id, (), (token,))
        return token

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                 stop_token_ids: Iterable[int] = ()) -> list[int]:
        """Plain autoregressive generation of up to `max_new_tokens` tokens (stops after a stop token)."""
        request_id = f"generate-{time.monotonic_ns()}"
        stop = set(stop_token_ids)
        self.open(request_id, prompt_ids)
        try:
            self.prefill(request_id)
            out: list[int] = []
            for step in range(max_new_tokens):
                out.append(self.decode(request_id, sampling, step))
                if out[-1] in stop or len(prompt_ids) + len(out) >= self.max_context:
                    break
            return out
        finally:
            self.release(request_id)
