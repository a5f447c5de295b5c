"""Keeping a started Stack up: a service that exits is restarted on its own address, with backoff.

    supervisor = Supervisor(stack, RestartPolicy(), say=print)
    supervisor.run()  # returns never; raises ServiceError when a service keeps dying

The others go on serving meanwhile: the gateway degrades around a missing validator or draft
pool, and re-prefills a request from the state store once a restarted primary is back. A restart
waits for the service's health check as at start-up (Stack.restart). The n-th restart in a row
waits initial_backoff_s * 2**(n-1), at most max_backoff_s; a service that then stays up for
stable_after_s starts afresh. One that exits again after max_rapid_restarts such restarts is given
up: run() raises ServiceError naming it, its last exit status and its log, and the caller stops the
stack.

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


@dataclasses.dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When an exited service is restarted, and when the launcher gives up on it."""

    initial_backoff_s: float = 0.5  # before the first restart in a row
    max_backoff_s: float = 30.0  # the doubling stops here
    stable_after_s: float = 60.0  # up (SERVING) this long: the next exit is a first one again
    max_rapid_restarts: int = DEFAULT_MAX_RAPID_RESTARTS  # in a row; 0: any exit stops the stack

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 < initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s}, {self.max_backoff_s}"
            )
        if self.stable_after_s <= 0:
            raise ValueError(f"stable_after_s must be > 0, got {self.stable_after_s}")
        if self.max_rapid_restarts < 0:
            raise ValueError(f"max_rapid_restarts must be >= 0, got {self.max_rapid_restarts}")

    def backoff_s(self, num_rapid_restarts: int) -> float:
        """The wait before the next restart after num_rapid_restarts in a row.

        E.g. 0.5 s doubling to 30: 0 -> 0.5, 1 -> 1, 2 -> 2, ..., 6 -> 30 (not 32).
        """
        return min(self.max_backoff_s, self.initial_backoff_s * 2.0**num_rapid_restarts)


@dataclasses.dataclass(slots=True)
class _Record:
    """One service as the supervisor sees it."""

    up_since: float  # when it last became SERVING
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
        self._records = {name: _Record(up_since=now) for name in stack.addresses}

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
                if code is None:
                    continue
                self._on_exit(name, record, code)
            if record.restart_at is not None and self._clock() >= record.restart_at:
                self._restart(name, record)

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
        record.up_since = self._clock()
        self._say(
            f"service {name!r} is serving again at {self.stack.addresses[name]} "
            f"(restart {num}, up in {record.up_since - started:.1f} s)"
        )
