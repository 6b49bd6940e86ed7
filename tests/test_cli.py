"""The qflash command line, run as a user would (a subprocess)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def qflash(*args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "160"
    return subprocess.run([sys.executable, "-m", "qflash.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_info():
    r = qflash("info")
    assert r.returncode == 0, r.stderr
    for word in ("torch", "triton", "interpreter", "flash_attn_func"):
        assert word in r.stdout


def test_demo_small():
    r = qflash("demo", "--seqlens", "64,96")
    assert r.returncode == 0, r.stderr
    assert "error against a float64 reference" in r.stdout
    assert "128k" in r.stdout and "GiB" in r.stdout


def test_bad_command_and_flag():
    r = qflash("nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = qflash("demo", "--bogus")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr
    r = qflash("bench", "matmul")
    assert r.returncode != 0 and "unknown op 'matmul'" in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only message")
def test_bench_needs_a_gpu():
    r = qflash("bench", "attention", "--quick")
    assert r.returncode == 2 and "no CUDA device" in r.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and "qflash demo" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
