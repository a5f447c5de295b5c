"""Shared by the kernel and validation-path tests: random trees, and a CuPy stand-in for CPU machines."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from specdec.grammar.bitmask import TokenBitmask
from specdec.grammar.mask import MASKED_LOGIT
from specdec.logits_codec import EncodedLogits, decode_logits
from validator_svc.entropy import row_entropy
from validator_svc.kernel import KERNEL_NAME, ROW_STATS_SOURCE, THREADS_PER_BLOCK

FORMAT_NAMES = {0: "fp32", 1: "bf16", 2: "fp8_e4m3"}  # the kernel's `fmt` codes


def make_random_tree_logits(num_nodes: int, vocab_size: int, seed: int) -> tuple[list[int], list[int], torch.Tensor]:
    """A random tree whose nodes often hit the argmax, so walks go deep; logits [N+1, V]."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_nodes + 1, vocab_size, generator=generator) * 3  # [N+1, V]
    token_ids, parents = [], []
    for i in range(num_nodes):
        parent = int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
        row = logits[parent + 1]
        used = {token_ids[j] for j in range(i) if parents[j] == parent}
        ranked = [t for t in row.argsort(descending=True).tolist() if t not in used][:2]  # best unused tokens
        token_ids.append(ranked[int(torch.randint(0, len(ranked), (1,), generator=generator))])
        parents.append(parent)
    return token_ids, parents, logits


@pytest.fixture
def random_tree_logits():
    return make_random_tree_logits


class FakeCupy:
    """Stands in for CuPy on a machine without a GPU: arrays are NumPy arrays and the "kernel" is a
    NumPy emulation of ROW_STATS_SOURCE's contract (per-pointer layout from its shape comments). It
    checks the host glue of CudaRowStats: CSR packing, argument order, the packed mask, outputs by
    node index. `launches` counts kernel launches."""

    uint8, int32, float32 = np.uint8, np.int32, np.float32
    launches = 0

    class RawModule:
        def __init__(self, code: str) -> None:
            assert code == ROW_STATS_SOURCE

        def get_function(self, name: str):
            assert name == KERNEL_NAME
            return FakeCupy.row_stats

    @staticmethod
    def asarray(array):
        return np.array(array)

    @staticmethod
    def empty(size, dtype):
        return np.full(size, -7, dtype=dtype)  # garbage that a missed write would leave behind

    @staticmethod
    def asnumpy(array):
        return array

    @staticmethod
    def row_stats(grid, block, args):
        (
            data,
            scales,
            offsets,
            nodes,
            tokens,
            words,
            num_words,
            fmt,
            vocab_size,
            itemsize,
            out_max,
            out_lse,
            out_entropy,
            out_argmax,
            out_child_logits,
            out_child_probs,
        ) = args
        FakeCupy.launches += 1
        num_rows, fmt_name = grid[0], FORMAT_NAMES[int(fmt)]
        assert len(data) == num_rows * int(vocab_size) * int(itemsize) and block == (THREADS_PER_BLOCK,)
        assert words.dtype == np.uint32 and (int(num_words) == 0 or words.shape == (num_rows, int(num_words)))
        encoded = EncodedLogits(
            fmt_name,
            num_rows,
            int(vocab_size),
            data.tobytes(),
            tuple(float(s) for s in scales) if fmt_name == "fp8_e4m3" else None,
        )
        logits = decode_logits(encoded)  # [R, V]
        if int(num_words):
            allowed = TokenBitmask(np.ascontiguousarray(words).view("<i4"), int(vocab_size)).to_bool()  # [R, V]
            logits = torch.where(allowed, logits, MASKED_LOGIT)
        out_max[:] = logits.amax(dim=-1).numpy()
        out_lse[:] = torch.logsumexp(logits, dim=-1).numpy()
        out_entropy[:] = row_entropy(logits).numpy()
        out_argmax[:] = logits.argmax(dim=-1).numpy()
        for row in range(num_rows):
            for k in range(offsets[row], offsets[row + 1]):
                out_child_logits[nodes[k]] = logits[row, tokens[k]]
                out_child_probs[nodes[k]] = math.exp(float(logits[row, tokens[k]]) - float(out_lse[row]))


@pytest.fixture
def fake_cupy(monkeypatch):
    """Installs FakeCupy as `cupy` for the test; returns it with its launch count at 0."""
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    monkeypatch.setattr(FakeCupy, "launches", 0)
    return FakeCupy
