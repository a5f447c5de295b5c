"""Log probabilities, token-id prompts and the tokenizer endpoints on a live fp32 stack (real
processes, real Redis), over gRPC and the OpenAI-compatible HTTP front, and lm-eval-harness's
`local-completions` model running a loglikelihood and a generation task against it, offline.

Greedy logprobs with speculation on equal those with it off (same tokens; values to float32
rounding: both come from the primary's fp32 rows) and those of a direct in-process forward of the
same model over prompt + output."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.launcher import Stack
from specdec.v1 import common_pb2, gateway_pb2, logprobs_pb2

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
MAX_CONTEXT = 1024  # the in-process reference model's positions (fp32_model)
# The module's stack (tests/e2e/conftest.py): fp32, the reference's context, and the HTTP front.
STACK_OPTIONS = {"precision": "fp32", "max_context": MAX_CONTEXT, "is_serving_http": True}
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
# Repetitive: prompt lookup drafts from it, so the speculative run accepts drafts.
PROMPT = "Copy the list exactly.\nred, green, blue, red, green, blue, red, green, blue, red, green,"
NUM_TOP = 4
TOLERANCE = 1e-3  # the same fp32 model in two processes, forwards of other shapes: float32 rounding


def _generate(
    gateway_stub, *, is_speculative: bool, include_prompt: bool = False, **fields
) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(
        max_new_tokens=24,
        logprobs=logprobs_pb2.LogprobsOptions(num_top_logprobs=NUM_TOP, include_prompt=include_prompt),
        speculation=gateway_pb2.SpeculationConfig(is_enabled=is_speculative, is_adaptive=False),
        **fields,
    )
    if "token_ids" not in fields:
        request.prompt = PROMPT
    return gateway_stub.Generate(request, timeout=600)


def _reference_log_probs(model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of one in-process forward over token_ids: [n, V], row r predicting token r + 1."""
    engine = Engine(model, KVCache(model.config, torch.float32, max_bytes=256 << 20), MAX_CONTEXT)
    engine.open("reference", token_ids[:1])
    rows = engine.verify("reference", token_ids[1:], list(range(-1, len(token_ids) - 2)))
    engine.release("reference")
    return torch.log_softmax(rows, dim=-1)


def _assert_raw_distributions_values(gateway_stub, fp32_model, answer) -> torch.Tensor:
    """Assert that each output token of answer (a Generate of PROMPT) has its value in the raw
    distribution, that of a direct forward over prompt + output; returns those rows, one a token."""
    prompt_ids = list(gateway_stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=PROMPT), timeout=60).token_ids)
    output = list(answer.token_ids)
    reference = _reference_log_probs(fp32_model.model, prompt_ids + output)[len(prompt_ids) - 1 :]
    assert [x.token_id for x in answer.logprobs] == output
    for row, value in zip(reference, answer.logprobs):
        assert value.logprob == pytest.approx(float(row[value.token_id]), abs=TOLERANCE)
    return reference


def _assert_same_values(a, b) -> None:
    assert [x.token_id for x in a] == [x.token_id for x in b]
    for x, y in zip(a, b):
        assert x.logprob == pytest.approx(y.logprob, abs=TOLERANCE)
        assert [t.logprob for t in x.top_logprobs] == pytest.approx([t.logprob for t in y.top_logprobs], abs=TOLERANCE)


# ---- gRPC ------------------------------------------------------------------------------------------


def test_greedy_logprobs_are_the_same_with_speculation_on_and_off(gateway_stub):
    plain = _generate(gateway_stub, is_speculative=False)
    speculative = _generate(gateway_stub, is_speculative=True)
    assert speculative.stats.num_accepted_tokens > 0  # the tree's rows scored accepted drafts
    assert list(speculative.token_ids) == list(plain.token_ids) and speculative.text == plain.text
    assert len(plain.logprobs) == len(plain.token_ids)
    _assert_same_values(speculative.logprobs, plain.logprobs)
    for x in speculative.logprobs:  # greedy: each token is its row's most likely; alternatives named
        assert x.top_logprobs[0].token_id == x.token_id and len(x.top_logprobs) == NUM_TOP
        assert x.text and all(t.text for t in x.top_logprobs)


def test_logprobs_equal_a_direct_in_process_computation(gateway_stub, fp32_model):
    answer = _generate(gateway_stub, is_speculative=True, include_prompt=True)
    prompt_ids = list(gateway_stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=PROMPT), timeout=60).token_ids)
    assert [x.token_id for x in answer.prompt_logprobs] == prompt_ids
    assert math.isnan(answer.prompt_logprobs[0].logprob) and not answer.prompt_logprobs[0].top_logprobs
    output = list(answer.token_ids)
    reference = _reference_log_probs(fp32_model.model, prompt_ids + output)
    scored = [*answer.prompt_logprobs[1:], *answer.logprobs]
    for row, value in zip(reference, scored):
        assert value.logprob == pytest.approx(float(row[value.token_id]), abs=TOLERANCE)
        top = torch.topk(row, NUM_TOP)
        assert [t.logprob for t in value.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOLERANCE)
    assert len(scored) == len(prompt_ids) - 1 + len(output)


