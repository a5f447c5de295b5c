"""The OpenAI-compatible HTTP API on a live stack, through the official clients: the `openai`
Python package (every endpoint, streaming and not, structured output, stop strings, seeds,
usage against the gRPC answer, an error per HTTP status as the SDK's typed exception) and the
`openai` npm package from Node. Greedy output over HTTP is the gRPC output token for token; a
client that disconnects mid-stream cancels its request and frees its KV cache.

Statuses that the module's stack cannot show are shown by extra HTTP fronts (real processes):
one with API keys (401), one pointed at a closed port (503), one with a short deadline (504),
and one in front of a second gateway that gives schemas no time to compile (429); that front
serves HTTPS, reaches its gateway over TLS and forwards the caller's key to it (the gateway has
the keys: requests belong to the key's tenant)."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from specdec.service.api_keys import key_hash, new_key
from specdec.launcher import DRAFT, PRIMARY, VALIDATOR, ServiceSpec, Stack, StackConfig, free_port
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, primary_pb2, primary_pb2_grpc
from tests.e2e.disconnecting_client import first_chunk_then_disconnect

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
NODE_DIR = Path(__file__).resolve().parents[1] / "node"
PROMPT = "List three colours of the rainbow."
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
API_KEY = new_key()
STACK_OPTIONS = {"is_serving_http": True}  # the module's stack (tests/e2e/conftest.py) serves HTTP too


def _grpc_chat(stub, content: str, max_new_tokens: int) -> gateway_pb2.GenerateResponse:
    req = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
    req.chat.messages.add(role="user", content=content)
    return stub.Generate(req, timeout=600)


def _ask(client: openai.OpenAI, content: str, **kwargs: Any) -> Any:
    """One user message to MODEL over the OpenAI API; kwargs are create()'s."""
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


# ---- answers ---------------------------------------------------------------------------------------


def test_models_health_and_metrics(client: openai.OpenAI, stack: Stack):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = _get(f"{stack.http_url}/health")
    assert health == (200, {"status": "ok", "gateway": "SERVING"})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    status, text = _get(f"{stack.http_url}/metrics", is_json=False)
    assert status == 200
    assert 'specdec_http_requests_total{endpoint="/v1/chat/completions",status="200"}' in text


