"""Fixtures of the draft service's tests."""

from __future__ import annotations

import types

import pytest
import torch

from draft_svc.heads.model import PRIMARY_FIELDS, DrafterConfig
from tests.specdec.model.tiny import tiny_config


class FakePrimary:
    """What a feature drafter reads of an attached primary: config, embed, final norm (tied head),
    shaped after a drafter's config."""

    def __init__(self, config: DrafterConfig, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        # the tiny model (tied head) in the drafter's shape, two layers deep
        self.config = tiny_config(num_hidden_layers=2, **{name: getattr(config, name) for name in PRIMARY_FIELDS})
        self.table = torch.randn(config.vocab_size, config.hidden_size, generator=g)
        self.norm = types.SimpleNamespace(weight=1 + 0.1 * torch.randn(config.hidden_size, generator=g))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


@pytest.fixture
def fake_primary() -> type[FakePrimary]:
    """FakePrimary(drafter_config, seed=0): a primary a drafter of that config binds to."""
    return FakePrimary
