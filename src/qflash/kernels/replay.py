"""Replayed launches: a call's kernel launches recorded once, then launched again with new pointers.

An eager call of a short product is bound by the host, not by the GPU: an FP8 ``QuantizedLinear``
at M = 16 took 145 us of host time a call for kernels that ran about 19 us (session 57). Most of it
is Python that gives the same answer on every call with the same shapes: checks, plans, Triton's
handling of 35 arguments, six tensor descriptors made and encoded. ``record`` calls a function once
and notes each kernel it launches (through ``common.CachedLauncher``) and each tensor it makes; the
``Replay`` it returns launches the same compiled kernels with the same arguments, except the
pointers that change from call to call:

    inputs         the caller's tensors                    their data pointers, plus the offset
    outputs        tensors the call made and returned      made anew (``testing.new_output``)
    intermediates  tensors made and dropped (the quantized one workspace made anew, each at its
                   activation, its scales, split-K sums)   recorded offset

Everything else is kept from the recorded call: integers, compiled kernels, grids, and the
pointers and tensor descriptors (encoded once) of tensors that outlive the call, such as a
layer's weights; the replay holds those tensors.

``record`` returns no replay where one could do other than a call:
- an aten op that computes (a copy, a cast, a fill of an existing tensor) instead of making a
  tensor (``empty``, ``empty_strided``, ``full``) or a view of one: a replay runs kernels only;
- a Triton launch that did not go through ``CachedLauncher`` (launch hooks count them);
- a grid that is not a tuple, a kernel that takes Triton's scratch memory, a launcher this Triton
  does not build as expected;
- an output that is not a whole contiguous tensor the call made.
A replay is only as good as its key: the caller keys it by everything the launches depend on
(shapes, strides, dtypes, 16-byte alignment, device, stream, switches such as ``common.PDL``) and
by the pointers of the tensors it keeps (``QuantizedLinear``: its buffers).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qflash.testing import new_output

aten = torch.ops.aten

# Ops that make a tensor without reading one (``full`` is how tests poison new outputs)
_FACTORIES = (aten.empty.memory_format, aten.empty_strided.default, aten.full.default)
_ALIGN = 256  # bytes between the intermediates in a replay's one workspace (Triton specializes on 16)
_BASE_ARGS = 13  # what Triton 3.6's C launcher takes before the kernel's own arguments (grid, stream, ...)

_RECORDING = threading.local()  # .launches: the list a ``record`` in this thread fills, else None


def note_launch(compiled, grid: tuple, values: list) -> None:
    """``CachedLauncher``'s report of a launch (a compiled kernel, its grid, its arguments in the
    kernel's order), kept where a ``record`` runs in this thread."""
    launches = getattr(_RECORDING, "launches", None)
    if launches is not None:
        launches.append((compiled, grid, values))


class _MadeTensors(TorchDispatchMode):
    """Logs the tensors a call makes, and the first aten op that does more than make or view one."""

    def __init__(self):
        super().__init__()
        self.made = []
        self.computed = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FACTORIES:
            self.made.append(out)
        elif not func.is_view and self.computed is None:
            self.computed = func
        return out


@contextlib.contextmanager
def _counting_launches():
    """A list that counts Triton's launches in this block (its launch-enter hook)."""
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(1)

    hooks = knobs.runtime.launch_enter_hook
    hooks.add(hook)
    try:
        yield seen
    finally:
        hooks.remove(hook)


def record(fn, inputs: Sequence[torch.Tensor]) -> Tuple[object, Optional["Replay"]]:
    """``fn(*inputs)``, and a ``Replay`` of its launches (None where it cannot have one: see the
    module docstring). ``fn`` returns a tensor or a tuple of tensors; ``inputs`` are CUDA tensors
    on the current device, whose kernels launch on its current stream."""
    launches, made = [], _MadeTensors()
    _RECORDING.launches = launches
    try:
        with _counting_launches() as counted, made:
            result = fn(*inputs)
    finally:
        _RECORDING.launches = None
    outputs = result if isinstance(result, tuple) else (result,)
    if made.computed is not None or len(counted) != len(launches):
        return result, None
    return result, Replay.build(inputs, outputs, made.made, launches, isinstance(result, tuple))


def _raw_launcher(run):
    """The C launch function under a Triton 3.6 ``CudaLauncher``: it takes tensor descriptors
    already encoded (``make_tensordesc_arg``), which Triton's wrapper would encode on every call.
    None where the launcher is not built as expected."""
    launch = getattr(run, "launch", None)
    closure = getattr(launch, "__closure__", None)
    if closure is None:  # no descriptor arguments: the C function itself
        return launch if callable(launch) else None
    cells = dict(zip(launch.__code__.co_freevars, closure))
    return cells["launcher"].cell_contents if "launcher" in cells else None


class _Pointer(int):
    """A device address where Triton's descriptor encoding asks a tensor for ``data_ptr()``."""

    def data_ptr(self) -> int:
        return int(self)


