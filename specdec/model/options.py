"""What a command line chooses about the model before any of it loads: the weight formats by name, and
where converted models are kept. Torch-free, so that a client's command line (inference.py
--gateway_address) and the services' flag parsers list them without importing torch."""

from __future__ import annotations

from pathlib import Path

FLOAT_PRECISIONS = ("fp32", "bf16", "fp16", "fp8_e4m3")
# int8_token: int8's rows and layout, each token's activations as one 15-bit row (specdec.model.quant)
INT8_TOKEN = "int8_token"
QUANTIZED_PRECISIONS = ("int8", "int4", INT8_TOKEN)
PRECISIONS = FLOAT_PRECISIONS + QUANTIZED_PRECISIONS
AUTO = "auto"  # not a format: the primary measures candidates at start-up (primary_svc.autotune)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "specdec" / "models"  # converted models (specdec.model.loader)
