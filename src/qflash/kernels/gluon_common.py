"""Gluon pieces shared by the Hopper kernels (``attention_gluon.py``, ``matmul_gluon.py``): the
mbarriers of their warp-specialized rings, grid dependency control, and their host tensor
descriptors."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def barrier(count: gl.constexpr):
    """One barrier in shared memory that completes after ``count`` arrivals."""
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=count)
    return bar


@gluon.jit
def ring_barriers(SLOTS: gl.constexpr, FILLS: gl.constexpr, RELEASES: gl.constexpr):
    """(ready, empty) barriers of a ring of SLOTS shared-memory slots: ready[s] completes after
    FILLS arrivals (the copies' expect counts one), empty[s] once RELEASES consumers let go."""
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(SLOTS):
        mbarrier.init(ready.index(s), count=FILLS)
        mbarrier.init(empty.index(s), count=RELEASES)
    return ready, empty


@gluon.jit
def wait_for_prior_grids():
    """Wait until the kernels before this one in the stream have finished and their writes are
    visible (``griddepcontrol.wait``). Launched with programmatic dependent launch (Triton's
    ``launch_pdl``) a kernel may start while the one before it still runs: nothing may read or
    write global memory before this wait. Without that launch it returns at once."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def let_next_grid_launch():
    """Let the next kernel in the stream, if it was launched with programmatic dependent launch,
    start on the SMs this grid leaves free (``griddepcontrol.launch_dependents``; the first call a
    CTA counts). That kernel still waits for this one to finish before it touches memory."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


def unchecked_descriptor(base, shape, strides, block_shape, layout) -> TensorDescriptor:
    """A Gluon host tensor descriptor made without its constructor's checks (alignment, unit last
    stride, block shape), for operands that the kernel's ``why_not`` has checked or outputs we
    made: the checks cost about 3 us of Python a descriptor on every launch (a 512-token
    attention call has four, a matmul three). The launcher reads the base's address and dtype
    and the lists here."""
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block_shape, layout=layout,
                         padding="zero")
    return desc
