"""Test setup: without a GPU, Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so this happens here, at
collection, before any test module imports qflash's kernels.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    # Fresh but reproducible inputs per test.
    torch.manual_seed(1234)


def ptxas_report(ptx: str) -> str:
    """What Triton's bundled ptxas says (-v: registers, spills, warnings) assembling ``ptx`` for sm_90a."""
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr
