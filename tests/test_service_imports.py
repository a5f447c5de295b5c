"""Services import the core library (`specdec`), never each other, and the core library imports no
service: every import statement of every module, nested ones included, is read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("gateway", "primary_svc", "draft_svc", "validator_svc", "http_svc")
CORE = "specdec"


def imported_packages(path: Path) -> set[str]:
    """The top-level package of every absolute import in the module at path."""
    packages = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            packages.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            packages.add(node.module.split(".")[0])
    return packages


@pytest.mark.parametrize("package", [*SERVICES, CORE])
def test_a_package_imports_no_service_but_itself(package):
    others = set(SERVICES) - {package}
    crossings = sorted(
        f"{path.relative_to(REPO_ROOT)} imports {other}"
        for path in (REPO_ROOT / package).rglob("*.py")
        if "v1" not in path.parts
        for other in imported_packages(path) & others
    )
    assert crossings == []


def test_the_walk_sees_nested_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from gateway.stats import RequestStats\n    import draft_svc.pool\n")
    assert imported_packages(module) == {"os", "gateway", "draft_svc"}
