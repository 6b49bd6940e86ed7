"""The experimental Gluon matmul (Hopper, warp-specialized, persistent): it builds for sm_90 on any
machine, says what it does not take, and on the H200 is bit-exact for INT8 and within float32
rounding for FP8, like the tl kernel (tests/test_matmul.py)."""

import re

import pytest
import torch

import qflash
from qflash.reference.matmul import fp8_matmul_ref, int8_matmul_ref
from qflash.reference.quantize import quantize_ref
from qflash.testing import assert_written, poisoned, rel_l2_err

from conftest import DEVICE, barrier_inits, check_chain_eager_and_replayed, ptxas_report, sm90_build

gluon = pytest.importorskip("qflash.kernels.matmul_gluon")
from qflash.kernels import common  # noqa: E402


@pytest.mark.parametrize("int8,scales,block_n,stages,tma_store,split_k", [
    (True, "row", 128, 6, False, 1), (False, "tensor", 128, 6, False, 1), (False, "row", 128, 6, True, 1),
    (False, "tensor", 256, 4, True, 1), (False, "row", 256, 3, False, 1), (True, "row", 128, 5, True, 4),
    (False, "block", 256, 3, True, 1), (False, "block", 128, 5, True, 1), (False, "tensor", 128, 5, True, 3),
    (False, "tensor", 64, 8, True, 2), (False, "block", 64, 8, True, 1), (True, "row", 64, 8, False, 1),
    (False, "row", 32, 10, True, 1), (False, "block", 32, 10, True, 2), (True, "row", 256, 3, True, 1),
    (True, "tensor", 256, 3, False, 2)])
def test_builds_for_sm90(int8, scales, block_n, stages, tma_store, split_k):
    """Compiled offline: a TMA loader warp and two consumer warpgroups on 8-bit wgmma, registers
    rebalanced with setmaxnreg, one CTA's ring within 227 KB; FP8 adds each 128-deep partial
    product into its float32 total (twice the float32 adds of the INT8 build). 256-wide FP8 tiles
    run as two 128-wide halves; C (or split K's partial sums) can leave through shared memory and
    bulk copies. 128-wide FP8 tiles take their K steps in pairs: the first partial is added while
    the second's product is still in flight (a wait that leaves one group outstanding), with block
    scales by fused multiply-adds. Launched early (programmatic dependent launch), each of the
    three partitions waits for the kernel ahead (before its first access to global memory: the GPU
    test of chained launches), and the loader lets the next kernel launch."""
    kernel = sm90_build("qflash.kernels.matmul_gluon", int8, scales, block_n=block_n, stages=stages,
                        tma_store=tma_store, split_k=split_k)
    ptx = kernel["ptx"]
    assert ptx.count("griddepcontrol.wait;") == 3 and ptx.count("griddepcontrol.launch_dependents;") == 1
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == tma_store
    kind = "s32.s8.s8" if int8 else "f32.e4m3.e4m3"
    assert f"m64n{min(block_n, 128)}k32.{kind}" in ptx and "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx
    assert kernel["shared"] <= 227 * 1024
    # Reading a wgmma's accumulator before its wait would make ptxas serialize every wgmma.
    assert "serialized" not in ptxas_report(ptx)
    if not int8:
        def adds(text):
            return len(re.findall(r"\badd(?:\.rn)?\.f32\b", text))

        narrow = block_n <= 128
        if not (scales == "block" and narrow):  # there: fused multiply-adds
            int8_ptx = sm90_build("qflash.kernels.matmul_gluon", True, scales, block_n=min(block_n, 128))["ptx"]
            assert adds(ptx) > adds(int8_ptx)
        assert ("wgmma.wait_group.sync.aligned 1;" in ptx) == narrow
        assert ("fma.rn.f32" in ptx) == (scales == "block" and narrow)


@pytest.mark.parametrize("int8,scales,block_n,stages,split_k", [
    (False, "tensor", 16, 16, 1), (False, "row", 32, 14, 1), (False, "row", 64, 11, 1), (True, "row", 16, 16, 1),
    (False, "tensor", 16, 10, 2), (True, "row", 32, 10, 3), (False, "block", 16, 10, 1),
    (False, "block", 32, 10, 2)])
def test_swap_ab_builds_for_sm90(int8, scales, block_n, stages, split_k):
    """The transposed product for decode-sized M: one consumer warpgroup on m64nNk32 wgmma (A's
    rows as N), a loader warp, and C written back transposed by plain stores. With K split, each
    run counts itself in with one acquire-release atomic a tile, and the last reads the runs back
    from L2 and sets the count back to zero. Block scales (16- and 32-wide tiles, groups of eight
    K steps) come in with each step's slot."""
    kernel = sm90_build("qflash.kernels.matmul_gluon", int8, scales, block_n=block_n, stages=stages,
                        consumers=1, swap_ab=True, split_k=split_k, k_group=8 if scales == "block" else 2)
    ptx = kernel["ptx"]
    kind = "s32.s8.s8" if int8 else "f32.e4m3.e4m3"
    assert f"m64n{block_n}k32.{kind}" in ptx and "setmaxnreg" in ptx
    assert "cp.async.bulk.tensor.2d.shared" in ptx and "cp.async.bulk.tensor.2d.global.shared" not in ptx
    assert kernel["shared"] <= 227 * 1024
    assert "serialized" not in ptxas_report(ptx)
    assert (len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 1) == (split_k > 1)
    assert ("ld.global.cg" in ptx and "atom.global.gpu.relaxed.exch" in ptx) == (split_k > 1)
    # block scales: both come with A and B, by 1-D bulk copies (none read from global memory in the
    # K loop), and multiply each step's partial by fused multiply-adds
    assert ("cp.async.bulk.tensor.1d.shared" in ptx and "fma.rn.f32" in ptx) == (scales == "block")


def test_swap_ab_two_consumers_build():
    """The transposed product with two consumers (128 rows of B a tile): each consumer counts its
    runs in with an atomic of its own, and a ring of 10 slots of two 64-row parts of B and the
    activations fits in shared memory."""
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, "row", block_n=16, stages=10, consumers=2,
                        swap_ab=True, split_k=2)
    ptx = kernel["ptx"]
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 2 and "m64n16k32.f32.e4m3.e4m3" in ptx
    assert kernel["shared"] <= 227 * 1024 and "serialized" not in ptxas_report(ptx)


@pytest.mark.parametrize("scales,block_n,split_k", [("tensor", 16, 1), ("tensor", 32, 1), ("tensor", 16, 2),
                                                    ("block", 16, 1), ("block", 32, 1)])
def test_swap_ab_two_ctas_an_sm_build(scales, block_n, split_k):
    """Two CTAs an SM: the build capped at 128 registers a thread (256 threads, two CTAs in the
    SM's 64 K registers) spills nothing, and two rings of the launch's depth (8 slots with block
    scales, 6 without) fit in the SM's shared memory."""
    stages = (gluon.TWO_CTA_BLOCK_STAGES if scales == "block" else gluon.SWAP_TWO_CTA_STAGES)[block_n]
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, scales, block_n=block_n, stages=stages, consumers=1,
                        swap_ab=True, split_k=split_k, ctas_per_sm=2, k_group=8 if scales == "block" else 2)
    report = ptxas_report(kernel["ptx"])
    assert ".maxnreg 128" in kernel["ptx"] and "0 bytes spill stores" in report and "serialized" not in report
    assert 2 * (kernel["shared"] + 1024) <= 228 * 1024


@pytest.mark.parametrize("scales,out_dtype", [("tensor", torch.bfloat16), ("row", torch.float32)])
def test_long_k_64_row_tiles_build(scales, out_dtype):
    """tile_config's 64 x 64 tiles at long K: one consumer, LONG_K_64_STAGES ring slots and a block
    of C (float32 too) within a CTA's shared memory, no spills."""
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, scales, block_n=64, stages=gluon.LONG_K_64_STAGES,
                        tma_store=True, consumers=1, out_dtype=out_dtype,
                        early_scales=gluon.loads_scales_early(scales, 64, 1))
    report = ptxas_report(kernel["ptx"])
    assert "0 bytes spill stores" in report and "serialized" not in report
    assert "cp.async.bulk.tensor.2d.global.shared" in kernel["ptx"] and kernel["shared"] <= 227 * 1024


@pytest.mark.parametrize("scales,block_n", [("tensor", 64), ("block", 64), ("row", 128), ("block", 128)])
def test_two_ctas_an_sm_64_row_tiles_build(scales, block_n):
    """Two CTAs an SM with 64-row tiles 64 or 128 wide: capped at 128 registers a thread, no spills,
    and two rings (6 / 4 slots; 3 of 128 wide with block scales) with a block of C each fit in the
    SM's shared memory."""
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, scales, block_n=block_n,
                        stages=(gluon.TWO_CTA_BLOCK_STAGES if scales == "block" else gluon.TWO_CTA_STAGES)[block_n],
                        tma_store=True, consumers=1, ctas_per_sm=2)
    report = ptxas_report(kernel["ptx"])
    assert ".maxnreg 128" in kernel["ptx"] and "0 bytes spill stores" in report and "serialized" not in report
    assert "cp.async.bulk.tensor.2d.global.shared" in kernel["ptx"]
    assert 2 * (kernel["shared"] + 1024) <= 228 * 1024


@pytest.mark.parametrize("scales,block_n,consumers", [("tensor", 96, 1), ("row", 160, 1), ("tensor", 48, 2),
                                                     ("row", 160, 2)])
def test_tailed_tiles_build(scales, block_n, consumers):
    """A tile of B's block and a narrower tail (96 = 64 + 32, 160 = 128 + 32, 48 = 32 + 16): two
    wgmma shapes a K step, both issued before the first wait, no spills, 8 slots of plain stores
    where they fit (6 for 128 x 160)."""
    lead, tail = gluon.tail_split(block_n)
    stages = 6 if (block_n, consumers) == (160, 2) else 8
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, scales, block_n=block_n, stages=stages,
                        tma_store=False, consumers=consumers)
    ptx = kernel["ptx"]
    report = ptxas_report(ptx)
    assert f"m64n{lead}k32.f32.e4m3.e4m3" in ptx and f"m64n{tail}k32.f32.e4m3.e4m3" in ptx
    assert "wgmma.wait_group.sync.aligned 1;" in ptx and "cp.async.bulk.tensor.2d.global.shared" not in ptx
    assert "0 bytes spill stores" in report and "serialized" not in report
    assert kernel["shared"] <= 227 * 1024


@pytest.mark.parametrize("scales,block_n,tma_store", [("tensor", 160, False), ("row", 96, False), ("tensor", 128, True),
                                                     ("row", 256, True)])
def test_split_n_build(scales, block_n, tma_store):
    """Two consumers splitting a 64-row tile's columns: each consumer's wgmma is half of B's block
    wide (and half of the tail), no spills, the ring (one 64-row part of A a slot) and blocks of C
    within shared memory."""
    lead, tail = gluon.tail_split(block_n)
    stages = gluon._split_n_stages(block_n)
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, scales, block_n=block_n, stages=stages,
                        tma_store=tma_store, consumers=2, split_n=True)
    ptx = kernel["ptx"]
    report = ptxas_report(ptx)
    assert f"m64n{lead // 2}k32.f32.e4m3.e4m3" in ptx and f"m64n{lead}k32" not in ptx
    assert not tail or f"m64n{tail // 2}k32.f32.e4m3.e4m3" in ptx
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == tma_store
    assert "0 bytes spill stores" in report and "serialized" not in report
    assert kernel["shared"] <= 227 * 1024 and stages >= 4


def test_two_c_blocks_build():
    """256-wide tiles with two blocks of C a consumer: the second half's copy waits only for the
    copy that last read its own block (``cp.async.bulk.wait_group.read 1``), no spills, and the
    ring and four 64 x 128 bfloat16 blocks within shared memory."""
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, "tensor", block_n=256, stages=3, tma_store=True,
                        c_bufs=2)
    report = ptxas_report(kernel["ptx"])
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+1;", kernel["ptx"])
    assert "0 bytes spill stores" in report and kernel["shared"] <= 227 * 1024


@pytest.mark.parametrize("scales,block_n,k_group", [("tensor", 128, 4), ("block", 128, 4), ("block", 64, 8)])
def test_k_steps_in_groups_build(scales, block_n, k_group):
    """K steps in groups of 4 or 8: each product waited for with one left in flight, the third on
    issued into the registers of the partial two steps back (``use_acc`` a runtime False, so ptxas
    keeps them there: two partials, not G), no spills and no serialized wgmma."""
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, scales, block_n=block_n, stages=5, tma_store=True,
                        k_group=k_group)
    report = ptxas_report(kernel["ptx"])
    assert "0 bytes spill stores" in report and "serialized" not in report
    pairs = sm90_build("qflash.kernels.matmul_gluon", False, scales, block_n=block_n, stages=5, tma_store=True)
    wait_one = "wgmma.wait_group.sync.aligned 1;"
    assert kernel["ptx"].count(wait_one) > pairs["ptx"].count(wait_one)


