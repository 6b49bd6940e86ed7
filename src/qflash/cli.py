"""The ``qflash`` command: ``info``, ``demo``, ``bench``.

Without a CUDA device the kernels run in Triton's interpreter; that switch must
be thrown before triton is imported, so it happens here, first.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional


def _use_interpreter_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


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
        t.add_row(f"kernel: {op}", f"forward on {where}")
    Console().print(t)
    return 0


def cmd_demo(args) -> int:
    """Naive attention vs qflash on the same inputs: error against fp64 and memory."""
    import torch

    _use_interpreter_without_gpu()
    from rich.console import Console
    from rich.table import Table

    import qflash
    from qflash.reference import attention_ref
    from qflash.testing import max_abs_err

    console = Console()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.float16
    heads, d = (16, 128) if cuda else (2, 64)
    seqlens = [int(s) for s in args.seqlens.split(",")] if args.seqlens else ([1024, 4096] if cuda else [128, 256])
    console.print(f"[bold]qflash demo[/bold] on {'the GPU' if cuda else 'the CPU (Triton interpreter)'}: "
                  f"batch 1, {heads} heads, head dim {d}, {str(dtype)[6:]}, causal")

    t = Table(title="error against a float64 reference (max |out - ref|)")
    for c in ("N", "naive (PyTorch, fp16)", "qflash", "naive N x N intermediates", "qflash extra memory"):
        t.add_column(c)
    for n in seqlens:
        g = torch.Generator(device=device).manual_seed(n)
        q, k, v = (torch.randn(1, n, heads, d, device=device, generator=g).to(dtype) for _ in range(3))
        ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=True)
        naive, _ = attention_ref(q, k, v, causal=True, upcast=False)
        out = qflash.flash_attn_func(q, k, v, causal=True)
        # Naive attention materializes scores and probabilities: two (heads, N, N) tensors.
        naive_bytes = 2 * heads * n * n * dtype.itemsize
        flash_bytes = heads * n * d * dtype.itemsize + heads * n * 4  # output + lse
        t.add_row(str(n), f"{max_abs_err(naive, ref):.2e}", f"{max_abs_err(out, ref):.2e}",
                  _mb(naive_bytes), _mb(flash_bytes))
    console.print(t)

    e = Table(title="the same arithmetic at long context (16 heads, fp16, per layer and batch element)")
    for c in ("context", "naive N x N intermediates", "FlashAttention output + lse"):
        e.add_column(c)
    for n in (4096, 32768, 131072):
        e.add_row(f"{n // 1024}k", _mb(2 * 16 * n * n * 2), _mb(16 * n * 128 * 2 + 16 * n * 4))
    console.print(e)
    return 0


def _mb(nbytes: float) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:,.1f} GiB"
    return f"{nbytes / 2**20:,.2f} MiB"


def cmd_bench(args) -> int:
    if args.op == "attention":
        from qflash.bench.attention import main as bench_main

        return bench_main(args.rest)
    raise SystemExit(f"qflash bench: unknown op {args.op!r}; available: attention")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qflash", description="Exact FlashAttention and quantized kernels in Triton.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, GPU, interpreter, available kernels")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("demo", help="naive attention vs qflash: exactness and memory")
    p.add_argument("--seqlens", help="comma-separated sequence lengths")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help="benchmark an op against its peers (GPU)")
    p.add_argument("op", help="attention")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (--help lists them)")
    p.set_defaults(fn=cmd_bench)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
