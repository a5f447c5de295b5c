"""Self-distillation data: the primary answers the training prompts, and every row's feature is kept.

The primary runs in process (`specdec.engine.Engine`, the serving precision, many sequences per
forward), one row per sequence per step, greedy for some sequences and sampled (temperature, top-p)
for the others, under the prompt's JSON Schema where it has one (the same grammar masks the service
applies). For each sequence it keeps, from the prompt's second-to-last token on:

    tokens   x_0 .. x_L          x_0, x_1: the prompt's last two tokens; then the answer
    features f_0 .. f_{L-1}      f_t: the final norm's output at the row of x_t (it predicted x_{t+1})
    argmax   a_0 .. a_{L-1}      a_t: the primary's greedy token at that row (under the grammar)

which is what the drafter sees when it serves: its first pair is the prefill's last row with the
last prompt token (x_0's feature with x_1), then every committed token with its row's feature.
"""

from __future__ import annotations

import dataclasses
import zipfile
import time
import zlib
from pathlib import Path
from collections.abc import Callable, Sequence

import numpy as np
import torch

from draft_svc.heads.data import TrainingPrompt
from specdec.engine.engine import Engine, VerifyWork
from specdec.grammar.compiler import GrammarCache
from specdec.grammar.state import GrammarState

SAMPLE_TOP_K = 256  # a nucleus of top-p 0.95 at temperature 0.8 lies well inside it


@dataclasses.dataclass(slots=True)
class Sequence_:
    source: str
    is_sampled: bool
    tokens: np.ndarray  # int32 [L+1]
    features: np.ndarray  # float16 [L, C]
    argmax: np.ndarray  # int32 [L]
    prompt_key: int = 0  # the same for every answer to one prompt (the validation split keeps them together)


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateSettings:
    max_new_tokens: int = 192
    batch: int = 32  # sequences per forward
    sampled_fraction: float = 0.5
    temperature: float = 0.8
    top_p: float = 0.95
    max_prompt_tokens: int = 768
    seed: int = 0


@dataclasses.dataclass(slots=True)
class _Live:
    request_id: str
    prompt: TrainingPrompt
    is_sampled: bool
    forced: list[int]  # prompt tokens still to commit before the answer (x_1)
    tokens: list[int]
    features: list[np.ndarray]
    argmax: list[int]
    grammar: GrammarState | None
    generator: torch.Generator
    num_new: int = 0


def generate(
    engine: Engine,
    encode: Callable[[TrainingPrompt], list[int]],
    grammars: GrammarCache | None,
    prompts: Sequence[TrainingPrompt],
    settings: GenerateSettings,
    eos_token_ids: Sequence[int],
    max_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> list[Sequence_]:
    """Answers to `prompts` in order until `max_tokens` answer tokens are kept (deterministic for a
    seed: sampled draws come from per-sequence seeded generators)."""
    out: list[Sequence_] = []
    live: list[_Live] = []
    next_prompt = 0
    num_tokens = 0
    eos = set(eos_token_ids)
    seen: set[TrainingPrompt] = set()
    while live or (next_prompt < len(prompts) and num_tokens < max_tokens):
        while len(live) < settings.batch and next_prompt < len(prompts) and num_tokens < max_tokens:
            prompt = prompts[next_prompt]
            seq = _start(engine, encode, grammars, prompt, next_prompt, settings, prompt in seen)
            seen.add(prompt)
            next_prompt += 1
            if seq is not None:
                live.append(seq)
        if not live:
            break
        features: list[torch.Tensor] = []
        logits = engine.step([VerifyWork(s.request_id, (), ()) for s in live], [], features_out=features)
        greedy, chosen = _choose(live, torch.cat(logits), settings)
        still = []
        for i, s in enumerate(live):
            token, is_done = _advance(engine, s, greedy[i], chosen[i], features[i][0], settings, eos)
            if token is not None:
                num_tokens += 1
                if progress is not None:
                    progress(1)
            if is_done:
                engine.release(s.request_id)
                if s.num_new:
                    out.append(_finish(s))
            else:
                still.append(s)
        live = still
    return out


def _start(
    engine: Engine,
    encode: Callable[[TrainingPrompt], list[int]],
    grammars: GrammarCache | None,
    prompt: TrainingPrompt,
    index: int,
    settings: GenerateSettings,
    is_repeat: bool,
) -> _Live | None:
    ids = encode(prompt)
    if len(ids) < 3 or len(ids) > settings.max_prompt_tokens:
        return None
    grammar = None
    if prompt.schema is not None and grammars is not None:
        try:
            grammar = grammars.compile_response_format("json_schema", prompt.schema).new_state()
        except Exception:  # a schema the grammar engine refuses: answer it unconstrained
            grammar = None
    request_id = f"distill-{index}-{time.monotonic_ns()}"
    # The request starts one token short: its first step's row is the prefill's last row (x_0's).
    engine.open(request_id, ids[:-1])
    engine.prefill(request_id)
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + index)
    # a prompt asked again is answered by sampling: its greedy answer would repeat the first one
    is_sampled = bool(torch.rand((), generator=generator) < settings.sampled_fraction) or is_repeat
    return _Live(request_id, prompt, is_sampled, [ids[-1]], [ids[-2]], [], [], grammar, generator)


