"""The package's front door (``qflash/__init__.py``): public names load on first use, and
importing qflash does no work (no triton, no GPU)."""

import importlib
import subprocess
import sys

import pytest

import qflash


def test_import_does_no_work():
    code = ("import sys, torch, qflash; names = dir(qflash); "
            "assert 'triton' not in sys.modules, 'triton imported'; "
            "assert not torch.cuda.is_initialized(), 'CUDA initialized'; print(len(names))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert int(out) == len(qflash.__all__)


def test_public_names_are_their_modules_objects():
    assert sorted(dir(qflash)) == sorted(qflash.__all__) and "__version__" in qflash.__all__
    for name, module in qflash._LAZY.items():
        assert getattr(qflash, name) is getattr(importlib.import_module(module), name)
    for name in qflash._SUBMODULES:
        assert getattr(qflash, name) is importlib.import_module(f"qflash.{name}")
    with pytest.raises(AttributeError, match="module 'qflash' has no attribute 'flash_attention'"):
        qflash.flash_attention
