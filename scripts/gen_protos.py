"""Generate the Python gRPC stubs of protos/specdec/v1/*.proto into specdec/v1/.

Run from anywhere with the project's venv: `.venv/bin/python scripts/gen_protos.py`.
The stubs are build outputs (gitignored); the import path follows the proto
package, so code writes `from specdec.v1 import primary_pb2, primary_pb2_grpc`.
"""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = Path("specdec") / "v1"
INIT_TEXT = '"""Generated gRPC stubs of protos/specdec/v1 (scripts/gen_protos.py); do not edit."""\n'


def generate(repo_root: Path = REPO_ROOT) -> list[Path]:
    """Regenerate every stub from scratch (stale stubs of deleted protos go too)."""
    proto_root = repo_root / "protos"
    out_dir = repo_root / PACKAGE_DIR
    protos = sorted((proto_root / PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {proto_root / PACKAGE_DIR}")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    # grpc_tools ships google/protobuf/*.proto; include it so well-known types resolve.
    well_known = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={repo_root}",
        f"--pyi_out={repo_root}",
        f"--grpc_python_out={repo_root}",
        *(str(p.relative_to(proto_root)) for p in protos),
    ]
    # protoc resolves relative proto paths against -I, independent of the cwd.
    status = protoc.main(args)
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    (out_dir / "__init__.py").write_text(INIT_TEXT)
    return sorted(out_dir.iterdir())


def main() -> int:
    written = generate()
    print(f"generated {len(written)} files in {REPO_ROOT / PACKAGE_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
