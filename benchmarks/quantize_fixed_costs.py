"""Fixed costs of a dynamic per-tensor scale on small activations (M x 4096 bfloat16 to fp8):
what ``quantize`` does by default against the absmax sweep and quantize pass, a static scale
and per-row scales, and the zeroing of the counters alone, from CUDA graphs (best of two).

    OUT=out python3 benchmarks/quantize_fixed_costs.py    (writes $OUT/quantize_fixed_costs.json)"""

import os

import torch

from qflash.bench.harness import environment, graph_ms, save_json
from qflash.kernels.quantize import quantize as launch

F8 = torch.float8_e4m3fn


def main():
    rows = [dict(what="torch.zeros(2) alone", us=graph_ms(lambda: torch.zeros(2, dtype=torch.int32, device="cuda"))
                 * 1e3)]
    static = torch.full((1,), 0.01, device="cuda")
    for m in (16, 128, 256, 512, 2048):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        paths = {"default": lambda: launch(x, F8, "tensor"),
                 "sweep + pass": lambda: launch(x, F8, "tensor", one_launch=False),
                 "static scale": lambda: launch(x, F8, "tensor", static_scale=static),
                 "per row": lambda: launch(x, F8, "row")}
        for name, fn in paths.items():
            rows.append(dict(what=f"{m}x4096 fp8 {name}", us=min(graph_ms(fn) for _ in range(2)) * 1e3))
    for r in rows:
        print(f"{r['what']:32s} {r['us']:7.2f} us")
    save_json(os.path.join(os.environ.get("OUT", "."), "quantize_fixed_costs.json"), dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
