"""Starting the four services (and, when asked, the OpenAI-compatible HTTP front) as separate
processes on loopback: the stack behind inference.py and the end-to-end tests.

    with Stack(StackConfig(precision="fp32")) as stack:
        channel = grpc.insecure_channel(stack.gateway_address)

Each service runs as `python -m <module>` in its own process group (so a stop
reaches anything it spawned, and a Ctrl-C in the terminal reaches only the
launcher, which then stops the services in order), on a free loopback port,
with stdout and stderr appended to `<log_dir>/<name>.log`. Services start in
dependency waves (primary; then validator, draft and gateway; then the HTTP front), each
wave waiting for grpc.health.v1 SERVING (the HTTP front: GET /health answering 200). The gateway
starts beside the validator and the draft pool rather than after them: it waits for its services
itself, so its start-up (seconds of imports) overlaps theirs. A service that exits while starting
fails the start at once with the tail of its log; the log dir is kept then. A port the caller
fixed (ServiceSpec.port, e.g. the HTTP front's) that another process holds is a PortInUseError
before anything starts; and a service counts as SERVING only once its own process holds the
listener (specdec.port_owner), so another server on its port never passes for it.
stop() sends SIGTERM (gateway first), then SIGKILL after a grace period; on
Linux the kernel also SIGTERMs the services if the launcher itself is killed.

restart() starts a service again on the port it had (the others hold its
address), and on its /metrics port (the one printed for scraping) unless that was
taken meanwhile, and waits for SERVING as at start-up; it counts restarts per service
(num_restarts, and restarts_file in the log dir, which the HTTP front serves as
specdec_service_restarts_total). Deciding when to restart a service that exited
(backoff, giving up) is specdec.supervisor's job, which `inference.py --serve`
runs.

The internal services accept only callers that present the stack's service
token (specdec.service.auth): start() writes a fresh one into a private
directory (0700, the file 0600), passes its path to every service with
--service_token_file, and removes it on stop(). Tests and tools reach an
internal service through stack.channel(name), which sends the token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import grpc

from specdec import port_owner
from specdec.progress import ProgressEvent, ProgressReader
from specdec.service.auth import TOKEN_FILE_NAME, authenticated_channel, write_service_token
from specdec.service.health import check_health
from specdec.strategies import GRAMMAR_STRATEGY, PREDICTION_STRATEGY

REPO_ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
PRIMARY, DRAFT, VALIDATOR, GATEWAY, HTTP = "primary", "draft", "validator", "gateway", "http"
SERVICE_NAMES = (PRIMARY, VALIDATOR, DRAFT, GATEWAY)
HTTP_HEALTH_PATH = "/health"
# The metrics port flag every service takes; 0 means no /metrics endpoint (port
# 0 cannot be scraped anyway, and a fixed one would collide between stacks).
NO_METRICS_PORT = "0"
# Lines of a service's log quoted in the error when it fails to start.
NUM_TAIL_LINES = 25
# How long a torch (libgomp) thread spins at a barrier before it sleeps. A forward meets hundreds
# of barriers, and the default (300,000 spins) lets a waiting thread hold a core that the thread it
# waits for needs whenever the cores are shared: by this stack's own services, or by anything else
# on the host. Never spinning costs the quiet machine instead (docs/benchmarks.md, "OpenMP spin and
# malloc arenas"). An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
OPENMP_SPIN_COUNT = "1000"
# glibc's malloc arenas per process (default: 8 per core, one per thread that allocates). Each RPC
# thread that decodes a step's logits would grow an arena of its own and keep it, and a service's
# memory with them (the same section). An operator's own MALLOC_ARENA_MAX wins.
MALLOC_ARENAS = "2"
# POSIX shared memory, and the prefixes of the segments a primary names after its pid (its weights,
# specdec.weights.shared; its logits slots, specdec.logits_shm; not imported: both load torch).
SHM_DIR = Path("/dev/shm")
SHM_SEGMENT_PREFIXES = ("specdec-weights", "specdec-logits")
# Where the launcher keeps every service's restart count, in the log dir (JSON: name -> count).
RESTARTS_FILE_NAME = "service_restarts.json"
# The gateway's --redis_url as its own variable (specdec.service.flags: SPECDEC_<SERVICE>_<FLAG>).
REDIS_URL_VARIABLE = "SPECDEC_GATEWAY_REDIS_URL"
# How often a starting service is polled (exit status, then health).
_POLL_S = 0.05
# Picking a free port is bind(0)-then-release, so another process can take the
# port before the service binds it: retry a lost race this many times.
MAX_BIND_ATTEMPTS = 3
# A fresh channel retries a refused connection after 1 s, then backs off
# exponentially; while a service loads its model that would add seconds.
_HEALTH_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
)
# argv: [launcher pid, program, args...]. PR_SET_PDEATHSIG is 1; it survives exec.
_DEATH_SIGNAL_SHIM = f"""
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, {int(signal.SIGTERM)})
if os.getppid() != int(sys.argv[1]):  # the launcher died before prctl: no signal will come
    sys.exit("the launcher exited before the service started")
