"""The local cluster's services: each node's three, every gateway wired to all nodes; and the
command line that starts it."""

from __future__ import annotations

import os
import signal
import sys

import pytest

import inference
from inference import parse_args
from specdec import cluster
from specdec.cluster import cluster_specs, serve_cluster
from specdec.launcher import ServiceSpec, StackConfig, waves
from specdec.supervisor import RestartPolicy


def test_each_node_has_its_three_services_and_every_gateway_routes_to_all_nodes():
    specs = cluster_specs(StackConfig(redis_url="redis://x"), 2, 3, ("--owner_lease_s", "5"))
    by_name = {s.name: s for s in specs}
    node_services = [f"{s}-{i}" for s in ("primary", "draft", "validator") for i in (0, 1)]
    assert sorted(by_name) == sorted(node_services + ["gateway-0", "gateway-1", "gateway-2"])
    assert by_name["draft-1"].address_flags == (("--primary_address", "primary-1"),)
    assert by_name["primary-1"].depends_on == ("primary-0",)  # one primary calibrates at a time
    for g in range(3):
        gateway = by_name[f"gateway-{g}"]
        assert gateway.node_services == (
            ("primary-0", "draft-0", "validator-0"),
            ("primary-1", "draft-1", "validator-1"),
        )
        assert gateway.address_flags == () and "--primary_address" not in gateway.command
        assert gateway.command[-2:] == ("--owner_lease_s", "5")
    assert [s.name for s in waves(specs)[-1]] == ["gateway-0", "gateway-1", "gateway-2"]


def test_a_cluster_needs_redis_and_sane_counts():
    with pytest.raises(ValueError, match="redis_url"):
        cluster_specs(StackConfig(), 1, 2)
    with pytest.raises(ValueError, match="num_nodes"):
        cluster_specs(StackConfig(redis_url="redis://x"), 0, 1)


def test_the_command_line_takes_nodes_and_gateways_only_to_serve(capsys):
    args = parse_args(["--serve", "--nodes", "2", "--gateways", "2"])
    assert (args.nodes, args.gateways) == (2, 2)
    for argv in (["--prompt", "hi", "--nodes", "2"], ["--serve", "--prompt", "hi", "--gateways", "2"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--serve and no --prompt" in capsys.readouterr().err


def test_the_cluster_does_not_print_the_redis_password():
    """serve_cluster said which Redis it starts on with the --redis_url as given, password and all."""
    said: list[str] = []

    class Said(Exception):
        pass

    def say(line: str) -> None:
        said.append(line)
        raise Said  # before any service starts

    config = StackConfig(redis_url="redis://app:hunter2@10.0.0.9:6379/0")
    with pytest.raises(Said):
        serve_cluster(config, 2, 2, RestartPolicy(), say)
    assert said and "hunter2" not in said[0] and "redis://app:***@10.0.0.9:6379/0" in said[0]


# A fake service for serve_cluster: writes its pid to the file its first argument names, then
# serves grpc.health.v1 through the real serve().
PID_WRITING_SERVICE = """
import argparse, os, sys
p = argparse.ArgumentParser()
p.add_argument("--host")
p.add_argument("--port", type=int)
a, _ = p.parse_known_args(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
from specdec.service import ServerConfig, serve
serve(ServerConfig(host=a.host, port=a.port, grace_s=0.0), [])
"""


def test_a_service_given_up_fails_the_cluster_like_a_stack_with_its_error_on_stderr(tmp_path, monkeypatch, capsys):
    # Before, serve_cluster returned 1 (inference.py documents 3 for a service given up under
    # --serve) and said the error through say(), which --quiet silences: it exited without a word.
    pid_file = tmp_path / "a.pid"
    spec = ServiceSpec("a", (sys.executable, "-c", PID_WRITING_SERVICE, str(pid_file)))
    monkeypatch.setattr(cluster, "cluster_specs", lambda *_args: (spec,))

    def quiet(msg: str) -> None:  # --quiet; once serving, the service dies for good
        if msg.startswith("serving"):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)

    config = StackConfig(redis_url="redis://unused", log_dir=tmp_path / "logs", stop_grace_s=2.0)
    code = cluster.serve_cluster(config, 1, 1, RestartPolicy(max_rapid_restarts=0), quiet, lambda _line: None)
    assert code == inference.EXIT_STACK_FAILED
    err = capsys.readouterr().err
    assert "error: service 'a' was killed by SIGKILL; gave up after 0 restarts in a row" in err


def test_the_http_port_is_refused_for_a_cluster_which_runs_no_http_api(capsys):
    # A cluster serves its gateways only: the port was silently unused.
    for argv in (
        ["--serve", "--nodes", "2", "--http_port", "9000"],
        ["--serve", "--gateways", "2", "--http-port", "1"],
    ):
        with pytest.raises(SystemExit) as raised:
            parse_args(argv)
        assert raised.value.code == inference.EXIT_BAD_FLAGS
        assert "--http_port: a cluster" in capsys.readouterr().err
    assert parse_args(["--serve", "--http_port", "9000"]).http_port == 9000