def test_sampled_tokens_with_speculation_get_their_raw_distributions_logprobs(gateway_stub, fp32_model):
    """The validator draws a sampled step's last token; its value (from the same fp32 row) and the
    primary's of the accepted drafts are those of the raw distribution, not the tempered one."""
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT,
        max_new_tokens=24,
        sampling=common_pb2.SamplingParams(temperature=0.7, seed=11),
        logprobs=logprobs_pb2.LogprobsOptions(num_top_logprobs=NUM_TOP),
        speculation=gateway_pb2.SpeculationConfig(is_enabled=True, is_adaptive=False),
    )
    answer = gateway_stub.Generate(request, timeout=600)
    assert answer.stats.num_proposed_tokens > 0 and answer.stats.num_steps < len(answer.token_ids)
    reference = _assert_raw_distributions_values(gateway_stub, fp32_model, answer)
    for row, value in zip(reference, answer.logprobs):
        assert [t.token_id for t in value.top_logprobs][:1] == [int(row.argmax())]


def test_sampled_tokens_under_penalties_get_their_raw_distributions_logprobs(gateway_stub, fp32_model):
    """With penalties and logit_bias the primary's rows are processed, so the validator would score
    its draw on a processed row: such a request's values are those of the raw distribution all the
    same, and those of speculation off."""
    sampling = common_pb2.SamplingParams(temperature=0.7, seed=11, frequency_penalty=0.5, presence_penalty=0.3)
    on, off = (
        _generate(gateway_stub, is_speculative=is_speculative, sampling=sampling) for is_speculative in (True, False)
    )
    _assert_raw_distributions_values(gateway_stub, fp32_model, on)
    _assert_same_values(on.logprobs, off.logprobs)


def test_a_streams_logprobs_are_the_whole_answers(gateway_stub):
    whole = _generate(gateway_stub, is_speculative=True, include_prompt=True)
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT,
        max_new_tokens=24,
        logprobs=logprobs_pb2.LogprobsOptions(num_top_logprobs=NUM_TOP, include_prompt=True),
    )
    messages = list(gateway_stub.GenerateStream(request, timeout=600))
    streamed = [x for m in messages for x in m.logprobs]
    assert [len(m.logprobs) for m in messages] == [len(m.token_ids) for m in messages]
    _assert_same_values(streamed, whole.logprobs)
    assert len(messages[0].prompt_logprobs) == len(whole.prompt_logprobs)
    assert not any(m.prompt_logprobs for m in messages[1:])


def test_a_token_id_prompt_is_the_text_prompts_tokens(gateway_stub):
    prompt_ids = list(gateway_stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=PROMPT), timeout=60).token_ids)
    by_ids = _generate(gateway_stub, is_speculative=True, token_ids=gateway_pb2.TokenIds(ids=prompt_ids))
    by_text = _generate(gateway_stub, is_speculative=True)
    assert list(by_ids.token_ids) == list(by_text.token_ids) and by_ids.stats.num_prompt_tokens == len(prompt_ids)
    text = gateway_stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=prompt_ids), timeout=60).text
    assert text == PROMPT
    info = gateway_stub.DescribeModel(gateway_pb2.DescribeModelRequest(), timeout=60)
    assert info.max_model_len == MAX_CONTEXT and info.special_tokens["eos_token"] and info.chat_template


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"logprobs": logprobs_pb2.LogprobsOptions(num_top_logprobs=21)}, "logprobs.num_top_logprobs"),
        ({"token_ids": gateway_pb2.TokenIds(ids=[])}, "token_ids.ids"),
        ({"token_ids": gateway_pb2.TokenIds(ids=[1, 10**9])}, "token_ids.ids"),
    ],
)
def test_bad_logprobs_or_token_prompts_are_refused_naming_the_field(gateway_stub, fields: dict, field: str):
    request = gateway_pb2.GenerateRequest(max_new_tokens=2, **fields)
    if "token_ids" not in fields:
        request.prompt = PROMPT
    with pytest.raises(grpc.RpcError) as e:
        gateway_stub.Generate(request, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(f"{field}: ")


def test_detokenizing_an_id_outside_the_vocabulary_is_refused(gateway_stub):
    with pytest.raises(grpc.RpcError) as e:
        gateway_stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=[5, -1]), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("token_ids: ")


# ---- HTTP ------------------------------------------------------------------------------------------


def _post(url: str, body: dict) -> tuple[int, dict]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with opener.open(request, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=60) as r:
        return json.loads(r.read())


