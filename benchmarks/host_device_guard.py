"""Host cost of the device guard (``ops.common.on_device_of``): the context alone, and public calls
with it and with a null context patched in, alternating five times in one process.

    python3 benchmarks/host_device_guard.py host_device_guard.json
"""

import contextlib
import json
import statistics
import sys

import torch
from host_overhead import per_call_us

import qflash
import qflash.ops.common as common
from qflash.ops import attention as att_ops, matmul as mm_ops, quantize as q_ops

GUARDS = {"guard": common.on_device_of, "null": lambda t: contextlib.nullcontext()}


def context_alone(t, res):
    for name, guard in GUARDS.items():
        def body(guard=guard):
            with guard(t):
                pass
        res.setdefault(name, []).append(per_call_us(body, 100000, warmup=50))


def public_calls(calls, modules, res):
    for name, guard in GUARDS.items():
        for m in modules:  # the launch paths look the guard up in their module at each call
            m.on_device_of = guard
        for op, fn in calls.items():
            res.setdefault(op, {}).setdefault(name, []).append(per_call_us(fn, 3000, warmup=50))
    for m in modules:
        m.on_device_of = common.on_device_of


def main():
    t = torch.zeros(1, device="cuda")
    x = torch.randn(16, 256, device="cuda")
    a_q, a_s = qflash.quantize(x, torch.float8_e4m3fn, "tensor")
    b_q, b_s = qflash.quantize(torch.randn(256, 256, device="cuda"), torch.float8_e4m3fn, "tensor")
    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    calls = {
        "fp8_matmul": lambda: qflash.fp8_matmul(a_q, b_q, a_s, b_s),
        "quantize": lambda: qflash.quantize(x, torch.float8_e4m3fn, "row"),
        "flash_attn_func": lambda: qflash.flash_attn_func(q, q, q, causal=True),
    }
    modules = [m for m in (att_ops, mm_ops, q_ops) if hasattr(m, "on_device_of")]
    res = {"context_alone": {}, "public": {}}
    for _ in range(5):
        context_alone(t, res["context_alone"])
    for _ in range(5):
        public_calls(calls, modules, res["public"])
    out = {"context_alone_us": {k: statistics.median(v) for k, v in res["context_alone"].items()},
           "public_us_median": {op: {k: statistics.median(v) for k, v in d.items()} for op, d in res["public"].items()},
           "raw": res, "patched_modules": [m.__name__ for m in modules]}
    print(json.dumps(out, indent=1))
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
