"""The ``qflash`` command: ``info``, ``demo``, ``bench``.

Without a CUDA device the kernels run in Triton's interpreter; that switch must
be thrown before triton is imported, so it happens here, first.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def _use_interpreter_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _fast_path_status(cuda: bool) -> str:
    """Whether the public functions can take the Gluon kernels here (and for what)."""
    import torch

    from qflash.kernels.common import gluon_enabled, is_hopper

    if not gluon_enabled():
        return "off (QFLASH_GLUON=0)"
    if not cuda or not is_hopper(torch.device("cuda", 0)):
        return "none here (the Gluon kernels need Hopper)"
    from qflash.kernels.matmul_gluon import MIN_NK

    return ("Gluon forward: D = 64 / 128 / 256, causal or no mask, lengths multiple of 128; "
            f"Gluon FP8 matmul: tensor / row / block scales, M > 32 with N, K >= {MIN_NK}, and M <= 32 "
            "with N, K >= 4096 where its transposed product fills the SMs")


def _transformers_status() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return (f"transformers {version('transformers')}: qflash.integrations.transformers.register() adds "
                "attn_implementation='qf_attention'")
    except PackageNotFoundError:
        return "transformers not installed (pip install 'qflash[integrations]')"


def cmd_info(args) -> int:
    import platform

    import torch

    _use_interpreter_without_gpu()
    import triton
    from rich.console import Console
    from rich.table import Table

    from qflash import __version__

    cuda = torch.cuda.is_available()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    t = Table(title=f"qflash {__version__}", show_header=False)
    t.add_row("python", platform.python_version())
    t.add_row("torch", torch.__version__)
    t.add_row("triton", triton.__version__)
    t.add_row("CUDA (torch build)", str(torch.version.cuda))
    if cuda:
        props = torch.cuda.get_device_properties(0)
        cap = torch.cuda.get_device_capability(0)
        t.add_row("GPU", f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
        t.add_row("compute capability", f"{cap[0]}.{cap[1]}" + (" (Hopper: tensor descriptors on)" if cap[0] >= 9 else ""))
    else:
        t.add_row("GPU", "none visible")
    t.add_row("Triton interpreter", "on (kernels run on the CPU, slowly)" if interp else "off")
    where = "CUDA" if cuda else ("interpreter" if interp else "unavailable here")
    for op in ("flash_attn_func", "flash_attn_varlen_func", "sdpa"):
        t.add_row(f"kernel: {op}", f"forward + backward on {where}")
    for op in ("quantize", "int8_matmul", "fp8_matmul"):
        t.add_row(f"kernel: {op}", f"on {where}")
    t.add_row("Hopper fast paths (Gluon)", _fast_path_status(cuda and not interp))
    t.add_row("Hugging Face transformers", _transformers_status())
    Console().print(t)
    return 0


def _naive_attention(q, k, v, record: list):
    """Causal attention in three steps, as a framework would run it; records each N x N tensor."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    s = (qt @ kt.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, N, N] scores
    n = s.shape[-1]
    s = s.masked_fill(torch_triu_mask(n, s.device), float("-inf"))
    p = torch_softmax(s)  # [B, H, N, N] probabilities
    record += [s, p]
    return (p @ vt).transpose(1, 2)


def torch_triu_mask(n, device):
    import torch

    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def torch_softmax(s):
    import torch

    return torch.softmax(s, dim=-1)


def cmd_demo(args) -> int:
    """Naive attention vs qflash on the same inputs: error against fp64, memory, speed, a plot."""
    import torch

    _use_interpreter_without_gpu()
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if args.explain:
        return _explain(console)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.float16
    heads, d = DEMO_HEADS_DIM[cuda]
    default = [1024, 2048, 4096, 8192, 16384] if cuda else [128, 256, 512]
    seqlens = args.seqlens or default
    console.print(f"[bold]qflash demo[/bold] on {torch.cuda.get_device_name() if cuda else 'the CPU (Triton interpreter)'}: "
                  f"batch 1, {heads} heads, head dim {d}, float16, causal. Both sides get the same inputs.")
    how = "allocator peak" if cuda else "bytes of the tensors each creates"
    t = Table(title=f"error against a float64 reference, and memory ({how})")
    cols = ["N", "naive err", "qflash err", "naive memory", "qflash memory"]
    cols += ["naive TFLOP/s", "qflash TFLOP/s"] if cuda else []
    for c in cols:
        t.add_column(c, justify="right")
    points = []
    for n in seqlens:
        row = _demo_point(n, heads, d, dtype, device)
        points.append(row)
        if row["naive_err"] is None:  # naive attention's N x N tensors do not fit here
            naive_cells = ["-", f"needs ~{_mb(row['naive_mem'])}, more than is free"] + (["-"] if cuda else [])
        else:
            naive_cells = [f"{row['naive_err']:.2e}", _mb(row["naive_mem"])]
            naive_cells += [f"{row['naive_tflops']:.0f}"] if cuda else []
        cells = [str(n), naive_cells[0], f"{row['flash_err']:.2e}", naive_cells[1], _mb(row["flash_mem"])]
        if cuda:
            cells += [naive_cells[2], f"{row['flash_tflops']:.0f}"]
        t.add_row(*cells)
    console.print(t)

    e = Table(title="the same arithmetic at long context (16 heads, fp16, one layer, one sequence)")
    for c in ("context", "naive: scores + probabilities, N x N", "FlashAttention: output + lse, O(N)"):
        e.add_column(c, justify="right")
    for n in (4096, 32768, 131072):
        e.add_row(f"{n // 1024}k", _mb(2 * 16 * n * n * 2), _mb(16 * n * 128 * 2 + 16 * n * 4))
    console.print(e)
    if args.plot:
        console.print(f"wrote {_demo_plot(points, heads, d, cuda, args.plot)}")
    return 0


