"""Progress of a service's slow start-up steps (the GGUF conversion, the weight-format autotune),
relayed to the terminal of whoever launched it: services log to files, so a progress bar on their
own stderr would reach nobody.

The protocol is a JSON-lines file the launcher names (`--progress_file`): the service appends one
line per event, the launcher reads the complete lines it has not seen while it waits for SERVING.

    {"stage": "converting GGUF tensors", "done": 136, "total": 272}
    {"stage": "measuring weight formats", "done": 1, "total": 3, "detail": "int8"}

`done == total` ends a stage; total 0 is a step without a count.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

# Whole-percent steps at which a relayed stage prints a line (and its start and end).
PERCENT_STEP = 25


class ProgressCallback(Protocol):
    def __call__(self, stage: str, done: int, total: int, detail: str = "") -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ProgressEvent:
    stage: str
    done: int
    total: int
    detail: str = ""

    @property
    def is_final(self) -> bool:
        return self.total > 0 and self.done >= self.total

    @property
    def percent(self) -> int:
        return 100 * self.done // self.total if self.total > 0 else 0


def no_progress(stage: str, done: int, total: int, detail: str = "") -> None:
    """The callback when nobody listens."""


class ProgressWriter:
    """The service's end: a ProgressCallback that appends events to the file (flushed per event)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: IO[str] | None = None

    def __call__(self, stage: str, done: int, total: int, detail: str = "") -> None:
        if self._file is None:
            self._file = open(self._path, "a", encoding="utf-8")
        event = {"stage": stage, "done": done, "total": total, **({"detail": detail} if detail else {})}
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def progress_callback(path: str) -> ProgressCallback:
    """A writer for `--progress_file PATH`; the no-op for an empty path."""
    return ProgressWriter(Path(path)) if path else no_progress


class ProgressReader:
    """The launcher's end: the complete events appended since the last read (a half-written last
    line waits for the next read; a line that is not an event is skipped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read_new(self) -> list[ProgressEvent]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        return [e for line in data[:end].splitlines() if (e := parse_event(line)) is not None]


def parse_event(line: bytes) -> ProgressEvent | None:
    try:
        raw = json.loads(line)
        event = ProgressEvent(str(raw["stage"]), int(raw["done"]), int(raw["total"]), str(raw.get("detail", "")))
    except (ValueError, KeyError, TypeError):
        return None
    return event


class ProgressPrinter:
    """Turns relayed events into terminal lines: a stage's start, every PERCENT_STEP %, its end."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._last_step: dict[tuple[str, str], int] = {}

    def __call__(self, service: str, event: ProgressEvent) -> None:
        key = (service, event.stage)
        step = event.percent // PERCENT_STEP
        if key in self._last_step and step == self._last_step[key] and not event.detail and not event.is_final:
            return
        self._last_step[key] = step
        count = f" {event.done}/{event.total} ({event.percent} %)" if event.total else ""
        detail = f": {event.detail}" if event.detail else ""
        self._say(f"  {service}: {event.stage}{count}{detail}")
