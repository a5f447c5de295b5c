"""The model's own answers, as drafts for the primary's runs where the context repeats nothing.

Prompt lookup drafts only what the request's context already holds. A small model also writes much
the same text across requests: the same openings, the same code idioms, the same JSON around
other values. REST (He et al. 2024) drafts from a datastore of text through a suffix array; here the
datastore is this model's own answers to prompts outside every benchmark set (the answers the
feature drafter was trained on, draft_svc/heads), so what follows a match is what this model wrote
after the same tokens, not what some other writer did.

`AnswerIndex.draft` finds the longest suffix of the context (at least MIN_MATCH_TOKENS tokens) in
the answers (specdec.suffix_array) and proposes the continuation most of its occurrences agree on,
with the share of occurrences that begin with the proposed token. A draft needs a share
of at least MIN_SHARE. The primary's run drafts (specdec.repeats.RunDrafts) ask it where the
context's tail repeats nothing and price its drafts by their own acceptance estimate, as a copy's.

`LearnedAnswers` are the same idea for what this primary served: each tenant's newest outputs (of
requests that speculate), drafted where a later run's context ends as an earlier output's text did;
a run asks them first, each source priced by its own acceptance estimate (specdec.repeats.RunDrafts).

The file: safetensors (no pickle), tensor `tokens` (int32 [N], the answers one after another,
SEPARATOR after each) and metadata `format` (FORMAT), `model_fingerprint`
(specdec.model.fingerprint of the model that wrote them) and `provenance` (JSON: the command, the
prompts' sources and licences, how many answers and tokens). A file that is unreadable, of another
format or of another model is refused with AnswersFileError naming the file and what differs.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from specdec.model.fingerprint import bound_metadata
from specdec.suffix_array import (
    SEPARATOR,
    QueryConfig,
    SuffixArray,
    block_starts,
    most_frequent_paths,
    ranked_tokens,
    sort_positions,
)

FORMAT = "specdec-answers-1"
# The shipped answers of the default model (python -m draft_svc.heads answers writes one)
DEFAULT_ANSWERS = Path(__file__).parent / "data" / "smollm2-135m-instruct.answers.safetensors"
MAX_FILE_BYTES = 64 << 20  # a few MB of token ids; anything this large is not an answers file
MIN_MATCH_TOKENS = 2  # one token says little about the next (docs/benchmarks.md, "Run drafts from the model's answers")
MAX_MATCH_TOKENS = 32  # the longest context suffix compared
SORT_DEPTH = 32  # the suffix array is sorted this deep (built at load: ~0.3 s for 600k tokens)
MAX_OCCURRENCES = 64  # occurrences voted on per match
MIN_SHARE = 0.3  # where fewer occurrences agree on the first token, it is accepted about a tenth of the time


class AnswersFileError(ValueError):
    """An answers file that cannot serve this model (unreadable, another format, another model)."""


def save_answers(
    path: Path, answers: Sequence[Sequence[int] | np.ndarray], fingerprint: str, provenance: dict[str, Any]
) -> int:
    """Write the answers (token ids each) as one file, atomically; returns its size in bytes."""
    tokens = np.concatenate([np.append(np.asarray(a, dtype=np.int32), SEPARATOR) for a in answers])
    metadata = {
        "format": FORMAT,
        "model_fingerprint": fingerprint,
        "provenance": json.dumps(provenance, sort_keys=True),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"tokens": tokens.astype(np.int32)}, str(tmp), metadata=metadata)
    tmp.replace(path)
    return path.stat().st_size


def load_answers(path: Path, vocab_size: int, expected_fingerprint: str) -> AnswerIndex:
    """The answers of `path` for the model with this fingerprint, indexed; AnswersFileError if they
    cannot serve it."""
    path = Path(path)
    try:
        bound_metadata(path, "answers", FORMAT, MAX_FILE_BYTES, expected_fingerprint)
    except ValueError as e:
        raise AnswersFileError(str(e)) from None
    try:
        with safe_open(str(path), framework="numpy") as f:
            tokens = f.get_tensor("tokens")
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise AnswersFileError(f"answers file {path} cannot be read: {e}") from None
    if tokens.ndim != 1 or tokens.dtype != np.int32 or tokens.size == 0:
        raise AnswersFileError(f"answers file {path}: tokens must be a non-empty int32 vector")
    is_token = tokens != SEPARATOR
    if ((tokens[is_token] < 0) | (tokens[is_token] >= vocab_size)).any():
        raise AnswersFileError(f"answers file {path}: token ids outside the model's vocabulary of {vocab_size}")
    return AnswerIndex(tokens, vocab_size)


class AnswerIndex:
    """The answers' suffix array and the query the run drafts ask (module docstring). Read-only, so
    one serves every request and thread."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, min_share: float = MIN_SHARE) -> None:
        if tokens.size == 0 or tokens[-1] != SEPARATOR:
            tokens = np.append(tokens, SEPARATOR).astype(np.int32)
        order = sort_positions(tokens, SORT_DEPTH)
        config = QueryConfig(MAX_MATCH_TOKENS, MIN_MATCH_TOKENS, MAX_OCCURRENCES)
        self.array = SuffixArray(tokens, order, block_starts(tokens, order, vocab_size), SORT_DEPTH, config)
        self.num_tokens = int(tokens.size)
        self.min_share = min_share

    def draft(self, context_ids: Sequence[int], max_tokens: int) -> list[int]:
        """What most occurrences of the context's longest matched suffix continue with, at most
        max_tokens; empty where no suffix of MIN_MATCH_TOKENS or more occurs, or where fewer than
        min_share of its occurrences begin with that continuation's first token."""
        path, share = self.continuation(context_ids, max_tokens, self.min_share)
        return path if share >= self.min_share else []

    def continuation(
        self, context_ids: Sequence[int], max_tokens: int, min_share: float = 0.0
    ) -> tuple[list[int], float]:
        """(the most frequent continuation of the longest matched suffix, the share of its occurrences
        that begin with its first token); ([], 0.0) where nothing matches, ([], share) where the share
        is under min_share (the continuation is not followed past its first token then)."""
        if max_tokens <= 0:
            return [], 0.0
        starts = next(self.array.occurrences(context_ids), None)
        if starts is None or starts.size == 0:
            return [], 0.0
        firsts = self.array.continuations(starts, 1)[:, 0]
        ranked = ranked_tokens(firsts)  # the path's first token is the most frequent first (most_frequent_paths)
        if ranked.size == 0:
            return [], 0.0
        share = float((firsts == ranked[0]).sum() / firsts.size)
        if share < min_share:
            return [], share
        paths = most_frequent_paths(self.array.continuations(starts, max_tokens), 1)
        return list(paths[0]), share


