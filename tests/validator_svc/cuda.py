"""Whether the CUDA kernel can run here, for the tests that need a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from validator_svc.kernel import cuda_device_count


def no_cuda_kernel() -> str:
    """Why the CUDA kernel cannot run here; "" where it can. A GPU machine without CuPy is told so,
    not "no CUDA device" (cuda_device_count is 0 there too)."""
    if cuda_device_count() > 0:
        return ""
    if importlib.util.find_spec("cupy") is None and torch.cuda.is_available():
        return "CuPy is not installed (the [gpu] extra)"
    return "no CUDA device"


requires_cuda_kernel = pytest.mark.skipif(bool(no_cuda_kernel()), reason=no_cuda_kernel() or "it can run")