class _Rebased:
    """A host tensor descriptor's fields over another base address (``make_tensordesc_arg`` reads these)."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base: int, desc):
        self.base, self.shape, self.strides, self.padding = _Pointer(base), desc.shape, desc.strides, desc.padding


class _Launch:
    """One recorded launch: the C launcher's arguments with the constant ones in place, and the
    slots to fill with new pointers (position, root tensor, byte offset, descriptor or None)."""

    def __init__(self, launcher, args: list, slots: list, metas: dict):
        self.launcher, self.args, self.slots, self.metas = launcher, args, slots, metas

    def __call__(self, stream: int, pointers: list) -> None:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        args = self.args.copy()
        args[3] = stream
        for position, root, offset, desc in self.slots:
            address = pointers[root] + offset
            args[position] = address if desc is None else make_tensordesc_arg(_Rebased(address, desc),
                                                                               self.metas[position])[0]
        self.launcher(*args)


class Replay:
    """The launches of a recorded call, launched again on new inputs (see the module docstring).
    ``replay(*inputs)`` returns new outputs as the call returned them."""

    def __init__(self, outputs: list, workspace: list, launches: list, kept: list, as_tuple: bool, device):
        self.outputs = outputs  # (shape, dtype) of each output
        self.workspace = workspace  # byte offsets of the intermediates in one workspace, and its size last
        self.launches = launches
        self.kept = kept  # tensors and descriptors whose pointers the launches keep: alive while the replay is
        self.as_tuple = as_tuple
        self.device = device

    @classmethod
    def build(cls, inputs, outputs, made, launches, as_tuple) -> Optional["Replay"]:
        # (The tensors the call gets back are other Python objects than those the mode saw made.)
        made_at = {t.data_ptr() for t in made}
        if any(t.data_ptr() not in made_at or not t.is_contiguous() or t.storage_offset()
               or t.untyped_storage().nbytes() != t.numel() * t.element_size() for t in outputs):
            return None
        out_at = {t.data_ptr() for t in outputs}
        intermediates = [t for t in made if t.data_ptr() not in out_at]
        roots = [*inputs, *outputs, *intermediates]  # the order of a replay's pointers
        spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.data_ptr()) for t in roots]
        offsets, size = [], 0
        for t in intermediates:
            offsets.append(size)
            size += -(-t.untyped_storage().nbytes() // _ALIGN) * _ALIGN
        kept = []

        def locate(address: int):
            """(root, offset) of an address in a root's storage, or None."""
            for root, (start, nbytes, base) in enumerate(spans):
                if start <= address < start + max(nbytes, 1):
                    return root, address - base
            return None

        recorded = []
        for compiled, grid, values in launches:
            launch = cls._template(compiled, grid, values, locate, kept)
            if launch is None:
                return None
            recorded.append(launch)
        device = inputs[0].device if inputs else outputs[0].device
        return cls([(tuple(t.shape), t.dtype) for t in outputs], [*offsets, size], recorded, kept, as_tuple, device)

    @staticmethod
    def _template(compiled, grid, values, locate, kept) -> Optional[_Launch]:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        run = compiled.run
        launcher = _raw_launcher(run)
        types = list(compiled.src.signature.values())
        if (launcher is None or not isinstance(grid, tuple) or len(types) != len(values)
                or run.global_scratch_size or run.profile_scratch_size):
            return None
        grid = (*grid, 1, 1)
        args = [grid[0], grid[1], grid[2], 0, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                None, None, compiled.packed_metadata, None, None, None]
        assert len(args) == _BASE_ARGS
        metas = iter(getattr(compiled.metadata, "tensordesc_meta", None) or [])
        has_metas = bool(getattr(compiled.metadata, "tensordesc_meta", None))
        slots, desc_metas = [], {}
        for kind, value in zip(types, values):
            if isinstance(kind, str) and kind.startswith("tensordesc"):
                meta = next(metas) if has_metas else None
                where = locate(value.base.data_ptr())
                if where is not None:  # over a tensor made anew each call: encoded on each replay
                    slots.append((len(args), *where, value))
                    desc_metas[len(args)] = meta
                else:  # over a tensor that outlives the call: encoded once, and held
                    kept.append(value)
                args.extend(make_tensordesc_arg(value, meta))
            elif isinstance(kind, str) and kind.startswith("*") and isinstance(value, torch.Tensor):
                where = locate(value.data_ptr())
                if where is not None:
                    slots.append((len(args), *where, None))
                else:
                    kept.append(value)
                args.append(value.data_ptr())
            else:
                args.append(value)
        return _Launch(launcher, args, slots, desc_metas)

    def __call__(self, *inputs: torch.Tensor):
        from triton.runtime import driver

        pointers = [t.data_ptr() for t in inputs]
        outputs = [new_output(shape, dtype=dtype, device=self.device) for shape, dtype in self.outputs]
        pointers += [t.data_ptr() for t in outputs]
        size = self.workspace[-1]
        if size:
            workspace = torch.empty(size, dtype=torch.uint8, device=self.device)  # freed after: stream-ordered
            start = workspace.data_ptr()
            pointers += [start + offset for offset in self.workspace[:-1]]
        stream = driver.active.get_current_stream(self.device.index) if self.launches else 0
        for launch in self.launches:
            launch(stream, pointers)
        return tuple(outputs) if self.as_tuple else outputs[0]
