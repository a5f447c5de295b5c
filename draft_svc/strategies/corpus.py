"""Corpus drafts: the suffix-index rule over a corpus that ships with the machine, not only over
this server's earlier outputs.

REST (He et al. 2024) drafts from a datastore: the longest suffix of the context found in the
corpus, and what most often followed it there, proposed as a few ranked candidates that the pool
merges into the step's token tree. The corpus here is Python's standard library and installed
packages' sources, Python's documentation and JSON meta-schemas, tokenized with the model's own
tokenizer (draft_svc/corpus/sources.py); the index is a memory-mapped backward suffix array
(specdec/suffix_array.py, store.py), shared read-only by every request and process.

The index is opened (and built, the first time on a machine) on a background thread: until it is
ready the decoder proposes nothing, as the model-based decoders before the primary's weights
attach, so the service serves at once. A failed build is logged and leaves the decoder silent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import structlog

from draft_svc.strategies.suffix_index import SuffixDecoder

if TYPE_CHECKING:
    from draft_svc.corpus.store import CorpusIndex


class CorpusDecoder(SuffixDecoder):
    """Per-request context tail over the shared corpus index (a PendingCorpusIndex or a SuffixArray)."""

    name: ClassVar[str] = "corpus"


class PendingCorpusIndex:
    """A corpus index that becomes queryable once `open_index` returns (on the thread `start` runs)."""

    def __init__(self, open_index: Callable[[], CorpusIndex], max_match_len: int) -> None:
        self._open_index = open_index
        self._max_match_len = max_match_len
        self._index: CorpusIndex | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._open, name="corpus-index", daemon=True)
        self._log = structlog.get_logger("draft_svc.corpus")

    @property
    def max_match_len(self) -> int:
        return self._max_match_len

    @property
    def index(self) -> CorpusIndex | None:
        """The opened index; None while it is being built (or after a failed build)."""
        return self._index

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> CorpusIndex | None:
        self._done.wait(timeout_s)
        return self._index

    def query(
        self, context_ids: Sequence[int], max_tokens: int, max_candidates: int = 1
    ) -> tuple[tuple[int, ...], ...]:
        index = self._index
        return () if index is None else index.suffix_array.query(context_ids, max_tokens, max_candidates)

    def _open(self) -> None:
        try:
            index = self._open_index()
        except Exception:  # the pool keeps serving its other strategies; the log says why this one is silent
            self._log.exception("corpus_index_failed")
        else:
            self._index = index
            self._log.info(
                "corpus_index_ready",
                path=str(index.path),
                num_tokens=index.meta["num_tokens"],
                num_bytes=index.num_bytes,
            )
        finally:
            self._done.set()
