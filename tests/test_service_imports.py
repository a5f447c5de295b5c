"""Services import the core library (`specdec`), never each other, and the core library imports no
service: every import statement of every module, nested ones included, is read from the source."""

from __future__ import annotations

import ast
import subprocess
import sys
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


def test_the_validator_starts_without_the_grammar_engine() -> None:
    # It needs only the packed token masks (specdec.grammar.bitmask); xgrammar with what it pulls in
    # (ml_dtypes, tvm_ffi, transformers) is 1.6-1.9 s of every start-up of a service that loads it.
    code = (
        "import sys, validator_svc.__main__; print(sorted(m for m in ('xgrammar', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_grammar_package_exports_its_names_when_read() -> None:
    import specdec.grammar as grammar
    from specdec.grammar.state import GrammarState

    assert grammar.GrammarState is GrammarState and "GrammarState" in dir(grammar)
    for name in grammar.__all__:  # each name's module holds it
        assert getattr(grammar, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        grammar.Nothing  # noqa: B018 - the read is the test
