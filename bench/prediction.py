"""python -m bench prediction: Predicted Outputs on editing tasks, tokens/s with and without the prediction.

Each task (bench/data/prediction/tasks.jsonl) asks the model to apply a small change to a source file
of 70-100 lines (a rename, a docstring, a default) and to write the whole edited file (a chat
request whose answer starts inside a code block, EditTask.prompt, ending at the closing fence);
greedy, with max_new_tokens the file's tokens plus EDIT_ROOM. Four systems per task on one stack:

    plain        speculation off: the primary alone (the baseline of every speedup)
    speculative  the product defaults without a prediction (adaptive controller, default decoders)
    prediction   the same with the file as the prediction (GenerateRequest.prediction)
    exact        the same with plain's own output as the prediction: a prediction that is right
                 token for token, the ceiling of the mechanism whatever the model writes

Printed per task and in all: output tokens, tokens/s of each system (output tokens / client wall
time), the prediction's speedup over plain and over speculative, accepted and rejected prediction
tokens (GenerationStats), steps, mean accepted length (tokens per step) and whether all three
outputs are the same tokens (greedy exactness; they must be).

    python -m bench prediction [--num-tasks 6] [--precision auto] [--num-threads 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from bench.stack import REQUEST_TIMEOUT_S, SystemUnderTest, system_under_test
from specdec.flag_spellings import add_spellings
from specdec.v1 import gateway_pb2

DEFAULT_DATA_DIR = Path(__file__).parent / "data" / "prediction"
EDIT_ROOM = 64  # output tokens beyond the file's own: the code fence and the edit
SYSTEMS = ("plain", "speculative", "prediction", "exact")
STOP = "```"  # the edited file's closing fence ends the answer
MAX_CONTEXT = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class EditTask:
    id: str
    file: str
    instruction: str
    source: str

    def prompt(self, tokenizer: Any) -> str:
        """The chat request, rendered with the model's template, and the start of the answer: the
        default model (135M parameters) asked in chat to edit a file mostly writes prose about it;
        started inside a code block it writes the file, which ends at the closing fence (the
        request's stop string)."""
        request = f"{self.instruction} Output the complete edited file.\n\n```python\n{self.source}```"
        return tokenizer.apply_chat_template([{"role": "user", "content": request}]) + "```python\n"


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    token_ids: tuple[int, ...]
    text: str
    seconds: float
    stats: gateway_pb2.GenerationStats

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


def load_tasks(data_dir: Path, num_tasks: int) -> list[EditTask]:
    tasks = []
    for line in (data_dir / "tasks.jsonl").read_text().splitlines()[:num_tasks]:
        row = json.loads(line)
        tasks.append(EditTask(row["id"], row["file"], row["instruction"], (data_dir / row["file"]).read_text()))
    return tasks


def run(
    sut: SystemUnderTest, prompt: str, task: EditTask, system: str, max_new_tokens: int, plain_text: str = ""
) -> Run:
    """One greedy request of `system` (SYSTEMS), timed by the client; `plain_text` is the exact system's
    prediction."""
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, stop=[STOP])
    if system == "plain":
        req.speculation.is_enabled = False
    elif system == "prediction":
        req.prediction.content = task.source
    elif system == "exact":
        req.prediction.content = plain_text
    started = time.perf_counter()
    response = sut.stub.Generate(req, timeout=REQUEST_TIMEOUT_S)
    return Run(tuple(response.token_ids), response.text, time.perf_counter() - started, response.stats)


def task_row(task: EditTask, runs: dict[str, Run]) -> dict[str, Any]:
    plain, speculative, predicted, exact = (runs[s] for s in SYSTEMS)
    stats = predicted.stats
    return {
        "task": task.id,
        "num_tokens": len(predicted.token_ids),
        **{f"{s}_tok_s": round(runs[s].tokens_per_second, 1) for s in SYSTEMS},
        "speedup_vs_plain": round(predicted.tokens_per_second / plain.tokens_per_second, 2),
        "speedup_vs_speculative": round(predicted.tokens_per_second / speculative.tokens_per_second, 2),
        "accepted_prediction": stats.num_accepted_prediction_tokens,
        "rejected_prediction": stats.num_rejected_prediction_tokens,
        "num_steps": stats.num_steps,
        "mean_accepted_length": round(stats.mean_accepted_length, 2),
        "exact_speedup_vs_plain": round(exact.tokens_per_second / plain.tokens_per_second, 2),
        "exact_accepted_prediction": exact.stats.num_accepted_prediction_tokens,
        "exact_mean_accepted_length": round(exact.stats.mean_accepted_length, 2),
        "is_exact": plain.token_ids == speculative.token_ids == predicted.token_ids == exact.token_ids,
        "draft_lengths": list(stats.num_steps_by_draft_length),
        "speculative_mean_accepted_length": round(speculative.stats.mean_accepted_length, 2),
        "decoders": {d.name: [d.num_proposed, d.num_accepted] for d in stats.decoders},
        "text": predicted.text,
    }


