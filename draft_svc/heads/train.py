"""Training the feature drafter on the primary's own answers (EAGLE's loss, unrolled several drafts deep).

Per sequence (draft_svc/heads/generate.py) the pair at row t is (f_t, x_{t+1}); the drafter's
pass-d prediction at t (model.unrolled) is compared with the primary's next feature f_{t+1}
(smooth L1) and its greedy token a_{t+1} (cross-entropy over the drafter's vocabulary):

    loss = sum_d  DEPTH_DECAY^(d-1) * (smooth_l1(f^_d, f_{t+1}) + cls_weight * CE(head(f^_d), target_{t+1}))

The classification target is the primary's greedy token a_{t+1}, or with `distill` > 0 partly its
whole distribution over the drafter's vocabulary, softmax(head(f_{t+1})), as EAGLE's loss takes it:
free here (f_{t+1} is the regression's target already) and more signal per row than one token.

Unrolling (pass d feeds pass d-1's predictions) trains the drafter on the inputs it meets when it
drafts d tokens deep, not only on the primary's true features (EAGLE-3's training-time test).

The vocabulary is the N tokens the primary chose most often in the training answers (FR-Spec):
`vocab_coverage` reports what share of the validation targets each N covers.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from draft_svc.heads.generate import Sequence_
from draft_svc.heads.model import DrafterConfig, FeatureDrafter, SharedParts, unrolled

DEPTH_DECAY = 0.8
TOP_K = 4  # the validation reports top-1 and top-TOP_K accuracy


@dataclasses.dataclass(frozen=True, slots=True)
class TrainSettings:
    draft_vocab_size: int = 8192
    depth: int = 3  # draft steps unrolled in training
    cls_weight: float = 0.2  # the cross-entropy's weight beside the features' smooth L1
    distill: float = 0.0  # the primary's distribution's share of the target (0: its greedy token alone)
    epochs: int = 4
    batch_tokens: int = 512  # rows a step: short of steps, the drafter learns more an epoch from small batches
    window: int = 256  # training rows per sequence piece (longer answers are cut into pieces)
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    validation_share: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("draft_vocab_size", "depth", "epochs", "batch_tokens", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not (math.isfinite(self.cls_weight) and self.cls_weight >= 0):
            raise ValueError(f"cls_weight must be >= 0, got {self.cls_weight}")
        if not 0 <= self.distill <= 1:
            raise ValueError(f"distill must lie in [0, 1], got {self.distill}")
        if not 0 < self.validation_share < 1:
            raise ValueError(f"validation_share must lie in (0, 1), got {self.validation_share}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Rows [start, end) of a sequence: pairs (f_t, x_{t+1}) whose targets (f_{t+1}, a_{t+1}) exist."""

    seq: int
    start: int
    end: int


@dataclasses.dataclass(slots=True)
class Accuracy:
    top1: list[float]  # per depth
    topk: list[float]
    num_rows: int

    def as_dict(self) -> dict[str, object]:
        return {
            "top1_by_depth": [round(a, 4) for a in self.top1],
            f"top{TOP_K}_by_depth": [round(a, 4) for a in self.topk],
            "rows": self.num_rows,
        }


def split(sequences: Sequence[Sequence_], share: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, validation) sequence indices; every answer to one prompt lands on the same side, so
    the validation measures prompts the drafter never saw."""
    keys = sorted({s.prompt_key for s in sequences})
    random.Random(seed).shuffle(keys)
    held_out = set(keys[: max(1, round(share * len(keys)))])
    train_idx = [i for i, s in enumerate(sequences) if s.prompt_key not in held_out]
    val_idx = [i for i, s in enumerate(sequences) if s.prompt_key in held_out]
    return train_idx, val_idx


def choose_vocab(sequences: Sequence[Sequence_], indices: Sequence[int], size: int) -> torch.Tensor:
    """The `size` tokens the primary chose (greedy) most often in these sequences, most frequent first
    (ties by id)."""
    counts: Counter[int] = Counter()
    for i in indices:
        counts.update(sequences[i].argmax.tolist())
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    vocab = [t for t, _ in ranked[:size]]
    if len(vocab) < size:  # a small data set: fill with the lowest unused ids
        used = set(vocab)
        vocab += [t for t in range(size * 2 + len(used)) if t not in used][: size - len(vocab)]
    return torch.tensor(vocab, dtype=torch.int64)


def vocab_coverage(
    sequences: Sequence[Sequence_], train: Sequence[int], val: Sequence[int], sizes: Sequence[int]
) -> dict[int, float]:
    """Share of the validation rows' greedy tokens inside the top-N vocabulary of the training rows."""
    targets = np.concatenate([sequences[i].argmax[1:] for i in val]) if val else np.zeros(0, np.int32)
    out = {}
    for n in sizes:
        vocab = choose_vocab(sequences, train, n).numpy()
        out[n] = float(np.isin(targets, vocab).mean()) if len(targets) else 0.0
    return out


