"""What every benchmark shares: timing, the machine's ceilings, results files, plots.

Timing on CUDA is ``triton.testing.do_bench`` (CUDA events, median and quantiles,
L2 flushed between calls); on a CPU (Triton's interpreter) it is a wall-clock
median, useful only to exercise the benchmark code itself.
"""

from __future__ import annotations

import datetime
import itertools
import json
import platform
import statistics
import subprocess
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch


def environment() -> Dict[str, object]:
    """What a result was measured on."""
    import os

    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   cudnn=torch.backends.cudnn.version(), **gpu_limits(f"GPU-{props.uuid}"))
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env


def gpu_limits(device: str) -> Dict[str, Optional[float]]:
    """The board's power limit (W) and top SM clock (MHz) as ``nvidia-smi`` reports them for
    ``device`` (an index or ``GPU-<uuid>``); None where it cannot say. Large FP8 products run the
    H200 at its power limit, below the top clock (benchmarks/NOTES.md, twentieth round), so a
    result's speed depends on both."""
    query = ["nvidia-smi", "-i", device, "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader,nounits"]
    try:
        line = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()[0]
        power, clock = (float(field) for field in line.split(","))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"power_limit_w": None, "sm_clock_max_mhz": None}
    return {"power_limit_w": power, "sm_clock_max_mhz": clock}


def time_ms(fn: Callable[[], object], *, rep_ms: int = 100, device: str = "cuda") -> Dict[str, float]:
    """Median time of ``fn`` in ms, with the 20th and 80th percentiles."""
    if device == "cuda":
        import triton

        med, lo, hi = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return {"ms": med, "ms_p20": lo, "ms_p80": hi}
    fn()  # warm-up (first call compiles / traces)
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(samples, n=5) if len(samples) > 1 else samples * 4
    return {"ms": statistics.median(samples), "ms_p20": q[0], "ms_p80": q[-1]}


def graph_ms(fn, rep_ms: int = 100) -> Optional[float]:
    """Median time of ``fn`` replayed from a CUDA graph of about ``rep_ms`` of calls: the kernels
    without the Python launch cost, which is as long as the kernels themselves for the smaller
    shapes (None if capture fails)."""
    import triton

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    except Exception:  # noqa: BLE001 - a capture failure only drops this column
        return None


# Sets of weights a "cold" timing rotates through: together at least this many times the L2, so
# that each call finds its weights in DRAM, as a model's layers do (each layer has its own)
COLD_L2_MULTIPLE = 4