def test_greedy_chat_over_http_is_the_grpc_output_token_for_token(client: openai.OpenAI, gateway_stub):
    reference = _grpc_chat(gateway_stub, PROMPT, 24)
    answer = _ask(client, PROMPT, max_completion_tokens=24, temperature=0, extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    assert choice.token_ids == list(reference.token_ids)
    assert choice.message.content == reference.text and choice.message.role == "assistant"
    assert answer.id.startswith("chatcmpl-") and answer.object == "chat.completion" and answer.model == MODEL
    assert answer.usage.prompt_tokens == reference.stats.num_prompt_tokens
    assert answer.usage.completion_tokens == reference.stats.num_generated_tokens == len(reference.token_ids)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    # the same prompt again: the primary's prefix cache holds at least what it held for the reference
    assert answer.usage.prompt_tokens_details.cached_tokens >= reference.stats.num_cached_prompt_tokens
    speculation = answer.usage.model_extra["speculation"]
    assert set(speculation) == {
        "proposed_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_accepted_length",
        "num_steps",
    }
    assert speculation["accepted_tokens"] <= speculation["proposed_tokens"]
    assert speculation["mean_accepted_length"] >= 1.0

    chunks = list(
        _ask(
            client,
            PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    token_ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert text == reference.text and token_ids == list(reference.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)
    assert chunks[-1].usage.prompt_tokens == reference.stats.num_prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_streamed_and_not(client: openai.OpenAI, gateway_stub):
    prompt = "The three primary colours are"
    reference = gateway_stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=12), timeout=600)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert answer.object == "text_completion" and answer.choices[0].text == reference.text
    assert answer.usage.prompt_tokens == reference.stats.num_prompt_tokens
    assert answer.usage.completion_tokens == reference.stats.num_generated_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reference.text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


def test_json_schema_output_validates(client: openai.OpenAI):
    answer = _ask(
        client,
        "Describe a person as JSON.",
        max_tokens=60,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": PERSON_SCHEMA},
        },
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON_SCHEMA)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": [{"type": "text", "text": "Give the name and hex code of one colour."}]},
        ],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content  # not cut mid-object
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_stop_strings(client: openai.OpenAI):
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    assert "4" in text
    for stop in ("4", ["4", "never-produced"]):
        cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=stop)
        assert cut.choices[0].message.content == text[: text.index("4")]
        assert cut.choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_answer(client: openai.OpenAI):
    def sample(seed: int) -> str:
        return (
            _ask(client, "Name an animal.", max_tokens=16, temperature=1.0, top_p=0.95, seed=seed, user="tester")
            .choices[0]
            .message.content
        )

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_n_choices_are_each_the_answer_of_their_own_seed_streamed_or_not(client: openai.OpenAI):
    sampling = {"max_tokens": 16, "temperature": 1.0, "seed": 21}
    answer = _ask(client, "Name an animal.", n=3, **sampling)
    texts = [c.message.content for c in sorted(answer.choices, key=lambda c: c.index)]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for j, text in enumerate(texts):  # choice j samples with seed + j
        alone = _ask(client, "Name an animal.", **{**sampling, "seed": 21 + j})
        assert alone.choices[0].message.content == text
        if j == 0:
            assert answer.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counts once
    stream = _ask(client, "Name an animal.", n=3, stream=True, stream_options={"include_usage": True}, **sampling)
    streamed, usage = ["", "", ""], None
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert streamed == texts
    assert usage is not None and usage.completion_tokens == answer.usage.completion_tokens
    greedy = _ask(client, "Name an animal.", n=2, max_tokens=12, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_ignore_eos_runs_to_max_tokens_and_stop_token_ids_end_the_output(client: openai.OpenAI, gateway_stub):
    def grpc_answer(**fields: Any) -> gateway_pb2.GenerateResponse:
        req = gateway_pb2.GenerateRequest(max_new_tokens=40, **fields)
        req.chat.messages.add(role="user", content="Say hi.")
        return gateway_stub.Generate(req, timeout=600)

    ended = grpc_answer()
    assert ended.finish_reason == gateway_pb2.FINISH_REASON_EOS and len(ended.token_ids) < 40
    eos = set(gateway_stub.DescribeModel(gateway_pb2.DescribeModelRequest(), timeout=60).eos_token_ids)
    plain = grpc_answer(ignore_eos=True, speculation=gateway_pb2.SpeculationConfig(is_enabled=False))
    assert plain.finish_reason == gateway_pb2.FINISH_REASON_LENGTH and len(plain.token_ids) == 40
    assert list(plain.token_ids[: len(ended.token_ids)]) == list(ended.token_ids)
    assert plain.token_ids[len(ended.token_ids)] in eos  # the end token is output like any other
    speculated = grpc_answer(ignore_eos=True)  # speculation at the service's defaults
    assert list(speculated.token_ids) == list(plain.token_ids)
    stop_id = ended.token_ids[2]
    stopped = grpc_answer(stop_token_ids=[stop_id])
    assert stopped.finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert list(stopped.token_ids) == list(ended.token_ids[: list(ended.token_ids).index(stop_id)])
    over_http = _ask(client, "Say hi.", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert over_http.usage.completion_tokens == 40 and over_http.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, "Say hi.", max_tokens=4, extra_body={"stop_token_ids": [10**8]})
    assert e.value.body["param"] == "stop_token_ids"


def test_min_tokens_holds_back_the_end_until_that_many_tokens_exactly(client: openai.OpenAI, gateway_stub):
    def grpc_answer(min_tokens: int, is_speculative: bool = True) -> gateway_pb2.GenerateResponse:
        req = gateway_pb2.GenerateRequest(max_new_tokens=40, sampling=common_pb2.SamplingParams(min_tokens=min_tokens))
        req.chat.messages.add(role="user", content="Say hi.")
        req.speculation.is_enabled = is_speculative
        return gateway_stub.Generate(req, timeout=600)

    ended = grpc_answer(0)
    length = len(ended.token_ids)
    assert ended.finish_reason == gateway_pb2.FINISH_REASON_EOS and length < 30
    assert list(grpc_answer(length).token_ids) == list(ended.token_ids)  # its end comes at token `length`
    held = grpc_answer(length + 1)  # that end is held back: the output goes on
    assert len(held.token_ids) > length and list(held.token_ids[:length]) == list(ended.token_ids)
    longer = grpc_answer(length + 8, is_speculative=False)
    assert len(longer.token_ids) >= length + 8
    assert list(grpc_answer(length + 8).token_ids) == list(longer.token_ids)  # speculation changes nothing
    over_http = _ask(client, "Say hi.", max_tokens=40, temperature=0, extra_body={"min_tokens": length + 8})
    assert over_http.usage.completion_tokens == len(longer.token_ids)
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, "Say hi.", max_tokens=4, extra_body={"min_tokens": 5})
    assert e.value.body["param"] == "min_tokens"


