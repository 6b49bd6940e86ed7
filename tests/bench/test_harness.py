"""The benchmark harness: what it records about the machine."""

import subprocess

from qflash.bench import harness


def test_gpu_limits_reads_nvidia_smi(monkeypatch):
    """Power limit and top SM clock from nvidia-smi's CSV line; None when nvidia-smi is missing,
    fails or prints something else."""
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="700.00, 1980\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert harness.gpu_limits("GPU-1234") == {"power_limit_w": 700.0, "sm_clock_max_mhz": 1980.0}
    assert seen[0][:3] == ["nvidia-smi", "-i", "GPU-1234"]

    for stdout in ("", "[N/A], 1980\n"):
        monkeypatch.setattr(subprocess, "run", lambda cmd, stdout=stdout, **kw: subprocess.CompletedProcess(
            cmd, 0, stdout=stdout, stderr=""))
        assert harness.gpu_limits("0") == {"power_limit_w": None, "sm_clock_max_mhz": None}

    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(subprocess, "run", missing)
    assert harness.gpu_limits("0") == {"power_limit_w": None, "sm_clock_max_mhz": None}


def test_environment_names_the_machine():
    """Versions and date everywhere; on a GPU also its power limit and top clock (None only where
    nvidia-smi cannot say)."""
    env = harness.environment()
    assert env["torch"] and env["triton"] and env["date"]
    assert ("power_limit_w" in env) == (env["gpu"] is not None)


def test_rotating_calls_each_in_turn():
    """A cold timing's callable runs its calls in turn, one a call, round and round."""
    seen = []
    fn = harness.rotating([lambda i=i: seen.append(i) or i for i in range(3)])
    assert [fn() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0] == seen
    one = lambda: 5  # noqa: E731
    assert harness.rotating([one]) is one  # a single call is timed as it is


def test_cold_copies_cover_four_times_the_l2(monkeypatch):
    """Enough copies of the weights that together they are COLD_L2_MULTIPLE times the L2 (one
    where a single copy is that large)."""
    class Props:
        L2_cache_size = 50 * 2 ** 20

    monkeypatch.setattr(harness.torch.cuda, "get_device_properties", lambda device=None: Props)
    mb = 2 ** 20
    assert harness.COLD_L2_MULTIPLE == 4
    assert harness.cold_copies(16 * mb) == 13 and harness.cold_copies(25 * mb) == 8
    assert harness.cold_copies(200 * mb) == 1 and harness.cold_copies(470 * mb) == 1


def test_weight_copies_are_clones_past_the_first(monkeypatch):
    """Warm: the weights alone. Cold: the weights, then clones of them (same values, other memory),
    as many sets as cold_copies gives for ``nbytes`` or the weights' own bytes."""
    import torch

    w, s = torch.randn(4, 8), torch.randn(4, 1)
    assert harness.weight_copies(False, w, s) == [(w, s)]
    asked = []
    monkeypatch.setattr(harness, "cold_copies", lambda nbytes: asked.append(nbytes) or 3)
    sets = harness.weight_copies(True, w, s)
    assert len(sets) == 3 and sets[0][0] is w and sets[0][1] is s and asked == [w.nbytes + s.nbytes]
    for w_i, s_i in sets[1:]:
        assert torch.equal(w_i, w) and torch.equal(s_i, s) and w_i.data_ptr() != w.data_ptr()
    harness.weight_copies(True, w, nbytes=32)
    assert asked[-1] == 32


def test_in_turn_rotates_and_median_speedup_takes_each_rounds_ratio():
    assert harness.in_turn(3, 3) == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert harness.in_turn(0, 2) == [] and harness.in_turn(2, 1) == [0, 1]
    # ratios peer / ours 3, 0.5, 2: median 2 (the medians' ratio would be 3 / 2)
    assert harness.median_speedup([1.0, 2.0, 3.0], [3.0, 1.0, 6.0]) == 2.0
