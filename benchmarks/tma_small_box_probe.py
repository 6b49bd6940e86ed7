"""Do small bulk tensor copies (the copy engine's TMA) of float32 values work from Gluon on this GPU?

Session 33's block-scales-by-TMA experiment stopped with an illegal instruction on the H200. This
probe copies small boxes of float32 values with 1-D descriptors (rank-1 shared layouts, as that
experiment did) and 2-D ones, swizzled or not, and of 16- and 8-bit values beside them, into a ring
of slots, each case in a subprocess of its own (an illegal instruction spoils the process's CUDA context), and compares
the values with torch's. Prints one line a case and writes them as JSON to ``--out``.

Found with it (s34a, s34b): a copy whose first element is not 16-byte aligned in global memory
(a flat coordinate of 7 float32 values, or column 3 of a 2-D box) stops the kernel with an
illegal instruction; aligned starts of 1-D and [1, N] boxes of float32 copy right.

    python3 benchmarks/tma_small_box_probe.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from qflash.kernels.gluon_common import unchecked_descriptor


CASES = [  # (dtype, box shape, swizzle bytes, read back): rank 1 where the box has one size
    ("float32", [64], 0, True), ("float32", [1, 32], 0, True), ("float32", [8, 32], 0, True),
    ("float32", [8, 32], 128, True), ("float32", [8, 8], 32, True), ("int32", [1, 32], 0, True),
    ("bfloat16", [1, 64], 0, True), ("bfloat16", [8, 64], 0, True), ("bfloat16", [8, 64], 128, True),
    ("float8_e4m3fn", [8, 128], 0, True), ("float8_e4m3fn", [8, 128], 128, True),
    ("float32", [64], 0, False), ("float32", [1, 32], 0, False), ("float32", [8, 32], 128, False),
]
SLOTS = 4


@gluon.jit
def copy_kernel(desc, Out, Coords, SLOTS: gl.constexpr, READ: gl.constexpr):
    """Copies SLOTS boxes of ``desc`` at the coordinates in ``Coords`` into a ring, then (READ) writes
    them out: without READ only the copies run, to tell their faults from the shared-memory reads'."""
    RANK: gl.constexpr = len(desc.block_type.shape)
    ring = gl.allocate_shared_memory(desc.dtype, [SLOTS] + desc.block_type.shape, desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, SLOTS * desc.block_type.nbytes)
    for s in gl.static_range(SLOTS):
        if RANK == 2:
            tma.async_copy_global_to_shared(desc, [gl.load(Coords + 2 * s), gl.load(Coords + 2 * s + 1)], bar,
                                            ring.index(s))
        else:
            tma.async_copy_global_to_shared(desc, [gl.load(Coords + 2 * s + 1)], bar, ring.index(s))
    mbarrier.wait(bar, 0)
    if not READ:
        pass
    elif RANK == 2:
        ROWS: gl.constexpr = desc.block_type.shape[0]
        COLS: gl.constexpr = desc.block_type.shape[1]
        layout2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout2))[:, None]
        cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout2))[None, :]
        for s in gl.static_range(SLOTS):
            gl.store(Out + (s * ROWS + rows) * COLS + cols, ring.index(s).load(layout2))
    else:
        BOX: gl.constexpr = desc.block_type.shape[0]
        layout1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        cols = gl.arange(0, BOX, layout=layout1)
        for s in gl.static_range(SLOTS):
            gl.store(Out + s * BOX + cols, ring.index(s).load(layout1))


def run_case(dtype_name: str, box: list, swizzle: int, read: bool) -> str:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    src = (torch.randn(1000, 256, device="cuda") * 100).to(dtype)  # a scale tensor's height
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[src.element_size()]
    out = torch.full((SLOTS, *box), 7, device="cuda", dtype=bits).view(dtype)  # poison: bits of 7
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8 * src.element_size(),
                                  rank=len(box))
    rows, cols = (box if len(box) == 2 else [1, box[0]])
    coords = [(0, 0), (5, 16), (997, 256 - cols), (500, 64)][:SLOTS]
    if len(box) == 2:
        desc = unchecked_descriptor(src, list(src.shape), list(src.stride()), box, layout)
        padded = torch.zeros(src.shape[0] + rows, src.shape[1], device="cuda", dtype=dtype)  # past the end: zeros
        padded[:src.shape[0]] = src
        want = torch.stack([padded[r:r + rows, c:c + cols] for r, c in coords])
    else:  # a flat view: the coordinate is the column of row 0
        flat = src.view(-1)
        desc = unchecked_descriptor(flat, [flat.numel()], [1], box, layout)
        want = torch.stack([flat[c:c + cols] for _, c in coords])
    coords_t = torch.tensor([x for rc in coords for x in rc], dtype=torch.int32, device="cuda")
    copy_kernel[(1,)](desc, out, coords_t, SLOTS=SLOTS, READ=read, num_warps=4)
    torch.cuda.synchronize()
    if not read:
        return "ran"
    want = want.reshape(out.shape).contiguous().view(bits)
    same = torch.equal(out.view(bits), want)
    return "same" if same else f"differ: {(out.view(bits) != want).sum().item()}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in the subprocess
    args = parser.parse_args()
    if args.case is not None:
        print(run_case(*json.loads(args.case)))
        return
    results = []
    for case in CASES:
        run = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True,
                             timeout=300, env=os.environ)
        said = run.stdout.strip().splitlines()[-1] if run.returncode == 0 else run.stderr.strip()[-600:]
        row = dict(dtype=case[0], box=case[1], swizzle=case[2], read=case[3], rc=run.returncode, result=said)
        print(row, flush=True)
        results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
