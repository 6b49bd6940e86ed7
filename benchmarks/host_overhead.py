"""Host (Python) time of one call, on a problem too small for the GPU to matter.

    python3 benchmarks/host_overhead.py --out host.json                # attention forward
    python3 benchmarks/host_overhead.py --head-dim 64 --seqlen 512 --causal --out host.json
    python3 benchmarks/host_overhead.py --op matmul --out host.json    # FP8 matmul (M = 128, N = K = 512)
    python3 benchmarks/host_overhead.py --op quantize --out host.json  # quantize (128 x 4096)
    python3 benchmarks/host_overhead.py --op layer --out host.json     # a quantized 4096 -> 14336 layer, M = 16
    python3 benchmarks/host_overhead.py --op decode --out host.json    # attention at decode, replays on / off

At 512 tokens a forward kernel runs 0.1-0.2 ms; a launch path that costs as much on the CPU
shows up in eager timings. Prints microseconds a call for each path, then where the public
path's time goes (cProfile, top functions by own time).
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import qflash
from qflash.bench.harness import environment, save_json
from qflash.kernels import attention_gluon
from qflash.kernels.attention import AttnOptions, attention_forward, default_config


def per_call_us(fn, calls: int = 500, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


class TritonCall:
    """A stand-in for a ``CachedLauncher`` that takes Triton's own call every time (the launch
    before the cache), to time both side by side."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return self.kernel[grid]


def uncached(module, name: str, fn):
    """``fn`` with ``module.name`` (a ``CachedLauncher``) swapped for Triton's own call."""
    def call():
        cached = getattr(module, name)
        setattr(module, name, TritonCall(cached.kernel))
        try:
            return fn()
        finally:
            setattr(module, name, cached)
    return call


