"""Launch helpers of ``qflash.kernels.common``: the plain-Python grid arithmetic must agree
with Triton's own, tensor-descriptor eligibility must follow the TMA rules, and the cached
launcher must launch what Triton's own call would."""

import pytest
import torch
import triton
import triton.language as tl

from qflash.kernels.common import CachedLauncher, _arg_key, cdiv, next_power_of_2, tma_compatible

from conftest import DEVICE


def test_grid_arithmetic_matches_triton():
    for a in range(0, 300):
        for b in (1, 3, 16, 64, 127, 128):
            assert cdiv(a, b) == triton.cdiv(a, b)
        if a >= 1:  # (for 0 Triton gives 0, a useless block size; ours gives 1)
            assert next_power_of_2(a) == triton.next_power_of_2(a)
    assert next_power_of_2(0) == 1 and next_power_of_2(2**31 + 1) == 2**32


def test_tma_compatible():
    t = torch.zeros(64, 64, dtype=torch.float16)
    assert tma_compatible(t)
    assert not tma_compatible(t.T)  # last stride is not 1
    assert not tma_compatible(t[:, 1:])  # base not 16-byte aligned, row stride fine
    assert not tma_compatible(torch.zeros(64, 63, dtype=torch.float16))  # 126-byte rows
    assert not tma_compatible(torch.zeros(0, 64, dtype=torch.float16))


@triton.jit
def _axpy_kernel(X, Y, Out, n, stride, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs * stride, mask=offs < n)
    y = tl.load(Y + offs * stride, mask=offs < n)
    tl.store(Out + offs * stride, alpha * x + y, mask=offs < n)


def _axpy(launcher, x, y, alpha, stride=1):
    out = torch.full_like(x, float("nan"))
    n = cdiv(x.numel(), stride)
    launcher[(cdiv(n, 64),)](x, y, out, n, stride, alpha, BLOCK=64, num_warps=4)
    return out


def _check_axpy(launcher, device):
    """Misses and hits, with the arguments Triton specializes on changing between calls: an
    integer that becomes 1, a pointer that loses its 16-byte alignment, a stride."""
    # Powers of two for alpha: alpha * x is exact, so a fused multiply-add rounds as torch does.
    for n, offset, stride, alpha in [(1000, 0, 1, 2.0), (1000, 0, 1, -4.0), (1, 0, 1, 2.0), (999, 1, 1, 0.5),
                                     (1000, 0, 3, 0.25), (1000, 0, 1, 8.0), (999, 1, 1, -2.0)]:
        x = torch.randn(n + offset, device=device, dtype=torch.float64)[offset:]
        y = torch.randn(n + offset, device=device, dtype=torch.float64)[offset:]
        out = _axpy(launcher, x, y, alpha, stride)
        want = alpha * x + y
        assert torch.equal(out[::stride], want[::stride]), (n, offset, stride, alpha)


