"""kernels/replay.py: what ``record`` refuses, and how a replay lays out the tensors a call makes.
Replays of real launches run on the GPU (tests/test_nn.py: a layer's replays against its normal
path, bit for bit)."""

import pytest
import torch

from qflash.kernels.replay import Replay, kind_of, record
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


def test_kind_of_tells_apart_what_launches_depend_on():
    x = _x()
    assert kind_of((x, 2.0, None)) == kind_of((_x(), 2.0, None))
    for other in ((x.t(), 2.0, None), (x[:, 1:], 2.0, None), (x.double(), 2.0, None), (x[:4], 2.0, None),
                  (x, 3.0, None), (x, 2.0, x)):
        assert kind_of(other) != kind_of((x, 2.0, None))


def test_kind_of_tells_apart_inputs_that_share_memory():
    """Views of one tensor (q, k and v of a packed one, one cu_seqlens passed twice) are a kind of
    their own, by where each lies from the first in its memory: a replay reads them there."""
    x, y = _x(), _x()
    assert kind_of((x[:4], x[4:])) == kind_of((y[:4], y[4:])) != kind_of((x[:4], y[4:]))
    assert kind_of((x[:4], x[4:])) != kind_of((x[:4], x[2:6]))
    assert kind_of((x, 1, x)) == kind_of((y, 1, y)) != kind_of((x, 1, y))
    assert kind_of((x[:, 0], x[:, 1])) == kind_of((y[:, 0], y[:, 1]))


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


def test_replay_makes_filled_tensors_filled_again():
    """A tensor the call made by ``full`` (the tests' poison, a path's zeroed sums) is made so again:
    an output by ``full``, an intermediate by a fill of its part of the workspace."""
    x = _x()

    def fn(x):
        torch.empty(5, dtype=torch.float32, device=x.device)
        torch.full((4,), 7, dtype=torch.int32, device=x.device)
        return torch.full((2, 3), 2.5, dtype=torch.float16, device=x.device)

    _, replay = record(fn, [x])
    assert replay.workspace == [0, 256, 512] and replay.filled == [(256, 16, torch.int32, 7)]
    y = replay(x)
    assert torch.equal(y, torch.full((2, 3), 2.5, dtype=torch.float16, device=x.device))


class _FakeRun:
    """A compiled kernel's launcher as ``replay`` reads it: no scratch memory, and a C launch
    function (here one that keeps its arguments)."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True
    calls = []

    @staticmethod
    def launch(*args):
        _FakeRun.calls.append(args)


class _FakeCompiled:
    def __init__(self, signature: dict, metas):
        self.run, self.function, self.packed_metadata = _FakeRun(), 77, "packed"
        self.src = type("Src", (), {"signature": signature})()
        self.metadata = type("Meta", (), {"tensordesc_meta": metas})()


class _FakeDriver:
    """Triton's active driver as ``replay`` uses it: the current stream and TMA encoding."""

    class utils:
        @staticmethod
        def fill_tma_descriptor(address, *fields):
            return ("tma", address, fields[3])

    @staticmethod
    def get_current_stream(index):
        return 1234


class _Desc:
    def __init__(self, base, block):
        self.base, self.shape, self.strides, self.block_shape, self.padding = base, [8, 16], [16, 1], block, "zero"


@pytest.fixture
def fake_driver():
    """Triton's active driver replaced by ``_FakeDriver`` for the test, and no launches noted."""
    from triton.runtime import driver

    saved = driver._active
    driver.set_active(_FakeDriver())
    _FakeRun.calls.clear()
    yield
    driver._active = saved


def _fake_launch(compiled, grid, args) -> None:
    """A launch as ``CachedLauncher`` notes it and Triton's launcher announces it."""
    from triton import knobs

    from qflash.kernels import common

    common.note_launch(compiled, grid, args)
    knobs.runtime.launch_enter_hook(None)


