"""The experimental Gluon forward kernel (Hopper, warp-specialized): it builds for sm_90 on any
machine, refuses what it does not take, and on the H200 meets the flash-attn rule."""

import math

import pytest
import torch

from qflash.reference import attention_ref
from qflash.testing import assert_flash_rule, assert_written, poisoned

from conftest import DEVICE

gluon = pytest.importorskip("qflash.kernels.attention_gluon")


@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_builds_for_sm90(d, dtype):
    """Compiled offline (no GPU needed): a producer warp and two consumer warpgroups whose
    registers are rebalanced (setmaxnreg), products on wgmma, tiles through TMA."""
    ptx = gluon.compile_for_sm90(d, dtype).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx


def test_refuses_what_it_cannot_take():
    def qkv(b=1, s=128, h=2, d=64, dtype=torch.float16):
        return [torch.randn(b, s, h, d, device=DEVICE).to(dtype) for _ in range(3)]

    q, k, v = qkv()
    cases = [
        ((q, k[:, :, :1], v[:, :, :1]), ValueError, "share one"),
        (qkv(dtype=torch.float32), TypeError, "float16 or bfloat16"),
        (qkv(d=80), ValueError, "head dim"),
        (qkv(s=200), ValueError, "multiple of 128"),
        ([t.expand(65536, -1, -1, -1) for t in qkv(b=1, h=1)], ValueError, "65535"),
        ((q.transpose(1, 2).contiguous().transpose(1, 2), k, v), ValueError, "contiguous"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            gluon.attention_forward_gluon(*args, softmax_scale=0.125)
    if DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="Hopper"):
            gluon.attention_forward_gluon(q, k, v, softmax_scale=0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b,s,h", [(2, 128, 3), (1, 1024, 4), (2, 4224, 2)])
def test_gpu_matches_reference(b, s, h, d, dtype):
    q, k, v = (torch.randn(b, s, h, d, device="cuda").to(dtype) for _ in range(3))
    scale = 1 / math.sqrt(d)
    with poisoned():
        out, lse = gluon.attention_forward_gluon(q, k, v, softmax_scale=scale)
    assert_written(out, "out")
    assert_written(lse, "lse")
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double())
    pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True)
    assert_flash_rule(out, ref, pt)
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-4 * max(1.0, ref_lse.abs().max().item())
