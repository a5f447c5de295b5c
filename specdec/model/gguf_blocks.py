"""The raw 4-bit blocks of a GGUF file's Q4_0/Q4_1 tensors, kept as they are for int4 serving.

llama.cpp's 4-bit formats quantize each row in blocks of 32 weights along the input dimension:

    Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles;   w = q * d + m,       q in 0..15
    Q4_0 block (18 bytes): fp16 d,         16 bytes of nibbles;   w = q * d - 8 * d   (m = -8d)

Byte j of the nibbles holds element j in its low nibble and element j + 16 in its high nibble.

Unpacked, a tensor [N, K] becomes `qweight` uint8 [N, K] (values 0..15) and `qscale` / `qmin`
fp16 [N, K/32] (d and m). The converter writes them next to the dequantized weights under
`<hf name>.qweight|.qscale|.qmin` (Q4_0's m is stored as -8d, exact in fp16), so that
`--precision int4` serves the file's own blocks instead of quantizing the float weights again.
Blocks run along the input dimension, so permuting rows (llama.cpp's Q/K order) is exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import SafetensorError
from safetensors.torch import load_file

BLOCK_SIZE = 32
Q4_BLOCKS_FILE = "q4_blocks.safetensors"
Q4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
QWEIGHT, QSCALE, QMIN = ".qweight", ".qscale", ".qmin"


def unpack_q4_blocks(data: np.ndarray, tensor_type: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw block bytes [N, K/32 * block_bytes] -> (q uint8 [N, K], d fp16 [N, K/32], m fp16 [N, K/32])."""
    assert tensor_type in Q4_TYPES, tensor_type
    has_min = tensor_type == GGMLQuantizationType.Q4_1
    header = 4 if has_min else 2
    num_rows = data.shape[0]
    blocks = data.reshape(num_rows, -1, header + BLOCK_SIZE // 2)  # [N, K/32, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [N, K/32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if has_min else (-8 * d.astype(np.float32)).astype(np.float16)
    nibbles = blocks[..., header:]  # [N, K/32, 16]
    q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1)  # [N, K/32, 32]: j, then j + 16
    return q.reshape(num_rows, -1), d, m


def q4_block_tensors(hf_name: str, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> dict[str, torch.Tensor]:
    """`<module>.weight` -> its three block tensors under `<module>.weight.qweight|.qscale|.qmin`."""
    return {
        hf_name + QWEIGHT: torch.from_numpy(np.ascontiguousarray(q)),
        hf_name + QSCALE: torch.from_numpy(np.ascontiguousarray(d)),
        hf_name + QMIN: torch.from_numpy(np.ascontiguousarray(m)),
    }


def load_q4_blocks(model_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """weight name -> (q uint8 [N, K], d fp16 [N, K/32], m fp16 [N, K/32]); empty without a blocks file."""
    path = Path(model_dir) / Q4_BLOCKS_FILE
    if not path.is_file():
        return {}
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:  # as loader.read_weights_file, which imports this module
        raise ValueError(
            f"model weights file {str(path)!r} cannot be read ({e}); if it is a converted GGUF's, "
            "remove its directory to convert the GGUF again"
        ) from None
    names = [name.removesuffix(QWEIGHT) for name in tensors if name.endswith(QWEIGHT)]
    return {name: (tensors[name + QWEIGHT], tensors[name + QSCALE], tensors[name + QMIN]) for name in names}