os.execvp(sys.argv[2], sys.argv[2:])
"""


class ServiceError(RuntimeError):
    """A service failed to start (exited, or not SERVING in time)."""

    def __init__(self, name: str, reason: str, log_path: Path, log_tail: str) -> None:
        super().__init__(
            f"service {name!r} {reason}; log: {log_path}\n--- last lines of {log_path.name} ---\n{log_tail}"
        )
        self.name = name
        self.reason = reason
        self.log_path = log_path
        self.log_tail = log_tail


class PortInUseError(ServiceError):
    """A port the caller fixed (ServiceSpec.port) is held by another process: raised before the
    stack starts, or when the service cannot bind it, never retried elsewhere (the caller chose it)."""

    def __init__(self, name: str, host: str, port: int, log_path: Path, log_tail: str = "") -> None:
        RuntimeError.__init__(
            self, f"port {port} on {host}, where service {name!r} was to listen, is in use by another process"
        )
        self.name, self.host, self.port = name, host, port
        self.reason = f"port {port} is in use"
        self.log_path, self.log_tail = log_path, log_tail


@dataclasses.dataclass(frozen=True, slots=True)
class ServiceSpec:
    """How to run one service. The launcher appends --host, --port,
    --metrics_port, --log_level and one `flag address` pair per address_flags."""

    name: str
    command: tuple[str, ...]  # e.g. (python, "-m", "primary_svc", "--precision", "fp32")
    health_service: str = ""  # grpc.health.v1 name; "" is the whole server
    depends_on: tuple[str, ...] = ()  # services that must be SERVING before this one starts
    # Services launched just before it in its wave, not awaited: it takes their addresses and waits
    # for them itself (it needs them only once requests come), so their start-ups overlap.
    started_beside: tuple[str, ...] = ()
    address_flags: tuple[tuple[str, str], ...] = ()  # (flag, service name): flag gets that service's address
    startup_timeout_s: float = 120.0
    is_taking_service_token: bool = False  # gets --service_token_file (specdec.service.auth)
    health_http_path: str = ""  # an HTTP server: SERVING once GET path answers 200
    port: int = 0  # 0: a free port; else this one (no retry elsewhere)
    health_ca_file: str = ""  # it serves TLS: health checks trust these PEM roots
    is_reporting_restarts: bool = False  # gets --service_restarts_file (Stack.num_restarts, for its /metrics)
    is_reporting_progress: bool = False  # gets --progress_file; Stack's on_progress hears its start-up events
    # Variables its process gets beside the launcher's environment: values that must not stand in
    # its command line, which every user of the machine can read (ps), e.g. a password in a URL.
    env: tuple[tuple[str, str], ...] = ()
    # (primary, draft, validator) service names per node: a gateway of several nodes gets
    # --nodes host:primary_port/draft_port/validator_port,... (gateway.nodes)
    node_services: tuple[tuple[str, str, str], ...] = ()

    @property
    def addressed(self) -> tuple[str, ...]:
        """The services whose addresses its argv names (address_flags, then node_services)."""
        return (*(dep for _, dep in self.address_flags), *(n for node in self.node_services for n in node))

    def __post_init__(self) -> None:
        if not self.name or not self.command:
            raise ValueError("name and command must not be empty")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        missing = set(self.addressed) - set(self.depends_on) - set(self.started_beside)
        if missing:
            raise ValueError(
                f"{self.name}: address_flags name services not in depends_on or started_beside: {sorted(missing)}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class StackConfig:
    """What the four real services run with."""

    model_path: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    # "auto" or a weight format of specdec.model.options.PRECISIONS; checked
    # by the primary, whose refusal fails the start at once with its message.
    # Not imported here: that module loads torch, which the launcher does not need.
    precision: str = "auto"
    cache_dir: Path | None = None  # converted models; None: the services' default
    redis_url: str = ""  # "": the gateway's in-memory state store
    strategies: tuple[str, ...] = ()  # draft decoders to load; (): the services' defaults
    num_threads: int = 0  # the primary's torch threads; 0: torch's default
    max_context: int = 4096
    api_keys_file: Path | None = None  # the gateway's tenants (specdec.service.api_keys); None: any local caller
    is_serving_http: bool = False  # also the OpenAI-compatible HTTP front (http_svc) on the gateway
    http_port: int = 0  # its port; 0: a free one
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    is_serving_metrics: bool = False  # each service serves /metrics on a free port (Stack.metrics_url)
    python: str = sys.executable
    log_level: str = "INFO"
    log_dir: Path | None = None  # None: a fresh temporary dir, removed after a clean stop
    is_keeping_logs: bool = False  # keep a temporary log dir after a clean stop too
    primary_startup_timeout_s: float = 300.0  # first run: GGUF conversion, load, verify-cost calibration
    startup_timeout_s: float = 120.0  # the other services
    stop_grace_s: float = 15.0  # SIGTERM -> SIGKILL; above the services' 5 s drain

    def __post_init__(self) -> None:
        if not self.precision:
            raise ValueError("precision must not be empty")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if self.max_context < 16:
            raise ValueError(f"max_context must be >= 16, got {self.max_context}")
        if any(not s or "," in s for s in self.strategies):
            raise ValueError(f"strategies must be non-empty names without commas, got {self.strategies}")
        if self.stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must be >= 0, got {self.stop_grace_s}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")


def service_specs(config: StackConfig) -> tuple[ServiceSpec, ...]:
    """The four services, in start order (then the HTTP front, with is_serving_http)."""
    http = (_http_spec(config),) if config.is_serving_http else ()
    # The validator after the primary, although it needs nothing from it: the primary
    # times its verify passes at startup, best done on an otherwise idle CPU.
    return (_primary_spec(config), _validator_spec(config), _draft_spec(config), _gateway_spec(config), *http)


def _model_path_flags(config: StackConfig) -> tuple[str, ...]:
    return () if config.model_path is None else ("--model_path", str(config.model_path))


def _model_flags(config: StackConfig) -> tuple[str, ...]:
    """--model_path and --cache_dir, those that are set."""
    cache = () if config.cache_dir is None else ("--cache_dir", str(config.cache_dir))
    return (*_model_path_flags(config), *cache)


def _api_keys_flags(config: StackConfig) -> tuple[str, ...]:
    return () if config.api_keys_file is None else ("--api_keys_file", str(config.api_keys_file))


def _primary_spec(config: StackConfig) -> ServiceSpec:
    return ServiceSpec(
        PRIMARY,
        (
            config.python,
            "-m",
            "primary_svc",
            *_model_flags(config),
            "--precision",
            config.precision,
            "--max_context",
            str(config.max_context),
            "--num_threads",
            str(config.num_threads),
        ),
        health_service="specdec.v1.PrimaryService",
        startup_timeout_s=config.primary_startup_timeout_s,
        is_taking_service_token=True,
        is_reporting_progress=True,
    )


def _validator_spec(config: StackConfig) -> ServiceSpec:
    return ServiceSpec(
        VALIDATOR,
        (config.python, "-m", "validator_svc"),
        health_service="specdec.v1.ValidatorService",
        depends_on=(PRIMARY,),
        startup_timeout_s=config.startup_timeout_s,
        is_taking_service_token=True,
    )


_PER_REQUEST_STRATEGIES = (GRAMMAR_STRATEGY, PREDICTION_STRATEGY)


def _draft_spec(config: StackConfig) -> ServiceSpec:
    # The pool also offers grammar-forced and prediction drafts, which the gateway adds to the
    # requests that can use them only (constrained ones, those with a prediction).
    offered = config.strategies + tuple(s for s in _PER_REQUEST_STRATEGIES if s not in config.strategies)
    strategies = ("--strategies", ",".join(offered)) if config.strategies else ()
    return ServiceSpec(
        DRAFT,
        (config.python, "-m", "draft_svc", *_model_flags(config), *strategies),
        health_service="specdec.v1.DraftService",
        depends_on=(PRIMARY,),
        address_flags=(("--primary_address", PRIMARY),),
        startup_timeout_s=config.startup_timeout_s,
        is_taking_service_token=True,
    )


def _gateway_spec(config: StackConfig) -> ServiceSpec:
    named = tuple(s for s in config.strategies if s not in _PER_REQUEST_STRATEGIES)
    strategies = ("--strategies", ",".join(named)) if named else ()
    # The Redis URL always, as the gateway's own variable (a password in it stays out of the command
    # line): an empty one must not fall back to SPECDEC_REDIS_URL (specdec.service.flags).
    # One machine: the validator reads the primary's logits through /dev/shm (--logits_via_handle).
    return ServiceSpec(
        GATEWAY,
        (
            config.python,
            "-m",
            "gateway",
            *_model_flags(config),
            *strategies,
            *_api_keys_flags(config),
            "--logits_via_handle",
        ),
        env=((REDIS_URL_VARIABLE, config.redis_url),),
        health_service="specdec.v1.GenerationService",
        # It asks the primary for the model before it serves, the pool and the validator only once
        # requests come (gateway.server: GetPoolInfo again while the pool's costs are pending).
        depends_on=(PRIMARY,),
        started_beside=(VALIDATOR, DRAFT),
        address_flags=(
            ("--primary_address", PRIMARY),
            ("--draft_address", DRAFT),
            ("--validator_address", VALIDATOR),
        ),
        startup_timeout_s=config.startup_timeout_s,
        is_taking_service_token=True,
    )


def _http_spec(config: StackConfig) -> ServiceSpec:
    # A client of the gateway's public API: it takes the same keys and no service token.
    return ServiceSpec(
        HTTP,
        (config.python, "-m", "http_svc", *_model_path_flags(config), *_api_keys_flags(config)),
        depends_on=(GATEWAY,),
        address_flags=(("--gateway_address", GATEWAY),),
        startup_timeout_s=config.startup_timeout_s,
        health_http_path=HTTP_HEALTH_PATH,
        port=config.http_port,
        is_reporting_restarts=True,
    )


def service_env(extra: Mapping[str, str] = {}, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment of a service process: the launcher's own, then `extra`, plus the repository on
    PYTHONPATH, unbuffered output, OpenMP's spin count (OPENMP_SPIN_COUNT) and glibc's arena count
    (MALLOC_ARENAS) unless one is set."""
    env = {**environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach the file before a crash
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
    env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)
    return env


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on right now (bind 0, read, release)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_port_taken(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # The same option gRPC listens with: a port in TIME_WAIT counts as free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
        return False


def waves(specs: Sequence[ServiceSpec]) -> list[list[ServiceSpec]]:
    """Specs grouped into start waves: each wave depends only on earlier ones, and a spec started
    beside others comes after them in theirs (ServiceSpec.started_beside).

    E.g. primary; validator, draft (on primary); gateway (on all) ->
    [[primary], [validator, draft], [gateway]]; with the gateway on the primary, started beside
    validator and draft -> [[primary], [validator, draft, gateway]].
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate service names in {names}")
    unknown = {d for s in specs for d in (*s.depends_on, *s.started_beside)} - set(names)
    if unknown:
        raise ValueError(f"unknown dependencies {sorted(unknown)}")
    done: set[str] = set()
    remaining = list(specs)
    result: list[list[ServiceSpec]] = []
    while remaining:
        wave: list[ServiceSpec] = []
        while joining := [
            s
            for s in remaining
            if s not in wave and set(s.depends_on) <= done and set(s.started_beside) <= done | {w.name for w in wave}
        ]:
            wave += joining[:1]  # one at a time: a spec joins after those it starts beside
        if not wave:
            raise ValueError(f"dependency cycle among {[s.name for s in remaining]}")
        result.append(wave)
        done |= {s.name for s in wave}
        remaining = [s for s in remaining if s.name not in done]
    return result


@dataclasses.dataclass(slots=True)
class _Running:
    """One launched service."""

    spec: ServiceSpec
    port: int
    argv: list[str]
    log_path: Path
    process: subprocess.Popen
    metrics_port: int = 0  # 0: no /metrics endpoint
    progress: ProgressReader | None = None  # its --progress_file (ServiceSpec.is_reporting_progress)
    dependency_ports: dict[str, int] = dataclasses.field(default_factory=dict)  # the addresses its argv names
    is_swept: bool = False  # its process group got the final SIGKILL after it exited


class Stack:
    """The services as child processes: start() / stop(), or a context manager.

    specs: what to run (default: the four real services from config); tests
    pass tiny fakes. Not thread-safe: drive it from one thread (the one that
    called start(), which children are tied to on Linux: see _start_process).
    """

    def __init__(
        self,
        config: StackConfig | None = None,
        *,
        specs: Sequence[ServiceSpec] | None = None,
        host: str = LOOPBACK,
        on_progress: Callable[[str, ProgressEvent], None] | None = None,
    ) -> None:
        """on_progress(service name, event): the start-up progress of services that report it
        (specdec.progress), heard while the launcher waits for them to serve."""
        self.config = StackConfig() if config is None else config
        self._specs = tuple(service_specs(self.config) if specs is None else specs)
        self._waves = waves(self._specs)
        self._host = host
        self._running: dict[str, _Running] = {}
        self._log_dir: Path | None = None
        self._is_temporary_log_dir = False
        self._is_keeping_logs = self.config.is_keeping_logs
        self._secrets_dir: Path | None = None
        self._service_token: str | None = None
        # Kills whatever is left if the Stack is dropped or the interpreter
        # exits without stop(); holds the dict, not self.
        self._finalizer = weakref.finalize(self, _kill_all, self._running)
        self._secrets_finalizer: weakref.finalize | None = None
        self._num_restarts: dict[str, int] = {}
        self._on_progress = on_progress

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> Stack:
        if any(r.process.poll() is None for r in self._running.values()):
            raise RuntimeError("the stack is already running")
        self._running.clear()  # in place: the finalizer holds this dict
        self._open_log_dir()
        self._write_service_token()
        self._num_restarts = {spec.name: 0 for spec in self._specs}
        self._write_restarts_file()
        try:
            self._check_fixed_ports()
            for wave in self._waves:
                launched = [self._launch(spec, port=None) for spec in wave]
                for running in launched:
                    self._await_serving(self._with_current_addresses(running))
            for running in self._running.values():  # an early wave may have died meanwhile
                if (code := running.process.poll()) is not None:
                    raise ServiceError(
                        running.spec.name,
                        f"exited with code {code} while the stack started",
                        running.log_path,
                        log_tail(running.log_path),
                    )
        except BaseException:  # KeyboardInterrupt too: never leave children behind
            if self._running:  # a service's log may say why; none ran when a fixed port was taken
                self.keep_logs()
            self._terminate_all()
            self._remove_service_token()
            self._remove_temporary_log_dir()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM every service (gateway first), SIGKILL what is left after stop_grace_s.

        A temporary log dir is removed, unless keep_logs() was called, config
        says so, or a service had exited with an error before the stop.
        """
        if any(r.process.poll() not in (None, 0, -signal.SIGTERM) for r in self._running.values()):
            self._is_keeping_logs = True
        self._terminate_all()
        self._remove_service_token()
        self._remove_temporary_log_dir()

    def keep_logs(self) -> None:
        """Keep a temporary log dir after stop() (a failure worth reading about)."""
        self._is_keeping_logs = True

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            self.keep_logs()  # the failure may be a service's
        self.stop()

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send sig to a service's process group and reap it (a crash, for recovery tests)."""
        running = self._get(name)
        if running.process.poll() is None:
            _signal_group(running.process, sig)
        running.process.wait()
        _sweep(running)

    def restart(self, name: str, *, is_killing: bool = True, reason: str = "") -> None:
        """kill -9 the service (unless is_killing=False: it is already down), then
        start it again on the SAME port (the others hold its address) and wait for SERVING.

        Counts the restart (num_restarts, the restarts file) before the launch, so a restart that
        fails to come up counts too; reason goes into the marker line in the service's log."""
        running = self._get(name)
        if is_killing:
            self.kill(name)
        if running.process.poll() is None:
            raise RuntimeError(f"service {name!r} is still running")
        _sweep(running)
        self._num_restarts[name] = self._num_restarts.get(name, 0) + 1
        self._write_restarts_file()
        note = f" ({reason})" if reason else ""
        with open(running.log_path, "ab") as log:
            log.write(f"\n---- restarted by the launcher at {time.strftime('%H:%M:%S')}{note} ----\n".encode())
        # Its /metrics port too: Prometheus scrapes the address inference.py --serve printed.
        relaunched = self._launch(running.spec, port=running.port, metrics_port=running.metrics_port)
        self._await_serving(relaunched, may_move_port=False)

    # ---- introspection -----------------------------------------------------------------------------

    @property
    def addresses(self) -> dict[str, str]:
        """Service name -> "host:port" of every launched service."""
        return {name: self._address(r.port) for name, r in self._running.items()}

    @property
    def gateway_address(self) -> str:
        return self._address(self._get(GATEWAY).port)

    @property
    def http_url(self) -> str:
        """The HTTP front's base URL, e.g. http://127.0.0.1:8000 (the OpenAI SDKs take it + "/v1")."""
        return f"http://{self._address(self._get(HTTP).port)}"

    @property
    def service_token(self) -> str:
        """The secret the internal services of this stack expect from their callers."""
        if self._service_token is None:
            raise RuntimeError("the stack has not been started")
        return self._service_token

    def channel(self, name: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A channel to a service that sends the service token (close it, or use it as a context manager)."""
        return authenticated_channel(
            grpc.insecure_channel(self.addresses[name], options=list(options)), self.service_token
        )

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            raise RuntimeError("the stack has not been started")
        return self._log_dir

    def metrics_url(self, name: str) -> str:
        """http://host:port/metrics of a service (StackConfig.is_serving_metrics)."""
        port = self._get(name).metrics_port
        if not port:
            raise RuntimeError("the stack serves no metrics: start it with StackConfig(is_serving_metrics=True)")
        return f"http://{self._address(port)}/metrics"

    def log_path(self, name: str) -> Path:
        return self._get(name).log_path

    def pid(self, name: str) -> int:
        return self._get(name).process.pid

    def is_running(self, name: str) -> bool:
        return self._get(name).process.poll() is None

    def is_answering(self, name: str, timeout_s: float) -> bool:
        """One health check of a running service: it answers SERVING within timeout_s (a stopped,
        deadlocked or swapping process does not, though it runs and holds its port)."""
        running = self._get(name)
        address = self._address(running.port)
        with _health_channel(running.spec, address) as channel:
            return _is_serving(running.spec, address, channel, timeout_s)

    def exit_code(self, name: str) -> int | None:
        """None while the service runs; else its exit status (-N: killed by signal N), after what
        is left of its process group has been killed."""
        running = self._get(name)
        code = running.process.poll()
        if code is not None:
            _sweep(running)
        return code

    def num_restarts(self, name: str) -> int:
        """How often restart() relaunched the service since start()."""
        self._get(name)
        return self._num_restarts.get(name, 0)

    @property
    def restarts_file(self) -> Path:
        """JSON {service name: restarts}, rewritten on every restart (for the HTTP front's /metrics)."""
        return self.log_dir / RESTARTS_FILE_NAME

    # ---- internals ---------------------------------------------------------------------------------

    def _get(self, name: str) -> _Running:
        if name not in self._running:
            raise KeyError(f"no running service {name!r}; launched: {sorted(self._running)}")
        return self._running[name]

    def _address(self, port: int) -> str:
        return f"[{self._host}]:{port}" if ":" in self._host else f"{self._host}:{port}"

    def _open_log_dir(self) -> None:
        if self.config.log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="specdec-stack-"))
            self._is_temporary_log_dir = True
        else:
            self._log_dir = Path(self.config.log_dir)
            self._log_dir.mkdir(parents=True, exist_ok=True)

    def _write_service_token(self) -> None:
        if self._secrets_dir is not None:
            return  # started again without stop(): the services' token stays
        self._secrets_dir = Path(tempfile.mkdtemp(prefix="specdec-secrets-"))  # 0700
        self._secrets_finalizer = weakref.finalize(self, shutil.rmtree, self._secrets_dir, True)
        self._service_token = write_service_token(self._secrets_dir / TOKEN_FILE_NAME)

    def _remove_service_token(self) -> None:
        if self._secrets_finalizer is not None:
            self._secrets_finalizer()  # removes the directory, once
        self._secrets_dir, self._secrets_finalizer = None, None

    def _remove_temporary_log_dir(self) -> None:
        if self._is_temporary_log_dir and not self._is_keeping_logs and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def _write_restarts_file(self) -> None:
        # Replaced, not rewritten in place: a reader sees the old counts or the new, never half.
        partial = self.restarts_file.with_suffix(".partial")
        partial.write_text(json.dumps(self._num_restarts, sort_keys=True))
        os.replace(partial, self.restarts_file)

    def _check_fixed_ports(self) -> None:
        """Fail before launching anything when a port the caller chose is taken: the primary's start
        takes seconds, and a server already on the port would answer the readiness check."""
        for spec in self._specs:
            if spec.port and is_port_taken(self._host, spec.port):
                raise PortInUseError(spec.name, self._host, spec.port, self.log_dir / f"{spec.name}.log")

    def _launch(self, spec: ServiceSpec, port: int | None, metrics_port: int | None = None) -> _Running:
        """Start the service on port (None: the spec's, else a free one) and metrics_port (None: a
        free one, when the stack serves metrics)."""
        port = (spec.port or free_port(self._host)) if port is None else port
        if not self.config.is_serving_metrics:
            metrics_port = int(NO_METRICS_PORT)
        elif metrics_port is None:
            metrics_port = free_port(self._host)
        argv = [
            *spec.command,
            "--host",
            self._host,
            "--port",
            str(port),
            "--metrics_port",
            str(metrics_port),
            "--log_level",
            self.config.log_level,
        ]
        for flag, dep in spec.address_flags:
            argv += [flag, self._address(self._get(dep).port)]
        dependency_ports = {dep: self._get(dep).port for dep in spec.addressed}
        if spec.node_services:
            nodes = (
                self._address(self._get(p).port) + f"/{self._get(d).port}/{self._get(v).port}"
                for p, d, v in spec.node_services
            )
            argv += ["--nodes", ",".join(nodes)]
        if spec.is_taking_service_token and self._secrets_dir is not None:
            argv += ["--service_token_file", str(self._secrets_dir / TOKEN_FILE_NAME)]
        if spec.is_reporting_restarts:
            argv += ["--service_restarts_file", str(self.restarts_file)]
        progress = None
        if spec.is_reporting_progress:
            progress_path = self.log_dir / f"{spec.name}.progress"
            progress_path.unlink(missing_ok=True)  # a restart's events start afresh
            argv += ["--progress_file", str(progress_path)]
            progress = ProgressReader(progress_path)
        log_path = self.log_dir / f"{spec.name}.log"
        process = _start_process(argv, log_path, {**self._env(), **dict(spec.env)})
        running = _Running(spec, port, argv, log_path, process, metrics_port, progress, dependency_ports)
        self._running[spec.name] = running
        return running

    def _env(self) -> dict[str, str]:
        return service_env(self.config.extra_env)

    def _with_current_addresses(self, running: _Running) -> _Running:
        """The service, relaunched if a service started beside it moved to another port since its
        launch (a port lost to a race: _await_serving): its argv would name the old address."""
        if all(self._get(dep).port == port for dep, port in running.dependency_ports.items()):
            return running
        _terminate([running], grace_s=0.0)
        return self._launch(running.spec, port=None)

    def _await_serving(self, running: _Running, may_move_port: bool = True) -> None:
        """Wait for SERVING; relaunch on new ports when another process took one of ours (the gRPC
        port unless fixed by the spec or may_move_port is False (a restart: the others hold its
        address), or the /metrics port: free_port only said they were free, and a restart's old one
        may have been taken meanwhile)."""
        for attempt in range(1, MAX_BIND_ATTEMPTS + 1):
            exit_code = _wait_serving(running, self._address(running.port), self._on_progress)
            if exit_code is None:
                return
            taken = [
                port
                for port, is_ours_to_move in (
                    (running.port, may_move_port and not running.spec.port),
                    (running.metrics_port, True),
                )
                if port > 0 and is_ours_to_move and is_port_taken(self._host, port)
            ]
            if running.spec.port and is_port_taken(self._host, running.spec.port):
                raise PortInUseError(
                    running.spec.name, self._host, running.spec.port, running.log_path, log_tail(running.log_path)
                )
            is_race = attempt < MAX_BIND_ATTEMPTS and bool(taken)
            if not is_race:
                raise ServiceError(
                    running.spec.name,
                    f"exited with code {exit_code} while starting",
                    running.log_path,
                    log_tail(running.log_path),
                )
            with open(running.log_path, "ab") as log:
                log.write(f"\n---- port {taken[0]} was taken: retrying on another port ----\n".encode())
            running = self._launch(running.spec, port=None if may_move_port else running.port)

    def _terminate_all(self) -> None:
        order = [
            r
            for wave in reversed(self._waves)
            for spec in reversed(wave)
            if (r := self._running.get(spec.name)) is not None
        ]
        _terminate(order, self.config.stop_grace_s)


