"""Generate text with speculative decoding from the command line.

    python inference.py --model_path PATH --speculative_decoding=true --speculative_degree 4 \\
        --acceptance_threshold 0.7 --prompt "Write a JSON object describing Mars."

Starts the four services (primary, validator, draft pool, gateway) as separate
processes talking gRPC on loopback (specdec.launcher.Stack), sends one request
to the gateway, prints the result and stops the services. Without --model_path
it serves the default model (SmolLM2-135M-Instruct). The text goes to stdout
and a short stats line to stderr; --json prints one JSON object instead, and
--stream prints the text as it is accepted. --serve keeps the services up with
the OpenAI-compatible HTTP API in front (http_svc, on --http_port) and prints
the gateway's address and the HTTP API's URL; a service that exits meanwhile, or
answers no health check for 30 s (hung), is restarted on its address
(specdec.supervisor, --max_service_restarts), and the
HTTP API's /metrics counts it (specdec_service_restarts_total). --gateway_address
talks to a gateway already running.

Exit codes: 0 success, 1 the gateway refused or failed the request (its gRPC
status and message are printed), 2 bad flags, 3 the services did not start (or,
under --serve, one kept exiting and was given up), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc

from specdec.flags import MAX_NUM_THREADS
from specdec.launcher import HTTP, PRIMARY, SERVICE_NAMES, PortInUseError, ServiceError, Stack, StackConfig
from specdec.model.options import AUTO, DEFAULT_CACHE_DIR, PRECISIONS
from specdec.progress import ProgressPrinter
from specdec.proto_ranges import MAX_INT32, MAX_UINT32, MAX_UINT64
from specdec.strategies import GRAMMAR_STRATEGY, PREDICTION_STRATEGY, check_names
from specdec.speculation_bounds import MAX_REQUEST_DRAFT_LENGTH, MAX_REQUEST_SPECULATIVE_DEGREE
from specdec.service.auth import authenticated_channel
from specdec.service.flags import parse_bool
from specdec.supervisor import DEFAULT_MAX_RAPID_RESTARTS, RestartPolicy, Supervisor
from specdec.task_type import TaskType
from specdec.task_type import to_pb as task_type_to_pb
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, primary_pb2, primary_pb2_grpc
from specdec.flag_spellings import add_spellings

PROG = "python inference.py"
EXIT_RPC_ERROR, EXIT_BAD_FLAGS, EXIT_STACK_FAILED, EXIT_INTERRUPTED = 1, 2, 3, 130
FINISH_REASON_PREFIX = "FINISH_REASON_"
# About 31 years: a gRPC deadline past ~7e9 s from now overflows its nanoseconds and the call fails
# at once with DEADLINE_EXCEEDED.
MAX_TIMEOUT_S = 1e9
# Statuses that say the request was at fault, not a service: no need to point at the logs.
CLIENT_ERROR_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_HTTP_PORT = 8000
# The API key's variable, read when no --api-key-file is given.
API_KEY_VARIABLE = "SPECDEC_API_KEY"
# How often --serve checks that every service is still alive.
_SERVE_POLL_S = 0.5


# ---- flags ---------------------------------------------------------------------------------------------


def ranged(
    kind: Callable[[str], Any], low: float | None = None, high: float | None = None, *, is_low_open: bool = False
) -> Callable[[str], Any]:
    """An argparse type: kind(text) within [low, high] ((low, high] when is_low_open)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        too_low = low is not None and (value <= low if is_low_open else value < low)
        if too_low or (high is not None and value > high):
            bounds = f"{'(' if is_low_open else '['}{_bound(low, '-inf')}, {_bound(high, 'inf')}]"
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {value}")
        return value

    return parse


def _bound(value: float | None, unbounded: str) -> str:
    """A bound as the message shows it: a float short (0.5, 1e+09), an int in full (4294967295)."""
    if value is None:
        return unbounded
    return f"{value:g}" if isinstance(value, float) else str(value)


