"""Scaled matmul speed: qflash INT8 / FP8 next to torch._int_mm, torch._scaled_mm and bf16.

    qflash bench matmul --out mm.json          # 8192^3 and LLM projection shapes (GPU)
    qflash bench matmul --weights cold         # each call on another copy of B (weights from DRAM)
    qflash bench matmul --rounds 3             # the providers of a shape timed in turn three times
    qflash bench matmul --mlp                  # a quantized transformer MLP block vs bf16
    qflash bench matmul --mlp --weights cold --rounds 3   # each call on another copy of the block, in turn
    qflash bench matmul --quick                # tiny shapes (also on a CPU, in the interpreter)

TOPS/TFLOP/s count 2 * M * N * K. Each provider's output is compared with the bf16
product of the original operands (``rel_err``), so a fast but wrong result shows.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from functools import partial
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from qflash.bench.harness import (
    bench_parser,
    cold_copies,
    environment,
    finish,
    graph_ms,
    in_turn,
    measure_ceilings,
    median_speedup,
    names_from,
    positive_ints,
    require_runnable,
    rich_table,
    rotating,
    run_as_script,
    time_ms,
    weight_copies,
)

# (N, K) of the Llama-3 projections by name, the eight of both models (q/k/v fused, o, gate/up
# fused, down), which `qflash bench matmul` and the scripts under benchmarks/ time
LLAMA = {"8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (28672, 4096), "8B down": (4096, 14336),
         "70B qkv": (10240, 8192), "70B o": (8192, 8192), "70B gate_up": (57344, 8192), "70B down": (8192, 28672)}
LLM_NK = list(LLAMA.values())
LLM_M = [16, 128, 1024, 8192]


def llama_shapes(ms: Iterable[int], cube: bool = False) -> Iterator[Tuple[str, int, int, int]]:
    """(name, M, N, K) of each LLAMA shape at each M in ``ms``, after 8192^3 with ``cube``."""
    if cube:
        yield "8192^3", 8192, 8192, 8192
    for m in ms:
        for name, (n, k) in LLAMA.items():
            yield name, m, n, k


def _providers(a: torch.Tensor, b: torch.Tensor) -> Dict[str, Callable[[], torch.Tensor]]:
    """Callables computing a @ b.T by each method. Weights (B) are quantized beforehand, as
    offline; "+q" rows also quantize the activations (A) inside the timed call, as a
    quantized Linear does, the others time the matmul kernel alone on quantized inputs."""
    import qflash

    f8 = torch.float8_e4m3fn
    q = {  # method -> (A quantizer, pre-quantized A, quantized B)
        "int8 (row x col)": (lambda: qflash.quantize(a, torch.int8, "row"), qflash.quantize(b, torch.int8, "row")),
        "fp8 (tensor)": (lambda: qflash.quantize(a, f8, "tensor"), qflash.quantize(b, f8, "tensor")),
        "fp8 (row x col)": (lambda: qflash.quantize(a, f8, "row"), qflash.quantize(b, f8, "row")),
        "fp8 (block)": (lambda: qflash.quantize(a, f8, "block", FP8_BLOCKS["block"][0]),
                        qflash.quantize(b, f8, "block", FP8_BLOCKS["block"][1])),
    }
    out: Dict[str, Callable] = {"bf16 matmul": lambda: a @ b.T}
    for method, (quant_a, (b_q, b_s)) in q.items():
        mm = qflash.int8_matmul if method.startswith("int8") else qflash.fp8_matmul
        a_q, a_s = quant_a()
        out[f"qflash {method}"] = partial(mm, a_q, b_q, a_s, b_s)
        out[f"qflash {method} +q"] = partial(_quantize_then_matmul, mm, quant_a, b_q, b_s)

    from qflash.kernels.common import is_hopper

    if is_hopper(a.device):  # each kernel alone, wherever the public functions send a product
        from qflash.kernels.matmul import default_config, scaled_matmul
        from qflash.kernels.matmul_gluon import scaled_matmul_gluon

        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        for method, scales in (("int8 (row x col)", "row"), ("fp8 (tensor)", "tensor"), ("fp8 (row x col)", "row"),
                               ("fp8 (block)", "block")):
            (a_q, a_s), (b_q, b_s) = q[method][0](), q[method][1]
            a_s = a_s.reshape(-1, 1) if scales == "row" else a_s
            b_s = b_s.reshape(-1, 1) if scales == "row" else b_s
            out[f"qflash gluon {method}"] = partial(scaled_matmul_gluon, a_q, b_q, a_s, b_s, None, torch.bfloat16,
                                                    scales)
            if method.startswith("fp8"):  # INT8's public path is the tl kernel already
                out[f"qflash tl {method}"] = partial(scaled_matmul, a_q, b_q, a_s, b_s, None, torch.bfloat16,
                                                     scales, config=default_config(m, n, k, scales, False, a.device))

    a8, a8_s = q["int8 (row x col)"][0]()
    b8, b8_s = q["int8 (row x col)"][1]
    out["torch._int_mm"] = lambda: torch._int_mm(a8, b8.T)  # int32 out; scales would be a separate pass
    b8_kn = b8.T.contiguous()  # B stored (K, N) row-major, as in a plain a @ b: cuBLAS's slower INT8 layout
    out["torch._int_mm (B as K x N)"] = lambda: torch._int_mm(a8, b8_kn)
    out["torch._int_mm +scales"] = lambda: (torch._int_mm(a8, b8.T) * a8_s * b8_s.T).to(torch.bfloat16)
    for method in ("fp8 (tensor)", "fp8 (row x col)"):  # cuBLASLt, fp32 accumulation (no fast accumulate)
        a_q, a_s = q[method][0]()
        b_q, b_s = q[method][1]
        out[f"torch._scaled_mm {method[4:]}"] = cublas_fp8(a_q, b_q, a_s, b_s)
    return out


def cublas_fp8(a_q, b_q, a_s, b_s, out_dtype=torch.bfloat16, fast_accum: bool = False) -> Callable[[], torch.Tensor]:
    """cuBLAS's FP8 product (``torch._scaled_mm``; by default float32 sums between its K blocks, no
    fast accumulation) on our operands: B (N, K) as its transpose, per-tensor scales as they are,
    per-row ones as a column / a row (cuBLAS takes those with bfloat16 out only)."""
    return partial(torch._scaled_mm, a_q, b_q.T, scale_a=a_s.reshape(-1, 1) if a_s.numel() > 1 else a_s,
                   scale_b=b_s.reshape(1, -1) if b_s.numel() > 1 else b_s, out_dtype=out_dtype,
                   use_fast_accum=fast_accum)


FP8_BLOCKS = {"block": ((1, 128), (128, 128))}  # A's and B's block sizes (DeepSeek-V3's recipe)


def fp8_operands(a: torch.Tensor, b: torch.Tensor,
                 kinds: Iterable[str] = ("tensor", "row", "block")) -> Dict[str, Tuple[torch.Tensor, ...]]:
    """A (M, K) and B (N, K) quantized to e4m3 for each kind of scaling ("tensor", "row" or
    "block": 1 x 128 for A, 128 x 128 for B), each as (a_q, b_q, a_scale, b_scale): the order in
    which ``scaled_matmul``, ``fp8_matmul`` and ``cublas_fp8`` take them."""
    import qflash

    out = {}
    for kind in kinds:
        a_block, b_block = FP8_BLOCKS.get(kind, (None, None))
        a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, kind, a_block)
        b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, kind, b_block)
        out[kind] = (a_q, b_q, a_s, b_s)
    return out


def _quantize_then_matmul(mm, quant_a, b_q, b_s):
    a_q, a_s = quant_a()
    return mm(a_q, b_q, a_s, b_s)


MAX_REL_ERR = 0.1  # INT8 / FP8 quantization errors here are 0.01-0.04


def _time_row(name: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor, m: int, n: int, k: int,
              device: str, **extra) -> dict:
    try:
        out = fn()
        # int32 products are unscaled: compare them after the scales so that rel_err stays meaningful
        err = float((out.float() - ref).norm() / ref.norm()) if out.dtype != torch.int32 else None
        res = time_ms(fn, device=device)
        # Quantization costs a few percent; anything far beyond is a wrong result, whatever its speed.
        wrong = err is not None and not err < MAX_REL_ERR
        graph = graph_ms(fn) if device == "cuda" else None  # without Python's launch cost
        return dict(provider=name, m=m, n=n, k=k, ms=res["ms"], rel_err=err, ms_graph=graph,
                    tflops=_tflops(m, n, k, res["ms"]), tflops_graph=_tflops(m, n, k, graph),
                    error=f"WRONG RESULT (rel_err {err:.3g})" if wrong else None, **extra)
    except Exception as exc:  # e.g. torch._int_mm refuses a shape
        return dict(provider=name, m=m, n=n, k=k, ms=None, rel_err=None, tflops=None,
                    error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}", **extra)


def provider_names(device: str) -> List[str]:
    """The names ``run`` can time on ``device`` (they depend on the device, not on the shape)."""
    a = torch.randn(16, 128, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    return list(_providers(a, a))


def run(shapes, device: str, providers: Optional[List[str]] = None, weights: str = "warm",
        rounds: int = 1) -> List[dict]:
    """Every provider at every M x N x K. ``weights="cold"`` (CUDA) times each call on another
    copy of B (the copies' 8-bit forms four times the L2 together, ``cold_copies``), as a model's
    layers find their weights in DRAM; "warm" repeats one B, which stays in the L2 where it fits.
    ``rounds`` > 1 times the providers of a shape in turn that many times, each round starting one
    further along, as the clock and the power draw drift over a run: a row's times are the medians
    of its rounds, and it keeps them all (``rounds_ms``, ``rounds_ms_graph``) for ``ratio_rows``."""
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        b = torch.randn(n, k, device=device, dtype=a.dtype)
        ref = (a.float() @ b.float().T)
        # (the copies' 8-bit forms, 1 byte an element, four times the L2 together)
        sets = [_providers(a, b_i) for (b_i,) in weight_copies(weights == "cold", b, nbytes=b.numel())]
        names = [name for name in sets[0] if not providers or name in providers]
        fns = {name: rotating([calls[name] for calls in sets]) for name in names}
        timed: Dict[str, List[dict]] = {name: [] for name in names}
        for i in in_turn(len(names), rounds):
            timed[names[i]].append(_time_row(names[i], fns[names[i]], ref, m, n, k, device, weights=weights,
                                             copies=len(sets)))
        rows += [_median_row(timed[name]) for name in names]
        del a, b, ref, sets, fns
    return rows


def _median_row(rounds: List[dict]) -> dict:
    """One provider's row from its rounds: the first round's, with the median times (and all the
    rounds' times where there were several); a failure in any round is the row."""
    failed = [row for row in rounds if row["error"]]
    if failed or len(rounds) == 1:
        return (failed or rounds)[0]
    row = _with_medians(dict(rounds[0]), rounds)
    row["tflops"] = _tflops(row["m"], row["n"], row["k"], row["ms"])
    row["tflops_graph"] = _tflops(row["m"], row["n"], row["k"], row["ms_graph"])
    return row


def _with_medians(row: dict, rounds: List[dict]) -> dict:
    """``row`` with every round's times (``rounds_ms``, ``rounds_ms_graph``) and their medians as
    ``ms`` and ``ms_graph`` (None where a round has no time)."""
    for key in ("ms", "ms_graph"):
        times = [r[key] for r in rounds]
        row[f"rounds_{key}"] = times
        row[key] = statistics.median(times) if None not in times else None
    return row


def _tflops(m: int, n: int, k: int, ms: Optional[float]) -> Optional[float]:
    """2 M N K a time of ``ms`` milliseconds, in TFLOP/s (TOPS for INT8); None without a time."""
    return 2 * m * n * k / (ms * 1e-3) / 1e12 if ms else None


# (block_m, block_n, block_k, num_warps, num_stages, group_m, use_tma[, warp_specialize[, split_k[,
# promote_in_dot[, swap_ab]]]]) tried by --tiles on the H200;
# benchmarks/results/matmul_tiles_*.json hold the rounds, the winners are
# qflash.kernels.matmul.default_config.
MATMUL_TILE_GRID = [
    (128, 128, 128, 8, 3, 8, True), (128, 128, 128, 8, 4, 8, True), (128, 128, 128, 8, 3, 8, False),
    (128, 128, 128, 4, 4, 8, True, True), (128, 128, 128, 4, 5, 8, True, True), (256, 128, 128, 8, 3, 8, True, True),
    (128, 256, 128, 8, 4, 8, True, True), (64, 128, 128, 4, 4, 8, False), (64, 32, 128, 4, 4, 8, False),
    (64, 64, 128, 4, 4, 8, False, False, 4), (64, 128, 128, 4, 4, 8, False, False, 8), (64, 32, 128, 4, 4, 8, False, False, 4),
    # FP8 promotion through tl.dot's max_num_imprecise_acc (exact; not faster in the full benchmark)
    (128, 128, 128, 8, 4, 8, True, False, 1, True), (128, 256, 128, 8, 3, 8, True, False, 1, True),
    # M <= 64: the transposed product (B's rows on the 64-row side), split K summed in the kernel;
    # pointer loads, then tensor descriptors (made on the host)
    (16, 64, 128, 4, 6, 8, False, False, 1, False, True), (16, 64, 128, 4, 6, 8, False, False, 2, False, True),
    (16, 64, 128, 4, 6, 8, False, False, 4, False, True), (16, 64, 128, 4, 4, 8, False, False, 4, False, True),
    (16, 128, 128, 4, 4, 8, False, False, 1, False, True), (64, 64, 128, 4, 6, 8, False, False, 4, False, True),
    (16, 64, 128, 4, 6, 8, True, False, 2, False, True), (16, 64, 128, 4, 6, 8, True, False, 4, False, True),
    (16, 64, 128, 4, 4, 8, True, False, 4, False, True), (16, 128, 128, 4, 4, 8, True, False, 1, False, True),
    (16, 128, 128, 4, 4, 8, True, False, 2, False, True), (64, 64, 128, 4, 6, 8, True, False, 4, False, True),
    (64, 128, 128, 4, 4, 8, True, False, 2, False, True),
    (64, 128, 128, 4, 4, 8, False, False, 4, False, True),
    # session 16: other K splits and deeper rings for M = 16, wider B tiles and the plain product for M = 64
    (16, 64, 128, 4, 6, 8, False, False, 3, False, True), (16, 64, 128, 4, 8, 8, False, False, 4, False, True),
    (16, 64, 128, 4, 6, 8, False, False, 6, False, True), (16, 128, 128, 4, 6, 8, False, False, 4, False, True),
    (64, 128, 128, 8, 4, 8, False, False, 8, False, True), (64, 64, 128, 4, 4, 8, False, False, 8, False, False),
    (64, 64, 128, 4, 6, 8, False, False, 2, False, False), (64, 128, 128, 8, 4, 8, False, False, 4, False, False),
]
TILE_SHAPES = [(8192, 8192, 8192), (1024, 6144, 4096), (128, 28672, 4096), (16, 4096, 4096)]
# --tiles: kind -> (quantized dtype, scales, A's block, B's block)
TILE_KINDS = {"int8 row": (torch.int8, "row", None, None), "fp8 tensor": (torch.float8_e4m3fn, "tensor", None, None),
              "fp8 row": (torch.float8_e4m3fn, "row", None, None),
              "fp8 block": (torch.float8_e4m3fn, "block", (1, 128), (128, 128))}


def run_tiles(shapes, device: str, kinds: Optional[List[str]] = None) -> List[dict]:
    """Every MATMUL_TILE_GRID config on each kind of scaling, kernel only, quantized inputs, and
    ``torch._scaled_mm`` on the same FP8 operands (per tensor, per row) beside them."""
    import qflash
    from qflash.kernels.matmul import MatmulConfig, config_problem, scaled_matmul

    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        ref = a.float() @ b.float().T
        for kind, (dtype, scales, block_a, block_b) in TILE_KINDS.items():
            if kinds and kind not in kinds:
                continue
            a_q, a_s = qflash.quantize(a, dtype, scales, block_a)
            b_q, b_s = qflash.quantize(b, dtype, scales, block_b)
            if scales == "row":
                a_s, b_s = a_s.reshape(m, 1), b_s.reshape(n, 1)
            for cfg in (MatmulConfig(*t) for t in MATMUL_TILE_GRID):
                if config_problem(cfg, scales, dtype == torch.int8):  # the launcher would refuse it
                    continue
                if (cfg.swap_ab and m > 128) or (cfg.block_m > 64 and m <= 64):  # decode-sized tiles for decode-sized M
                    continue
                fn = partial(scaled_matmul, a_q, b_q, a_s, b_s, None, torch.bfloat16, scales, config=cfg)
                rows.append(_time_row(f"qflash {kind}", fn, ref, m, n, k, device, config=cfg.__dict__))
            if kind in ("fp8 tensor", "fp8 row"):
                rows.append(_time_row(f"torch._scaled_mm {kind[4:]}", cublas_fp8(a_q, b_q, a_s, b_s), ref, m, n, k,
                                      device))
        del a, b, ref
    return rows


# (name, numerator, denominator): the comparisons the targets are stated in.
RATIOS = [
    ("int8 / _int_mm", "qflash int8 (row x col)", "torch._int_mm"),
    ("int8 / _int_mm (B as K x N)", "qflash int8 (row x col)", "torch._int_mm (B as K x N)"),
    ("fp8 tensor / _scaled_mm", "qflash fp8 (tensor)", "torch._scaled_mm (tensor)"),
    ("fp8 row / _scaled_mm row", "qflash fp8 (row x col)", "torch._scaled_mm (row x col)"),
    ("fp8 block / our tensor", "qflash fp8 (block)", "qflash fp8 (tensor)"),
    ("gluon int8 / _int_mm", "qflash gluon int8 (row x col)", "torch._int_mm"),
    ("gluon fp8 tensor / _scaled_mm", "qflash gluon fp8 (tensor)", "torch._scaled_mm (tensor)"),
    ("gluon fp8 row / _scaled_mm row", "qflash gluon fp8 (row x col)", "torch._scaled_mm (row x col)"),
    ("gluon fp8 tensor / tl", "qflash gluon fp8 (tensor)", "qflash tl fp8 (tensor)"),
    ("gluon fp8 row / tl", "qflash gluon fp8 (row x col)", "qflash tl fp8 (row x col)"),
    ("gluon fp8 block / tl", "qflash gluon fp8 (block)", "qflash tl fp8 (block)"),
]


def ratio_rows(rows: List[dict], key: str = "ms") -> List[dict]:
    """Per shape, the time ratios of RATIOS (> 1: the numerator is faster), of times ``key``; where
    both rows kept their rounds' times (``run``'s ``rounds``), the median of each round's ratio."""
    ok = {(r["provider"], r["m"], r["n"], r["k"]): r for r in rows if not r["error"]}  # wrong: no ratio
    out = []
    for m, n, k in dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows):
        row = dict(m=m, n=n, k=k)
        for name, num, den in RATIOS:
            a, b = ok.get((num, m, n, k), {}), ok.get((den, m, n, k), {})
            ta, tb = a.get(f"rounds_{key}"), b.get(f"rounds_{key}")
            if ta and tb and len(ta) == len(tb) and None not in ta + tb:
                row[name] = median_speedup(ta, tb)
            else:
                row[name] = b[key] / a[key] if a.get(key) and b.get(key) else None
        out.append(row)
    return out


class _MLP(torch.nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(d, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _model_time(name: str, fn: Callable[[], torch.Tensor], device: str) -> dict:
    """One timing of a model's call: eagerly, and replayed from a CUDA graph (without Python's
    launch costs) on a GPU."""
    return dict(ms=time_ms(fn, device=device)["ms"], ms_graph=graph_ms(fn) if device == "cuda" else None)


def _model_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters and buffers (a quantized layer's weights are buffers)."""
    return sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))


def mlp_rows(ms, device: str, d: int = 4096, hidden: int = 14336, weights: str = "warm",
             rounds: int = 1) -> List[dict]:
    """A transformer MLP block (up, GELU, down) in bf16 vs quantized by qflash.nn in each of its
    modes, end to end.
    ``weights`` and ``rounds`` as in ``run``: "cold" rotates each model through copies of itself,
    its weights' bytes ``cold_copies`` times the L2 together; the models of an M are timed in
    turn ``rounds`` times, a row keeps its rounds' times and their medians, and a speedup is the
    median of the rounds' own."""
    import copy

    from qflash.nn import MODES, quantize_model
    from qflash.testing import sqnr_db

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    base = _MLP(d, hidden).to(device=device, dtype=dtype)
    models = {"bf16": base, **{mode: quantize_model(copy.deepcopy(base), mode) for mode in MODES}}
    copies = {name: [model] + [copy.deepcopy(model) for _ in range(cold_copies(_model_bytes(model)) - 1)]
              if weights == "cold" else [model] for name, model in models.items()}
    names = list(models)
    rows = []
    with torch.no_grad():
        for m in ms:
            x = torch.randn(m, d, device=device, dtype=dtype)
            ref = base(x).float()
            fns = {name: rotating([partial(model, x) for model in copies[name]]) for name in names}
            timed: Dict[str, List[dict]] = {name: [] for name in names}
            for i in in_turn(len(names), rounds):
                timed[names[i]].append(_model_time(names[i], fns[names[i]], device))
            for name in names:
                rows.append(_with_medians(dict(model=name, m=m, d=d, hidden=hidden, weights=weights,
                                               copies=len(copies[name]),
                                               sqnr_db=sqnr_db(models[name](x).float(), ref)), timed[name]))
    bf16 = {r["m"]: r for r in rows if r["model"] == "bf16"}
    for r in rows:
        r["speedup_vs_bf16"] = median_speedup(r["rounds_ms"], bf16[r["m"]]["rounds_ms"])
        if r["ms_graph"] and bf16[r["m"]]["ms_graph"]:  # without Python's launch costs (CUDA graph)
            r["speedup_graph"] = median_speedup(r["rounds_ms_graph"], bf16[r["m"]]["rounds_ms_graph"])
    return rows


def _shapes(text: str) -> List[Tuple[int, int, int]]:
    """--shapes: M,N,K triples separated by semicolons."""
    return [tuple(positive_ints(3)(shape)) for shape in text.split(";")]


def main(argv: Optional[List[str]] = None) -> int:
    parser = bench_parser("matmul", __doc__, quick="tiny shapes")
    parser.add_argument("--mlp", action="store_true", help="a quantized MLP block vs bf16, end to end")
    parser.add_argument("--tiles", action="store_true", help="search qflash tile configs instead (GPU)")
    parser.add_argument("--shapes", default=None, type=_shapes, help="M,N,K[;M,N,K...] instead of the default shapes")
    parser.add_argument("--providers", default=None,
                        help="comma-separated provider names to time (they hold spaces: quote them; default: all)")
    parser.add_argument("--weights", default="warm", choices=["warm", "cold"],
                        help="warm: one B repeated (in the L2 where it fits); cold: each call on another copy of B "
                             "(--mlp: of the block) (CUDA)")
    parser.add_argument("--rounds", default=1, type=int,
                        help="time the providers of a shape (--mlp: the blocks of an M) in turn this many times "
                             "(medians; ratios: the median of the rounds' own)")
    parser.add_argument("--kinds", default=None, type=names_from(list(TILE_KINDS)),
                        help="--tiles: comma-separated kinds (int8 row, fp8 tensor, fp8 row, fp8 block; default: all)")
    args = parser.parse_args(argv)
    cuda = require_runnable(parser)
    device = "cuda" if cuda else "cpu"
    if args.rounds < 1:
        parser.error(f"argument --rounds: takes a positive integer, got {args.rounds}")
    if args.weights == "cold" and not cuda:
        parser.error("--weights cold times weights read from a GPU's DRAM; no CUDA GPU is visible")
    if args.providers:  # their names depend on the device: parsed once it is known (--kinds by its type)
        try:
            args.providers = names_from(provider_names(device))(args.providers)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"argument --providers: {exc}")
    from rich.console import Console

    console = Console()
    result = {"env": environment()}
    if args.tiles:
        if not cuda:
            parser.error("--tiles measures a CUDA GPU; none is visible")
        result["tiles"] = run_tiles(args.shapes or TILE_SHAPES, device, args.kinds)
        console.print(rich_table(result["tiles"], ["provider", "m", "n", "k", "config", "tflops", "tflops_graph",
                                                   "rel_err", "error"],
                                 "qflash tile search, kernel only"))
    elif args.mlp:
        ms = [16, 1024, 8192] if cuda and not args.quick else [16]
        dims = {} if cuda and not args.quick else {"d": 128, "hidden": 256}
        result["mlp"] = mlp_rows(ms, device, **dims, weights=args.weights, rounds=args.rounds)
        console.print(rich_table(result["mlp"], ["model", "m", "d", "hidden", "copies", "ms", "speedup_vs_bf16",
                                                  "ms_graph", "speedup_graph", "sqnr_db"],
                                 "transformer MLP block (up d -> hidden, GELU, down), end to end; "
                                 "sqnr_db against the bf16 block"))
    else:
        if args.shapes:
            shapes = args.shapes
        elif cuda and not args.quick:
            shapes = [(8192, 8192, 8192)] + [(m, n, k) for n, k in LLM_NK for m in LLM_M]
            result["ceilings"] = measure_ceilings()
        else:
            shapes = [(33, 64, 256)]
        result["rows"] = run(shapes, device, args.providers, args.weights, args.rounds)
        result["ratios"] = ratio_rows(result["rows"])
        result["ratios_graph"] = ratio_rows(result["rows"], "ms_graph")
        console.print(rich_table(result["rows"], ["provider", "m", "n", "k", "tflops", "tflops_graph", "ms", "rel_err",
                                                  "error"], "scaled matmul, TOPS / TFLOP/s = 2MNK / time"))
        for key, title in (("ratios", "speed ratios, same run (> 1: qflash faster)"),
                           ("ratios_graph", "speed ratios replayed from CUDA graphs (kernels without launch cost)")):
            measured = [name for name, _, _ in RATIOS if any(r[name] is not None for r in result[key])]
            console.print(rich_table(result[key], ["m", "n", "k"] + measured, title))
    return finish(console, args.out, result)


if __name__ == "__main__":
    run_as_script(main)
