"""Gluon pieces shared by the Hopper kernels (``attention_gluon.py``, ``matmul_gluon.py``): the
mbarriers of their warp-specialized rings, and their host tensor descriptors."""

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
