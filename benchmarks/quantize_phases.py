"""Where the time of a dynamic per-tensor quantize goes (s30c): ``_tensor_kernel``'s two phases
launched apart (the absmax alone, the quantize alone), both in one launch, cooperative or plain,
the counters' zeroing, beside the default path, the sweep and a static scale; float8 from
M x 4096 bfloat16, times from CUDA graphs, best of three in turn.

    OUT=out python3 benchmarks/quantize_phases.py   (writes $OUT/quantize_one_launch_fixed_costs.json)"""
import os
import torch
from qflash.bench.harness import environment, graph_ms, save_json
from qflash.kernels import quantize_gluon as qg
from qflash.kernels.quantize import (TENSOR_BLOCK, TENSOR_HOLD_BYTES, TENSOR_WARPS, _TL_DTYPES, _tensor_launcher,
                                     _tensor_plan, quantize as launch)
from qflash.reference.quantize import QMAX

OUT = os.environ.get("OUT", ".")
rows = []
for m, n in [(16, 4096), (128, 4096), (512, 4096), (2048, 4096), (3072, 4096), (4096, 4096)]:
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    qd = torch.float8_e4m3fn
    x_q = torch.empty(x.shape, dtype=qd, device="cuda"); sc = torch.empty((), device="cuda")
    plan = _tensor_plan(m * n, 2, 132, TENSOR_HOLD_BYTES, TENSOR_BLOCK)
    zeroed = torch.zeros(2, dtype=torch.int32, device="cuda")
    zeroed[0] = torch.tensor(4.0).view(torch.int32)
    args = (x, x_q, sc, zeroed.view(torch.float32), zeroed[1:], m * n)
    common = dict(QMAX=QMAX[qd], OUT=_TL_DTYPES[qd], EMULATE_CASTS=False, num_warps=TENSOR_WARPS,
                  **(plan.constexprs if plan else {}))
    static = x.abs().amax().float().reshape(1) / 448
    fns = {
        "default": lambda: launch(x, qd, "tensor"),
        "sweep": lambda: launch(x, qd, "tensor", one_launch=False),
        "static": lambda: launch(x, qd, "tensor", static_scale=static),
        "zeros(2)": lambda: torch.zeros(2, dtype=torch.int32, device="cuda"),
        "tl both, coop": lambda: (zeroed[1:].zero_(), _tensor_launcher[plan.grid](*args, FIND_ABSMAX=True, QUANTIZE=True, launch_cooperative_grid=True, **common)),
        "tl both, plain": lambda: (zeroed[1:].zero_(), _tensor_launcher[plan.grid](*args, FIND_ABSMAX=True, QUANTIZE=True, **common)),
        "tl absmax only, coop": lambda: _tensor_launcher[plan.grid](*args, FIND_ABSMAX=True, QUANTIZE=False, launch_cooperative_grid=True, **common),
        "tl absmax only, plain": lambda: _tensor_launcher[plan.grid](*args, FIND_ABSMAX=True, QUANTIZE=False, **common),
        "tl quantize only, plain": lambda: _tensor_launcher[plan.grid](*args, FIND_ABSMAX=False, QUANTIZE=True, **common),
        "gluon sr": lambda: qg.launch(x, x_q, sc, slots=7, slot_bytes=32768, warps=8, self_reset=True),
    }
    if plan is None:
        fns = {k: f for k, f in fns.items() if not k.startswith("tl ")}
    times = {k: [] for k in fns}
    for _ in range(3):
        for k, f in fns.items():
            times[k].append(graph_ms(f))
    for k, t in times.items():
        rows.append(dict(shape=f"{m}x{n}", variant=k, ms=t))
        print(f"{m}x{n} {k:26s} {min(t) * 1e3:7.2f} us", flush=True)
save_json(os.path.join(OUT, "quantize_one_launch_fixed_costs.json"), dict(env=environment(), rows=rows))
