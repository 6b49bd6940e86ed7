"""The qflash command line, run as a user would (a subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    for word in ("torch", "triton", "interpreter", "flash_attn_func", "transformers"):
        assert word in r.stdout


def test_demo_small(tmp_path):
    png = tmp_path / "demo.png"
    r = qflash("demo", "--seqlens", "64,96", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "error against a float64 reference" in r.stdout
    assert "128k" in r.stdout and "GiB" in r.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_demo_leaves_out_naive_attention_where_it_does_not_fit(monkeypatch, capsys, tmp_path):
    """Where naive attention's N x N tensors need more than the free memory, the demo says so and
    shows qflash's row (it used to fail inside the naive side, or the float64 reference, with a
    traceback: `qflash demo --seqlens 100000`)."""
    from qflash import cli

    # naive needs 3 x heads x N^2 x 2 bytes, which may take 90 % of the free memory: N = 64 fits, 96 does not
    heads = cli.DEMO_HEADS_DIM[torch.cuda.is_available()][0]
    monkeypatch.setattr(cli, "_free_bytes", lambda device: 2 * cli.NAIVE_SQUARES * heads * 64 * 64 * 2)
    monkeypatch.setenv("COLUMNS", "200")
    png = tmp_path / "demo.png"
    assert cli.main(["demo", "--seqlens", "64,96", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip(" │").startswith(("64 ", "96 "))]
    assert len(rows) == 2 and "needs" not in rows[0] and "needs ~" in rows[1] and "more than is free" in rows[1]
    assert rows[1].count("e-0") == 1  # qflash's error, measured; naive's is "-"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_demo_reference_in_blocks_of_rows_is_the_one_piece():
    """The demo's float64 reference, a block of query rows at a time (so that it fits at any N),
    gives the numbers of attention_ref in one piece."""
    from qflash import cli
    from qflash.reference import attention_ref

    q, k, v = (torch.randn(1, 37, 2, 8, dtype=torch.float16) for _ in range(3))
    whole = attention_ref(q.double(), k.double(), v.double(), causal=True)[0]
    for budget in (1, 2 * 4 * 2 * 37 * 8 * 5, 2**30):  # a row, five rows, everything at a time
        torch.testing.assert_close(cli._reference(q, k, v, budget=budget), whole, rtol=1e-15, atol=1e-15)


def test_demo_explain():
    r = qflash("demo", "--explain")
    assert r.returncode == 0, r.stderr
    assert "alpha" in r.stdout and "acc / l" in r.stdout


def test_check_quick():
    r = qflash("check", "--quick")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failed" in r.stdout and "flash_attn_varlen_func" in r.stdout and "sdpa" in r.stdout


def test_bench_quick_json(tmp_path):
    out = tmp_path / "bench.json"
    r = qflash("bench", "attention", "--quick", "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert {"date", "torch", "triton", "gpu"} <= set(result["env"])
    rows = result["rows"]
    # (On a CPU the quick run is qflash beside naive attention; on a GPU beside SDPA's backends.)
    expected = {"qflash", "sdpa_flash"} if torch.cuda.is_available() else {"qflash", "naive"}
    assert {r["provider"] for r in rows} >= expected
    for row in rows:
        assert {"provider", "seqlen", "head_dim", "causal", "tflops", "tflops_exact", "gbps", "ms", "max_err",
                "check", "error"} <= set(row)
        if row["error"] is None:
            assert row["check"] == "ok" and row["ms"] > 0 and row["tflops"] > 0
    assert (tmp_path / "bench.png").exists()
    # --quick picks short lists only for what the command line leaves unsaid (it used to override them)
    r = qflash("bench", "attention", "--quick", "--seqlens", "48", "--providers", "qflash", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert {row["seqlen"] for row in json.loads(out.read_text())["rows"]} == {48}


def test_bench_matmul_and_quantize_quick(tmp_path):
    out = tmp_path / "mm.json"
    r = qflash("bench", "matmul", "--quick", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    qrows = [row for row in rows if row["provider"].startswith("qflash")]
    # 4 schemes, each as the kernel alone and with the activation quantize (+q); on Hopper also each
    # kernel alone wherever the public functions send a product (4 Gluon, 3 tl)
    from qflash.kernels.common import is_hopper

    hopper = torch.cuda.is_available() and is_hopper(torch.device("cuda"))
    assert len(qrows) == (15 if hopper else 8) and all(row["error"] is None and row["rel_err"] < 0.06 for row in qrows)
    ratios = json.loads(out.read_text())["ratios"]
    assert len(ratios) == 1 and ratios[0]["fp8 block / our tensor"] > 0
    out = tmp_path / "acc.json"
    r = qflash("bench", "quantize", "--accuracy", "--quick", "--out", str(out))
    assert r.returncode == 0, r.stderr
    acc = json.loads(out.read_text())["accuracy"]
    # Kernel error apart from the quantization's: float32 rounding, but on the GPU FP8 products keep
    # Hopper's FP8 sum precision (about 1e-4 here, as cuBLAS's: test_gpu_fp8_as_accurate_as_cublas)
    bound = {row["scheme"]: 5e-4 if torch.cuda.is_available() and "fp8" in row["scheme"] else 1e-5 for row in acc}
    assert len(acc) == 10 and all(row["kernel_rel_err"] < bound[row["scheme"]] for row in acc), acc


def test_bad_command_and_flag():
    r = qflash("nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = qflash("demo", "--bogus")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr
    r = qflash("bench", "softmax")
    assert r.returncode != 0 and "unknown op 'softmax'" in r.stderr
    r = qflash("bench", "attention", "--providers", "qflash,nope")
    assert r.returncode == 2 and "unknown provider" in r.stderr
    # names bench matmul does not have (it used to time none of them and print an empty table)
    r = qflash("bench", "matmul", "--quick", "--providers", "bf16 matmul,nope")
    assert r.returncode == 2 and "argument --providers: unknown name(s) ['nope']" in r.stderr
    assert "choose from bf16 matmul" in r.stderr
    r = qflash("bench", "matmul", "--quick", "--rounds", "0")
    assert r.returncode == 2 and "argument --rounds: takes a positive integer, got 0" in r.stderr
    r = qflash("bench", "matmul", "--tiles", "--kinds", "fp8 tensor,int4")
    assert r.returncode == 2 and "argument --kinds: unknown name(s) ['int4']; choose from int8 row" in r.stderr
    r = qflash("bench", "attention", "--tiles", "--backward", "--vary", "dq,dv")
    assert r.returncode == 2 and "argument --vary: unknown name(s) ['dv']; choose from dq, dkdv" in r.stderr
    for command, option, bad in [(("bench", "attention"), "--seqlens", "a,b"),
                                 (("bench", "attention"), "--head-dims", "64,-1"),
                                 (("bench", "matmul"), "--shapes", "1,2"),
                                 (("bench", "matmul"), "--shapes", "64,64,64;a,b,c"),
                                 (("bench", "quantize"), "--shape", "8,8,0"), (("demo",), "--seqlens", "0,64"),
                                 (("demo",), "--seqlens", "64,,128")]:
        r = qflash(*command, option, bad)
        assert r.returncode == 2 and f"argument {option}: takes" in r.stderr and "positive integers" in r.stderr, \
            (option, bad, r.stderr[-300:])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only message")
def test_bench_gpu_only_options():
    r = qflash("bench", "attention", "--memory")
    assert r.returncode == 2 and "CUDA GPU" in r.stderr
    r = qflash("bench", "matmul", "--quick", "--weights", "cold")
    assert r.returncode == 2 and "--weights cold" in r.stderr and "CUDA GPU" in r.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and "qflash demo" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_check_exit_code_reports_failures(monkeypatch, capsys):
    import qflash.check
    from qflash import cli

    def failing(quick=False, seed=0):
        return [dict(op="flash_attn_func", case="planted failure", kernel_err=1.0, torch_err=1e-3, bound=3e-3,
                     ok=False, error=None)]

    monkeypatch.setattr(qflash.check, "run_check", failing)
    assert cli.main(["check", "--quick"]) == 1
    assert "0 passed, 1 failed" in capsys.readouterr().out
