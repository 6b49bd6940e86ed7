"""Launch helpers shared by the kernels: grid arithmetic, tensor-descriptor (TMA) eligibility
and scratch memory."""

from __future__ import annotations

import collections
import functools
import os

import torch
import triton
from triton import knobs
from triton.runtime import driver


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


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def has_tma(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer (Hopper's copy engine); cached, since
    the query costs microseconds on every launch."""
    return device.type == "cuda" and _capability(_index(device))[0] >= 9


def is_hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.x: what the Gluon kernels (wgmma, setmaxnreg) are built for."""
    return device.type == "cuda" and _capability(_index(device))[0] == 9


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached): the grid of a persistent kernel."""
    return _sm_count(_index(device))


def gluon_enabled() -> bool:
    """Whether the public functions may take the Gluon (Hopper) kernels: yes unless
    ``QFLASH_GLUON=0`` (read on each call, so that it can be switched at run time)."""
    return os.environ.get("QFLASH_GLUON", "1") != "0"


@functools.lru_cache(maxsize=None)
def nvmma_layout(block_shape: tuple, dtype):
    """The shared-memory layout Gluon's TMA copies and wgmma use for a tile of ``block_shape`` in
    Gluon ``dtype``: made once per shape (about 15 microseconds of Python each time otherwise,
    on every launch)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


def build_for_sm90(fn, types: dict, constants: dict, **options):
    """Compile a Gluon kernel for sm_90 without a GPU (what the CPU tests check): ``types`` gives
    each runtime argument's type ("*fp32", "i32", a tensor-descriptor type), ``constants`` each
    constexpr argument's value. Returns the compiled kernel (PTX in ``.asm["ptx"]``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: "constexpr" if name in constants else types[name] for name in fn.arg_names}
    index = {name: i for i, name in enumerate(fn.arg_names)}
    fixed = {(index[name],): value for name, value in constants.items()}
    return triton.compile(GluonASTSource(fn, signature, fixed), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, **options))


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


def _arg_key(arg):
    """What Triton specializes a launch on, or finer: a tensor's dtype and 16-byte alignment, an
    integer's value, a descriptor's tensor, shape, strides, block and layout."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if hasattr(arg, "block_shape"):  # a host tensor descriptor
        return (arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.shape), tuple(arg.strides),
                tuple(arg.block_shape), arg.layout)
    if isinstance(arg, float):
        return float
    return arg  # int, bool, None, constexpr values


class CachedLauncher:
    """``kernel[grid](*args, **constexprs, **options)`` that skips Triton's per-call argument
    binding for arguments it has seen before.

    Each ``kernel[grid](...)`` call binds and specializes every argument and rebuilds the
    kernel's cache key: tens of microseconds of Python for a Gluon kernel with tensor
    descriptors, as much as a short kernel runs. This launcher keys the compiled kernel that
    Triton's call returned by everything Triton specializes on (``_arg_key``: dtypes, pointer
    alignment, integer values) and launches it directly the next time the key comes back. A
    miss takes Triton's own path, so compiling, caching on disk and checks stay Triton's."""

    def __init__(self, kernel, maxsize: int = 512):
        self.kernel = kernel
        self.maxsize = maxsize
        self.compiled = collections.OrderedDict()

    def __call__(self, grid: tuple, *args, constexprs: dict, **options):
        if not hasattr(self.kernel, "device_caches"):  # Triton's interpreter: nothing compiled to keep
            self._check_order(args, constexprs)
            self.kernel[grid](*args, **constexprs, **options)
            return
        device = driver.active.get_current_device()
        key = [device, *constexprs.values(), *options.items()]
        for arg in args:  # _arg_key, with the common cases inline: this loop runs on every launch
            kind = type(arg)
            if kind is int:
                key.append(arg)
            elif kind is torch.Tensor:
                key.append((arg.dtype, arg.data_ptr() % 16 == 0))
            else:
                key.append(_arg_key(arg))
        key = tuple(key)
        compiled = self.compiled.get(key)
        if compiled is None:
            self._check_order(args, constexprs)
            self.compiled[key] = self.kernel[grid](*args, **constexprs, **options)
            if len(self.compiled) > self.maxsize:  # the oldest key goes first
                self.compiled.popitem(last=False)
            return
        grid = (*grid, 1, 1)
        stream = driver.active.get_current_stream(device)
        # The launcher takes every argument in the kernel's order and skips the constexprs.
        args = (*args, *constexprs.values())
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *args), knobs.runtime.launch_enter_hook,
                     knobs.runtime.launch_exit_hook, *args)

    def _check_order(self, args: tuple, constexprs: dict) -> None:
        """A hit passes ``args`` and then the constexprs' values by position: they must be the kernel's order."""
        names = self.kernel.arg_names
        if len(args) + len(constexprs) != len(names) or list(names[len(args):]) != list(constexprs):
            raise TypeError(f"{self.kernel.__name__} takes {names}: the runtime arguments, then the constexprs")
