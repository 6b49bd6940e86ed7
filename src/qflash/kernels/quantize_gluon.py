"""Dynamic per-tensor quantize for Hopper in Gluon: one cooperative launch, the input held in
shared memory between the absmax and the quantize phase.

A per-tensor scale needs the absmax of the whole tensor before the first value is quantized.
``quantize._tensor_kernel`` (``tl``) holds up to 128 KB an SM in registers and streams the
rest, through registers, with one program an SM. Here bulk copies (TMA) bring the input into
shared memory, up to SLOTS chunks of BLOCK_R x 256 values an SM at once (224 KB: 29 MB on the
H200), and what one SM's share holds beyond that streams through the same slots:

    the flat input, viewed as [numel / 256, 256], in chunks of BLOCK_R rows;
    program p takes chunks p, p + programs, ...  (its j-th: chunk p + j * programs)

    phase one   j = 0 .. mine - 1 through the ring of slots (slot j % SLOTS); the absmax of each;
                the last SLOTS stay where they are
    barrier     the programs' maxima into Amax (atomic max), then a grid barrier (Arrived)
    phase two   quantize the held chunks from shared memory; each freed slot takes one of the
                streamed chunks again, the last read first (the likeliest still in L2)

Every value is read from memory once where a program's share fits its slots (up to 29 MB),
against twice for what ``_tensor_kernel`` streams. The rounding is ``quantize``'s: the same
helpers, the same bits.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from qflash.kernels.common import SIGNATURE_NAMES, CachedLauncher, build_for_sm90, cdiv, is_hopper, sm_count
from qflash.kernels.gluon_common import unchecked_descriptor
from qflash.kernels.quantize import _quantized, _scale_of
from qflash.reference.quantize import QMAX

COLS = 256  # the flat input viewed as rows of 256 values: a bulk copy's box is at most 256 wide
SLOT_BYTES = 16 * 1024  # a chunk: BLOCK_R = 32 rows of 16-bit values, 16 of float32
SLOTS = 14  # 224 KB of shared memory a CTA
WARPS = 4

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
_GL_OUT = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


@gluon.jit
def _fetch(x_desc, chunk, ready, slot):
    """Start the bulk copy of chunk (BLOCK_R rows) into a slot; ready completes when it lands
    (rows past the end come as zeros)."""
    mbarrier.expect(ready, x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [chunk * x_desc.block_type.shape[0], 0], ready, slot)


@gluon.jit
def _load_acquire(ptr):
    """An int32 load with acquire semantics at GPU scope (no read-modify-write for a spin to queue behind)."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _abs_bits(x):
    """|x| as an integer of x's width (the sign bit cleared): for values >= 0 integer order is
    float order, and every NaN lies above inf."""
    if x.dtype.primitive_bitwidth == 32:
        bits = x.to(gl.int32, bitcast=True) & 0x7FFFFFFF
    else:
        bits = x.to(gl.int16, bitcast=True) & 0x7FFF
    return bits


