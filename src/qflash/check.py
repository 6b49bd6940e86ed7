"""``qflash check``: every kernel against its reference on this device, under the accuracy rule.

Each case draws fresh random inputs, runs the kernel on poisoned outputs, and
compares it with the float64 reference next to PyTorch in the same precision
(flash-attn's rule: kernel error <= 2 x PyTorch's error + a rounding floor).
Quantization and INT8 matmul must match their references bit for bit; FP8 matmul
must match the product of its dequantized inputs to the precision of Hopper's FP8
sums (about 14 bits within each 128-wide K block) and float32 rounding.
On a CPU the kernels run in Triton's interpreter, so the cases are small.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Tuple

import torch

from qflash.testing import assert_written, flash_rule, poisoned

FP8_SUM_EPS = 2.0**-12  # an FP8 matmul's error bound, relative to the sum of |a_k b_k| (see _matmul_case)


def _qkv(b, sq, sk, h, hkv, d, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(b, s, heads, d, device=device, generator=g).to(dtype)
                 for s, heads in ((sq, h), (sk, hkv), (sk, hkv)))


def _flash_case(shape, dtype, **kw) -> Callable[[str, int], Tuple]:
    def run(device: str, seed: int):
        import qflash
        from qflash.reference import attention_ref

        q, k, v = _qkv(*shape, dtype, device, seed)
        if kw.get("alibi_slopes") == "random":
            kw["alibi_slopes"] = torch.rand(shape[3], device=device)
        with poisoned():
            out = qflash.flash_attn_func(q, k, v, **kw)
        assert_written(out)
        ref, _ = attention_ref(q.double(), k.double(), v.double(), **kw)
        pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
        return out, ref, pt

    return run


def _varlen_case(lens_q, lens_k, dtype, **kw):
    def run(device: str, seed: int):
        import qflash
        from qflash.reference import attention_varlen_ref

        g = torch.Generator(device=device).manual_seed(seed)
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
        q = torch.randn(sum(lens_q), 4, 64, device=device, generator=g).to(dtype)
        k, v = (torch.randn(sum(lens_k), 2, 64, device=device, generator=g).to(dtype) for _ in range(2))
        with poisoned():
            out = qflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
        assert_written(out)
        ref, _ = attention_varlen_ref(q.double(), k.double(), v.double(), cu_q, cu_k, **kw)
        pt, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, reorder_ops=True, **kw)
        return out, ref, pt

    return run


def _sdpa_case(b, h, sq, sk, d, dtype, mask_kind):
    def run(device: str, seed: int):
        import qflash
        from qflash.reference import sdpa_ref

        g = torch.Generator(device=device).manual_seed(seed)
        query, key, value = (torch.randn(b, h, s, d, device=device, generator=g).to(dtype) for s in (sq, sk, sk))
        kw = {"is_causal": True} if mask_kind == "causal" else {}
        if mask_kind == "bool":
            kw["attn_mask"] = torch.rand(sq, sk, device=device, generator=g) > 0.3
        elif mask_kind == "float":
            kw["attn_mask"] = torch.randn(b, 1, sq, sk, device=device, generator=g).to(dtype)
        with poisoned():
            out = qflash.sdpa(query, key, value, **kw)
        assert_written(out)
        kw64 = {k: (m.double() if k == "attn_mask" and m.is_floating_point() else m) for k, m in kw.items()}
        ref = sdpa_ref(query.double(), key.double(), value.double(), **kw64)
        pt = sdpa_ref(query, key, value, upcast=False, **kw)
        return out, ref, pt

    return run


def _quantize_case(qdtype, granularity, block):
    def run(device: str, seed: int):
        import qflash
        from qflash.reference.quantize import quantize_ref

        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(67, 300, device=device, generator=g) * 4
        with poisoned():
            x_q, scale = qflash.quantize(x, qdtype, granularity, block)
        ref_q, ref_scale = quantize_ref(x, qdtype, granularity, block)
        # Bit-exact: compare the codes and the scales as float64, with no tolerance.
        out = torch.cat([x_q.double().flatten(), scale.double().flatten()])
        ref = torch.cat([ref_q.double().flatten(), ref_scale.double().flatten()])
        return out, ref, None, 0.0

    return run


def _matmul_case(kind: str, scales: str):
    def run(device: str, seed: int):
        import qflash
        from qflash.reference.matmul import QBLOCK, dequantize_operand, fp8_matmul_ref, int8_matmul_ref

        g = torch.Generator(device=device).manual_seed(seed)
        a, b = torch.randn(70, 300, device=device, generator=g), torch.randn(90, 300, device=device, generator=g)
        bias = torch.randn(90, device=device, generator=g)
        if kind == "int8":
            (a_q, a_s), (b_q, b_s) = (qflash.quantize(t, torch.int8, scales) for t in (a, b))
            out = qflash.int8_matmul(a_q, b_q, a_s, b_s, bias=bias, out_dtype=torch.float32)
            return out, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float32).double(), None, 0.0
        blocks = ((1, 128), (128, 128)) if scales == "block" else (None, None)
        a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, scales, blocks[0])
        b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, scales, blocks[1])
        with poisoned():
            out = qflash.fp8_matmul(a_q, b_q, a_s, b_s, bias=bias, out_dtype=torch.float32)
        assert_written(out)
        ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)
        # Hopper's tensor cores keep about 14 bits of an FP8 sum within each 128-wide K block (the
        # kernel adds the blocks in float32): errors up to about 2^-13 of the sum of the terms'
        # magnitudes, doubled for a margin. (Triton's interpreter sums in float32: far below.)
        a_deq, b_deq = dequantize_operand(a_q, a_s, block_rows=1), dequantize_operand(b_q, b_s, block_rows=QBLOCK)
        magnitudes = a_deq.abs() @ b_deq.abs().T  # [M, N]: sum over k of |a_ik b_jk|
        return out, ref, None, FP8_SUM_EPS * float(magnitudes.max()) + 1e-5 * float(ref.abs().max())

    return run


def cases(device: str, quick: bool) -> Iterator[Tuple[str, str, Callable]]:
    """(op, description, run) for every kernel. Small on a CPU, GPU-sized on CUDA."""
    f16 = torch.float16
    dtypes = [torch.float16, torch.bfloat16] if device == "cuda" else [torch.float16]
    big = device == "cuda" and not quick
    n = 2048 if big else 113
    m = 1500 if big else 203
    for dt in dtypes:
        name = str(dt)[6:]
        yield "flash_attn_func", f"{name} causal GQA 6/2, D=80, {n}x{m}", _flash_case((2, n, m, 6, 2, 80), dt, causal=True)
        yield "flash_attn_func", f"{name} non-causal, D=128, {m}x{n}", _flash_case((1, m, n, 4, 4, 128), dt)
        if big:
            yield "flash_attn_func", f"{name} causal, D=256, 4096x4096", _flash_case((1, 4096, 4096, 2, 1, 256), dt,
                                                                                    causal=True)
    yield "flash_attn_func", "fp32 causal, D=64", _flash_case((1, 77, 130, 2, 2, 64), torch.float32, causal=True)
    yield "flash_attn_func", "sliding window (32, 8)", _flash_case((1, n, n, 2, 2, 64), f16, window_size=(32, 8))
    yield "flash_attn_func", "softcap 5, causal", _flash_case((1, 90, 90, 2, 2, 64), f16, softcap=5.0, causal=True)
    yield "flash_attn_func", "ALiBi, causal", _flash_case((1, 70, 99, 2, 2, 64), f16, alibi_slopes="random",
                                                          causal=True)
    if not quick:
        yield "flash_attn_func", "(1, 1) and (239, 1)", _flash_case((2, 239, 1, 2, 1, 32), f16, causal=True)
    yield "flash_attn_varlen_func", "causal, lengths 1/63/0/40", _varlen_case([1, 63, 0, 40], [5, 63, 9, 40], f16,
                                                                             causal=True)
    yield "sdpa", "top-left causal", _sdpa_case(2, 2, 40, 70, 64, f16, "causal")
    yield "sdpa", "bool mask", _sdpa_case(2, 2, 40, 70, 64, f16, "bool")
    yield "sdpa", "float mask", _sdpa_case(2, 2, 40, 70, 64, f16, "float")
    yield "quantize", "int8 per row (bit-exact)", _quantize_case(torch.int8, "row", None)
    yield "quantize", "fp8 e4m3 blocks 1x128 (bit-exact)", _quantize_case(torch.float8_e4m3fn, "block", (1, 128))
    if not quick:
        yield "quantize", "fp8 e5m2 per column (bit-exact)", _quantize_case(torch.float8_e5m2, "column", None)
        yield "quantize", "int8 per tensor (bit-exact)", _quantize_case(torch.int8, "tensor", None)
    yield "int8_matmul", "per-row x per-column (bit-exact)", _matmul_case("int8", "row")
    yield "fp8_matmul", "block scales, vs dequantized fp64", _matmul_case("fp8", "block")
    if not quick:
        yield "fp8_matmul", "per-tensor, vs dequantized fp64", _matmul_case("fp8", "tensor")


def run_check(quick: bool = False, seed: int = 0) -> List[Dict[str, object]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for i, (op, what, run) in enumerate(cases(device, quick)):
        try:
            out, ref, pt, *floor = run(device, seed + i)
            if pt is None:  # no PyTorch counterpart: the bound is the stated tolerance alone
                res = flash_rule(out, ref, ref, floor=floor[0])
            else:
                res = flash_rule(out, ref, pt)
            rows.append(dict(op=op, case=what, kernel_err=res.kernel_err, torch_err=res.torch_err, bound=res.bound,
                             ok=res.ok, error=None))
        except Exception as exc:  # a crash is a failed check, reported with its reason
            rows.append(dict(op=op, case=what, kernel_err=None, torch_err=None, bound=None, ok=False,
                             error=f"{type(exc).__name__}: {exc}"[:160]))
    return rows
