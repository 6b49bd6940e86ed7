"""The matmul benchmark's helpers."""

import torch

from qflash.bench.matmul import fp8_operands
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