def _choose(live: Sequence[_Live], logits: torch.Tensor, settings: GenerateSettings) -> tuple[list[int], list[int]]:
    """Per sequence (greedy token, chosen token) from its row of logits [B, V]: the argmax under the
    sequence's grammar; a sampled sequence draws from the top SAMPLE_TOP_K tokens' top-p nucleus."""
    for i, s in enumerate(live):
        if s.grammar is not None and not s.forced:
            logits[i].masked_fill_(~s.grammar.allowed_mask().to_bool()[0], float("-inf"))
    greedy = torch.argmax(logits, dim=-1).tolist()
    chosen = list(greedy)
    rows = [i for i, s in enumerate(live) if s.is_sampled and not s.forced]
    if rows:
        top, ids = torch.topk(logits[rows] / settings.temperature, SAMPLE_TOP_K, dim=-1)
        probs = torch.softmax(top, dim=-1)  # sorted, descending
        probs = probs * ((torch.cumsum(probs, -1) - probs) < settings.top_p)
        for j, i in enumerate(rows):
            chosen[i] = int(ids[j, torch.multinomial(probs[j], 1, generator=live[i].generator)])
    return greedy, chosen


def _advance(
    engine: Engine,
    s: _Live,
    greedy: int,
    chosen: int,
    feature: torch.Tensor,
    settings: GenerateSettings,
    eos: set[int],
) -> tuple[int | None, bool]:
    """Record the row and commit the next token; (the answer token or None, whether done)."""
    s.features.append(feature.to(torch.float16).numpy())
    s.argmax.append(greedy)
    if s.forced:
        token = s.forced.pop(0)
        engine.commit(s.request_id, (), (token,))
        s.tokens.append(token)
        return None, False
    token = chosen
    s.tokens.append(token)
    s.num_new += 1
    if s.grammar is not None:
        s.grammar.accept_tokens([token])
    is_done = (
        token in eos
        or s.num_new >= settings.max_new_tokens
        or (s.grammar is not None and s.grammar.is_terminated)
        or engine.num_tokens(s.request_id) + 1 >= engine.max_context
    )
    if not is_done:
        engine.commit(s.request_id, (), (token,))
    return token, is_done


def _finish(s: _Live) -> Sequence_:
    # tokens x_0 .. x_L; features/argmax of rows x_0 .. x_{L-1} (the last token's row never ran)
    n = len(s.features)
    return Sequence_(
        s.prompt.source,
        s.is_sampled,
        np.asarray(s.tokens[: n + 1], dtype=np.int32),
        np.stack(s.features),
        np.asarray(s.argmax, dtype=np.int32),
        zlib.crc32(s.prompt.text.encode()),
    )


class AnswersDataError(ValueError):
    """Answers kept by an earlier run (--data) that cannot train a drafter for this model."""


def save_sequences(path: Path, sequences: Sequence[Sequence_], fingerprint: str = "") -> None:
    """The generated answers as one .npz (no pickle): concatenated arrays and their offsets, and the
    fingerprint of the model that answered (`load_sequences` checks it)."""
    token_counts = np.array([len(s.tokens) for s in sequences], dtype=np.int64)
    row_counts = np.array([len(s.features) for s in sequences], dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path,
        tokens=np.concatenate([s.tokens for s in sequences]),
        features=np.concatenate([s.features for s in sequences]),
        argmax=np.concatenate([s.argmax for s in sequences]),
        token_counts=token_counts,
        row_counts=row_counts,
        sources=np.array([s.source for s in sequences]),
        is_sampled=np.array([s.is_sampled for s in sequences]),
        prompt_keys=np.array([s.prompt_key for s in sequences], dtype=np.int64),
        model_fingerprint=np.array(fingerprint),
    )


def load_sequences(path: Path, fingerprint: str | None = None, hidden_size: int | None = None) -> list[Sequence_]:
    """The answers `save_sequences` wrote; AnswersDataError naming the file when they are another model's
    (its fingerprint, or for a file written without one its features' width): a drafter trained on
    them would be bound to this model yet have learnt another's features."""
    try:
        with np.load(path, allow_pickle=False) as f:
            tokens, features, argmax = f["tokens"], f["features"], f["argmax"]
            token_ends, row_ends = np.cumsum(f["token_counts"]), np.cumsum(f["row_counts"])
            sources, sampled = f["sources"], f["is_sampled"]
            keys = f["prompt_keys"] if "prompt_keys" in f.files else np.arange(len(sources))
            written_for = str(f["model_fingerprint"]) if "model_fingerprint" in f.files else ""
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise AnswersDataError(f"answers data {path} cannot be read: {e}") from None
    if fingerprint is not None and written_for and written_for != fingerprint:
        raise AnswersDataError(f"answers data {path} holds the answers of model {written_for}, not {fingerprint}")
    if hidden_size is not None and (features.ndim != 2 or features.shape[1] != hidden_size):
        raise AnswersDataError(f"answers data {path} holds features {features.shape}, the model is {hidden_size} wide")
    out = []
    for i in range(len(token_ends)):
        t0 = token_ends[i - 1] if i else 0
        r0 = row_ends[i - 1] if i else 0
        out.append(
            Sequence_(
                str(sources[i]),
                bool(sampled[i]),
                tokens[t0 : token_ends[i]],
                features[r0 : row_ends[i]],
                argmax[r0 : row_ends[i]],
                int(keys[i]),
            )
        )
    return out
