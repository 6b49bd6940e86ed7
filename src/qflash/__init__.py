"""qflash: exact FlashAttention and quantized attention/matmul kernels in Triton.

Importing ``qflash`` does no work: the kernels (and triton) load on first use of
an op, so ``import qflash.reference`` stays free of triton.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "flash_attn_func": "qflash.ops.attention",
    "flash_attn_kvpacked_func": "qflash.ops.attention",
    "flash_attn_qkvpacked_func": "qflash.ops.attention",
    "flash_attn_varlen_func": "qflash.ops.attention",
    "flash_attn_varlen_kvpacked_func": "qflash.ops.attention",
    "flash_attn_varlen_qkvpacked_func": "qflash.ops.attention",
    "flash_attn_with_kvcache": "qflash.ops.attention",
    "sdpa": "qflash.ops.attention",
    "set_debug": "qflash.ops.common",
    "quantize": "qflash.ops.quantize",
    "dequantize": "qflash.ops.quantize",
    "int8_matmul": "qflash.ops.matmul",
    "fp8_matmul": "qflash.ops.matmul",
    "quantize_model": "qflash.nn",
}
_SUBMODULES = ("nn", "reference", "testing", "kernels", "ops", "bench", "integrations")

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"qflash.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qflash' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
