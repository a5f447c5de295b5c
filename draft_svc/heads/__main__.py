"""python -m draft_svc.heads train --model MODEL --out FILE: train the feature drafter for a model.

1. The primary (in process, the serving precision) answers training prompts (draft_svc/heads/data.py:
   sources that ship with Python, no benchmark set), greedy and sampled, keeping every row's feature.
2. The drafter's vocabulary: the N tokens the primary chose most often (coverage of 2k..16k printed).
3. The drafter trains on those answers (draft_svc/heads/train.py) and is checked on a validation split
   (top-1 / top-4 agreement with the primary's greedy token, per draft depth).
4. The file (draft_svc/heads/file.py) records the config, vocabulary, the model's fingerprint, the
   data's sources and licences and size, the accuracy and this command.

python -m draft_svc.heads answers --model MODEL --out FILE: step 1 alone, the answers kept as the
model's own answers file (specdec/answers.py) that the primary drafts runs from; with the --data of
a train run, the answers that drafter was trained on.

Seeds are fixed: the same command on the same machine gives the same data and the same drafter
up to the floating-point order of its threads.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from typing import NoReturn
from pathlib import Path

import torch
from tqdm import tqdm

from draft_svc.heads import data, file, generate, train
from draft_svc.heads.model import DrafterConfig, FeatureDrafter, shared_parts
from specdec.answers import save_answers
from specdec.model.config import ModelConfig
from specdec.model.fingerprint import model_fingerprint
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import LoadedModel, load_model, set_num_threads
from specdec.grammar.compiler import GrammarCache
from specdec.grammar.tokenizer_info import GrammarTokenizerInfo
from specdec.model import native
from specdec.model.loader import default_cache_dir, resolve_model_dir
from specdec.model.tokenizer import Tokenizer
from specdec.flag_spellings import add_spellings
from specdec.flags import EXIT_BAD_CONFIG

COVERAGE_SIZES = (2048, 4096, 8192, 16384)
MAX_POSITIONS = 2048  # the primary's context while it answers the training prompts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m draft_svc.heads", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a feature drafter on the primary's own answers")
    t.add_argument("--out", type=Path, required=True, help="the drafter file to write (.safetensors)")
    a = sub.add_parser("answers", help="write the primary's own answers as the file its runs draft from")
    a.add_argument("--out", type=Path, required=True, help="the answers file to write (.safetensors)")
    defaults = train.TrainSettings()
    for p in (t, a):
        p.add_argument("--model", default=None, help="model directory or GGUF (default: the default model)")
        p.add_argument("--precision", default="int4", help="the primary's precision while it answers (serve it so)")
        p.add_argument("--tokens", type=int, default=600_000, help="answer tokens to generate")
        p.add_argument("--prompts", type=int, default=12000, help="training prompts to draw from")
        p.add_argument("--batch", type=int, default=48, help="sequences per forward while generating")
        p.add_argument("--max_new_tokens", type=int, default=192)
        p.add_argument("--seed", type=int, default=defaults.seed)
        p.add_argument(
            "--data", type=Path, default=None, help="keep the generated answers here (.npz), reused when it exists"
        )
        p.add_argument("--num_threads", type=int, default=0, help="0: every core")
    t.add_argument("--vocab", type=int, default=defaults.draft_vocab_size, help="N: the drafter's vocabulary")
    t.add_argument("--depth", type=int, default=defaults.depth, help="draft steps unrolled in training")
    t.add_argument("--epochs", type=int, default=defaults.epochs)
    t.add_argument("--lr", type=float, default=defaults.lr, help="AdamW's peak learning rate (cosine decay)")
    t.add_argument(
        "--batch_tokens", type=int, default=defaults.batch_tokens, help="training rows (answer tokens) per step"
    )
    t.add_argument(
        "--cls_weight", type=float, default=defaults.cls_weight, help="the cross-entropy's weight beside the features'"
    )
    t.add_argument(
        "--distill",
        type=float,
        default=defaults.distill,
        help="the primary's next-token distribution's share of the cross-entropy's target (0: its greedy token)",
    )
    args = add_spellings(parser).parse_args(argv)
    try:  # before the answers are generated, not after
        check_run_flags(args)
        args.train_settings = train_settings(args) if args.command == "train" else None
    except ValueError as e:
        parser.error(str(e))
    return args


def check_run_flags(args: argparse.Namespace) -> None:
    """The flags of the generation and the files it writes, checked before the model loads: a bad one
    found after an hour of generating loses that hour (--out a directory fails only at the rename)."""
    for name in ("tokens", "prompts", "batch", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.num_threads < 0:
        raise ValueError(f"--num_threads must be >= 0 (0: every core), got {args.num_threads}")
    for name in ("out", "data"):
        path = getattr(args, name)
        if path is not None and path.is_dir():
            raise ValueError(f"--{name} {path} is a directory; name the file to write")
        if path is not None and any(p.exists() and not p.is_dir() for p in path.parents):
            raise ValueError(f"--{name} {path}: a parent of it is a file, not a directory")


def check_against_model(args: argparse.Namespace, config: ModelConfig) -> None:
    """The flags the model bounds, checked once it is loaded and before it answers anything."""
    if args.command == "train" and args.vocab > config.vocab_size:
        raise ValueError(f"--vocab {args.vocab} is more than the model's vocabulary of {config.vocab_size} tokens")


def train_settings(args: argparse.Namespace) -> train.TrainSettings:
    return train.TrainSettings(
        draft_vocab_size=args.vocab, depth=args.depth, epochs=args.epochs, seed=args.seed, lr=args.lr,
        cls_weight=args.cls_weight, batch_tokens=args.batch_tokens, distill=args.distill,
    )  # fmt: skip


def primary_answers(
    args: argparse.Namespace,
    settings: generate.GenerateSettings,
    loaded: LoadedModel,
    tokenizer: Tokenizer,
    fingerprint: str = "",
) -> list[generate.Sequence_]:
    """Step 1: the primary's answers to the training prompts (or those an earlier run of the same
    model kept in --data; AnswersDataError when they are another model's)."""
    model, config = loaded.model, loaded.config
    if args.data is not None and args.data.exists():
        print(f"1/3 the primary's answers from {args.data} (written by an earlier run of this command)")
        return generate.load_sequences(args.data, fingerprint or None, config.hidden_size)
    grammars = GrammarCache(GrammarTokenizerInfo.from_tokenizer(tokenizer, config.vocab_size))
    engine = Engine(model, KVCache(config, model.kv_dtype), MAX_POSITIONS)

    def encode(prompt: data.TrainingPrompt) -> list[int]:  # as the gateway encodes it (gateway.chat)
        if prompt.is_completion:
            return tokenizer.encode_prompt(prompt.text)
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}]))

    prompts = data.training_prompts(args.seed, num_prompts=args.prompts)
    print(f"1/3 the primary answers up to {len(prompts)} prompts ({', '.join(data.SOURCES)}), {args.tokens} tokens")
    with tqdm(total=args.tokens, unit="tok", smoothing=0.05) as bar:

        def advanced(n: int) -> None:
            bar.update(n)

        sequences = generate.generate(
            engine, encode, grammars, prompts, settings, config.eos_token_ids, args.tokens, advanced
        )
    if args.data is not None:
        generate.save_sequences(args.data, sequences, fingerprint)
    return sequences