def cold_copies(nbytes: int) -> int:
    """How many sets of ``nbytes`` of weights a cold timing rotates through (``COLD_L2_MULTIPLE``
    times the current device's L2 together; 1 where one set alone is that large)."""
    l2 = torch.cuda.get_device_properties().L2_cache_size
    return max(1, -(-COLD_L2_MULTIPLE * l2 // max(1, nbytes)))


def weight_copies(cold: bool, *weights: torch.Tensor, nbytes: Optional[int] = None) -> List[tuple]:
    """``[weights]``, and where ``cold`` that many copies of them as ``cold_copies`` asks for
    ``nbytes`` (by default the weights' own bytes) a set; the first set is the tensors themselves."""
    copies = cold_copies(sum(w.nbytes for w in weights) if nbytes is None else nbytes) if cold else 1
    return [weights] + [tuple(w.clone() for w in weights) for _ in range(copies - 1)]


def rotating(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs ``calls`` in turn, one a call (the call itself where there is one).
    Timed by ``graph_ms``, the graph captures them in turn, so its replays time each on inputs the
    previous calls did not touch. Repeated runs over one buffer measure the cache where the inputs
    fit in it (a decode product's weights: 8B o's FP8 B is 16.8 MB, the H200's L2 50 MB)."""
    if len(calls) == 1:
        return calls[0]
    it = itertools.cycle(calls)
    return lambda: next(it)()


def in_turn(count: int, rounds: int) -> List[int]:
    """The order of ``rounds`` timings of ``count`` contenders in turn, each round starting one
    further along: clocks and power draw drift between two timings of one product by several per
    cent, and a place in the order can weigh as much (benchmarks/NOTES.md, round 54)."""
    return [(r + j) % count for r in range(rounds) for j in range(count)]


def median_speedup(ours: Sequence[float], peer: Sequence[float]) -> float:
    """Of two contenders timed in the same rounds (``in_turn``), the median of each round's own
    ratio peer / ours (> 1: ours faster), which the drift between rounds does not move."""
    return statistics.median(p / o for o, p in zip(ours, peer))


def compiled_flex_attention():
    """``torch.compile(flex_attention)``, compiled afresh for each shape a benchmark builds. Dynamo
    keeps a few compiled versions of one function (its cache size limit); past them it runs
    flex_attention eagerly, whose math path materializes the scores: a run over many shapes then
    timed that path from its eighth build on (78-289 ms where the compiled kernel takes 1-5 ms) or
    ran out of memory (attention_sinks_prefill_h200_2026-12-03_s52a.json)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention)


def kernel_events(fn: Callable[[], object], calls: int, warmup: int = 1):
    """The torch profiler's averages over ``calls`` calls of ``fn`` (after ``warmup`` calls), CUDA
    activity only: one entry a kernel name, its ``count`` and ``device_time_total`` over all calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written, in TB/s."""
    import triton

    src = torch.randn(2**28, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


def measure_ceilings() -> Dict[str, Optional[float]]:
    """The machine's own limits, measured in the same run as the benchmark (CUDA only).

    copy_TBps: device-to-device copy, bytes read + written; bf16_mm_TFLOPs: 8192^3
    torch.matmul on random data; fp8_mm_TFLOPs: the same through torch._scaled_mm (e4m3).
    """
    import triton

    out: Dict[str, Optional[float]] = {"copy_TBps": copy_bandwidth()}
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    out["bf16_mm_TFLOPs"] = 2 * n**3 / (ms * 1e-3) / 1e12
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t()  # _scaled_mm wants B column-major
        one = torch.ones((), device="cuda")
        ms = triton.testing.do_bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16), return_mode="median")
        out["fp8_mm_TFLOPs"] = 2 * n**3 / (ms * 1e-3) / 1e12
    except Exception:  # older GPUs have no FP8 tensor cores
        out["fp8_mm_TFLOPs"] = None
    return out


def bench_parser(op: str, doc: str, quick: str, out: str = "write results as JSON here"):
    """``qflash bench <op>``'s parser with the options every benchmark has: --quick and --out."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"qflash bench {op}", description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", help=out)
    return parser


def positive_ints(count: Optional[int] = None) -> Callable[[str], List[int]]:
    """An argparse ``type``: comma-separated positive integers (``count`` of them, if set), else
    the parser's error, which names the option."""
    import argparse

    def parse(text: str) -> List[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not values or any(v < 1 for v in values) or (count is not None and len(values) != count):
            raise argparse.ArgumentTypeError(f"takes {f'{count} ' if count else ''}comma-separated positive "
                                             f"integers, got {text!r}")
        return values

    return parse


def names_from(choices: Sequence[str]) -> Callable[[str], List[str]]:
    """An argparse ``type``: comma-separated names, each one of ``choices``, else the parser's
    error, which names the option and lists them (an unknown name would otherwise select nothing)."""
    import argparse

    def parse(text: str) -> List[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"unknown name(s) {unknown or [text]}; choose from {', '.join(choices)}")
        return names

    return parse


def require_runnable(parser) -> bool:
    """True on CUDA; on a CPU only through ``qflash bench`` (which turns the interpreter on)."""
    import os

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("no CUDA device is visible: run through `qflash bench`, which uses Triton's interpreter")
    return cuda


def finish(console, path: Optional[str], result: dict, plots: Callable[[], List[str]] = lambda: []) -> int:
    """Write the results (and any plots) where asked, say so, and return the exit code."""
    if path:
        save_json(path, result)
        console.print("wrote " + ", ".join([path] + plots()))
    return 0


def run_as_script(main: Callable[[], int]) -> None:
    """``python -m qflash.bench.X``: without a GPU, switch the interpreter on before triton loads."""
    import os
    import sys

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())


def save_json(path: str, result: dict) -> None:
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if x != x:
            return "nan"
        return f"{x:.2e}" if abs(x) < 1e-2 and x != 0 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3f}"
    return str(x)


def rich_table(rows: List[dict], columns: Sequence[str], title: str):
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        numeric = any(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) for r in rows)
        table.add_column(c, justify="right" if numeric else "left")
    for r in rows:
        table.add_row(*[fmt(r.get(c)) for c in columns])
    return table


def plot_lines(rows: List[dict], *, panels: Sequence[tuple], panel_key: Callable[[dict], tuple], x: str, y: str,
               series: str, title: str, path: str, xlabel: str, ylabel: str, logx: bool = True) -> str:
    """One subplot per panel, one line per series (e.g. per provider)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        sel = [r for r in rows if panel_key(r) == panel and r.get(y) is not None]
        for name in dict.fromkeys(r[series] for r in sel):
            pts = sorted((r[x], r[y]) for r in sel if r[series] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                    linewidth=2.5 if name == "qflash" else 1.2)
        ax.set_title(", ".join(str(p) for p in panel))
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_roofline(points: List[dict], ceilings: Dict[str, Optional[float]], *, path: str, title: str) -> str:
    """Achieved TFLOP/s against arithmetic intensity, under the measured ceilings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 5))
    intensity = np.logspace(0, 4, 200)
    bw = ceilings.get("copy_TBps")
    for key, style in (("bf16_mm_TFLOPs", "-"), ("fp8_mm_TFLOPs", "--")):
        peak = ceilings.get(key)
        if bw and peak:
            ax.plot(intensity, np.minimum(bw * intensity, peak), "k" + style, linewidth=1,
                    label=f"{key.split('_')[0]} ceiling: {peak:.0f} TFLOP/s, {bw:.2f} TB/s")
    for name in dict.fromkeys(p["provider"] for p in points):
        sel = [p for p in points if p["provider"] == name and p.get("tflops")]
        ax.scatter([p["intensity"] for p in sel], [p["tflops"] for p in sel], s=14, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of q, k, v, out)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
