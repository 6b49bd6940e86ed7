"""What a launch in clusters costs: chains of a kernel that does next to nothing, in and out of
clusters, with and without programmatic dependent launch (PDL).

    python3 benchmarks/cluster_launch_probe.py [--ctas 96,132] [--spin-ns 0,4000] [--chain 20] [--out probe.json]

The FP8 matmul in pairs of CTAs lost about 1.1 us a call that did not grow with K (NOTES, round
68, s68d) and gained nothing from PDL, which hides about that much of the kernel without
clusters. This asks where that goes, with the matmul's launch and nothing of its work: one CTA
an SM (the shared memory it asks for lets no second one in), 16 warps, each CTA waiting
``--spin-ns`` (a stand-in for work) and writing one value. Grids of 96 CTAs (the matmul's at
128 x 6144 x 4096) leave SMs on which the next grid's CTAs can start early; 132 leave none.
Variants: no clusters; pairs and fours, with the cluster barrier nowhere, at the start (as
every partition of the matmul calls it, after its barriers' initialization is fenced) or at the
start and the end; each without and with PDL (the kernel then waits for the grid before it at
its start, and lets the next one launch after its wait, as the matmul's loader does after its
last copy). A chain of ``--chain`` launches is captured in a CUDA graph and timed
(``triton.testing.do_bench_cudagraph``); what prints is the time a launch, and whether every CTA
wrote its value."""

import argparse
import itertools
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from qflash.kernels.common import SM_SHARED_BYTES, CachedLauncher
from qflash.kernels.gluon_common import (ClusterLauncher, cluster_sync, fence_barrier_init, let_next_grid_launch,
                                         wait_for_prior_grids)

SYNC_NONE, SYNC_START, SYNC_BOTH = 0, 1, 2
HELD_BYTES = 128 * 1024  # more than half of what an SM has (a power of two, as Gluon's shapes): one CTA an SM
WARPS = 16  # the matmul's: two consumer warpgroups, the loader's
assert 2 * HELD_BYTES > SM_SHARED_BYTES
HELD_LAYOUT = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])


@gluon.jit
def _now():
    """The GPU's global timer (ns)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _tick_kernel(Out, spin_ns, SMEM_AT: gl.constexpr, CTAS: gl.constexpr, CLUSTER: gl.constexpr, SYNC: gl.constexpr,
                 PDL: gl.constexpr, HELD: gl.constexpr, HELD_LAYOUT: gl.constexpr):
    """Out[program] = program + 1 after ``spin_ns`` of waiting (a stand-in for a kernel's work),
    and nothing else but what the variant asks for."""
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # (what ClusterLauncher locates)
    mbarrier.init(bar, count=1)
    held = gl.allocate_shared_memory(gl.int32, [HELD // 4], HELD_LAYOUT)  # only to take the SM's shared memory
    if CLUSTER and SYNC >= 1:
        fence_barrier_init()
        cluster_sync()
    if PDL:
        wait_for_prior_grids()
    start = _now()
    while _now() - start < spin_ns:
        pass
    if PDL:  # (where the matmul lets the next grid launch: its loader's last copy issued, near the end)
        let_next_grid_launch()
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    lanes = gl.arange(0, 32 * gl.num_warps(), layout)  # [32 * warps]
    pid = gl.program_id(0)
    piece = held.slice(0, 32 * gl.num_warps())
    piece.store(lanes + pid + 1)
    value = piece.load(layout)  # [32 * warps]: every thread its own value, lane 0's pid + 1
    gl.store(Out + pid + lanes, value, mask=lanes == 0)
    if CLUSTER and SYNC >= 2:
        cluster_sync()


_plain = CachedLauncher(_tick_kernel)
_clustered = ClusterLauncher(_tick_kernel, ("bar",))


def launch(out: torch.Tensor, spin_ns: int, ctas: int, sync: int, pdl: bool):
    """One launch of ``out.numel()`` CTAs: in clusters of ``ctas`` (1: none)."""
    grid = out.numel() // ctas
    launcher = _clustered if ctas > 1 else _plain
    launcher[(grid,)](out, spin_ns, SMEM_AT=(0,), CTAS=ctas, CLUSTER=ctas > 1, SYNC=sync, PDL=pdl, HELD=HELD_BYTES,
                      HELD_LAYOUT=HELD_LAYOUT, num_warps=WARPS, launch_pdl=pdl)


VARIANTS = [(f"{name} {where}{' pdl' if pdl else ''}", ctas, sync, pdl)
            for name, ctas in (("plain", 1), ("pairs", 2), ("fours", 4))
            for where, sync in (("", SYNC_NONE), ("sync start", SYNC_START), ("sync both", SYNC_BOTH))
            if ctas > 1 or sync == SYNC_NONE
            for pdl in (False, True)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=20, help="launches a graph replays")
    parser.add_argument("--ctas", default="96,132",
                        help="CTAs a launch, comma-separated, multiples of 4 (96: the matmul's 128 x 6144 x 4096, "
                             "which leaves SMs free for the next grid; 132: every SM)")
    parser.add_argument("--spin-ns", default="0,4000", help="how long each CTA waits, comma-separated")
    parser.add_argument("--out", help="where to write the rows as JSON")
    args = parser.parse_args()
    rows = []
    for ctas, spin in itertools.product(map(int, args.ctas.split(",")), map(int, args.spin_ns.split(","))):
        for name, size, sync, pdl in VARIANTS:
            out = torch.zeros(ctas, dtype=torch.int32, device="cuda")
            launch(out, spin, size, sync, pdl)
            torch.cuda.synchronize()
            wrote = bool(torch.equal(out.cpu(), torch.arange(1, ctas + 1, dtype=torch.int32)))

            def chain():
                for _ in range(args.chain):
                    launch(out, spin, size, sync, pdl)

            us = triton.testing.do_bench_cudagraph(chain, rep=100) * 1e3 / args.chain
            print(f"{ctas:4d} CTAs, spin {spin:5d} ns {name:>22}  {us:6.2f} us a launch  wrote={wrote}", flush=True)
            rows.append(dict(variant=name, ctas_a_cluster=size, sync=sync, pdl=pdl, ctas=ctas, spin_ns=spin,
                             chain=args.chain, us_a_launch=us, wrote=wrote))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