def test_min_tokens_holds_back_a_stop_string_as_vllm_does(client: openai.OpenAI, gateway_stub):
    """A stop string in the first min_tokens tokens does not end the output (before, it did, though
    min_tokens held back the end tokens): the output runs to the stop string's next occurrence."""

    def grpc_answer(min_tokens: int, stop: tuple[str, ...] = (), is_speculative: bool = True):
        req = gateway_pb2.GenerateRequest(max_new_tokens=48, sampling=common_pb2.SamplingParams(min_tokens=min_tokens))
        req.stop.extend(stop)
        req.chat.messages.add(role="user", content=PROMPT)
        req.speculation.is_enabled = is_speculative
        return gateway_stub.Generate(req, timeout=600)

    free = grpc_answer(0)
    stop = " "  # the answer's first space
    assert free.text.count(stop) >= 2, free.text
    cut = grpc_answer(0, (stop,))
    assert cut.finish_reason == gateway_pb2.FINISH_REASON_STOP and cut.text == free.text[: free.text.index(stop)]
    # min_tokens past that first space: the output goes on to a space that ends past them
    min_tokens = len(cut.token_ids) + 2
    plain = grpc_answer(min_tokens, (stop,), is_speculative=False)
    assert plain.finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert len(plain.token_ids) > min_tokens  # the token completing it comes after the first min_tokens
    assert list(plain.token_ids) == list(free.token_ids[: len(plain.token_ids)])
    assert free.text.startswith(plain.text + stop) and len(plain.text) > len(cut.text)
    speculative = grpc_answer(min_tokens, (stop,))
    assert list(speculative.token_ids) == list(plain.token_ids) and speculative.text == plain.text
    over_http = _ask(client, PROMPT, max_tokens=48, temperature=0, stop=[stop], extra_body={"min_tokens": min_tokens})
    assert over_http.choices[0].message.content == plain.text


def test_speculation_settings_ride_as_extra_body_fields(client: openai.OpenAI, gateway_stub):
    reference = _grpc_chat(gateway_stub, PROMPT, 20)
    answer = _ask(client, PROMPT, max_tokens=20, temperature=0, extra_body={"speculative_decoding": False})
    assert answer.choices[0].message.content == reference.text
    assert answer.usage.model_extra["speculation"]["proposed_tokens"] == 0
    answer = _ask(
        client,
        PROMPT,
        max_tokens=20,
        temperature=0,
        extra_body={
            "speculative_degree": 2,
            "draft_length": 4,
            "acceptance_threshold": 0.0,
            "strategies": ["prompt_lookup"],
            "adaptive": False,
        },
    )
    assert answer.choices[0].message.content == reference.text


# ---- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"seed": -1}, "seed"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": []}, "messages"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"speculative_degree": 1000}, "speculative_degree"),
        ({"draft_length": 1000}, "draft_length"),
        ({"acceptance_threshold": 2}, "acceptance_threshold"),
        ({"strategies": ["telepathy"]}, "strategies"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"temperature": 3}, "temperature"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 2}, "min_p"),
        ({"logit_bias": {"1000000": 5}}, "logit_bias"),  # past the vocabulary: the gateway's check
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(client: openai.OpenAI, extra: dict, param: str):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body=body, cast_to=object)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert e.value.body["message"].startswith(f"{param}: ")


def test_a_bad_prompt_or_body_is_a_400(client: openai.OpenAI, stack: Stack):
    for prompt in ("   ", [], ["a", "   "]):  # token ids and lists of prompts are prompts (test_logprobs)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert e.value.body["param"] == "prompt"
    for body in (b"{not json", b"[1, 2]"):
        status, answer = _post(f"{stack.http_url}/v1/chat/completions", body)
        assert status == 400 and answer["error"]["param"] is None and "JSON" in answer["error"]["message"]


