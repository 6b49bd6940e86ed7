"""What recording a decode forward for replays costs, piece by piece (kernels/replay.py).

    python3 benchmarks/record_cost.py

``flash_attn_func``'s forward of one token against 1024 keys (Llama-3-8B's 32 / 8 heads, D = 128,
bfloat16), taken as ``Replays`` calls it: the forward alone, the forward inside ``record``'s
dispatch mode (which sees every aten op), and in one without the wrapper that keeps Dynamo out of
a mode's ``__torch_dispatch__`` (torch's ``_should_skip_dynamo``), ``Replay.build`` with each
compiled kernel's parameters classified once (as ``build`` does) and anew on every call (as before
session 61), and ``record`` in all. Five rounds in turn, medians (us a call).
"""

import statistics

import torch

import qflash
import qflash.kernels.replay as replay
from qflash.kernels import common
from qflash.ops import attention as ops_attention

from host_overhead import per_call_us  # (beside this script)


def main() -> None:
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    captured = {}

    def grab(fn, args, kept=()):  # (stands in for _EAGER_FORWARDS: the function and arguments it gets)
        captured["fn"], captured["args"] = fn, args
        return fn(*args)

    replays = ops_attention._EAGER_FORWARDS
    ops_attention._EAGER_FORWARDS = grab
    with torch.no_grad():
        qflash.flash_attn_func(q, k, v, causal=True)
    ops_attention._EAGER_FORWARDS = replays
    fn, args = captured["fn"], captured["args"]
    inputs = [a for a in args if isinstance(a, torch.Tensor)]

    def in_mode():
        with replay._MadeTensors():
            fn(*args)

    handler = replay._MadeTensors.__dict__["__torch_dispatch__"]  # torch wraps it to keep Dynamo out

    class Undisabled(replay._MadeTensors):
        @classmethod
        def _should_skip_dynamo(cls):  # (read when a subclass is made: its handler stays unwrapped)
            return False

        __torch_dispatch__ = getattr(handler, "__wrapped__", handler)

    def in_mode_undisabled():
        with Undisabled():
            fn(*args)

    made = replay._MadeTensors()
    launches, scratch = [], []
    common.LAUNCH_LOG.launches, common.LAUNCH_LOG.scratch = launches, scratch
    with made, torch.no_grad():
        outputs = list(fn(*args))
    common.LAUNCH_LOG.launches = common.LAUNCH_LOG.scratch = None
    print("tensors made in one forward:", len(made.made), "launches:", len(launches), "computed:", made.computed)

    def build():
        replay.Replay.build(inputs, outputs, made.made, launches, scratch, True)

    def build_uncached():
        replay._PARAMS.clear()
        build()

    paths = {"forward": lambda: fn(*args), "forward in the dispatch mode": in_mode,
             "forward in the dispatch mode, without Dynamo's wrapper": in_mode_undisabled,
             "Replay.build (parameters classified once a kernel)": build,
             "Replay.build (classified anew, as before)": build_uncached,
             "record (all)": lambda: replay.record(fn, args)}
    rounds = {name: [] for name in paths}
    with torch.no_grad():
        for _ in range(5):
            for name, path in paths.items():
                rounds[name].append(per_call_us(path, calls=300))
    for name, r in rounds.items():
        print(f"{name:55s} {statistics.median(r):7.1f} us  ({', '.join(f'{x:.0f}' for x in r)})")


if __name__ == "__main__":
    main()
