"""Gluon pieces shared by the Hopper kernels (``attention_gluon.py``, ``matmul_gluon.py``): the
mbarriers of their warp-specialized rings."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


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
