"""A dynamic per-tensor scale: what ``quantize`` does by default (one cooperative launch holding
part of the input in registers, ``_tensor_kernel``, up to about 34 MB; the sweep above) against
the absmax sweep and quantize pass (two launches, two reads), a static scale (one read) and a
copy of the same bfloat16 tensor, timed from CUDA graphs in turn, three times each, at activation
shapes. ``--variants`` adds the one launch with other sizes of its held part and streamed tiles
(each up to twice the size it holds, the sweep above). The outputs are compared bit for bit
with the sweep's.

    OUT=out python3 benchmarks/quantize_per_tensor.py [--variants]   (writes $OUT/quantize_per_tensor.json)"""

import os
import sys

import torch

from qflash.bench.harness import environment, graph_ms, measure_ceilings, save_json
from qflash.kernels.quantize import TENSOR_BLOCK, TENSOR_HOLD_BYTES, _tensor_plan, quantize as launch
from qflash.reference.quantize import QMAX
from qflash.testing import same_bits

SHAPES = [(512, 4096), (1024, 4096), (2048, 4096), (1024, 8192), (3072, 4096), (1024, 14336), (4096, 4096),
          (2048, 8192), (6144, 4096), (1024, 28672), (8192, 4096), (8192, 8192)]
VARIANTS = {  # hold_bytes a program, elements a streamed tile
    "held 128 KB, tiles 16 K": dict(stream_block=2**14),
    "held 64 KB, tiles 16 K": dict(hold_bytes=2**16, stream_block=2**14),
    "held 64 KB, tiles 32 K": dict(hold_bytes=2**16, stream_block=2**15),
}


def _one_launch(x, one_launch=True, hold_bytes=TENSOR_HOLD_BYTES, stream_block=TENSOR_BLOCK) -> bool:
    """Whether ``quantize`` takes the one launch for a dynamic per-tensor scale on x (contiguous)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return one_launch and _tensor_plan(x.numel(), x.element_size(), sms, hold_bytes, stream_block) is not None


def main():
    variants = {"default": dict(), "sweep + pass": dict(one_launch=False)}
    if "--variants" in sys.argv:
        variants.update(VARIANTS)
    ceilings = measure_ceilings()
    rows = []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        for qdtype in (torch.float8_e4m3fn, torch.int8):
            static = x.abs().amax().float() / QMAX[qdtype]
            fns = {name: (lambda kw=kw: launch(x, qdtype, "tensor", **kw)) for name, kw in variants.items()}
            fns["static scale"] = lambda: launch(x, qdtype, "tensor", static_scale=static.reshape(1))
            fns["copy"] = lambda: dst.copy_(x)
            want = launch(x, qdtype, "tensor", one_launch=False)
            same = {name: all(same_bits(a, b) for a, b in zip(fns[name](), want)) for name in variants}
            times = {name: [] for name in fns}
            for _ in range(3):
                for name, fn in fns.items():
                    times[name].append(graph_ms(fn))
            copy_ms = min(times.pop("copy"))
            copy_tbps = 2 * x.numel() * 2 / (copy_ms * 1e-3) / 1e12
            for name, ms in times.items():
                best = min(ms)
                tbps = x.numel() * 3 / (best * 1e-3) / 1e12  # read once + written, as the issue counts
                rows.append(dict(shape=f"{m}x{k}", mbytes=x.numel() * 2 / 2**20, qdtype=str(qdtype).split(".")[-1],
                                 variant=name, ms=ms, tbps=tbps, x_same_size_copy=tbps / copy_tbps,
                                 x_copy_1gib=tbps / ceilings["copy_TBps"], same_bits=same.get(name),
                                 copy_ms=copy_ms, one_launch=_one_launch(x, **variants[name]) if name in variants
                                 else None))
                print(f"{m}x{k} {rows[-1]['qdtype']:14s} {name:24s} {best * 1e3:8.1f} us  x copy "
                      f"{rows[-1]['x_same_size_copy']:.3f} / {rows[-1]['x_copy_1gib']:.3f}  {same.get(name, '')}",
                      flush=True)
    out = os.path.join(os.environ.get("OUT", "."), "quantize_per_tensor.json")
    save_json(out, dict(env=environment(), ceilings=ceilings, rows=rows))


if __name__ == "__main__":
    main()
