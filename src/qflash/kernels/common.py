"""Launch helpers shared by the kernels: grid arithmetic, tensor-descriptor (TMA) eligibility
and scratch memory."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading

import torch
import triton
from triton import knobs
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.runtime import driver


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids. Plain Python: ``triton.cdiv`` is a constexpr function whose
    host-side call costs microseconds, several of which add up to a short kernel's run time."""
    return -(-a // b)


def aligned_columns(shape: tuple, device, alloc=torch.empty) -> torch.Tensor:
    """A float32 (rows, cols) tensor stored column-major with each column starting 16-byte aligned
    (strides (1, rows rounded up to 4)): how the FP8 matmul's bulk copies take (1, 128) block
    scales, a K step's rows at a time. ``alloc`` makes the storage (``testing.new_output``: poisoned
    in tests)."""
    rows, cols = shape
    return alloc((cols, cdiv(rows, 4) * 4), dtype=torch.float32, device=device)[:, :rows].t()


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), without ``triton.next_power_of_2``'s wrapper."""
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def stream_handle(device: torch.device) -> int:
    """The raw handle of the current stream on a CUDA device, as Triton launches on it (about 0.1 us;
    ``torch.cuda.current_stream(device).cuda_stream`` makes a Stream object, about 7 us on the
    H200's host, s57a)."""
    return driver.active.get_current_stream(_index(device))


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


# Programmatic dependent launch, opt in (True): the Gluon matmul of a few rows
# (``matmul_gluon.launches_early``), the tl matmul of up to PDL_MAX_M rows and the one-pass quantize
# then start while the kernel ahead of them still runs, wait for it before they touch memory, and
# let the next kernel start early (the tl matmul's block-scaled decode pair, quantize then product,
# 0.95-1.16 x as fast as without, session 36).
# Back to back, the products gained up to a microsecond each, and a layer's quantize-then-product
# pair 0.97-1.19 x (session 35, s35c, s35d); but a product launched so after a kernel that did not
# let it start early lost 0.26-2.5 us a pair (s35a), as it would after a caller's own kernels.
PDL = False
PDL_MAX_M = 128  # the matmuls take part up to this many rows of A (a long product gains little from a microsecond)


def launches_early_on(device: torch.device) -> bool:
    """Whether our kernels' launches on ``device`` are programmatic dependent ones: ``PDL`` opts in,
    and the device has them (compute capability 9.0 or newer: ``griddepcontrol`` is sm_90's)."""
    return PDL and has_tma(device)


@contextlib.contextmanager
def early_launch(on: bool = True):
    """``PDL`` set to ``on`` within the block (the benchmarks' A/B of it), then back as it was."""
    global PDL
    saved, PDL = PDL, on
    try:
        yield
    finally:
        PDL = saved


SM_SHARED_BYTES = 228 * 1024  # an H100 / H200 SM's shared memory, of which each resident CTA ...
CTA_RESERVED_BYTES = 1024  # ... takes this much beside its own (so one CTA has 227 KB at most)
SM_REGISTERS = 64 * 1024  # an H100 / H200 SM's 32-bit registers


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


# Triton's names of element types in a kernel signature ("*bf16", "tensordesc<fp8e4nv[...]>"): what
# the offline builds below are typed with.
SIGNATURE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
                   torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


# A pointer argument marked 16-byte aligned, as Triton specializes a launch on aligned tensors
_ALIGNED = [["tt.divisibility", 16]]


