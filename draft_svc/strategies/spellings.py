"""How the model spells grammar-forced text, learned per request and across requests.

Under a grammar mask the model does not always write forced text (keys, `": "`) with the canonical
tokens of its tokenizer: it takes the allowed token it likes best, and when its favourite is forbidden
that is often a short piece, so `clean` comes out as `cl`, `e`, `a`, `n`. A draft of the canonical
tokens then fails at the first token. The model is consistent within a request, though: a key it
wrote in pieces once, it writes in the same pieces the next time (the next object of an array, the
next call of a function). So the pool remembers, per request, the tokens the model used for each
forced text, and proposes those spellings beside the canonical one, most used first. Requests share
much of their forced text too (the same tool's schema, `{"` at an output's start, `": "`), so the
pool also keeps one memory of its requests' spellings per tenant (SharedSpellings), which a request
consults for a text it has not spelled itself. Per tenant, as the primary's prefix cache: how fast a
request's drafts are accepted must not tell one tenant what another's outputs were.

    # E.g. the model wrote `{"` `cl` `e` `a` `n` `":` ` true` where `{"clean": ` was forced:
    #   observe('{"clean": ', those tokens) remembers '{"clean":' -> ({", cl, e, a, n, ":)
    #   (the last token ` true` reaches into free text: not part of the spelling), and every
    #   suffix at a token boundary: 'clean":' -> (cl, e, a, n, ":), 'ean":' -> (e, a, n, ":), ...
    #   spellings(', "clean": ') later -> [`, "` cl e a n `":` ` `, `, "` `clean` `":` ` `]: the
    #   model's pieces where 'clean":' starts at a canonical token boundary, and the canonical ones
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence

DEFAULT_MAX_TEXTS = 256  # remembered texts per request (least recently used dropped first)
DEFAULT_MAX_SPELLINGS = 4  # remembered spellings per text
DEFAULT_MAX_SHARED_TEXTS = 4096  # remembered texts across one tenant's requests
DEFAULT_MAX_TENANTS = 64  # tenants with a shared memory (least recently used dropped first)


@dataclasses.dataclass(frozen=True, slots=True)
class Spelling:
    token_ids: tuple[int, ...]
    # The last token is a canonical one that ends the forced text: the model often merges that one
    # with the free text after it (the decoder leaves it out). False when the model's own tokens end it.
    is_canonical_end: bool


@dataclasses.dataclass(slots=True)
class _Seen:
    token_ids: tuple[int, ...]
    count: int
    last_seen: int


class SpellingMemory:
    """One request's forced-text spellings. Not thread-safe (the pool holds the request's lock)."""

    def __init__(
        self,
        encode: Callable[[str], Sequence[int]],
        decode: Callable[[Sequence[int]], str],
        *,
        max_texts: int = DEFAULT_MAX_TEXTS,
        max_spellings: int = DEFAULT_MAX_SPELLINGS,
    ) -> None:
        if max_texts < 1 or max_spellings < 1:
            raise ValueError(f"max_texts and max_spellings must be >= 1, got {max_texts}, {max_spellings}")
        self._encode, self._decode = encode, decode
        self._max_texts, self._max_spellings = max_texts, max_spellings
        self._texts: collections.OrderedDict[str, list[_Seen]] = collections.OrderedDict()  # LRU order
        self._num_observed = 0

    @property
    def num_texts(self) -> int:
        return len(self._texts)

    def observe(self, forced_text: str, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The model wrote `token_ids` where `forced_text` was forced. Remembers the longest prefix of
        them that spells a prefix of the text exactly (a last token reaching past it into free text is
        not part of the spelling), and its suffixes at token boundaries; returns that prefix."""
        self._num_observed += 1
        num_spelled, texts = 0, [""]
        for i in range(1, len(token_ids) + 1):
            text = self._decode(token_ids[:i])
            if not forced_text.startswith(text):
                break
            num_spelled, texts = i, texts + [text]
        spelled = tuple(int(t) for t in token_ids[:num_spelled])
        for start in range(num_spelled):  # the whole spelling, then each suffix of it
            suffix_text = texts[num_spelled][len(texts[start]) :]
            if suffix_text and self._decode(spelled[start:]) == suffix_text:  # whole characters only
                self._remember(suffix_text, spelled[start:])
        for end in range(2, num_spelled):  # and each prefix of two tokens or more
            if self._decode(spelled[:end]) == texts[end]:
                self._remember(texts[end], spelled[:end])
        return spelled

    def spellings(self, forced_text: str, max_spellings: int) -> list[Spelling]:
        """Up to `max_spellings` distinct spellings of `forced_text`, best first.

        A remembered spelling is used where its text starts at a canonical token boundary of the
        forced text: canonical tokens up to there, the model's tokens for the remembered text, the
        canonical tokens of the rest. The earliest boundary and the longest text first (the most of
        the model's own tokens), then the most used and most recent spelling; the canonical
        spelling is among them unless only one is asked for and the model has spelled the text before.

        # E.g. remembered 'clean":' -> (cl, e, an, ":); forced ' {"clean": ' (canonical ` {"` `clean`
        #   `":` ` `) -> [(` {"` cl e an `":` ` `), (` {"` `clean` `":` ` `)], both with a canonical end
        """
        if not forced_text or max_spellings < 1:
            return []
        canonical = tuple(self._encode(forced_text))
        result: list[Spelling] = []
        for b in range(len(canonical)):
            head_text = self._decode(canonical[:b])
            if not forced_text.startswith(head_text):  # a boundary inside a character
                continue
            tail = forced_text[len(head_text) :]
            for text in sorted((t for t in self._texts if tail.startswith(t)), key=len, reverse=True):
                self._texts.move_to_end(text)
                rest = tuple(self._encode(tail[len(text) :])) if len(text) < len(tail) else ()
                for seen in sorted(self._texts[text], key=lambda s: (-s.count, -s.last_seen)):
                    _add(result, Spelling(canonical[:b] + seen.token_ids + rest, bool(rest)))
        head = result[:max_spellings]
        if not head or (max_spellings > 1 and all(s.token_ids != canonical for s in head)):
            head = head[: max_spellings - 1] + [Spelling(canonical, True)]
        return head

    def _remember(self, text: str, token_ids: tuple[int, ...]) -> None:
        seen = self._texts.setdefault(text, [])
        self._texts.move_to_end(text)
        for s in seen:
            if s.token_ids == token_ids:
                s.count += 1
                s.last_seen = self._num_observed
                return
        seen.append(_Seen(token_ids, 1, self._num_observed))
        if len(seen) > self._max_spellings:  # forget the least used, oldest first
            seen.remove(min(seen, key=lambda s: (s.count, s.last_seen)))
        while len(self._texts) > self._max_texts:
            self._texts.popitem(last=False)