DEMO_HEADS_DIM = {True: (16, 128), False: (2, 64)}  # on a GPU or not: heads, head dim
# naive attention holds up to three N x N tensors a head at once (scores, scaled or masked scores,
# probabilities); the estimate of what it needs, against the free memory
NAIVE_SQUARES = 3


def _demo_point(n: int, heads: int, d: int, dtype, device: str) -> dict:
    """One row of the demo: both sides' error against float64, memory and (on a GPU) speed. Naive
    attention runs only where its N x N tensors fit in the free memory (it is left out, with the
    bytes it would need, where they do not); qflash runs at any N."""
    import torch

    import qflash
    from qflash.testing import max_abs_err

    cuda = device == "cuda"
    g = torch.Generator(device=device).manual_seed(n)
    q, k, v = (torch.randn(1, n, heads, d, device=device, generator=g).to(dtype) for _ in range(3))
    ref = _reference(q, k, v)
    naive_bytes = NAIVE_SQUARES * heads * n * n * q.element_size()
    free = _free_bytes(device)
    naive_fits = free is None or naive_bytes < 0.9 * free
    row = dict(n=n, naive_err=None, naive_mem=naive_bytes, naive_tflops=None)
    flash = lambda: qflash.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    flops = 4 * heads * n * n * d / 2  # causal
    if cuda:
        row["flash_mem"], row["flash_tflops"] = _peak_and_tflops(flash, flops)
    if naive_fits:
        try:
            if cuda:
                row["naive_mem"], row["naive_tflops"] = _peak_and_tflops(lambda: _naive_attention(q, k, v, []), flops)
            record: list = []
            naive = _naive_attention(q, k, v, record)
            if not cuda:
                row["naive_mem"] = sum(x.numel() * x.element_size() for x in record)
            del record
            row["naive_err"] = max_abs_err(naive, ref)
            del naive
        except torch.OutOfMemoryError:  # the estimate fell short (fragmentation): as if it did not fit
            row.update(naive_mem=naive_bytes, naive_tflops=None)
            torch.cuda.empty_cache()
    out = flash()
    if not cuda:
        row["flash_mem"] = out.numel() * out.element_size() + heads * n * 4  # output + lse, all it allocates
    row["flash_err"] = max_abs_err(out, ref)
    return row


def _free_bytes(device: str):
    """Free memory on ``device`` in bytes, or None where this platform does not say."""
    import torch

    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not Linux
        return None


