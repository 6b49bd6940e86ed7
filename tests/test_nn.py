"""QuantizedLinear and quantize_model: accuracy against float layers, exactness against the
reference pipeline, state_dict round trips and clear errors."""

import contextlib
import io
import re

import pytest
import torch
import torch.nn as nn

import qflash
from qflash.nn import MODES, QuantizedLinear, quantize_model
from qflash.reference.matmul import fp8_matmul_ref, int8_matmul_ref
from qflash.reference.quantize import quantize_ref
from qflash.testing import rel_l2_err, sqnr_db

from conftest import DEVICE, one_graph


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 256)).to(DEVICE)


@pytest.mark.parametrize("mode,floor_db", [("int8", 30.0), ("fp8", 25.0), ("fp8_row", 25.0)])
def test_quantized_linear_tracks_the_float_layer(mode, floor_db):
    lin = nn.Linear(256, 200).to(DEVICE)
    x = torch.randn(3, 17, 256, device=DEVICE)
    q = QuantizedLinear.from_linear(lin, mode)
    with torch.no_grad():
        y, ref = q(x), lin(x)
    assert y.shape == (3, 17, 200) and y.dtype == x.dtype
    assert sqnr_db(y, ref) > floor_db


def test_int8_layer_equals_the_reference_pipeline():
    lin = nn.Linear(96, 40).to(DEVICE)
    x = torch.randn(10, 96, device=DEVICE)
    q = QuantizedLinear.from_linear(lin, "int8")
    w_q, w_s = quantize_ref(lin.weight, torch.int8, "row")
    x_q, x_s = quantize_ref(x, torch.int8, "row")
    with torch.no_grad():
        expected = int8_matmul_ref(x_q, w_q, x_s, w_s, lin.bias.detach(), torch.float32)
        assert torch.equal(q(x), expected)


def test_fp8_row_layer_equals_the_reference_pipeline():
    """Weight per output channel, activations per token, both e4m3: the product of the dequantized
    operands, to float32 rounding (the quantized operands are the reference's bit for bit)."""
    lin = nn.Linear(200, 40).to(DEVICE)
    x = torch.randn(10, 200, device=DEVICE)
    q = QuantizedLinear.from_linear(lin, "fp8_row")
    w_q, w_s = quantize_ref(lin.weight, torch.float8_e4m3fn, "row")
    assert q.weight_scale.shape == (40, 1) and torch.equal(q.weight_q.view(torch.int8), w_q.view(torch.int8))
    x_q, x_s = quantize_ref(x, torch.float8_e4m3fn, "row")
    with torch.no_grad():
        expected = fp8_matmul_ref(x_q, w_q, x_s, w_s, lin.bias.detach(), torch.float64)
        assert rel_l2_err(q(x), expected) < 1e-5 * 200 ** 0.5


@pytest.mark.parametrize("mode", MODES)
def test_quantize_model_and_state_dict_round_trip(mode):
    model = _mlp()
    x = torch.randn(8, 256, device=DEVICE)
    with torch.no_grad():
        ref = model(x)
    quantize_model(model, mode, skip=["2"])
    assert isinstance(model[0], QuantizedLinear) and isinstance(model[2], nn.Linear)
    with torch.no_grad():
        y = model(x)
    assert sqnr_db(y, ref) > 20
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    fresh = quantize_model(_mlp(), mode, skip=["2"])
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    with torch.no_grad():
        assert torch.equal(fresh(x), y)
    assert "mode=" + mode in repr(model)