# The outputs a primary served, as drafts for the same tenant's later runs (LearnedAnswers).
LEARNED_MATCH_TOKENS = 8  # a learned answer is drafted where the context's last 8 tokens stood before its text
LEARNED_PROMPT_TOKENS = 16  # the prompt's last tokens kept before each output: a question asked again
MAX_LEARNED_TOKENS = 1 << 14  # per tenant, the newest outputs (about 100 answers of 128 tokens)
MAX_LEARNED_TENANTS = 16  # tenants whose outputs are kept, the most recently served


class _TenantOutputs:
    """One tenant's newest outputs: their tokens one after another, each after its prompt's last
    tokens and followed by SEPARATOR, and where each n-gram that some output token followed was
    last seen (its hash -> the position after it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.lengths: list[tuple[int, int]] = []  # (prompt tail, output) tokens per kept output, oldest first
        self.followed: dict[int, int] = {}

    def add(self, prompt_tail: Sequence[int], output: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(prompt_tail)
        first = len(self.tokens)  # n-grams are indexed only where an output token follows them
        self.tokens.extend(output)
        self.tokens.append(SEPARATOR)
        self.lengths.append((len(prompt_tail), len(output)))
        tokens, n = self.tokens, self.n
        for p in range(max(first, start + n), first + len(output)):
            self.followed[hash(tuple(tokens[p - n : p]))] = p

    def keep_newest(self, max_tokens: int) -> None:
        """Only the newest outputs that fit in max_tokens // 2 tokens, re-indexed (amortised: once
        per max_tokens // 2 tokens added)."""
        kept: list[tuple[int, int]] = []
        total = 0
        for prompt_len, output_len in reversed(self.lengths):
            if total + prompt_len + output_len + 1 > max_tokens // 2:
                break
            kept.append((prompt_len, output_len))
            total += prompt_len + output_len + 1
        tokens = self.tokens[len(self.tokens) - total :]
        self.tokens, self.lengths, self.followed = [], [], {}
        at = 0
        for prompt_len, output_len in reversed(kept):
            self.add(tokens[at : at + prompt_len], tokens[at + prompt_len : at + prompt_len + output_len])
            at += prompt_len + output_len + 1

    def continuation(self, context_ids: Sequence[int], max_tokens: int) -> list[int]:
        if len(context_ids) < self.n:
            return []
        p = self.followed.get(hash(tuple(context_ids[-self.n :])))
        if p is None or tuple(self.tokens[p - self.n : p]) != tuple(context_ids[-self.n :]):
            return []  # never seen (or a hash collision)
        out = []
        for token in self.tokens[p : p + max_tokens]:
            if token == SEPARATOR:
                break
            out.append(token)
        return out