@pytest.mark.parametrize("int8,scales,block_n,consumers,swap_ab", [
    (False, "row", 128, 2, False), (False, "tensor", 64, 2, False), (True, "row", 64, 2, False),
    (False, "row", 64, 1, False), (False, "row", 32, 1, True), (False, "row", 128, 3, False)])
def test_early_scales_build(int8, scales, block_n, consumers, swap_ab):
    """Scales loaded at a work item's start (``EARLY_SCALES``): a different build with the same
    products and the same scale loads, no serialized wgmma and no spills; three consumers keep
    their epilogue's loads (their 160 registers a thread would spill the row scales). (Where the
    loads run is the GPU tests' and the timings' to show: PTX lists blocks out of order.)"""
    def build(early):
        return sm90_build("qflash.kernels.matmul_gluon", int8, scales, has_bias=False, block_n=block_n,
                          stages={3: 4, 2: 8 if block_n <= 64 else 5, 1: 8}[consumers], tma_store=not swap_ab,
                          swap_ab=swap_ab, consumers=consumers, early_scales=early)["ptx"]

    late, early = build(False), build(True)
    for ptx in (late, early):
        report = ptxas_report(ptx)
        assert "serialized" not in report and " 0 bytes spill stores" in report and ".local" not in ptx
    kind = "s32.s8.s8" if int8 else "f32.e4m3.e4m3"
    assert (late != early) == (consumers < 3) and late.count(kind) == early.count(kind) > 0
    assert late.count("ld.global") == early.count("ld.global") > 0


@pytest.mark.parametrize("block_n,k_group,aligned", [(128, 8, True), (128, 4, False), (64, 8, True), (256, 2, True)])
def test_block_scales_by_bulk_copies_build(block_n, k_group, aligned):
    """Block scales come into each ring slot by 1-D bulk copies beside A and B (A's 64 rows a
    part, B's aligned four values a block), counted in the slot's expected bytes; no spills with
    B's value picked where the kernel is built (groups of eight) or at run time (groups of four)."""
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, "block", block_n=block_n,
                        stages=gluon.RING_STAGES[2][block_n], k_group=k_group, b_sc_aligned=aligned)
    report = ptxas_report(kernel["ptx"])
    assert "0 bytes spill stores" in report and "serialized" not in report
    b_blocks = 2 if block_n == 256 else 1
    assert kernel["ptx"].count("cp.async.bulk.tensor.1d.shared::cluster.global") == 2 + b_blocks
    step_bytes = 2 * 64 * 128 + block_n * 128 + 2 * 64 * 4 + b_blocks * 16
    assert re.search(rf"mbarrier\.arrive\.expect_tx\.shared\.b64 _, \[%r\d+\], {step_bytes};", kernel["ptx"])


@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
def test_three_consumers_build(scales):
    """192 x 128 tiles: three consumer warpgroups and the loader's warp (padded to a fourth
    warpgroup), 160 registers a consumer thread (setmaxnreg), so each K step's partial is added
    before the next product is issued (no pairs); no spills with bulk stores of a bfloat16 C, and
    the ring (4 slots of 40 KB) and three blocks of C within shared memory."""
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, scales, block_n=128, stages=4, tma_store=True,
                        consumers=3)
    ptx = kernel["ptx"]
    report = ptxas_report(ptx)
    assert ".reqntid 512" in ptx and re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+160;", ptx)
    assert "m64n128k32.f32.e4m3.e4m3" in ptx and "wgmma.wait_group.sync.aligned 1;" not in ptx
    assert ("fma.rn.f32" in ptx) == (scales == "block")
    assert "0 bytes spill stores" in report and "serialized" not in report
    assert kernel["shared"] <= 227 * 1024 and gluon._slot_bytes(128, 3) == 40 * 1024


@pytest.mark.parametrize("int8,scales,block_n,consumers,shares,swap_ab,split_k,ctas", [
    (False, "tensor", 128, 2, "A", False, 1, 2), (False, "tensor", 64, 2, "A", False, 1, 2),
    (False, "row", 160, 2, "A", False, 1, 2), (False, "block", 128, 2, "A", False, 1, 2),
    (True, "row", 128, 2, "A", False, 1, 2), (False, "tensor", 64, 1, "A", False, 1, 2),
    (False, "row", 128, 3, "A", False, 1, 2),
    (False, "tensor", 64, 1, "B", False, 1, 2), (False, "tensor", 128, 2, "B", False, 2, 2),
    (False, "tensor", 16, 1, "B", True, 1, 2), (False, "row", 32, 1, "B", True, 2, 2),
    (False, "block", 16, 1, "B", True, 1, 2), (True, "row", 16, 1, "B", True, 2, 2),
    # clusters of four: the transposed product's (cuBLAS's at M = 16) and 128-row tiles'
    (False, "tensor", 16, 1, "B", True, 1, 4), (False, "row", 32, 1, "B", True, 2, 4),
    (False, "block", 16, 1, "B", True, 1, 4), (True, "row", 16, 1, "B", True, 2, 4),
    (False, "tensor", 128, 2, "A", False, 1, 4), (False, "tensor", 64, 1, "B", False, 1, 4)])
def test_cluster_build(int8, scales, block_n, consumers, shares, swap_ab, split_k, ctas):
    """Clusters of two or four CTAs that share the kernel's A or B tiles (``launch(cluster=...)``;
    with swap_ab the kernel's B is the user's A: the activations at M = 16), built offline: each
    CTA's loader copies its share of the shared operand's parts to every CTA of the cluster by
    multicast (mask 3 or 15), naming that operand's descriptor parameter (one copy a part, made
    by a lane the loader's one warp elects); a consumer releases a slot on its own empty barrier
    and on each other CTA's (``mapa``; release at the CTA's scope), so each empty barrier counts
    all the cluster's consumers; every partition waits once at the cluster barrier after the
    barriers' initialization is fenced, the two partitions of idle warps beside the loader's
    warp (2 + 1) too, so that no warp waits outside the partitions (``.reqntid``: the consumers,
    and the loader with the idle warps, 128 threads each). No spills (but one 8-byte value in
    128 x 160 tiles), no serialized wgmma. The offsets the kernel names (``smem_offsets``, the
    same in its two builds: ``build_in_clusters``) are where its PTX initializes ready[s] and
    empty[s]."""
    # (three consumers' tiles take bulk stores, as tile_config gives them: plain ones spill there)
    stages = 4 if consumers == 3 or block_n == 160 else 8 if block_n == 64 or scales == "block" and swap_ab else \
        10 if swap_ab else 5
    config = dict(block_n=block_n, consumers=consumers, stages=stages, tma_store=consumers == 3, swap_ab=swap_ab,
                  split_k=split_k)
    mode = {"A": gluon.CLUSTER_SHARES_A, "B": gluon.CLUSTER_SHARES_B}[shares].value
    kernel = sm90_build("qflash.kernels.matmul_gluon", int8, scales, **config, cluster=mode, cluster_size=ctas,
                        with_offsets=True)
    ptx, at = kernel["ptx"], kernel["smem"]
    report = ptxas_report(ptx)
    assert f".reqntid {128 * (consumers + 1)}" in ptx
    param = {"A": "_scaled_mm_ws_kernel_param_0", "B": "_scaled_mm_ws_kernel_param_5"}[shares]
    copies = re.findall(rf"mov\.b64 map, (\w+); cvta\.param\.u64 map, map; mov\.u16 mask, {2 ** ctas - 1};", ptx)
    assert copies == [param] * (consumers if shares == "A" else 1)
    assert ptx.count("global.mbarrier::complete_tx::bytes.multicast::cluster") == len(copies)
    arrivals = re.findall(r"mov\.u32 rank, %cluster_ctarank;.*?mov\.u32 %r\d+, 0; }", ptx, re.S)
    remote = ("mapa.shared::cluster.u32", "@p mbarrier.arrive.shared::cluster.b64 _, [remote];")  # (CTA scope)
    assert arrivals and all(a.count(step) == ctas - 1 for a in arrivals for step in remote)
    assert ptx.count("barrier.cluster.arrive.release;") == consumers + 3
    assert ptx.count("elect.sync _|p, 0xffffffff;") == len(copies)  # (the loader's warp elects a lane)
    assert ptx.count("fence.mbarrier_init.release.cluster;") == 1
    # (128 x 160 tiles: the loader's one warp, at 40 registers, keeps a descriptor's address in
    # local memory while it makes the other part's: one 8-byte store and load a K step)
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    assert spills == (8 if (block_n, consumers) == (160, 2) else 0) and "serialized" not in report
    assert barrier_inits(ptx) == {1: [at["ready"] + 8 * s for s in range(stages)],
                                  ctas * consumers: [at["empty"] + 8 * s for s in range(stages)]}
    assert at["a_ring"] % 1024 == 0 and at["b_ring"] % 1024 == 0  # (swizzled tiles start on 1024-byte boundaries)
    plain = sm90_build("qflash.kernels.matmul_gluon", int8, scales, **config)["ptx"]
    assert "barrier.cluster" not in plain and "multicast" not in plain and "mapa" not in plain


@pytest.mark.parametrize("int8,scales,block_n,swap_ab,ctas", [(False, "tensor", 16, True, 4), (True, "row", 32, True, 2),
                                                             (False, "block", 16, True, 4), (False, "row", 64, False, 2)])
def test_cluster_build_two_ctas_an_sm(int8, scales, block_n, swap_ab, ctas):
    """Two one-consumer CTAs an SM in clusters that share B (the transposed product's activations,
    or 64-wide tiles' weights): capped at 128 registers a thread (two CTAs of 256 threads fill the
    SM's 64 K), no spills, each CTA in half the SM's shared memory, the empty barriers counting
    every CTA of the cluster."""
    stages = 6
    kernel = sm90_build("qflash.kernels.matmul_gluon", int8, scales, block_n=block_n, consumers=1, stages=stages,
                        swap_ab=swap_ab, ctas_per_sm=2, cluster=gluon.CLUSTER_SHARES_B.value, cluster_size=ctas,
                        with_offsets=True)
    ptx, at = kernel["ptx"], kernel["smem"]
    report = ptxas_report(ptx)
    assert ".maxnreg 128" in ptx and "0 bytes spill stores" in report and "serialized" not in report
    assert kernel["shared"] + 1024 <= 114 * 1024
    assert barrier_inits(ptx) == {1: [at["ready"] + 8 * s for s in range(stages)],
                                  ctas: [at["empty"] + 8 * s for s in range(stages)]}


@pytest.mark.parametrize("block_n,ctas", [(96, 2), (160, 2), (160, 4)])
def test_cluster_build_split_columns(block_n, ctas):
    """cuBLAS's M = 128 tiling in clusters: 64-row tiles 96 or 160 wide (a block and a tail whose
    columns two consumers split), the cluster sharing the tile's 64 rows of A (one part, copied by
    rank 0 for all): no spills, the ring and the consumers' blocks within shared memory, each
    empty barrier counting both consumers of every CTA."""
    stages = gluon._split_n_stages(block_n)
    kernel = sm90_build("qflash.kernels.matmul_gluon", False, "tensor", block_n=block_n, consumers=2, split_n=True,
                        stages=stages, cluster=gluon.CLUSTER_SHARES_A.value, cluster_size=ctas, with_offsets=True)
    ptx, at = kernel["ptx"], kernel["smem"]
    report = ptxas_report(ptx)
    assert "0 bytes spill stores" in report and "serialized" not in report and kernel["shared"] <= 227 * 1024
    copies = re.findall(rf"mov\.b64 map, (\w+); cvta\.param\.u64 map, map; mov\.u16 mask, {2 ** ctas - 1};", ptx)
    assert copies == ["_scaled_mm_ws_kernel_param_0"]
    assert barrier_inits(ptx) == {1: [at["ready"] + 8 * s for s in range(stages)],
                                  2 * ctas: [at["empty"] + 8 * s for s in range(stages)]}


def test_tail_split():
    assert [gluon.tail_split(n) for n in (16, 64, 256, 48, 80, 96, 160, 192)] == [
        (16, 0), (64, 0), (256, 0), (32, 16), (64, 16), (64, 32), (128, 32), (128, 64)]
    for bad in (8, 24, 112, 224, 320):
        with pytest.raises(ValueError, match="block_n must be"):
            gluon.tail_split(bad)


def _quantized(m, n, k, qdtype, scales, device=DEVICE):
    a, b = torch.randn(m, k, device=device), torch.randn(n, k, device=device)
    a_q, a_s = qflash.quantize(a, qdtype, "tensor" if scales == "tensor" else "row")
    b_q, b_s = qflash.quantize(b, qdtype, "row" if scales == "row" else "tensor")
    return a_q, b_q, a_s, b_s