def test_replay_fills_each_launch_with_the_new_pointers(fake_driver):
    """A fake kernel launched with a view of the input, an output, an intermediate, a tensor that
    outlives the call, descriptors over an intermediate and over that tensor, an int and a
    constexpr: the replay passes the new input's and the new tensors' pointers at the recorded
    offsets, encodes the descriptor over the intermediate anew and keeps the rest as recorded."""
    meta = dict(swizzle=0, elem_size=4, elem_type=7, block_size=[4, 16], fp4_padded=False)
    signature = {"X": "*fp32", "Out": "*fp32", "Tmp": "*fp32", "W": "*fp32", "t_desc": "tensordesc<fp32[4, 16]>",
                 "w_desc": "tensordesc<fp32[4, 16]>", "n": "i32", "BLOCK": "constexpr"}
    compiled = _FakeCompiled(signature, [meta, meta])
    weight = torch.randn(8, 16)

    def fn(x):
        out = torch.empty(8, 16)
        tmp = torch.empty(3, 8, 16)
        _fake_launch(compiled, (5,), [x[2:], out, tmp[1], weight, _Desc(tmp[2], [4, 16]), _Desc(weight, [4, 16]),
                                      42, 64])
        return out

    x = torch.randn(12, 16)
    _, replay = record(fn, [x])
    assert replay is not None and len(replay.launches) == 1
    assert replay.kept[0] is weight  # the tensor that outlives the call, held
    x2 = torch.randn(12, 16)
    out2 = replay(x2)
    args = _FakeRun.calls[-1]
    tmp_at = args[15]  # the intermediate's pointer in the new workspace
    assert args[:13] == (5, 1, 1, 1234, 77, False, True, None, None, "packed", None, None, None)
    assert args[13] == x2.data_ptr() + 2 * 16 * 4 and args[14] == out2.data_ptr()
    assert args[16] == weight.data_ptr()
    assert args[17] == ("tma", tmp_at + 8 * 16 * 4, [4, 16])  # t_desc over tmp[2], encoded anew
    assert args[18:22] == (8, 16, 16, 1)
    assert args[22] == ("tma", weight.data_ptr(), [4, 16])  # w_desc, encoded once
    assert args[27:] == (42, 64)
    assert replay.workspace == [0, 3 * 8 * 16 * 4]


def test_replay_gives_a_launch_its_scratch_memory_in_the_workspace(fake_driver):
    """A kernel that takes Triton's scratch memory (tensor descriptors made in the kernel): the
    memory Triton took for it, an intermediate of the call's, has its place in a replay's workspace,
    passed where Triton's launcher passes it. No replay where that memory was not noted, nor for
    a kernel that takes profiling memory."""
    from qflash.kernels import common

    def compiled(**run):
        kernel = _FakeCompiled({"X": "*fp32", "Tmp": "*fp32", "Out": "*fp32"}, None)
        vars(kernel.run).update(global_scratch_align=128, **run)
        return kernel

    def fn(x, kernel, noted=True):
        out, tmp = torch.empty(4, 8), torch.empty(16)
        scratch = torch.empty(2 * 96, dtype=torch.int8)  # what Triton takes: grid x the kernel's size
        if noted:
            common.note_scratch(scratch.data_ptr())
        _fake_launch(kernel, (2,), [x, tmp, out])
        return out

    x = torch.randn(4, 8)
    _, replay = record(fn, [x, compiled(global_scratch_size=96)])
    assert replay is not None and replay.workspace == [0, 256, 512]
    assert replay.launches[0].args[7] is None  # (filled on each replay)
    replay(torch.randn(4, 8))
    args = _FakeRun.calls[-1]
    assert args[7] == args[14] + 256  # the scratch memory, after the intermediate passed as Tmp
    assert record(fn, [x, compiled(global_scratch_size=96), False])[1] is None
    assert record(fn, [x, compiled(profile_scratch_size=64)])[1] is None


def test_replay_reads_inputs_that_share_memory_from_the_first(fake_driver):
    """q, k and v as views of one packed tensor, and one tensor passed twice: a replay on new
    inputs that share memory the same way (their kind: ``kind_of``) reads each at its distance from
    the first input."""
    compiled = _FakeCompiled({"Q": "*fp32", "K": "*fp32", "V": "*fp32", "Cu": "*i32", "CuK": "*i32",
                              "Out": "*fp32"}, None)

    def fn(q, k, v, cu_q, cu_k):
        out = torch.empty(4, 8)
        _fake_launch(compiled, (1,), [q, k, v, cu_q, cu_k, out])
        return out

    def inputs():
        qkv, cu = torch.randn(4, 3, 8), torch.arange(3, dtype=torch.int32)
        return (*qkv.unbind(1), cu, cu)

    _, replay = record(fn, inputs())
    new = inputs()
    out = replay(*new)
    assert _FakeRun.calls[-1][13:] == (*(t.data_ptr() for t in new), out.data_ptr())
    assert new[1].data_ptr() == new[0].data_ptr() + 8 * 4


