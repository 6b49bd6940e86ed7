"""Scaled matmul speed: qflash INT8 / FP8 next to torch._int_mm, torch._scaled_mm and bf16.

    qflash bench matmul --out mm.json          # 8192^3 and LLM projection shapes (GPU)
    qflash bench matmul --mlp                  # a quantized transformer MLP block vs bf16
    qflash bench matmul --quick                # tiny shapes (also on a CPU, in the interpreter)

TOPS/TFLOP/s count 2 * M * N * K. Each provider's output is compared with the bf16
product of the original operands (``rel_err``), so a fast but wrong result shows.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Optional

import torch

from qflash.bench.harness import (
    environment,
    finish,
    measure_ceilings,
    require_runnable,
    rich_table,
    run_as_script,
    time_ms,
)

# (N, K) of Llama-3 projections: 8B qkv / o / gate+up / down, then 70B o / down.
LLM_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (8192, 28672)]
LLM_M = [16, 128, 1024, 8192]


def _providers(a: torch.Tensor, b: torch.Tensor) -> Dict[str, Callable[[], torch.Tensor]]:
    """Callables computing a @ b.T by each method, quantization of B done beforehand
    (weights are quantized offline), quantization of A inside (activations are dynamic)."""
    import qflash

    out: Dict[str, Callable] = {"bf16 matmul": lambda: a @ b.T}
    b8, b8_s = qflash.quantize(b, torch.int8, "row")
    out["qflash int8 (row x col)"] = lambda: qflash.int8_matmul(*_pair(qflash.quantize(a, torch.int8, "row"), b8, b8_s))
    bf, bf_s = qflash.quantize(b, torch.float8_e4m3fn, "tensor")
    out["qflash fp8 (tensor)"] = lambda: qflash.fp8_matmul(*_pair(qflash.quantize(a, torch.float8_e4m3fn, "tensor"),
                                                                  bf, bf_s))
    br, br_s = qflash.quantize(b, torch.float8_e4m3fn, "row")
    out["qflash fp8 (row x col)"] = lambda: qflash.fp8_matmul(*_pair(qflash.quantize(a, torch.float8_e4m3fn, "row"),
                                                                     br, br_s))
    bb, bb_s = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
    out["qflash fp8 (block)"] = lambda: qflash.fp8_matmul(*_pair(qflash.quantize(a, torch.float8_e4m3fn, "block",
                                                                                 (1, 128)), bb, bb_s))

    def int_mm():  # PyTorch's INT8 path: int32 out, scales applied outside
        a_q, a_s = qflash.quantize(a, torch.int8, "row")
        return (torch._int_mm(a_q, b8.T) * a_s * b8_s.T).to(torch.bfloat16)

    def scaled_mm():  # PyTorch's FP8 path (cuBLASLt), per-tensor scales
        a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "tensor")
        return torch._scaled_mm(a_q, bf.T, scale_a=a_s, scale_b=bf_s, out_dtype=torch.bfloat16)

    out["torch._int_mm"] = int_mm
    out["torch._scaled_mm"] = scaled_mm
    return out


def _pair(quantized, b_q, b_s):
    a_q, a_s = quantized
    return a_q, b_q, a_s, b_s


def run(shapes, device: str, providers: Optional[List[str]] = None) -> List[dict]:
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        b = torch.randn(n, k, device=device, dtype=a.dtype)
        ref = (a.float() @ b.float().T)
        for name, fn in _providers(a, b).items():
            if providers and name not in providers:
                continue
            try:
                out = fn()
                err = float((out.float() - ref).norm() / ref.norm())
                res = time_ms(fn, device=device)
                rows.append(dict(provider=name, m=m, n=n, k=k, ms=res["ms"], rel_err=err,
                                 tflops=2 * m * n * k / (res["ms"] * 1e-3) / 1e12, error=None))
            except Exception as exc:  # e.g. torch._int_mm refuses a shape
                rows.append(dict(provider=name, m=m, n=n, k=k, ms=None, rel_err=None, tflops=None,
                                 error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"))
        del a, b, ref
    return rows


class _MLP(torch.nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(d, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def mlp_rows(ms, device: str, d: int = 4096, hidden: int = 14336) -> List[dict]:
    """A transformer MLP block (up, GELU, down) in bf16 vs quantized with qflash.nn, end to end."""
    import copy

    from qflash.nn import quantize_model
    from qflash.testing import sqnr_db

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    base = _MLP(d, hidden).to(device=device, dtype=dtype)
    models = {"bf16": base, "int8": quantize_model(copy.deepcopy(base), "int8"),
              "fp8": quantize_model(copy.deepcopy(base), "fp8")}
    rows = []
    with torch.no_grad():
        for m in ms:
            x = torch.randn(m, d, device=device, dtype=dtype)
            ref = base(x).float()
            for name, model in models.items():
                res = time_ms(lambda: model(x), device=device)
                rows.append(dict(model=name, m=m, d=d, hidden=hidden, ms=res["ms"],
                                 sqnr_db=sqnr_db(model(x).float(), ref)))
    bf16 = {r["m"]: r["ms"] for r in rows if r["model"] == "bf16"}
    for r in rows:
        r["speedup_vs_bf16"] = bf16[r["m"]] / r["ms"]
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="qflash bench matmul", description=__doc__.splitlines()[0])
    parser.add_argument("--mlp", action="store_true", help="a quantized MLP block vs bf16, end to end")
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--out", help="write results as JSON here")
    args = parser.parse_args(argv)
    cuda = require_runnable(parser)
    device = "cuda" if cuda else "cpu"
    from rich.console import Console

    console = Console()
    result = {"env": environment()}
    if args.mlp:
        ms = [16, 1024, 8192] if cuda and not args.quick else [16]
        dims = {} if cuda and not args.quick else {"d": 128, "hidden": 256}
        result["mlp"] = mlp_rows(ms, device, **dims)
        console.print(rich_table(result["mlp"], ["model", "m", "d", "hidden", "ms", "speedup_vs_bf16", "sqnr_db"],
                                 "transformer MLP block (up d -> hidden, GELU, down), end to end; "
                                 "sqnr_db against the bf16 block"))
    else:
        if cuda and not args.quick:
            shapes = [(8192, 8192, 8192)] + [(m, n, k) for n, k in LLM_NK for m in LLM_M]
            result["ceilings"] = measure_ceilings()
        else:
            shapes = [(33, 64, 256)]
        result["rows"] = run(shapes, device)
        console.print(rich_table(result["rows"], ["provider", "m", "n", "k", "tflops", "ms", "rel_err", "error"],
                                 "scaled matmul, TOPS / TFLOP/s = 2MNK / time"))
    return finish(console, args.out, result)


if __name__ == "__main__":
    run_as_script(main)
