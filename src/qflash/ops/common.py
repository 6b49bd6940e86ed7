"""Checks every public op shares."""

from __future__ import annotations

import contextlib
import os

import torch


_DEBUG = [os.environ.get("QFLASH_DEBUG", "") not in ("", "0")]


def set_debug(enabled: bool = True) -> None:
    """Also validate tensor *contents* (cu_seqlens, static scales), at the cost of a host sync per call."""
    _DEBUG[0] = bool(enabled)


def debug_enabled() -> bool:
    return _DEBUG[0]


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def require_runnable(name: str, t: torch.Tensor) -> None:
    """The kernels run on CUDA tensors, or anywhere in Triton's interpreter; on meta tensors the
    ops give their outputs' shapes and dtypes (their custom ops' fake implementations)."""
    if t.device.type not in ("cuda", "meta") and not interpreter_on():
        raise RuntimeError(
            f"qflash kernels run on CUDA tensors; {name} is on {t.device}. On a CPU-only machine, "
            "set TRITON_INTERPRET=1 before triton is imported to run them in Triton's interpreter."
        )


def require_tensor(name: str, t, ndim: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {what}, got shape {tuple(t.shape)}")


def through_custom_op(t: torch.Tensor) -> bool:
    """Whether a launch path goes through its ``torch.library`` custom op rather than straight to
    the launcher: under torch.compile (the graph records the op) and on meta tensors (the op's fake
    implementation gives the outputs' shapes, dtypes and strides without a kernel). Eager calls on
    real tensors skip the op's dispatch, which costs as much as a short kernel."""
    return torch.compiler.is_compiling() or t.is_meta


_NO_SWITCH = contextlib.nullcontext()  # on_device_of's context where nothing switches (reentrant: one serves all)


def on_device_of(t: torch.Tensor):
    """A context in which t's GPU is the current CUDA device, the caller's restored after. Triton
    launches on the current device and its current stream, not on the arguments' (flash-attn sets
    its CUDAGuard for the same reason): a model spread over GPUs (transformers' device_map="auto")
    calls with tensors on cuda:1 while cuda:0 is current. Where t's device is already current (the
    common case) nothing is switched: ``torch.cuda.device`` costs about 5 us of host time a call
    on the H200's host, as much as a decode-sized kernel runs (s57a)."""
    device = t.device
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return _NO_SWITCH
    return torch.cuda.device(device)

