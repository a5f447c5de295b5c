"""A peer in a child process: replies over JSON lines, errors and crashes recorded, restarted after a crash."""

from __future__ import annotations

import sys
import textwrap

import pytest

from bench.peer_process import PeerCrashed, PeerProcess

# A stand-in worker speaking the same protocol: echoes the prompt, fails on an empty one,
# and dies of SIGSEGV (as llama.cpp's native code can) on max_new_tokens == 13.
WORKER = textwrap.dedent("""
    import json, os, signal, sys
    print(json.dumps({"systems": ["echo"]}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["max_new_tokens"] == 13:
            os.kill(os.getpid(), signal.SIGSEGV)
        if not req["prompt_ids"]:
            print(json.dumps({"error": "ValueError: empty prompt"}), flush=True)
            continue
        print(json.dumps({"token_ids": req["prompt_ids"][:req["max_new_tokens"]], "seconds": 0.5}), flush=True)
""")


@pytest.fixture
def peer(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    p = PeerProcess("echo", {}, worker=(sys.executable, str(script)))
    yield p
    p.close()


def test_replies_and_errors(peer):
    assert peer.systems == ("echo",)
    assert peer.run("echo", [5, 6, 7], 2) == ([5, 6], 0.5)
    with pytest.raises(RuntimeError, match="empty prompt"):
        peer.run("echo", [], 2)
    assert peer.run("echo", [8], 4) == ([8], 0.5)  # still serving after an error


def test_crash_is_an_error_and_the_next_call_restarts(peer):
    with pytest.raises(PeerCrashed, match="SIGSEGV"):
        peer.run("echo", [1], 13)
    assert peer.run("echo", [1, 2], 5) == ([1, 2], 0.5)


def test_a_peer_that_fails_to_load_says_why():
    with pytest.raises(RuntimeError, match="unknown peer"):
        PeerProcess("no-such-peer", {})
