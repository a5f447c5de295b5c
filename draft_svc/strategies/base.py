"""The one small protocol every draft strategy implements, and the registry of strategies.

Per request the pool creates one decoder per strategy (`DecoderRegistry.create`). A decoder
keeps its own per-request state and sees the request's committed tokens exactly once:

    decoder.extend(prompt_ids)            # first call: the prompt
    decoder.propose(max_tokens=8, max_candidates=2)
    decoder.extend(committed_ids)         # the tokens the step committed (accepted + bonus)
    decoder.propose(...)

`propose` returns a tuple of candidates, best first, rather than one candidate: a strategy
such as prompt lookup finds several matches in one pass over its index, so asking one decoder
for its top-k is k times cheaper than k decoders that each keep the same index. Rank r of a
decoder's answer is `Candidate.rank == r`; the controller keeps acceptance statistics per
(decoder, rank), so "a second prompt-lookup match" earns its place like any other decoder.
An empty tuple means "nothing to propose" (no match), which is common and cheap.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeGuard, runtime_checkable

import numpy as np

# Context tokens live in array('i'): 4 bytes a token, appended in place, no per-step list copies.
TOKEN_TYPECODE = "i"


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One decoder's proposed continuation of the request's current context."""

    decoder: str
    token_ids: tuple[int, ...]  # a point-mass draft: every strategy proposes deterministically
    rank: int = 0  # position in the decoder's best-first answer to one propose() call

    def __post_init__(self) -> None:
        if not self.decoder:
            raise ValueError("decoder must be a non-empty name")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class DraftDecoder(Protocol):
    """A proposer with independent per-request state."""

    name: ClassVar[str]

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append the tokens committed since the last call (the first call passes the prompt)."""
        ...

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        """Up to `max_candidates` continuations of the current context, best first, each at most
        `max_tokens` long; candidates are distinct, ranks are 0, 1, ...; may be empty."""
        ...


@runtime_checkable
class FeatureConsumer(Protocol):
    """A decoder that also reads the primary's features (its last hidden states after the final norm,
    the lm_head's input; specdec/features.py), e.g. an EAGLE-style feature drafter.

    Alignment: `features[i]` [C] is the primary's hidden state at the row whose next token is the
    token at absolute position `position + i` of the request's context (prompt included, position 0
    = the first prompt token); so it was computed over the tokens before that position. Every
    predicted token is committed already: the pool calls `observe_features` after `extend` has
    given the decoder those tokens, with `position >= 1` and `position + len(features) <=` the
    context's length. E.g. a prompt of 5 tokens: after the Prefill, (4, [1, C]): the row of token 3,
    predicting token 4. After a step that accepted 2 drafts and a bonus at positions 5-7:
    (5, [3, C]). Calls may leave gaps (tokens committed without a verify, or by a pool call that had
    no features) and may come while the decoder is not asked to propose; a decoder created later
    sees only the features from then on.
    """

    def observe_features(self, position: int, features: np.ndarray) -> None:
        """Rows `features` float32 [n, C]: row i predicts the token at `position + i` (see above)."""
        ...


# (decoder class, protocol) -> whether the class implements it (implements)
_IMPLEMENTS: dict[tuple[type, type], bool] = {}


def implements(decoder: object, protocol: type) -> bool:
    """isinstance(decoder, protocol) for a runtime-checkable Protocol, decided once per decoder class:
    a Protocol's isinstance looks every member up on each call (20-40 us on a 2-vCPU EPYC), and the
    pool asks several per Propose. Sound because a decoder's capabilities are its class's methods."""
    key = (type(decoder), protocol)
    found = _IMPLEMENTS.get(key)
    if found is None:
        found = _IMPLEMENTS[key] = isinstance(decoder, protocol)
    return found


def reads_features(decoder: object) -> TypeGuard[FeatureConsumer]:
    """Whether the decoder takes the primary's features (FeatureConsumer)."""
    return implements(decoder, FeatureConsumer)


DecoderFactory = Callable[..., DraftDecoder]


class UnknownDecoderError(ValueError):
    """A request named a draft decoder that this pool does not have."""


class DecoderRegistry:
    """Names -> factories: a new strategy is one `register` call (and its entry in specdec/strategies.py,
    the list the other services read), never a new `elif`.

    A factory carries the strategy's configuration and shared objects (a `functools.partial` over
    the class); `create(name, **request_kwargs)` passes per-request arguments through. A strategy
    that learns from other requests (a shared index) is registered `is_tenant_scoped`: the pool then
    creates it with the request's `tenant=`, and it must learn from and draft for that tenant only.
    """

    def __init__(self, factories: Mapping[str, DecoderFactory] | None = None) -> None:
        self._factories: dict[str, DecoderFactory] = {}
        self._tenant_scoped: set[str] = set()
        for name, factory in (factories or {}).items():
            self.register(name, factory)

    def register(self, name: str, factory: DecoderFactory, *, is_tenant_scoped: bool = False) -> None:
        if not name:
            raise ValueError("decoder name must be non-empty")
        if name in self._factories:
            raise ValueError(f"decoder {name!r} is already registered")
        self._factories[name] = factory
        if is_tenant_scoped:
            self._tenant_scoped.add(name)

    def is_tenant_scoped(self, name: str) -> bool:
        return name in self._tenant_scoped

    def names(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def create(self, name: str, **request_kwargs: Any) -> DraftDecoder:
        factory = self._factories.get(name)
        if factory is None:
            raise UnknownDecoderError(f"decoder {name!r} is not one of {sorted(self._factories)}")
        return factory(**request_kwargs)

    def create_all(self, names: Iterable[str], **request_kwargs: Any) -> dict[str, DraftDecoder]:
        return {name: self.create(name, **request_kwargs) for name in names}


def new_context() -> array:
    return array(TOKEN_TYPECODE)


def append_tokens(context: array, token_ids: Sequence[int]) -> None:
    """Append committed token ids to a context array; ids must be non-negative (negative values are
    the strategies' sentinels)."""
    # numpy / torch elements are converted once so that array('i') accepts them
    chunk = token_ids if isinstance(token_ids, (list, tuple, array)) else [int(t) for t in token_ids]
    if len(chunk) and min(chunk) < 0:
        raise ValueError(f"token_ids must be non-negative, got min {min(chunk)}")
    context.extend(chunk)


def validate_propose_args(max_tokens: int, max_candidates: int) -> None:
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if max_candidates < 1:
        raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
