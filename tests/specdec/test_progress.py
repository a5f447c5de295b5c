"""specdec.progress: the JSON-lines protocol between a starting service and its launcher, and the
lines the launcher prints from it."""

from __future__ import annotations

from pathlib import Path

from specdec.progress import ProgressEvent, ProgressPrinter, ProgressReader, ProgressWriter, progress_callback


def test_events_written_by_the_service_are_read_once_in_order(tmp_path: Path) -> None:
    path = tmp_path / "primary.progress"
    reader = ProgressReader(path)
    assert reader.read_new() == []  # nothing written yet
    write = ProgressWriter(path)
    write("converting GGUF tensors", 1, 272)
    write("choosing the weight format", 0, 3, "timing int4")
    assert reader.read_new() == [
        ProgressEvent("converting GGUF tensors", 1, 272),
        ProgressEvent("choosing the weight format", 0, 3, "timing int4"),
    ]
    assert reader.read_new() == []
    write("converting GGUF tensors", 272, 272)
    write.close()
    assert reader.read_new() == [ProgressEvent("converting GGUF tensors", 272, 272)]


def test_a_half_written_line_waits_and_a_foreign_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "p"
    path.write_bytes(b'not json\n{"stage": "a", "done": 1, "total": 2}\n{"stage": "a", "do')
    reader = ProgressReader(path)
    assert reader.read_new() == [ProgressEvent("a", 1, 2)]
    with open(path, "ab") as f:
        f.write(b'ne": 2, "total": 2}\n{"stage": 3}\n')
    assert reader.read_new() == [ProgressEvent("a", 2, 2)]


def test_an_empty_path_reports_nowhere(tmp_path: Path) -> None:
    progress_callback("")("stage", 1, 2)  # the no-op: no file, no error
    assert list(tmp_path.iterdir()) == []


def test_the_printer_says_a_stage_at_its_start_each_quarter_and_its_end() -> None:
    lines: list[str] = []
    printer = ProgressPrinter(lines.append)
    for done in range(1, 273):
        printer("primary", ProgressEvent("converting GGUF tensors", done, 272))
    printer("primary", ProgressEvent("choosing the weight format", 0, 2, "timing int4"))
    printer("primary", ProgressEvent("choosing the weight format", 1, 2, "timing int8"))
    printer("primary", ProgressEvent("choosing the weight format", 2, 2, "chose int4"))
    printer("primary", ProgressEvent("timing the verify passes", 0, 0))
    assert lines == [
        "  primary: converting GGUF tensors 1/272 (0 %)",
        "  primary: converting GGUF tensors 68/272 (25 %)",
        "  primary: converting GGUF tensors 136/272 (50 %)",
        "  primary: converting GGUF tensors 204/272 (75 %)",
        "  primary: converting GGUF tensors 272/272 (100 %)",
        "  primary: choosing the weight format 0/2 (0 %): timing int4",
        "  primary: choosing the weight format 1/2 (50 %): timing int8",
        "  primary: choosing the weight format 2/2 (100 %): chose int4",
        "  primary: timing the verify passes",
    ]
