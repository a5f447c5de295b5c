"""Retrying calls that fail for transient reasons, with exponential backoff and jitter."""

import functools
import logging
import random
import time

log = logging.getLogger(__name__)


class RetryError(Exception):
    def __init__(self, attempts, last_error):
        super().__init__(f"gave up after {attempts} attempts: {last_error}")
        self.attempts = attempts
        self.last_error = last_error


def backoff_delays(base=0.1, factor=2.0, max_delay=10.0, jitter=0.1, rng=random.random):
    delay = base
    while True:
        spread = delay * jitter
        yield max(0.0, delay - spread + 2 * spread * rng())
        delay = min(max_delay, delay * factor)


def call_with_retry(fn, *args, attempts=5, retry_on=(ConnectionError, TimeoutError), sleep=time.sleep, **kwargs):
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    delays = backoff_delays()
    last_error = None
    for attempt in range(1, attempts + 1):
        try:
            return fn(*args, **kwargs)
        except retry_on as e:
            last_error = e
            if attempt == attempts:
                break
            delay = next(delays)
            log.warning("attempt %d of %d failed (%s); retrying in %.2fs", attempt, attempts, e, delay)
            sleep(delay)
    raise RetryError(attempts, last_error)


def retry(attempts=5, retry_on=(ConnectionError, TimeoutError)):
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return call_with_retry(fn, *args, attempts=attempts, retry_on=retry_on, **kwargs)

        return wrapper

    return decorator


class CircuitBreaker:
    def __init__(self, failure_threshold=5, reset_after=30.0, clock=time.monotonic):
        self.failure_threshold = failure_threshold
        self.reset_after = reset_after
        self.clock = clock
        self.failures = 0
        self.opened_at = None

    @property
    def is_open(self):
        if self.opened_at is None:
            return False
        if self.clock() - self.opened_at >= self.reset_after:
            self.opened_at = None
            self.failures = 0
            return False
        return True

    def call(self, fn, *args, **kwargs):
        if self.is_open:
            raise RuntimeError("circuit open: not calling")
        try:
            result = fn(*args, **kwargs)
        except Exception:
            self.failures += 1
            if self.failures >= self.failure_threshold:
                self.opened_at = self.clock()
            raise
        self.failures = 0
        return result