class LearnedAnswers:
    """The outputs this primary served, per tenant (specdec.request_id.tenant_of): where a run's
    context ends as an earlier output's text did (a question asked again, a reply that repeats an
    earlier one's wording), what that output went on with is its draft. Prompt lookup drafts what
    the request's own context holds, the shipped answers what the model writes in general; these
    are what it wrote here. A tenant's drafts come from its own outputs only. Bounded: the newest
    MAX_LEARNED_TOKENS tokens of the MAX_LEARNED_TENANTS tenants served last. Thread-safe."""

    def __init__(
        self,
        max_tokens: int = MAX_LEARNED_TOKENS,
        max_tenants: int = MAX_LEARNED_TENANTS,
        n: int = LEARNED_MATCH_TOKENS,
    ) -> None:
        if max_tokens < 1 or max_tenants < 1 or n < 1:
            raise ValueError(f"need max_tokens, max_tenants and n >= 1, got {max_tokens}, {max_tenants}, {n}")
        self.max_tokens, self.max_tenants, self.n = max_tokens, max_tenants, n
        self._tenants: collections.OrderedDict[str, _TenantOutputs] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, tenant: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """An output served to `tenant` after the prompt `prompt_ids` (its last LEARNED_PROMPT_TOKENS
        are kept before it)."""
        prompt_tail = list(prompt_ids[-LEARNED_PROMPT_TOKENS:])
        if not output_ids or len(prompt_tail) + len(output_ids) + 1 > self.max_tokens // 2:
            return  # nothing, or longer than what a tenant keeps
        with self._lock:
            outputs = self._tenants.pop(tenant, None) or _TenantOutputs(self.n)
            self._tenants[tenant] = outputs  # the most recently served last
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
            outputs.add(prompt_tail, list(output_ids))
            if len(outputs.tokens) > self.max_tokens:
                outputs.keep_newest(self.max_tokens)

    def draft(self, tenant: str, context_ids: Sequence[int], max_tokens: int) -> list[int]:
        """What the tenant's newest output whose text stood where the context ends went on with, at
        most max_tokens; empty where none did."""
        if max_tokens <= 0:
            return []
        with self._lock:
            outputs = self._tenants.get(tenant)
            return [] if outputs is None else outputs.continuation(context_ids, max_tokens)

    def num_tokens(self, tenant: str) -> int:
        with self._lock:
            outputs = self._tenants.get(tenant)
            return 0 if outputs is None else len(outputs.tokens)
