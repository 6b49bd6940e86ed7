"""Host time of eager quantized layers, the launch paths of another source tree against this one's,
in turn in one process (the host's pace drifts between processes by up to 2 x, s57).

    git worktree add /tmp/base <commit> && \
    python3 benchmarks/host_layers_ab.py --base /tmp/base/src --out host_ab.json

What is swapped (the rest of the code is this tree's): ``QuantizedLinear.forward``, the ops'
``on_device_of``, ``CachedLauncher._launch`` and ``split_k_counters``. (From session 58 this
tree's forward replays its launches, ``kernels/replay.py``; a base tree from before does not.) Times a Llama-3-8B up
projection (4096 -> 14336) at M = 16 in bfloat16, INT8 and FP8 (the microseconds from the first
call to the last call's return, 200 calls, no synchronize between: the host's issue rate), with
``torch._scaled_mm`` as a yardstick of the host's pace, in seven alternating rounds; then the
MLP block (up, GELU, down) at M = 16 and 1024 eagerly (``triton.testing.do_bench``) and by issue
rate, in three.
"""

import argparse
import copy
import importlib.util
import os
import statistics
import time

import torch

import qflash.nn
import qflash.kernels.common as kernels_common
import qflash.kernels.matmul as kernels_matmul
import qflash.kernels.matmul_epilogue as kernels_epilogue
import qflash.kernels.matmul_gluon as kernels_gluon
import qflash.ops.common as ops_common
import qflash.ops.matmul as ops_matmul
import qflash.ops.quantize as ops_quantize
from qflash.bench.harness import environment, save_json, time_ms
from qflash.bench.matmul import _MLP
from qflash.nn import QuantizedLinear, quantize_model


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_paths(nn, kernels_common, matmul_epilogue, ops_common) -> dict:
    """The swapped functions, from a tree's ``qflash.nn``, ``kernels.common``,
    ``kernels.matmul_epilogue`` and ``ops.common`` modules."""
    return dict(forward=nn.QuantizedLinear.forward, launch=kernels_common.CachedLauncher._launch,
                counters=matmul_epilogue.split_k_counters, device=ops_common.on_device_of)


def loaded_paths(src: str) -> dict:
    """``launch_paths`` of the tree at ``src`` (its ``qflash`` package's files, loaded apart)."""
    files = ("nn.py", "kernels/common.py", "kernels/matmul_epilogue.py", "ops/common.py")
    return launch_paths(*(_load(os.path.join(src, "qflash", *f.split("/")), "base_" + f.replace("/", "_")[:-3])
                          for f in files))


def use(paths: dict) -> None:
    QuantizedLinear.forward = paths["forward"]
    kernels_common.CachedLauncher._launch = paths["launch"]
    kernels_matmul.split_k_counters = kernels_gluon.split_k_counters = paths["counters"]
    for module in (ops_common, ops_matmul, ops_quantize):
        module.on_device_of = paths["device"]


def issue_us(fn, calls: int = 200) -> float:
    """Microseconds a call from the first call to the last one's return, the GPU left to catch up."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the other tree's src directory")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    trees = {"base": loaded_paths(args.base),
             "this": launch_paths(qflash.nn, kernels_common, kernels_epilogue, ops_common)}
    dev = torch.device("cuda")
    torch.manual_seed(0)
    torch.set_grad_enabled(False)  # inference, as the quantized layers are
    linear = torch.nn.Linear(4096, 14336, bias=False).to(dev, torch.bfloat16)
    layers = {mode: quantize_model(torch.nn.Sequential(copy.deepcopy(linear)), mode)[0] for mode in ("int8", "fp8")}
    block = _MLP(4096, 14336).to(dev, torch.bfloat16)
    blocks = {"bf16": block, **{mode: quantize_model(copy.deepcopy(block), mode) for mode in ("int8", "fp8")}}
    xs = {m: torch.randn(m, 4096, device=dev, dtype=torch.bfloat16) for m in (16, 1024)}
    x8, w8 = xs[16].to(torch.float8_e4m3fn), torch.randn(4096, 4096, device=dev).to(torch.float8_e4m3fn)
    ones_m, ones_n = torch.ones(16, 1, device=dev), torch.ones(1, 4096, device=dev)
    calls = {
        "bfloat16 layer": lambda: linear(xs[16]),
        "INT8 QuantizedLinear": lambda: layers["int8"](xs[16]),
        "FP8 QuantizedLinear": lambda: layers["fp8"](xs[16]),
        "torch._scaled_mm 16 x 4096 x 4096 (yardstick)": lambda: torch._scaled_mm(x8, w8.t(), ones_m, ones_n,
                                                                                   out_dtype=torch.bfloat16),
    }
    for paths in trees.values():  # compile and warm both trees' paths
        use(paths)
        for fn in calls.values():
            for _ in range(30):
                fn()
        for mode in ("int8", "fp8"):
            for x in xs.values():
                blocks[mode](x)
    rows = {}
    for r in range(7):
        for tree in (("base", "this") if r % 2 == 0 else ("this", "base")):
            use(trees[tree])
            for name, fn in calls.items():
                rows.setdefault((name, tree), []).append(issue_us(fn))
    for r in range(3):
        for tree in (("base", "this") if r % 2 == 0 else ("this", "base")):
            use(trees[tree])
            for m, x in xs.items():
                for mode, model in blocks.items():
                    if mode == "bf16" and tree == "this":
                        continue  # no quantized layer in it: timed once a round
                    name = f"MLP block {mode}, M = {m}"
                    rows.setdefault((name + ", eager (do_bench)", tree), []).append(
                        time_ms(lambda: model(x))["ms"] * 1e3)
                    rows.setdefault((name + ", issue", tree), []).append(issue_us(lambda: model(x), 100))
    use(trees["this"])
    out = []
    for (name, tree), us in rows.items():
        out.append(dict(path=name, tree=tree, us=us, min_us=min(us), median_us=statistics.median(us)))
        print(f"{name:52s} {tree:5s} min {min(us):7.1f}  median {statistics.median(us):7.1f} us", flush=True)
    save_json(args.out, {"env": environment(), "base": args.base, "rows": out})


if __name__ == "__main__":
    main()
