"""Builds the package (pyproject.toml holds the metadata): generates the gRPC stubs of protos/
into specdec/v1/ first, so that the wheel carries them (they are build outputs, not in git)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
STUBS_PACKAGE = "specdec.v1"


class BuildPyWithStubs(build_py):
    """build_py that runs scripts/gen_protos.py (grpcio-tools, a build requirement) beforehand."""

    def run(self) -> None:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py")], check=True)
        # Package discovery ran before the stubs existed in a fresh clone: add their package.
        if self.packages is not None and STUBS_PACKAGE not in self.packages:
            self.packages.append(STUBS_PACKAGE)
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
