"""The matmul benchmark's helpers."""

import torch

import qflash.bench.matmul as bench
from qflash.bench.matmul import fp8_operands, ratio_rows
from qflash.reference.quantize import quantize_ref
from qflash.testing import same_bits

from conftest import DEVICE


def test_fp8_operands_are_the_public_quantize_of_each_kind():
    """(a_q, b_q, a_scale, b_scale) per kind of scaling, in the order the products take them, as
    quantize gives them (1 x 128 blocks for A, 128 x 128 for B)."""
    a, b = torch.randn(5, 256, device=DEVICE), torch.randn(130, 256, device=DEVICE)
    ops = fp8_operands(a, b)
    assert list(ops) == ["tensor", "row", "block"]
    for kind, blocks in (("tensor", (None, None)), ("row", (None, None)), ("block", ((1, 128), (128, 128)))):
        a_q, b_q, a_s, b_s = ops[kind]
        for x, x_q, x_s, block in ((a, a_q, a_s, blocks[0]), (b, b_q, b_s, blocks[1])):
            ref_q, ref_s = quantize_ref(x, torch.float8_e4m3fn, kind, block)
            assert same_bits(x_q, ref_q) and torch.equal(x_s.reshape(ref_s.shape), ref_s), kind
    assert ops["block"][2].shape == (5, 2) and ops["block"][3].shape == (2, 2)
    assert list(fp8_operands(a, b, ("block",))) == ["block"]


def test_rounds_time_the_providers_in_turn_and_keep_the_median(monkeypatch):
    """``run(rounds=3)``: each round times every provider, starting one further along; a row's
    times are the medians of its rounds, which it keeps; a failure in any round is the row."""
    order, times = [], {"bf16 matmul": [3.0, 1.0, 2.0], "qflash fp8 (tensor)": [4.0, 8.0, 6.0],
                        "qflash fp8 (row x col)": [1.0, 1.0, 1.0]}

    def fake_time_row(name, fn, ref, m, n, k, device, **extra):
        order.append(name)
        ms = times[name][sum(1 for o in order if o == name) - 1]
        error = "WRONG RESULT" if name == "qflash fp8 (row x col)" and len(order) > 3 else None
        return dict(provider=name, m=m, n=n, k=k, ms=ms, ms_graph=ms / 2, rel_err=0.01, tflops=None,
                    tflops_graph=None, error=error, **extra)

    monkeypatch.setattr(bench, "_time_row", fake_time_row)
    names = list(times)
    rows = bench.run([(16, 64, 128)], DEVICE, providers=names, rounds=3)
    assert order == names + names[1:] + names[:1] + names[2:] + names[:2]
    assert [row["provider"] for row in rows] == names
    assert rows[0]["ms"] == 2.0 and rows[0]["rounds_ms"] == [3.0, 1.0, 2.0] and rows[0]["ms_graph"] == 1.0
    assert rows[0]["tflops"] == 2 * 16 * 64 * 128 / 2e-3 / 1e12 and rows[1]["ms"] == 6.0
    assert rows[2]["error"] == "WRONG RESULT" and "rounds_ms" not in rows[2]
    order.clear()
    single = bench.run([(16, 64, 128)], DEVICE, providers=names[:1])
    assert single[0]["ms"] == 3.0 and "rounds_ms" not in single[0]
    assert bench.run([(16, 64, 128)], DEVICE, providers=["no such provider"], rounds=2) == []


def test_ratios_are_the_median_of_each_rounds_own():
    """With both rows' rounds, a ratio is the median of the rounds' ratios (here 2, where the
    medians' ratio is 1.5); a row without rounds, or a failed one, falls back or gives none."""
    def row(provider, ms, rounds=None, error=None):
        return dict(provider=provider, m=16, n=64, k=128, ms=ms, error=error,
                    **({"rounds_ms": rounds} if rounds else {}))

    ours, cublas, block = "qflash fp8 (tensor)", "torch._scaled_mm (tensor)", "qflash fp8 (block)"
    rows = [row(ours, 2.0, [1.0, 2.0, 3.0]), row(cublas, 3.0, [3.0, 1.0, 6.0]), row(block, 4.0)]
    ratios = ratio_rows(rows)[0]
    assert ratios["fp8 tensor / _scaled_mm"] == 2.0 and ratios["fp8 block / our tensor"] == 0.5
    assert ratios["fp8 row / _scaled_mm row"] is None
    rows[1]["error"] = "WRONG RESULT"
    assert ratio_rows(rows)[0]["fp8 tensor / _scaled_mm"] is None


def test_mlp_blocks_are_timed_in_turn_and_speedups_are_the_rounds_median(monkeypatch):
    """``mlp_rows(rounds=3)``: the four blocks of an M are timed in turn, each round starting one
    further along; a row keeps its rounds' times and their medians, a speedup is the median of the
    rounds' own (int8's 2, where the medians' ratio is 4 / 3), and every block computes the
    product. Cold, each block rotates through copies of itself, as many as its bytes ask for."""
    order, times = [], {"bf16": [3.0, 1.0, 2.0], "int8": [1.5, 2.0, 0.5], "fp8": [2.0, 2.0, 2.0],
                    "fp8_row": [1.0, 1.0, 1.0]}

    def fake_model_time(name, fn, device):
        order.append(name)
        assert fn().shape == (4, 128)
        ms = times[name][sum(1 for o in order if o == name) - 1]
        return dict(ms=ms, ms_graph=None)

    monkeypatch.setattr(bench, "_model_time", fake_model_time)
    rows = bench.mlp_rows([4], DEVICE, d=128, hidden=256, rounds=3)
    names = list(times)
    assert order == names + names[1:] + names[:1] + names[2:] + names[:2]
    by_model = {row["model"]: row for row in rows}
    assert by_model["int8"]["rounds_ms"] == [1.5, 2.0, 0.5] and by_model["int8"]["ms"] == 1.5
    assert by_model["int8"]["speedup_vs_bf16"] == 2.0 and by_model["fp8"]["speedup_vs_bf16"] == 1.0
    assert by_model["fp8_row"]["speedup_vs_bf16"] == 2.0
    assert by_model["bf16"]["speedup_vs_bf16"] == 1.0 and "speedup_graph" not in by_model["bf16"]
    assert all(row["copies"] == 1 and row["weights"] == "warm" for row in rows)
    assert by_model["int8"]["sqnr_db"] > 25 and by_model["bf16"]["sqnr_db"] > 100
    order.clear()
    asked = []
    monkeypatch.setattr(bench, "cold_copies", lambda nbytes: asked.append(nbytes) or 2)
    cold = bench.mlp_rows([4], DEVICE, d=128, hidden=256, weights="cold")
    assert order == names and all(row["copies"] == 2 and row["weights"] == "cold" for row in cold)
    # float32 weights of 2 x 128 x 256 values; the 8-bit ones a quarter of that, with their scales
    assert asked[0] == 2 * 128 * 256 * 4 and all(2 * 128 * 256 <= b < 2 * 128 * 256 * 1.1 for b in asked[1:])
