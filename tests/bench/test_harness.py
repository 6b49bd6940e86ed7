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
