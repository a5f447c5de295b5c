"""Deterministic selection of benchmark prompts from the JSONL sets (json, code, prose, specbench)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

# The prompt sets that ship with the repository (bench/data/README.md: sources and licences), so the
# benchmarks run on a fresh clone; every benchmark's --data-dir takes another folder of the same files.
DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclasses.dataclass(frozen=True, slots=True)
class BenchPrompt:
    id: str
    scenario: str
    prompt: str
    system: str | None
    schema: dict | None
    is_completion: bool  # HumanEval-style stubs are fed raw, without the chat template

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": self.prompt}]

    def text(self, tokenizer: Any) -> str:
        return self.prompt if self.is_completion else tokenizer.apply_chat_template(self.messages())

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The prompt as the service encodes it (gateway.chat.PromptEncoder): a rendered chat as its
        template writes it, a raw prompt after the BOS where the model takes one."""
        if self.is_completion:
            return tokenizer.encode_prompt(self.prompt)
        return tokenizer.encode(self.text(tokenizer))


def check_scenarios(parser: argparse.ArgumentParser, scenarios: str, data_dir: str | Path) -> None:
    """A usage error (exit 2) naming each entry of the comma list `scenarios` that has no prompt file
    in `data_dir`, and the ones there are, before anything starts (a traceback after a stack started,
    before)."""
    available = sorted(path.stem for path in Path(data_dir).glob("*.jsonl"))
    unknown = [s for s in scenarios.split(",") if s and s not in available]
    if unknown:
        parser.error(
            f"--scenarios: no prompt file for {', '.join(unknown)} in {data_dir} (there are: {', '.join(available)})"
        )


def load_prompts(
    data_dir: str | Path, scenarios: list[str], num_prompts: int, max_chars: int | None = None
) -> list[BenchPrompt]:
    """The first `num_prompts` rows of each scenario file (in file order) that fit `max_chars`.

    Rows are taken in file order so every run and every system sees the same prompts.
    """
    out: list[BenchPrompt] = []
    for scenario in scenarios:
        text = (Path(data_dir) / f"{scenario}.jsonl").read_text(encoding="utf-8")
        rows = [json.loads(line) for line in text.split("\n") if line.strip()]  # "\n" only: prompts hold U+2028
        chosen = [r for r in rows if max_chars is None or len(r["prompt"]) <= max_chars][:num_prompts]
        out.extend(
            BenchPrompt(
                r["id"], scenario, r["prompt"], r.get("system"), r.get("schema"), r.get("prompt_style") == "completion"
            )
            for r in chosen
        )
    return out