def strategy_list(text: str) -> tuple[str, ...]:
    """Names of specdec.strategies: an unknown one stopped the draft pool's start (exit 3, its log's
    tail) or, against a running gateway, came back as its INVALID_ARGUMENT."""
    names = tuple(s.strip() for s in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated strategy names, got {text!r}")
    try:
        check_names(names)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return names


# gRPC target schemes taken as they are (grpc's naming doc); anything else is HOST:PORT.
GRPC_TARGET_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def grpc_address(text: str) -> str:
    """An argparse type: HOST:PORT ([V6]:PORT) with a port in [1, 65535], or a gRPC target URI. grpc
    itself takes a port past 65535 modulo 65536 (127.0.0.1:99999 dialled port 34463, another
    server) and reports a malformed address as UNKNOWN or a failed name lookup."""
    if text.startswith(GRPC_TARGET_SCHEMES):
        return text
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        sep = sep if ":" not in host else ""
    if not sep or not host or any(c.isspace() or c in "/[]" for c in host):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"the port must be a number in [1, 65535], got {text!r}")
    return text


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    _add_io_args(p.add_argument_group("input and output"))
    _add_generation_args(p.add_argument_group("generation"))
    _add_speculation_args(p.add_argument_group("speculation"))
    stack = p.add_argument_group("services")
    _add_model_args(stack)
    _add_state_store_args(stack)
    _add_serving_args(stack)
    _add_remote_args(stack)
    return p


def _add_io_args(io: argparse._ArgumentGroup) -> None:
    """The prompt, its output format and what is printed."""
    io.add_argument("--prompt", metavar="TEXT", help="the prompt; '-' reads it from stdin (required unless --serve)")
    io.add_argument("--system", metavar="TEXT", help="a system message before the prompt (chat mode only)")
    io.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send the prompt as a chat message (the gateway applies the chat template)",
    )
    io.add_argument("--json", action="store_true", help="print one machine-readable JSON object")
    io.add_argument("--stream", action="store_true", help="print the text as it is accepted (GenerateStream)")
    io.add_argument("--quiet", action="store_true", help="no progress or stats lines on stderr")
    fmt = io.add_mutually_exclusive_group()
    fmt.add_argument("--json_schema", type=Path, metavar="FILE", help="constrain the output to this JSON Schema")
    fmt.add_argument("--json_mode", action="store_true", help="constrain the output to a JSON object")


def _add_generation_args(gen: argparse._ArgumentGroup) -> None:
    """Sampling, stop strings, length and deadline of the request."""
    gen.add_argument("--max_new_tokens", type=ranged(int, 1, MAX_UINT32), metavar="N", help="default: the gateway's")
    gen.add_argument("--temperature", type=ranged(float, 0.0), default=0.0, metavar="T", help="0 (default): greedy")
    gen.add_argument("--top_k", type=ranged(int, 0, MAX_INT32), default=0, metavar="K", help="0 (default): off")
    gen.add_argument(
        "--top_p", type=ranged(float, 0.0, 1.0, is_low_open=True), default=1.0, metavar="P", help="1 (default): off"
    )
    gen.add_argument("--seed", type=ranged(int, 0, MAX_UINT64), metavar="N", help="seed of the sampling stream")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    gen.add_argument(
        "--ignore_eos",
        action="store_true",
        help="the model's end-of-sequence tokens do not end the output: it runs to --max_new_tokens or a stop string",
    )
    gen.add_argument(
        "--min_tokens",
        type=ranged(int, 0, MAX_UINT32),
        default=0,
        metavar="N",
        help="no end of the output before N tokens",
    )
    gen.add_argument(
        "--timeout",
        type=ranged(float, 0.0, MAX_TIMEOUT_S, is_low_open=True),
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"deadline of the request, seconds (default {DEFAULT_TIMEOUT_S:g})",
    )


def _add_speculation_args(spec: argparse._ArgumentGroup) -> None:
    """The request's speculation settings (the gateway's defaults when not given)."""
    spec.add_argument(
        "--speculative_decoding",
        type=parse_bool,
        nargs="?",
        const=True,
        default=None,
        metavar="BOOL",
        help="speculate (true/false/1/0/yes/no); default: the gateway's (on)",
    )
    spec.add_argument(
        "--speculative_degree",
        type=ranged(int, 1, MAX_REQUEST_SPECULATIVE_DEGREE),
        metavar="N",
        help="draft decoders per step",
    )
    spec.add_argument(
        "--draft_length",
        type=ranged(int, 1, MAX_REQUEST_DRAFT_LENGTH),
        metavar="N",
        help="tokens each decoder proposes per step",
    )
    spec.add_argument(
        "--acceptance_threshold",
        type=ranged(float, 0.0, 1.0),
        default=0.0,
        metavar="X",
        help="opt-in lossy mode: accept a draft token the primary gives at least X times its top "
        "token's probability; 0 (default): lossless",
    )
    spec.add_argument("--strategies", type=strategy_list, metavar="A,B", help="draft decoders, comma-separated")
    spec.add_argument("--task_type", choices=sorted(t.value for t in TaskType), help="default: inferred by the gateway")
    spec.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let the controller tune degree and draft length per step",
    )