def _reference(q, k, v, budget: int = 2**30):
    """Causal attention in float64, a block of query rows at a time so that it fits at any N: rows
    i0..i1 see keys 0..i1 (bottom-right alignment puts row i0 + t on key i0 + t), the same numbers
    as in one piece."""
    import torch

    from qflash.reference import attention_ref

    n, heads = q.shape[1], q.shape[2]
    rows = max(1, budget // (4 * heads * n * 8))  # scores, probabilities and their temporaries in float64
    return torch.cat([attention_ref(q[:, i:i + rows].double(), k[:, :i + rows].double(), v[:, :i + rows].double(),
                                    causal=True)[0] for i in range(0, n, rows)], dim=1)


def _peak_and_tflops(fn, flops: float):
    """On a GPU: the allocator's peak over what was allocated before ``fn`` ran, and its TFLOP/s."""
    import torch
    import triton

    fn()  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak, flops / triton.testing.do_bench(fn) / 1e9


def _demo_plot(points, heads, d, cuda, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2 if cuda else 1, figsize=(11 if cuda else 6, 4), squeeze=False)
    ax = axes[0, 0]
    ns = np.array([p["n"] for p in points])
    ran = [p for p in points if p["naive_err"] is not None]  # where naive attention fitted
    ax.plot([p["n"] for p in ran], [p["naive_mem"] / 2**20 for p in ran], "o", color="C1", label="naive, measured")
    ax.plot(ns, [p["flash_mem"] / 2**20 for p in points], "o", color="C0", label="qflash, measured")
    grid = np.logspace(np.log2(ns.min()), 17, 50, base=2)
    ax.plot(grid, 2 * heads * grid**2 * 2 / 2**20, "--", color="C1", label="naive: 2 x H x N^2 x 2 bytes")
    ax.plot(grid, (heads * grid * d * 2 + heads * grid * 4) / 2**20, "--", color="C0", label="flash: output + lse")
    ax.axhline(141e9 / 2**20, color="gray", linewidth=0.8)
    ax.text(grid[0], 141e9 / 2**20 * 1.3, "H200 memory (141 GB)", fontsize=7, color="gray")
    ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="MiB",
           title=f"extra memory, {heads} heads, D={d}, fp16")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    if cuda:
        ax = axes[0, 1]
        ax.plot([p["n"] for p in ran], [p["naive_tflops"] for p in ran], "o-", color="C1", label="naive (PyTorch ops)")
        ax.plot(ns, [p["flash_tflops"] for p in points], "o-", color="C0", label="qflash")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="sequence length N", ylabel="TFLOP/s (causal, 2 x H x N^2 x D)", title="speed")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _explain(console) -> int:
    """The online-softmax recurrence on a tiny example, block by block."""
    import torch
    from rich.table import Table

    from qflash.reference import attention_ref, online_softmax_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 4, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, 8, 1, 4, generator=g, dtype=torch.float64) * 2
    v = torch.randn(1, 8, 1, 4, generator=g, dtype=torch.float64)
    # Visit blocks from the smallest best score of row 0 upwards, so its running max keeps moving.
    block_max = (q[0, :, 0] @ k[0, :, 0].T)[0].view(4, 2).amax(dim=1)
    order = block_max.argsort().tolist()
    console.print("[bold]The online softmax[/bold]: 2 query rows, 8 keys in blocks of 2, taken in the order "
                  f"{', '.join(map(str, order))} (any order gives the same result; this one makes row 0's max move).\n"
                  "Per block: m_new = max(m, rowmax(s)); alpha = exp(m - m_new) rescales what is held; "
                  "l = alpha * l + rowsum(exp(s - m_new)); acc = alpha * acc + exp(s - m_new) @ v.")
    t = Table(title="state after each block (row 0 | row 1)")
    for c in ("step", "keys", "m", "alpha (rescale)", "l"):
        t.add_column(c, justify="right")

    def show(st):
        m, a, l = (st[x][0, 0, :, 0].tolist() for x in ("m", "alpha", "l"))
        t.add_row(str(st["step"]), f"{st['keys'][0]}-{st['keys'][1] - 1}", " | ".join(f"{x:7.3f}" for x in m),
                  " | ".join(f"{x:7.4f}" for x in a), " | ".join(f"{x:7.3f}" for x in l))

    out, lse = online_softmax_attention(q, k, v, block_n=2, order=order, on_block=show)
    ref, ref_lse = attention_ref(q, k, v)
    console.print(t)
    console.print(f"one division at the end: out = acc / l. Largest difference from softmax(q k^T) v computed "
                  f"in one piece: {float((out - ref).abs().max()):.1e} (output), "
                  f"{float((lse - ref_lse).abs().max()):.1e} (log-sum-exp): float64 rounding.")
    return 0


def _mb(nbytes: float) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:,.1f} GiB"
    return f"{nbytes / 2**20:,.2f} MiB"


def cmd_bench(args) -> int:
    _use_interpreter_without_gpu()
    if args.op in ("attention", "attention-backward"):
        from qflash.bench.attention import main as bench_main

        return bench_main(args.rest + (["--backward"] if args.op == "attention-backward" else []))
    if args.op == "quantize":
        from qflash.bench.quantize import main as bench_main

        return bench_main(args.rest)
    if args.op == "matmul":
        from qflash.bench.matmul import main as bench_main

        return bench_main(args.rest)
    raise SystemExit(f"qflash bench: unknown op {args.op!r}; available: attention, attention-backward, "
                     "matmul, quantize")


def cmd_check(args) -> int:
    _use_interpreter_without_gpu()
    from rich.console import Console

    from qflash.bench.harness import rich_table
    from qflash.check import run_check

    console = Console()
    rows = run_check(quick=args.quick)
    for r in rows:
        r["result"] = "pass" if r["ok"] else "FAIL"
    console.print(rich_table(rows, ["op", "case", "kernel_err", "torch_err", "bound", "result", "error"],
                             "qflash check: kernel error against an fp64 reference; bound = 2 x PyTorch's error "
                             "+ rounding floor (attention), 0 (bit-exact) or Hopper's FP8 sum precision (fp8 matmul)"))
    failed = sum(not r["ok"] for r in rows)
    console.print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    from qflash.bench.harness import positive_ints

    parser = argparse.ArgumentParser(prog="qflash", description="Exact FlashAttention and quantized kernels in Triton.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, GPU, interpreter, available kernels")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("demo", help="naive attention vs qflash: exactness, memory, speed")
    p.add_argument("--seqlens", type=positive_ints(), help="comma-separated sequence lengths")
    p.add_argument("--plot", default="qflash_demo.png", help="PNG to write (memory vs N; on a GPU also speed)")
    p.add_argument("--explain", action="store_true", help="walk through the online softmax on a tiny example")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("check", help="every kernel against its reference on this device")
    p.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("bench", help="benchmark an op against its peers (GPU)")
    p.add_argument("op", help="attention | attention-backward | matmul | quantize")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (--help lists them)")
    p.set_defaults(fn=cmd_bench)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
