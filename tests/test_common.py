"""Launch helpers of ``qflash.kernels.common``: the plain-Python grid arithmetic must agree
with Triton's own, tensor-descriptor eligibility must follow the TMA rules, and the cached
launcher must launch what Triton's own call would."""

import pytest
import torch
import triton
import triton.language as tl

from qflash.kernels.common import CachedLauncher, _arg_key, cdiv, next_power_of_2, tma_compatible


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