@dataclasses.dataclass(frozen=True)
class Trained:
    drafter: FeatureDrafter
    vocab: torch.Tensor  # [draft_vocab_size] the primary's token ids the drafter predicts
    accuracy: train.Accuracy  # on the validation answers
    coverage: dict[int, float]  # top-N vocabulary -> share of validation targets it covers
    settings: train.TrainSettings


def train_drafter(args: argparse.Namespace, sequences: list[generate.Sequence_], loaded: LoadedModel) -> Trained:
    """Steps 2 and 3: the draft vocabulary, then the drafter."""
    model, config = loaded.model, loaded.config
    settings: train.TrainSettings = args.train_settings
    train_idx, val_idx = train.split(sequences, settings.validation_share, args.seed)
    coverage = train.vocab_coverage(sequences, train_idx, val_idx, COVERAGE_SIZES)
    print(
        "2/3 vocabulary: validation targets covered by the top N: "
        + ", ".join(f"{n}: {c:.3f}" for n, c in coverage.items())
    )
    vocab = train.choose_vocab(sequences, train_idx, args.vocab)
    shared = shared_parts(model, vocab, config.rms_norm_eps)
    drafter_config = DrafterConfig.for_model(config, args.vocab)
    steps = len(train.batches(train.pieces(sequences, train_idx, settings.window), settings.batch_tokens, None))
    print(
        f"3/3 training: {len(train_idx)} answers ({len(val_idx)} for validation), {steps} steps x {args.epochs} epochs"
    )
    with tqdm(total=steps * args.epochs, unit="step") as bar:

        def progress(n: int, loss: float) -> None:
            bar.update(n)
            bar.set_postfix(loss=f"{loss:.3f}")

        drafter, accuracy = train.train(
            sequences, drafter_config, shared, settings, train_idx, val_idx, progress, log=tqdm.write
        )
    return Trained(drafter, vocab, accuracy, dict(coverage), settings)


