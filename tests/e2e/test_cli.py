"""inference.py: flag parsing and the request it builds (no services), then the
real command line as a subprocess, once starting its own services and against
the module's stack (--gateway_address): JSON fields, greedy token ids equal
with speculation on and off, streaming, errors with their gRPC status."""

from __future__ import annotations

import io
import json
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

import inference
from specdec.launcher import Stack
from specdec.model.options import PRECISIONS
from specdec.model.tokenizer import MAX_STOP_CHARS, MAX_STOP_STRINGS
from specdec.speculation_bounds import MAX_REQUEST_DRAFT_LENGTH, MAX_REQUEST_SPECULATIVE_DEGREE
from specdec.v1 import common_pb2, gateway_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Write a JSON object describing the planet Mars with keys name, moons and radius_km."
MAX_NEW_TOKENS = 12
# A whole stack start (model load, verify-cost calibration) on a busy 2-core machine, plus the run.
CLI_TIMEOUT_S = 900
JSON_KEYS = {
    "request_id",
    "text",
    "token_ids",
    "finish_reason",
    "speculative_decoding",
    "num_prompt_tokens",
    "num_generated_tokens",
    "num_steps",
    "num_proposed_tokens",
    "num_accepted_tokens",
    "acceptance_rate",
    "mean_accepted_length",
    "tokens_per_second",
    "stage_times",
    "decoders",
    "entropy_bins",
    "wall_s",
    "stack_start_s",
    "precision",
    "precision_choice",
}


def run_cli(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "inference.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s
    )