def pieces(sequences: Sequence[Sequence_], indices: Sequence[int], window: int) -> list[Piece]:
    out: list[Piece] = []
    for i in indices:
        num_pairs = len(sequences[i].features) - 1  # pair t needs f_{t+1}
        out.extend(Piece(i, s, min(s + window, num_pairs)) for s in range(0, num_pairs, window))
    return [p for p in out if p.end > p.start]


def batches(items: list[Piece], batch_tokens: int, rng: random.Random | None) -> list[list[Piece]]:
    """Pieces grouped by length (little padding) into batches of about batch_tokens rows."""
    items = sorted(items, key=lambda p: (p.end - p.start, p.seq, p.start))
    out: list[list[Piece]] = []
    current: list[Piece] = []
    for p in items:
        if current and (len(current) + 1) * (p.end - p.start) > batch_tokens:
            out.append(current)
            current = []
        current.append(p)
    if current:
        out.append(current)
    if rng is not None:
        rng.shuffle(out)
    return out


@dataclasses.dataclass(slots=True)
class Batch:
    features: torch.Tensor  # [B, T, C] f_t
    embeddings: torch.Tensor  # [B, T, C] embed(x_{t+1})
    positions: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T]
    next_features: torch.Tensor  # [B, T, C] f_{t+1}
    labels: torch.Tensor  # [B, T] head row of a_{t+1}, -100 outside the vocabulary or padding


def make_batch(
    sequences: Sequence[Sequence_], group: Sequence[Piece], shared: SharedParts, row_of: torch.Tensor
) -> Batch:
    T = max(p.end - p.start for p in group)
    B, C = len(group), shared.head.shape[1]
    features = torch.zeros(B, T, C)
    next_features = torch.zeros(B, T, C)
    tokens = torch.zeros(B, T, dtype=torch.int64)
    positions = torch.zeros(B, T, dtype=torch.int64)
    valid = torch.zeros(B, T, dtype=torch.bool)
    labels = torch.full((B, T), -100, dtype=torch.int64)
    for b, p in enumerate(group):
        s, n = sequences[p.seq], p.end - p.start
        feats = torch.from_numpy(s.features[p.start : p.end + 1].astype(np.float32))
        features[b, :n] = feats[:n]
        next_features[b, :n] = feats[1:]
        tokens[b, :n] = torch.from_numpy(s.tokens[p.start + 1 : p.end + 1].astype(np.int64))
        positions[b, :n] = torch.arange(p.start + 1, p.end + 1)
        valid[b, :n] = True
        labels[b, :n] = row_of[torch.from_numpy(s.argmax[p.start + 1 : p.end + 1].astype(np.int64))]
    with torch.no_grad():
        embeddings = shared.embed(tokens.view(-1)).float().view(B, T, C)
    return Batch(features, embeddings, positions, valid, next_features, labels)