def test_completions_echo_logprobs_over_token_prompts_and_prompt_lists(client: openai.OpenAI, gateway_stub):
    prompt_ids = list(gateway_stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=PROMPT), timeout=60).token_ids)
    answer = client.completions.create(
        model=MODEL, prompt=[prompt_ids, "Hello"], max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    assert [c.index for c in answer.choices] == [0, 1]
    first = answer.choices[0]
    assert first.text.startswith(PROMPT)
    lp = first.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(prompt_ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == first.text and lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert value is not None and value <= 0 and top is not None and top[token] == value and len(top) <= 3
    # the generated tokens' values are the gRPC answer's
    grpc_answer = _generate(gateway_stub, is_speculative=True, token_ids=gateway_pb2.TokenIds(ids=prompt_ids))
    assert lp.token_logprobs[len(prompt_ids) :] == pytest.approx(
        [x.logprob for x in grpc_answer.logprobs[:3]], abs=TOLERANCE
    )
    assert answer.choices[1].text.startswith("Hello") and answer.usage is not None
    assert answer.usage.prompt_tokens == len(prompt_ids) + 1  # "Hello" is one token
    # streamed: the prompt's text and tokens come first, offsets run on across chunks
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt_ids, max_tokens=3, temperature=0, logprobs=2, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == PROMPT
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens or []] == lp.tokens
    assert [o for s in streamed for o in s.text_offset or []] == lp.text_offset


def test_an_echoed_token_prompt_spells_its_special_tokens_as_its_logprobs_do(client: openai.OpenAI, gateway_stub):
    """The echo of a token prompt holding <|im_start|> is the text its tokens' log probabilities
    name, as a text prompt's echo is (the echo used to leave the special tokens out)."""
    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = list(gateway_stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=chat), timeout=60).token_ids)
    assert prompt_ids[0] == 1  # <|im_start|>, the special token
    answer = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=2, temperature=0, logprobs=0, echo=True
    )
    choice = answer.choices[0]
    assert choice.text.startswith(chat) and choice.logprobs is not None and choice.logprobs.tokens is not None
    assert "".join(choice.logprobs.tokens[: len(prompt_ids)]) == chat


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = whole.choices[0].logprobs.content
    assert content is not None and "".join(c.token for c in content) == whole.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    assert all(bytes(c.bytes or []) == c.token.encode() for c in content)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=TOLERANCE)


def test_tokenize_detokenize_round_trip_and_model_info(stack: Stack):
    status, tokens = _post(f"{stack.http_url}/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_CONTEXT
    assert "".join(tokens["token_strs"]) == PROMPT
    status, text = _post(f"{stack.http_url}/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and text == {"prompt": PROMPT}
    status, chat = _post(f"{stack.http_url}/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and chat["count"] > 3  # the chat template's markup around "Hi"
    info = _get(f"{stack.http_url}/tokenizer_info")
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == MAX_CONTEXT
    (card,) = _get(f"{stack.http_url}/v1/models")["data"]
    assert card["id"] == MODEL and card["max_model_len"] == MAX_CONTEXT


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [3, "x"]]}, "prompt[1][1]"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(stack: Stack, path: str, body: dict, param: str):
    status, answer = _post(f"{stack.http_url}{path}", {"model": MODEL, **body})
    assert status == 400 and answer["error"]["param"] == param, answer


# ---- lm-eval-harness -------------------------------------------------------------------------------


def test_lm_eval_harness_runs_a_loglikelihood_and_a_generation_task(stack: Stack, monkeypatch):
    """lm-eval-harness's `local-completions` model, unchanged, offline: the tokenizer is the server's
    (/tokenizer_info, /tokenize, /detokenize: its "remote" backend), the tasks' rows local JSON files
    (their paths are relative to TASKS_DIR), so nothing is fetched from a hub."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(TASKS_DIR)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": MODEL,
            "base_url": f"{stack.http_url}/v1/completions",
            "tokenizer_backend": "remote",
            "tokenized_requests": True,  # token-id prompts, as lm-eval sends them by default
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["specdec_tiny_mc", "specdec_tiny_gen"],
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        log_samples=True,
    )
    assert results is not None
    mc, gen = results["results"]["specdec_tiny_mc"], results["results"]["specdec_tiny_gen"]
    print("lm-eval:", json.dumps({"mc": mc, "gen": gen}, default=str))
    assert 0.0 <= mc["acc,none"] <= 1.0 and 0.0 <= gen["exact_match,none"] <= 1.0
    mc_samples = results["samples"]["specdec_tiny_mc"]
    assert len(mc_samples) == 4
    for sample in mc_samples:  # every choice scored: a finite, negative log likelihood
        assert len(sample["resps"]) == 3
        assert all(r[0][0] < 0 and math.isfinite(r[0][0]) for r in sample["resps"])
    generations = [sample["resps"][0][0] for sample in results["samples"]["specdec_tiny_gen"]]
    print("lm-eval generations:", generations)
    assert len(generations) == 3 and all(isinstance(g, str) and "\n" not in g for g in generations)
