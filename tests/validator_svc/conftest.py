"""Shared by the kernel and validation-path tests: random trees, and a CuPy stand-in for CPU machines."""

from __future__ import annotations

import math
import re
import sys
import types

import numpy as np
import pytest
import torch

from specdec.grammar.bitmask import TokenBitmask
from specdec.grammar.mask import MASKED_LOGIT
from specdec.logits_codec import EncodedLogits, decode_logits
from validator_svc.entropy import row_entropy
from validator_svc.kernel import KERNEL_NAME, ROW_STATS_SOURCE, THREADS_PER_BLOCK

FORMAT_NAMES = {0: "fp32", 1: "bf16", 2: "fp8_e4m3"}  # the kernel's `fmt` codes


def kernel_parameters(source: str, name: str) -> tuple[str, ...]:
    """The parameter names of CUDA `source`'s function `name`, in order, read from its signature.
    E.g. "void f(const int* offsets,  // [R + 1]\n float* out) {" -> ("offsets", "out")."""
    code = re.sub(r"//[^\n]*", "", source)  # the shape comments hold parentheses and commas
    signature = code.split(f"void {name}(", 1)[1].split(")", 1)[0]
    return tuple(parameter.split()[-1].lstrip("*") for parameter in signature.split(","))


# The fake kernel reads its arguments by these positions, as the GPU does: a host call that passes
# them in another order, or another number of them, fails in the fake too.
KERNEL_PARAMETERS = kernel_parameters(ROW_STATS_SOURCE, KERNEL_NAME)


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
        k = types.SimpleNamespace(**dict(zip(KERNEL_PARAMETERS, args, strict=True)))
        FakeCupy.launches += 1
        num_rows, fmt_name = grid[0], FORMAT_NAMES[int(k.fmt)]
        assert len(k.data) == num_rows * int(k.vocab_size) * int(k.itemsize) and block == (THREADS_PER_BLOCK,)
        assert k.allowed_words.dtype == np.uint32
        assert int(k.num_words) == 0 or k.allowed_words.shape == (num_rows, int(k.num_words))
        encoded = EncodedLogits(
            fmt_name,
            num_rows,
            int(k.vocab_size),
            k.data.tobytes(),
            tuple(float(s) for s in k.row_scales) if fmt_name == "fp8_e4m3" else None,
        )
        logits = decode_logits(encoded)  # [R, V]
        if int(k.num_words):
            allowed = TokenBitmask(np.ascontiguousarray(k.allowed_words).view("<i4"), int(k.vocab_size)).to_bool()
            logits = torch.where(allowed, logits, MASKED_LOGIT)  # [R, V]
        k.out_max[:] = logits.amax(dim=-1).numpy()
        k.out_lse[:] = torch.logsumexp(logits, dim=-1).numpy()
        k.out_entropy[:] = row_entropy(logits).numpy()
        k.out_argmax[:] = logits.argmax(dim=-1).numpy()
        for row in range(num_rows):
            for i in range(k.child_offsets[row], k.child_offsets[row + 1]):
                node, token = k.child_nodes[i], k.child_tokens[i]
                k.out_child_logits[node] = logits[row, token]
                k.out_child_probs[node] = math.exp(float(logits[row, token]) - float(k.out_lse[row]))


@pytest.fixture
def fake_cupy(monkeypatch):
    """Installs FakeCupy as `cupy` for the test; returns it with its launch count at 0."""
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    monkeypatch.setattr(FakeCupy, "launches", 0)
    return FakeCupy
