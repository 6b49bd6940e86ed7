"""Launch helpers shared by the kernels: grid arithmetic, tensor-descriptor (TMA) eligibility
and scratch memory."""

from __future__ import annotations

import functools

import torch
import triton


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids. Plain Python: ``triton.cdiv`` is a constexpr function whose
    host-side call costs microseconds, several of which add up to a short kernel's run time."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), without ``triton.next_power_of_2``'s wrapper."""
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def has_tma(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer (Hopper's copy engine); cached, since
    the query costs microseconds on every launch."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need a unit last stride, every dimension > 0, a 16-byte aligned
    base and strides that are multiples of 16 bytes."""
    for t in tensors:
        if t.numel() == 0 or t.stride(-1) != 1:
            return False
        size = t.element_size()
        if t.data_ptr() % 16 or any((st * size) % 16 for st in t.stride()[:-1]):
            return False
    return True


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator(device: torch.device) -> None:
    """Descriptors built inside a kernel live in a global-memory scratch buffer that triton
    asks the host to allocate (the interpreter needs none). Triton keeps the allocator in a
    context variable, which every thread sees anew (autograd runs the backward pass on a
    thread of its own), so it is set on each call: a context-variable write, ~100 ns."""
    if device.type == "cuda":
        triton.set_allocator(_scratch)