@pytest.mark.parametrize("mode", MODES)
def test_quantize_model_of_a_model_built_on_meta(mode):
    """A model built on the meta device (no float weights ever made) is quantized to layers of the
    quantized buffers' shapes and dtypes on meta, which a saved quantized state_dict then fills
    (``load_state_dict(..., assign=True)``): the same outputs as the model it was saved from."""
    model = quantize_model(_mlp(), mode)
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 256))
    quantize_model(empty, mode)
    for name, buf in empty.named_buffers():
        saved = model.get_buffer(name)
        assert buf.is_meta and (buf.shape, buf.dtype) == (saved.shape, saved.dtype), name
    empty.load_state_dict(model.state_dict(), assign=True)
    x = torch.randn(8, 256, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(empty(x), model(x))


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_keeps_the_buffers_dtypes(mode, assign):
    """A checkpoint whose scales and bias are not float32 (float64 scales, a strided float16 bias)
    loads as float32, contiguous, with ``assign=True`` too (the kernels read them so); the layer
    then gives the outputs of one loaded from the float32 values, and the caller's dict is left as
    it was. A weight in the other mode's dtype, or integer scales, is a clear error."""
    layer = QuantizedLinear.from_linear(nn.Linear(256, 64).to(DEVICE), mode)
    saved = layer.state_dict()
    bias16 = torch.stack([saved["bias"].half()] * 2, dim=1)[:, 0]  # strided
    odd = {"weight_q": saved["weight_q"], "weight_scale": saved["weight_scale"].double(), "bias": bias16}
    kept = dict(odd)
    fresh = QuantizedLinear(256, 64, mode=mode, device=DEVICE)
    fresh.load_state_dict(odd, assign=assign)
    assert all(odd[key] is kept[key] for key in kept) and odd["bias"].dtype == torch.float16
    for name in ("weight_scale", "bias"):
        buf = fresh.get_buffer(name)
        assert buf.dtype == torch.float32 and buf.is_contiguous(), name
    assert torch.equal(fresh.weight_scale, saved["weight_scale"]) and torch.equal(fresh.bias, bias16.float())
    same = QuantizedLinear(256, 64, mode=mode, device=DEVICE)
    same.load_state_dict({**saved, "bias": bias16.float()})
    x = torch.randn(5, 256, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(fresh(x), same(x))
    other = "fp8" if mode == "int8" else "int8"
    with pytest.raises(RuntimeError, match=f"weight_q is {saved['weight_q'].dtype} in the checkpoint, but this "
                                           f"layer \\(mode '{other}'\\)"):
        QuantizedLinear(256, 64, mode=other, device=DEVICE).load_state_dict(saved, assign=assign)
    if mode != "int8":  # FP8 block and row scales: one weight dtype, scales of other shapes
        other, shape = ("fp8_row", (64, 1)) if mode == "fp8" else ("fp8", (1, 2))
        with pytest.raises(RuntimeError, match=re.escape(f"weight_scale is {tuple(saved['weight_scale'].shape)} in "
                                                         f"the checkpoint, but this layer (mode '{other}') holds "
                                                         f"{shape}")):
            QuantizedLinear(256, 64, mode=other, device=DEVICE).load_state_dict(saved, assign=assign)
    with pytest.raises(RuntimeError, match="weight_scale is torch.int32 in the checkpoint; expected floating"):
        fresh.load_state_dict({**saved, "weight_scale": saved["weight_scale"].int()}, assign=assign)


@pytest.mark.parametrize("mode", MODES)
def test_quantize_model_replaces_a_shared_layer_everywhere(mode):
    """One nn.Linear registered under two names (a shared layer): every place gets the same
    quantized layer (the second place used to keep the float layer), and a skipped place keeps it."""
    torch.manual_seed(0)
    shared = nn.Linear(128, 128).to(DEVICE)
    model = nn.Sequential(shared, nn.GELU(), shared, nn.GELU(), shared).to(DEVICE)
    x = torch.randn(6, 128, device=DEVICE)
    quantize_model(model, mode)
    assert isinstance(model[0], QuantizedLinear) and model[0] is model[2] is model[4]
    with torch.no_grad():
        q = QuantizedLinear.from_linear(shared, mode)
        h = q(x)
        expected = q(nn.functional.gelu(q(nn.functional.gelu(h))))
        assert torch.equal(model(x), expected)
    tree = nn.Module()
    tree.a, tree.b = nn.Sequential(shared), nn.Sequential(nn.GELU(), shared)
    quantize_model(tree, mode, skip=["b.1"])
    assert isinstance(tree.a[0], QuantizedLinear) and tree.b[1] is shared


class _AttentionBlock(nn.Module):
    def __init__(self, dim: int = 128):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.ff(x)


@pytest.mark.parametrize("mode", MODES)
def test_quantize_model_leaves_multihead_attention_working(mode):
    """nn.MultiheadAttention reads out_proj's weight itself and never calls the layer: its out_proj
    stays float (replaced, MHA failed on out_proj.weight) and the layers around it are quantized;
    the output tracks the float block's. An nn.TransformerEncoderLayer, whose fast path reads its
    feed-forward weights too, gets a clear error naming the layer instead of failing later."""
    torch.manual_seed(0)
    block = _AttentionBlock().to(DEVICE).eval()
    x = torch.randn(2, 7, 128, device=DEVICE)
    with torch.no_grad():
        ref = block(x)
    quantize_model(block, mode)
    assert isinstance(block.ff[0], QuantizedLinear) and isinstance(block.ff[2], QuantizedLinear)
    assert type(block.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    with torch.no_grad():
        assert sqnr_db(block(x), ref) > 20
    layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True).to(DEVICE)
    with pytest.raises(TypeError, match="layer 'linear1' belongs to an nn.TransformerEncoderLayer"):
        quantize_model(layer, mode)


@pytest.mark.parametrize("mode", MODES)
def test_quantize_model_of_one_linear_returns_the_layer(mode):
    """A model that is itself an nn.Linear cannot be changed in place: the quantized layer comes
    back (it used to fail on setattr(model, "", ...))."""
    lin = nn.Linear(256, 64).to(DEVICE)
    x = torch.randn(5, 256, device=DEVICE)
    q = quantize_model(lin, mode)
    assert isinstance(q, QuantizedLinear) and isinstance(lin, nn.Linear)
    with torch.no_grad():
        assert torch.equal(q(x), QuantizedLinear.from_linear(lin, mode)(x))
        assert sqnr_db(q(x), lin(x)) > 20
    assert quantize_model(lin, mode, skip=[""]) is lin


@pytest.mark.parametrize("mode", MODES)
def test_out_dtype(mode):
    """The output in out_dtype where given (it was accepted and ignored), else the input's dtype."""
    lin = nn.Linear(256, 64).to(DEVICE)
    x = torch.randn(2, 3, 256, device=DEVICE, dtype=torch.float16)
    wide = QuantizedLinear.from_linear(lin, mode, out_dtype=torch.float32)
    with torch.no_grad():
        y32, y16 = wide(x), QuantizedLinear.from_linear(lin, mode)(x)
    assert y32.dtype == torch.float32 and y16.dtype == torch.float16 and y32.shape == (2, 3, 64)
    assert torch.equal(y32.half(), y16)  # the same sums, rounded once to float16 either way
    assert "out_dtype=torch.float32" in repr(wide)
    with pytest.raises(TypeError, match="out_dtype must be"):
        QuantizedLinear(256, 64, mode=mode, out_dtype=torch.int8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cast", ["half", "bfloat16", "to"])
def test_model_casts_keep_the_quantized_buffers(mode, cast):
    """model.half() / .bfloat16() / .to(dtype) after quantize_model, as users do with float models:
    the layers' float8 weights, float32 scales and bias keep their dtypes (a cast turned float8
    weights into float16 ones, which the kernels refused with an unclear error, and rounded the
    scales), the plain layers are cast, and the output is the uncast model's on 16-bit inputs."""
    dtype = torch.bfloat16 if cast == "bfloat16" else torch.float16
    model = quantize_model(_mlp(), mode, skip=["2"])
    x = torch.randn(8, 256, device=DEVICE).to(dtype)
    before = {name: (buf.dtype, buf.clone()) for name, buf in model.named_buffers()}
    with torch.no_grad():
        want = model[0](x)
        cast_model = model.to(dtype) if cast == "to" else getattr(model, cast)()
        got = cast_model[0](x)
    for name, buf in cast_model.named_buffers():
        assert buf.dtype == before[name][0] and torch.equal(buf, before[name][1]), name
    assert cast_model[2].weight.dtype == dtype
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_model_under_torch_compile(mode):
    """A quantized model compiled into one graph (the layers' quantize and product are custom ops
    there) gives the eager model's output bit for bit; it used to fail inside dynamo."""
    model = quantize_model(_mlp(), mode)
    x = torch.randn(3, 5, 256, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(one_graph(model)(x), model(x))


def test_clear_errors():
    class LoRALinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(8, 8), LoRALinear(8, 8)).to(DEVICE)
    with pytest.raises(TypeError, match="layer '1' is a LoRALinear"):
        quantize_model(model, "int8")
    quantize_model(model, "int8", skip=["1"])
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize_model(_mlp(), "int4")
    q = QuantizedLinear.from_linear(nn.Linear(16, 8).to(DEVICE))
    with pytest.raises(ValueError, match=r"expected input \(..., 16\)"):
        with torch.no_grad():
            q(torch.randn(4, 15, device=DEVICE))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        with torch.no_grad():
            q(torch.randn(4, 16, device=DEVICE, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="inference"):
        q(torch.randn(4, 16, device=DEVICE, requires_grad=True))
    with pytest.raises(ValueError, match="input is on meta but the layer is on"):
        with torch.no_grad():
            q(torch.randn(4, 16, device="meta"))
    with pytest.raises(ValueError, match="mode must be one of"):
        QuantizedLinear(16, 8, mode="int4")
    # int8's exact int32 sums: K up to 131071 (fp8 modes sum in float32)
    wide = nn.Sequential(nn.Linear(131072, 1, device="meta"), nn.Linear(1, 131071, device="meta"))
    with pytest.raises(ValueError, match="layer '0' has in_features = 131072, over the 131071"):
        quantize_model(wide, "int8")
    assert isinstance(quantize_model(wide, "int8", skip=["0"])[1], QuantizedLinear)
    with pytest.raises(ValueError, match="in_features up to 131071"):
        QuantizedLinear(131072, 1, mode="int8", device="meta")
    assert QuantizedLinear(131072, 1, mode="fp8_row", device="meta").in_features == 131072
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight = nn.Parameter(torch.ones(4, 4, dtype=torch.int32), requires_grad=False)
    with pytest.raises(TypeError, match="layer '0' has a torch.int32 weight; expected floats"):
        quantize_model(model, "int8")
    assert qflash.quantize_model is quantize_model and qflash.nn.QuantizedLinear is QuantizedLinear


# ----------------------------------------------------------------------------------------------
# Replayed launches (kernels/replay.py): from the second eager call of a kind on, a layer on a
# GPU launches its first recorded call's kernels again with the new pointers. Each replayed
# output must equal the normal path's on the same input bit for bit, poisoned beforehand.
# ----------------------------------------------------------------------------------------------
def _replays(layer):
    return layer._replays.replays()


def _layer(mode, n, k, bias=True, out_dtype=None, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias, device="cuda")
    return QuantizedLinear.from_linear(lin, mode, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 4096, 4096), (16, 14336, 4096), (16, 4096, 14336),
                                   (63, 1000, 1000), (113, 6144, 4096), (128, 4096, 4096), (239, 384, 256),
                                   (1024, 4096, 4096), (1023, 1024, 4096)])
def test_gpu_replayed_layer_equals_its_normal_path(mode, m, n, k):
    from qflash.testing import poisoned

    layer = _layer(mode, n, k)
    with torch.no_grad(), poisoned():
        for call in range(4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = layer(x)
            assert torch.equal(y, layer._product(x, layer._buffers)), f"call {call}"
    assert len(_replays(layer)) == 1, "the layer did not replay"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_replay_keys_follow_layouts_dtypes_and_switches(mode, monkeypatch):
    """Strided and 3-D inputs, other dtypes, no bias, out_dtype, early launch and Gluon off each
    take a replay of their own, and every replay equals the normal path."""
    from qflash.kernels.common import early_launch

    @contextlib.contextmanager
    def gluon_off():
        with monkeypatch.context() as patch:
            patch.setenv("QFLASH_GLUON", "0")
            yield

    k, n = 512, 768
    for bias, out_dtype in ((True, None), (False, torch.float32)):
        layer = _layer(mode, n, k, bias=bias, out_dtype=out_dtype)
        wide = torch.randn(16, 2 * k, device="cuda", dtype=torch.float16)
        inputs = [torch.randn(16, k, device="cuda", dtype=torch.bfloat16), wide[:, :k], wide[:, 4:k + 4],
                  torch.randn(2, 8, k, device="cuda", dtype=torch.float32)]
        with torch.no_grad():
            for switch in (contextlib.nullcontext, early_launch, gluon_off):
                with switch():
                    for x in inputs:
                        for _ in range(3):
                            y = layer(x)
                            ref = layer._product(x.reshape(-1, k), layer._buffers)
                            assert torch.equal(y.reshape(-1, n), ref)
        assert len(_replays(layer)) == 3 * len(inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_replays_follow_the_weights(mode):
    """New weights loaded in place are read by the replay; buffers moved or replaced (``.to``,
    ``load_state_dict(assign=True)``) and a changed ``out_dtype`` drop the replays; copies record
    their own."""
    import copy

    layer, other = _layer(mode, 512, 256, seed=0), _layer(mode, 512, 256, seed=1)
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            layer(x)
        assert _replays(layer)
        layer.load_state_dict(other.state_dict())
        assert torch.equal(layer(x), other._product(x, other._buffers))
        twin = copy.deepcopy(layer)
        assert not twin._replays.kinds and torch.equal(twin(x), layer(x))
        layer.out_dtype = torch.float32  # a setting the launches were made with: replays go
        assert layer(x).dtype == torch.float32 and not _replays(layer)
        layer.out_dtype = None
        layer.cpu()
        assert not layer._replays.kinds
        layer.cuda()
        layer.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
        for _ in range(3):
            assert torch.equal(layer(x), other._product(x, other._buffers))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_replays_on_other_streams_in_graphs_and_under_hooks(mode):
    """Each stream keys replays of its own (split-K counts are a stream's); a CUDA graph captured
    from replayed calls gives what they give; with a launch hook added (a profiler's) the layer
    takes the normal path, so the hook sees every kernel."""
    from triton import knobs

    layer = _layer(mode, 4096, 4096)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = layer._product(x, layer._buffers)
        for _ in range(3):
            assert torch.equal(layer(x), ref)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outs = [layer(x) for _ in range(3)]
        torch.cuda.current_stream().wait_stream(side)
        assert all(torch.equal(y, ref) for y in outs) and len(_replays(layer)) == 2
        capture = torch.cuda.Stream()  # warmed up on the capture's stream: the capture replays
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):
            layer(x), layer(x)
        torch.cuda.current_stream().wait_stream(capture)
        assert len(_replays(layer)) == 3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            y = layer(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ref)
        seen = []

        def hook(metadata):
            seen.append(metadata.get()["name"])

        knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert torch.equal(layer(x), ref)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert len(seen) >= 2  # the quantize and the product, at least