def test_an_unknown_model_is_a_404(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_an_oversize_body_is_a_413(client: openai.OpenAI):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="x" * (5 << 20), max_tokens=1)
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"


def test_a_client_that_disconnects_mid_stream_cancels_its_request(stack: Stack, gateway_stub):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a ship."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    request_id = first_chunk_then_disconnect(stack.http_url, body)["id"]
    give_up = time.monotonic() + 120
    while True:
        state = gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=request_id), timeout=10)
        if (state.status != gateway_pb2.REQUEST_STATUS_RUNNING and _kv_bytes(stack) == 0) or time.monotonic() > give_up:
            break
        time.sleep(0.2)
    assert state.status == gateway_pb2.REQUEST_STATUS_CANCELLED, state
    assert state.finish_reason == gateway_pb2.FINISH_REASON_CANCELLED
    assert len(state.token_ids) < 400 and _kv_bytes(stack) == 0


def test_a_client_that_disconnects_before_a_whole_answer_cancels_its_request(stack: Stack):
    host, port = stack.http_url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write a long story about a ship."}],
            "max_tokens": 400,
            "temperature": 0,
        }
    ).encode()
    with socket.create_connection((host, int(port)), timeout=300) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        give_up = time.monotonic() + 120
        while _metric(stack, "specdec_http_active_requests") < 1 and time.monotonic() < give_up:
            time.sleep(0.05)
        while _kv_bytes(stack) == 0 and time.monotonic() < give_up:  # prefilled: the request holds KV
            time.sleep(0.05)
    give_up = time.monotonic() + 120
    while (
        _metric(stack, "specdec_http_client_disconnects_total") < 1 or _kv_bytes(stack) != 0
    ) and time.monotonic() < give_up:
        time.sleep(0.2)
    assert _metric(stack, "specdec_http_client_disconnects_total") >= 1 and _kv_bytes(stack) == 0


# ---- statuses shown by extra fronts -------------------------------------------------------------------


