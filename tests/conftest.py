"""Test setup: without a GPU, Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so this happens here, at
collection, before any test module imports qflash's kernels.
"""

import os
import re

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


@pytest.fixture(autouse=True)
def _no_replays_from_other_tests():
    # The attention ops' eager forwards replay their launches by the arguments' kinds (ops/attention.py),
    # which do not see a test's monkeypatched plans and tiles: each test records its own.
    from qflash.ops.attention import _EAGER_FORWARDS

    _EAGER_FORWARDS.clear()


def one_graph(fn):
    """``fn`` under torch.compile as one graph (``fullgraph``: a break fails), through AOT autograd
    without code generation (the kernels run as they are), after a fresh dynamo state."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


# torch.library.opcheck's checks of a custom op's fake implementation (outputs' shapes, strides
# and dtypes, also with dynamic shapes); its schema check multiplies the outputs, which PyTorch's
# CPU cannot do for float8.
FAKE_CHECKS = ("test_faketensor", "test_aot_dispatch_dynamic")


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


def sm90_build(module: str, *args, with_offsets: bool = False, **kwargs) -> dict:
    """``module.compile_for_sm90(*args, **kwargs)`` in a fresh Python process: {"ptx", "shared",
    "num_warps"}, and with ``with_offsets`` "smem": its buffers' offsets in shared memory
    (``gluon_common.smem_offsets``).

    Gluon kernels are built away from this process because Triton's interpreter (which the CPU
    tests run on) leaves some of its patches to triton.language in place after calling nested
    @triton.jit functions, and a Gluon build that follows one then fails to compile."""
    import json
    import subprocess
    import sys

    code = ("import importlib, json, sys, torch\n"
            f"kernel = importlib.import_module({module!r}).compile_for_sm90(*{args!r}, **{kwargs!r})\n"
            "smem = None\n"
            + ("from qflash.kernels.gluon_common import smem_offsets\nsmem = smem_offsets(kernel)\n" if with_offsets
               else "")
            + "json.dump({'ptx': kernel.asm['ptx'], 'shared': kernel.metadata.shared,\n"
            "           'num_warps': kernel.metadata.num_warps, 'smem': smem}, sys.stdout)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = os.path.dirname(os.path.abspath(__file__))  # (for modules of the tests, launch_builds)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def barrier_inits(ptx: str) -> dict:
    """{arrival count: [byte offsets]} of the mbarriers a kernel's PTX initializes (each at
    ``global_smem`` plus an immediate, in the order the kernel makes them)."""
    base = re.search(r"mov\.b32\s+(%r\d+), global_smem;", ptx).group(1)
    offsets = {base: 0, **{reg: int(imm) for reg, imm in re.findall(rf"add\.s32\s+(%r\d+), {base}, (\d+);", ptx)}}
    inits = {}
    for reg, count in re.findall(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\], (\d+);", ptx):
        inits.setdefault(int(count), []).append(offsets[reg])
    return inits


def check_chain_eager_and_replayed(chain, check, refresh, times: int = 3) -> None:
    """Kernels launched back to back, each reading what the one before wrote (the early-launch
    tests): ``check(*chain())`` ``times`` times eagerly, then ``chain`` captured in a CUDA graph
    and, ``times`` times, ``refresh()`` of the inputs in place, the first output poisoned (NaN),
    a replay and ``check`` of its outputs. All of it on the graph's capture stream, so that what
    the first calls make (the split-K arrival counts) is made there before the capture, not by a
    kernel inside the graph between two of the chained launches."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(times):
            check(*chain())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = chain()
    for _ in range(times):
        refresh()
        outs[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(*outs)
