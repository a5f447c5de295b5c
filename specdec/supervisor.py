"""Keeping a started Stack up: a service that exits, or hangs, is restarted on its own address, with
backoff.

    supervisor = Supervisor(stack, RestartPolicy(), say=print)
    supervisor.run()  # returns never; raises ServiceError when a service keeps dying

The others go on serving meanwhile: the gateway degrades around a missing validator or draft
pool, and re-prefills a request from the state store once a restarted primary is back. A restart
waits for the service's health check as at start-up (Stack.restart). The n-th restart in a row
waits initial_backoff_s * 2**(n-1), at most max_backoff_s; a service that then stays up for
stable_after_s starts afresh. One that exits again after max_rapid_restarts such restarts is given
up: run() raises ServiceError naming it, its last exit status and its log, and the caller stops the
stack.

A hung service (stopped, deadlocked, swapping: it runs and holds its port but answers nothing) is
found by a health check every liveness_interval_s; one that has not answered one for hang_after_s
is killed (SIGKILL) and restarted as an exited one, as a Kubernetes liveness probe would. The
gateway serves around a hung validator or draft pool meanwhile (gateway.call_deadlines); a hung
primary holds its requests until then.

Driven from the thread that started the stack, not a thread of its own: on Linux a child is tied
to the thread that spawned it (PR_SET_PDEATHSIG fires when that thread ends), and a Ctrl-C or
SIGTERM that unwinds that thread ends supervision before the stack stops, so nothing is restarted
during a shutdown.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable
from typing import NoReturn

from specdec.launcher import ServiceError, Stack, log_tail

# How often run() looks at the services' exit statuses.
DEFAULT_POLL_S = 0.5
# Restarts in a row before the launcher gives up on a service: 0.5 + 1 + 2 + 4 + 8 s of backoff.
DEFAULT_MAX_RAPID_RESTARTS = 5
# The longest one liveness check waits (a loaded machine's health answer takes milliseconds).
LIVENESS_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When an exited service is restarted, and when the launcher gives up on it."""

    initial_backoff_s: float = 0.5  # before the first restart in a row
    max_backoff_s: float = 30.0  # the doubling stops here
    stable_after_s: float = 60.0  # up (SERVING) this long: the next exit is a first one again
    max_rapid_restarts: int = DEFAULT_MAX_RAPID_RESTARTS  # in a row; 0: any exit stops the stack
    liveness_interval_s: float = 5.0  # a health check of each running service this often
    hang_after_s: float = 30.0  # no answer for this long: hung, killed and restarted (0: never)

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 < initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s}, {self.max_backoff_s}"
            )
        if self.stable_after_s <= 0:
            raise ValueError(f"stable_after_s must be > 0, got {self.stable_after_s}")
        if self.max_rapid_restarts < 0:
            raise ValueError(f"max_rapid_restarts must be >= 0, got {self.max_rapid_restarts}")
        if self.liveness_interval_s <= 0 or self.hang_after_s < 0:
            raise ValueError(
                f"need liveness_interval_s > 0 and hang_after_s >= 0, got {self.liveness_interval_s}, "
                f"{self.hang_after_s}"
            )

    @property
    def liveness_timeout_s(self) -> float:
        """How long one health check waits for its answer."""
        return min(LIVENESS_TIMEOUT_S, self.hang_after_s / 2)

    def backoff_s(self, num_rapid_restarts: int) -> float:
        """The wait before the next restart after num_rapid_restarts in a row.

        E.g. 0.5 s doubling to 30: 0 -> 0.5, 1 -> 1, 2 -> 2, ..., 6 -> 30 (not 32).
        """
        return min(self.max_backoff_s, self.initial_backoff_s * 2.0**num_rapid_restarts)


