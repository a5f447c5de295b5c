"""specdec.redis_server: the one throwaway redis-server of the test suite and the benchmark."""

from __future__ import annotations

import os
import shutil

import pytest
import redis

from specdec.redis_server import redis_server

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def test_it_answers_on_its_socket_and_leaves_nothing_behind():
    with redis_server() as server:
        assert server.url == f"unix://{server.socket_path}"
        with redis.Redis.from_url(server.url) as client:
            assert client.ping() and client.set("k", "v")
        os.kill(server.pid, 0)  # running
    assert not os.path.exists(os.path.dirname(server.socket_path))
    with pytest.raises(ProcessLookupError):  # terminated and reaped
        os.kill(server.pid, 0)