def _kernel_scales(a_s, b_s, scales):
    """The scales as the kernel takes them: one value each per tensor, else (M, 1) and (N, 1)."""
    if scales == "tensor":
        return a_s, b_s
    return a_s.reshape(-1, 1), b_s.reshape(-1, 1)


def _fp8_case(m, n, k, scales):
    """FP8 operands on the GPU with tensor, row or (1 x 128 / 128 x 128) block scales as the kernel
    takes them, a bias (none with block scales) and the float64 reference:
    (a_q, b_q, a_k, b_k, bias, ref)."""
    if scales == "block":
        a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        a_q, a_k = qflash.quantize(a, torch.float8_e4m3fn, "block", (1, 128))
        b_q, b_k = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
        return a_q, b_q, a_k, b_k, None, fp8_matmul_ref(a_q, b_q, a_k, b_k, None, torch.float64)
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
    a_k, b_k = _kernel_scales(a_s, b_s, scales)
    bias = torch.randn(n, device="cuda")
    return a_q, b_q, a_k, b_k, bias, fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)


def _block_case(m, n, k, outliers):
    """FP8 operands on the GPU with 1 x 128 / 128 x 128 block scales, A with five outlier channels
    (50x) or not, a bias and the float64 reference: (a_q, b_q, a_s, b_s, bias, ref)."""
    a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    if outliers:
        a[:, :5] *= 50
    a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "block", (1, 128))
    b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
    bias = torch.randn(n, device="cuda")
    return a_q, b_q, a_s, b_s, bias, fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)


def _int8_kernel_scales(a_s, b_s, scales, m, n):
    """(kind, a_k, b_k) for the INT8 bit-exact tests. The reference reads one value each as per
    tensor scales ((a_s * b_s) first): so must the kernel; "mixed" goes as (M, 1) and (N, 1)
    views, a per-tensor one broadcast."""
    kind = "tensor" if scales == "tensor" or a_s.numel() == b_s.numel() == 1 else "row"
    if kind == "tensor":
        return kind, a_s, b_s
    return kind, a_s.reshape(-1, 1).expand(m, 1), b_s.reshape(-1, 1).expand(n, 1)


def test_names_what_it_does_not_take():
    a_q, b_q, a_s, b_s = _quantized(4, 8, 64, torch.int8, "row")
    if DEVICE == "cpu":
        assert "Hopper" in gluon.why_not(a_q, b_q, "row")
        return
    f8 = torch.float8_e4m3fn
    cases = [
        ((a_q, b_q, "block"), "block scales are FP8's"),
        ((a_q, b_q, "column"), "'tensor', 'row' or 'block'"),
        ((a_q, b_q.to(torch.float32).to(f8), "row"), "both be int8 or float8_e4m3fn"),
        ((a_q.float().to(torch.float8_e5m2), b_q.float().to(torch.float8_e5m2), "row"), "float8_e4m3fn"),
        ((a_q[:, :40].contiguous(), b_q[:, :40].contiguous(), "row"), "16-byte aligned"),  # rows of 40 bytes
        ((a_q, b_q[:, :32], "row"), "share a positive K"),
    ]
    for (x, y, scales), match in cases:
        assert match in gluon.why_not(x, y, scales)
        with pytest.raises(ValueError, match=match):
            gluon.scaled_matmul_gluon(x, y, a_s, b_s, None, torch.bfloat16, scales)


GPU_SHAPES = [(1, 1, 16), (70, 90, 320), (300, 129, 64), (257, 1000, 4096), (1024, 768, 1024)]  # ragged M, N, K


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row", "mixed"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_int8_bit_exact(m, n, k, out_dtype, scales):
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, scales, "cuda")
    bias = torch.randn(n, device="cuda")
    kind, a_k, b_k = _int8_kernel_scales(a_s, b_s, scales, m, n)
    with poisoned():
        c = gluon.scaled_matmul_gluon(a_q, b_q, a_k, b_k, bias, out_dtype, kind)
    assert_written(c)
    assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_fp8_within_fp32_rounding(m, n, k, scales):
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
    with poisoned():
        c = gluon.scaled_matmul_gluon(a_q, b_q, a_s, b_s, None, torch.float32, scales)
    assert_written(c)
    ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float64)
    assert rel_l2_err(c, ref) < 1e-5 * max(1.0, k ** 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES + [(384, 640, 1152)])
def test_gpu_fp8_wide_tiles_match(m, n, k, scales):
    """256-, 64- and 32-wide tiles add the same 128-deep partials in the same order as 128-wide
    ones, and C written through shared memory and bulk copies is C written by plain stores: the
    same bits, ragged edges (N not a multiple of the tile; rows not 16-byte aligned fall back to
    plain stores) and bias included."""
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
    a_k, b_k = _kernel_scales(a_s, b_s, scales)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    narrow = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, block_n=128, stages=6)
    for block_n, stages, tma_store in [(256, 3, False), (256, 4, False), (256, 4, True), (256, 3, True),
                                       (128, 5, True), (64, 8, True), (64, 8, False), (32, 10, True)]:
        with poisoned():
            wide = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, block_n=block_n, stages=stages,
                                tma_store=tma_store)
        assert_written(wide)
        assert torch.equal(wide, narrow), (block_n, stages, tma_store)


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES + [(384, 640, 1152)])
def test_gpu_early_scales_match(m, n, k, scales):
    """Scales loaded at a work item's start give the bits of scales loaded in its epilogue: each
    item's own rows and columns, ragged edges and bias included, with two consumers' 128- and
    64-wide tiles, one consumer's 64-row tiles, columns split between two consumers, and the
    transposed product; INT8 exact."""
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    configs = [dict(block_n=128, stages=5, tma_store=True), dict(block_n=128, stages=6, tma_store=False),
               dict(block_n=64, stages=8, tma_store=True), dict(block_n=64, stages=8, consumers=1),
               dict(block_n=256, split_n=True)]
    if m <= 64:  # the transposed product takes decode-sized M
        configs.append(dict(swap_ab=True))
    for qdtype in (torch.float8_e4m3fn, torch.int8):
        a_q, b_q, a_s, b_s = _quantized(m, n, k, qdtype, scales, "cuda")
        a_k, b_k = _kernel_scales(a_s, b_s, scales)
        for config in configs:
            if qdtype == torch.int8 and config.get("split_n"):
                continue  # split columns are FP8's
            late = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, early_scales=False, **config)
            with poisoned():
                early = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, early_scales=True, **config)
            assert_written(early)
            assert torch.equal(early, late), config
            if qdtype == torch.int8:
                assert torch.equal(early, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.bfloat16)), config


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,stages,split_k", [(128, 5, 1), (256, 3, 1), (256, 3, 2)])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_int8_bulk_store_bit_exact(m, n, k, block_n, stages, split_k):
    """INT8 with C written through shared memory (float32 C: 64 KB of blocks next to 5 ring slots),
    and 256-wide tiles, each half its own int32 total (one or two consumers, K whole or in runs)."""
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, "row", "cuda")
    with poisoned():
        c = gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), None, torch.float32, "row",
                         block_n=block_n, stages=stages, tma_store=True, split_k=split_k)
    assert_written(c)
    assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float32))


@pytest.mark.gpu
def test_gpu_chained_launches_wait_for_the_kernel_ahead(monkeypatch):
    """Programmatic dependent launch: a product that reads the bytes of the one before it (C of
    the first, bfloat16, taken as the second's INT8 A) starts while the first still runs (5
    tiles, K = 8192: most SMs free) and must wait for it before it loads; so must a quantize of
    that C and the FP8 product of what it wrote (``common.PDL``: the quantize too). Back to back
    with nothing between them, eagerly and replayed from a CUDA graph on fresh inputs; C of the
    first starts poisoned, so a load that came too early reads NaN bytes (without the product's
    waits this test failed on the H200, s35a)."""
    monkeypatch.setattr(common, "PDL", True)
    m, n, k, n2 = 128, 640, 8192, 384
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, "tensor", "cuda")
    _, b2, _, _ = _quantized(m, n2, 2 * n, torch.int8, "tensor", "cuda")
    b3, b3_s = qflash.quantize(torch.randn(n2, n, device="cuda"), torch.float8_e4m3fn, "row")
    one = torch.ones((), device="cuda")

    def chain():
        with poisoned():
            c1 = gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", block_n=128, split_k=1, pdl=True)
        c2 = gluon.launch(c1.view(torch.int8), b2, one, one, None, torch.float32, "tensor", pdl=True)
        x_q, x_s = qflash.quantize(c1, torch.float8_e4m3fn, "row")
        c3 = gluon.launch(x_q, b3, x_s.reshape(-1, 1), b3_s.reshape(-1, 1), None, torch.float32, "row", pdl=True)
        return c1, c2, x_q, x_s, c3

    def check(c1, c2, x_q, x_s, c3):
        assert_written(c1)
        assert torch.equal(c1, int8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.bfloat16))
        assert torch.equal(c2, int8_matmul_ref(c1.view(torch.int8), b2, one, one, None, torch.float32))
        want_q, want_s = quantize_ref(c1, torch.float8_e4m3fn, "row")
        assert torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(x_s, want_s)
        assert torch.equal(c3, gluon.launch(want_q, b3, want_s.reshape(-1, 1), b3_s.reshape(-1, 1), None,
                                            torch.float32, "row", pdl=False))

    def refresh():
        fresh_q, _, fresh_s, _ = _quantized(m, n, k, torch.int8, "tensor", "cuda")
        a_q.copy_(fresh_q)
        a_s.copy_(fresh_s)

    check_chain_eager_and_replayed(chain, check, refresh)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 3])
def test_gpu_repeated_launches_bit_exact(split_k):
    """Launches after the first skip Triton's argument binding (``CachedLauncher``): fresh inputs
    of the same shapes, scales whose base loses its 16-byte alignment (another specialization)
    and back, each bit-exact against the int32 reference."""
    m, n, k = 300, 640, 1024
    for offset in (0, 0, 1, 0, 1):
        a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, "row", "cuda")
        a_k = torch.cat([torch.ones(offset, device="cuda"), a_s.flatten()])[offset:].reshape(m, 1)
        b_k = torch.cat([torch.ones(offset, device="cuda"), b_s.flatten()])[offset:].reshape(n, 1)
        bias = torch.randn(n, device="cuda")
        with poisoned():
            c = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, "row", split_k=split_k)
        assert_written(c)
        assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.bfloat16)), offset


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES + [(100, 384, 2000)])
def test_gpu_split_k(m, n, k):
    """K cut into runs whose partial sums a second kernel adds in a fixed order: INT8 still bit-exact,
    FP8 within float32 rounding (another order of the same float32 adds), bias and scales once."""
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        a_q, b_q, a_s, b_s = _quantized(m, n, k, qdtype, "row", "cuda")
        bias = torch.randn(n, device="cuda")
        scales = "tensor" if m == n == 1 else "row"  # the reference reads one value each as per tensor
        for split_k, tma_store, block_n in [(2, True, 128), (3, False, 128), (4, True, 128), (2, True, 64)]:
            with poisoned():
                c = gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), bias, torch.float32, scales,
                                 block_n=block_n, stages=5, split_k=split_k, tma_store=tma_store)
            assert_written(c)
            if qdtype == torch.int8:
                assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float32))
            else:
                ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)
                assert rel_l2_err(c, ref) < 1e-5 * max(1.0, k ** 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES + [(384, 640, 1152)])
