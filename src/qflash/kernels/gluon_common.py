"""Gluon pieces shared by the Hopper kernels (``attention_gluon.py``, ``matmul_gluon.py``): the
mbarriers of their warp-specialized rings, grid dependency control, their host tensor
descriptors, and the steps of kernels launched in clusters of two or four CTAs (multicast copies,
arrivals on the other CTAs' barriers, the buffers' offsets those name, the launcher)."""

from __future__ import annotations

import os
import re
import tempfile

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from qflash.kernels.common import CTA_RESERVED_BYTES, SM_REGISTERS, SM_SHARED_BYTES, CachedLauncher


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


# Clusters of CTAs (two or four) that share tiles by TMA multicast. A kernel built for one CTA runs
# in clusters when its launch asks for them (``ClusterLauncher``), but Triton 3.6's Gluon has no
# multicast copy, no arrival on another CTA's barrier and no way to name a buffer's address in
# shared memory; so these steps are inline PTX, given the buffers' byte offsets (``smem_offsets``,
# read off the built kernel) as constexprs. An arrival is made by the first thread of each
# warpgroup that runs it (thread 0 of its 128); a copy by a lane the warp elects where one warp
# runs it (Triton may place a one-warp partition anywhere in its warpgroup), else by thread 0 of
# the warps that run it.
@gluon.constexpr_function
def _multicast_asm(desc_param: str, cta_mask: int, warps: int) -> str:
    """The PTX of ``multicast_copy`` for the tensor descriptor that is the kernel parameter named
    ``desc_param`` (the descriptor's 128 bytes as Triton passes them: ``<kernel>_param_<i>``)."""
    # the copying thread: a lane the warp elects (one warp), or thread 0 of each ``warps`` warps
    leader = ("elect.sync _|p, 0xffffffff;" if warps == 1 else
              f"mov.u32 t, %tid.x; and.b32 t, t, {32 * warps - 1}; setp.eq.u32 p, t, 0;")
    return ("{ .reg .pred p; .reg .b32 t, dst, bar; .reg .b64 map; .reg .b16 mask;\n"
            f"{leader}\n"
            "mov.u32 dst, global_smem; add.u32 bar, dst, $2; add.u32 dst, dst, $1;\n"
            f"mov.b64 map, {desc_param}; cvta.param.u64 map, map; mov.u16 mask, {cta_mask};\n"
            "@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            " [dst], [map, {$3, $4}], [bar], mask;\n"
            "mov.u32 $0, 0; }")


@gluon.jit
def multicast_copy(DESC_PARAM: gl.constexpr, x, y, dst_at, bar_at, CTA_MASK: gl.constexpr = 3):
    """One box of the 2-D tensor descriptor ``DESC_PARAM`` (the kernel parameter's PTX name), at
    column ``x`` and row ``y``, copied into shared memory at byte ``dst_at`` of every CTA of the
    cluster in ``CTA_MASK`` (bit i: rank i), each CTA's mbarrier at byte ``bar_at`` counting the
    bytes that reach it, as a plain copy's does; made once by the warps that run it (the calling
    partition's: one, or a warpgroup). The offsets are the same in every CTA: all run one
    kernel."""
    gl.inline_asm_elementwise(_multicast_asm(DESC_PARAM, CTA_MASK, gl.num_warps()), "=r,r,r,r,r",
                              [dst_at, bar_at, x, y], dtype=gl.int32, is_pure=False, pack=1)


@gluon.constexpr_function
def _remote_arrive_asm(ctas: int) -> str:
    """The PTX of ``remote_arrive`` in a cluster of ``ctas`` CTAs (a power of two): the other CTAs
    are this one's rank with each of the bits below ``ctas`` flipped. (Release at the CTA's scope,
    as CUTLASS's cluster barriers arrive: the slot was read by the tensor cores, whose reads a
    generic release does not order anyway; at the cluster's scope each arrival waited as a fence
    does, and pairs took 1.6 x the time of the kernel without clusters at 8192^3, s67d.)"""
    arrivals = "".join(f"xor.b32 peer, rank, {i}; mapa.shared::cluster.u32 remote, bar, peer;\n"
                       "@p mbarrier.arrive.shared::cluster.b64 _, [remote];\n" for i in range(1, ctas))
    return ("{ .reg .pred p; .reg .b32 t, bar, rank, peer, remote;\n"
            "mov.u32 t, %tid.x; and.b32 t, t, 127; setp.eq.u32 p, t, 0; setp.ne.and.u32 p, $2, 0, p;\n"
            "mov.u32 rank, %cluster_ctarank; mov.u32 bar, global_smem; add.u32 bar, bar, $1;\n"
            f"{arrivals}mov.u32 $0, 0; }}")