def _add_model_args(stack: argparse._ArgumentGroup) -> None:
    """The primary's model, its weight format and the converted models' cache."""
    stack.add_argument(
        "--model_path", metavar="PATH", help="HF model dir or .gguf file; default: SmolLM2-135M-Instruct"
    )
    stack.add_argument(
        "--precision",
        choices=(AUTO, *PRECISIONS),
        help="the primary's weights (default auto: the format that measures fastest here)",
    )
    stack.add_argument(
        "--cache_dir",
        type=Path,
        metavar="DIR",
        help=f"where converted models are kept (default: {DEFAULT_CACHE_DIR})",
    )


def _add_state_store_args(stack: argparse._ArgumentGroup) -> None:
    """Where the requests' state is kept: a Redis URL or a local Redis Cluster."""
    redis = stack.add_mutually_exclusive_group()
    redis.add_argument(
        "--redis_url",
        metavar="URL",
        help="state store: redis://host:port/db, redis+cluster://host:port,... or "
        "redis+sentinel://host:port,.../service_name[/db]; default: in memory",
    )
    redis.add_argument(
        "--redis_cluster",
        action="store_true",
        help="start a local Redis Cluster (3 masters, one replica each, on loopback) for the state "
        "store and stop it on exit (needs redis-server and redis-cli)",
    )


def _add_serving_args(stack: argparse._ArgumentGroup) -> None:
    """How the local services run: threads, logs, and --serve with its HTTP port and restarts."""
    stack.add_argument(
        "--num_threads",
        type=ranged(int, 0, MAX_NUM_THREADS),
        default=0,
        metavar="N",
        help="the primary's threads; 0: torch's",
    )
    stack.add_argument(
        "--log_dir", type=Path, metavar="DIR", help="service logs (default: a temporary dir, kept on failure)"
    )
    stack.add_argument(
        "--serve",
        action="store_true",
        help="keep the services up with the OpenAI-compatible HTTP API in front, print the gateway "
        "address and the HTTP API's URL, stop on Ctrl-C / SIGTERM",
    )
    stack.add_argument(
        "--http_port",
        type=ranged(int, 0, 65535),
        metavar="PORT",
        help=f"--serve: the HTTP API's port on 127.0.0.1 (default {DEFAULT_HTTP_PORT}; 0: a free one)",
    )
    stack.add_argument(
        "--max_service_restarts",
        type=ranged(int, 0),
        metavar="N",
        help="--serve: a service that exits (or answers no health check for 30 s) is restarted on its "
        "address, after 0.5 s doubling to 30 s; "
        f"after N restarts in a row (none lasting a minute) the services stop (default {DEFAULT_MAX_RAPID_RESTARTS}; "
        "0: at once)",
    )


def _add_remote_args(stack: argparse._ArgumentGroup) -> None:
    """A running gateway instead of local services, the --serve topology, and the API key."""
    stack.add_argument(
        "--gateway_address",
        type=grpc_address,
        metavar="HOST:PORT",
        help="use a running gateway instead of starting the services",
    )
    for name, what in (("--nodes", "nodes (primary, draft pool, validator each)"), ("--gateways", "gateways")):
        stack.add_argument(
            name, type=ranged(int, 1), default=1, metavar="N", help=f"--serve: {what} on loopback (specdec.cluster)"
        )
    keys = stack.add_mutually_exclusive_group()
    keys.add_argument(
        "--api_key_file",
        type=Path,
        metavar="FILE",
        help=f"a file whose first line is the API key a --gateway-address with --api-keys-file expects "
        f"(default: ${API_KEY_VARIABLE})",
    )
    keys.add_argument(
        "--api_key",
        metavar="KEY",
        help="deprecated: the key on the command line, where other processes see it; use --api-key-file or "
        f"${API_KEY_VARIABLE}",
    )