def test_arg_key_tells_apart_what_triton_specializes():
    x = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(x) != _arg_key(x[1:])  # 16-byte alignment
    assert _arg_key(x) != _arg_key(x.to(torch.float16))
    assert _arg_key(1) != _arg_key(16) and _arg_key(2.0) == _arg_key(3.0)  # floats by type, not value
    # Triton's (tl) host descriptors have no layout (Gluon's do): keyed by block and padding
    from triton.tools.tensor_descriptor import TensorDescriptor

    m = torch.zeros(32, 64, dtype=torch.float16)
    desc = TensorDescriptor.from_tensor(m, [16, 64])
    assert _arg_key(desc) == _arg_key(TensorDescriptor.from_tensor(m.clone(), [16, 64]))
    assert _arg_key(desc) != _arg_key(TensorDescriptor.from_tensor(m, [32, 64]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs the tests where there is no GPU")
def test_cached_launcher_in_the_interpreter():
    """Without compiled kernels (Triton's interpreter) every call takes Triton's own path."""
    launcher = CachedLauncher(_axpy_kernel)
    _check_axpy(launcher, "cpu")
    assert not launcher.compiled


@pytest.mark.gpu
def test_gpu_cached_launcher_launches_the_right_kernel():
    """Against the float64 result of every call: one compiled kernel a distinct specialization,
    found again for a key it has seen; a missing argument is named."""
    launcher = CachedLauncher(_axpy_kernel)
    _check_axpy(launcher, "cuda")
    assert len(launcher.compiled) == 4  # n = 1000 aligned, n = 1, misaligned, stride 3 (n = 334)
    x = torch.zeros(4, device="cuda")
    with pytest.raises(TypeError, match="missing argument 'Out'"):
        launcher[(1,)](x, x, BLOCK=64)


@triton.jit(do_not_specialize=["seed"])
def _fill_kernel(Out, n, seed, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Out + offs, (seed + offs).to(tl.float64), mask=offs < n)


@pytest.mark.gpu
def test_gpu_cached_launcher_keys_loose_parameters_by_type():
    """A ``do_not_specialize`` integer (a seed) takes one compiled kernel for every value of its
    integer type, and each launch still gets its own value."""
    launcher = CachedLauncher(_fill_kernel)
    for seed in (1, 16, 12345, 7, 2**31 + 5):
        out = torch.full((64,), float("nan"), device="cuda", dtype=torch.float64)
        launcher[(1,)](out, 64, seed, BLOCK=64)
        assert torch.equal(out, seed + torch.arange(64, device="cuda", dtype=torch.float64)), seed
    assert len(launcher.compiled) == 2  # i32 seeds, one i64 seed


@pytest.mark.gpu
def test_gpu_cached_launcher_calls_launch_hooks_where_there_are_some():
    """Without hooks the cached path skips Triton's launch metadata and hook calls; with one added
    (as a profiler adds its own) every launch, cached or not, calls it with the kernel's name."""
    from triton import knobs

    launcher = CachedLauncher(_fill_kernel)
    out = torch.zeros(64, device="cuda", dtype=torch.float64)
    launcher[(1,)](out, 64, 3, BLOCK=64)  # compiled: the next launches take the cached path
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for seed in (4, 5):
            launcher[(1,)](out, 64, seed, BLOCK=64)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    launcher[(1,)](out, 64, 6, BLOCK=64)
    torch.cuda.synchronize()
    assert seen == ["_fill_kernel", "_fill_kernel"]
    assert torch.equal(out, 6 + torch.arange(64, device="cuda", dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# Tensors on a GPU other than the current one (a model spread over GPUs: transformers'
# device_map="auto"). Triton launches on the current device and its stream; qflash's ops set the
# device of their inputs (ops.common.on_device_of), or the kernels would launch on cuda:0's stream
# with cuda:1's pointers.
# ----------------------------------------------------------------------------------------------
_PUBLIC_OPS = ["flash_attn", "flash_attn_backward", "flash_attn_with_kvcache", "sdpa", "quantize", "int8_matmul",
               "fp8_matmul", "quantized_linear"]


def _public_op(name: str):
    """(inputs made on the CPU from the test's seed, a call of the public op on them -> tensors)."""
    import qflash
    from qflash.nn import QuantizedLinear
    from qflash.ops.common import on_device_of

    if name in ("flash_attn", "flash_attn_backward"):
        q, k, v = (torch.randn(2, 113, 4, 72, dtype=torch.float16) for _ in range(3))
        dout = torch.randn(2, 113, 4, 72, dtype=torch.float16)

        def call(q, k, v, dout):
            if name == "flash_attn":
                return [qflash.flash_attn_func(q, k, v, causal=True)]
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            qflash.flash_attn_func(q, k, v, causal=True, deterministic=True).backward(dout)  # dQ in a fixed order
            return [q.grad, k.grad, v.grad]
        return [q, k, v, dout], call
    if name == "flash_attn_with_kvcache":
        q, k, v = (torch.randn(2, 1, h, 72, dtype=torch.float16) for h in (4, 2, 2))
        k_cache, v_cache = (torch.randn(2, 50, 2, 72, dtype=torch.float16) for _ in range(2))
        lens = torch.tensor([3, 40], dtype=torch.int32)

        def call(q, k_cache, v_cache, k, v, lens):  # the caches as they are after the new keys went in
            out, lse = qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                                      return_softmax_lse=True)
            return [out, lse, k_cache, v_cache]
        return [q, k_cache, v_cache, k, v, lens], call
    if name == "sdpa":
        q, k, v = (torch.randn(2, 4, 63, 64, dtype=torch.bfloat16) for _ in range(3))
        return [q, k, v], lambda q, k, v: [qflash.sdpa(q, k, v, is_causal=True)]
    if name == "quantize":
        return [torch.randn(113, 256, dtype=torch.bfloat16)], lambda x: list(qflash.quantize(
            x, torch.float8_e4m3fn, "block", block_size=(1, 128)))
    if name in ("int8_matmul", "fp8_matmul"):
        dtype = torch.int8 if name == "int8_matmul" else torch.float8_e4m3fn
        a = torch.randint(-100, 100, (113, 256), dtype=torch.int8).to(dtype)
        b = torch.randint(-100, 100, (96, 256), dtype=torch.int8).to(dtype)
        op = getattr(qflash, name)
        return [a, b, torch.rand(113) / 64, torch.rand(96) / 64], lambda a, b, sa, sb: [op(a, b, sa, sb)]
    assert name == "quantized_linear"
    linear = torch.nn.Linear(256, 96, dtype=torch.bfloat16)

    def call(x):
        with on_device_of(x):  # the layer (offline weights) as a user would have made it
            layer = QuantizedLinear.from_linear(linear.to(x.device), "fp8")
        return [layer(x)]
    return [torch.randn(113, 256, dtype=torch.bfloat16)], call


def _late_copies(tensors, device):
    """Copies of ``tensors`` on ``device`` whose current stream writes them only after about 0.1 s,
    over bytes of 0x7F (NaN in float16 / float8, 127 in int8): a kernel launched on another
    stream reads those instead."""
    with torch.cuda.device(device):
        sources = [t.to(device) for t in tensors]
        copies = [torch.empty_like(s) for s in sources]
        for c in copies:
            c.view(torch.uint8).fill_(0x7F)
        torch.cuda.synchronize(device)
        torch.cuda._sleep(200_000_000)
        for c, s in zip(copies, sources):
            c.copy_(s)
    return copies


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (tensors on a GPU not current)")
@pytest.mark.parametrize("name", _PUBLIC_OPS)
def test_gpu_ops_launch_on_their_inputs_gpu(name):
    """With cuda:0 current, each public op on tensors of cuda:1 gives the bits it gives with cuda:1
    current, in cuda:1's stream order (its inputs are written there late), and leaves cuda:0
    current."""
    inputs, call = _public_op(name)
    with torch.cuda.device(1):
        want = [_bits(t) for t in call(*[t.to("cuda:1") for t in inputs])]
    torch.cuda.set_device(0)
    got = call(*_late_copies(inputs, "cuda:1"))
    assert torch.cuda.current_device() == 0
    assert all(t.device == torch.device("cuda:1") for t in got)
    torch.cuda.synchronize(1)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(_bits(g), w), f"output {i}"


# ----------------------------------------------------------------------------------------------
# Meta tensors: a model built on the meta device (shapes only, weights loaded later), and shape
# inference. The ops go to their custom ops' fake implementations, as under torch.compile.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", _PUBLIC_OPS)
def test_ops_on_meta_tensors_give_the_outputs_shapes(name):
    """On meta tensors each public op gives what it gives on real ones, in shape, dtype and strides
    (the backward's gradients too), without launching a kernel (it used to fail in the launch)."""
    inputs, call = _public_op(name)
    real = call(*[t.to(DEVICE) for t in inputs])
    meta = call(*[t.to("meta") for t in inputs])
    assert len(meta) == len(real)
    for i, (m, r) in enumerate(zip(meta, real)):
        assert m.is_meta and (m.shape, m.dtype, m.stride()) == (r.shape, r.dtype, r.stride()), f"output {i}"
