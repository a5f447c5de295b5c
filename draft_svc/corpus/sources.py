"""The documents a corpus index is built from: text that ships on every machine the services run on.

Sources, read in this order (a corpus is cut at its token budget, so the small ones come first):

    docs    Python's own documentation: the Language Reference topics that `help()` shows
            (`pydoc_data/topics.py` in the standard library), one document per topic;
            ~110k tokens of English prose. PSF License 2.0.
    json    The JSON Schema meta-schemas of `jsonschema-specifications` (installed with jsonschema,
            a requirement of the services), one document per file; ~15k tokens of JSON. MIT.
    python  The standard library's `.py` files (PSF License 2.0), then the installed packages'
            (site-packages, each under its own licence, read only on the machine that has them),
            sorted by path, test folders skipped; ~12 MB of standard library alone.

Extra paths (files, or folders read recursively for TEXT_SUFFIXES) come last. Nothing is
downloaded: every file is found through the running interpreter's own paths.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

SOURCES = ("docs", "json", "python")
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json")
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"})
MAX_FILE_BYTES = 1 << 20  # larger files are generated tables, not code anyone writes


@dataclasses.dataclass(frozen=True, slots=True)
class SourceFile:
    path: Path
    source: str  # one of SOURCES, or "path" for an extra path
    num_bytes: int
    mtime_ns: int

    @property
    def identity(self) -> str:
        """What the cached index depends on: a changed file gets a new index."""
        return f"{self.source}\0{self.path}\0{self.num_bytes}\0{self.mtime_ns}"


def source_files(sources: Sequence[str], paths: Sequence[Path], max_bytes: int) -> list[SourceFile]:
    """The files of `sources` then `paths`, in reading order, until they hold max_bytes."""
    if unknown := set(sources) - set(SOURCES):
        raise ValueError(f"corpus sources {sorted(unknown)} are not among {SOURCES}")
    files: list[SourceFile] = []
    num_bytes = 0
    candidates = [(name, p) for name in SOURCES if name in sources for p in _source_paths(name)]
    candidates += [("path", p) for path in paths for p in _text_files(Path(path))]
    for source, path in candidates:
        if num_bytes >= max_bytes:
            break
        stat = path.stat()
        if stat.st_size == 0 or (source == "python" and stat.st_size > MAX_FILE_BYTES):
            continue
        files.append(SourceFile(path, source, stat.st_size, stat.st_mtime_ns))
        num_bytes += stat.st_size
    return files


def documents(file: SourceFile) -> list[str]:
    """The documents of one file: the docs source's topics, else the file's text."""
    if file.source == "docs":  # `topics = {name: text, ...}`, read as a literal, not executed
        tree = ast.parse(file.path.read_text(encoding="utf-8"))
        topics = next(
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["topics"]
        )
        return [topics[name] for name in sorted(topics)]
    return [file.path.read_text(encoding="utf-8", errors="replace")]


def _source_paths(name: str) -> Iterator[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if name == "docs":
        path = stdlib / "pydoc_data" / "topics.py"
        if path.is_file():
            yield path
    elif name == "json":
        for location in _package_locations("jsonschema_specifications"):
            yield from sorted(p for p in (location / "schemas").rglob("*") if p.is_file())
    elif name == "python":
        yield from _text_files(stdlib, suffixes=(".py",))
        for packages in dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")):
            yield from _text_files(Path(packages), suffixes=(".py",))


def _package_locations(package: str) -> list[Path]:
    """Where an installed package's files are, found without importing it."""
    spec = importlib.util.find_spec(package)
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []


def _text_files(root: Path, suffixes: Sequence[str] = TEXT_SUFFIXES) -> Iterator[Path]:
    """A file, or a folder's files with one of `suffixes`, sorted by path, test folders skipped."""
    if root.is_file():
        yield root
        return
    if not root.is_dir():
        raise FileNotFoundError(f"corpus path {str(root)!r} is neither a file nor a folder")
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(names):
            if name.endswith(tuple(suffixes)):
                yield Path(folder) / name
