"""Where the time of a dynamic per-tensor quantize goes (s30c): ``_tensor_kernel``'s two phases
launched apart (the absmax alone, the quantize alone: timing only, the values are not the point),
both in one launch, cooperative or plain, and the counters' zeroing, beside the default path, the
sweep and a static scale; float8 from M x 4096 bfloat16, times from CUDA graphs, best of three in
turn. (s30c also timed session 30's Gluon experiment, in the commit that added it.)

    OUT=out python3 benchmarks/quantize_phases.py   (writes $OUT/quantize_phases.json)"""

import os

import torch

from qflash.bench.harness import environment, graph_ms, save_json
from qflash.kernels.common import sm_count
from qflash.kernels.quantize import (TENSOR_BLOCK, TENSOR_HOLD_BYTES, TENSOR_WARPS, _TL_DTYPES, _tensor_launcher,
                                     _tensor_plan, quantize)
from qflash.reference.quantize import QMAX

SHAPES = [(16, 4096), (128, 4096), (512, 4096), (2048, 4096), (3072, 4096), (4096, 4096)]


def main():
    qdtype = torch.float8_e4m3fn
    rows = []
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        x_q = torch.empty(x.shape, dtype=qdtype, device="cuda")
        scale = torch.empty((), device="cuda")
        static = x.abs().amax().float().reshape(1) / QMAX[qdtype]
        counters = torch.zeros(2, dtype=torch.int32, device="cuda")  # Amax's bits, Arrived
        fns = {
            "default": lambda: quantize(x, qdtype, "tensor"),
            "sweep": lambda: quantize(x, qdtype, "tensor", one_launch=False),
            "static": lambda: quantize(x, qdtype, "tensor", static_scale=static),
            "zeros(2)": lambda: torch.zeros(2, dtype=torch.int32, device="cuda"),
        }
        plan = _tensor_plan(m * n, x.element_size(), sm_count(x.device), TENSOR_HOLD_BYTES, TENSOR_BLOCK)
        if plan is not None:  # (None: the tensor is too small for the one launch)
            def phases(absmax, quant, coop):
                def run():
                    if absmax and quant:
                        counters[1:].zero_()  # the barrier's count
                    _tensor_launcher[plan.grid](
                        x, x_q, scale, counters.view(torch.float32), counters[1:], m * n, QMAX=QMAX[qdtype],
                        OUT=_TL_DTYPES[qdtype], EMULATE_CASTS=False, FIND_ABSMAX=absmax, QUANTIZE=quant,
                        num_warps=TENSOR_WARPS, launch_cooperative_grid=coop, **plan.constexprs)
                return run
            fns.update({"tl both, coop": phases(True, True, True), "tl both, plain": phases(True, True, False),
                        "tl absmax only, coop": phases(True, False, True),
                        "tl absmax only, plain": phases(True, False, False),
                        "tl quantize only, plain": phases(False, True, False)})
        times = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                times[name].append(graph_ms(fn))
        for name, ms in times.items():
            rows.append(dict(shape=f"{m}x{n}", variant=name, ms=ms))
            print(f"{m}x{n} {name:26s} {min(ms) * 1e3:7.2f} us", flush=True)
    save_json(os.path.join(os.environ.get("OUT", "."), "quantize_phases.json"), dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