def test_gpu_fp8_block_scales(m, n, k, outliers):
    """1 x 128 scales for A, 128 x 128 for B (DeepSeek-V3's recipe), applied to each 128-deep
    partial before it joins the float32 total, for narrow, wide and split-K tiles, ragged edges
    and bias included. Gaussian inputs: within float32 rounding of the reference on the
    dequantized inputs. With outlier channels (50x) the tensor cores' own sum inside a K step
    (about 14 bits, not float32) shows: then the result matches the tl kernel, which shares it,
    to float32 rounding, and the reference to DeepGEMM's bar (1 - cosine similarity < 1e-3)."""
    from qflash.kernels.matmul import MatmulConfig, scaled_matmul

    a_q, b_q, a_s, b_s, bias, ref = _block_case(m, n, k, outliers)
    portable = scaled_matmul(a_q, b_q, a_s, b_s, bias, torch.float32, "block",
                             config=MatmulConfig(128, 128, 128, 8, 3, use_tma=False))
    for opts in [{}, dict(block_n=128, stages=5, tma_store=True), dict(block_n=256, stages=3, tma_store=True),
                 dict(block_n=128, stages=5, split_k=3), dict(block_n=64, stages=8, tma_store=True),
                 dict(block_n=64, stages=8, split_k=2), dict(block_n=32, stages=10, tma_store=True)]:
        with poisoned():
            c = gluon.launch(a_q, b_q, a_s, b_s, bias, torch.float32, "block", **opts)
        assert_written(c)
        bound = 1e-5 * max(1.0, k ** 0.5)
        if outliers:
            assert rel_l2_err(c, portable) < bound, (opts, rel_l2_err(c, portable), rel_l2_err(portable, ref))
            cos = torch.nn.functional.cosine_similarity(c.double().flatten(), ref.flatten(), dim=0)
            assert 1 - cos < 1e-3, opts
        else:
            assert rel_l2_err(c, ref) < bound, (opts, rel_l2_err(c, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [32, 64, 128, 256])
def test_gpu_fp8_block_scales_any_strides(block_n):
    """Block scales are read through their strides: A's column-major (as ``quantize`` gives them,
    read by the copy engine as they are) or row-major (the launcher makes a column-major copy),
    B's contiguous (rows of 9: each step's value picked from its aligned four at run time) or with
    a gap between rows (rows of 12: picked where the kernel is built), all give the same bits."""
    m, n, k = 203, 300, 1040  # K: rows of A_q and B_q 16-byte aligned, as the bulk copies need
    a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "block", (1, 128))
    b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
    assert a_s.stride() == (1, 204)
    stages = {32: 10, 64: 8, 128: 5, 256: 3}[block_n]
    want = gluon.launch(a_q, b_q, a_s, b_s, None, torch.float32, "block", block_n=block_n, stages=stages)
    b_gap = torch.full((b_s.shape[0], b_s.shape[1] + 3), float("nan"), device="cuda")[:, :b_s.shape[1]]
    b_gap.copy_(b_s)
    for a_k, b_k in [(a_s, b_gap), (a_s.contiguous(), b_s), (a_s.contiguous(), b_gap)]:
        got = gluon.launch(a_q, b_q, a_k, b_k, None, torch.float32, "block", block_n=block_n, stages=stages)
        assert torch.equal(got, want), (a_k.stride(), b_k.stride())
    assert rel_l2_err(want, fp8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float64)) < 1e-5 * k ** 0.5


CLUSTER_CONFIGS = {  # the operand pairs share: the tiles they run with it
    "A": [dict(block_n=128, stages=5, tma_store=True), dict(block_n=128, stages=6), dict(block_n=64, stages=8),
          dict(block_n=64, stages=8, consumers=1), dict(block_n=160), dict(block_n=128, consumers=3, tma_store=True),
          dict(block_n=256, split_n=True), dict(block_n=160, split_n=True), dict(block_n=96, split_n=True),
          dict(block_n=128, stages=5, split_k=2), {}],
    "B": [dict(block_n=64, stages=8, consumers=1, tma_store=True), dict(block_n=128, stages=5, tma_store=True),
          dict(block_n=256, split_n=True), dict(block_n=128, stages=5, split_k=2)],
}
CLUSTER_KINDS = [(torch.float8_e4m3fn, "tensor"), (torch.float8_e4m3fn, "row"), (torch.float8_e4m3fn, "block"),
                 (torch.int8, "row")]


def _cluster_cases():
    """(qdtype, scales, shares, config) of CLUSTER_KINDS x CLUSTER_CONFIGS that run: tails and
    split columns take FP8 with tensor or row scales, three consumers FP8."""
    for qdtype, scales in CLUSTER_KINDS:
        for shares, configs in CLUSTER_CONFIGS.items():
            for config in configs:
                narrow_only = config.get("block_n") == 160 or config.get("split_n")
                int8 = qdtype == torch.int8
                if not ((int8 and (narrow_only or config.get("consumers") == 3))
                        or (scales == "block" and narrow_only)):
                    yield qdtype, scales, shares, config


def _check_clusters(qdtype, scales, shares, config, shapes, ctas=2):
    """``launch(cluster=shares, cluster_size=ctas)`` gives the bits of the same launch without
    clusters at each of ``shapes`` (poisoned output, every element written; INT8 also the exact
    reference's)."""
    for m, n, k in shapes:
        if scales == "block":
            a_q, b_q, a_k, b_k, bias, _ = _block_case(m, n, k, outliers=False)
        else:
            a_q, b_q, a_s, b_s = _quantized(m, n, k, qdtype, scales, "cuda")
            a_k, b_k = _kernel_scales(a_s, b_s, scales)
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        want = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, **{"ctas_per_sm": 1, **config})
        with poisoned():
            got = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, cluster=shares, cluster_size=ctas,
                               **config)
        assert_written(got)
        assert torch.equal(got, want), (m, n, k)
        if qdtype == torch.int8:
            assert torch.equal(got, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.bfloat16)), (m, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype,scales,shares,config", list(_cluster_cases()), ids=str)
def test_gpu_cluster_pairs_match(qdtype, scales, shares, config):
    """Clusters of two CTAs whose tiles share A's tile (the same rows, two column blocks) or B's
    (the same columns, two row blocks), copied to both by multicast (``launch(cluster=...)``),
    give the bits of the same tiles without them: FP8 per tensor, per row and with block scales,
    INT8 exact too; 128- and 64-wide tiles, a tailed one, one consumer's 64-row tiles, three
    consumers' 192-row ones, split columns, split K and the dispatch's tile; ragged edges and odd
    counts of blocks included (a pair's second tile past M or N reads zeros, writes nothing)."""
    _check_clusters(qdtype, scales, shares, config, [(70, 90, 320), (257, 1000, 4096)])  # (one build each)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{}, dict(split_k=1), dict(split_k=3)], ids=str)
@pytest.mark.parametrize("qdtype,scales", CLUSTER_KINDS, ids=str)
def test_gpu_cluster_transposed_pairs_match(qdtype, scales, config):
    """The transposed product (decode-sized M) in clusters whose two tiles of B's rows share the
    activations' tile, as cuBLAS's clusters do at M = 16: the bits of the same launch without
    clusters, K whole or in runs that the tile's last run adds up; odd counts of 64- and 128-row
    tiles (a pair's second tile past B's rows stores nothing and counts no run)."""
    _check_clusters(qdtype, scales, "A", dict(swap_ab=True, **config),
                    [(16, 1000, 4096), (5, 300, 320), (9, 900, 2048), (9, 1100, 2048)])


@pytest.mark.gpu
@pytest.mark.parametrize("shares,config", [("A", dict(swap_ab=True)), ("A", dict(swap_ab=True, split_k=3)),
                                           ("A", dict(swap_ab=True, ctas_per_sm=2)),
                                           ("A", {}), ("B", dict(block_n=64, consumers=1)),
                                           ("B", dict(block_n=64, consumers=1, ctas_per_sm=2)),
                                           ("B", dict(block_n=128, split_k=2))], ids=str)
@pytest.mark.parametrize("qdtype,scales", CLUSTER_KINDS, ids=str)
def test_gpu_clusters_of_four_match(qdtype, scales, shares, config):
    """Clusters of four CTAs (cuBLAS's at M = 16: four tiles of B's rows share the activations'
    tile in the transposed product), and four column or row blocks of 128- and 64-row tiles: the
    bits of the same launch without clusters; counts of tiles that leave a cluster one to three
    tiles past M or N; two CTAs an SM too."""
    shapes = [(16, 1000, 4096), (5, 300, 320)] if config.get("swap_ab") else [(70, 90, 320), (257, 1000, 4096)]
    _check_clusters(qdtype, scales, shares, config, shapes, ctas=4)


@pytest.mark.gpu
@pytest.mark.parametrize("ctas,per_sm", [(2, 1), (4, 1), (4, 2)])
def test_gpu_cluster_grid_is_resident_at_once(ctas, per_sm):
    """Where the work would fill more, ``launch``'s grid in clusters is as many clusters as the GPU
    holds at once (``resident_clusters``, asked at the first call; a cluster's CTAs share a GPC,
    so the GPCs' sizes may leave SMs over), so that none waits for another to finish: at most
    SMs x CTAs an SM / cluster_size, and the same bits as without clusters."""
    a_q, b_q, a_s, b_s = _quantized(16, 28672, 4096, torch.float8_e4m3fn, "tensor", "cuda")
    want = gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", swap_ab=True, ctas_per_sm=per_sm)
    for _ in range(2):  # the first call asks how many fit; the second launches that many
        common.LAUNCH_LOG.launches = launches = []
        try:
            got = gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", swap_ab=True, cluster="A",
                               cluster_size=ctas, ctas_per_sm=per_sm)
        finally:
            common.LAUNCH_LOG.launches = None
        assert torch.equal(got, want)
    resident = gluon._cluster_launcher.resident[a_q.device.index, ctas, per_sm]
    assert 1 <= resident <= per_sm * common.sm_count(a_q.device) // ctas
    assert [grid for _, grid, _ in launches] == [(resident,)]


@pytest.mark.gpu
def test_gpu_cluster_launch_replays():
    """A product in clusters captured in a CUDA graph and replayed on refreshed inputs: each replay
    the bits of an eager call (Triton's launcher makes the clusters from the kernel's metadata,
    which a capture records)."""
    a_q, b_q, a_s, b_s = _quantized(128, 4096, 4096, torch.float8_e4m3fn, "tensor", "cuda")
    out = gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", cluster="A")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", cluster="A")
    for _ in range(3):
        a_q.copy_(torch.randn(a_q.shape, device="cuda").to(a_q.dtype))
        out.fill_(float("nan"))
        graph.replay()
        want = gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor")
        assert torch.equal(out, want)


def test_launch_refuses_what_clusters_do_not_take():
    a_q, b_q, a_s, b_s = _quantized(4, 8, 64, torch.float8_e4m3fn, "row")
    a_k, b_k = _kernel_scales(a_s, b_s, "row")
    with pytest.raises(ValueError, match="cluster must be None, 'A' or 'B'"):
        gluon.launch(a_q, b_q, a_k, b_k, None, torch.bfloat16, "row", cluster=True)
    with pytest.raises(ValueError, match="cluster_size must be 2 or 4, got 3"):
        gluon.launch(a_q, b_q, a_k, b_k, None, torch.bfloat16, "row", cluster="A", cluster_size=3)


