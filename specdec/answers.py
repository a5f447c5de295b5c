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

The file: safetensors (no pickle), tensor `tokens` (int32 [N], the answers one after another,
SEPARATOR after each) and metadata `format` (FORMAT), `model_fingerprint`
(specdec.model.fingerprint of the model that wrote them) and `provenance` (JSON: the command, the
prompts' sources and licences, how many answers and tokens). A file that is unreadable, of another
format or of another model is refused with AnswersFileError naming the file and what differs.
"""

from __future__ import annotations

import json
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