def run_json(*args: str) -> dict:
    done = run_cli("--prompt", PROMPT, "--max_new_tokens", str(MAX_NEW_TOKENS), "--json", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


# ---- flags and the request, no services ------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--speculative_decoding=true"], True),
        (["--speculative_decoding=false"], False),
        (["--speculative_decoding", "true"], True),
        (["--speculative_decoding", "false"], False),
        (["--speculative_decoding=1"], True),
        (["--speculative_decoding", "0"], False),
        (["--speculative_decoding=yes"], True),
        (["--speculative_decoding", "NO"], False),
        (["--speculative_decoding"], True),
        ([], None),
    ],
)
def test_speculative_decoding_parses_both_forms(flags: list[str], expected: bool | None) -> None:
    args = inference.parse_args(["--prompt", "x", *flags])
    assert args.speculative_decoding is expected
    request = inference.build_request(args)
    if expected is None:
        assert not request.speculation.HasField("is_enabled"), "unset: the gateway's default"
    else:
        assert request.speculation.is_enabled is expected
    # What --json reports: on unless turned off (it reported null without the flag).
    assert inference.is_speculative(request) is (expected is not False)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--acceptance_threshold", "2"], "--acceptance_threshold"),
        (["--top_p", "0"], "--top_p"),
        (["--temperature", "-0.5"], "--temperature"),
        (["--max_new_tokens", "0"], "--max_new_tokens"),
        (["--speculative_degree", "0"], "--speculative_degree"),
        (["--top_k", "nan"], "--top_k"),
        (["--strategies", "prompt_lookup,no_such_strategy"], "--strategies"),
        (["--strategies", "grammar"], "--strategies"),
        (["--strategies", "prompt_lookup,prediction", "--json_mode"], "--strategies"),
        (["--temperature", "inf"], "--temperature"),
        (["--speculative_decoding=maybe"], "--speculative_decoding"),
        (["--precision", "int3"], "--precision"),
        (["--json_mode", "--json_schema", "s.json"], "--json_schema"),
        (["--http_port", "70000"], "--http_port"),
        (["--max_service_restarts", "-1"], "--max_service_restarts"),
        (["--redis_url", "redis+cluster://127.0.0.1"], "--redis_url"),
        (["--redis_url", "redis+sentinel://127.0.0.1:26379"], "--redis_url"),
        (["--redis_url", "redis://127.0.0.1:6379", "--redis_cluster"], "--redis_cluster"),
        (["--gateway_address", "127.0.0.1:1", "--redis_cluster"], "--redis_cluster"),
        # grpc dialled port 99999 - 65536 = 34463; the others failed as UNKNOWN or a name lookup.
        (["--gateway_address", "127.0.0.1:99999"], "--gateway_address"),
        (["--gateway_address", "127.0.0.1:0"], "--gateway_address"),
        (["--gateway_address", "127.0.0.1"], "--gateway_address"),
        (["--gateway_address", ""], "--gateway_address"),
        (["--gateway_address", "http://127.0.0.1:50050"], "--gateway_address"),
        # Past the request's proto fields (uint32, int32 top_k): a ValueError from protobuf otherwise.
        (["--max_new_tokens", str(2**32)], "--max_new_tokens"),
        (["--min_tokens", str(2**32)], "--min_tokens"),
        (["--top_k", str(2**31)], "--top_k"),
        (["--speculative_degree", str(2**32)], "--speculative_degree"),
        (["--draft_length", str(2**32)], "--draft_length"),
        # Past what one request may ask (specdec.speculation_bounds): a bad flag, not an RPC error.
        (["--speculative_degree", str(MAX_REQUEST_SPECULATIVE_DEGREE + 1)], "--speculative_degree"),
        (["--draft_length", str(MAX_REQUEST_DRAFT_LENGTH + 1)], "--draft_length"),
        # More threads than a machine has: libgomp's thread creation failed and aborted the primary.
        (["--num_threads", "100000"], "--num_threads"),
        # Past what a gRPC deadline holds: DEADLINE_EXCEEDED at once otherwise.
        (["--timeout", "1e10"], "--timeout"),
        # --serve's own flags without --serve: the HTTP front never started, nothing said so.
        (["--http_port", "9000"], "--http_port"),
        (["--max_service_restarts", "2"], "--max_service_restarts"),
        # Bytes that are not UTF-8 (the shell passes them through as surrogates): protobuf cannot send them.
        (["--prompt", "\udcff"], "--prompt"),
        (["--system", "\udcff"], "--system"),
        (["--stop", "\udcff"], "--stop"),
        # What the gateway refuses of any request: after the services had started, naming its field.
        (["--min_tokens", "8", "--max_new_tokens", "4"], "--min_tokens"),
        (["--min_tokens", "1", "--json_mode"], "--min_tokens"),
        (["--ignore_eos", "--json_mode"], "--ignore_eos"),
        (["--stop", ""], "--stop"),
        (["--stop", "x" * (MAX_STOP_CHARS + 1)], "--stop"),
        ([arg for i in range(MAX_STOP_STRINGS + 1) for arg in ("--stop", str(i))], "--stop"),
    ],
)
def test_bad_flags_are_refused_locally_naming_the_flag(
    flags: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        inference.parse_args(["--prompt", "x", *flags])
    assert info.value.code == inference.EXIT_BAD_FLAGS
    assert field in capsys.readouterr().err


def test_a_prompt_on_stdin_that_is_not_utf8_is_refused_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9"), encoding="utf-8"))
    with pytest.raises(SystemExit) as info:
        inference.parse_args(["--prompt", "-"])
    assert info.value.code == inference.EXIT_BAD_FLAGS
    assert "--prompt" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "stdin"),
    [(["--prompt", ""], ""), (["--prompt", " \n"], ""), (["--prompt", "", "--no-chat"], ""), (["--prompt", "-"], "\n")],
)
def test_a_blank_prompt_is_refused_naming_the_flag(
    flags: list[str], stdin: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The gateway refuses it, naming chat.messages or prompt: only after the services had started.
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as info:
        inference.parse_args(flags)
    assert info.value.code == inference.EXIT_BAD_FLAGS
    assert "--prompt" in capsys.readouterr().err


def test_a_blank_prompt_after_a_system_message_is_sent() -> None:
    # The gateway takes a chat with one message of text: the system message carries it.
    request = inference.build_request(inference.parse_args(["--prompt", "", "--system", "Say hello."]))
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "Say hello."), ("user", "")]


@pytest.mark.parametrize("flag", ["--log_dir", "--cache_dir"])
@pytest.mark.parametrize("under_a_file", [False, True])
def test_a_directory_that_cannot_be_one_is_refused_naming_the_flag(
    flag: str, under_a_file: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --log_dir: the stack's start raised FileExistsError / NotADirectoryError from mkdir, a
    # traceback; --cache_dir: the primary did, shown as its log's traceback.
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(SystemExit) as info:
        inference.parse_args(["--prompt", "x", flag, str(file / "dir" if under_a_file else file)])
    assert info.value.code == inference.EXIT_BAD_FLAGS
    assert flag in capsys.readouterr().err


def test_a_missing_log_dir_is_created(tmp_path: Path) -> None:
    assert inference.parse_args(["--prompt", "x", "--log_dir", str(tmp_path / "a" / "logs")]).log_dir.is_dir()


def test_a_model_path_without_a_model_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One tensor of 1024 float32s whose data the file lacks: a GGUF cut short, as a download can be.
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 1024, 0, 0)
    (tmp_path / "cut.gguf").write_bytes(header + b"\0" * 64)
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    for name, named in (("cut.gguf", "truncated"), ("notes.txt", "neither"), ("empty", "config.json")):
        with pytest.raises(SystemExit) as info:
            inference.parse_args(["--prompt", "x", "--model_path", str(tmp_path / name)])
        assert info.value.code == inference.EXIT_BAD_FLAGS
        err = capsys.readouterr().err
        assert "--model_path" in err and str(tmp_path / name) in err and named in err