def test_tile_config_follows_the_measurements():
    """128 x 256 FP8 tiles with bulk stores where they make 3/4 of a wave on 132 SMs and fill its
    rounds about as well as 128-wide ones; 128-wide ones otherwise, and for block scales, with K
    split when the tiles fill less than half the SMs; there, with K short, tiles halved to 64 or 32
    columns until they fill half, with K long 64 wide only where 128 fill under a quarter, and K
    split where the tiles still fill under half (s22b); INT8 as in session 7. From M <= 64, tiles of
    64 rows (one consumer), counted by the same rules but halved whatever K (s23b, s23c); 64 x 64
    one-consumer tiles instead of 128 x 32 ones (s23c). 192 x 128 tiles of three consumers where
    their rounds are fuller than 128 x 256 ones' (per row: even 2 % less full) and C is 16-bit
    with 16-byte aligned rows (s27c). Six ring slots for two consumers' 128 x 128 tiles with K long:
    per tensor up to M = 512 beside a 16-bit C, per row at M = 128, and either with K split (s43a, s43b)."""
    assert gluon.tile_config(8192, 8192, 8192, int8=False) == (128, 4, True, 1, 3)  # 0.985 against 0.970 full
    assert gluon.tile_config(8192, 8192, 8192, int8=False, c_bytes=4) == (256, 3, True, 1, 2)  # float32 C
    assert gluon.tile_config(8192, 8184, 8192, int8=False)[4] == 3
    assert gluon.tile_config(8192, 8190, 8192, int8=False)[4] == 2  # rows of C not 16-byte aligned
    assert gluon.tile_config(8192, 4096, 4096, int8=False) == (256, 3, True, 1, 2)  # 0.940 against 0.970
    assert gluon.tile_config(8192, 4096, 4096, int8=False, row_scales=True)[4] == 2
    assert gluon.tile_config(8192, 6144, 4096, int8=False)[4] == 2  # as full: per tensor no gain (s27c)
    assert gluon.tile_config(8192, 6144, 4096, int8=False, row_scales=True) == (128, 4, True, 1, 3)
    assert gluon.tile_config(8192, 10240, 8192, int8=False, row_scales=True)[4] == 3  # 0.958 against 0.970
    assert gluon.tile_config(4096, 10240, 8192, int8=False, row_scales=True)[4] == 2  # 0.924 against 0.970
    assert gluon.tile_config(1024, 4096, 4096, int8=False, row_scales=True)[4] == 2
    assert gluon.tile_config(2048, 6144, 4096, int8=False, row_scales=True)[4] == 2  # as full, but tied (s27d)
    assert gluon.tile_config(1024, 4096, 4096, int8=False) == (256, 3, True, 1, 2)  # 128 wide tiles: 0.97 wave
    # 192 wide tiles fill 2 rounds of 132 SMs to 0.73, 384 narrow ones 3 rounds to 0.97 (s19b: 0.91 -> 1.03 x cuBLAS)
    assert gluon.tile_config(1024, 6144, 4096, int8=False) == (128, 5, True, 1, 2)
    assert gluon.tile_config(1024, 10240, 8192, int8=False) == (128, 5, True, 1, 2)  # 0.81 -> 0.97
    assert gluon.tile_config(8192, 10240, 8192, int8=False) == (256, 3, True, 1, 2)  # 0.97 vs 0.995: wide
    assert gluon.tile_config(128, 10240, 8192, int8=False) == (128, 6, True, 1, 2)  # 80 tiles: no split; 6 slots
    assert gluon.tile_config(128, 10240, 8192, int8=False, row_scales=True) == (128, 6, True, 1, 2)
    assert gluon.tile_config(128, 10240, 8192, int8=False, c_bytes=4)[1] == 5  # float32 C: no room beside 6
    assert gluon.tile_config(128, 10240, 8192, int8=False, block_scales=True)[1] == 5
    # INT8: FP8's tile where it takes it (192-row ones: 128 x 256; tailed or split-column ones: 128 x 128)
    assert gluon.tile_config(128, 4096, 4096, int8=True) == gluon.tile_config(128, 4096, 4096, int8=False)
    assert gluon.tile_config(128, 4096, 14336, int8=True) == (64, 12, True, 1, 1)
    assert gluon.tile_config(8192, 8192, 8192, int8=True) == (256, 3, True, 1, 2)  # FP8: 192 x 128
    assert gluon.tile_config(1024, 4096, 4096, int8=True) == (256, 3, True, 1, 2)
    # ... 256 wide from INT8_WIDE_MIN_M (M = 128 / 256 8B gate_up: 1.46 / 1.67 x _int_mm against
    # 1.52 / 1.74 on 128 x 128 tiles; M = 512 70B gate_up: 1.48 either way, s63f)
    assert gluon.tile_config(128, 28672, 4096, int8=False) == (256, 3, True, 1, 2)
    assert gluon.tile_config(128, 28672, 4096, int8=True) == (128, 5, True, 1, 2)
    assert gluon.tile_config(256, 28672, 4096, int8=True) == (128, 5, True, 1, 2)
    assert gluon.tile_config(512, 57344, 8192, int8=True) == (256, 3, True, 1, 2)
    assert gluon.tile_config(64, 28672, 4096, int8=True) == (128, 5, True, 1, 2)  # FP8: split columns
    assert gluon.tile_config(256, 10240, 8192, int8=True) == (128, 5, True, 1, 2)  # FP8: 128 x 160
    # six slots per tensor up to M = 512 with K long (s43a, s43b); per row only at M = 128 or with K split
    assert gluon.tile_config(256, 8192, 8192, int8=False) == (128, 6, True, 1, 2)
    assert gluon.tile_config(256, 8192, 8192, int8=False, row_scales=True) == (128, 5, True, 1, 2)
    assert gluon.tile_config(512, 6144, 4096, int8=False) == (128, 5, True, 1, 2)  # K short
    assert gluon.tile_config(256, 4096, 14336, int8=False, row_scales=True) == (128, 6, False, 2, 2)
    # 128 tiles of 128 x 32 become 128 of 64 x 64 (one consumer): 0.90 -> 1.02 x cuBLAS (s23c)
    assert gluon.tile_config(128, 4096, 4096, int8=False) == (64, 8, True, 1, 1)  # one round of 32 K steps
    assert gluon.tile_config(128, 6144, 4096, int8=False) == (64, 8, True, 1, 2)  # 96 tiles of 64
    assert gluon.tile_config(128, 6144, 4096, int8=False, row_scales=True) == (64, 8, True, 1, 2)
    assert gluon.tile_config(128, 8192, 8192, int8=False) == (64, 8, True, 1, 2)  # 128 tiles of 64 K steps
    # long K where 128-wide tiles fill under a quarter of the SMs: 128 of 64 x 64 on 12 slots, K whole
    assert gluon.tile_config(128, 4096, 14336, int8=False) == (64, gluon.LONG_K_64_STAGES, True, 1, 1)
    assert gluon.tile_config(128, 4096, 14336, int8=False, row_scales=True) == (64, 12, True, 1, 1)
    assert gluon.tile_config(128, 4096, 14336, int8=False, block_scales=True) == (64, 8, True, 2, 2)  # 2 runs
    # long K: 64 tiles of 128, 2 runs, 6 slots (the float32 sums then by plain stores)
    assert gluon.tile_config(128, 8192, 28672, int8=False) == (128, 6, False, 2, 2)
    assert gluon.tile_config(128, 8192, 28672, int8=False, block_scales=True) == (128, 5, True, 2, 2)
    assert gluon.tile_config(8192, 8192, 8192, int8=False, block_scales=True) == (128, 5, True, 1, 2)  # pairs, FMA
    assert gluon.tile_config(128, 4096, 4096, int8=False, block_scales=True) == (64, 8, True, 1, 1)
    assert gluon.tile_config(64, 6144, 4096, int8=False) == (64, 8, True, 1, 1)  # 96 tiles of 32 K steps
    assert gluon.tile_config(64, 4096, 4096, int8=False) == (32, 10, True, 1, 1)  # 128 tiles: 0.91
    assert gluon.tile_config(64, 10240, 8192, int8=False) == (128, 6, True, 1, 1)  # 80 tiles: 0.98
    assert gluon.tile_config(64, 28672, 4096, int8=False) == (256, 3, True, 1, 1)  # 112 wide tiles: 1.01
    assert gluon.tile_config(64, 4096, 14336, int8=False) == (32, 10, True, 1, 1)  # long K, no split: 0.92
    assert gluon.tile_config(64, 8192, 28672, int8=False) == (64, 8, True, 1, 1)  # 0.98
    # 160 tiles of 128 x 128 (two rounds, 0.61 full) -> 128 of 128 x 160 with a tail: 0.79 -> 0.93
    assert gluon.tile_config(256, 10240, 8192, int8=False) == (160, 6, False, 1, 2)
    assert gluon.tile_config(256, 28672, 4096, int8=False)[0] == 256  # 224 wide tiles: the fill gains less
    assert gluon.tile_config(256, 10240, 8192, int8=False, block_scales=True)[0] == 128  # tails: no block scales
    for m, n, k in [(1, 1, 16), (64, 28672, 4096), (64, 4096, 4096), (128, 4096, 4096), (128, 6144, 4096),
                    (8192, 28672, 4096)]:
        block_n, stages, _, _, consumers = gluon.tile_config(m, n, k, int8=False)
        # float32 C blocks (split K's sums) beside the ring; three consumers' tiles take only 16-bit C, no split
        c_size = 2 if consumers == 3 else 4
        c_blocks = consumers * 64 * gluon.c_block_cols(block_n) * c_size
        assert stages * gluon._slot_bytes(block_n, consumers) + c_blocks <= gluon.SMEM_BYTES


def test_plan_consumers():
    """tile_config's choice of one or two consumers goes with its own tile width: a width of the
    caller's takes 64-row tiles where M <= 64 and 128-row ones above, unless told."""
    def plan(m, n, k, **kw):
        opts = dict(block_n=None, stages=None, tma_store=None, split_k=None, consumers=None, swap_ab=False,
                    ctas_per_sm=None, split_n=None, scales="tensor", c_bufs=None)
        opts.update(kw)
        return gluon._plan(m, n, k, False, torch.bfloat16, opts["scales"], False, opts["block_n"], opts["stages"],
                           opts["tma_store"], opts["split_k"], gluon.GROUP_M, 132, opts["consumers"], opts["swap_ab"],
                           opts["ctas_per_sm"], opts["split_n"], opts["c_bufs"])

    assert (plan(128, 4096, 4096).block_n, plan(128, 4096, 4096).consumers) == (64, 1)  # tile_config's 64 x 64
    assert plan(128, 4096, 4096, block_n=32).consumers == 2  # the caller's 128 x 32 tiles
    assert plan(128, 4096, 4096, block_n=32, consumers=1).consumers == 1
    assert plan(64, 4096, 4096, block_n=128).consumers == 1
    swapped = plan(6144, 16, 4096, swap_ab=True)  # the kernel's M x N: the user's N x M
    assert (swapped.block_n, swapped.consumers, swapped.constexprs["SWAP_AB"]) == (16, 1, True)
    assert swapped.grid == (96,) and swapped.constexprs["STAGES"] == 10 and swapped.split_k == 1  # 32 steps an item
    swapped = plan(4096, 16, 4096, swap_ab=True)  # 64 tiles of 32 K steps: K whole
    assert swapped.grid == (64,) and swapped.split_k == 1 and swapped.constexprs["STAGES"] == 10
    swapped = plan(4096, 16, 14336, swap_ab=True)  # 64 tiles of 112 steps: K in two runs, 128 work items
    assert swapped.grid == (128,) and swapped.split_k == 2 and swapped.partial_dtype == torch.float32
    assert swapped.options == {"launch_pdl": True}  # the runs meet in the kernel: no second kernel
    swapped = plan(10240, 16, 8192, swap_ab=True)  # 160 tiles: two CTAs an SM, each with 6 slots
    assert swapped.grid == (160,) and swapped.constexprs["STAGES"] == 6
    assert swapped.options == {"maxnreg": 128, "launch_pdl": False}
    assert plan(10240, 16, 8192, swap_ab=True, stages=10).constexprs["STAGES"] == 10  # the caller's depth
    with pytest.raises(ValueError, match="do not fit"):
        plan(10240, 32, 8192, swap_ab=True, stages=10)  # two rings of 10 x 12 KB do not
    with pytest.raises(ValueError, match="two CTAs an SM take one-consumer tiles up to 128 wide"):
        plan(1024, 4096, 4096, ctas_per_sm=2)  # two consumers: their registers do not halve
    assert plan(1024, 4096, 4096).options == {"launch_pdl": False}
    two = plan(128, 6144, 4096, block_n=64, consumers=1, ctas_per_sm=2)  # 192 tiles 64 x 64, 6 slots each
    assert two.grid == (192,) and two.constexprs["STAGES"] == 6 and two.constexprs["TMA_STORE"]
    assert two.options == {"maxnreg": 128, "launch_pdl": False}
    assert plan(128, 10240, 8192, block_n=128, consumers=1, ctas_per_sm=2).constexprs["STAGES"] == 4
    with pytest.raises(ValueError, match="up to 128 wide"):
        plan(128, 28672, 4096, block_n=256, consumers=1, ctas_per_sm=2)
    tailed = plan(128, 6144, 4096, block_n=96, consumers=1)  # 128 tiles of 64 x 96: one round
    assert tailed.grid == (128,) and tailed.constexprs["TAIL_N"] == 32 and tailed.constexprs["STAGES"] == 8
    assert not plan(128, 6144, 4096, block_n=96, consumers=1, tma_store=True).constexprs["TMA_STORE"]
    assert plan(256, 10240, 8192, block_n=160).constexprs["STAGES"] == 6  # 36 KB slots: 6 fit
    assert plan(128, 6144, 4096).constexprs["TAIL_N"] == 0
    # the caller's 128-wide tiles keep bulk stores where tile_config's own would be 160 wide with a tail
    assert plan(200, 10240, 640, block_n=128, consumers=1, ctas_per_sm=2).constexprs["TMA_STORE"]
    # two consumers splitting the columns of 64-row tiles: 128 tiles of 64 x 160 at M = 128, 70B qkv
    split = plan(128, 10240, 8192, block_n=160, split_n=True)
    assert split.grid == (128,) and split.consumers == 2 and split.m_pad == 128 and split.split_k == 1
    assert split.constexprs["SPLIT_N"] and split.constexprs["TAIL_N"] == 32 and split.constexprs["STAGES"] == 8
    assert not split.constexprs["TMA_STORE"]
    split = plan(128, 8192, 8192, block_n=128, split_n=True)  # no tail: bulk stores of 64 x 64 blocks
    assert split.grid == (128,) and split.constexprs["TMA_STORE"] and split.constexprs["STAGES"] == 8
    assert gluon._slot_bytes(128, 2, split_n=True) == (64 + 128) * 128
    # tile_config's 64 x 256 tiles (M <= 64) run split between two consumers; a caller's width as told
    auto = plan(64, 28672, 4096, scales="row")
    assert auto.constexprs["SPLIT_N"] and auto.consumers == 2 and auto.block_n == 256 and auto.grid == (112,)
    assert auto.constexprs["STAGES"] == 4 and auto.constexprs["TMA_STORE"]
    assert not plan(64, 28672, 4096, block_n=256).constexprs["SPLIT_N"]
    assert plan(64, 28672, 4096, block_n=256).consumers == 1
    assert not plan(64, 6144, 4096).constexprs["SPLIT_N"] and not plan(1024, 28672, 4096).constexprs["SPLIT_N"]
    assert not plan(64, 28672, 4096, split_k=2).constexprs["SPLIT_N"]
    # 256-wide tiles: two blocks of C a consumer where they fit beside the ring (bfloat16 C), else one
    assert plan(8192, 4096, 4096).constexprs["C_BUFS"] == 2
    assert plan(8192, 4096, 4096, c_bufs=1).constexprs["C_BUFS"] == 1
    assert plan(1024, 6144, 4096).constexprs["C_BUFS"] == 1  # 128-wide tiles
    assert gluon._plan(8192, 8192, 8192, False, torch.float32, "tensor", False, None, None, None, None, gluon.GROUP_M,
                       132, None, False).constexprs["C_BUFS"] == 1  # float32 blocks: the second does not fit
    with pytest.raises(ValueError, match="c_bufs"):
        plan(1024, 6144, 4096, block_n=128, c_bufs=2)
    for bad in (dict(block_n=48), dict(block_n=80), dict(block_n=128, scales="block"), dict(block_n=128, split_k=2),
                dict(block_n=128, swap_ab=True)):
        with pytest.raises(ValueError, match="split_n"):
            plan(128, 8192, 8192, split_n=True, **bad)
    # three consumers: tile_config's 192 x 128 tiles at large M, or the caller's
    three = plan(8192, 8192, 8192)
    assert (three.block_n, three.consumers, three.m_pad, three.grid) == (128, 3, 43 * 192, (132,))
    assert three.constexprs["STAGES"] == 4 and three.constexprs["TMA_STORE"] and three.constexprs["C_BUFS"] == 1
    assert plan(8192, 8192, 8192, scales="block").consumers == 2  # block scales keep their K-step pairs
    assert plan(8192, 8192, 8192, block_n=256).consumers == 2  # the caller's width: two consumers
    two = plan(8192, 8192, 8192, consumers=2)  # the caller's two consumers: 128 x 128 tiles, 5 slots
    assert (two.block_n, two.consumers, two.constexprs["STAGES"], two.m_pad) == (128, 2, 5, 8192)
    own = plan(1000, 4096, 4096, consumers=3)
    assert (own.block_n, own.m_pad, own.grid, own.constexprs["STAGES"]) == (128, 1152, (132,), 4)
    assert own.constexprs["TMA_STORE"]


