"""Kernels built for sm_90 (no GPU) with the argument values a real call launches them with.

``compile_for_sm90`` in the kernel modules makes its launch arguments by hand; ptxas's register
choice moves with them. The paged D = 256 decode forward held 128 registers as
flash_attn_with_kvcache launches it and 184 as flash_attn_varlen_func does (which leaves one
program an SM instead of two). Here a public call runs on CPU tensors with the forward's launcher
replaced by one that keeps its arguments; those are then built as Triton specializes them
(integers equal to 1 become constants, multiples of 16 are marked divisible). Run through
``conftest.sm90_build("launch_builds", ...)``, in a process without Triton's interpreter.
"""

import dataclasses

import torch

import qflash
import qflash.ops.common
from qflash.kernels import attention as kernels
from qflash.kernels.common import SIGNATURE_NAMES, build_tl_for_sm90

# The H200's share count for the calls below (8 key/value heads at batch 1: two programs an SM).
H200_SPLITS = 33


class _Stop(Exception):
    pass


def _forward_launch(call):
    """(arguments by name, launch options) of the one forward launch ``call()`` makes."""
    launches = []

    class Capture:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((args, kwargs))
                raise _Stop
            return launch

    kept = kernels._fwd_launcher
    kernels._fwd_launcher = Capture()
    try:
        call()
    except _Stop:
        pass
    finally:
        kernels._fwd_launcher = kept
    (args, kwargs), = launches
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages", "maxnreg") if name in kwargs}
    return dict(zip(kernels._attn_fwd_kernel.arg_names, args), **kwargs), options


def _build(values, options):
    """``_attn_fwd_kernel`` built for sm_90 with these argument values."""
    fn = kernels._attn_fwd_kernel
    args, constants = {}, {}
    for param in fn.params:
        value = values.get(param.name, param.default)
        if param.is_constexpr:
            constants[param.name] = value
        elif isinstance(value, torch.Tensor):
            args[param.name] = "*" + ("i64" if value.dtype == torch.int64 else SIGNATURE_NAMES[value.dtype])
        elif isinstance(value, float):
            args[param.name] = "fp64" if param.name in ("qk_scale", "softcap_log2") else "fp32"
        elif param.do_not_specialize:
            args[param.name] = "i32"
        else:
            args[param.name] = int(value)
    return build_tl_for_sm90(fn, args, constants, **options)


def compile_for_sm90(case: str, head_dim: int = 256, keys: int = 4096, page_size: int = 16,
                     share_keys: int = 4096 // H200_SPLITS):
    """The forward of a decode step (batch 1, Llama-3-8B's 32 / 8 heads, bf16) as a public call
    launches it on the H200 (the launcher's own tiles for Hopper and for shares of ``share_keys``
    keys, H200_SPLITS key shares):
    ``flash_attn_func`` on a dense cache ("func"), ``flash_attn_with_kvcache`` on a cache row named
    by cache_batch_idx with a left pad ("rows") or on pages ("kvcache"), ``flash_attn_varlen_func``
    on pages ("varlen")."""
    default = kernels.default_config
    kernels.has_tma = lambda device: True

    def h200_tiles(*args, **kwargs):
        kwargs.setdefault("share_keys", share_keys)
        return dataclasses.replace(default(args[0], args[1], torch.device("cuda"), *args[3:], **kwargs),
                                   num_splits=H200_SPLITS)

    kernels.default_config = h200_tiles
    qflash.ops.common.interpreter_on = lambda: True  # CPU tensors get as far as the launch
    q = torch.randn(1, 1, 32, head_dim, dtype=torch.bfloat16)
    lens = torch.full((1,), keys, dtype=torch.int32)
    if case in ("func", "rows"):
        k, v = (torch.randn(2, keys, 8, head_dim, dtype=torch.bfloat16) for _ in range(2))
        calls = {"func": lambda: qflash.flash_attn_func(q, k[:1], v[:1]),
                 "rows": lambda: qflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens - 1,
                                                                cache_batch_idx=torch.ones(1, dtype=torch.int32),
                                                                cache_leftpad=torch.ones(1, dtype=torch.int32))}
    else:
        k_pages, v_pages = (torch.randn(keys // page_size, page_size, 8, head_dim, dtype=torch.bfloat16)
                            for _ in range(2))
        table = torch.arange(keys // page_size, dtype=torch.int32)[None]
        cu = torch.tensor([0, 1], dtype=torch.int32)
        calls = {"kvcache": lambda: qflash.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens,
                                                                   block_table=table),
                 "varlen": lambda: qflash.flash_attn_varlen_func(q[0], k_pages, v_pages, cu, cu * keys, 1, keys,
                                                                 block_table=table)}
    with torch.no_grad():
        return _build(*_forward_launch(calls[case]))