def losses(
    drafter: FeatureDrafter,
    shared: SharedParts,
    batch: Batch,
    depth: int,
    keep_logits: bool = False,
    cls_weight: float = 0.2,
    distill: float = 0.0,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the training loss, per depth the drafter's logits [B, T, N] when keep_logits).

    Products run in bf16 (AMX / AVX512-BF16 where the CPU has them: 4-7x fp32's rate on this work),
    norms, softmax and the loss in fp32; the weights stay fp32."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _losses(drafter, shared, batch, depth, keep_logits, cls_weight, distill)


def _losses(
    drafter: FeatureDrafter,
    shared: SharedParts,
    batch: Batch,
    depth: int,
    keep_logits: bool,
    cls_weight: float,
    distill: float,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    predicted = unrolled(drafter, shared, batch.features, batch.embeddings, batch.positions, batch.valid, depth)
    total = torch.zeros(())
    all_logits = []
    soft = None
    if distill > 0:  # the primary's next-token distribution over the drafter's vocabulary, the same each pass
        with torch.no_grad():
            soft = shared.logits(batch.next_features).float().softmax(-1)
    for d, f_hat in enumerate(predicted, start=1):
        rows = batch.valid.clone()
        rows[:, : d - 1] = False  # pass d has no input before row d-1
        reg = F.smooth_l1_loss(f_hat[rows], batch.next_features[rows])
        logits = shared.logits(f_hat)
        labels = batch.labels.masked_fill(~rows, -100)
        cls = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        if soft is not None:
            soft_cls = -(soft[rows] * logits[rows].float().log_softmax(-1)).sum(-1).mean()
            cls = (1 - distill) * cls + distill * soft_cls
        total = total + DEPTH_DECAY ** (d - 1) * (reg + cls_weight * cls)
        if keep_logits:
            all_logits.append(logits.float())
    return total, all_logits


def evaluate(
    drafter: FeatureDrafter,
    shared: SharedParts,
    sequences: Sequence[Sequence_],
    val: list[Piece],
    row_of: torch.Tensor,
    settings: TrainSettings,
) -> Accuracy:
    """Top-1 / top-k agreement with the primary's greedy token, per draft depth (a label outside the
    drafter's vocabulary counts as a miss)."""
    hits1 = [0] * settings.depth
    hitsk = [0] * settings.depth
    counts = [0] * settings.depth
    drafter.eval()
    with torch.no_grad():
        for group in batches(val, settings.batch_tokens, None):
            batch = make_batch(sequences, group, shared, row_of)
            true_rows = batch.labels  # -100 outside the vocabulary
            _, all_logits = losses(drafter, shared, batch, settings.depth, keep_logits=True)
            for d, logits in enumerate(all_logits):
                rows = batch.valid.clone()
                rows[:, :d] = False
                top = torch.topk(logits[rows], TOP_K, dim=-1).indices
                labels = true_rows[rows]
                hits1[d] += int((top[:, 0] == labels).sum())
                hitsk[d] += int((top == labels[:, None]).any(-1).sum())
                counts[d] += int(rows.sum())
    drafter.train()
    return Accuracy(
        [h / max(c, 1) for h, c in zip(hits1, counts, strict=True)],
        [h / max(c, 1) for h, c in zip(hitsk, counts, strict=True)],
        counts[0],
    )


def train(
    sequences: Sequence[Sequence_],
    config: DrafterConfig,
    shared: SharedParts,
    settings: TrainSettings,
    train_idx: Sequence[int],
    val_idx: Sequence[int],
    progress: Callable[[int, float], None] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[FeatureDrafter, Accuracy]:
    """Train a drafter from a seeded initialisation; returns it and its validation accuracy."""
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    drafter = FeatureDrafter(config)
    row_of = torch.full((config.vocab_size,), -100, dtype=torch.int64)
    row_of[shared.vocab] = torch.arange(len(shared.vocab))
    train_pieces = pieces(sequences, train_idx, settings.window)
    val_pieces = pieces(sequences, val_idx, settings.window)
    steps_per_epoch = len(batches(train_pieces, settings.batch_tokens, None))
    total_steps = max(1, steps_per_epoch * settings.epochs)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)

    def lr_at(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        return 0.5 * (
            1 + math.cos(math.pi * (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps))
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    step = 0
    for epoch in range(settings.epochs):
        started = time.monotonic()
        for group in batches(train_pieces, settings.batch_tokens, rng):
            batch = make_batch(sequences, group, shared, row_of)
            loss, _ = losses(
                drafter, shared, batch, settings.depth, cls_weight=settings.cls_weight, distill=settings.distill
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if progress is not None:
                progress(1, float(loss.detach()))
        accuracy = evaluate(drafter, shared, sequences, val_pieces, row_of, settings)
        log(
            f"epoch {epoch + 1}/{settings.epochs}: {time.monotonic() - started:.0f} s, validation "
            f"top-1 by depth {[round(a, 3) for a in accuracy.top1]}, top-{TOP_K} {[round(a, 3) for a in accuracy.topk]}"
        )
    return drafter.eval().requires_grad_(False), accuracy
