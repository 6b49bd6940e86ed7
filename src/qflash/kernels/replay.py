"""Replayed launches: a call's kernel launches recorded once, then launched again with new pointers.

An eager call of a short product is bound by the host, not by the GPU: an FP8 ``QuantizedLinear``
at M = 16 took 145 us of host time a call for kernels that ran about 19 us (session 57). Most of it
is Python that gives the same answer on every call with the same shapes: checks, plans, Triton's
handling of 35 arguments, six tensor descriptors made and encoded. ``record`` calls a function once
and notes each kernel it launches (through ``common.CachedLauncher``) and each tensor it makes; the
``Replay`` it returns launches the same compiled kernels with the same arguments, except the
pointers that change from call to call:

    inputs         the caller's tensors                  their pointers, plus the recorded offset
    outputs        tensors the call made and returned    made anew, as the call made them
    intermediates  tensors the call made and dropped     one workspace made anew, each at its
                   (the quantized activation, its        recorded offset (and filled where the
                   scales, split-K sums, Triton's        call made it by ``full``)
                   scratch memory for descriptors
                   made in a kernel)

Everything else is kept from the recorded call: integers, compiled kernels, grids, and the
pointers and tensor descriptors (encoded once) of tensors that outlive the call, such as a
layer's weights; the replay holds those tensors.

``record`` returns no replay where one could do other than a call:
- an aten op that computes (a copy, a cast, a fill of an existing tensor) instead of making a
  tensor (``empty``, ``empty_strided``, ``full``) or a view of one: a replay runs kernels only;
- a Triton launch that did not go through ``CachedLauncher`` (launch hooks count them);
- a grid that is not a tuple, a kernel that takes Triton's profiling memory, a launcher this
  Triton does not build as expected;
- an output that is not a whole contiguous tensor the call made.
Inputs that share memory (q, k and v as views of one packed tensor, one ``cu_seqlens`` passed for
both q and k) are found in the first one's: a replay reads them at their recorded distances from
it, so it is only for calls whose inputs share memory in the same way.
A replay is only as good as its key: ``Replays``, which keeps a layer's or an op's replays, keys
them by everything the launches depend on (the arguments' shapes, strides, dtypes, 16-byte
alignment and shared memory, their other values, device, stream, switches such as ``common.PDL``)
and by what the caller says they keep (``QuantizedLinear``: its buffers' pointers).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import driver

from qflash.kernels import common

aten = torch.ops.aten

# Ops that make a tensor without reading one (``full`` is how tests poison new outputs)
_FACTORIES = (aten.empty.memory_format, aten.empty_strided.default, aten.full.default)
_ALIGN = 256  # bytes between the intermediates in a replay's one workspace (Triton specializes on 16)
_BASE_ARGS = 13  # what Triton 3.6's C launcher takes before the kernel's own arguments (grid, stream, ...)
_GLOBAL_SCRATCH = 7  # where among them the scratch memory's address goes


class _MadeTensors(TorchDispatchMode):
    """Logs the tensors a call makes, each with its fill value (None: made empty), and the first
    aten op that does more than make or view one."""

    def __init__(self):
        super().__init__()
        self.made = []
        self.computed = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FACTORIES:
            self.made.append((out, args[1] if func is aten.full.default else None))
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


def record(fn, args: Sequence) -> Tuple[object, Optional["Replay"]]:
    """``fn(*args)``, and a ``Replay`` of its launches (None where it cannot have one: see the
    module docstring), which takes the tensors among ``args`` anew, in their order. ``fn`` returns a
    tensor or a tuple of tensors; the tensors among ``args`` are CUDA tensors on the current device,
    whose kernels launch on its current stream."""
    launches, scratch, made = [], [], _MadeTensors()
    common.LAUNCH_LOG.launches, common.LAUNCH_LOG.scratch = launches, scratch
    try:
        with _counting_launches() as counted, made:
            result = fn(*args)
    finally:
        common.LAUNCH_LOG.launches = common.LAUNCH_LOG.scratch = None
    outputs = result if isinstance(result, tuple) else (result,)
    if made.computed is not None or len(counted) != len(launches):
        return result, None
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    return result, Replay.build(inputs, outputs, made.made, launches, scratch, isinstance(result, tuple))


def _tma_fields(desc, meta) -> tuple:
    """``fill_tma_descriptor``'s arguments after the address, as ``make_tensordesc_arg`` passes them
    for a host descriptor of a compiled kernel's (its swizzle, element type and box from ``meta``)."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    return (meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
            list(desc.shape), list(desc.strides), 1 if desc.padding == "nan" else 0)


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


