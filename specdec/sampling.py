"""Sampling parameters and the ONE function that turns logits into a sampling distribution.

Every stage applies the request's temperature, top-k and top-p through `logits_to_probs`, to the
primary's (target) logits and to a draft decoder's logits alike. Rejection sampling is only
lossless when target and draft distributions are shaped by the same rule, so there is exactly
one implementation and everybody imports it.

Order of operations (the Hugging Face order): divide by temperature, keep the top-k logits,
softmax, keep the smallest top-p nucleus, drop the tokens below min_p times the most likely
token's probability, renormalise. The penalties and logit_bias (specdec.penalties) are not
applied here: they depend on each row's token history, so the primary applies them to the logits
it returns, and every stage sees the processed logits. Ties are broken by the lowest token id
everywhere (argmax, the k-th place, the nucleus boundary), so the result does not depend on the
sort implementation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch

TOP_K_OFF = 0  # top_k == 0 keeps the whole vocabulary
TOP_P_OFF = 1.0  # top_p == 1.0 keeps the whole vocabulary
GREEDY_TEMPERATURE = 0.0  # temperature == 0 means argmax decoding
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts unsigned 64-bit seeds
MIN_P_OFF = 0.0  # min_p == 0 keeps the whole vocabulary
REPETITION_PENALTY_OFF = 1.0
MAX_ABS_PENALTY = 2.0  # OpenAI's range of frequency_penalty and presence_penalty: [-2, 2]
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range of a logit_bias value: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on the tokens one logit_bias names
MAX_STOP_TOKEN_IDS = 64  # the stop_token_ids a request may name (gateway Limits.max_stop_token_ids)
# The tokens min_tokens may hold back: a request's end tokens, its stop_token_ids and the model's own.
MAX_MIN_TOKENS_IDS = 2 * MAX_STOP_TOKEN_IDS

_MASK_64 = 2**64 - 1
_TOP_P_FIRST_PREFIX = 256  # typical nuclei are far smaller; the prefix grows x8 when not


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = GREEDY_TEMPERATURE
    top_k: int = TOP_K_OFF
    top_p: float = TOP_P_OFF
    seed: int | None = None
    # The history-dependent logits processing (specdec.penalties), applied by the primary:
    frequency_penalty: float = 0.0  # [-2, 2], minus this times a token's count in the output
    presence_penalty: float = 0.0  # [-2, 2], minus this once for a token present in the output
    repetition_penalty: float = REPETITION_PENALTY_OFF  # > 0, divides (or multiplies) seen tokens' logits
    min_p: float = MIN_P_OFF  # [0, 1], applied here after top-p (logits_to_probs)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) sorted by id
    # vLLM's min_tokens: output token k < min_tokens cannot be one of min_tokens_ids (specdec.penalties)
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()  # sorted, each once

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an int or None, got {self.seed!r}")
            if not (0 <= self.seed <= MAX_SEED):
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed!r}")
        self._check_processing()

    def _check_processing(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not (0.0 < rp and math.isfinite(rp)):
            raise ValueError(f"repetition_penalty must be finite and > 0 (1 = off), got {rp!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}")
        previous = -1
        for token_id, bias in self.logit_bias:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id <= previous:
                raise ValueError(f"logit_bias token ids must be ints >= 0, sorted, each once, got {token_id!r}")
            if not _is_number(bias) or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token_id}] must be in [-100, 100], got {bias!r}")
            previous = token_id
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0 (0 = off), got {self.min_tokens!r}")
        ids = self.min_tokens_ids
        if len(ids) > MAX_MIN_TOKENS_IDS:
            raise ValueError(f"min_tokens_ids may name at most {MAX_MIN_TOKENS_IDS} tokens, got {len(ids)}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids) or list(ids) != sorted(set(ids)):
            raise ValueError(f"min_tokens_ids must be ints >= 0, sorted, each once, got {ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether the primary processes this request's logits (specdec.penalties): only those rows pay."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != REPETITION_PENALTY_OFF
            or self.logit_bias
            or (self.min_tokens and self.min_tokens_ids)
        )

    def holding_back(self, end_token_ids: Iterable[int], num_generated: int) -> SamplingParams:
        """What the primary is sent after num_generated output tokens: with min_tokens still ahead,
        min_tokens_ids the request's end tokens when it named none; once min_tokens is reached,
        nothing of it (so the steps after it are as a request without min_tokens)."""
        if num_generated >= self.min_tokens:
            return self if not self.min_tokens else dataclasses.replace(self, min_tokens=0, min_tokens_ids=())
        if self.min_tokens_ids:
            return self
        return dataclasses.replace(self, min_tokens_ids=tuple(sorted(set(end_token_ids))))


def _is_number(value: object) -> bool:
    """A finite int or float (NaN fails every range comparison, so it is refused by the callers too)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [R, V] fp32 -> probabilities [R, V] fp32 under `params`.

    Greedy (temperature 0) gives the one-hot of the argmax, the lowest token id winning ties.
    """
    assert logits.dim() == 2, f"logits must be [R, V], got {tuple(logits.shape)}"
    assert logits.dtype == torch.float32, f"logits must be float32, got {logits.dtype}"
    num_rows, vocab_size = logits.shape
    if params.is_greedy:
        argmax_ids = torch.argmax(logits, dim=-1)  # [R]; torch returns the first maximum
        probs = torch.zeros_like(logits)  # [R, V]
        probs[torch.arange(num_rows), argmax_ids] = 1.0
        return probs
    # Shifted to each row's max first (softmax and the top-k order are unchanged): at a tiny
    # temperature (1e-38) logits / T overflows to +inf and softmax([inf, inf, ...]) is NaN, while
    # (x - max) / T is 0 at the max and at most -inf elsewhere. At T = 1 the values are the same bits.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature  # [R, V], max 0
    if params.top_k != TOP_K_OFF and params.top_k < vocab_size:
        scaled = scaled.masked_fill(~_top_k_mask(scaled, params.top_k), -math.inf)
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    if params.top_p < TOP_P_OFF:
        probs = probs * _top_p_mask(probs, params.top_p)
    if params.min_p > MIN_P_OFF:
        # Keep p >= min_p * max p: a ratio to the most likely token, so the same set whether taken
        # before or after top-p's renormalisation; the most likely token is always kept.
        probs = probs * (probs >= params.min_p * probs.amax(dim=-1, keepdim=True)).to(probs.dtype)
    if params.top_p < TOP_P_OFF or params.min_p > MIN_P_OFF:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_mask(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Bool [R, V]: exactly top_k kept per row; at a tie on the k-th value the lowest ids win.

    E.g. scores [3, 1, 3, 3], k=2 -> kth value 3, nothing above it, ties at ids 0, 2, 3 ->
    keep the first two tied ids: [T, F, T, F]. O(V) per row, no full sort.
    """
    kth_value = torch.topk(scores, top_k, dim=-1).values[:, -1:]  # [R, 1]
    return _keep_first(scores, kth_value, torch.full_like(kth_value, top_k, dtype=torch.int64))