@gluon.jit
def _tensor_kernel(x_desc, Xq, Scale, Amax, Arrived, rows,
                   QMAX: gl.constexpr, OUT: gl.constexpr, SLOTS: gl.constexpr, SELF_RESET: gl.constexpr = False,
                   MAX_PROGRAMS: gl.constexpr = 256):
    BLOCK_R: gl.constexpr = x_desc.block_type.shape[0]
    COLS: gl.constexpr = x_desc.block_type.shape[1]
    WIDE: gl.constexpr = x_desc.dtype.primitive_bitwidth == 32
    # 16 values a thread along a row (16-byte stores of 8-bit output), two rows a warp
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [gl.num_warps(), 1], [1, 0])
    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    mine = gl.cdiv(gl.cdiv(rows, BLOCK_R) - pid, progs)  # this program's chunks (>= 1: programs <= chunks)
    held = gl.minimum(mine, SLOTS)
    streamed = mine - held

    ring = gl.allocate_shared_memory(x_desc.dtype, [SLOTS, BLOCK_R, COLS], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)

    # Phase one: every chunk through the ring, its absmax; the last `held` stay in their slots.
    for j in range(held):
        _fetch(x_desc, pid + j * progs, ready.index(j), ring.index(j))
    top = gl.zeros([BLOCK_R, COLS], gl.int32 if WIDE else gl.int16, layout)  # [BLOCK_R, COLS]
    for j in range(mine):
        s = j % SLOTS
        mbarrier.wait(ready.index(s), (j // SLOTS) & 1)
        top = gl.maximum(top, _abs_bits(ring.index(s).load(layout)))
        if j + SLOTS < mine:  # a streamed chunk: its slot takes the chunk SLOTS on
            gl.thread_barrier()  # every warp has read the slot ...
            fence_async_shared()  # ... before the copy engine writes it
            _fetch(x_desc, pid + (j + SLOTS) * progs, ready.index(s), ring.index(s))
    top = gl.max(gl.max(top, axis=1), axis=0)
    if WIDE:
        amax = top.to(gl.float32, bitcast=True)
    else:
        amax = top.to(gl.int16).to(x_desc.dtype, bitcast=True).to(gl.float32)  # (the max came back as int32)
    amax = gl.where(amax < float("inf"), amax, float("inf"))  # a NaN as inf: not finite either way
    if SELF_RESET:
        # Amax: a maximum a program; Arrived: (count, generation), left with count 0 for the next launch
        gen = _load_acquire(Arrived + 1)
        gl.store(Amax + pid, amax)
        if gl.atomic_add(Arrived, 1, sem="acq_rel", scope="gpu") == progs - 1:  # the last to arrive
            gl.store(Arrived, 0)
            gl.atomic_xchg(Arrived + 1, gen + 1, sem="release", scope="gpu")
        else:
            while _load_acquire(Arrived + 1) == gen:
                pass
        p = gl.arange(0, MAX_PROGRAMS, gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
        scale, inv = _scale_of(gl.max(gl.load(Amax + p, mask=p < progs, other=0.0, cache_modifier=".cg"), axis=0),
                               QMAX)
    else:
        gl.atomic_max(Amax, amax, sem="release", scope="gpu")  # all >= 0: float order is int order
        # The grid barrier: every program has added its maximum (the launch is cooperative: all resident).
        arrived = gl.atomic_add(Arrived, 1, sem="acq_rel", scope="gpu") + 1
        while arrived < progs:
            arrived = gl.atomic_add(Arrived, 0, sem="acquire", scope="gpu")
        scale, inv = _scale_of(gl.atomic_max(Amax, 0.0, sem="acquire", scope="gpu"), QMAX)
    if pid == 0:
        gl.store(Scale, scale)

    # Phase two: item k < held is the held chunk j = streamed + k; item k >= held the streamed
    # chunk j = streamed - 1 - (k - held), fetched again (fill mine + k - held of the ring).
    # Either way its slot is (streamed + k) % SLOTS, and item k + SLOTS reuses item k's.
    r = gl.arange(0, BLOCK_R, gl.SliceLayout(1, layout))[:, None]  # [BLOCK_R, 1]
    c = gl.arange(0, COLS, gl.SliceLayout(0, layout))[None, :]  # [1, COLS]
    for k in range(mine):
        s = (streamed + k) % SLOTS
        if k < held:
            j = streamed + k
        else:
            j = streamed - 1 - (k - held)
            fill = mine + k - held
            mbarrier.wait(ready.index(s), (fill // SLOTS) & 1)
        x = ring.index(s).load(layout)  # [BLOCK_R, COLS]
        if k + SLOTS < mine:
            gl.thread_barrier()
            fence_async_shared()
            _fetch(x_desc, pid + (streamed - 1 - k) * progs, ready.index(s), ring.index(s))
        row = (pid + j * progs) * BLOCK_R + r  # [BLOCK_R, 1]
        q = _quantized(x.to(gl.float32), inv, QMAX, OUT, False)
        gl.store(Xq + row.to(gl.int64) * COLS + c, q, mask=row < rows)


_launcher = CachedLauncher(_tensor_kernel)


def why_not(x: torch.Tensor) -> Optional[str]:
    """None if this kernel takes a dynamic per-tensor quantize of x, else why not."""
    if not is_hopper(x.device):
        return f"the Gluon quantize runs on Hopper (compute capability 9.x), got a tensor on {x.device}"
    if x.dtype not in _GL_DTYPES:
        return f"x must be bfloat16, float16 or float32, got {x.dtype}"
    if not x.is_contiguous() or x.numel() % COLS or x.data_ptr() % 16:
        return f"x must be contiguous, 16-byte aligned and a multiple of {COLS} values"
    return None


def _descriptor(x: torch.Tensor, slot_bytes: int = SLOT_BYTES):
    bits = x.element_size() * 8
    block = [slot_bytes // (COLS * x.element_size()), COLS]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=2)
    return unchecked_descriptor(x, [x.numel() // COLS, COLS], [COLS, 1], block, layout)


_SCRATCH = {}


def launch(x: torch.Tensor, x_q: torch.Tensor, scale: torch.Tensor, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES,
           warps: int = WARPS, self_reset: bool = False) -> None:
    """Quantize x (accepted by ``why_not``) into x_q with one scale from its absmax, written to
    scale. Raises RuntimeError where the GPU refuses the cooperative launch."""
    desc = _descriptor(x, slot_bytes)
    rows = x.numel() // COLS
    programs = min(sm_count(x.device), cdiv(rows, desc.block_shape[0]))
    if self_reset:
        key = (x.device, torch.cuda.current_stream(x.device).cuda_stream)
        if key not in _SCRATCH:
            _SCRATCH[key] = torch.zeros(258, dtype=torch.int32, device=x.device)
        scratch = _SCRATCH[key]
        amax, arrived = scratch[2:].view(torch.float32), scratch[:2]
    else:
        zeroed = torch.zeros(2, dtype=torch.int32, device=x.device)  # Amax (float32 bits), then Arrived
        amax, arrived = zeroed.view(torch.float32), zeroed[1:]
    _launcher[(programs,)](desc, x_q, scale, amax, arrived, rows,
                           QMAX=QMAX[x_q.dtype], OUT=_GL_OUT[x_q.dtype], SLOTS=slots, num_warps=warps,
                           launch_cooperative_grid=True, SELF_RESET=self_reset)


def compile_for_sm90(x_dtype: torch.dtype = torch.bfloat16, dtype: torch.dtype = torch.float8_e4m3fn,
                     slots: int = SLOTS, self_reset: bool = False, warps: int = WARPS):
    """Build the kernel for sm_90 without a GPU (what the CPU tests read)."""
    size = torch.empty((), dtype=x_dtype).element_size()
    block = SLOT_BYTES // (COLS * size)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=size * 8, rank=2)
    types = dict(x_desc=f"tensordesc<{SIGNATURE_NAMES[x_dtype]}[{block}, {COLS}],{layout!r}>",
                 Xq=f"*{SIGNATURE_NAMES[dtype]}", Scale="*fp32", Amax="*fp32", Arrived="*i32", rows="i32")
    constants = dict(QMAX=QMAX[dtype], OUT=_GL_OUT[dtype], SLOTS=slots, SELF_RESET=self_reset, MAX_PROGRAMS=256)
    return build_for_sm90(_tensor_kernel, types, constants, num_warps=warps)
