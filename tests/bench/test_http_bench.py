"""python -m bench http runs end to end (tiny sizes) and prints its table."""

from __future__ import annotations

import pytest

from bench import http as bench_http

pytestmark = pytest.mark.e2e


def test_the_http_benchmark_prints_both_paths_at_each_concurrency(capsys: pytest.CaptureFixture[str]) -> None:
    bench_http.main(["--num_requests", "8", "--num_rounds", "1", "--concurrency", "1,2", "--num_tokens", "4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert [row.split(" | ")[1].split(" (")[0] for row in rows] == ["per request", "per streamed token"] * 2