def _keep_first(scores: torch.Tensor, boundary: torch.Tensor, num_kept: torch.Tensor) -> torch.Tensor:
    """Bool [R, V]: the num_kept [R, 1] highest scores per row, whose lowest is boundary [R, 1];
    ties at the boundary are filled by the lowest ids."""
    is_above = scores > boundary  # [R, V]
    is_tied = scores == boundary  # [R, V]
    num_tied_slots = num_kept - is_above.sum(dim=-1, keepdim=True)  # [R, 1]
    if bool((is_tied.sum(dim=-1, keepdim=True) <= num_tied_slots).all()):
        return is_above | is_tied  # the usual case: no tie straddles the boundary
    tie_rank = torch.cumsum(is_tied.to(torch.int64), dim=-1)  # [R, V]; 1-based among ties
    return is_above | (is_tied & (tie_rank <= num_tied_slots))


def _top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Float [R, V] 0/1: the smallest set of most likely tokens whose mass reaches top_p.

    In descending-probability order a token is kept when the mass strictly before it is below
    top_p; the most likely token is always kept; ties at the boundary go to the lowest ids.
    E.g. probs [0.5, 0.3, 0.2], top_p 0.6 -> mass before each [0, 0.5, 0.8] -> keep [T, T, F].
    The nucleus size depends only on the sorted values, so a top-k prefix (grown until the
    nucleus ends inside it) replaces a full sort of V: ~0.3 ms instead of ~5 ms at V = 49152.
    """
    vocab_size = probs.shape[1]
    prefix = min(vocab_size, _TOP_P_FIRST_PREFIX)
    while True:
        sorted_probs = torch.topk(probs, prefix, dim=-1).values  # [R, prefix], descending
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [R, prefix]
        nucleus_size = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)  # [R, 1]
        if prefix == vocab_size or bool((nucleus_size < prefix).all()):
            break
        prefix = min(vocab_size, prefix * 8)
    boundary = sorted_probs.gather(-1, nucleus_size - 1)  # [R, 1]
    return _keep_first(probs, boundary, nucleus_size).to(probs.dtype)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of probs [R, V] -> [R] int64, by inverse CDF in float64.

    Uses exactly one uniform per row from `generator`, so a seeded caller can reason about how
    many draws a step consumes. Zero-probability tokens are never returned. Rows need not be
    normalised, only non-negative with a positive sum.
    """
    assert probs.dim() == 2, f"probs must be [R, V], got {tuple(probs.shape)}"
    num_rows = probs.shape[0]
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # [R, V]
    total = cdf[:, -1:]  # [R, 1]
    assert bool((total > 0).all()), "every row of probs must have positive mass"
    uniforms = torch.rand(num_rows, 1, generator=generator, dtype=torch.float64)  # [R, 1]
    token_ids = torch.searchsorted(cdf, uniforms * total, right=True).squeeze(1)  # [R]
    vocab_size = probs.shape[1]
    if bool((token_ids == vocab_size).any()):
        # u * total rounded up to total: fall back to the last token with positive mass.
        last_positive = vocab_size - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
        token_ids = torch.minimum(token_ids, last_positive)
    return token_ids  # [R]


def draw_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token a plain step draws from one row of logits [1, V] under `params` (not greedy), at
    `position` among the request's generated tokens: the seed's stream for that position
    (make_generator), so every service that draws it draws the same token."""
    return int(sample(logits_to_probs(logits, params), make_generator(params.seed, position))[0])


def make_generator(seed: int | None, position: int) -> torch.Generator:
    """A CPU generator, deterministic per (seed, position); seed None draws fresh OS entropy.

    `position` is the index of the drawn token among the request's generated tokens, not a step
    count: every service keys the draw of the token at position p by (seed, p), so the token is the
    same whether a plain step, a run or any level of a speculative step drew it (the acceptance
    rule's per-position walk, validator_svc.acceptance), and a seed gives the same text with any
    drafts, any plan and with speculation off."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position!r}")
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
        return generator
    generator.manual_seed(_splitmix64(_splitmix64(seed) ^ position))
    return generator


def _splitmix64(value: int) -> int:
    """SplitMix64 finaliser: nearby (seed, position) pairs give unrelated generator seeds."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)
