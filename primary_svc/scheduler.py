"""The primary's scheduling policy: what one engine step runs. Pure bookkeeping, no model.

The engine thread (primary_svc.worker) keeps two queues and asks this policy, once per step,
which work goes into the step:

- verify entries: the pending Verify/Decode work of running requests (one per request), in
  arrival order; each is `num_rows` rows (chain + tree) and may need `kv_growth_bytes` more KV;
- waiting entries: prefills (new requests, and preempted ones that re-prefill from their committed
  tokens), FIFO, a preempted request at the front.

A step has a budget of `max_step_tokens` rows. Verify rows go first, in arrival order, while they
fit (the first one always does: a step never runs empty). The rest of the budget goes to prefill
chunks of the waiting requests in FIFO order, at most one chunk of at most `prefill_chunk_tokens`
rows per request per step, so a long prompt is prefilled over several steps while the running
requests keep decoding, and several prompts advance in the same step.

Chunks and exactness: where the model's results do not depend on where a prompt is cut (row-exact
kernels and attention), a chunk may be any size that fits what is left of the budget
(`is_chunk_splittable`). Otherwise a chunk is always the whole `prefill_chunk_tokens` (or the rest of
the prompt), cut at the same positions as an uninterrupted prefill, so the cache holds the same bits;
a chunk that does not fit waits for a later step.

No starvation: a waiting request that could have run but was passed over (its whole chunk did not
fit, or verify rows took the budget) `max_skipped_steps` steps in a row gets its chunk in the next step
even past the budget. Admission is FIFO with head-of-line blocking: a request is admitted (its KV
allocated) only when its whole prompt fits the free KV bytes, and no later request is admitted before
it, so small prompts cannot starve a large one.

Shared prefixes: a new prompt that begins like a prompt being prefilled in this step (whole blocks
of the prefix cache, the same tenant) sits the step out (`held`, chosen by the engine thread), and
at its admission a step later the prefix cache hands it those rows: a burst of requests with one
system prompt computes it once, not once per request (SGLang's cache-aware scheduling). A request
is held at most a few steps in all, so a leader that does not get its chunk cannot starve it.

Preemption: when the running requests' verify rows need more KV than is free, `choose_victims` picks
requests to release, newest admitted first (as vLLM): they lose their KV and re-prefill later from
their committed tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Sequence

DEFAULT_MAX_STEP_TOKENS = 1024
DEFAULT_PREFILL_CHUNK_TOKENS = 512  # = Engine.prefill's chunk: fp32 caches keep the bits they had before
DEFAULT_MAX_SKIPPED_STEPS = 4


@dataclasses.dataclass(slots=True)
class VerifyEntry:
    request_id: str
    num_rows: int  # chain + tree rows this verify runs
    kv_growth_bytes: int = 0  # KV bytes its slot must grow by to hold them


@dataclasses.dataclass(slots=True)
class WaitingEntry:
    request_id: str
    num_remaining: int  # tokens still to prefill
    kv_bytes_to_admit: int  # KV bytes its slot takes when admitted
    is_admitted: bool = False  # holds its KV slot (prefill under way)
    num_skipped_steps: int = 0  # steps in a row it could have run but did not (the policy counts)


@dataclasses.dataclass(slots=True)
class RunningEntry:
    request_id: str
    admitted_seq: int  # admission order: larger is newer
    kv_bytes: int  # what releasing it frees
    kv_growth_bytes: int = 0  # what its verify in this step needs (0 when it has none)


@dataclasses.dataclass(slots=True)
class StepPlan:
    verify_ids: list[str]  # in arrival order
    prefill_chunks: list[tuple[str, int]]  # (request_id, tokens) in FIFO order
    admit_ids: list[str]  # waiting requests to admit (allocate KV) before the step
    num_verify_rows: int = 0
    kv_shortfall_bytes: int = 0  # verify growth beyond the free KV: preempt this much

    @property
    def num_prefill_rows(self) -> int:
        return sum(n for _, n in self.prefill_chunks)


class SchedulerPolicy:
    def __init__(
        self,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        is_chunk_splittable: bool = False,
        max_skipped_steps: int = DEFAULT_MAX_SKIPPED_STEPS,
        max_verify_items: int | None = None,
    ) -> None:
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        if not 1 <= prefill_chunk_tokens <= max_step_tokens:
            raise ValueError(
                f"need 1 <= prefill_chunk_tokens <= max_step_tokens, got {prefill_chunk_tokens}, {max_step_tokens}"
            )
        if max_skipped_steps < 0:
            raise ValueError(f"max_skipped_steps must be >= 0, got {max_skipped_steps}")
        self.max_step_tokens, self.prefill_chunk_tokens = max_step_tokens, prefill_chunk_tokens
        self.is_chunk_splittable, self.max_skipped_steps = is_chunk_splittable, max_skipped_steps
        self.max_verify_items = max_verify_items

    def plan(
        self,
        verifies: Sequence[VerifyEntry],
        waiting: Sequence[WaitingEntry],
        kv_free_bytes: int | None,
        held: Collection[str] = frozenset(),
    ) -> StepPlan:
        """The next step. `kv_free_bytes` None: no KV budget. Updates waiting entries' num_skipped_steps.
        `held`: waiting requests not yet admitted that sit this step out (see "Shared prefixes"): they
        are neither admitted nor counted as skipped, and they hold up no one behind them."""
        verify_ids: list[str] = []
        rows, growth, seen = 0, 0, set()
        for v in verifies:
            if v.request_id in seen:
                continue
            if self.max_verify_items is not None and len(verify_ids) >= self.max_verify_items:
                break
            if verify_ids and rows + v.num_rows > self.max_step_tokens:
                break
            verify_ids.append(v.request_id)
            seen.add(v.request_id)
            rows += v.num_rows
            growth += v.kv_growth_bytes
        plan = StepPlan(verify_ids, [], [], num_verify_rows=rows)
        free = None if kv_free_bytes is None else kv_free_bytes - growth
        if free is not None and free < 0:
            plan.kv_shortfall_bytes = -free
        budget = self.max_step_tokens - rows
        is_admitting = True
        for w in waiting:
            if not w.is_admitted and w.request_id in held:
                continue
            if not w.is_admitted:
                if not is_admitting or (free is not None and w.kv_bytes_to_admit > free):
                    is_admitting = False  # head-of-line: nobody behind it is admitted first
                    continue
                if free is not None:
                    free -= w.kv_bytes_to_admit
                plan.admit_ids.append(w.request_id)
            whole = min(w.num_remaining, self.prefill_chunk_tokens)
            chunk = min(whole, budget) if self.is_chunk_splittable else (whole if whole <= budget else 0)
            if chunk == 0 and whole > 0 and w.num_skipped_steps >= self.max_skipped_steps:
                chunk = whole  # starved long enough: runs past the budget
            if chunk == 0 and whole > 0:
                w.num_skipped_steps += 1
                continue
            w.num_skipped_steps = 0
            budget -= chunk
            plan.prefill_chunks.append((w.request_id, chunk))
        return plan


def choose_victims(running: Sequence[RunningEntry], shortfall_bytes: int) -> list[str]:
    """Requests to release, newest admitted first, until their freed KV (and the growth their own
    verifies no longer need) covers `shortfall_bytes`; all of them if even that is not enough."""
    victims = []
    for r in sorted(running, key=lambda r: r.admitted_seq, reverse=True):
        if shortfall_bytes <= 0:
            break
        victims.append(r.request_id)
        shortfall_bytes -= r.kv_bytes + r.kv_growth_bytes
    return victims