def _default_plan(m, k, scales, group_m=None, n=4096, swap_ab=False, **kw):
    """The plan ``_plan`` makes for an M x N x K bfloat16 product on 132 SMs with tile_config's
    tiles (``group_m``, ``swap_ab`` and ``kw``: the caller's own options)."""
    return gluon._plan(m, n, k, False, torch.bfloat16, scales, False, None, None, None, None, group_m, 132, None,
                       swap_ab, **kw)


def _default_constexprs(m, k, scales, group_m=None, **kw):
    """The kernel constexprs of ``_default_plan``."""
    return _default_plan(m, k, scales, group_m, **kw).constexprs


def test_plan_k_groups():
    """Block scales take their K steps in groups of eight, four from K = LONG_K (as measured); tensor
    and row scales keep the pairs; a caller's own group is kept, and other sizes are refused."""
    def k_group(k, scales, **kw):
        return _default_constexprs(1024, k, scales, **kw)["K_GROUP"]

    assert k_group(4096, "block") == 8 and k_group(gluon.LONG_K - 128, "block") == 8
    assert k_group(gluon.LONG_K, "block") == 4 and k_group(28672, "block") == 4
    assert k_group(4096, "tensor") == k_group(28672, "row") == 2
    assert k_group(4096, "tensor", k_group=8) == 8 and k_group(28672, "block", k_group=2) == 2
    a = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_group must be 2, 4 or 8, got 3"):
        gluon.launch(a, a, torch.ones(()), torch.ones(()), None, torch.bfloat16, "tensor", k_group=3)


def test_plan_block_group_m():
    """Block scales from K = LONG_K at M >= 8192 order their tiles in rows of four (as measured);
    elsewhere, and a caller's own order, as asked."""
    def group_m(m, k, scales, group=None):
        return _default_constexprs(m, k, scales, group)["GROUP_M"]

    long_k = gluon.LONG_K
    assert group_m(8192, long_k, "block") == gluon.BLOCK_LONG_K_GROUP_M == 4
    assert group_m(8192, long_k - 128, "block") == group_m(4096, long_k, "block") == gluon.GROUP_M
    assert group_m(8192, long_k, "tensor") == group_m(8192, long_k, "row") == gluon.GROUP_M
    assert group_m(8192, long_k, "block", 16) == 16


def test_plan_early_scales():
    """Row scales load at each work item's start, and a tensor's two where tiles are at most 64
    wide (as measured); block scales come with the ring's slots; a caller's choice is kept."""
    rule = gluon.loads_scales_early
    assert rule("row", 128, 2) and rule("row", 256, 2) and rule("row", 64, 1)
    assert rule("tensor", 64, 2) and rule("tensor", 16, 1) and not rule("tensor", 128, 2) and not rule("block", 64, 2)
    assert not rule("row", 128, 3)  # 192 x 128 tiles: the scales would spill

    def early(m, n, k, scales, **kw):
        return _default_plan(m, k, scales, n=n, **kw).constexprs["EARLY_SCALES"]
    assert early(128, 6144, 4096, "tensor") and early(128, 10240, 8192, "row")  # 64- and 128-wide tiles
    assert not early(128, 10240, 8192, "tensor") and early(6144, 16, 4096, "tensor", swap_ab=True)
    assert _default_plan(8192, 8192, "row", n=10240).constexprs["CONSUMERS"] == 3  # 192 x 128 tiles ...
    assert not early(8192, 10240, 8192, "row")  # ... keep the epilogue's loads
    assert not early(128, 10240, 8192, "row", early=False) and early(128, 10240, 8192, "tensor", early=True)


def test_programmatic_dependent_launch_where_measured():
    """Short products launch early (``launches_early``): up to 128 rows on grids that fill 70 % of
    the SMs, without split-K's second kernel; the transposed product's runs meet in the kernel."""
    assert gluon.launches_early(128, 96, 132, False) and gluon.launches_early(16, 160, 132, False)
    assert not gluon.launches_early(16, 160, 132, False, ctas_per_sm=2)  # 70B qkv at M = 16: 1.00 -> 0.81
    assert not gluon.launches_early(128, 80, 132, False)  # 70B qkv at M = 128: 0.88 -> 0.84 x cuBLAS
    assert not gluon.launches_early(128, 128, 132, True) and not gluon.launches_early(1024, 132, 132, False)

    def options(m, n, k, swap_ab=False):
        return _default_plan(m, k, "tensor", n=n, swap_ab=swap_ab).options
    assert options(128, 6144, 4096)["launch_pdl"] and not options(128, 10240, 8192)["launch_pdl"]
    assert not options(1024, 6144, 4096)["launch_pdl"]
    assert options(6144, 16, 4096, swap_ab=True)["launch_pdl"]  # C^T of 16 rows: the user's M is 16


@pytest.mark.parametrize("switch,pdl,want", [(False, None, False), (True, None, True), (False, True, True),
                                             (True, False, False)])
def test_launch_asks_for_early_launch_where_opted_in(monkeypatch, switch, pdl, want):
    """The launch asks for programmatic dependent launch where ``common.PDL`` opts in and
    ``launches_early`` takes the product (128 x 6144 x 4096: 96 CTAs), or where the caller says so
    (``pdl``); the kernel launch is recorded here, not run."""
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(kwargs)

    monkeypatch.setattr(gluon, "_launcher", Recorder())
    monkeypatch.setattr(gluon, "sm_count", lambda device: 132)
    monkeypatch.setattr(common, "PDL", switch)
    a_q = torch.zeros(128, 4096, dtype=torch.float8_e4m3fn)
    b_q = torch.zeros(6144, 4096, dtype=torch.float8_e4m3fn)
    one = torch.ones(())
    gluon.launch(a_q, b_q, one, one, None, torch.bfloat16, "tensor", pdl=pdl)
    assert seen["launch_pdl"] is want


def test_launch_refuses_tailed_int8_tiles():
    a_q, b_q, a_s, b_s = _quantized(4, 8, 64, torch.int8, "row")
    with pytest.raises(ValueError, match="a tile with a tail"):
        gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "row", block_n=96)
    with pytest.raises(ValueError, match="block_n must be"):
        gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "row", block_n=112)


def test_launch_refuses_a_transposed_product_of_many_rows():
    """The transposed product puts A's rows on the tile's narrow side: up to 64 (it used to fail
    with a KeyError from M = 257)."""
    a_q, b_q, a_s, b_s = _quantized(300, 128, 64, torch.float8_e4m3fn, "row")
    a_k, b_k = _kernel_scales(a_s, b_s, "row")
    with pytest.raises(ValueError, match="swap_ab.*up to 64 rows.*got 300"):
        gluon.launch(a_q, b_q, a_k, b_k, None, torch.bfloat16, "row", swap_ab=True)


def test_launch_refuses_what_three_consumers_do_not_take():
    a_q, b_q, a_s, b_s = _quantized(4, 8, 64, torch.float8_e4m3fn, "row")
    a_k, b_k = _kernel_scales(a_s, b_s, "row")
    for bad in (dict(block_n=256), dict(block_n=64), dict(split_k=2), dict(swap_ab=True), dict(ctas_per_sm=2),
                dict(split_n=True)):
        with pytest.raises(ValueError, match="consumers=3"):
            gluon.launch(a_q, b_q, a_k, b_k, None, torch.bfloat16, "row", consumers=3, **bad)
    i_q, j_q, i_s, j_s = _quantized(4, 8, 64, torch.int8, "row")
    with pytest.raises(ValueError, match="consumers=3"):
        gluon.launch(i_q, j_q, i_s, j_s, None, torch.bfloat16, "row", consumers=3)
    with pytest.raises(ValueError, match="consumers must be 1, 2 or 3"):
        gluon.launch(a_q, b_q, a_k, b_k, None, torch.bfloat16, "row", consumers=4)


def test_preferred_only_where_measured():
    """FP8 from M = 33 with N and K from 2048, the range timed against the tl kernel on the H200;
    at M <= 32 the transposed product where B's 64-row tiles fill the SMs (one round 70 % from
    M = 8, several 90 %) or, from M = 16, K in two runs fills one round, tensor and row scales.
    INT8 by the same rules, in the tiles it takes."""
    assert gluon.preferred(128, 8192, 4096, int8=False) and gluon.preferred(8192, 28672, 8192, int8=False)
    # INT8 likewise, but at M <= 64 not where FP8's tile is one INT8 cannot run (256 wide: gate / up)
    assert gluon.preferred(8192, 8192, 8192, int8=True) and gluon.preferred(64, 4096, 14336, int8=True)
    assert gluon.preferred(128, 28672, 4096, int8=True) and not gluon.preferred(64, 28672, 4096, int8=True)
    assert not gluon.preferred(32, 8192, 4096, int8=True) and not gluon.preferred(128, 1024, 4096, int8=True)
    assert gluon.preferred(1024, 4096, 4096, int8=False) and gluon.preferred(128, 4096, 14336, int8=False)
    assert gluon.preferred(64, 6144, 4096, int8=False) and gluon.preferred(33, 4096, 4096, int8=False)
    assert not gluon.preferred(32, 8192, 4096, int8=False) and gluon.preferred(1024, 2048, 4096, int8=False)
    assert gluon.preferred(128, 2048, 2048, int8=False) and gluon.preferred(33, 3584, 18944, int8=False)
    assert not gluon.preferred(128, 1024, 4096, int8=False) and not gluon.preferred(1024, 8192, 1024, int8=False)
    swap = [(16, 6144, 4096), (8, 8192, 8192), (32, 57344, 8192), (1, 57344, 8192), (16, 8192, 28672),
            (16, 4096, 4096), (32, 4096, 14336), (16, 10240, 8192), (1, 10240, 8192)]  # 96, 128, 896 tiles;
    # 64 tiles from M = 16: K whole at 32 steps, in 2 runs at 112; 160 tiles in one round of two CTAs an SM
    tl = [(8, 4096, 4096), (16, 28672, 4096), (1, 6144, 4096), (1, 4096, 4096), (64, 6144, 4096),
          (16, 6144, 2048), (16, 2048, 4096)]  # 64 tiles at M = 8, 448 (85 %), M = 1 in one round; M, K
    # or N out of range
    assert all(gluon.swap_preferred(m, n, k, int8=False) for m, n, k in swap)
    assert not any(gluon.swap_preferred(m, n, k, int8=False) for m, n, k in tl)
    assert [gluon.swap_config(m, n, k)[3] for m, n, k in swap] == [1, 1, 1, 1, 1, 1, 2, 1, 1]
    assert [gluon.swap_ctas_per_sm(tiles, 132) for tiles in (96, 132, 133, 160, 264, 265, 896)] == [1, 1, 2, 2, 2, 1, 1]
    assert [gluon.swap_preferred(m, n, k, int8=True) for m, n, k in swap + tl] == [True] * len(swap) + [False] * len(tl)
    # Block scales: also where the tiles make one or two rounds (M < 8: the tl kernel's product is
    # slower with them, s37b); not four rounds at 85 % (8B gate_up), nor out of range
    assert all(gluon.swap_preferred(m, n, k, int8=False, block_scales=True) for m, n, k in swap)
    assert [gluon.swap_preferred(m, n, k, int8=False, block_scales=True) for m, n, k in tl] == [
        True, False, True, True, False, False, False]


