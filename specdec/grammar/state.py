"""Per-request grammar state: accept committed tokens, roll back, next-token masks, jump-forward
tokens, and masks for every node of a speculative token tree.

Tree masks follow the shared tree convention (node i's parent is parents[i], -1 = the root, i.e.
the committed context) and return one row per verify logits row:

    allowed[0]     tokens the grammar allows after the committed context
    allowed[1 + i] tokens it allows after draft node i (decides node i's children)

They walk the tree depth-first, accepting a node's token on the way down and rolling it back on
the way up, so a tree of N nodes costs N accepts, N rollbacks and at most N + 1 mask fills, not
one replay of every root-to-node path. E.g. parents [-1, 0, -1] (a -> b, c): accept a, fill row
1, accept b, fill row 2, roll back b, roll back a, accept c, fill row 3, roll back c.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xgrammar as xgr

from specdec.engine.tree import check_tree
from specdec.grammar.bitmask import TokenBitmask

if TYPE_CHECKING:
    from specdec.grammar.tokenizer_info import GrammarTokenizerInfo


@dataclasses.dataclass(frozen=True, slots=True)
class TreeMasks:
    """Masks for one token tree. A node whose path the grammar rejects is invalid: the mask of its
    parent's row already excludes its token, so no acceptance rule can accept it, and its own row
    (never reached) allows every token rather than none, so every row keeps a finite softmax."""

    allowed: TokenBitmask  # [N+1] rows, packed as the engine fills them (never unpacked here)
    is_valid_node: torch.Tensor  # bool [N]


class GrammarState:
    """One request's position in its grammar. Not thread-safe (one request, one caller)."""

    def __init__(self, matcher: xgr.GrammarMatcher, tokenizer_info: GrammarTokenizerInfo, num_tokens: int = 0) -> None:
        """Made by `CompiledGrammar.new_state()` (a fresh matcher) or `fork()`."""
        self._info = tokenizer_info
        self._matcher = matcher
        self.num_tokens = num_tokens  # tokens accepted so far (the bound of rollback)
        # After the end only the end again: keeps a mask row non-empty once a stop token is accepted.
        # Packed once per state, copied into the rows after a stop token.
        stop_bytes = np.zeros(xgr.get_bitmask_shape(1, tokenizer_info.vocab_size)[1] * 4, dtype=np.uint8)
        for token_id in tokenizer_info.stop_token_ids:
            stop_bytes[token_id // 8] |= 1 << (token_id % 8)  # little-endian words: byte k // 8
        self._stop_words = torch.from_numpy(stop_bytes.view("<i4").astype(np.int32))  # [W]

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is over."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The text so far is a complete output (a stop token may come next)."""
        return self._matcher.is_completed()

    def fork(self) -> "GrammarState":
        """An independent copy at the same position."""
        return GrammarState(self._matcher.fork(), self._info, self.num_tokens)

    # --- moving along the output ------------------------------------------------------------

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Accept `token_ids` in order; all or nothing: on the first token the grammar rejects,
        the ones accepted by this call are rolled back and False is returned."""
        for num_accepted, token_id in enumerate(token_ids):
            if not self._accept(int(token_id)):
                self.rollback(num_accepted)
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} accepted tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_tokens -= num_tokens

    def _accept(self, token_id: int) -> bool:
        # Out-of-range and special ids are refused here: the engine would log a warning for each.
        is_stop = token_id in self._info.stop_token_ids
        if not is_stop and (not 0 <= token_id < self._info.vocab_size or token_id in self._info.special_token_ids):
            return False
        if not self._matcher.accept_token(token_id):
            return False
        self.num_tokens += 1
        return True

    # --- masks ---------------------------------------------------------------------------------

    def allowed_mask(self) -> TokenBitmask:
        """One row: the tokens the grammar allows next (only the stop tokens once terminated)."""
        bitmask = xgr.allocate_token_bitmask(1, self._info.vocab_size)  # [1, W] int32
        self._fill_row(bitmask, 0)
        return TokenBitmask.from_engine(bitmask, self._info.vocab_size)

    def tree_masks(self, token_ids: Sequence[int], parents: Sequence[int]) -> TreeMasks:
        """Masks after the committed context and after every node of a token tree (module doc).
        The state is the same before and after the call."""
        num_nodes = len(token_ids)
        check_tree(token_ids, parents)
        children: list[list[int]] = [[] for _ in range(num_nodes + 1)]  # children[p + 1]: of parent p (ROOT: 0)
        for node, parent in enumerate(parents):
            children[parent + 1].append(node)
        bitmask = xgr.allocate_token_bitmask(num_nodes + 1, self._info.vocab_size)  # [N+1, W], all allowed
        is_valid_node = [False] * num_nodes
        self._fill_row(bitmask, 0)
        num_committed = self.num_tokens
        # Depth-first with an explicit stack; (node, True) marks "leaving node": roll its token back.
        stack = [(child, False) for child in reversed(children[0])]
        try:
            while stack:
                node, is_leaving = stack.pop()
                if is_leaving:
                    self.rollback(1)
                    continue
                if not self._accept(int(token_ids[node])):
                    continue  # invalid: its subtree is never entered, their rows stay all-allowed
                is_valid_node[node] = True
                self._fill_row(bitmask, node + 1)
                stack.append((node, True))
                stack.extend((child, False) for child in reversed(children[node + 1]))
        finally:  # an error mid-walk (a bad token id type) must not leave draft tokens accepted
            self.rollback(self.num_tokens - num_committed)
        return TreeMasks(
            TokenBitmask.from_engine(bitmask, self._info.vocab_size), torch.tensor(is_valid_node, dtype=torch.bool)
        )

    def _fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        if self.is_terminated:  # the engine has no mask after a stop token
            bitmask[row] = self._stop_words
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    # --- jump-forward --------------------------------------------------------------------------

    def forced_text(self) -> str:
        """The only text the grammar allows next (keys, punctuation, `": "`), "" when the next text
        is the model's choice or the output is over."""
        if self.is_terminated:
            return ""
        return self._matcher.find_jump_forward_string()

    def forced_token_ids(self, max_tokens: int) -> tuple[int, ...]:
        """Up to `max_tokens` tokens the grammar allows alone, one after another from here, or ().

        Where the mask leaves exactly one token (`_` inside a key the model began as `faq`, the `:`
        after a key's closing quote, the end token after the last `}`), greedy and sampled decoding
        alike must write that token: it needs no model decision and no verification. The run stops at
        the first position with a choice, so a forced *text* the model may spell with several tokens
        (`clean` or `cl` `e` `a` `n`) is not part of it. The state is the same before and after."""
        token_ids: list[int] = []
        try:
            while len(token_ids) < max_tokens and not self.is_terminated:
                if not (self.is_completed or self.forced_text()):  # a free choice ahead: skip the mask
                    break
                allowed_ids = self.allowed_mask().allowed_ids(0)
                if allowed_ids.numel() != 1 or not self._accept(int(allowed_ids[0])):
                    break
                token_ids.append(int(allowed_ids[0]))
        finally:
            self.rollback(len(token_ids))
        return tuple(token_ids)

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, from the first, the grammar accepts in a row (the state is
        unchanged after)."""
        num_checked = 0
        for token_id in token_ids:
            if not self._accept(int(token_id)):
                break
            num_checked += 1
        self.rollback(num_checked)
        return num_checked

    def forced_continuation(self, max_tokens: int) -> tuple[int, ...]:
        """Up to `max_tokens` token ids spelling `forced_text()`, or () when nothing is forced.

        The forced text is re-tokenized with the model's own tokenizer, which is how the model
        itself would write it unconstrained (docs/architecture.md: these drafts are accepted more often
        than the engine's forced-token list). Tokens are checked against the grammar and cut at the
        first one it refuses, so every proposed token is one the mask would allow."""
        if max_tokens <= 0:
            return ()
        forced_text = self.forced_text()
        if not forced_text:
            return ()
        token_ids = self._info.tokenizer.encode(forced_text)[:max_tokens]
        return tuple(token_ids[: self.num_valid(token_ids)])
