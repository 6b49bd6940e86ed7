"""The Gluon dynamic per-tensor quantize (``kernels/quantize_gluon.py``: the input held in shared
memory between the phases) against ``quantize``'s own paths: first the same bits as the sweep at
ragged shapes, every input dtype and output format, the absmax planted first, last, in the middle
or as a NaN, and from a replayed CUDA graph; then times from graphs, in turn, three each, beside
a static scale and a same-size copy. Session 30's experiment (s30a, s30b); not kept.

    OUT=out python3 benchmarks/quantize_per_tensor_gluon.py   (writes $OUT/quantize_per_tensor_gluon_probe.json)"""
import os
import torch
from qflash.bench.harness import environment, graph_ms, measure_ceilings, save_json
from qflash.kernels import quantize_gluon as qg
from qflash.kernels.quantize import quantize as launch
from qflash.reference.quantize import QMAX
from qflash.testing import same_bits

OUT = os.environ.get("OUT", ".")
torch.manual_seed(0)

def gluon(x, qdtype, **kw):
    x_q = torch.full(x.shape, 77, dtype=torch.int8, device=x.device).view(qdtype) if qdtype != torch.int8 else torch.full(x.shape, 77, dtype=torch.int8, device=x.device)
    scale = torch.full((), float("nan"), device=x.device)
    qg.launch(x, x_q, scale, **kw)
    return x_q, scale

fails = 0
checks = 0
for (m, n) in [(1, 256), (63, 512), (113, 2304), (239, 1024), (1023, 768), (1024, 4096), (3072, 4096), (4096, 4096),
               (8192, 4096), (1024, 14336), (2048, 8192), (8192, 8192)]:
    for xd in (torch.bfloat16, torch.float32, torch.float16):
        if xd != torch.bfloat16 and m * n > 2**25:
            continue
        for qd in (torch.float8_e4m3fn, torch.int8, torch.float8_e5m2):
            for where in ("first", "last", "mid", "rand", "nan"):
                if where != "rand" and (qd != torch.float8_e4m3fn or xd == torch.float16):
                    continue
                x = torch.randn(m, n, device="cuda", dtype=xd)
                i = {"first": 0, "last": m * n - 1, "mid": (m * n) // 2 + 7, "rand": None, "nan": (m * n) * 3 // 4}[where]
                if i is not None:
                    x.view(-1)[i] = float("nan") if where == "nan" else -1000.0
                x0 = x.clone()
                want = launch(x, qd, "tensor", one_launch=False)
                for kw in (dict(self_reset=True, warps=16), dict(slots=7, slot_bytes=32768, self_reset=True, warps=8), dict(slots=2, self_reset=True, warps=16), dict(slots=2, self_reset=True, warps=4)):
                    got = gluon(x, qd, **kw)
                    ok = same_bits(got[0], want[0]) and (same_bits(got[1], want[1]) or bool(got[1].isnan() & want[1].isnan())) and same_bits(x.view(torch.int16 if x.element_size() == 2 else torch.int32), x0.view(torch.int16 if x.element_size() == 2 else torch.int32))
                    checks += 1
                    if not ok:
                        fails += 1
                        print("FAIL", m, n, xd, qd, where, kw, got[1].item(), want[1].item(), flush=True)
print(f"checks {checks} fails {fails}", flush=True)
print("scratch after", {k: v[:2].tolist() for k, v in qg._SCRATCH.items()}, flush=True)

# graphs: capture + replay on new values
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
x_q = torch.empty(x.shape, dtype=torch.int8, device="cuda"); sc = torch.empty((), device="cuda")
qg.launch(x, x_q, sc, self_reset=True)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    qg.launch(x, x_q, sc, self_reset=True)
for t in range(3):
    x.copy_(torch.randn_like(x) * (t + 1))
    g.replay(); torch.cuda.synchronize()
    want = launch(x, torch.int8, "tensor", one_launch=False)
    print("graph replay same bits", same_bits(x_q, want[0]) and same_bits(sc, want[1]), flush=True)

SHAPES = [(512, 4096), (2048, 4096), (3072, 4096), (1024, 14336), (3584, 4096), (4096, 4096),
          (5120, 4096), (8192, 4096)]
variants = {"g 7x32K w8": dict(slots=7, slot_bytes=32768, warps=8),
            "g 7x32K w8 sr": dict(slots=7, slot_bytes=32768, warps=8, self_reset=True),
            "g 7x32K w16 sr": dict(slots=7, slot_bytes=32768, warps=16, self_reset=True),
            "g 14x16K w16 sr": dict(warps=16, self_reset=True),
            "g 14x16K w8 sr": dict(warps=8, self_reset=True)}
ceilings = measure_ceilings()
rows = []
for m, k in SHAPES:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    for qdtype in (torch.float8_e4m3fn, torch.int8):
        static = x.abs().amax().float() / QMAX[qdtype]
        x_q = torch.empty(x.shape, dtype=qdtype, device="cuda"); sc = torch.empty((), device="cuda")
        fns = {name: (lambda kw=kw: qg.launch(x, x_q, sc, **kw)) for name, kw in variants.items()}
        fns["default"] = lambda: launch(x, qdtype, "tensor")
        fns["static scale"] = lambda: launch(x, qdtype, "tensor", static_scale=static.reshape(1))
        fns["copy"] = lambda: dst.copy_(x)
        times = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                times[name].append(graph_ms(fn))
        copy_ms = min(times.pop("copy"))
        copy_tbps = 2 * x.numel() * 2 / (copy_ms * 1e-3) / 1e12
        for name, ms in times.items():
            best = min(ms)
            tbps = x.numel() * 3 / (best * 1e-3) / 1e12
            rows.append(dict(shape=f"{m}x{k}", mbytes=x.numel() * 2 / 2**20, qdtype=str(qdtype).split(".")[-1],
                             variant=name, ms=ms, tbps=tbps, x_same_size_copy=tbps / copy_tbps,
                             x_copy_1gib=tbps / ceilings["copy_TBps"], copy_ms=copy_ms))
            print(f"{m}x{k} {rows[-1]['qdtype']:14s} {name:18s} {best * 1e3:8.1f} us  x copy "
                  f"{rows[-1]['x_same_size_copy']:.3f} / {rows[-1]['x_copy_1gib']:.3f}", flush=True)
save_json(os.path.join(OUT, "quantize_per_tensor_gluon_probe.json"), dict(env=environment(), ceilings=ceilings, rows=rows,
          checks=checks, fails=fails))