@gluon.jit
def remote_arrive(bar_at, go=1, CTAS: gl.constexpr = 2):
    """One arrival on the mbarrier at byte ``bar_at`` of each other CTA of a cluster of CTAS (by the
    warpgroup's first thread), where ``go`` is not 0: what this CTA read of the slot it guards is
    done."""
    gl.inline_asm_elementwise(_remote_arrive_asm(CTAS), "=r,r,r", [bar_at, go], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def fence_barrier_init():
    """Make this CTA's mbarrier initializations visible to the other CTAs of its cluster (before
    ``cluster_sync``): a copy multicast into this CTA, or a remote arrival, may reach them next."""
    gl.inline_asm_elementwise("fence.mbarrier_init.release.cluster; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def cluster_sync():
    """Wait until every thread of every CTA of the cluster has come here. Every warp of a
    warp-specialized kernel must (none idle: a partition's warps a multiple of four), so each
    partition calls it first."""
    gl.inline_asm_elementwise("barrier.cluster.arrive.release; barrier.cluster.wait.acquire; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


def smem_offsets(compiled) -> dict:
    """Where a built Gluon kernel's shared-memory buffers lie: {name: byte offset}, by the name of
    the variable each ``allocate_shared_memory`` was assigned to (``a_ring``, ``ready``, ...).
    Triton decides the offsets while it lowers the kernel and keeps them nowhere; this runs its
    passes up to that allocation again on the kernel's TTGIR, as its build for sm_90 ran them."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend, get_ptx_version_from_options

    meta = compiled.metadata
    context = ir.context()
    ir.load_dialects(context)
    CUDABackend(GPUTarget("cuda", 90, 32)).load_dialects(context)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttgir")
        with open(path, "w") as f:
            f.write(compiled.asm["ttgir"])
        module = ir.parse_mlir_module(path, context)
    module.context = context
    pm = ir.pass_manager(context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, get_ptx_version_from_options(meta, 90))
    pm.run(module, "smem_offsets")
    found = re.findall(r"%(\w+) = ttg\.local_alloc \{allocation\.offset = (\d+) : i32\}", str(module))
    return {name: int(offset) for name, offset in found}


def build_in_clusters(build, buffers: tuple):
    """A kernel for clusters whose ``SMEM_AT`` constexpr gives the byte offsets of ``buffers`` in
    shared memory: ``build(smem_at)`` (the built kernel) first with zeros, to find where the
    buffers lie (``smem_offsets``), then with those offsets, checked to be where that build put
    them (they only enter inline PTX, so they should not move)."""
    found = smem_offsets(build((0,) * len(buffers)))
    at = tuple(found[name] for name in buffers)
    compiled = build(at)
    moved = smem_offsets(compiled)
    if tuple(moved[name] for name in buffers) != at:
        raise RuntimeError(f"shared-memory buffers {buffers} moved between two builds ({at} -> {moved}): the "
                           f"cluster's copies would miss them")
    return compiled


def ctas_per_sm(compiled) -> int:
    """How many CTAs of a built kernel an SM holds at once, by their registers and shared memory."""
    compiled._init_handles()
    by_registers = SM_REGISTERS // max(1, compiled.n_regs * 32 * compiled.metadata.num_warps)
    by_shared = SM_SHARED_BYTES // (compiled.metadata.shared + CTA_RESERVED_BYTES)
    return max(1, min(by_registers, by_shared))


def resident_clusters(compiled, ctas: int) -> int:
    """How many clusters of ``ctas`` CTAs the GPU holds at once, ``ctas_per_sm(compiled)`` an SM,
    asked of the built kernel (``cuOccupancyMaxActiveClusters``). A cluster's CTAs run in one GPC,
    so the GPCs' sizes can leave SMs over: the answer may be under SMs x CTAs an SM / ctas.
    (Triton's helper asks for CTAs of 128 threads, whatever the kernel's; each is given its share
    of the SM's shared memory, so that as many fit an SM as the kernel's own.)"""
    from triton.runtime import driver

    share = SM_SHARED_BYTES // ctas_per_sm(compiled) - CTA_RESERVED_BYTES
    return driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, share, ctas)


class ClusterLauncher(CachedLauncher):
    """``CachedLauncher`` for a Gluon kernel built for one CTA and launched in clusters of ``CTAS``
    CTAs (its constexpr: two or four), whose ``CLUSTER`` constexpr turns on the copies and
    arrivals between them (``multicast_copy``, ``remote_arrive``) and whose ``SMEM_AT`` constexpr
    gives those the byte offsets of ``buffers`` in shared memory (``build_in_clusters``: a key's
    first call builds the kernel twice). The grid counts clusters. The build's launches make
    clusters through this launcher or any other, a replay's included: Triton's launcher clusters
    ``num_ctas`` CTAs, read from the metadata it is passed.

    ``resident``: {(device, CTAS, CTAs an SM): clusters the GPU holds at once}
    (``resident_clusters``), asked at a key's first call. A persistent kernel's caller sizes its
    grid by it (``persistent``: the first call's own grid is cut to it too), so that no cluster
    waits for another to finish."""

    def __init__(self, kernel, buffers: tuple, maxsize: int = 512, persistent: bool = False):
        super().__init__(kernel, maxsize)
        self.buffers = buffers
        self.persistent = persistent
        self.resident = {}

    def _first_launch(self, grid: tuple, device: int, values: list, kwargs: dict):
        at = self.names.index("SMEM_AT")

        def build(smem_at):
            return self.kernel.warmup(*values[:at], smem_at, *values[at + 1:], grid=grid, **kwargs)

        compiled = build_in_clusters(build, self.buffers)
        meta = compiled.metadata
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            raise RuntimeError(f"{self.kernel.__name__}: Triton sizes global scratch memory a CTA, not a cluster")
        ctas = values[self.names.index("CTAS")]
        compiled.packed_metadata = (meta.num_warps, ctas, meta.shared)
        key = (device, ctas, ctas_per_sm(compiled))
        if key not in self.resident:
            self.resident[key] = resident_clusters(compiled, ctas)
        if self.persistent:
            grid = (min(grid[0], self.resident[key]), *grid[1:])
        self._run(compiled, (*grid, 1, 1), device, values)
        return compiled