SWAP_SHAPES = [(1, 1, 16), (5, 1000, 2000), (16, 640, 1152), (33, 384, 4096), (64, 129, 320)]  # decode-sized M


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row", "mixed"])
@pytest.mark.parametrize("m,n,k", SWAP_SHAPES)
def test_gpu_swap_ab_int8_bit_exact(m, n, k, scales):
    """The transposed product (C^T = B A^T, one consumer, A's rows on the narrow side) is the
    reference's C bit for bit, bias along C's columns included, with every tile width that a
    decode-sized M gets, two ring depths, and K in 2 or 3 runs that the kernel adds up."""
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, scales, "cuda")
    bias = torch.randn(n, device="cuda")
    kind, a_k, b_k = _int8_kernel_scales(a_s, b_s, scales, m, n)
    want = int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.bfloat16)
    for stages, split_k in ((None, None), (4, None), (None, 2), (None, 3)):
        with poisoned():
            c = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, kind, swap_ab=True, stages=stages,
                             split_k=split_k)
        assert_written(c)
        assert torch.equal(c, want), (stages, split_k)


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k", SWAP_SHAPES + [(16, 4096, 4096)])
def test_gpu_swap_ab_fp8_within_fp32_rounding(m, n, k, scales):
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
    a_k, b_k = _kernel_scales(a_s, b_s, scales)
    bias = torch.randn(n, device="cuda")
    ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)
    for split_k in (None, 2):
        with poisoned():
            c = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, swap_ab=True, split_k=split_k)
        assert_written(c)
        assert rel_l2_err(c, ref) < 1e-5 * max(1.0, k ** 0.5), split_k


@pytest.mark.gpu
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("m,n,k", SWAP_SHAPES + [(16, 4096, 4096), (3, 10240, 1024)])
def test_gpu_swap_ab_fp8_block_scales(m, n, k, outliers):
    """Block scales in the transposed product: A's (1 x 128) scales run along the kernel's
    columns and B's (128 x 128) block holds its 64 rows. Within float32 rounding of the reference
    on Gaussian inputs, with K in one to three runs, two CTAs an SM, A's scales row-major (the
    launcher's column-major copy) and B's with a gap between rows (each step's value picked at run
    time); with outlier channels within float32 rounding of the tl kernel's transposed product,
    which shares the tensor cores' sum inside a K step."""
    from qflash.kernels.matmul import default_config, scaled_matmul

    a_q, b_q, a_s, b_s, bias, ref = _block_case(m, n, k, outliers)
    tl_swap = scaled_matmul(a_q, b_q, a_s, b_s, bias, torch.float32, "block",
                            config=default_config(16, 4096, 4096, "block", False, a_q.device))
    b_gap = torch.full((b_s.shape[0], b_s.shape[1] + 1), float("nan"), device="cuda")[:, :b_s.shape[1]]
    b_gap.copy_(b_s)
    bound = 1e-5 * max(1.0, k ** 0.5)
    for a_k, b_k, opts in [(a_s, b_s, {}), (a_s, b_s, dict(split_k=2)), (a_s, b_s, dict(split_k=3, stages=6)),
                           (a_s, b_s, dict(ctas_per_sm=2)), (a_s.contiguous(), b_gap, dict(k_group=4)),
                           (a_s, b_s, dict(k_group=2, split_k=2))]:
        with poisoned():
            c = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, "block", swap_ab=True, **opts)
        assert_written(c)
        if outliers:
            assert rel_l2_err(c, tl_swap) < bound, (opts, rel_l2_err(c, tl_swap))
        else:
            assert rel_l2_err(c, ref) < bound, (opts, rel_l2_err(c, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(16, 10240, 1024), (5, 8500, 640), (32, 16896, 384)])  # 160, 133, 264 tiles
def test_gpu_swap_ab_two_ctas_an_sm(m, n, k):
    """Two CTAs an SM (the launch's default where B's 64-row tiles make one to two rounds) give the
    bits of one CTA an SM: INT8 against the int32 reference with bias and row scales, FP8 the same
    bits as the one-CTA launch and within float32 rounding."""
    assert gluon._plan(n, m, k, False, torch.bfloat16, "row", True, None, None, None, None, gluon.GROUP_M,
                       torch.cuda.get_device_properties(0).multi_processor_count, None, True).options["maxnreg"]
    bias = torch.randn(n, device="cuda")
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, "row", "cuda")
    with poisoned():
        c = gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), bias, torch.bfloat16, "row", swap_ab=True)
    assert_written(c)
    assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.bfloat16))
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, "row", "cuda")
    one = gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), bias, torch.float32, "row", swap_ab=True,
                       ctas_per_sm=1)
    with poisoned():
        two = gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), bias, torch.float32, "row",
                           swap_ab=True)
    assert_written(two)
    assert torch.equal(two, one)
    assert rel_l2_err(two, fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)) < 1e-5 * max(1.0, k ** 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
@pytest.mark.parametrize("m,n,k,block_n", [(128, 6144, 1024, 64), (200, 10240, 640, 128), (113, 8500, 1040, 64)])
def test_gpu_two_ctas_an_sm_64_row_tiles(m, n, k, block_n, scales):
    """Two CTAs an SM with 64-row tiles 64 or 128 wide (C through shared memory and bulk copies
    where its rows allow, each ring in half the SM's shared memory): INT8 exact, FP8 the bits of
    one CTA an SM."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = gluon._plan(m, n, k, False, torch.bfloat16, scales, True, block_n, None, None, None, gluon.GROUP_M, sms,
                       1, False, 2)
    assert plan.options["maxnreg"] and plan.grid[0] > sms
    assert plan.constexprs["TMA_STORE"] == (n % 8 == 0)  # bulk stores need 16-byte rows of bfloat16
    bias = torch.randn(n, device="cuda")
    if scales != "block":
        a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, scales, "cuda")
        a_k, b_k = _kernel_scales(a_s, b_s, scales)
        with poisoned():
            c = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, block_n=block_n, consumers=1,
                             ctas_per_sm=2)
        assert_written(c)
        assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.bfloat16))
        a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
        a_k, b_k = _kernel_scales(a_s, b_s, scales)
    else:
        a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        a_q, a_k = qflash.quantize(a, torch.float8_e4m3fn, "block", (1, 128))
        b_q, b_k = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
        a_s, b_s = a_k, b_k
    one = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, block_n=block_n, consumers=1, ctas_per_sm=1)
    with poisoned():
        two = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, block_n=block_n, consumers=1,
                           ctas_per_sm=2)
    assert_written(two)
    assert torch.equal(two, one)
    assert rel_l2_err(two, fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)) < 1e-5 * max(1.0, k ** 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k,block_n,consumers,split_k", [
    (128, 6144, 1024, 96, 1, 1), (113, 1000, 640, 96, 1, 1), (200, 10240, 1040, 160, 2, 1), (128, 700, 384, 48, 2, 1),
    (70, 2000, 2048, 160, 1, 2), (256, 4000, 528, 192, 2, 1)])
def test_gpu_tailed_tiles(m, n, k, block_n, consumers, split_k, scales):
    """Tiles of B's block and a narrower tail (ragged M, N and K, bias, row scales, K split): FP8
    within float32 rounding of the reference, and the bits of 64-wide tiles (each column's
    K steps are the same wgmma partials added in the same order)."""
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
    a_k, b_k = _kernel_scales(a_s, b_s, scales)
    bias = torch.randn(n, device="cuda")
    with poisoned():
        c = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, block_n=block_n, consumers=consumers,
                         split_k=split_k)
    assert_written(c)
    ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)
    assert rel_l2_err(c, ref) < 1e-5 * max(1.0, k ** 0.5)
    if split_k == 1:
        narrow = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, block_n=64, consumers=consumers)
        assert torch.equal(c, narrow)
    with poisoned():
        c16 = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, block_n=block_n, consumers=consumers,
                           split_k=split_k)
    assert_written(c16)
    assert c16.dtype == torch.bfloat16 and rel_l2_err(c16, ref) < 2 ** -8  # bfloat16's rounding
    if split_k == 1:  # the same float32 values, rounded once
        assert torch.equal(c16, c.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k,block_n", [
    (128, 10240, 1024, 160), (113, 1000, 640, 96), (64, 4096, 1040, 128), (200, 2000, 528, 256), (1, 700, 384, 64),
    (239, 3000, 2048, 192)])
def test_gpu_split_n_tiles(m, n, k, block_n, scales):
    """64-row tiles whose columns two consumers split (ragged M, N and K, bias, with and without a
    tail, bulk and plain stores): FP8 within float32 rounding of the reference and the bits of
    one consumer's 64 x 64 tiles (each column's K steps are the same wgmma partials added in the
    same order), bfloat16 output that float32 rounded once."""
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
    a_k, b_k = _kernel_scales(a_s, b_s, scales)
    bias = torch.randn(n, device="cuda")
    with poisoned():
        c = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, block_n=block_n, split_n=True)
    assert_written(c)
    ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)
    assert rel_l2_err(c, ref) < 1e-5 * max(1.0, k ** 0.5)
    assert torch.equal(c, gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, block_n=64, consumers=1))
    with poisoned():
        c16 = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, block_n=block_n, split_n=True)
    assert_written(c16)
    assert torch.equal(c16, c.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k", [(1024, 8192, 1024), (1000, 8000, 640), (8192, 4096, 512)])
def test_gpu_two_c_blocks(m, n, k, scales):
    """256-wide tiles whose halves leave through two blocks of shared memory a consumer (several
    tiles a CTA, so each block is written again while the other half's copy may run): the same
    bits as one block a consumer, bias and ragged edges included."""
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
    a_k, b_k = _kernel_scales(a_s, b_s, scales)
    bias = torch.randn(n, device="cuda")
    with poisoned():
        two = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, block_n=256, stages=3, tma_store=True,
                           c_bufs=2)
    assert_written(two)
    one = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, block_n=256, stages=3, tma_store=True,
                       c_bufs=1)
    assert torch.equal(two, one)
    assert torch.equal(two, gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales))  # the dispatch's tiles
    assert rel_l2_err(two, fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)) < 2 ** -8


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
@pytest.mark.parametrize("m,n,k", [(1000, 900, 1024), (193, 385, 640), (8269, 1280, 4096), (64, 128, 128),
                                   (1, 48, 16)])
def test_gpu_three_consumers(m, n, k, scales):
    """192 x 128 tiles of three consumers (ragged M, N and K, bias, one tile to several a CTA,
    bulk stores of bfloat16 and plain stores of float32): the bits of two consumers' 128 x 128
    tiles (each block's K steps are the same partials added in the same order, pairs or not),
    close to the reference, bfloat16 output that float32 rounded once. Close: float32 rounding
    over K, or where K is one or two steps, one step's sum inside the tensor cores (about 14 bits:
    1.3e-4 at K = 128 in s27e, for two consumers' tiles alike)."""
    a_q, b_q, a_k, b_k, bias, ref = _fp8_case(m, n, k, scales)
    with poisoned():
        c = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, consumers=3)
    assert_written(c)
    assert torch.equal(c, gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, block_n=128, consumers=2))
    assert rel_l2_err(c, ref) < max(1e-5 * k ** 0.5, 2 ** -12)
    with poisoned():
        c16 = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, consumers=3)
    assert_written(c16)
    assert torch.equal(c16, c.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
@pytest.mark.parametrize("m,n,k,block_n", [(1000, 900, 1280, 128), (193, 385, 640, 128), (300, 1000, 896, 64),
                                           (64, 128, 1024, 128), (64, 128, 128, 128), (257, 2048, 1920, 32),
                                           (512, 1024, 2048, 128)])
@pytest.mark.parametrize("k_group", [4, 8])
def test_gpu_k_steps_in_groups(m, n, k, block_n, scales, k_group):
    """K steps in groups of 4 or 8 (two partials, from the third step on each product into the
    registers of the partial two steps back): the bits of the pairs (the same partials added in
    the same order) for 1 to 16 K steps (every remainder of four, and groups then pairs then a
    single step), with ragged M and N, bias, float32 and bfloat16. At K = 2048 in one run, B's
    block scales lie in aligned fours, where the pairs starting at the third step of a four
    must still pick their values at run time."""
    a_q, b_q, a_k, b_k, bias, ref = _fp8_case(m, n, k, scales)
    for out_dtype in (torch.float32, torch.bfloat16):
        with poisoned():
            grouped = gluon.launch(a_q, b_q, a_k, b_k, bias, out_dtype, scales, block_n=block_n, k_group=k_group)
        assert_written(grouped)
        assert torch.equal(grouped, gluon.launch(a_q, b_q, a_k, b_k, bias, out_dtype, scales, block_n=block_n,
                                                 k_group=2))
    assert rel_l2_err(grouped.double(), ref) < 2 ** -8


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
def test_gpu_public_fp8_matmul_three_consumers(scales):
    """fp8_matmul where tile_config takes 192 x 128 tiles (M = 8192, N = 8192): the three-consumer
    kernel's result, bit for bit, within float32 rounding of the reference."""
    m, n, k = 8192, 8192, 256
    assert gluon.tile_config(m, n, k, int8=False, row_scales=scales == "row")[4] == 3
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
    a_k, b_k = _kernel_scales(a_s, b_s, scales)
    public = qflash.fp8_matmul(a_q, b_q, a_s, b_s)  # bfloat16
    assert torch.equal(public, gluon.launch(a_q, b_q, a_k, b_k, None, torch.bfloat16, scales, consumers=3))
    ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float64)
    assert rel_l2_err(public, ref) < 2 ** -8