@pytest.fixture(scope="module")
def fronts(
    stack: Stack, certificate: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """Extra HTTP fronts (and one extra gateway) as real processes: name -> base URL with /v1."""
    folder = tmp_path_factory.mktemp("http-fronts")
    cert, key = (str(path) for path in certificate)
    tls = ("--tls_cert", cert, "--tls_key", key)
    keys_file = folder / "api_keys"
    keys_file.write_text(f"tester {key_hash(API_KEY)}\n")
    token_file = folder / "service_token"
    token_file.write_text(stack.service_token)
    token_file.chmod(0o600)
    py, gateway = sys.executable, stack.gateway_address
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    quick_gateway = ServiceSpec(
        "gateway-quick",
        (
            py,
            "-m",
            "gateway",
            "--primary_address",
            stack.addresses[PRIMARY],
            "--draft_address",
            stack.addresses[DRAFT],
            "--validator_address",
            stack.addresses[VALIDATOR],
            "--redis_url=",
            "--logits_via_handle",
            "--max_grammar_compile_s",
            "0.001",
            "--max_active_requests",
            "1",
            "--max_queued_requests",
            "0",
            "--service_token_file",
            str(token_file),
            "--api_keys_file",
            str(keys_file),
            *tls,
        ),
        health_service="specdec.v1.GenerationService",
        health_ca_file=cert,
    )
    specs = [
        ServiceSpec(
            "http-keys",
            (py, "-m", "http_svc", "--gateway_address", gateway, "--api_keys_file", str(keys_file)),
            health_http_path="/health",
        ),
        ServiceSpec("http-dead", (py, "-m", "http_svc", "--gateway_address", dead), health_http_path="/v1/models"),
        ServiceSpec(
            "http-deadline",
            (py, "-m", "http_svc", "--gateway_address", gateway, "--request_timeout_s", "1"),
            health_http_path="/health",
        ),
        quick_gateway,
        ServiceSpec(
            "http-quick",
            (py, "-m", "http_svc", "--gateway_ca_file", cert, *tls),
            depends_on=("gateway-quick",),
            address_flags=(("--gateway_address", "gateway-quick"),),
            health_http_path="/health",
            health_ca_file=cert,
        ),
    ]
    with Stack(StackConfig(log_dir=folder), specs=specs) as extra:
        yield {
            name: f"{'https' if name == 'http-quick' else 'http'}://{address}/v1"
            for name, address in extra.addresses.items()
        }


def test_a_front_without_keys_answers_only_a_loopback_or_allowed_host(fronts: dict[str, str]):
    """DNS rebinding (http_svc.allowed_hosts) through a real server: a page whose site's name now
    resolves to 127.0.0.1 sends that name as Host and gets a 403 it cannot use; local clients'
    hosts are answered; a front with keys answers any Host (its 401 without a key)."""
    dead = fronts["http-dead"]  # no keys; /v1/models answers without a gateway
    port = dead.rsplit(":", 1)[1].split("/")[0]
    status, body = _get_as(f"{dead}/models", f"attacker.example:{port}")
    assert status == 403 and body["error"]["code"] == "host_not_allowed"
    assert f"attacker.example:{port}" in body["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert _get_as(f"{dead}/models", host)[0] == 200, host
    assert _get_as(f"{fronts['http-keys']}/models", "attacker.example")[0] == 401


def test_a_missing_or_wrong_key_is_a_401(fronts: dict[str, str]):
    client = openai.OpenAI(base_url=fronts["http-keys"], api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert e.value.body["type"] == "authentication_error" and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # Without any key (the SDK always sends one).
    assert _get(f"{fronts['http-keys']}/models")[0] == 401
    assert (
        _post(
            f"{fronts['http-keys']}/chat/completions",
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}).encode(),
        )[0]
        == 401
    )
    client = openai.OpenAI(base_url=fronts["http-keys"], api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert answer.usage.completion_tokens == 2


def test_a_gateway_that_cannot_be_reached_is_a_503(fronts: dict[str, str]):
    client = openai.OpenAI(base_url=fronts["http-dead"], api_key="unused", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=stream
            )
        assert e.value.status_code == 503 and e.value.body["code"] == "service_unavailable"
    assert _get(fronts["http-dead"].removesuffix("/v1") + "/health")[0] == 503


def test_a_deadline_is_a_504(fronts: dict[str, str]):
    """The front's 1 s deadline passes mid-generation. The essay runs to the context's end (4,058
    tokens here, about 30 s); 400 tokens could be done within the second on a fast CPU."""
    client = openai.OpenAI(base_url=fronts["http-deadline"], api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(
            model=MODEL,
            max_tokens=8000,
            temperature=0,
            messages=[{"role": "user", "content": "Write a long essay about bridges."}],
        )
    assert e.value.status_code == 504 and e.value.body["type"] == "timeout_error"


def test_no_capacity_is_a_429_with_retry_after(fronts: dict[str, str], certificate: tuple[Path, Path]):
    """The second gateway gives a schema 1 ms to compile: RESOURCE_EXHAUSTED, as a full admission
    queue would answer. Over HTTPS to a front that reaches that gateway over TLS."""
    client = _tls_client(fronts, certificate, API_KEY)
    plaintext = openai.OpenAI(
        base_url=fronts["http-quick"].replace("https://", "http://"), api_key=API_KEY, max_retries=0
    )
    with pytest.raises(openai.APIConnectionError):
        plaintext.models.list()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 17}}, "required": ["city"]}
    with pytest.raises(openai.RateLimitError) as e:
        _ask(
            client,
            "A city?",
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        )
    assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.body["type"] == "rate_limit_error" and e.value.body["code"] == "rate_limit_exceeded"


def test_a_full_admission_queue_is_a_429_with_retry_after(fronts: dict[str, str], certificate: tuple[Path, Path]):
    """The second gateway admits one request and queues none: while a stream holds its slot, the
    next request is turned away (RESOURCE_EXHAUSTED with retry-after-ms) and the front says 429 with
    Retry-After; once the stream is closed the slot is free again."""
    client = _tls_client(fronts, certificate, API_KEY)
    messages = [{"role": "user", "content": "Write a long essay about bridges."}]
    # Up to the context's end: the holder must still be running when the next request comes.
    holder = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8000, temperature=0, stream=True)
    try:
        next(iter(holder))  # admitted and generating
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
    finally:
        holder.close()  # the front cancels the call: the slot frees
    give_up = time.monotonic() + 120
    while True:
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < give_up, "the slot was never released"
            time.sleep(0.2)