@dataclasses.dataclass(slots=True)
class _Record:
    """One service as the supervisor sees it."""

    up_since: float  # when it last became SERVING
    answered_at: float  # its last SERVING answer to a health check (or up_since)
    checked_at: float  # its last health check
    num_rapid_restarts: int = 0  # restarts since it last stayed up for stable_after_s
    restart_at: float | None = None  # it is down: restart it then


def describe_exit(code: int) -> str:
    """E.g. 1 -> "exited with code 1", -9 -> "was killed by SIGKILL"."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class Supervisor:
    """Restarts the exited services of a started Stack (see the module docstring)."""

    def __init__(
        self,
        stack: Stack,
        policy: RestartPolicy | None = None,
        *,
        say: Callable[[str], None] = lambda _msg: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stack = stack
        self.policy = RestartPolicy() if policy is None else policy
        self._say = say
        self._clock = clock
        now = clock()
        self._records = {name: _Record(now, now, now) for name in stack.addresses}

    def run(self, poll_s: float = DEFAULT_POLL_S) -> NoReturn:
        """poll() until a KeyboardInterrupt (Ctrl-C; SIGTERM where the caller maps it to one) or
        a ServiceError (a service given up)."""
        while True:
            self.poll()
            time.sleep(poll_s)

    def poll(self) -> None:
        """Notice exits, restart what is due (waiting for it to serve); ServiceError to give up."""
        for name, record in self._records.items():
            if record.restart_at is None:
                code = self.stack.exit_code(name)
                if code is None and self._is_hung(name, record):
                    self.stack.kill(name)
                    code = self.stack.exit_code(name)
                if code is None:
                    continue
                self._on_exit(name, record, code)
            if record.restart_at is not None and self._clock() >= record.restart_at:
                self._restart(name, record)

    def _is_hung(self, name: str, record: _Record) -> bool:
        """A health check when one is due; True once the service has answered none for hang_after_s."""
        now = self._clock()
        if not self.policy.hang_after_s or now - record.checked_at < self.policy.liveness_interval_s:
            return False
        record.checked_at = now
        if self.stack.is_answering(name, self.policy.liveness_timeout_s):
            record.answered_at = self._clock()
            return False
        silent_s = self._clock() - record.answered_at
        if silent_s < self.policy.hang_after_s:
            return False
        self._say(f"service {name!r} answered no health check for {silent_s:.0f} s (hung?): killing it")
        return True

    def _on_exit(self, name: str, record: _Record, code: int, *, has_served: bool = True) -> None:
        now = self._clock()
        if has_served and now - record.up_since >= self.policy.stable_after_s:
            record.num_rapid_restarts = 0
        log_path = self.stack.log_path(name)
        if record.num_rapid_restarts >= self.policy.max_rapid_restarts:
            raise ServiceError(
                name,
                f"{describe_exit(code)}; gave up after {record.num_rapid_restarts} restarts in a row",
                log_path,
                log_tail(log_path),
            )
        backoff_s = self.policy.backoff_s(record.num_rapid_restarts)
        record.restart_at = now + backoff_s
        self._say(
            f"service {name!r} {describe_exit(code)}; restarting it in {backoff_s:g} s "
            f"(restart {self.stack.num_restarts(name) + 1}; log: {log_path})"
        )

    def _restart(self, name: str, record: _Record) -> None:
        record.restart_at = None
        record.num_rapid_restarts += 1
        num = self.stack.num_restarts(name) + 1
        started = self._clock()
        try:
            self.stack.restart(name, is_killing=False, reason=f"restart {num}")
        except ServiceError as e:
            # It exited while starting, or did not serve in time (then it was killed): one more exit.
            code = self.stack.exit_code(name)
            self._say(f"service {name!r} failed to restart: {e.reason}")
            self._on_exit(name, record, -signal.SIGKILL if code is None else code, has_served=False)
            return
        record.up_since = record.answered_at = record.checked_at = self._clock()
        self._say(
            f"service {name!r} is serving again at {self.stack.addresses[name]} "
            f"(restart {num}, up in {record.up_since - started:.1f} s)"
        )