def build_for_sm90(fn, types: dict, constants: dict, **options):
    """Compile a Gluon kernel for sm_90 without a GPU (what the CPU tests check): ``types`` gives
    each runtime argument's type ("*fp32", "i32", a tensor-descriptor type), ``constants`` each
    constexpr argument's value. Pointers count as 16-byte aligned, as Triton specializes a launch
    on aligned tensors. Returns the compiled kernel (PTX in ``.asm["ptx"]``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: "constexpr" if name in constants else types[name] for name in fn.arg_names}
    index = {name: i for i, name in enumerate(fn.arg_names)}
    fixed = {(index[name],): value for name, value in constants.items()}
    aligned = {(index[name],): _ALIGNED for name, type_name in signature.items() if type_name.startswith("*")}
    return triton.compile(GluonASTSource(fn, signature, fixed, aligned), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, **options))


def build_tl_for_sm90(fn, args: dict, constants: dict, **options):
    """Compile a ``tl`` kernel for sm_90 without a GPU, specialized as a launch with these arguments
    would be: ``args`` gives each runtime argument as a type ("*bf16", "fp64", "i32") or an int
    value (1 becomes a constant and multiples of 16 are marked divisible, as Triton does at
    launch; pointers count as 16-byte aligned), ``constants`` each constexpr's value."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs, fixed = {}, {}, dict(constants)
    for i, name in enumerate(fn.arg_names):
        value = args.get(name)
        if name in constants:
            signature[name] = "constexpr"
        elif isinstance(value, str):
            signature[name] = value
            if value.startswith("*"):
                attrs[(i,)] = _ALIGNED
        elif value == 1:
            signature[name] = "constexpr"
            fixed[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = _ALIGNED
    index = {name: i for i, name in enumerate(fn.arg_names)}
    fixed = {(index[name],): value for name, value in fixed.items()}
    return triton.compile(ASTSource(fn, signature, fixed, attrs), target=GPUTarget("cuda", 90, 32), options=options)


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
    scratch = torch.empty(size, dtype=torch.int8, device="cuda")
    note_scratch(scratch.data_ptr())
    return scratch


def ensure_descriptor_allocator(device: torch.device) -> None:
    """Descriptors built inside a kernel live in a global-memory scratch buffer that triton
    asks the host to allocate (the interpreter needs none). Triton keeps the allocator in a
    context variable, which every thread sees anew (autograd runs the backward pass on a
    thread of its own), so it is set on each call: a context-variable write, ~100 ns."""
    if device.type == "cuda":
        triton.set_allocator(_scratch)


def _arg_key(arg):
    """What Triton specializes a launch on, or finer: a tensor's dtype and 16-byte alignment, an
    integer's value, a descriptor's tensor, shape, strides, block, padding and (Gluon's) layout."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if hasattr(arg, "block_shape"):  # a host tensor descriptor: Triton's (tl) or Gluon's, which has a layout
        return _descriptor_key(arg)
    if isinstance(arg, float):
        return float
    return arg  # int, bool, None, constexpr values


def _descriptor_key(desc):
    """A host tensor descriptor's ``_arg_key``: its tensor's dtype and alignment, shape, strides,
    block, padding and (Gluon's) layout."""
    base = desc.base
    return (base.dtype, base.data_ptr() % 16 == 0, tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape),
            getattr(desc, "padding", None), getattr(desc, "layout", None))


def _int_type(value: int) -> str:
    """The integer type Triton gives a parameter it does not specialize (``do_not_specialize``)."""
    return "i32" if -2**31 <= value < 2**31 else "u64" if value >= 2**63 else "i64"


# While ``replay.record`` runs: .launches, a list of this thread's launches, and .scratch, the
# addresses of the scratch memory (``_scratch``) Triton took for those of them that use it.
LAUNCH_LOG = threading.local()


def note_launch(compiled, grid: tuple, values: list) -> None:
    """A launch of ``CachedLauncher``'s (a compiled kernel, its grid, its arguments in the kernel's
    order), kept where ``replay.record`` runs in this thread."""
    launches = getattr(LAUNCH_LOG, "launches", None)
    if launches is not None:
        launches.append((compiled, grid, values))


def note_scratch(address: int) -> None:
    """The address of scratch memory Triton took for a launch (``_scratch``), kept where
    ``replay.record`` runs in this thread: the replay finds it among the call's intermediates."""
    addresses = getattr(LAUNCH_LOG, "scratch", None)
    if addresses is not None:
        addresses.append(address)


class CachedLauncher:
    """``launcher[grid](*args, **kwargs)``: ``kernel[grid](...)`` without Triton's per-call
    argument binding for arguments it has seen before.

    Each ``kernel[grid](...)`` call binds and specializes every argument and rebuilds the
    kernel's cache key: tens of microseconds of Python for a Gluon kernel with tensor
    descriptors, as much as a short kernel runs. This launcher binds the arguments to the
    kernel's parameters by name, keys the compiled kernel that Triton's call returned by
    everything Triton specializes on (``_arg_key``: dtypes, pointer alignment, integer values,
    constexprs, options; the type alone for ``do_not_specialize`` parameters) and launches it
    directly the next time the key comes back. A miss takes Triton's own path, so compiling,
    caching on disk and checks stay Triton's; so does every call in Triton's interpreter."""

    def __init__(self, kernel, maxsize: int = 512):
        self.kernel = kernel
        self.maxsize = maxsize
        self.compiled = collections.OrderedDict()
        params = getattr(kernel, "params", [])  # (the interpreter's functions have none: not needed there)
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.has_default}
        self.loose = [i for i, p in enumerate(params) if p.do_not_specialize and not p.is_constexpr]

    def __getitem__(self, grid: tuple):
        return functools.partial(self._launch, grid)

    def _launch(self, grid: tuple, *args, **kwargs):
        if not hasattr(self.kernel, "device_caches"):  # Triton's interpreter: nothing compiled to keep
            return self.kernel[grid](*args, **kwargs)
        values = list(args)  # every parameter in the kernel's order; what is left in kwargs are options
        for name in self.names[len(args):]:
            if name in kwargs:
                values.append(kwargs.pop(name))
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                raise TypeError(f"{self.kernel.__name__}() missing argument {name!r}")
        device = driver.active.get_current_device()
        key = [device, *kwargs.items()]
        base = len(key)
        for value in values:  # _arg_key, with the common cases inline: this loop runs on every launch
            kind = type(value)
            if kind is int:
                key.append(value)
            elif kind is torch.Tensor:
                key.append((value.dtype, value.data_ptr() % 16 == 0))
            elif kind is GluonDescriptor:  # (the Gluon kernels pass up to seven)
                key.append(_descriptor_key(value))
            else:
                key.append(_arg_key(value))
        for i in self.loose:  # do_not_specialize: the value's integer type, not the value
            if type(values[i]) is int:
                key[base + i] = _int_type(values[i])
        key = tuple(key)
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = compiled = self._first_launch(grid, device, values, kwargs)
            if len(self.compiled) > self.maxsize:  # the oldest key goes first
                self.compiled.popitem(last=False)
        else:
            self._run(compiled, (*grid, 1, 1), device, values)
        note_launch(compiled, grid, values)  # (where a layer records its launches: replay.record)
        return compiled

    def _first_launch(self, grid: tuple, device: int, values: list, kwargs: dict):
        """A key's first call: Triton's own path (binding, compiling or its caches, the launch).
        The compiled kernel."""
        return self.kernel[grid](*values, **kwargs)

    @staticmethod
    def _run(compiled, grid: tuple, device: int, values: list) -> None:
        """Launch a compiled kernel on the current stream; the launcher takes every parameter in
        the kernel's order and skips the constexprs."""
        stream = driver.active.get_current_stream(device)
        if launches_hookless():
            # Nobody listens (a profiler such as proton adds hooks): no launch metadata to make and
            # no empty hook chains for the launcher to call back into Python for.
            metadata = enter = leave = None
        else:
            metadata = compiled.launch_metadata(grid, stream, *values)
            enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata, enter,
                     leave, *values)


def launches_hookless() -> bool:
    """Whether no launch hook listens (a profiler such as proton adds its own)."""
    return _no_hooks(knobs.runtime.launch_enter_hook) and _no_hooks(knobs.runtime.launch_exit_hook)


def _no_hooks(hook) -> bool:
    """Whether a Triton launch hook (None, a function, or Triton 3.6's chain of them) calls nothing."""
    return hook is None or getattr(hook, "calls", None) == []