def test_the_key_is_forwarded_to_the_gateway(fronts: dict[str, str], certificate: tuple[Path, Path]):
    """http-quick checks no key itself: its gateway does, from the forwarded Authorization header."""
    with pytest.raises(openai.AuthenticationError) as e:
        _tls_client(fronts, certificate, "not-a-key").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert e.value.body["code"] == "invalid_api_key"
    answer = _tls_client(fronts, certificate, API_KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert answer.usage.completion_tokens == 2
    address = fronts["gateway-quick"].removeprefix("http://").removesuffix("/v1")
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate[0].read_bytes())
    with grpc.secure_channel(address, credentials) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        state = stub.GetRequest(
            gateway_pb2.GetRequestRequest(request_id=answer.id),
            timeout=30,
            metadata=(("authorization", f"Bearer {API_KEY}"),),
        )
        assert state.status == gateway_pb2.REQUEST_STATUS_FINISHED and len(state.token_ids) == 2
        with pytest.raises(grpc.RpcError) as rpc:
            stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=answer.id), timeout=30)
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _tls_client(fronts: dict[str, str], certificate: tuple[Path, Path], key: str) -> openai.OpenAI:
    trusted = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(certificate[0])))
    return openai.OpenAI(base_url=fronts["http-quick"], api_key=key, max_retries=0, http_client=trusted)


# ---- Node ------------------------------------------------------------------------------------------------


def test_the_node_openai_package_streams_a_chat_completion(stack: Stack, client: openai.OpenAI):
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "openai").is_dir():
        pytest.skip("node or tests/node dependencies missing (`make test` installs them)")
    prompt = "Name two planets."
    reference = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0
    )
    out = subprocess.run(
        [node, str(NODE_DIR / "openai_stream.js"), f"{stack.http_url}/v1", MODEL, prompt, "12"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    chunks = [json.loads(line) for line in out.stdout.splitlines()]
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        == reference.choices[0].message.content
    )
    assert chunks[-1]["usage"]["completion_tokens"] == reference.usage.completion_tokens


# ---- helpers ---------------------------------------------------------------------------------------------


def _get(url: str, is_json: bool = True) -> tuple[int, object]:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=30) as response:
            body = response.read().decode()
            return response.status, json.loads(body) if is_json else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode()) if is_json else ""


def _get_as(url: str, host: str) -> tuple[int, dict]:
    """GET url with `host` as its Host header, as a browser sends it for the name it resolved."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", parts.path, headers={"Host": host})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _post(url: str, body: bytes) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(stack: Stack, name: str) -> float:
    """A sample without labels from the front's /metrics."""
    _, text = _get(f"{stack.http_url}/metrics", is_json=False)
    return next((float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == name), 0.0)


def _kv_bytes(stack: Stack) -> int:
    with stack.channel(PRIMARY) as channel:
        return primary_pb2_grpc.PrimaryServiceStub(channel).GetStats(primary_pb2.GetStatsRequest(), timeout=30).kv_bytes


def test_penalties_and_unknown_fields_over_http(client: openai.OpenAI, gateway_stub):
    """The OpenAI penalties reach the primary (greedy: the gRPC answer with the same controls, token for
    token); a field nobody defines is accepted and named in the response header."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=24,
        temperature=0,
        extra_body={"return_token_ids": True, "repetition_penalty": 1.2, "foo_bar": 1},
        frequency_penalty=1.0,
        presence_penalty=0.5,
        logit_bias={"28": -100},
    )
    assert raw.headers["x-specdec-ignored-fields"] == "foo_bar"
    answer = raw.parse()
    req = gateway_pb2.GenerateRequest(max_new_tokens=24)
    req.chat.messages.add(role="user", content=PROMPT)
    req.sampling.frequency_penalty, req.sampling.presence_penalty = 1.0, 0.5
    req.sampling.repetition_penalty = 1.2
    req.sampling.logit_bias[28] = -100
    expected = gateway_stub.Generate(req, timeout=600)
    assert answer.choices[0].model_extra["token_ids"] == list(expected.token_ids)
    assert 28 not in expected.token_ids