def parse_args(argv: Sequence[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    parser = build_parser(prog)
    args = add_spellings(parser).parse_args(argv)
    if args.prompt is None and not args.serve:
        parser.error("--prompt is required (or --serve)")
    if (args.nodes > 1 or args.gateways > 1) and (not args.serve or args.prompt is not None):
        parser.error("--nodes / --gateways above 1 start a cluster: they go with --serve and no --prompt")
    # Unset (None) until here so that one given without --serve is refused, not silently unused.
    serve_only = [f"--{n}" for n in ("http_port", "max_service_restarts") if getattr(args, n) is not None]
    if serve_only and not args.serve:
        parser.error(f"{', '.join(serve_only)}: only with --serve (without it no HTTP API or supervisor runs)")
    if args.http_port is not None and (args.nodes > 1 or args.gateways > 1):
        parser.error("--http_port: a cluster (--nodes / --gateways above 1) runs no HTTP API, only its gateways")
    args.http_port = DEFAULT_HTTP_PORT if args.http_port is None else args.http_port
    if args.max_service_restarts is None:
        args.max_service_restarts = DEFAULT_MAX_RAPID_RESTARTS
    check_service_flags(parser, args)
    if args.system is not None and not args.chat:
        parser.error("--system needs chat mode (drop --no-chat)")
    is_stdin = args.prompt == "-"
    if is_stdin:
        try:
            args.prompt = sys.stdin.read()
        except UnicodeDecodeError as e:
            parser.error(f"--prompt -: stdin is not text in its encoding ({sys.stdin.encoding}): {e.reason}")
    check_prompt(parser, args, is_stdin)
    check_utf8(parser, args)
    if args.stop:
        check_stop(parser, args.stop)
    check_output_bounds(parser, args)
    check_request_strategies(parser, args)
    if args.json_schema is not None:
        args.json_schema_text = read_json_schema(parser, args.json_schema)
    args.api_key = read_api_key(parser, args, os.environ)
    return args


def check_service_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags that configure the services this command starts: none with --gateway_address (it
    starts none); a Redis URL that parses, a model path that holds a model, directories it can write."""
    if args.gateway_address is not None:
        if args.serve:
            parser.error("--serve starts the services: it does not take --gateway_address")
        given = [
            f"--{n}"
            for n in ("model_path", "precision", "cache_dir", "redis_url", "log_dir")
            if getattr(args, n) is not None
        ] + (["--redis_cluster"] if args.redis_cluster else [])
        if given:
            parser.error(f"{', '.join(given)} configure the services, which --gateway_address does not start")
    if args.redis_url:
        from specdec.state_store.redis_url import parse_redis_url  # the redis client: only for a local stack

        try:
            parse_redis_url(args.redis_url)
        except ValueError as e:
            parser.error(str(e))
    if args.model_path is not None:
        # A directory without a model, another file, a cut GGUF: the primary's start failed on it,
        # a traceback in the error, after the other services had started.
        from specdec.model.model_files import check_model_path  # numpy and gguf: only for a local model

        try:
            check_model_path(Path(args.model_path).expanduser())
        except (OSError, ValueError) as e:
            parser.error(f"--model_path: {e}")
    for flag, directory in (("--log_dir", args.log_dir), ("--cache_dir", args.cache_dir)):
        if directory is not None:
            check_directory(parser, flag, directory)


def check_directory(parser: argparse.ArgumentParser, flag: str, path: Path) -> None:
    """--log_dir and --cache_dir must be directories the services can write in (created if missing):
    the stack's start raised on a --log_dir that is a file or cannot be created, a traceback; the
    primary did on such a --cache_dir (where it converts the GGUF), which the error showed as its
    log's traceback."""
    if path.exists() and not path.is_dir():
        parser.error(f"{flag}: {str(path)!r} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"{flag}: cannot create {str(path)!r}: {e.strerror}")
    if not os.access(path, os.W_OK | os.X_OK):
        parser.error(f"{flag}: {str(path)!r} is not writable")


def check_prompt(parser: argparse.ArgumentParser, args: argparse.Namespace, is_stdin: bool) -> None:
    """A request needs some text: the gateway refuses a blank prompt (a chat whose every message is
    blank), which reached it only after the services had started and came back naming its field
    (`chat.messages`), not the flag."""
    if args.prompt is None or args.prompt.strip():
        return
    if args.chat and args.system is not None and args.system.strip():
        return  # the system message carries the text
    parser.error(f"--prompt: {'stdin held no text' if is_stdin else 'the prompt is empty'}")


def check_utf8(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The texts the request carries must be UTF-8: bytes that are not (in an argument, or stdin in
    a C locale) reach Python as lone surrogates, which protobuf refuses with a traceback."""
    texts = [("--prompt", args.prompt), ("--system", args.system), *(("--stop", stop) for stop in args.stop)]
    for flag, text in texts:
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError:
            parser.error(f"{flag}: not UTF-8 text")


def check_output_bounds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the gateway refuses of every request (gateway.params) among --min_tokens, --max_new_tokens,
    --ignore_eos and a JSON output: refused here, before the services start, naming the flags."""
    if args.max_new_tokens is not None and args.min_tokens > args.max_new_tokens:
        parser.error(f"--min_tokens: must be at most --max_new_tokens ({args.max_new_tokens}), got {args.min_tokens}")
    json_flag = "--json_schema" if args.json_schema is not None else "--json_mode" if args.json_mode else None
    for flag, is_given in (("--ignore_eos", args.ignore_eos), ("--min_tokens", args.min_tokens > 0)):
        if is_given and json_flag is not None:
            parser.error(f"{flag}: cannot be combined with {json_flag}: a finished JSON value allows only the end")


def check_request_strategies(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Strategies the gateway refuses in this command's requests (gateway.params): grammar-forced
    drafts without a JSON output, prediction drafts (no request of this command carries a prediction)."""
    strategies = args.strategies or ()
    if PREDICTION_STRATEGY in strategies:
        parser.error(
            f"--strategies: {PREDICTION_STRATEGY!r} drafts need a prediction, which this command does not send"
        )
    if GRAMMAR_STRATEGY in strategies and args.json_schema is None and not args.json_mode:
        parser.error(f"--strategies: {GRAMMAR_STRATEGY!r} drafts need --json_schema or --json_mode")


def check_stop(parser: argparse.ArgumentParser, stop: Sequence[str]) -> None:
    """The gateway's bounds on stop strings (how many, each 1 to MAX_STOP_CHARS characters): an empty
    --stop reached the gateway only after the services had started, refused naming its field."""
    from specdec.errors import InvalidArgument
    from specdec.model.tokenizer import check_stop_strings  # jinja2 and tokenizers: only when --stop is given

    try:
        check_stop_strings(stop, "--stop")
    except InvalidArgument as e:
        parser.error(str(e))


def read_api_key(parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The API key from --api-key-file, else $SPECDEC_API_KEY, else the deprecated --api-key (with a
    warning: a command line is readable by every process of the machine)."""
    if args.api_key is not None:
        print(
            f"warning: --api-key puts the key where other processes can read it; use --api-key-file or "
            f"${API_KEY_VARIABLE}",
            file=sys.stderr,
        )
        return args.api_key
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            parser.error(f"--api-key-file: cannot read {str(args.api_key_file)!r}: {e.strerror}")
        except UnicodeDecodeError as e:
            parser.error(f"--api-key-file: {str(args.api_key_file)!r} is not UTF-8 text: {e.reason}")
        key = lines[0].strip() if lines else ""
        if not key:
            parser.error(f"--api-key-file: {str(args.api_key_file)!r} has no key on its first line")
        return key
    return environ.get(API_KEY_VARIABLE) or None


def read_json_schema(parser: argparse.ArgumentParser, path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except OSError as e:
        parser.error(f"--json_schema: cannot read {str(path)!r}: {e.strerror}")
    except json.JSONDecodeError as e:
        parser.error(f"--json_schema: {str(path)!r} is not JSON: {e}")
    except UnicodeDecodeError as e:
        parser.error(f"--json_schema: {str(path)!r} is not UTF-8 text: {e.reason}")
    return text


# ---- request and result --------------------------------------------------------------------------------


def build_request(args: argparse.Namespace) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(stop=args.stop, ignore_eos=args.ignore_eos)
    if args.chat:
        messages = [] if args.system is None else [gateway_pb2.ChatMessage(role="system", content=args.system)]
        messages.append(gateway_pb2.ChatMessage(role="user", content=args.prompt))
        req.chat.messages.extend(messages)
    else:
        req.prompt = args.prompt
    if args.max_new_tokens is not None:
        req.max_new_tokens = args.max_new_tokens
    req.sampling.temperature, req.sampling.top_k, req.sampling.top_p = args.temperature, args.top_k, args.top_p
    req.sampling.min_tokens = args.min_tokens
    if args.seed is not None:
        req.sampling.seed = args.seed
    s = req.speculation
    if args.speculative_decoding is not None:
        s.is_enabled = args.speculative_decoding
    s.speculative_degree = args.speculative_degree or 0
    s.draft_length = args.draft_length or 0
    s.acceptance_threshold = args.acceptance_threshold
    s.strategies.extend(args.strategies or ())
    if args.task_type is not None:
        s.task_type = task_type_to_pb(TaskType(args.task_type))
    if args.adaptive is not None:
        s.is_adaptive = args.adaptive
    if args.json_schema is not None:
        req.response_format.type = common_pb2.ResponseFormat.TYPE_JSON_SCHEMA
        req.response_format.json_schema = args.json_schema_text
    elif args.json_mode:
        req.response_format.type = common_pb2.ResponseFormat.TYPE_JSON_OBJECT
    return req


@dataclass(slots=True)
class Result:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: int
    stats: gateway_pb2.GenerationStats
    wall_s: float


def generate(
    stub: gateway_pb2_grpc.GenerationServiceStub, req: gateway_pb2.GenerateRequest, timeout_s: float
) -> Result:
    started = time.perf_counter()
    resp = stub.Generate(req, timeout=timeout_s)
    return Result(
        resp.request_id, resp.text, list(resp.token_ids), resp.finish_reason, resp.stats, time.perf_counter() - started
    )


def generate_stream(
    stub: gateway_pb2_grpc.GenerationServiceStub, req: gateway_pb2.GenerateRequest, timeout_s: float, out: TextIO | None
) -> Result:
    """GenerateStream, writing each step's text to out (when given) as it arrives."""
    started = time.perf_counter()
    result = Result("", "", [], gateway_pb2.FINISH_REASON_UNSPECIFIED, gateway_pb2.GenerationStats(), 0.0)
    for msg in stub.GenerateStream(req, timeout=timeout_s):
        result.request_id = msg.request_id or result.request_id
        result.text += msg.text
        result.token_ids.extend(msg.token_ids)
        if out is not None and msg.text:
            out.write(msg.text)
            out.flush()
        if msg.is_final:
            result.finish_reason, result.stats = msg.finish_reason, msg.stats
    result.wall_s = time.perf_counter() - started
    return result


def finish_reason_name(value: int) -> str:
    return gateway_pb2.FinishReason.Name(value).removeprefix(FINISH_REASON_PREFIX).lower()


def is_speculative(req: gateway_pb2.GenerateRequest) -> bool:
    """Whether the request runs with speculation: its own setting, else the gateway's default
    (gateway.proto: SpeculationConfig.is_enabled unset means on)."""
    return req.speculation.is_enabled if req.speculation.HasField("is_enabled") else True


def result_to_dict(
    result: Result, is_speculative: bool, stack_start_s: float | None, primary: dict[str, str] | None = None
) -> dict[str, Any]:
    st = result.stats
    times = st.stage_times
    return {
        "request_id": result.request_id,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": finish_reason_name(result.finish_reason),
        "speculative_decoding": is_speculative,
        "num_prompt_tokens": st.num_prompt_tokens,
        "num_generated_tokens": st.num_generated_tokens,
        "num_steps": st.num_steps,
        "num_proposed_tokens": st.num_proposed_tokens,
        "num_accepted_tokens": st.num_accepted_tokens,
        "acceptance_rate": st.acceptance_rate,
        "mean_accepted_length": st.mean_accepted_length,
        "tokens_per_second": st.tokens_per_second,
        "stage_times": {
            name: getattr(times, name)
            for name in (
                "draft_ms",
                "verify_ms",
                "validate_ms",
                "commit_ms",
                "state_ms",
                "other_ms",
                "total_ms",
                "forward_ms",
            )
        },
        "decoders": [
            {
                "name": d.name,
                "num_proposed": d.num_proposed,
                "num_accepted": d.num_accepted,
                "acceptance_rate": d.num_accepted / d.num_proposed if d.num_proposed else 0.0,
                "time_ms": d.time_ms,
            }
            for d in st.decoders
        ],
        "entropy_bins": [
            {"lower": b.lower, "upper": b.upper, "num_proposed": b.num_proposed, "num_accepted": b.num_accepted}
            for b in st.entropy_bins
        ],
        "wall_s": result.wall_s,
        "stack_start_s": stack_start_s,
        # The primary's weight format and how it was chosen (None when talking to a running gateway).
        "precision": (primary or {}).get("precision"),
        "precision_choice": (primary or {}).get("precision_choice"),
    }


def primary_info(stack: Stack) -> dict[str, str]:
    """The weight format the primary serves and how it was chosen (GetModelInfo)."""
    with stack.channel(PRIMARY) as channel:
        info = primary_pb2_grpc.PrimaryServiceStub(channel).GetModelInfo(primary_pb2.GetModelInfoRequest(), timeout=30)
    return {"precision": info.precision, "precision_choice": info.precision_choice}


def stats_line(result: Result) -> str:
    st, times = result.stats, result.stats.stage_times
    decoders = ", ".join(f"{d.name} {d.num_accepted}/{d.num_proposed}" for d in st.decoders)
    return (
        f"[{st.num_generated_tokens} tokens in {result.wall_s:.2f} s ({st.tokens_per_second:.1f} tok/s), "
        f"{st.num_steps} steps, mean accepted length {st.mean_accepted_length:.2f}, "
        f"acceptance {100 * st.acceptance_rate:.1f} %, finish {finish_reason_name(result.finish_reason)}; "
        f"ms: draft {times.draft_ms:.0f}, verify {times.verify_ms:.0f}, validate {times.validate_ms:.0f}, "
        f"commit {times.commit_ms:.0f}, state {times.state_ms:.0f}, other {times.other_ms:.0f}"
        f"{'; accepted/proposed: ' + decoders if decoders else ''}]"
    )


# ---- running -------------------------------------------------------------------------------------------


def run_request(
    address: str, args: argparse.Namespace, stack_start_s: float | None, primary: dict[str, str] | None = None
) -> None:
    req = build_request(args)
    # An API key travels as the service token does: `authorization: Bearer <key>` on every call.
    with authenticated_channel(grpc.insecure_channel(address), args.api_key) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        if args.stream:
            result = generate_stream(stub, req, args.timeout, out=None if args.json else sys.stdout)
        else:
            result = generate(stub, req, args.timeout)
    if args.json:
        print(json.dumps(result_to_dict(result, is_speculative(req), stack_start_s, primary)))
        return
    if args.stream:
        print(flush=True)
    else:
        print(result.text, flush=True)
    if not args.quiet:
        print(stats_line(result), file=sys.stderr)


def request_or_report(
    address: str,
    args: argparse.Namespace,
    stack: Stack | None,
    stack_start_s: float | None = None,
    primary: dict[str, str] | None = None,
) -> int:
    """run_request; on a gRPC error print its status and message, and keep the
    service logs of a stack we started when the error is not the request's fault."""
    try:
        run_request(address, args, stack_start_s, primary)
        return 0
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        print(f"error: {code.name}: {details}", file=sys.stderr)
        if stack is not None and code not in CLIENT_ERROR_CODES:
            stack.keep_logs()
            print(f"the services' logs are kept in {stack.log_dir}", file=sys.stderr)
        return EXIT_RPC_ERROR


def stack_config(args: argparse.Namespace) -> StackConfig:
    return StackConfig(
        model_path=None if args.model_path is None else str(_absolute(Path(args.model_path))),
        precision=args.precision or AUTO,
        cache_dir=None if args.cache_dir is None else _absolute(args.cache_dir),
        redis_url=args.redis_url or "",
        strategies=args.strategies or (),
        num_threads=args.num_threads,
        log_dir=None if args.log_dir is None else _absolute(args.log_dir),
        is_serving_http=args.serve,
        http_port=args.http_port,
        is_serving_metrics=args.serve,  # each service's own /metrics (docs/metrics.md), printed at start
    )


def _absolute(path: Path) -> Path:
    """A path as this command's working directory names it: the services run in the project's
    directory (specdec.launcher), where a relative --model_path, --cache_dir or --log_dir (the
    services' progress files) named another file, or none, once the command ran elsewhere (the
    installed `specdec generate`, a script in another directory)."""
    return path.expanduser().absolute()


def metrics_lines(stack: Stack) -> str:
    """Where Prometheus scrapes each service: each one exports the families it owns (docs/metrics.md)."""
    return "metrics (Prometheus scrape targets):\n" + "\n".join(
        f"  {name}: {stack.metrics_url(name)}" for name in (*SERVICE_NAMES, HTTP)
    )


def serve_until_stopped(stack: Stack, policy: RestartPolicy, say: Callable[[str], None]) -> int:
    """Wait for Ctrl-C / SIGTERM (KeyboardInterrupt), restarting a service that exits meanwhile;
    fail once one keeps exiting (specdec.supervisor)."""
    try:
        Supervisor(stack, policy, say=say).run(_SERVE_POLL_S)
    except ServiceError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_STACK_FAILED


def _interrupt(_signum: int, _frame: object) -> None:
    # Once: a second SIGTERM (or SIGHUP) must not cut short the stop of the services.
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is _interrupt:
            signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


# SIGTERM (an operator, systemd, a container runtime) and SIGHUP (the terminal or ssh session that
# ran the command closed) unwind like Ctrl-C, so the services are stopped on the way out. SIGHUP's
# default would kill the launcher outright: the services get their SIGTERM from the kernel, but the
# service token's directory, a temporary log dir and --redis_cluster's redis-servers were left.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _handle_stop_signals() -> None:
    """_interrupt on every STOP_SIGNALS but one ignored from the start (`nohup` ignores SIGHUP)."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _interrupt)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The command line; `prog` names it in help and errors (`specdec generate` when run as the package's command)."""
    try:
        args = parse_args(argv, prog)
    except KeyboardInterrupt:  # Ctrl-C while `--prompt -` waits for stdin: nothing started, no traceback
        return EXIT_INTERRUPTED
    _handle_stop_signals()
    say = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.gateway_address is not None:
        try:
            return request_or_report(args.gateway_address, args, stack=None)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    return run_services(args, say)


def run_services(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """Start the services (a stack, or a cluster of them), then run the request or serve until stopped."""
    # A client of a running gateway (main) needs none of these: the Redis client alone takes a tenth
    # of a second to import.
    from specdec.cluster import serve_cluster
    from specdec.redis_cluster import redis_cluster
    from specdec.redis_server import RedisServerError

    local_redis = contextlib.ExitStack()  # the --redis_cluster nodes, stopped after the services
    try:
        if args.redis_cluster:
            say("starting a local Redis Cluster (3 masters, 3 replicas)...")
            args.redis_url = local_redis.enter_context(redis_cluster()).url  # what stack_config passes on
            say(f"state store: --redis_url {args.redis_url}")
        if args.nodes > 1 or args.gateways > 1:
            policy = RestartPolicy(max_rapid_restarts=args.max_service_restarts)
            return serve_cluster(stack_config(args), args.nodes, args.gateways, policy, say)
        say(f"starting the services (primary, validator, draft, gateway{', http' if args.serve else ''})...")
        started = time.perf_counter()
        # The primary's first start converts the model and times the weight formats: its progress
        # events are relayed here, since the services log to files.
        with Stack(stack_config(args), on_progress=None if args.quiet else ProgressPrinter(say)) as stack:
            stack_start_s = time.perf_counter() - started
            primary = primary_info(stack)
            say(
                f"services ready in {stack_start_s:.1f} s (logs: {stack.log_dir}); primary weights "
                f"{primary['precision']} ({primary['precision_choice']})"
            )
            if args.prompt is not None:
                exit_code = request_or_report(stack.gateway_address, args, stack, stack_start_s, primary)
                if exit_code or not args.serve:
                    return exit_code
            print(stack.gateway_address, flush=True)
            print(stack.http_url, flush=True)
            say(
                "serving GenerationService (gRPC) at the first address above, the OpenAI-compatible HTTP API "
                "at the second (base URL + /v1); Ctrl-C stops"
            )
            say(metrics_lines(stack))
            try:
                return serve_until_stopped(stack, RestartPolicy(max_rapid_restarts=args.max_service_restarts), say)
            except KeyboardInterrupt:  # the normal end of --serve
                say("stopping the services...")
                return 0
    except PortInUseError as e:
        print(f"error: {e}: choose another with --http-port PORT (0: a free one)", file=sys.stderr)
        return EXIT_STACK_FAILED
    except ServiceError as e:
        print(f"error: the services did not start: {e}", file=sys.stderr)
        return EXIT_STACK_FAILED
    except KeyboardInterrupt:
        say("interrupted; services stopped")
        return EXIT_INTERRUPTED
    except RedisServerError as e:
        print(f"error: --redis_cluster: {e}", file=sys.stderr)
        return EXIT_STACK_FAILED
    finally:
        local_redis.close()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # stdout was closed early (`| head`); the services are stopped already.
        # Point stdout at /dev/null so the interpreter's final flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_RPC_ERROR)