@pytest.fixture
def as_if_on_gpu(monkeypatch):
    """``Replays`` on the CPU as if the inputs' device were the current GPU with no launch hook."""
    from qflash.kernels import common

    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(common, "stream_handle", lambda device: 0)
    monkeypatch.setattr(common, "launches_hookless", lambda: True)


def test_replays_policy(monkeypatch, as_if_on_gpu):
    """A kind's first call runs the function, its second records it, later ones replay (the
    function is not called); a change of what the launches were made with (``kept``) drops every
    replay; a refused recording is tried again up to MAX_REFUSALS times; at MAX_KINDS kinds the
    oldest goes."""
    from qflash.kernels import replay

    calls = []

    def make(x):
        calls.append(x.shape)
        return torch.empty(x.shape[0], 3)

    def compute(x):
        calls.append(x.shape)
        return x + 1

    replays = replay.Replays()

    def call(fn, x, kept):
        return replays(fn, (x,), kept)

    x = torch.randn(4, 8)
    for _ in range(4):
        assert call(make, x, ("w", 1)).shape == (4, 3)
    assert len(calls) == 2 and len(replays.replays()) == 1  # run, recorded, then replayed twice
    call(make, x, ("w", 2))  # other kept: the replay is gone, the kind starts again
    assert len(calls) == 3 and not replays.replays()
    for _ in range(replay.MAX_REFUSALS + 3):
        assert torch.equal(call(compute, x, ("w", 2)), x + 1)
    def shape(kind):  # the input's shape in a kind
        return kind[0][0][0]

    assert replays.kinds[next(k for k in replays.kinds if shape(k) == x.shape)] == replay.MAX_REFUSALS
    for m in range(5, 5 + replay.MAX_KINDS):  # as many new kinds as are kept
        call(make, torch.randn(m, 8), ("w", 2))
    assert len(replays.kinds) == replay.MAX_KINDS and (4, 8) not in [shape(k) for k in replays.kinds]
    x5 = torch.randn(5, 8)
    call(make, x5, ("w", 2))  # (recorded)
    before = len(calls)
    call(make, x5, ("w", 2))
    assert len(calls) == before  # replayed
    monkeypatch.setattr(replay, "ENABLED", False)
    call(make, x5, ("w", 2))  # replays off: the function runs
    assert len(calls) == before + 1


def test_replays_record_a_new_kind_at_once_after_a_replay(as_if_on_gpu):
    """With ``record_after_replay`` (the attention ops'), a new kind's first call records where the
    call before it replayed: in a decode loop whose steps bring every layer a new key length, a
    step's first layer records and the others replay. After a normal call or a recording a new
    kind takes the normal path, so a run of kinds seen once does not record each of them."""
    from qflash.kernels import replay

    made = []  # the key lengths of the calls that ran the function (normal or recorded)

    def attend(k):
        made.append(k.shape[0])
        return torch.empty(1, 8)

    replays = replay.Replays(record_after_replay=True)

    def step(keys):  # four layers
        for _ in range(4):
            replays(attend, (torch.randn(keys, 8),))

    step(16)
    assert made == [16, 16] and len(replays.replays()) == 1  # normal, recorded, two replays
    for keys in (17, 18, 19):
        step(keys)
        assert made[-1] == keys and made.count(keys) == 1  # recorded at once, three replays
    assert len(replays.replays()) == 4
    for keys in (30, 31, 32, 33):  # kinds seen once: after the replay, one records; then normal calls
        replays(attend, (torch.randn(keys, 8),))
    assert len(replays.replays()) == 5 and made[-4:] == [30, 31, 32, 33]
    plain = replay.Replays()  # (the default: only a kind's second call records)
    for keys in (16, 16, 16, 17, 17):
        plain(attend, (torch.randn(keys, 8),))
    assert len(plain.replays()) == 2 and made[-4:] == [16, 16, 17, 17]  # each kind: normal, then recorded
