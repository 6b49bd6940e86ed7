"""The numerics contract: error measures, the accuracy rule, poisoning, generators."""

import math

import pytest
import torch

from qflash import testing as T


def test_error_measures():
    ref = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    x = ref + torch.tensor([0.1, 0.0, -0.2], dtype=torch.float64)
    assert T.max_abs_err(x, ref) == pytest.approx(0.2)
    assert T.rel_l2_err(x, ref) == pytest.approx(math.sqrt(0.05) / math.sqrt(14))
    assert T.sqnr_db(x, ref) == pytest.approx(10 * math.log10(14 / 0.05))
    assert T.cosine_similarity(ref, ref) == pytest.approx(1.0)
    assert T.sqnr_db(ref, ref) == math.inf
    assert math.isnan(T.max_abs_err(torch.tensor([math.nan]), torch.tensor([0.0])))  # NaN never passes
    with pytest.raises(ValueError, match="shape mismatch"):
        T.max_abs_err(x[:2], ref)


def test_flash_rule_passes_and_fails():
    ref = torch.randn(100, dtype=torch.float64)
    torch_out = (ref + 1e-3 * torch.randn(100, dtype=torch.float64)).half()
    good = ref.half()
    bad = (ref + 0.1).half()
    assert T.flash_rule(good, ref, torch_out).ok
    res = T.flash_rule(bad, ref, torch_out)
    assert not res.ok and "kernel err" in str(res)
    nan = good.clone()
    nan[3] = math.nan
    assert not T.flash_rule(nan, ref, torch_out).ok
    with pytest.raises(AssertionError, match="out"):
        T.assert_flash_rule(bad, ref, torch_out, what="out")


def test_rounding_floor_scales_with_dtype():
    ref = torch.randn(64, dtype=torch.float64)
    assert T.rounding_floor(ref, torch.float16) > T.rounding_floor(ref, torch.float32) > 0


def test_poisoned_outputs():
    assert not T.poison_enabled()
    with T.poisoned():
        x = T.new_output((3, 4), dtype=torch.float16, device="cpu")
        i = T.new_output((5,), dtype=torch.int32, device="cpu")
        assert torch.isnan(x).all() and (i == -123).all()
        with pytest.raises(AssertionError, match="12 of 12"):
            T.assert_written(x)
    assert not T.poison_enabled()
    T.assert_written(torch.zeros(3))


def test_generators():
    a = T.gaussian((1000,), seed=1)
    assert torch.equal(a, T.gaussian((1000,), seed=1))
    assert 0.9 < float(a.std()) < 1.1 and bool((a != 0).all())
    x = T.gaussian((64, 32), seed=2)
    y = T.with_outlier_channels(x, num=3, scale=50.0, seed=0)
    ratio = y.abs().amax(0) / x.abs().amax(0)
    assert int((ratio > 10).sum()) == 3 and torch.equal(x, T.gaussian((64, 32), seed=2))  # input untouched
    big = T.large_logits((64, 64), seed=3, magnitude=30.0)
    assert float((big @ big.T / 8).abs().max()) > 30
