"""The lock files (`make lock`) against the requirements they pin: every requirement of
requirements*.txt has exactly one pinned version in the locks that install it, the pin satisfies
it, and every pin carries a hash (pip's --require-hashes refuses anything else). The CPU lock has
the CPU build of torch and no CUDA libraries; the CUDA one the CUDA build and CuPy; no lock that
an image runs from carries the stub generator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[1]
# lock -> the requirement files it pins
LOCKS = {
    "requirements-cpu.lock": ("requirements.txt",),
    "requirements-dev.lock": ("requirements.txt", "requirements-bench.txt", "requirements-dev.txt"),
    "requirements-cuda.lock": ("requirements.txt", "requirements-gpu.txt"),
}
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+) \\$")


def pins(lock: str) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) of every package in a lock."""
    lines = (REPO_ROOT / lock).read_text().splitlines()
    found: dict[str, tuple[str, int]] = {}
    for i, line in enumerate(lines):
        if (m := PIN.match(line)) is None:
            continue
        name = canonicalize_name(m.group(1))
        assert name not in found, f"{lock}: {name} pinned twice"
        num_hashes = 0
        for follow in lines[i + 1 :]:
            if not follow.strip().startswith("--hash=sha256:"):
                break
            num_hashes += 1
        found[name] = (m.group(2), num_hashes)
    return found


def requirements(path: str) -> list[Requirement]:
    text = (REPO_ROOT / path).read_text()
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_requirement_is_pinned_with_hashes(lock: str) -> None:
    pinned = pins(lock)
    assert pinned and all(num_hashes > 0 for _, num_hashes in pinned.values()), lock
    for source in LOCKS[lock]:
        for req in requirements(source):
            name = canonicalize_name(req.name)
            assert name in pinned, f"{lock} does not pin {req} ({source}): run `make lock`"
            version = pinned[name][0]
            assert req.specifier.contains(version, prereleases=True), f"{lock}: {name}=={version} vs {req}"


def test_the_cpu_lock_has_the_cpu_torch_and_the_cuda_lock_the_cuda_one() -> None:
    cpu, cuda = pins("requirements-cpu.lock"), pins("requirements-cuda.lock")
    assert cpu["torch"][0].endswith("+cpu") and not any(name.startswith("nvidia-") for name in cpu)
    assert "+" not in cuda["torch"][0] and any(name.startswith("nvidia-cuda") for name in cuda)
    assert "cupy-cuda13x" in cuda and "cupy-cuda13x" not in cpu
    assert pins("requirements-dev.lock")["torch"] == cpu["torch"]  # CI tests what the CPU image runs


def test_the_images_locks_carry_no_stub_generator() -> None:
    for lock in ("requirements-cpu.lock", "requirements-cuda.lock"):
        assert "grpcio-tools" not in pins(lock), lock