def _fail(message: str) -> NoReturn:
    """A bad flag found past parsing: one line, exit 2."""
    print(f"python -m draft_svc.heads: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_CONFIG)


def _loaded(args: argparse.Namespace) -> tuple[Path, LoadedModel]:
    """The --model's directory and the model loaded, the flags checked against it."""
    if args.num_threads:
        set_num_threads(args.num_threads)
    try:  # a missing path, a directory without weights, a GGUF that cannot be converted
        model_dir = resolve_model_dir(args.model, default_cache_dir())
    except (OSError, ValueError) as e:
        _fail(f"--model: {e}")
    loaded = load_model(model_dir, args.precision, max_positions=MAX_POSITIONS, is_shared=False)
    try:
        check_against_model(args, loaded.config)
    except ValueError as e:
        _fail(str(e))
    return model_dir, loaded


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python -m draft_svc.heads " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    started = time.monotonic()
    model_dir, loaded = _loaded(args)
    fingerprint = model_fingerprint(loaded.config, loaded.model.norm.weight)
    settings = generate.GenerateSettings(max_new_tokens=args.max_new_tokens, batch=args.batch, seed=args.seed)
    print(f"model {model_dir} ({args.precision}), fingerprint {fingerprint}; {native.status()}")
    try:
        sequences = primary_answers(args, settings, loaded, Tokenizer.from_dir(model_dir), fingerprint)
    except generate.AnswersDataError as e:  # --data of another model
        _fail(f"--data: {e}")
    generated_s = time.monotonic() - started
    by_source: collections.Counter[str] = collections.Counter()
    for s in sequences:
        by_source[s.source] += len(s.tokens) - 2
    num_tokens = sum(by_source.values())
    print(
        f"   {len(sequences)} answers, {num_tokens} tokens in {generated_s:.0f} s "
        f"({num_tokens / generated_s:.0f} tok/s); by source {dict(by_source)}"
    )
    if args.command == "answers":
        provenance = {
            "command": command, "sources": data.SOURCES, "answers": len(sequences), "tokens": num_tokens,
            "tokens_by_source": dict(by_source), "precision": args.precision,
        }  # fmt: skip
        size = save_answers(args.out, [s.tokens for s in sequences], fingerprint, provenance)
        print(f"wrote {args.out} ({size / 1e6:.1f} MB): {len(sequences)} answers")
        return
    train_started = time.monotonic()
    trained = train_drafter(args, sequences, loaded)
    trained_s, total_s = time.monotonic() - train_started, time.monotonic() - started
    validation = trained.accuracy.as_dict()
    training = {
        "command": command,
        "sources": data.SOURCES,
        "answers": len(sequences),
        "tokens": num_tokens,
        "tokens_by_source": dict(by_source),
        "sampled_share": round(sum(s.is_sampled for s in sequences) / max(1, len(sequences)), 3),
        "vocab_coverage": {str(n): round(c, 4) for n, c in trained.coverage.items()},
        "validation": validation,
        "settings": {"generate": vars_of(settings), "train": vars_of(trained.settings)},
        "seconds": {"generate": round(generated_s), "train": round(trained_s), "total": round(total_s)},
        "machine": f"{_cpu_name()}, {torch.get_num_threads()} threads, {native.status()}",
        "precision": args.precision,
    }
    size = file.save(args.out, trained.drafter, trained.vocab, fingerprint, training)
    print(
        f"wrote {args.out} ({size / 1e6:.1f} MB) in {total_s / 60:.1f} min; validation top-1 by depth "
        f"{validation['top1_by_depth']}, top-{train.TOP_K} {validation[f'top{train.TOP_K}_by_depth']}"
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def vars_of(settings: object) -> dict[str, object]:
    return {k: getattr(settings, k) for k in settings.__dataclass_fields__}  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