@pytest.mark.gpu
def test_gpu_swap_ab_split_k_counts_reset():
    """The transposed product's runs meet through one count a tile that the last run sets back to
    zero: exact INT8 launch after launch with fresh inputs, on the default stream and another one
    (each has its own counts), and in a CUDA graph replayed with new inputs."""
    from qflash.kernels.matmul_epilogue import _COUNTERS

    m, n, k = 16, 4096, 4096

    def launch(a_q, b_q, a_s, b_s):
        return gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), None, torch.float32, "row",
                            swap_ab=True, split_k=3)

    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, "row", "cuda")
            with poisoned():
                c = launch(a_q, b_q, a_s, b_s)
            assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float32))
        stream.synchronize()
    assert all(int(t.count_nonzero()) == 0 for t in _COUNTERS.values())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = launch(a_q, b_q, a_s, b_s)
    for _ in range(2):
        fresh_q, _, fresh_s, _ = _quantized(m, n, k, torch.int8, "row", "cuda")
        a_q.copy_(fresh_q)
        a_s.copy_(fresh_s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(16, 640, 1152), (5, 1000, 2000), (33, 200, 4096)])
def test_gpu_swap_ab_two_consumers(m, n, k):
    """The transposed product with two consumers (128 rows of B a tile, the activations' slot
    shared): each consumer's runs of K count themselves in apart, so launch after launch, with K
    in one to three runs, INT8 is the reference's C bit for bit, and FP8 adds the same partials
    in the same order as one consumer (the same bits)."""
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, "row", "cuda")
    bias = torch.randn(n, device="cuda")
    want = int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.bfloat16)
    for split_k in (None, 2, 3, 3):  # twice with three runs: the counts went back to zero
        with poisoned():
            c = gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), bias, torch.bfloat16, "row",
                             swap_ab=True, consumers=2, ctas_per_sm=1, split_k=split_k)
        assert_written(c)
        assert torch.equal(c, want), split_k
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, "row", "cuda")
    for split_k in (None, 2):
        one = gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), bias, torch.float32, "row",
                           swap_ab=True, consumers=1, ctas_per_sm=1, split_k=split_k)
        with poisoned():
            two = gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), bias, torch.float32, "row",
                               swap_ab=True, consumers=2, ctas_per_sm=1, split_k=split_k)
        assert_written(two)
        assert torch.equal(two, one), split_k


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
@pytest.mark.parametrize("m,n,k", [(64, 640, 1152), (100, 384, 2000)])
def test_gpu_one_consumer_tiles_match(m, n, k, scales):
    """64-row tiles (one consumer) add the same partials in the same order as 128-row ones: the
    same bits, with plain and bulk stores, K split or not (INT8 for the split: exact either way)."""
    if scales == "block":
        a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        a_q, a_k = qflash.quantize(a, torch.float8_e4m3fn, "block", (1, 128))
        b_q, b_k = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
    else:
        a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
        a_k, b_k = _kernel_scales(a_s, b_s, scales)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, block_n=64, stages=6, consumers=2)
    for tma_store in (False, True):
        with poisoned():
            got = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, scales, block_n=64, stages=8,
                               tma_store=tma_store, consumers=1)
        assert_written(got)
        assert torch.equal(got, want), tma_store
    if scales == "row":
        a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, scales, "cuda")
        want = int8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float32)
        got = gluon.launch(a_q, b_q, a_s.reshape(-1, 1), b_s.reshape(-1, 1), None, torch.float32, scales,
                           block_n=64, stages=8, consumers=1, split_k=3)
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(16, 6144, 4096), (1, 6144, 4096), (32, 4096, 14336), (16, 28672, 4096)])
def test_gpu_public_block_scales_at_decode_sizes(m, n, k, monkeypatch):
    """fp8_matmul with block scales at decode sizes is the transposed product's result, bit for
    bit, where ``swap_preferred`` takes it (8B qkv at M = 16 and at M = 1, 8B down at M = 32 in two
    runs of K), else the tl kernel's (8B gate_up at M = 16); within float32 rounding of the
    reference."""
    a_q, b_q, a_k, b_k, _, ref = _fp8_case(m, n, k, "block")
    public = qflash.fp8_matmul(a_q, b_q, a_k, b_k, out_dtype=torch.float32)
    swap = gluon.swap_preferred(m, n, k, False, torch.cuda.get_device_properties(0).multi_processor_count,
                                block_scales=True)
    assert swap == (n != 28672)
    if swap:
        want = gluon.launch(a_q, b_q, a_k, b_k, None, torch.float32, "block", swap_ab=True)
    else:
        monkeypatch.setenv("QFLASH_GLUON", "0")
        want = qflash.fp8_matmul(a_q, b_q, a_k, b_k, out_dtype=torch.float32)
    assert torch.equal(public, want)
    assert rel_l2_err(public, ref) < 1e-5 * k ** 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k", [(16, 6144, 4096), (32, 4096, 14336), (16, 28672, 4096), (64, 4096, 14336),
                                   (64, 28672, 4096), (130, 4096, 4096), (256, 10240, 8192), (1030, 4096, 4096)])
def test_gpu_public_int8_matmul_on_the_gluon_kernel(m, n, k, scales, monkeypatch):
    """int8_matmul sends a product where ``preferred`` or ``swap_preferred`` says (the transposed
    product at M <= 32, FP8's narrow tiles, 128 x 128 ones where FP8's are wider), else to the tl
    kernel (8B gate_up at M = 16 and 64): the exact reference's bits either way, bias included."""
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.int8, scales, "cuda")
    kind, a_k, b_k = _int8_kernel_scales(a_s, b_s, scales, m, n)
    bias = torch.randn(n, device="cuda")
    with poisoned():
        public = qflash.int8_matmul(a_q, b_q, a_s, b_s, bias=bias, out_dtype=torch.bfloat16)
    assert_written(public)
    assert torch.equal(public, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.bfloat16))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    swap, plain = gluon.swap_preferred(m, n, k, True, sms), gluon.preferred(m, n, k, int8=True)
    assert (swap or plain) == (n != 28672 or m > 64)
    if swap or plain:
        kernel = gluon.launch(a_q, b_q, a_k, b_k, bias, torch.bfloat16, kind, swap_ab=swap)
        assert torch.equal(public, kernel)
    monkeypatch.setenv("QFLASH_GLUON", "0")
    assert torch.equal(qflash.int8_matmul(a_q, b_q, a_s, b_s, bias=bias, out_dtype=torch.bfloat16), public)


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
@pytest.mark.parametrize("m,n,k", [(128, 3072, 2048), (33, 2048, 2048), (1024, 3584, 3584), (200, 2048, 8192),
                                   (128, 1024, 4096)])
def test_gpu_public_fp8_matmul_at_smaller_models_shapes(m, n, k, scales, monkeypatch):
    """From M = 33 with N and K from MIN_NK (Llama-3.2-1B / 3B, Qwen2.5-7B), fp8_matmul is this
    kernel's result, bit for bit; under MIN_NK (N = 1024) the tl kernel's. Within float32 rounding
    of the reference, both paths, every kind of scales."""
    a_q, b_q, a_k, b_k, bias, ref = _fp8_case(m, n, k, scales)
    public = qflash.fp8_matmul(a_q, b_q, a_k, b_k, bias=bias, out_dtype=torch.float32)
    monkeypatch.setenv("QFLASH_GLUON", "0")
    portable = qflash.fp8_matmul(a_q, b_q, a_k, b_k, bias=bias, out_dtype=torch.float32)
    if gluon.preferred(m, n, k, int8=False):
        assert n >= gluon.MIN_NK
        assert torch.equal(public, gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales))
    else:
        assert n < gluon.MIN_NK and torch.equal(public, portable)
    for c in (public, portable):
        assert rel_l2_err(c, ref) < 1e-5 * k ** 0.5


def test_swap_ab_takes_what_it_can():
    """The transposed product writes C with plain stores: it says so for bulk stores; its tile is
    A's rows rounded up to 16, 32 or 64, in 10 ring slots (8 for 64-wide tiles), and 6 a CTA where
    two share an SM (16- and 32-wide tiles with tensor or row scales); K whole in items of up to 32
    steps."""
    a_q, b_q, a_s, b_s = _quantized(4, 8, 64, torch.int8, "row")
    with pytest.raises(ValueError, match="swap_ab"):
        gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "row", swap_ab=True, tma_store=True)
    with pytest.raises(ValueError, match="consumers must be 1, 2 or 3"):
        gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "row", consumers=4)
    assert gluon.swap_config(1, 4096, 4096) == (16, 10, False, 1, 1)  # 64 items of 32 K steps
    assert gluon.swap_config(16, 4096, 4096) == (16, 10, False, 1, 1)  # 64 items of 32 steps, not 128 of 16
    assert gluon.swap_config(32, 6144, 4096) == (32, 10, False, 1, 1)  # 96 items of 32 steps
    block_plan = gluon._plan(6144, 16, 4096, False, torch.bfloat16, "block", False, None, None, None, None, None, 132,
                             None, True)  # the kernel's M x N: the user's N x M; block scales, one CTA an SM
    assert block_plan.constexprs["STAGES"] == 10
    assert gluon.swap_config(16, 8192, 8192)[1] == 10  # 128 items of 64 steps
    assert gluon.swap_config(16, 28672, 4096)[1] == 10  # 448 items: rounds of the SMs
    assert gluon.swap_config(16, 4096, 14336)[1:4] == (10, False, 2)  # 2 runs of 56 steps
    assert gluon.swap_config(17, 4096, 4096)[0] == 32 and gluon.swap_config(64, 4096, 4096)[:2] == (64, 8)
    two_ctas = {scales: gluon._plan(10240, 16, 8192, False, torch.bfloat16, scales, False, None, None, None, None,
                                    None, 132, None, True) for scales in ("tensor", "row", "block")}  # 160 tiles
    assert [(p.options.get("maxnreg"), p.constexprs["STAGES"]) for p in two_ctas.values()] == [(128, 6), (128, 6),
                                                                                               (128, 8)]
    for m in (1, 16, 32, 64):
        block_n, stages, _, _, consumers = gluon.swap_config(m, 4096, 4096)
        assert stages * gluon._slot_bytes(block_n, consumers) <= gluon.SMEM_BYTES


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k,swap_ab", [(128, 8192, 4096, False), (64, 6144, 4096, False), (16, 6144, 4096, True),
                                            (16, 10240, 8192, True), (256, 10240, 4096, False),
                                            (128, 4096, 14336, False), (16, 4096, 4096, True)])
def test_gpu_public_fp8_matmul_takes_it(m, n, k, swap_ab, scales, monkeypatch):
    """fp8_matmul at a preferred shape is this kernel's result, bit for bit (the tl kernel's with
    QFLASH_GLUON=0): 128-row tiles, 64-row tiles at M = 64 and at M = 128 with long K, the
    transposed product at M = 16 (K whole or not), 128 x 160 tiles with a tail at M = 256; both
    within float32 rounding of the reference, bias included."""
    a_q, b_q, a_s, b_s = _quantized(m, n, k, torch.float8_e4m3fn, scales, "cuda")
    bias = torch.randn(n, device="cuda")
    public = qflash.fp8_matmul(a_q, b_q, a_s, b_s, bias=bias, out_dtype=torch.float32)
    a_k, b_k = _kernel_scales(a_s, b_s, scales)
    assert torch.equal(public, gluon.launch(a_q, b_q, a_k, b_k, bias, torch.float32, scales, swap_ab=swap_ab))
    monkeypatch.setenv("QFLASH_GLUON", "0")
    portable = qflash.fp8_matmul(a_q, b_q, a_s, b_s, bias=bias, out_dtype=torch.float32)
    ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)
    for c in (public, portable):
        assert rel_l2_err(c, ref) < 1e-5 * k ** 0.5
