"""The prompt sets the benchmarks read by default ship with the repository, in the row format they load."""

from __future__ import annotations

from pathlib import Path

from bench.prompts import DEFAULT_DATA_DIR, load_prompts
from bench.suite import SuiteConfig

REPOSITORY = Path(__file__).resolve().parents[2]


def test_the_default_scenarios_read_the_shipped_prompts():
    config = SuiteConfig()
    assert config.data_dir == DEFAULT_DATA_DIR == REPOSITORY / "bench" / "data"  # nothing outside the clone
    assert (DEFAULT_DATA_DIR / "README.md").is_file()  # sources and licences travel with the rows
    prompts = load_prompts(DEFAULT_DATA_DIR, list(config.scenarios), num_prompts=2)
    assert [p.scenario for p in prompts] == [s for s in config.scenarios for _ in range(2)]
    assert all(p.prompt for p in prompts)
    assert any(p.schema for p in prompts if p.scenario == "json")