class _Params:
    """What a replay needs of a compiled kernel, found once a kernel (``_params_of``): its C
    launcher (None where not built as expected), its parameter count, and the parameters that take a
    tensor, pointers and tensor descriptors: (position, whether a descriptor, the descriptor's TMA
    metadata or None)."""

    def __init__(self, compiled):
        self.launcher = _raw_launcher(compiled.run)
        types = list(compiled.src.signature.values())
        self.count = len(types)
        metas = getattr(compiled.metadata, "tensordesc_meta", None)
        metas = iter(metas) if metas else None  # None: descriptors passed as pointer, shape and strides
        self.tensor_params = []
        for position, kind in enumerate(types):
            if isinstance(kind, str) and kind.startswith("tensordesc"):
                self.tensor_params.append((position, True, next(metas) if metas is not None else None))
            elif isinstance(kind, str) and kind.startswith("*"):
                self.tensor_params.append((position, False, None))


_PARAMS = weakref.WeakKeyDictionary()  # compiled kernel -> its _Params (a recording's loop over 70 parameters)


def _params_of(compiled) -> _Params:
    params = _PARAMS.get(compiled)
    if params is None:
        params = _PARAMS[compiled] = _Params(compiled)
    return params


class _Launch:
    """One recorded launch: the C launcher's arguments with the constant ones in place, and the
    slots to fill anew: (position, root, byte offset from the root's pointer, and None for a
    pointer or the rest of ``fill_tma_descriptor``'s arguments for a tensor descriptor's TMA map)."""

    def __init__(self, launcher, args: list, slots: list):
        self.launcher, self.args, self.slots = launcher, args, slots

    def __call__(self, stream: int, pointers: list, fill_tma_descriptor) -> None:
        args = self.args.copy()
        args[3] = stream
        for position, root, offset, tma in self.slots:
            address = pointers[root] + offset
            args[position] = address if tma is None else fill_tma_descriptor(address, *tma)
        self.launcher(*args)


