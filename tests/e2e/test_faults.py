"""Faults below the public API on a live stack: Redis stalls and internal services that fail.

A Redis blip shorter than the gateway's retry budget changes nothing in a request's output; a longer
outage ends it with UNAVAILABLE (bounded retries, well inside the request's deadline), and the stack
serves again once Redis is back. A failure inside the service reaches the client as INTERNAL or
UNAVAILABLE naming the request, never an internal service, its field names or its details.

The outages stop the module's redis-server (SIGSTOP) rather than kill it: it keeps no data on disk,
so a restarted one would have lost every request. A stopped Redis is what a client of a failing-over
or overloaded one sees: commands time out (this module's gateway gives one 2 s, --state_timeout_s). A
blip lasts until the gateway has seen a write time out (its log says it retries), however slow the
machine. This module's gateway also offers a strategy the draft pool does not load (a deployment
fault), waits only 3 s for a primary that went away and 5 s for a state store that does not answer; its draft pool is
pointed at a feature drafter file that is not there (another deployment fault: the pool serves
without the feature strategy).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from specdec.launcher import DRAFT, GATEWAY, PRIMARY, Stack, StackConfig, service_specs
from specdec.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2

pytestmark = pytest.mark.e2e

PROMPT = "List the planets of the solar system, one per line, with one fact about each."
RETRYING = "state store unavailable; retrying"  # the gateway's log line when a write timed out
INTERNAL_NAMES = ("primary", "draft", "validator", "state_store", "redis", "early_exit")
# The gateway's time for one state store command (5 s by default) and its budget for a store that does
# not answer (30 s by default): over two of the command timeouts, so a blip that ends after the first is
# ridden out; an outage ends sooner than with the defaults.
STATE_TIMEOUT_S = 2
MAX_STATE_RETRY_S = 5


@pytest.fixture(scope="module")
def missing_drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The draft pool's --feature_drafter: a file that is not there."""
    return tmp_path_factory.mktemp("no-drafter") / "missing.safetensors"


@pytest.fixture(scope="module")
def stack(
    redis_server,  # noqa: ANN001 - RedisServer from tests/conftest.py
    tmp_path_factory: pytest.TempPathFactory,
    missing_drafter: Path,
) -> Iterator[Stack]:
    config = StackConfig(redis_url=redis_server.url, log_dir=tmp_path_factory.mktemp("stack-faults"))
    extra_args = {
        GATEWAY: (
            *("--strategies", "prompt_lookup,early_exit", "--recovery_timeout_s", "3"),
            *("--max_state_retry_s", str(MAX_STATE_RETRY_S), "--state_timeout_s", str(STATE_TIMEOUT_S)),
        ),
        DRAFT: ("--feature_drafter", str(missing_drafter)),  # its default strategies name "feature"
    }
    specs = tuple(
        dataclasses.replace(s, command=(*s.command, *extra_args.get(s.name, ()))) for s in service_specs(config)
    )
    with Stack(config, specs=specs) as started:
        yield started


def _request(request_id: str, max_new_tokens: int = 48) -> gateway_pb2.GenerateRequest:
    """Greedy, speculative with the strategies the pool has (the gateway's default list does not fit it)."""
    req = gateway_pb2.GenerateRequest(request_id=request_id, max_new_tokens=max_new_tokens)
    req.speculation.strategies.extend(["prompt_lookup", "suffix_index"])
    req.chat.messages.add(role="user", content=PROMPT)
    return req


def _assert_names_only_the_request(error: grpc.RpcError, request_id: str) -> None:
    details = error.details()
    assert f"'{request_id}'" in details, details
    rest = details.replace(f"'{request_id}'", "").lower()
    assert not any(name in rest for name in INTERNAL_NAMES), details


def test_a_redis_blip_mid_request_changes_nothing_in_the_output(
    stream_in_background, gateway_stub, redis_server, stack
):
    """Redis stalls mid-stream until a write has timed out (STATE_TIMEOUT_S), then comes back within the retry
    budget (--max_state_retry_s from the write's start): the write is retried and succeeds (before,
    the request failed at that step with UNAVAILABLE, which also ends the stall here)."""
    reference = gateway_stub.Generate(_request("undisturbed"), timeout=300)
    gateway_log = stack.log_path(GATEWAY)
    num_retries_before = gateway_log.read_text().count(RETRYING)
    received, errors, reader = stream_in_background(gateway_stub, _request("blip"))
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        give_up = time.monotonic() + 120
        while (
            gateway_log.read_text().count(RETRYING) == num_retries_before
            and reader.is_alive()
            and time.monotonic() < give_up
        ):
            time.sleep(0.05)
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    reader.join(timeout=300)
    assert not errors, errors
    assert received[-1].is_final and received[-1].finish_reason == reference.finish_reason
    assert [t for r in received for t in r.token_ids] == list(reference.token_ids)
    assert "".join(r.text for r in received) == reference.text
    state = gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="blip"), timeout=30)
    assert state.status == gateway_pb2.REQUEST_STATUS_FINISHED and list(state.token_ids) == list(reference.token_ids)
    assert gateway_log.read_text().count(RETRYING) > num_retries_before, "the blip missed the request"


