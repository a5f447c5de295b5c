"""Token-bucket rate limiting per client, with a shared clock for tests."""

import threading
import time


class TokenBucket:
    def __init__(self, rate, burst, clock=time.monotonic):
        if rate <= 0:
            raise ValueError("rate must be positive")
        if burst < 1:
            raise ValueError("burst must be at least 1")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.updated_at = clock()
        self.lock = threading.Lock()

    def _refill(self):
        now = self.clock()
        elapsed = now - self.updated_at
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
        self.updated_at = now

    def try_acquire(self, cost=1):
        with self.lock:
            self._refill()
            if self.tokens >= cost:
                self.tokens -= cost
                return True
            return False

    def wait_time(self, cost=1):
        with self.lock:
            self._refill()
            missing = cost - self.tokens
            return max(0.0, missing / self.rate)

    def acquire(self, cost=1, timeout=None):
        deadline = None if timeout is None else self.clock() + timeout
        while not self.try_acquire(cost):
            delay = self.wait_time(cost)
            if deadline is not None and self.clock() + delay > deadline:
                return False
            time.sleep(delay)
        return True


class ClientLimiter:
    def __init__(self, rate, burst, max_clients=10000):
        self.rate = rate
        self.burst = burst
        self.max_clients = max_clients
        self.buckets = {}
        self.lock = threading.Lock()

    def bucket_for(self, client_id):
        with self.lock:
            bucket = self.buckets.get(client_id)
            if bucket is None:
                if len(self.buckets) >= self.max_clients:
                    oldest = min(self.buckets, key=lambda c: self.buckets[c].updated_at)
                    del self.buckets[oldest]
                bucket = TokenBucket(self.rate, self.burst)
                self.buckets[client_id] = bucket
            return bucket

    def allow(self, client_id, cost=1):
        return self.bucket_for(client_id).try_acquire(cost)

    def retry_after(self, client_id, cost=1):
        return self.bucket_for(client_id).wait_time(cost)


def limited(limiter, client_of):
    def decorator(handler):
        def wrapper(request, *args, **kwargs):
            client_id = client_of(request)
            if not limiter.allow(client_id):
                seconds = limiter.retry_after(client_id)
                return {"status": 429, "retry_after": round(seconds, 3)}
            return handler(request, *args, **kwargs)

        return wrapper

    return decorator
