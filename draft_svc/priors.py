"""What a trained drafter's file says of its own acceptance: the controller's starting estimate.

A drafter file records its validation accuracy (draft_svc/heads/__main__.py: `training.validation.
top1_by_depth`, the share of held-out positions where its top token at depth d, drafting from its
own earlier drafts, was the primary's greedy token). Until a request's own steps say more, that is a
better guess of its acceptance than a task type's prior for drafts in general: GetPoolInfo reports it
(AcceptancePrior) and the gateway's controller starts from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draft_svc.heads.file import DrafterFileError, load


def validation_acceptance(training: Any) -> tuple[float, ...]:
    """top1_by_depth of a drafter file's training record, each in [0, 1]; () when it has none. The
    record is the file's JSON, whatever its shape (a list where an object belongs failed the pool's start)."""
    validation = training.get("validation") if isinstance(training, Mapping) else None
    by_depth = validation.get("top1_by_depth") if isinstance(validation, Mapping) else None
    if not isinstance(by_depth, (list, tuple)):  # a string's characters are no accuracies
        return ()
    try:
        values = tuple(float(a) for a in by_depth)
    except (TypeError, ValueError):
        return ()
    return values if all(0.0 <= a <= 1.0 for a in values) else ()


def drafter_file_acceptance(path: Path) -> tuple[float, ...]:
    """validation_acceptance of the drafter file at `path`; () when it cannot be read (the pool then
    does not offer the strategy anyway)."""
    try:
        return validation_acceptance(load(path).training)
    except DrafterFileError:
        return ()
