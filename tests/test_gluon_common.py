"""The cluster steps of ``qflash.kernels.gluon_common`` on a kernel small enough to read: two CTAs
of a cluster each copy half of a tile to both by multicast, each reads the whole tile and tells
the other it is done by an arrival on the other's barrier. Built offline on any machine; run on
the H200, where it checks the steps apart from the matmul that uses them."""

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from qflash.kernels.common import build_for_sm90, nvmma_layout
from qflash.kernels.gluon_common import (ClusterLauncher, build_in_clusters, cluster_sync, fence_barrier_init,
                                         multicast_copy, remote_arrive, unchecked_descriptor)

from conftest import barrier_inits, sm90_build

ROWS, COLS = 64, 64  # the tile; each CTA copies half its rows
X_PARAM = gl.constexpr("_pair_kernel_param_0")  # x_desc, the first parameter
BUFFERS = ("tile", "ready", "done")


@gluon.jit
def _pair_kernel(x_desc, Out, SMEM_AT: gl.constexpr = (0, 0, 0)):
    """CTA ``rank`` of cluster ``pair`` copies rows [rank * HALF, (rank + 1) * HALF) of x's tile
    ``pair`` to both CTAs, waits for the whole tile and writes it to Out[2 * pair + rank]; then it
    arrives on the other CTA's ``done`` and waits for the other's arrival on its own, so that
    neither leaves while the other may still reach it."""
    HALF: gl.constexpr = x_desc.block_type.shape[0]
    tile = gl.allocate_shared_memory(x_desc.dtype, [2 * HALF, x_desc.block_type.shape[1]], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(done, count=1)
    fence_barrier_init()
    cluster_sync()
    pair = gl.program_id(0) // 2
    rank = gl.program_id(0) % 2
    mbarrier.expect(ready, 2 * x_desc.block_type.nbytes)  # both halves land here
    multicast_copy(X_PARAM, 0, (2 * pair + rank) * HALF, SMEM_AT[0] + rank * x_desc.block_type.nbytes, SMEM_AT[1])
    mbarrier.wait(ready, 0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    x = tile.load(layout)  # [2 * HALF, COLS]
    rows = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, x_desc.block_type.shape[1], layout=gl.SliceLayout(0, layout))
    base = gl.program_id(0) * (2 * HALF * x_desc.block_type.shape[1])
    gl.store(Out + base + gl.expand_dims(rows, 1) * x_desc.block_type.shape[1] + gl.expand_dims(cols, 0), x)
    remote_arrive(SMEM_AT[2])
    mbarrier.wait(done, 0)


_launcher = ClusterLauncher(_pair_kernel, BUFFERS)


def compile_for_sm90():
    """The kernel built offline for sm_90, for clusters (``build_in_clusters``)."""
    layout = nvmma_layout((ROWS // 2, COLS), gl.float16)
    types = {"x_desc": f"tensordesc<fp16[{ROWS // 2}, {COLS}],{layout!r}>", "Out": "*fp16"}
    return build_in_clusters(lambda smem_at: build_for_sm90(_pair_kernel, types, {"SMEM_AT": smem_at}), BUFFERS)


def test_pair_kernel_builds():
    """Built offline: one multicast copy naming x's descriptor parameter, one arrival on the other
    CTA's barrier (its address by ``mapa``), the barriers' initialization fenced for the cluster
    before one cluster barrier; and the offsets it names are where it initializes its barriers."""
    kernel = sm90_build("test_gluon_common", with_offsets=True)
    ptx, at = kernel["ptx"], kernel["smem"]
    assert ptx.count(".multicast::cluster [dst], [map,") == 1 and "mov.b64 map, _pair_kernel_param_0;" in ptx
    assert ptx.count("mapa.shared::cluster.u32") == 1 and ptx.count("barrier.cluster.arrive.release;") == 1
    assert ptx.index("fence.mbarrier_init.release.cluster;") < ptx.index("barrier.cluster.arrive.release;")
    assert set(at) == set(BUFFERS) and at["tile"] % 1024 == 0
    assert barrier_inits(ptx) == {1: [at["ready"], at["done"]]}


@pytest.mark.gpu
@pytest.mark.parametrize("pairs", [1, 3, 66])
def test_gpu_pair_shares_a_tile(pairs):
    """Each CTA of each cluster reads the whole tile of its pair, half of it copied by the other
    CTA, and the launch returns (both CTAs' arrivals reached each other)."""
    x = torch.randn(pairs * ROWS, COLS, device="cuda", dtype=torch.float16)
    out = torch.full((2 * pairs, ROWS, COLS), float("nan"), device="cuda", dtype=torch.float16)
    desc = unchecked_descriptor(x, list(x.shape), list(x.stride()), [ROWS // 2, COLS],
                                nvmma_layout((ROWS // 2, COLS), gl.float16))
    for _ in range(2):  # the first call builds the kernel twice and launches; the second launches
        out.fill_(float("nan"))
        _launcher[(pairs,)](desc, out, num_warps=4)
        torch.cuda.synchronize()
        assert torch.equal(out, x.reshape(pairs, 1, ROWS, COLS).expand(pairs, 2, ROWS, COLS).reshape(out.shape))