def matmul_paths() -> tuple:
    """Paths of an FP8 product small enough (128 x 512 x 512) that the host sets the pace."""
    from qflash.kernels import matmul_gluon
    from qflash.kernels.matmul import scaled_matmul

    a = torch.randn(128, 512, device="cuda")
    b = torch.randn(512, 512, device="cuda")
    a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "tensor")
    b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "tensor")
    ones = torch.ones((), device="cuda")
    gluon = lambda: matmul_gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", split_k=1)
    paths = {
        "matmul_gluon.launch (one launch)": gluon,
        "matmul_gluon.launch (one launch, Triton's call)": uncached(matmul_gluon, "_launcher", gluon),
        "matmul_gluon.launch (split K 4: two launches)":
            lambda: matmul_gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", split_k=4),
        "tl kernel (scaled_matmul)": lambda: scaled_matmul(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor"),
        "qflash.fp8_matmul": lambda: qflash.fp8_matmul(a_q, b_q, a_s, b_s),
        "torch._scaled_mm": lambda: torch._scaled_mm(a_q, b_q.t(), ones, ones, out_dtype=torch.bfloat16),
    }
    return paths, gluon


def quantize_paths() -> tuple:
    """Paths of quantizing 128 x 4096 bfloat16 values (1 MB: the host sets the pace)."""
    from qflash.kernels import quantize as kernels

    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    static = torch.full((1,), 0.01, device="cuda")
    paths = {}
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        name = str(qdtype).split(".")[-1]
        paths[f"{name} per tensor (one launch)"] = lambda q=qdtype: qflash.quantize(x, q, "tensor")
        paths[f"{name} per tensor (one launch, Triton's call)"] = uncached(
            kernels, "_tensor_launcher", lambda q=qdtype: qflash.quantize(x, q, "tensor"))
        paths[f"{name} per tensor (sweep + pass)"] = lambda q=qdtype: kernels.quantize(x, q, "tensor", one_launch=False)
        paths[f"{name} per tensor, static scale"] = lambda q=qdtype: qflash.quantize(x, q, "tensor", scale=static)
        paths[f"{name} per row"] = lambda q=qdtype: qflash.quantize(x, q, "row")
    return paths, lambda: qflash.quantize(x, torch.float8_e4m3fn, "tensor")


def layer_paths(device: str = "cuda") -> tuple:
    """A quantized Llama-3-8B up projection (4096 -> 14336, no bias) at M = 16, where its two
    kernels take about 19 us on the H200 (s56f): the layer's call in bfloat16, INT8 and FP8, and
    the FP8 and INT8 layers' quantize and product launch paths, layer by layer down to the Gluon
    kernel's own launch (each layer's checks and dispatch on top of the one below)."""
    import copy

    from qflash.kernels import matmul_gluon
    from qflash.kernels.matmul import scaled_matmul
    from qflash.nn import quantize_model
    from qflash.ops.matmul import launch_scaled_matmul
    from qflash.ops.quantize import launch_quantize

    x = torch.randn(16, 4096, device=device, dtype=torch.bfloat16)
    base = torch.nn.Sequential(torch.nn.Linear(4096, 14336, bias=False)).to(device, torch.bfloat16)
    int8, fp8 = (quantize_model(copy.deepcopy(base), mode)[0] for mode in ("int8", "fp8"))
    f8 = torch.float8_e4m3fn
    x_q, x_s = launch_quantize(x, f8, "block", (1, 128), None)
    xi_q, xi_s = launch_quantize(x, torch.int8, "row", None, None)
    w_q, w_s, wi_q, wi_s = fp8.weight_q, fp8.weight_scale, int8.weight_q, int8.weight_scale
    bf16 = torch.bfloat16

    def layer(module):  # a call under no_grad: inference, as the quantized layers are
        return torch.no_grad()(lambda: module(x))

    paths = {
        "bfloat16 layer": layer(base),
        "INT8 QuantizedLinear": layer(int8),
        "FP8 QuantizedLinear": layer(fp8),
        "FP8 quantize (1 x 128 blocks)": lambda: launch_quantize(x, f8, "block", (1, 128), None),
        "FP8 product (ops.launch_scaled_matmul)": lambda: launch_scaled_matmul(x_q, w_q, x_s, w_s, None, bf16,
                                                                               "block"),
        "FP8 product (kernels.matmul.scaled_matmul)": lambda: scaled_matmul(x_q, w_q, x_s, w_s, None, bf16,
                                                                            "block"),
        "FP8 product (matmul_gluon.launch)": lambda: matmul_gluon.launch(x_q, w_q, x_s, w_s, None, bf16, "block",
                                                                         swap_ab=True),
        "INT8 quantize (row)": lambda: launch_quantize(x, torch.int8, "row", None, None),
        "INT8 product (ops.launch_scaled_matmul)": lambda: launch_scaled_matmul(xi_q, wi_q, xi_s, wi_s, None,
                                                                                bf16, "row"),
        "three torch.empty (the host's pace)": lambda: [torch.empty(16, 14336, device=device) for _ in range(3)],
    }
    return paths, layer(fp8)


def attention_paths(head_dim: int = 128, seqlen: int = 128, causal: bool = False) -> tuple:
    """One head of one sequence: the launch paths of the kernels that a (head_dim, seqlen,
    causal) call at any batch x heads takes, with little for the GPU to do."""
    q, k, v = (torch.randn(1, seqlen, 1, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    scale = head_dim**-0.5
    opts = AttnOptions(scale, window_right=0 if causal else -1)
    cfg = default_config(head_dim, q.dtype, q.device, causal=causal, seqlen_k=seqlen)
    gluon = lambda: attention_gluon.launch(q, k, v, scale, causal, True)  # noqa: E731
    paths = {
        "attention_gluon.launch": gluon,
        "attention_gluon.launch (Triton's call)": uncached(attention_gluon, "_fwd_launcher", gluon),
        "attention_gluon.attention_forward_gluon":
            lambda: attention_gluon.attention_forward_gluon(q, k, v, scale, causal=causal),
        "tl kernel (attention_forward, config)": lambda: attention_forward(q, k, v, opts, config=cfg),
        "qflash.flash_attn_func": lambda: qflash.flash_attn_func(q, k, v, causal=causal),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
    }
    return paths, lambda: qflash.flash_attn_func(q, k, v, causal=causal)


def decode_paths() -> tuple:
    """Attention of one new token (Llama-3-8B's 32 / 8 heads, D = 128, bfloat16) against 1024 keys:
    ``flash_attn_func``, ``flash_attn_with_kvcache`` (the new key and value written into a cache
    of 4096 slots) and the transformers integration's attention function, each with its launches
    replayed (ops/attention.py) and without, beside PyTorch's SDPA; and a kind's first two calls,
    the normal path and a recording (what a decode step's new key length costs its first two
    layers), a pair a call; and decode steps (``decode_step_paths``)."""
    import qflash.kernels.replay as replay
    from qflash.integrations.transformers import attention_forward
    from qflash.ops.attention import _EAGER_FORWARDS

    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_cache, v_cache = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    module = torch.nn.Module()
    module.is_causal = True

    def replayed(fn, on: bool):
        def call():
            replay.ENABLED = on
            try:
                with torch.no_grad():
                    return fn()
            finally:
                replay.ENABLED = True
        return call

    def new_kind(fn):
        def call():
            _EAGER_FORWARDS.clear()
            with torch.no_grad():
                fn()  # the normal path
                return fn()  # recorded
        return call

    calls = {
        "flash_attn_func": lambda: qflash.flash_attn_func(q, k, v, causal=True),
        "flash_attn_with_kvcache": lambda: qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                                          cache_seqlens=lens, causal=True),
        "transformers integration": lambda: attention_forward(module, q.transpose(1, 2), k.transpose(1, 2),
                                                              v.transpose(1, 2), None),
    }
    paths = {f"{name} ({'replayed' if on else 'not replayed'})": replayed(fn, on)
             for name, fn in calls.items() for on in (True, False)}
    paths.update({f"{name} (a new kind: normal path + recording)": new_kind(fn) for name, fn in calls.items()})
    paths["F.scaled_dot_product_attention"] = lambda: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    paths.update(decode_step_paths(q, module))
    return paths, paths["flash_attn_func (replayed)"]


def decode_step_paths(q: torch.Tensor, module, layers: int = 8) -> dict:
    """A decode step of ``layers`` layers through the transformers integration's attention
    function, each step one key more than the last (1024 to 3071 keys, then again: transformers'
    growing cache), a step a call: without replays, with replays whose kinds record on their second
    call, and with the attention ops' policy (a new kind records at once after a replay)."""
    import qflash.kernels.replay as replay
    from qflash.integrations.transformers import attention_forward
    from qflash.ops.attention import _EAGER_FORWARDS

    k_all, v_all = (torch.randn(1, 8, 3072, 128, device="cuda", dtype=q.dtype) for _ in range(2))
    query = q.transpose(1, 2)
    step = [0]

    def decode_step(on: bool, at_once: bool):
        def call():
            keys = 1024 + step[0] % 2048
            step[0] += 1
            replay.ENABLED, _EAGER_FORWARDS.record_after_replay = on, at_once
            try:
                with torch.no_grad():
                    for _ in range(layers):
                        attention_forward(module, query, k_all[:, :, :keys], v_all[:, :, :keys], None)
            finally:
                replay.ENABLED, _EAGER_FORWARDS.record_after_replay = True, True
        return call

    name = f"decode step, {layers} layers, a new key length a step"
    return {f"{name} (not replayed)": decode_step(False, False),
            f"{name} (replayed, recorded on a kind's second call)": decode_step(True, False),
            f"{name} (replayed, recorded at once after a replay)": decode_step(True, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=["attention", "matmul", "quantize", "layer", "decode"], default="attention")
    parser.add_argument("--rounds", type=int, default=1, help="times each path in turn this many times (medians)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--head-dim", type=int, default=128, help="attention: the head dim whose kernels to launch")
    parser.add_argument("--seqlen", type=int, default=128, help="attention: the length (sets the tiles)")
    parser.add_argument("--causal", action="store_true", help="attention: the causal kernels")
    args = parser.parse_args()
    if args.op == "matmul":
        paths, profiled = matmul_paths()
    elif args.op == "quantize":
        paths, profiled = quantize_paths()
    elif args.op == "layer":
        paths, profiled = layer_paths()
    elif args.op == "decode":
        paths, profiled = decode_paths()
    else:
        paths, profiled = attention_paths(args.head_dim, args.seqlen, args.causal)
    result = {"env": environment(), "op": args.op, "rows": [],
              "attention": dict(head_dim=args.head_dim, seqlen=args.seqlen, causal=args.causal)}
    rounds = {name: [] for name in paths}
    for _ in range(args.rounds):  # in turn, so that a drift of the host's pace touches every path alike
        for name, fn in paths.items():
            rounds[name].append(per_call_us(fn))
    for name, us in rounds.items():
        median = statistics.median(us)
        result["rows"].append({"path": name, "us_per_call": median, "rounds_us": us})
        print(f"{name:45s} {median:8.1f} us/call" + (f"  ({', '.join(f'{u:.1f}' for u in us)})" if len(us) > 1 else ""),
              flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        profiled()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    result["profile_200_calls"] = text.getvalue()
    print(text.getvalue())
    save_json(args.out, result)


if __name__ == "__main__":
    main()