def _add(result: list[Spelling], spelling: Spelling) -> None:
    if spelling.token_ids and all(s.token_ids != spelling.token_ids for s in result):
        result.append(spelling)


class SharedSpellings:
    """A SpellingMemory of each tenant's requests' spellings, for the pool's requests at once
    (thread-safe). Tenant "" is the one of a gateway without API keys."""

    def __init__(self, new_memory: Callable[[], SpellingMemory], max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        """`new_memory()`: a tenant's memory, made on its first use."""
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self._new_memory, self._max_tenants = new_memory, max_tenants
        self._memories: collections.OrderedDict[str, SpellingMemory] = collections.OrderedDict()  # LRU order
        self._lock = threading.Lock()

    def num_texts(self, tenant: str) -> int:
        with self._lock:
            memory = self._memories.get(tenant)
            return 0 if memory is None else memory.num_texts

    def observe(self, tenant: str, forced_text: str, token_ids: Sequence[int]) -> None:
        with self._lock:
            self._memory(tenant).observe(forced_text, token_ids)

    def spellings(self, tenant: str, forced_text: str, max_spellings: int) -> list[Spelling]:
        with self._lock:
            return self._memory(tenant).spellings(forced_text, max_spellings)

    def _memory(self, tenant: str) -> SpellingMemory:
        memory = self._memories.get(tenant)
        if memory is None:
            memory = self._memories[tenant] = self._new_memory()
            while len(self._memories) > self._max_tenants:
                self._memories.popitem(last=False)
        self._memories.move_to_end(tenant)
        return memory