class Replay:
    """The launches of a recorded call, launched again on new inputs (see the module docstring).
    ``replay(*inputs)`` returns new outputs as the call returned them."""

    def __init__(self, outputs: list, workspace: list, filled: list, launches: list, kept: list, as_tuple: bool,
                 device):
        self.outputs = outputs  # (shape, dtype, fill value or None) of each output
        self.workspace = workspace  # byte offsets of the intermediates in one workspace, and its size last
        self.filled = filled  # (offset, bytes, dtype, value) of each intermediate the call made by ``full``
        self.launches = launches
        self.kept = kept  # tensors and descriptors whose pointers the launches keep: alive while the replay is
        self.as_tuple = as_tuple
        self.device = device
        self.fill_tma_descriptor = None
        if launches:  # (Triton's CUDA driver: a replay of no launches, as the CPU tests make, needs none)
            self.fill_tma_descriptor = driver.active.utils.fill_tma_descriptor

    @classmethod
    def build(cls, inputs, outputs, made, launches, scratch, as_tuple) -> Optional["Replay"]:
        """The replay of ``launches`` (``record``'s), or None; ``scratch``: the addresses of the
        scratch memory Triton took for those launches that take it, in their order (intermediates
        of the call's, as ``common._scratch`` makes them)."""
        # (The tensors the call gets back are other Python objects than those the mode saw made.)
        fills = {t.data_ptr(): fill for t, fill in made}
        if any(t.data_ptr() not in fills or not t.is_contiguous() or t.storage_offset()
               or t.untyped_storage().nbytes() != t.numel() * t.element_size() for t in outputs):
            return None
        out_at = {t.data_ptr() for t in outputs}
        intermediates = [(t, fill) for t, fill in made if t.data_ptr() not in out_at]
        roots = [*inputs, *outputs, *(t for t, _ in intermediates)]  # the order of a replay's pointers
        # (Inputs that share memory are found in the first one's: kind_of keeps their distances.)
        spans = []  # (start, end, the tensor's own address) of each root's storage
        for t in roots:
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + max(storage.nbytes(), 1), t.data_ptr()))
        offsets, filled, size = [], [], 0
        for t, fill in intermediates:
            offsets.append(size)
            nbytes = t.untyped_storage().nbytes()
            if fill is not None:
                filled.append((size, nbytes, t.dtype, fill))
            size += -(-nbytes // _ALIGN) * _ALIGN
        kept = []

        def locate(address: int):
            """(root, offset) of an address in a root's storage, or None."""
            for root, (start, end, base) in enumerate(spans):
                if start <= address < end:
                    return root, address - base
            return None

        recorded, scratch = [], iter(scratch)
        for compiled, grid, values in launches:
            launch = cls._template(compiled, grid, values, locate, kept, scratch)
            if launch is None:
                return None
            recorded.append(launch)
        device = inputs[0].device if inputs else outputs[0].device
        return cls([(tuple(t.shape), t.dtype, fills[t.data_ptr()]) for t in outputs], [*offsets, size], filled,
                   recorded, kept, as_tuple, device)

    @staticmethod
    def _template(compiled, grid, values, locate, kept, scratch) -> Optional[_Launch]:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        params = _params_of(compiled)
        run = compiled.run
        if (params.launcher is None or not isinstance(grid, tuple) or params.count != len(values)
                or run.profile_scratch_size):
            return None
        grid = (*grid, 1, 1)
        args = [grid[0], grid[1], grid[2], 0, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                None, None, compiled.packed_metadata, None, None, None]
        assert len(args) == _BASE_ARGS
        slots = []
        if run.global_scratch_size:  # (in-kernel tensor descriptors): its memory is an intermediate's
            where = locate(next(scratch, -1))
            if where is None or run.global_scratch_align > _ALIGN:
                return None
            slots.append((_GLOBAL_SCRATCH, *where, None))
        start = 0  # the values up to a pointer or descriptor go in as they are
        for position, is_descriptor, meta in params.tensor_params:
            args.extend(values[start:position])
            start = position + 1
            value = values[position]
            if is_descriptor:
                where = locate(value.base.data_ptr())
                if where is not None:  # over a tensor made anew each call: encoded on each replay
                    if meta is not None and meta["fp4_padded"]:
                        return None
                    slots.append((len(args), *where, None if meta is None else _tma_fields(value, meta)))
                else:  # over a tensor that outlives the call: encoded once, and held
                    kept.append(value)
                args.extend(make_tensordesc_arg(value, meta))  # (the TMA map, or the pointer, first)
                if where is not None:
                    args[slots[-1][0]] = None  # (filled on each replay: the template holds no tensor of the call's)
            elif isinstance(value, torch.Tensor):
                where = locate(value.data_ptr())
                if where is not None:
                    slots.append((len(args), *where, None))
                else:
                    kept.append(value)
                args.append(value.data_ptr())
            else:  # (a pointer parameter given something else, such as None)
                args.append(value)
        args.extend(values[start:])
        return _Launch(launcher=params.launcher, args=args, slots=slots)

    def __call__(self, *inputs: torch.Tensor):
        pointers = [t.data_ptr() for t in inputs]
        outputs = [torch.empty(shape, dtype=dtype, device=self.device) if fill is None else
                   torch.full(shape, fill, dtype=dtype, device=self.device) for shape, dtype, fill in self.outputs]
        pointers += [t.data_ptr() for t in outputs]
        size = self.workspace[-1]
        if size:
            workspace = torch.empty(size, dtype=torch.uint8, device=self.device)  # freed after: stream-ordered
            for offset, nbytes, dtype, fill in self.filled:  # (the tests' poison, or a path's zeroed sums)
                workspace[offset:offset + nbytes].view(dtype).fill_(fill)
            start = workspace.data_ptr()
            pointers += [start + offset for offset in self.workspace[:-1]]
        stream = driver.active.get_current_stream(self.device.index) if self.launches else 0
        for launch in self.launches:
            launch(stream, pointers, self.fill_tma_descriptor)
        return tuple(outputs) if self.as_tuple else outputs[0]


ENABLED = True  # False: every call takes the normal path (to tell a replay's doing from a kernel's, or to time both)
MAX_KINDS = 16  # kinds of call a ``Replays`` keeps (decode batch sizes, a few prefill lengths)
MAX_REFUSALS = 3  # recordings refused before a kind stays on the normal path


def kind_of(values: Sequence) -> tuple:
    """What launches made from ``values`` may depend on: a tensor's shape, strides, dtype, 16-byte
    alignment and the memory it shares (None, or the position of the first tensor in its storage
    and the distance in bytes from it: a replay reads it there), anything else itself (numbers,
    flags, None)."""
    kinds, firsts = [], {}  # firsts: a storage's address -> (position, address) of its first tensor
    for position, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            address = v.data_ptr()
            first, at = firsts.setdefault(v.untyped_storage().data_ptr(), (position, address))
            kinds.append((v.shape, v.stride(), v.dtype, address % 16, None if first == position else
                          (first, address - at)))
        else:
            kinds.append(v)
    return tuple(kinds)


class Replays:
    """Replays of a function's calls, one a kind of call (``QuantizedLinear``'s eager calls on a GPU,
    the attention ops' eager forwards without gradients).

    ``replays(fn, args, kept)`` is ``fn(*args)``: the first call of a kind runs ``fn`` as it is (so
    that prefills of ever new lengths are not recorded: recording an attention forward at decode
    costs 2.6-2.7 normal calls, session 61), the second records it, and the later ones replay it
    with the tensors among ``args``. With ``record_after_replay``, a kind's first call records at
    once where the call before it replayed: in a decode loop whose steps each bring a new key
    length to every layer (transformers' growing cache), a step's first layer records and the
    others replay, where the first two would otherwise take the normal path and record. After a
    normal call or a recording a new kind takes the normal path, so a run of kinds seen once does
    not record each of them.

    A kind is everything the launches depend on: ``kind_of(args)`` (the tensors' shapes, strides,
    dtypes, alignment and shared memory, every other argument's value), the GPU, the current stream
    (split-K counts are a stream's) and the switches ``common.PDL`` and ``QFLASH_GLUON``. ``kept``
    gives what else the launches were made with: the addresses of the tensors they keep (a layer's
    buffers) and the caller's settings (its output dtype); where it changes, the replays go. A
    recording refused because the call first made something lasting (the split-K counts of a new
    stream) may succeed next time; after MAX_REFUSALS a kind stays on ``fn``. Calls take ``fn``
    where the inputs' GPU is not the current one or a launch hook listens (a profiler's: it sees
    every kernel) or ``ENABLED`` is False."""

    def __init__(self, record_after_replay: bool = False):
        self.kinds = {}  # kind -> its Replay, or the recordings refused so far (0: seen once)
        self.kept = None
        self.record_after_replay = record_after_replay
        self.replayed = False  # whether the last call replayed

    def __call__(self, fn, args: Sequence, kept: tuple = ()):
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        device = inputs[0].device
        if not ENABLED or device.index != torch.cuda.current_device() or not common.launches_hookless():
            return fn(*args)
        kinds = self.kinds
        if kept != self.kept:  # buffers replaced or moved (the replays hold the old ones), or settings changed
            kinds.clear()
            self.kept = kept
        # (the device too: every GPU's default stream has handle 0, and a kernel is loaded per GPU)
        kind = (kind_of(args), device.index, common.stream_handle(device), common.PDL, common.gluon_enabled())
        replay = kinds.get(kind)
        after_replay, self.replayed = self.replayed, False
        if type(replay) is not int:
            if replay is not None:
                self.replayed = True
                return replay(*inputs)
            if len(kinds) >= MAX_KINDS:  # the oldest kind goes first
                del kinds[next(iter(kinds))]
            kinds[kind] = replay = 0
            if not (self.record_after_replay and after_replay):
                return fn(*args)
        if replay >= MAX_REFUSALS:
            return fn(*args)
        y, made = record(fn, args)
        kinds[kind] = replay + 1 if made is None else made
        return y

    def clear(self) -> None:
        self.kinds.clear()
        self.kept = None
        self.replayed = False

    def replays(self) -> list:
        """The Replays made so far (what the tests check was replayed)."""
        return [r for r in self.kinds.values() if isinstance(r, Replay)]