class _InterruptedStdin(io.StringIO):
    def read(self, size: int | None = -1) -> str:
        raise KeyboardInterrupt


def test_ctrl_c_while_the_prompt_is_read_from_stdin_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    # `--prompt -` waits for stdin; Ctrl-C there ended the command with a traceback.
    monkeypatch.setattr(sys, "stdin", _InterruptedStdin())
    try:
        exit_code = inference.main(["--prompt", "-"])
    except KeyboardInterrupt:  # not raised on: it would stop the whole test run
        pytest.fail("the interrupt escaped main (a traceback)")
    assert exit_code == inference.EXIT_INTERRUPTED


@pytest.mark.parametrize("flag", ["--json_schema", "--api_key_file"])
def test_a_file_that_is_not_utf8_is_refused_naming_the_flag(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"\xff{}")
    with pytest.raises(SystemExit) as info:
        inference.parse_args(["--prompt", "x", flag, str(path)])
    assert info.value.code == inference.EXIT_BAD_FLAGS
    assert "UTF-8" in capsys.readouterr().err


def test_the_request_carries_every_flag(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    args = inference.parse_args(
        [
            "--prompt",
            "Hi",
            "--system",
            "Be brief.",
            "--max_new_tokens",
            "7",
            "--temperature",
            "0.5",
            "--top_k",
            "3",
            "--top_p",
            "0.9",
            "--seed",
            "11",
            "--stop",
            "\n\n",
            "--stop",
            "END",
            "--ignore_eos",
            "--min_tokens",
            "3",
            "--speculative_degree",
            "4",
            "--draft_length",
            "6",
            "--acceptance_threshold",
            "0.7",
            "--strategies",
            "prompt_lookup,suffix_index",
            "--task_type",
            "code",
            "--no-adaptive",
        ]
    )
    req = inference.build_request(args)
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert req.max_new_tokens == 7 and list(req.stop) == ["\n\n", "END"] and req.ignore_eos
    assert (req.sampling.temperature, req.sampling.top_k, req.sampling.seed, req.sampling.min_tokens) == (0.5, 3, 11, 3)
    assert req.sampling.top_p == pytest.approx(0.9)
    s = req.speculation
    assert (s.speculative_degree, s.draft_length, list(s.strategies)) == (4, 6, ["prompt_lookup", "suffix_index"])
    assert s.acceptance_threshold == pytest.approx(0.7)
    assert s.task_type == common_pb2.TASK_TYPE_CODE and s.HasField("is_adaptive") and not s.is_adaptive
    # A schema goes without --ignore_eos and --min_tokens, which the gateway refuses beside it.
    req = inference.build_request(inference.parse_args(["--prompt", "Hi", "--json_schema", str(schema)]))
    assert req.response_format.type == common_pb2.ResponseFormat.TYPE_JSON_SCHEMA
    assert req.response_format.json_schema == '{"type": "object"}'


def test_serve_adds_the_http_front_on_its_port() -> None:
    config = inference.stack_config(inference.parse_args(["--serve"]))
    assert config.is_serving_http and config.http_port == 8000
    assert inference.stack_config(inference.parse_args(["--serve", "--http_port", "0"])).http_port == 0
    assert not inference.stack_config(inference.parse_args(["--prompt", "x"])).is_serving_http


def test_relative_paths_reach_the_services_as_this_command_names_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The services run in the project's directory: a relative --model_path named a file there.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    args = inference.parse_args(["--prompt", "x", "--model_path", "model", "--cache_dir", "cache", "--log_dir", "logs"])
    config = inference.stack_config(args)
    here = Path.cwd()  # tmp_path, its links resolved
    assert config.model_path == str(here / "model")
    assert (config.cache_dir, config.log_dir) == (here / "cache", here / "logs")


def test_serve_on_a_taken_port_is_a_clear_error_before_services_ready(tmp_path: Path) -> None:
    """Another server holds the HTTP port: --serve names the port and the flag and never says ready."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        done = run_cli("--serve", "--http-port", str(port), "--log-dir", str(tmp_path), timeout_s=120)
    assert done.returncode == inference.EXIT_STACK_FAILED
    assert f"port {port} on 127.0.0.1" in done.stderr and "in use" in done.stderr
    assert "--http-port" in done.stderr
    assert "services ready" not in done.stderr and done.stdout == ""


def test_the_api_key_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    monkeypatch.setenv(inference.API_KEY_VARIABLE, "sk-from-env")
    assert inference.parse_args(["--prompt", "x", "--api-key-file", str(key_file)]).api_key == "sk-from-file"
    assert inference.parse_args(["--prompt", "x"]).api_key == "sk-from-env"
    assert capsys.readouterr().err == ""
    monkeypatch.delenv(inference.API_KEY_VARIABLE)
    assert inference.parse_args(["--prompt", "x"]).api_key is None


def test_a_key_on_the_command_line_still_works_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    assert inference.parse_args(["--prompt", "x", "--api_key", "sk-visible"]).api_key == "sk-visible"
    err = capsys.readouterr().err
    assert "warning" in err and "--api-key-file" in err and "sk-visible" not in err


@pytest.mark.parametrize(
    ("content", "message"), [(None, "cannot read"), ("", "no key on its first line"), ("\nkey", "no key")]
)
def test_a_bad_api_key_file_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    key_file = tmp_path / "key"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(SystemExit):
        inference.parse_args(["--prompt", "x", "--api-key-file", str(key_file)])
    err = capsys.readouterr().err
    assert "--api-key-file" in err and message in err


@pytest.mark.parametrize("address", ["127.0.0.1:50050", "localhost:1", "[::1]:65535", "dns:///gateway:50050"])
def test_a_gateway_address_is_host_port_or_a_grpc_target(address: str) -> None:
    assert inference.parse_args(["--prompt", "x", "--gateway_address", address]).gateway_address == address


def test_kebab_and_snake_flags_are_the_same_flag() -> None:
    kebab = inference.parse_args(["--prompt", "x", "--max-new-tokens", "5", "--speculative-degree", "2"])
    snake = inference.parse_args(["--prompt", "x", "--max_new_tokens", "5", "--speculative_degree", "2"])
    assert inference.build_request(kebab) == inference.build_request(snake)
    assert kebab.max_new_tokens == 5 and kebab.speculative_degree == 2


def test_defaults_send_a_raw_prompt_only_with_no_chat() -> None:
    chat = inference.build_request(inference.parse_args(["--prompt", "Hi"]))
    assert chat.WhichOneof("input") == "chat" and not chat.HasField("response_format")
    assert chat.sampling.temperature == 0.0 and not chat.sampling.HasField("seed"), "greedy"
    assert not chat.ignore_eos
    raw = inference.build_request(inference.parse_args(["--prompt", "Hi", "--no-chat", "--json_mode"]))
    assert raw.WhichOneof("input") == "prompt" and raw.prompt == "Hi"
    assert raw.response_format.type == common_pb2.ResponseFormat.TYPE_JSON_OBJECT


def test_a_bad_flag_exits_nonzero_naming_the_field() -> None:
    done = run_cli("--prompt", "x", "--acceptance_threshold", "2", timeout_s=120)
    assert done.returncode == inference.EXIT_BAD_FLAGS
    assert "--acceptance_threshold" in done.stderr and "[0, 1]" in done.stderr
    assert done.stdout == ""


# ---- the real command line -------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_hangup_stops_the_services_as_sigterm_does(tmp_path: Path) -> None:
    # The terminal or ssh session closed: SIGHUP's default killed the launcher outright, leaving the
    # service token's directory, a temporary log dir and --redis_cluster's redis-servers behind.
    process = subprocess.Popen(
        [sys.executable, "inference.py", "--prompt", "x", "--log_dir", str(tmp_path)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "primary.log").exists():  # the services are starting
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.05)
        process.send_signal(signal.SIGHUP)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == inference.EXIT_INTERRUPTED, stderr
    assert "interrupted; services stopped" in stderr
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(tmp_path) in _cmdline(p)]
    assert not left, "a service outlived the launcher"


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def self_launched() -> dict:
    """One run that starts (and stops) its own four services, speculation on."""
    return run_json("--speculative_decoding=true")


@pytest.mark.e2e
@pytest.mark.slow
def test_json_output_of_a_self_launched_run(self_launched: dict) -> None:
    out = self_launched
    assert set(out) == JSON_KEYS
    assert out["speculative_decoding"] is True
    assert out["finish_reason"] in ("length", "eos", "stop")
    assert 1 <= len(out["token_ids"]) == out["num_generated_tokens"] <= MAX_NEW_TOKENS
    if out["finish_reason"] == "length":
        assert len(out["token_ids"]) == MAX_NEW_TOKENS
    assert isinstance(out["text"], str) and out["text"]
    assert 1 <= out["num_steps"] <= out["num_generated_tokens"]
    # a stop token that ended the output was its step's: it counts, though the output leaves it out
    num_step_tokens = out["num_generated_tokens"] + (out["finish_reason"] == "eos")
    assert out["mean_accepted_length"] == pytest.approx(num_step_tokens / out["num_steps"])
    assert 0.0 <= out["acceptance_rate"] <= 1.0
    assert out["num_accepted_tokens"] <= out["num_proposed_tokens"]
    assert out["tokens_per_second"] > 0 and out["stack_start_s"] > 0
    assert out["precision"] in PRECISIONS and out["precision_choice"]  # auto's pick, and why
    # every stage time the gateway reports, by its name in the proto
    assert set(out["stage_times"]) == {field.name for field in gateway_pb2.StageTimes.DESCRIPTOR.fields}
    # Both are positive, but neither bounds the other: in a streamed run the primary computes the next
    # token while the gateway commits the last one, so the gateway waits less than the forward took.
    assert out["stage_times"]["forward_ms"] > 0 and out["stage_times"]["verify_ms"] > 0
    assert out["num_prompt_tokens"] > 0
    for decoder in out["decoders"]:
        assert decoder["num_accepted"] <= decoder["num_proposed"]


@pytest.mark.e2e
@pytest.mark.slow
def test_greedy_token_ids_do_not_depend_on_speculation(self_launched: dict, stack: Stack) -> None:
    off = run_json("--speculative_decoding", "false", "--gateway_address", stack.gateway_address)
    on = run_json(
        "--speculative_decoding=true",
        "--speculative_degree",
        "2",
        "--draft_length",
        "4",
        "--gateway_address",
        stack.gateway_address,
    )
    assert off["speculative_decoding"] is False and off["num_proposed_tokens"] == 0
    assert on["token_ids"] == off["token_ids"] == self_launched["token_ids"]
    assert on["text"] == off["text"] == self_launched["text"]


@pytest.mark.e2e
@pytest.mark.slow
def test_stream_prints_the_same_text(self_launched: dict, stack: Stack) -> None:
    streamed = run_json("--stream", "--gateway_address", stack.gateway_address)
    assert streamed["token_ids"] == self_launched["token_ids"]
    assert streamed["text"] == self_launched["text"]
    assert streamed["finish_reason"] == self_launched["finish_reason"]
    human = run_cli(
        "--prompt",
        PROMPT,
        "--max_new_tokens",
        str(MAX_NEW_TOKENS),
        "--stream",
        "--gateway_address",
        stack.gateway_address,
    )
    assert human.returncode == 0, human.stderr[-3000:]
    assert human.stdout == self_launched["text"] + "\n"
    assert "tokens in" in human.stderr and "mean accepted length" in human.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_a_request_the_gateway_refuses_exits_with_its_status(stack: Stack) -> None:
    # Valid locally (a uint32), beyond the gateway's configured limit on max_new_tokens.
    done = run_cli(
        "--prompt", PROMPT, "--max_new_tokens", "100000", "--gateway_address", stack.gateway_address, timeout_s=120
    )
    assert done.returncode == inference.EXIT_RPC_ERROR
    assert "INVALID_ARGUMENT" in done.stderr and "max_new_tokens" in done.stderr
    assert done.stdout == ""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_client_of_a_running_gateway_loads_neither_torch_nor_redis(stack: Stack) -> None:
    # They are the services' (seconds of import on this machine's kind), not a client's.
    args = ["--prompt", PROMPT, "--max_new_tokens", "4", "--quiet", "--gateway_address", stack.gateway_address]
    code = (
        "import sys, inference\n"
        f"exit_code = inference.main({args!r})\n"
        "print(sorted(m for m in ('torch', 'redis') if m in sys.modules), file=sys.stderr)\n"
        "sys.exit(exit_code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() and done.stderr.strip().splitlines()[-1] == "[]"


@pytest.mark.e2e
@pytest.mark.slow
def test_json_schema_constrains_the_output(stack: Stack, tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"planet": {"type": "string"}, "moons": {"type": "integer"}},
        "required": ["planet", "moons"],
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    out = run_json("--json_schema", str(path), "--max_new_tokens", "48", "--gateway_address", stack.gateway_address)
    assert out["finish_reason"] == "eos", out["text"]
    jsonschema.validate(json.loads(out["text"]), schema)
