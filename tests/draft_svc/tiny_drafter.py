"""A tiny seeded feature drafter and the primary's parts it reads, for tests of the feature decoder
and of its measured costs: small enough to build in milliseconds, shaped like a real one (grouped KV
heads, a draft vocabulary smaller than the primary's)."""

from __future__ import annotations

import torch

from draft_svc.heads.model import DrafterConfig, FeatureDrafter, SharedParts
from tests.specdec.model.tiny import tiny_config

# The tiny model (tests/specdec/model/tiny.py) narrowed to 4 heads of 8 over a vocabulary of 50
TINY = DrafterConfig.for_model(
    tiny_config(hidden_size=32, head_dim=8, intermediate_size=64, vocab_size=50), draft_vocab_size=20, max_window=512
)


def tiny_parts(config: DrafterConfig = TINY, seed: int = 0) -> tuple[FeatureDrafter, SharedParts]:
    """A random drafter of `config` and random shared parts (embedding, final norm, a head over a random
    subset of the vocabulary), all from torch's global RNG seeded with `seed`."""
    torch.manual_seed(seed)
    drafter = FeatureDrafter(config).eval().requires_grad_(False)
    table = torch.randn(config.vocab_size, config.hidden_size)
    vocab = torch.randperm(config.vocab_size)[: config.draft_vocab_size]
    shared = SharedParts(
        embed=lambda ids: table[ids],
        final_norm=1 + 0.1 * torch.randn(config.hidden_size),
        head=4 * torch.randn(config.draft_vocab_size, config.hidden_size),  # peaked enough for distinct argmaxes
        vocab=vocab,
        eps=config.rms_norm_eps,
    )
    return drafter, shared
