"""The cluster steps of ``qflash.kernels.gluon_common`` on a kernel small enough to read: the CTAs
of a cluster (two or four) each copy their part of a tile to all of them by multicast, each reads
the whole tile and tells the others it is done by an arrival on each one's barrier. Built offline
on any machine; run on the H200, where it checks the steps apart from the matmul that uses them."""

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from qflash.kernels.common import build_for_sm90, nvmma_layout
from qflash.kernels.gluon_common import (ClusterLauncher, build_in_clusters, cluster_sync, fence_barrier_init,
                                         multicast_copy, remote_arrive, unchecked_descriptor)

from conftest import barrier_inits, sm90_build

ROWS, COLS = 64, 64  # the tile; each CTA of a cluster copies ROWS / CTAS of its rows
X_PARAM = gl.constexpr("_cluster_kernel_param_0")  # x_desc, the first parameter
BUFFERS = ("tile", "ready", "done")


@gluon.jit
def _cluster_kernel(x_desc, Out, CTAS: gl.constexpr = 2, SMEM_AT: gl.constexpr = (0, 0, 0)):
    """CTA ``rank`` of cluster ``cluster`` copies rows [rank * PART, (rank + 1) * PART) of x's tile
    ``cluster`` to every CTA of the cluster, waits for the whole tile and writes it to
    Out[CTAS * cluster + rank]; then it arrives on each other CTA's ``done`` and waits for their
    arrivals on its own, so that none leaves while another may still reach it."""
    PART: gl.constexpr = x_desc.block_type.shape[0]
    tile = gl.allocate_shared_memory(x_desc.dtype, [CTAS * PART, x_desc.block_type.shape[1]], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(done, count=CTAS - 1)
    fence_barrier_init()
    cluster_sync()
    cluster = gl.program_id(0) // CTAS
    rank = gl.program_id(0) % CTAS
    mbarrier.expect(ready, CTAS * x_desc.block_type.nbytes)  # every part lands here
    multicast_copy(X_PARAM, 0, (CTAS * cluster + rank) * PART, SMEM_AT[0] + rank * x_desc.block_type.nbytes,
                   SMEM_AT[1], (1 << CTAS) - 1)
    mbarrier.wait(ready, 0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    x = tile.load(layout)  # [CTAS * PART, COLS]
    rows = gl.arange(0, CTAS * PART, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, x_desc.block_type.shape[1], layout=gl.SliceLayout(0, layout))
    base = gl.program_id(0) * (CTAS * PART * x_desc.block_type.shape[1])
    gl.store(Out + base + gl.expand_dims(rows, 1) * x_desc.block_type.shape[1] + gl.expand_dims(cols, 0), x)
    remote_arrive(SMEM_AT[2], 1, CTAS)
    mbarrier.wait(done, 0)


_launcher = ClusterLauncher(_cluster_kernel, BUFFERS)


def compile_for_sm90(ctas: int = 2):
    """The kernel built offline for sm_90, for clusters of ``ctas`` (``build_in_clusters``)."""
    layout = nvmma_layout((ROWS // ctas, COLS), gl.float16)
    types = {"x_desc": f"tensordesc<fp16[{ROWS // ctas}, {COLS}],{layout!r}>", "Out": "*fp16"}
    return build_in_clusters(lambda smem_at: build_for_sm90(_cluster_kernel, types, {"CTAS": ctas, "SMEM_AT": smem_at}),
                             BUFFERS)


@pytest.mark.parametrize("ctas", [2, 4])
def test_cluster_kernel_builds(ctas):
    """Built offline: one multicast copy to every CTA of the cluster naming x's descriptor
    parameter, an arrival on each other CTA's barrier (its address by ``mapa``; release at the
    CTA's scope), the barriers'
    initialization fenced for the cluster before one cluster barrier; and the offsets it names are
    where it initializes its barriers."""
    kernel = sm90_build("test_gluon_common", ctas, with_offsets=True)
    ptx, at = kernel["ptx"], kernel["smem"]
    assert ptx.count(".multicast::cluster [dst], [map,") == 1 and "mov.b64 map, _cluster_kernel_param_0;" in ptx
    assert f"mov.u16 mask, {2 ** ctas - 1};" in ptx
    assert ptx.count("mapa.shared::cluster.u32") == ctas - 1 and ".release.cluster.shared" not in ptx
    assert ptx.count("@p mbarrier.arrive.shared::cluster.b64 _, [remote];") == ctas - 1
    assert ptx.count("barrier.cluster.arrive.release;") == 1
    assert ptx.index("fence.mbarrier_init.release.cluster;") < ptx.index("barrier.cluster.arrive.release;")
    assert set(at) == set(BUFFERS) and at["tile"] % 1024 == 0
    if ctas == 2:
        assert barrier_inits(ptx) == {1: [at["ready"], at["done"]]}
    else:
        assert barrier_inits(ptx) == {1: [at["ready"]], ctas - 1: [at["done"]]}


@pytest.mark.gpu
@pytest.mark.parametrize("ctas,clusters", [(2, 1), (2, 3), (2, 66), (4, 1), (4, 3), (4, 32)])
def test_gpu_cluster_shares_a_tile(ctas, clusters):
    """Each CTA of each cluster reads the whole tile of its cluster, the other parts copied by the
    other CTAs, and the launch returns (every CTA's arrivals reached the others)."""
    x = torch.randn(clusters * ROWS, COLS, device="cuda", dtype=torch.float16)
    out = torch.full((ctas * clusters, ROWS, COLS), float("nan"), device="cuda", dtype=torch.float16)
    desc = unchecked_descriptor(x, list(x.shape), list(x.stride()), [ROWS // ctas, COLS],
                                nvmma_layout((ROWS // ctas, COLS), gl.float16))
    want = x.reshape(clusters, 1, ROWS, COLS).expand(clusters, ctas, ROWS, COLS).reshape(out.shape)
    for _ in range(2):  # the first call builds the kernel twice and launches; the second launches
        out.fill_(float("nan"))
        _launcher[(clusters,)](desc, out, CTAS=ctas, num_warps=4)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
