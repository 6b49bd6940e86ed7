"""Quantized layers for inference: ``QuantizedLinear`` and ``quantize_model``.

Weights are quantized once, offline; activations are quantized on the fly by the
fused quantize kernel right before the scaled matmul:

    "int8"     weight per output channel (row of W), activations per token (row of x),
               int8 x int8 -> exact int32 -> scales in the epilogue
    "fp8"      e4m3 with block scales: weight 128 x 128, activations 1 x 128 (DeepSeek-V3),
               float32 promotion every 128-wide K block
    "fp8_row"  e4m3, weight per output channel, activations per token ("FP8 dynamic" in
               vLLM and llm-compressor, torchao's rowwise float8): one scale a row of each
               operand, applied in the epilogue
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn

from qflash.kernels.replay import Replays
from qflash.ops.common import require_runnable
from qflash.ops.matmul import INT8_MAX_K, launch_scaled_matmul
from qflash.ops.quantize import INPUT_DTYPES, launch_quantize
from qflash.reference.quantize import scale_shape

__all__ = ["QuantizedLinear", "quantize_model"]

# mode -> (the quantized dtype, the weight's (granularity, block_size), the activations' (quantized on
# the fly), the product's scales)
_RECIPES = {
    "int8": (torch.int8, ("row", None), ("row", None), "row"),
    "fp8": (torch.float8_e4m3fn, ("block", (128, 128)), ("block", (1, 128)), "block"),
    "fp8_row": (torch.float8_e4m3fn, ("row", None), ("row", None), "row"),
}
MODES = tuple(_RECIPES)


def _weight_recipe(mode: str):
    """(dtype, granularity, block_size) of a mode's quantized weight."""
    dtype, (granularity, block), _, _ = _RECIPES[mode]
    return dtype, granularity, block


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with W stored quantized (``mode`` "int8", "fp8" or "fp8_row": the module's
    docstring). Inference only.

    Buffers: ``weight_q`` (out, in) int8 / float8_e4m3fn, ``weight_scale`` float32 ((out, 1) for
    int8 and fp8_row, (ceil(out/128), ceil(in/128)) for fp8) and ``bias`` float32 (or None); they
    keep these dtypes under ``model.to(dtype)`` / ``.half()`` / ``.bfloat16()`` (only move devices)
    and ``load_state_dict`` (``assign=True`` too; a checkpoint of another mode, whose weight's
    dtype or scales' shape differ, is an error).
    Input (..., in_features) in float16 / bfloat16 / float32; output in ``out_dtype`` (float16,
    bfloat16 or float32), by default the input's dtype.

    Eager calls on a GPU record their launches on the second call of a kind and replay them from
    the third on (``Replays``, kernels/replay.py): the same kernels and outputs, for a quarter
    (FP8) to two fifths (INT8) of the host time at decode sizes (README). Replays are not saved or
    copied with the layer.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, mode: str = "int8",
                 device=None, out_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if out_dtype is not None and out_dtype not in INPUT_DTYPES:
            raise TypeError(f"out_dtype must be None (the input's), float16, bfloat16 or float32, got {out_dtype}")
        if mode == "int8" and in_features > INT8_MAX_K:
            raise ValueError(f"mode 'int8' takes in_features up to {INT8_MAX_K} (beyond, the int32 sums could "
                             f"overflow), got {in_features}: take an fp8 mode")
        self.in_features, self.out_features, self.mode, self.out_dtype = in_features, out_features, mode, out_dtype
        qdtype, granularity, block = _weight_recipe(mode)
        self.register_buffer("weight_q", torch.zeros(out_features, in_features, dtype=qdtype, device=device))
        self.register_buffer("weight_scale", torch.ones(scale_shape(out_features, in_features, granularity, block),
                                                        dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self._replays = Replays()  # eager calls' replays (forward); never saved or copied

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str = "int8",
                    out_dtype: Optional[torch.dtype] = None) -> "QuantizedLinear":
        """Quantize an ``nn.Linear``'s weight (offline) into a new layer on the same device."""
        import qflash

        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, mode, device=w.device,
                    out_dtype=out_dtype)
        qdtype, granularity, block = _weight_recipe(mode)
        w_q, scale = qflash.quantize(w if w.dtype != torch.float64 else w.float(), qdtype, granularity, block)
        layer.weight_q.copy_(w_q)
        layer.weight_scale.copy_(scale)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach().float())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("QuantizedLinear is for inference: call it under torch.no_grad() or inference_mode()")
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"expected input (..., {self.in_features}), got {getattr(x, 'shape', type(x).__name__)}")
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(f"input must be float16, bfloat16 or float32, got {x.dtype}")
        # The buffers read once, from the dict: each ``self.weight_q`` goes through Module.__getattr__'s
        # Python, which an eager decode step pays in every layer (the layer's host time: README).
        buffers = self._buffers
        weight_q = buffers["weight_q"]
        if x.device != weight_q.device:
            raise ValueError(f"input is on {x.device} but the layer is on {weight_q.device}")
        require_runnable("x", x)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.is_cuda and x2.numel() and not torch.compiler.is_compiling():
            # Eager on a GPU: the second call of a kind records its launches, later ones replay them
            # with the new pointers (kernels/replay.py): at decode sizes the host's Python, not the
            # kernels, sets a layer's pace.
            bias = buffers["bias"]
            kept = (weight_q.data_ptr(), buffers["weight_scale"].data_ptr(), bias is not None and bias.data_ptr(),
                    self.out_dtype, self.mode)
            y = self._replays(lambda x: self._product(x, buffers), (x2,), kept)
        else:
            y = self._product(x2, buffers)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _product(self, x2: torch.Tensor, buffers: dict) -> torch.Tensor:
        """Quantize x2 (M, in) and multiply: straight to the launch paths, since the public ops
        would re-validate the layer's own buffers (checked when made or loaded) on every call,
        which costs as much as a short kernel."""
        qdtype, _, (granularity, block), scales = _RECIPES[self.mode]
        x_q, x_scale = launch_quantize(x2, qdtype, granularity, block, None)
        return launch_scaled_matmul(x_q, buffers["weight_q"], x_scale, buffers["weight_scale"], buffers["bias"],
                                    self.out_dtype or x2.dtype, scales)

    def __getstate__(self):
        """Pickles and deep copies leave the replays behind: they hold compiled kernels and the
        buffers' addresses. (Their copies record their own.)"""
        return {**super().__getstate__(), "_replays": Replays()}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_replays", Replays())  # a layer pickled before replays were

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A checkpoint's buffers are checked before ``Module`` copies them in (or, with
        ``load_state_dict(..., assign=True)``, takes them as they are). The quantized weight must
        already be in this layer's dtype: a copy would turn float8 codes into int8 ones, or the
        reverse, without a word. The scales and bias must be floating point; where they are not
        contiguous float32 (as the kernels read them), a float32 copy of them is what loads."""
        qdtype = _weight_recipe(self.mode)[0]
        weight_q = state_dict.get(prefix + "weight_q")
        if isinstance(weight_q, torch.Tensor) and weight_q.dtype != qdtype:
            error_msgs.append(f"{prefix}weight_q is {weight_q.dtype} in the checkpoint, but this layer (mode "
                              f"{self.mode!r}) holds {qdtype}: make the layer in the checkpoint's mode")
            return
        weight_scale = state_dict.get(prefix + "weight_scale")
        if isinstance(weight_scale, torch.Tensor) and weight_scale.shape != self.weight_scale.shape:
            # (FP8 block scales, or FP8 row scales: the weight's dtype alone does not tell the modes apart)
            error_msgs.append(f"{prefix}weight_scale is {tuple(weight_scale.shape)} in the checkpoint, but this "
                              f"layer (mode {self.mode!r}) holds {tuple(self.weight_scale.shape)}: make the layer in "
                              f"the checkpoint's mode")
            return
        fixed = {}
        for name in ("weight_scale", "bias"):
            value = state_dict.get(prefix + name)
            if not isinstance(value, torch.Tensor):
                continue
            if not value.is_floating_point():
                error_msgs.append(f"{prefix}{name} is {value.dtype} in the checkpoint; expected floating point")
                return
            if value.dtype != torch.float32 or not value.is_contiguous():
                fixed[prefix + name] = value.to(torch.float32, memory_format=torch.contiguous_format)
        if fixed:
            state_dict = {**state_dict, **fixed}  # the caller's dict stays as it was
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        """``Module.to(dtype)``, ``.half()``, ``.bfloat16()`` and the like cast every floating-point
        buffer, float8 included: the quantized weight, its float32 scales and the float32 bias would
        become 16-bit (scales rounded, and float8 weights the kernels do not take). Here they move
        where ``fn`` moves them (device) and keep their dtypes; the output still follows the input's
        dtype (or ``out_dtype``)."""
        kept = {name: buf for name, buf in self._buffers.items() if buf is not None}
        self._replays.clear()  # they hold the buffers where they were
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            moved = self._buffers[name]
            if moved.dtype != buf.dtype:  # a cast: redo it as a move of the original
                self._buffers[name] = buf.to(moved.device)
        return self

    def extra_repr(self) -> str:
        out = f", out_dtype={self.out_dtype}" if self.out_dtype is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, mode={self.mode}{out}"


def quantize_model(model: nn.Module, mode: str = "int8", *, skip: Iterable[str] = ()) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a ``QuantizedLinear`` of ``mode`` ("int8",
    "fp8" or "fp8_row": the module's docstring); returns ``model``, or a new ``QuantizedLinear``
    where ``model`` is itself an ``nn.Linear`` (it cannot be replaced in place: use what is returned).

    ``skip`` lists module names (as in ``named_modules``) to leave alone, e.g. ``["lm_head"]``.
    One layer registered under several names (a shared layer) becomes one quantized layer in every
    place that is not skipped. A subclass of ``nn.Linear`` with a forward of its own (LoRA wrappers
    and the like) cannot be replaced faithfully: it raises, naming the layer, unless skipped.
    ``nn.MultiheadAttention``'s ``out_proj`` stays as it is (as in ``torch.ao``'s dynamic
    quantization): MHA reads its weight itself and never calls the layer. An
    ``nn.TransformerEncoderLayer``'s layers raise unless skipped: its fast path reads their weights.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    skip = set(skip)
    targets = []
    # Every name, not only a module's first one: a layer shared by two parents has a place in each.
    for name, module in model.named_modules(remove_duplicate=False):
        if name in skip or not isinstance(module, nn.Linear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if name else None  # None: the model is this layer
        if isinstance(parent, nn.MultiheadAttention):  # its out_proj: MHA reads the weight, never calls it
            continue
        if isinstance(parent, nn.TransformerEncoderLayer):
            raise TypeError(f"quantize_model: layer {name!r} belongs to an nn.TransformerEncoderLayer, whose inference "
                            f"fast path reads its weight itself; qflash cannot replace it (pass skip=[{name!r}])")
        if type(module) not in (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear):
            raise TypeError(f"quantize_model: layer {name!r} is a {type(module).__name__}, a subclass of nn.Linear "
                            f"with its own behaviour; qflash replaces plain nn.Linear only (pass skip=[{name!r}])")
        if not module.weight.is_floating_point():
            raise TypeError(f"quantize_model: layer {name!r} has a {module.weight.dtype} weight; expected floats")
        if mode == "int8" and module.in_features > INT8_MAX_K:
            raise ValueError(f"quantize_model: layer {name!r} has in_features = {module.in_features}, over the "
                             f"{INT8_MAX_K} that int8's int32 sums can take (pass skip=[{name!r}] or an fp8 mode)")
        targets.append((parent, child, module))
    if [parent for parent, _, _ in targets] == [None]:  # the model is one nn.Linear
        return QuantizedLinear.from_linear(model, mode)
    quantized = {}  # id of a float layer -> its quantized layer, made once however often it is shared
    for parent, child, module in targets:
        if id(module) not in quantized:
            quantized[id(module)] = QuantizedLinear.from_linear(module, mode)
        setattr(parent, child, quantized[id(module)])
    return model