def test_a_redis_outage_ends_the_request_unavailable_within_its_deadline(
    stream_in_background, gateway_stub, redis_server
):
    """Redis stays stopped until the client has its answer: UNAVAILABLE naming the request after the
    bounded retries (endless retries would end in DEADLINE_EXCEEDED at the client's 300 s), not the
    store's details; once Redis is back the stack serves again."""
    # Plain decoding: a speculative stream of a prompt the suffix index has seen in this module can
    # finish its 200 tokens between the first message and the stop.
    outage = _request("outage", max_new_tokens=200)
    outage.speculation.is_enabled = False
    received, errors, reader = stream_in_background(gateway_stub, outage)
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        reader.join(timeout=300)
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    assert not reader.is_alive()
    assert len(errors) == 1 and not received[-1].is_final, received[-1]
    assert errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors[0]
    _assert_names_only_the_request(errors[0], "outage")
    after = gateway_stub.Generate(_request("after-outage", max_new_tokens=8), timeout=300)
    assert after.finish_reason == gateway_pb2.FINISH_REASON_LENGTH and len(after.token_ids) == 8


def test_a_redis_outage_outside_a_running_request_names_only_the_request(gateway_stub, redis_server):
    """Starting a request, GetRequest and Cancel while Redis is stopped: UNAVAILABLE naming the
    request, not the store (before: `state_store: Redis unreachable: ...`)."""
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        calls = {
            "starting": lambda: gateway_stub.Generate(_request("starting", max_new_tokens=8), timeout=120),
            "undisturbed": lambda: gateway_stub.GetRequest(
                gateway_pb2.GetRequestRequest(request_id="undisturbed"), timeout=120
            ),
            "blip": lambda: gateway_stub.Cancel(gateway_pb2.CancelRequest(request_id="blip"), timeout=120),
        }
        for request_id, call in calls.items():
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value
            _assert_names_only_the_request(raised.value, request_id)
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)


def test_an_internal_services_refusal_reaches_the_client_as_internal(gateway_stub, stack):
    """The gateway's default strategies name one the pool did not load, so the pool refuses the
    request's Propose with INVALID_ARGUMENT. The client cannot fix that: INTERNAL naming the request
    (before: INVALID_ARGUMENT "draft: strategies: 'early_exit' is not one of this pool's ..."); the
    details are in the gateway's log."""
    req = gateway_pb2.GenerateRequest(
        request_id="misconfigured",
        max_new_tokens=8,
        speculation=gateway_pb2.SpeculationConfig(is_adaptive=False, speculative_degree=2),
    )
    req.chat.messages.add(role="user", content=PROMPT)
    with pytest.raises(grpc.RpcError) as e:
        gateway_stub.Generate(req, timeout=300)
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value
    _assert_names_only_the_request(e.value, "misconfigured")
    assert "early_exit" in stack.log_path(GATEWAY).read_text()
    state = gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="misconfigured"), timeout=30)
    assert state.status == gateway_pb2.REQUEST_STATUS_FAILED


def test_a_strategy_whose_drafter_file_is_missing_is_refused_naming_the_strategy_and_the_file(
    gateway_stub, stack, missing_drafter
):
    """A request naming "feature" gets INVALID_ARGUMENT naming the field and the strategy before anything
    runs (the gateway asks the pool what it serves: GetPoolInfo lists what it serves, not why the rest
    is missing, so the client is not told of the file); the pool's own refusal, and its start-up log,
    name the missing file for the operator."""
    req = gateway_pb2.GenerateRequest(request_id="no-drafter", max_new_tokens=8)
    req.speculation.strategies.extend(["prompt_lookup", "feature"])
    req.chat.messages.add(role="user", content=PROMPT)
    with pytest.raises(grpc.RpcError) as e:
        gateway_stub.Generate(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "speculation.strategies" in e.value.details() and "'feature'" in e.value.details(), e.value.details()
    with stack.channel(DRAFT) as channel:
        with pytest.raises(grpc.RpcError) as e:
            draft_pb2_grpc.DraftServiceStub(channel).Propose(
                draft_pb2.ProposeRequest(
                    request_id="no-drafter-probe", prompt_token_ids=[1, 2, 3], strategies=["feature"]
                ),
                timeout=60,
            )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "'feature'" in e.value.details() and str(missing_drafter) in e.value.details(), e.value.details()
    log = stack.log_path(DRAFT).read_text()
    assert "feature_drafter_unavailable" in log and str(missing_drafter) in log
    # the others still serve
    assert gateway_stub.Generate(_request("with-drafter-missing", max_new_tokens=8), timeout=300).token_ids


def test_a_primary_that_stays_away_reaches_the_client_as_unavailable(stream_in_background, gateway_stub, stack):
    """kill -9 the primary mid-stream and leave it down past the gateway's 3 s recovery wait:
    UNAVAILABLE naming the request (before: "primary: failed to connect to all addresses; ...").
    Last in the module: the primary stays down."""
    received, errors, reader = stream_in_background(gateway_stub, _request("primary-gone", max_new_tokens=200))
    stack.kill(PRIMARY)
    reader.join(timeout=300)
    assert not reader.is_alive() and len(errors) == 1, received[-1]
    assert errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors[0]
    _assert_names_only_the_request(errors[0], "primary-gone")
