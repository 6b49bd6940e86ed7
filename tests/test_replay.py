"""kernels/replay.py: what ``record`` refuses, and how a replay lays out the tensors a call makes.
Replays of real launches run on the GPU (tests/test_nn.py: a layer's replays against its normal
path, bit for bit)."""

import torch

from qflash.kernels.replay import Replay, record
from qflash.testing import new_output

from conftest import DEVICE


def _x():
    return torch.randn(8, 16, device=DEVICE)


def test_record_refuses_calls_that_compute_or_write():
    x = _x()
    for fn in (lambda x: x + 1, lambda x: x.clone(), lambda x: torch.zeros_like(x),
               lambda x: new_output((8, 16), dtype=x.dtype, device=x.device).copy_(x)):
        result, replay = record(fn, [x])
        assert isinstance(result, torch.Tensor) and replay is None


def test_record_refuses_outputs_that_are_not_whole_tensors_it_made():
    x = _x()
    for fn in (lambda x: x, lambda x: x[:, :4], lambda x: new_output((8, 32), dtype=x.dtype, device=x.device)[:, :16],
               lambda x: new_output((16, 8), dtype=x.dtype, device=x.device).t()):
        assert record(fn, [x])[1] is None


def test_replay_makes_outputs_anew_and_packs_intermediates():
    """Outputs come back as new tensors of the recorded shapes and dtypes; the intermediates share
    one workspace, each at an offset aligned for Triton's 16-byte specialization."""
    x = _x()

    def fn(x):
        new_output((3, 5), dtype=torch.int8, device=x.device)  # an intermediate of 15 bytes
        new_output((7,), dtype=torch.float32, device=x.device)
        return new_output((8, 4), dtype=torch.bfloat16, device=x.device), new_output((2,), dtype=torch.int32,
                                                                                     device=x.device)

    (a, b), replay = record(fn, [x])
    assert isinstance(replay, Replay) and not replay.launches
    assert replay.workspace == [0, 256, 512]
    a2, b2 = replay(x)
    assert (a2.shape, a2.dtype, b2.shape, b2.dtype) == (a.shape, a.dtype, b.shape, b.dtype)
    assert a2.data_ptr() != a.data_ptr()