def _health_channel(spec: ServiceSpec, address: str) -> grpc.Channel:
    """A channel for the service's gRPC health checks (TLS where it serves TLS)."""
    if spec.health_ca_file:
        with open(spec.health_ca_file, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.secure_channel(address, credentials, options=_HEALTH_CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=_HEALTH_CHANNEL_OPTIONS)


def _is_serving(spec: ServiceSpec, address: str, channel: grpc.Channel, timeout_s: float) -> bool:
    """One health check: SERVING (gRPC) or 200 (an HTTP server's health path) within timeout_s."""
    if spec.health_http_path:
        scheme = "https" if spec.health_ca_file else "http"
        url = f"{scheme}://{address}{spec.health_http_path}"
        return is_http_healthy(url, timeout_s=timeout_s, ca_file=spec.health_ca_file)
    return check_health(channel, spec.health_service, timeout_s=timeout_s)


def _wait_serving(
    running: _Running, address: str, on_progress: Callable[[str, ProgressEvent], None] | None = None
) -> int | None:
    """None once SERVING; the exit code if the process exits first. Raises
    ServiceError (after killing it) when startup_timeout_s passes. Relays the service's progress
    events to on_progress meanwhile."""
    spec = running.spec
    deadline = time.monotonic() + spec.startup_timeout_s
    with _health_channel(spec, address) as channel:
        while True:
            _relay_progress(running, on_progress)
            if (code := running.process.poll()) is not None:
                _sweep(running)
                return code
            is_serving = _is_serving(spec, address, channel, timeout_s=1.0)
            # Another server on a port we lost to a race answers too: SERVING counts only once the
            # service itself listens on the port (until then it binds, or exits on EADDRINUSE).
            if is_serving and is_listening_itself(running):
                if (code := running.process.poll()) is not None:
                    _sweep(running)
                    return code
                _relay_progress(running, on_progress)  # what it wrote since the last look
                return None
            if time.monotonic() > deadline:
                _terminate([running], grace_s=0.0)
                raise ServiceError(
                    spec.name,
                    f"was not SERVING within {spec.startup_timeout_s:g} s",
                    running.log_path,
                    log_tail(running.log_path),
                )
            time.sleep(_POLL_S)


def _relay_progress(running: _Running, on_progress: Callable[[str, ProgressEvent], None] | None) -> None:
    if running.progress is not None and on_progress is not None:
        for event in running.progress.read_new():
            on_progress(running.spec.name, event)


def is_listening_itself(running: _Running) -> bool:
    """Whether the service's own process group holds the listener on its port (Linux's /proc);
    True where that cannot be read."""
    if not port_owner.is_supported():
        return True
    return port_owner.is_listening_in_group(running.process.pid, running.port)


def is_http_healthy(url: str, timeout_s: float = 1.0, ca_file: str = "") -> bool:
    """GET url answers 200 (directly: loopback is never behind an HTTP proxy); an https url is
    verified against ca_file's PEM roots when given."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if ca_file:
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca_file)))
    try:
        with urllib.request.build_opener(*handlers).open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _start_process(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            _with_parent_death_signal(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )


def _with_parent_death_signal(argv: list[str]) -> list[str]:
    """On Linux, argv behind a shim that asks the kernel to SIGTERM the service
    when the launcher dies without cleaning up (kill -9, OOM), then execs it
    under the same pid. Not a preexec_fn: that forks with Python's at-fork
    handlers, which can deadlock on locks held by the launcher's other threads."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _DEATH_SIGNAL_SHIM, str(os.getpid()), *argv]


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    # The child leads its own session, so its pid is its process group's id.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _sweep(running: _Running) -> None:
    """SIGKILL what is left of an exited service's group (what it spawned), and remove the shared
    memory it named after its pid, once: right after the leader is reaped, before its pid (the group
    id) can be reused. A primary unlinks its segments in its graceful stop; one killed, or stopped
    while it started (before it handles SIGTERM), left hundreds of MB in /dev/shm until the next
    primary's start."""
    if not running.is_swept:
        _signal_group(running.process, signal.SIGKILL)
        remove_segments_of(running.process.pid)
        running.is_swept = True


def remove_segments_of(pid: int, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the shared-memory segments named after pid (SHM_SEGMENT_PREFIXES); their names.
    Mappings stay valid until unmapped (a draft pool's)."""
    removed = []
    for prefix in SHM_SEGMENT_PREFIXES:
        for path in shm_dir.glob(f"{prefix}-{pid}-*"):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _terminate(services: Iterable[_Running], grace_s: float) -> None:
    """SIGTERM (and SIGCONT) each group in order, wait up to grace_s in all, then SIGKILL."""
    services = list(services)
    for r in services:
        if r.process.poll() is None:
            _signal_group(r.process, signal.SIGTERM)
            # A stopped service (SIGSTOP, SIGTSTP, a debugger) keeps the SIGTERM pending and would
            # sit out the grace to be SIGKILLed, skipping its graceful stop: the primary's weight and
            # logits segments would stay in /dev/shm. Resumed, it handles the SIGTERM at once.
            _signal_group(r.process, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for r in services:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for r in services:
        if r.process.poll() is None:
            _signal_group(r.process, signal.SIGKILL)
            r.process.wait()
        _sweep(r)


def _kill_all(running: dict[str, _Running]) -> None:
    for r in running.values():
        if r.process.poll() is None:
            _signal_group(r.process, signal.SIGKILL)
        with contextlib.suppress(Exception):
            r.process.wait(timeout=5)
        _sweep(r)


def log_tail(path: Path, num_lines: int = NUM_TAIL_LINES, max_bytes: int = 16384) -> str:
    """The last num_lines lines of a log file ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-num_lines:])