def total_row(rows: list[dict[str, Any]], all_runs: list[dict[str, Run]]) -> dict[str, Any]:
    """Tokens over seconds summed over the tasks (a long task weighs by its length)."""
    rates = {s: sum(len(r[s].token_ids) for r in all_runs) / sum(r[s].seconds for r in all_runs) for s in SYSTEMS}
    num_steps = sum(r["num_steps"] for r in rows)
    num_exact_steps = sum(r["exact"].stats.num_steps for r in all_runs)

    def step_tokens(system: str) -> float:  # each answer's tokens and the end token its last step decoded
        return sum(r[system].stats.mean_accepted_length * r[system].stats.num_steps for r in all_runs)

    return {
        "task": "all",
        "num_tokens": sum(r["num_tokens"] for r in rows),
        **{f"{s}_tok_s": round(rates[s], 1) for s in SYSTEMS},
        "speedup_vs_plain": round(rates["prediction"] / rates["plain"], 2),
        "speedup_vs_speculative": round(rates["prediction"] / rates["speculative"], 2),
        "accepted_prediction": sum(r["accepted_prediction"] for r in rows),
        "rejected_prediction": sum(r["rejected_prediction"] for r in rows),
        "num_steps": num_steps,
        "mean_accepted_length": round(step_tokens("prediction") / max(1, num_steps), 2),
        "exact_speedup_vs_plain": round(rates["exact"] / rates["plain"], 2),
        "exact_accepted_prediction": sum(r["exact_accepted_prediction"] for r in rows),
        "exact_mean_accepted_length": round(step_tokens("exact") / max(1, num_exact_steps), 2),
        "is_exact": all(r["is_exact"] for r in rows),
    }


COLUMNS = (
    ("task", "task"),
    ("num_tokens", "tokens"),
    ("plain_tok_s", "plain tok/s"),
    ("speculative_tok_s", "spec. tok/s"),
    ("prediction_tok_s", "pred. tok/s"),
    ("speedup_vs_plain", "x plain"),
    ("speedup_vs_speculative", "x spec."),
    ("accepted_prediction", "accepted"),
    ("rejected_prediction", "rejected"),
    ("num_steps", "steps"),
    ("mean_accepted_length", "tok/step"),
    ("exact_tok_s", "exact-pred. tok/s"),
    ("exact_speedup_vs_plain", "exact-pred. x plain"),
    ("exact_accepted_prediction", "exact-pred. accepted"),
    ("exact_mean_accepted_length", "exact-pred. tok/step"),
    ("is_exact", "same output"),
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(row[key]) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--num-tasks", type=int, default=6)
    p.add_argument("--precision", default="auto")
    p.add_argument("--num-threads", type=int, default=0, help="the primary's torch threads (0: torch's default)")
    p.add_argument("--out", default=None, help="also write the rows and settings as JSON here")
    args = add_spellings(p).parse_args()

    from specdec.model.loader import default_cache_dir, resolve_model_dir
    from specdec.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_dir(None, default_cache_dir()))
    tasks = load_tasks(Path(args.data_dir), args.num_tasks)
    rows, all_runs = [], []
    with system_under_test(args.precision, args.num_threads, MAX_CONTEXT) as sut:
        warm_up = EditTask("warm-up", "", "Say hi.", "")
        run(sut, warm_up.prompt(tokenizer), warm_up, "plain", 8)
        run(sut, warm_up.prompt(tokenizer), warm_up, "speculative", 8)
        for task in tasks:
            max_new_tokens = len(tokenizer.encode(task.source)) + EDIT_ROOM
            prompt = task.prompt(tokenizer)
            runs: dict[str, Run] = {}
            for system in SYSTEMS:
                plain_text = runs["plain"].text if "plain" in runs else ""
                runs[system] = run(sut, prompt, task, system, max_new_tokens, plain_text)
            rows.append(task_row(task, runs))
            all_runs.append(runs)
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "text"}), flush=True)
    table = [*rows, total_row(rows, all_runs)]
    print()
    print(markdown_table(table))
    if args.out:
        settings = {"precision": args.precision, "num_threads": args.num_threads, "edit_room": EDIT_ROOM}
        Path(args.out).write_text(json.dumps({"settings": settings, "rows": table}, indent=2))


if __name__ == "__main__":
    main()
