"""The installable package: the wheel built from a copy of the sources (setup.py generates the gRPC
stubs into it), installed into a clean venv (no system site-packages) with pip, then `specdec serve`
from that venv answers one OpenAI chat request, and `specdec generate` / `specdec bench` are the
commands they stand for.

Offline and fast: the wheel is built without build isolation (the project venv has setuptools and
grpcio-tools) and installed with --no-deps; the project venv's site-packages is then put on the
clean venv's path by a .pth file, standing in for `pip install`'s download of the same pinned
dependencies, and the test checks that they satisfy every requirement the wheel declares."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import read_lines, stop

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("specdec", "gateway", "primary_svc", "draft_svc", "validator_svc", "http_svc", "bench", "protos")
SOURCE_FILES = (
    "pyproject.toml",
    "setup.py",
    "MANIFEST.in",
    "README.md",
    "inference.py",
    "scripts/gen_protos.py",
    "requirements.txt",
    "requirements-gpu.txt",
    "requirements-bench.txt",
    "requirements-dev.txt",
)
# A whole stack start (model load, verify-cost calibration) on a busy 2-core machine.
START_TIMEOUT_S = 900
# Every requirement of the wheel (extras aside) is met by what the clean venv sees; prints the misses.
CHECK_REQUIREMENTS = """
import importlib.metadata as md, sys
from packaging.requirements import Requirement
missing = []
for text in md.requires("specdec"):
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(f"{req} (absent)")
        continue
    if not req.specifier.contains(version, prereleases=True):
        missing.append(f"{req} (found {version})")
print("\\n".join(missing))
sys.exit(1 if missing else 0)
"""


def build_wheel(work: Path) -> Path:
    """The wheel of a copy of the sources without generated stubs (as a fresh clone has them)."""
    src = work / "src"
    for name in SOURCES:
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(src / "specdec" / "v1", ignore_errors=True)
    for name in SOURCE_FILES:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, src / name)
    assert not (src / "specdec" / "v1").exists()
    dist = work / "dist"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = dist.glob("specdec-*.whl")
    return wheel


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("package")
    wheel = build_wheel(work)
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return env_dir


def clean_env() -> dict[str, str]:
    """The caller's environment without anything that would put the repository on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def run_in(env_dir: Path, *argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(env_dir / "bin" / argv[0]), *argv[1:]],
        cwd=env_dir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_the_installed_package_carries_its_stubs_and_is_not_the_repository(clean_venv: Path) -> None:
    code = "import specdec, inference, specdec.v1.gateway_pb2 as g\n"
    code += "print(specdec.__file__, inference.__file__, g.__file__)"
    done = run_in(clean_venv, "python", "-c", code)
    assert done.returncode == 0, done.stderr
    assert all(path.startswith(str(clean_venv)) for path in done.stdout.split()), done.stdout


def test_the_dependencies_it_declares_are_all_satisfied(clean_venv: Path) -> None:
    done = run_in(clean_venv, "python", "-c", CHECK_REQUIREMENTS)
    assert done.returncode == 0, f"unmet requirements:\n{done.stdout}{done.stderr}"


def test_the_specdec_command_dispatches_to_each_command_line(clean_venv: Path) -> None:
    usage = run_in(clean_venv, "specdec")
    assert usage.returncode == 2 and "serve" in usage.stderr and "generate" in usage.stderr
    generate = run_in(clean_venv, "specdec", "generate", "--help")
    assert generate.returncode == 0 and "usage: specdec generate" in generate.stdout
    assert "--max-new-tokens" in generate.stdout and "--api-key-file" in generate.stdout
    serve = run_in(clean_venv, "specdec", "serve", "--http-port", "70000")
    assert serve.returncode == 2 and "--http-port" in serve.stderr
    bench = run_in(clean_venv, "specdec", "bench", "--help")
    assert bench.returncode == 0 and "--num-prompts" in bench.stdout
    unknown = run_in(clean_venv, "specdec", "nope")
    assert unknown.returncode == 2 and "unknown command 'nope'" in unknown.stderr


@pytest.fixture
def served(clean_venv: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(the HTTP API's URL, the file that holds the command's stderr)."""
    argv = [str(clean_venv / "bin" / "specdec"), "serve", "--http-port", "0", "--log-dir", str(tmp_path / "logs")]
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen(
            argv, cwd=clean_venv, env=clean_env(), stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    try:
        _gateway, http_url = read_lines(process, 2, START_TIMEOUT_S)
        yield http_url, tmp_path / "stderr"
    finally:
        stop(process)


def test_specdec_serve_from_the_clean_venv_answers_a_chat_request(served: tuple[str, Path]) -> None:
    url, stderr = served
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{url}/v1/models", timeout=60) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with opener.open(request, timeout=600) as response:
        answer = json.loads(response.read())
    assert response.status == 200
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0
    # The primary's start-up steps, relayed from its progress file to the command's terminal.
    assert "  primary: loading the " in stderr.read_text()
