"""A hung internal service (SIGSTOP: it holds its connections and never answers) on a live stack.

A hung validator or draft pool is treated as a dead one once a call outlasts the deadline drawn
from that RPC's recent latency (gateway.call_deadlines; 2 s here): the breaker opens for every
request (specdec_dependency_available reads 0), greedy requests go on without it with the same
output, and after SIGCONT a probe closes the breaker again. Before, a hung validator stalled a
greedy stream for --rpc_timeout_s (60 s) and then failed it DEADLINE_EXCEEDED; a hung draft pool
held every new request for a minute.

Every stop is undone in a finally block: no test leaves a stopped process behind.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.launcher import DRAFT, GATEWAY, VALIDATOR, Stack, StackConfig
from specdec.v1 import gateway_pb2

pytestmark = pytest.mark.e2e

PROMPT = "List the planets of the solar system, one per line, with one fact about each."
# A stream must end this soon after its service stopped: the call's deadline (2 s) and the rest of
# the request by plain decoding on a shared CPU, far below the 60 s it took before.
MAX_STALL_S = 20.0


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # noqa: ANN001
    config = StackConfig(
        redis_url=redis_server.url, log_dir=tmp_path_factory.mktemp("stack-hangs"), is_serving_metrics=True
    )
    with Stack(config) as started:
        yield started


@contextlib.contextmanager
def stopped(stack: Stack, name: str) -> Iterator[float]:
    """The service's process group stopped (SIGSTOP) within, continued (SIGCONT) however it ends;
    yields when it stopped (time.monotonic)."""
    group = stack.pid(name)  # the service leads its own process group
    os.killpg(group, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.killpg(group, signal.SIGCONT)


def is_available(stack: Stack, dependency: str) -> float:
    with urllib.request.urlopen(stack.metrics_url(GATEWAY), timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "specdec_dependency_available" and sample.labels.get("dependency") == dependency:
                return sample.value
    raise AssertionError(f"no specdec_dependency_available{{dependency={dependency!r}}} on the gateway")


def request(request_id: str, max_new_tokens: int) -> gateway_pb2.GenerateRequest:
    """Greedy, speculative at every step (not adaptive: the controller may choose plain steps)."""
    req = gateway_pb2.GenerateRequest(request_id=request_id, max_new_tokens=max_new_tokens)
    req.speculation.CopyFrom(
        gateway_pb2.SpeculationConfig(strategies=["prompt_lookup", "suffix_index"], is_adaptive=False)
    )
    req.chat.messages.add(role="user", content=PROMPT)
    return req


def wait_until(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    give_up = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < give_up, what
        time.sleep(0.1)


def test_a_hung_validator_is_served_around_and_taken_back(stream_in_background, gateway_stub, stack):
    """SIGSTOP the validator mid-stream: the greedy stream finishes with the undisturbed output within
    seconds (not after 60 s with DEADLINE_EXCEEDED), the gauge reads 0 meanwhile; after SIGCONT the
    breaker closes and a request is validated again."""
    reference = gateway_stub.Generate(request("undisturbed", 200), timeout=300)  # also the latency history
    assert reference.stats.num_validator_fallback_steps == 0
    received, errors, reader = stream_in_background(gateway_stub, request("validator-hung", 200))
    with stopped(stack, VALIDATOR) as since:
        wait_until(lambda: is_available(stack, "validator") == 0, MAX_STALL_S, "the breaker did not open")
        reader.join(timeout=MAX_STALL_S - (time.monotonic() - since))
        stall_s = time.monotonic() - since
        assert not reader.is_alive(), f"the stream still runs {stall_s:.1f} s after the validator stopped"
        assert is_available(stack, "validator") == 0
    assert not errors, errors
    assert received[-1].is_final and received[-1].finish_reason == reference.finish_reason
    assert [t for r in received for t in r.token_ids] == list(reference.token_ids)
    assert "".join(r.text for r in received) == reference.text
    assert received[-1].stats.num_validator_fallback_steps > 0

    attempts = itertools.count()

    def is_validated_again() -> bool:
        after = gateway_stub.Generate(request(f"after-validator-{next(attempts)}", 24), timeout=300)
        assert list(after.token_ids) == list(reference.token_ids[:24])
        return after.stats.num_validator_fallback_steps == 0 and is_available(stack, "validator") == 1

    wait_until(is_validated_again, 60, "the breaker did not close after SIGCONT")


def test_a_hung_draft_pool_leaves_plain_decoding(gateway_stub, stack):
    """SIGSTOP the draft pool: a new request completes by plain decoding with the same text within
    seconds (before: it waited a minute), the gauge reads 0 meanwhile; after SIGCONT the pool drafts
    again."""
    reference = gateway_stub.Generate(request("drafted", 40), timeout=300)  # also the latency history
    assert reference.stats.num_proposed_tokens > 0
    with stopped(stack, DRAFT) as since:
        during = gateway_stub.Generate(request("draft-hung", 40), timeout=MAX_STALL_S)
        assert time.monotonic() - since < MAX_STALL_S
        assert is_available(stack, "draft") == 0
    assert list(during.token_ids) == list(reference.token_ids) and during.text == reference.text
    assert during.stats.num_proposed_tokens == 0

    attempts = itertools.count()

    def drafts_again() -> bool:
        after = gateway_stub.Generate(request(f"after-draft-{next(attempts)}", 40), timeout=300)
        assert list(after.token_ids) == list(reference.token_ids)
        return after.stats.num_proposed_tokens > 0 and is_available(stack, "draft") == 1

    wait_until(drafts_again, 60, "the breaker did not close after SIGCONT")
