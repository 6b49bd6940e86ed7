"""Hugging Face models on qflash's attention (``attn_implementation="qf_attention"``): tiny models made
from a config (random weights, nothing downloaded), each run with PyTorch's SDPA beside it.

In float64 the two agree to float64 rounding, where transformers' own eager attention (softmax in
float32) is 1e-8 off; the GPU test holds bfloat16 to the accuracy rule against float64."""

import warnings

import pytest
import torch

from qflash.testing import rel_l2_err

from conftest import DEVICE

transformers = pytest.importorskip("transformers")
qhf = pytest.importorskip("qflash.integrations.transformers")

NAME = qhf.register()


def _llama(dtype=torch.float64, **overrides):
    """Two layers, grouped-query heads (4 query heads on 2 key/value heads), head dim 16."""
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    cfg.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(DEVICE, dtype).eval()


def _logits(model, impl, ids, **kw):
    model.set_attn_implementation(impl)
    return model(ids, **kw).logits


def test_registered_name_is_taken_for_neither_flash_attn_nor_sdpa():
    """transformers takes a name with "flash" in it for a flash-attn package, and one with "sdpa"
    only for models that declare SDPA support; ours has neither."""
    assert NAME == "qf_attention" and "flash" not in NAME and "sdpa" not in NAME
    assert transformers.AttentionInterface._global_mapping[NAME] is qhf.attention_forward
    assert qhf.register() == NAME  # again: harmless


@torch.no_grad()
def test_logits_match_sdpa_without_padding(monkeypatch):
    """A causal batch with no padding: transformers passes no mask and the causal flag; every layer
    goes through qflash."""
    calls = []
    forward = qhf.attention_forward
    monkeypatch.setattr(qhf, "attention_forward", lambda *a, **k: calls.append(a[4]) or forward(*a, **k))
    qhf.register()
    model = _llama()
    ids = torch.randint(0, 97, (2, 13), device=DEVICE)
    ref = _logits(model, "sdpa", ids)
    out = _logits(model, NAME, ids)
    assert len(calls) == 2 and all(mask is None for mask in calls)
    assert rel_l2_err(out, ref) < 1e-12
    eager = _logits(model, "eager", ids)
    assert rel_l2_err(eager, ref) > 1e-10  # eager's float32 softmax: the comparison can tell
    monkeypatch.undo()
    qhf.register()


@torch.no_grad()
def test_left_padding_matches_sdpa():
    """Left-padded prompts: the boolean mask transformers builds reaches the kernel; real tokens
    match SDPA, and padding rows (which see no key) come out finite."""
    model = _llama()
    ids = torch.randint(0, 97, (3, 11), device=DEVICE)
    mask = torch.ones(3, 11, dtype=torch.long, device=DEVICE)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ref = _logits(model, "sdpa", ids, attention_mask=mask)
    out = _logits(model, NAME, ids, attention_mask=mask)
    real = mask.bool()
    assert out.isfinite().all()
    assert rel_l2_err(out[real], ref[real]) < 1e-12


@torch.no_grad()
def test_greedy_generation_matches_sdpa():
    """Prefill, then one query at a time against the cache."""
    model = _llama()
    ids = torch.randint(0, 97, (2, 7), device=DEVICE)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    model.set_attn_implementation(NAME)
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)


@torch.no_grad()
def test_torch_compile_fullgraph():
    """A padded batch through ``torch.compile(fullgraph=True)``: the integration and the masks it
    gets trace without a graph break, and give the eager logits."""
    model = _llama(torch.float32)
    model.set_attn_implementation(NAME)
    ids = torch.randint(0, 97, (2, 13), device=DEVICE)
    mask = torch.ones(2, 13, dtype=torch.long, device=DEVICE)
    mask[0, :3] = 0
    eager = model(ids, attention_mask=mask).logits
    compiled = torch.compile(lambda i, m: model(i, attention_mask=m).logits, fullgraph=True, backend="aot_eager")
    real = mask.bool()
    torch.testing.assert_close(compiled(ids, mask)[real], eager[real], rtol=0, atol=0)


def _training_grads(model, impls):
    """{impl: {parameter name: gradient}} of one language-model loss on random tokens, each impl in turn."""
    model.train()
    ids = torch.randint(0, 97, (2, 12), device=DEVICE)
    grads = {}
    for impl in impls:
        model.zero_grad()
        model.set_attn_implementation(impl)
        model(ids, labels=ids).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads


def test_training_gradients_match_sdpa():
    """Training: the loss's gradients through qflash's backward, every parameter."""
    grads = _training_grads(_llama(), ("sdpa", NAME))
    assert grads[NAME].keys() == grads["sdpa"].keys()
    for name, g in grads["sdpa"].items():
        assert rel_l2_err(grads[NAME][name], g) < 1e-10, name


def test_autocast_with_float32_weights_matches_sdpa():
    """Mixed-precision training as Trainer runs it: float32 weights under torch.autocast (float16
    here). Rotary embeddings leave query and key in float32 beside a float16 value, which SDPA
    takes in autocast's dtype; qflash used to refuse the mix. Logits (with and without padding)
    and every parameter's gradient against the float64 model, within twice (gradients: three
    times) SDPA's own error under the same autocast, plus a rounding floor."""
    model = _llama(torch.float32)
    model.train()
    ids = torch.randint(0, 97, (2, 12), device=DEVICE)
    mask = torch.ones(2, 12, dtype=torch.long, device=DEVICE)
    mask[1, :3] = 0
    real = mask.bool()

    def run(impl, autocast):
        model.zero_grad()
        model.set_attn_implementation(impl)
        with torch.autocast(DEVICE, dtype=torch.float16, enabled=autocast):
            logits = model(ids).logits
            padded = model(ids, attention_mask=mask).logits[real]
        (logits.float().logsumexp(-1).mean() + padded.float().logsumexp(-1).mean()).backward()
        return logits.double(), padded.double(), {n: p.grad.double() for n, p in model.named_parameters()}

    out, out_padded, out_grads = run(NAME, True)
    pt, pt_padded, pt_grads = run("sdpa", True)
    model.double()
    ref, ref_padded, ref_grads = run("sdpa", False)
    assert rel_l2_err(out, ref) <= 2 * rel_l2_err(pt, ref) + 1e-3
    assert rel_l2_err(out_padded, ref_padded) <= 2 * rel_l2_err(pt_padded, ref_padded) + 1e-3
    for name, g in ref_grads.items():
        assert rel_l2_err(out_grads[name], g) <= 3 * rel_l2_err(pt_grads[name], g) + 1e-3, name


@torch.no_grad()
def test_sliding_window_and_softcap_match_eager():
    """Gemma 2: scores soft-capped (tanh) and every other layer on a sliding window shorter than
    the prompt (then transformers passes a mask); SDPA takes no soft-capping, so the reference is
    transformers' eager attention, whose float32 softmax bounds the agreement."""
    cfg = transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64, sliding_window=4, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=None)
    model = transformers.Gemma2ForCausalLM(cfg).to(DEVICE, torch.float64).eval()
    for name, p in model.named_parameters():  # large projections: the soft-capping bites
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            p.mul_(8)
    ids = torch.randint(0, 97, (2, 13), device=DEVICE)
    ref = _logits(model, "eager", ids)
    out = _logits(model, NAME, ids)
    assert rel_l2_err(out, ref) < 1e-6
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped = _logits(model, NAME, ids)
    assert rel_l2_err(uncapped, out) > 1e-3  # the soft-capping mattered


@torch.no_grad()
def test_value_head_dim_of_its_own_matches_sdpa():
    """DeepSeek-V3's multi-head latent attention: query and key heads of 24 (16 + 8 rotary), value
    heads of 16 (it used to fail without a mask: flash_attn_func takes one head dim). Both paths,
    no mask and left padding, match SDPA in float64, where eager attention is 1e-8 off."""
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("this transformers has no DeepSeek-V3")
    cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64, rope_scaling=None)  # dense layers: no MoE
    model = transformers.DeepseekV3ForCausalLM(cfg).to(DEVICE, torch.float64).eval()
    ids = torch.randint(0, 97, (2, 13), device=DEVICE)
    ref = _logits(model, "sdpa", ids)
    assert rel_l2_err(_logits(model, NAME, ids), ref) < 1e-12
    assert rel_l2_err(_logits(model, "eager", ids), ref) > 1e-10
    mask = torch.ones(2, 13, dtype=torch.long, device=DEVICE)
    mask[0, :3] = 0
    real = mask.bool()
    out, ref = _logits(model, NAME, ids, attention_mask=mask), _logits(model, "sdpa", ids, attention_mask=mask)
    assert rel_l2_err(out[real], ref[real]) < 1e-12


_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
_DECODER = dict(vocab_size=97, num_key_value_heads=2, max_position_embeddings=64, **_SMALL)
_ARCHITECTURES = {  # name: (model class, config class, config arguments); tiny, random weights
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "bert": ("BertModel", "BertConfig", dict(vocab_size=97, max_position_embeddings=64, **_SMALL)),
    "modernbert": ("ModernBertModel", "ModernBertConfig",
                   dict(vocab_size=97, max_position_embeddings=64, local_attention=8, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, cls_token_id=1, sep_token_id=2, **_SMALL)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _DECODER),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, **_DECODER)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=5, **_DECODER)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(pad_token_id=0, **_DECODER)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(head_dim=16, sliding_window=5, **_DECODER)),
    "vit": ("ViTModel", "ViTConfig", dict(image_size=32, patch_size=8, **_SMALL)),
    "whisper": ("WhisperForConditionalGeneration", "WhisperConfig",
                dict(vocab_size=97, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, num_mel_bins=8,
                     max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, decoder_start_token_id=1)),
}


@torch.no_grad()
@pytest.mark.parametrize("arch", sorted(_ARCHITECTURES))
def test_more_architectures_match_sdpa(arch):
    """Encoders (BERT, ModernBERT's local windows, ViT), decoders (sliding windows, QK norms, GQA)
    and an encoder-decoder (Whisper: cross-attention): their outputs on qflash match SDPA's in
    float64, with a padded batch where the model takes text; every attention layer goes through
    qflash."""
    model_name, config_name, kwargs = _ARCHITECTURES[arch]
    if not hasattr(transformers, model_name):
        pytest.skip(f"this transformers has no {model_name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny vocabularies next to the real models' special tokens
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs))
    model = model.to(DEVICE, torch.float64).eval()
    ids = torch.randint(3, 97, (2, 13), device=DEVICE)
    mask = torch.ones(2, 13, dtype=torch.long, device=DEVICE)
    mask[0, :3] = 0
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    if arch == "vit":
        inputs = [dict(pixel_values=torch.randn(2, 3, 32, 32, device=DEVICE, dtype=torch.float64, generator=gen))]
    elif arch == "whisper":
        features = torch.randn(2, 8, 32, device=DEVICE, dtype=torch.float64, generator=gen)
        inputs = [dict(input_features=features, decoder_input_ids=ids)]
    else:
        inputs = [dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask)]

    def run(impl, kw):
        model.set_attn_implementation(impl)
        out = model(**kw)
        out = out.logits if hasattr(out, "logits") else out.last_hidden_state
        return out[mask.bool()] if "attention_mask" in kw else out

    for kw in inputs:
        calls = []
        forward = qhf.attention_forward
        transformers.AttentionInterface.register(NAME, lambda *a, **k: calls.append(1) or forward(*a, **k))
        try:
            out = run(NAME, kw)
        finally:
            qhf.register()
        assert len(calls) >= 2
        assert rel_l2_err(out, run("sdpa", kw)) < 1e-12


def test_sliding_window_without_a_mask():
    """Called with no mask and a window shorter than the keys (transformers passes a mask there
    itself, but a model's own code may not): query i sees keys i - window < j <= i."""
    from qflash.reference.attention import sdpa_ref

    q, k, v = (torch.randn(2, 4, 13, 16, device=DEVICE, dtype=torch.float64) for _ in range(3))
    out, _ = qhf.attention_forward(torch.nn.Module(), q, k, v, None, sliding_window=4, scaling=0.3)
    i, j = torch.arange(13, device=DEVICE)[:, None], torch.arange(13, device=DEVICE)[None, :]
    ref = sdpa_ref(q, k, v, attn_mask=(j <= i) & (j > i - 4), scale=0.3)
    assert rel_l2_err(out, ref.transpose(1, 2)) < 1e-12


def test_causal_alignment_without_a_mask():
    """The docstring's picture: with more keys than queries and no mask, the keys past seqlen_q
    are empty cache slots (garbage here) and left out; a single query sees every key."""
    from qflash.reference.attention import sdpa_ref

    q = torch.randn(1, 2, 3, 16, device=DEVICE, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 5, 16, device=DEVICE, dtype=torch.float64) for _ in range(2))
    k[:, :, 3:], v[:, :, 3:] = 1e4, float("nan")
    out, _ = qhf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True)
    ref = sdpa_ref(q, k[:, :, :3], v[:, :, :3], is_causal=True)
    assert rel_l2_err(out, ref.transpose(1, 2)) < 1e-12
    k, v = (torch.randn(1, 2, 5, 16, device=DEVICE, dtype=torch.float64) for _ in range(2))
    out, _ = qhf.attention_forward(torch.nn.Module(), q[:, :, :1], k, v, None, is_causal=True)
    assert rel_l2_err(out, sdpa_ref(q[:, :, :1], k, v).transpose(1, 2)) < 1e-12


def test_t5_position_bias_training_matches_sdpa():
    """T5: a learned relative-position bias added to the scores of every layer (encoder, causal
    decoder, cross-attention), with a padded encoder batch; the loss's gradients, the bias
    tables' among them, through the float mask's gradient."""
    cfg = transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
                                d_ff=64, relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
                                dropout_rate=0.0)
    model = transformers.T5ForConditionalGeneration(cfg).to(DEVICE, torch.float64)
    ids = torch.randint(1, 97, (2, 11), device=DEVICE)
    mask = torch.ones(2, 11, dtype=torch.long, device=DEVICE)
    mask[1, 8:] = 0
    labels = torch.randint(1, 97, (2, 7), device=DEVICE)
    runs = {}
    for impl in ("sdpa", NAME):
        model.zero_grad()
        model.set_attn_implementation(impl)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        runs[impl] = out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (ref, ref_grads), (got, got_grads) = runs["sdpa"], runs[NAME]
    assert rel_l2_err(got, ref) < 1e-12
    assert sum("relative_attention_bias" in n for n in ref_grads) == 2
    for name, g in ref_grads.items():
        assert rel_l2_err(got_grads[name], g) < 1e-10, name


@pytest.mark.parametrize("mode,floor_db", [("int8", 30.0), ("fp8", 20.0), ("fp8_row", 20.0)])
def test_quantized_llama_tracks_the_float_model(mode, floor_db):
    """``quantize_model`` on a transformers model: every projection but the head becomes a
    QuantizedLinear, the logits stay near the float model's, and greedy decoding (a KV cache)
    runs through the quantized layers."""
    from qflash.nn import QuantizedLinear, quantize_model
    from qflash.testing import sqnr_db

    torch.manual_seed(0)
    model = _llama(torch.float32, hidden_size=128, intermediate_size=256, head_dim=32)
    ids = torch.randint(0, 97, (2, 9), device=DEVICE)
    with torch.no_grad():
        ref = _logits(model, "sdpa", ids)
        quantize_model(model, mode, skip=["lm_head"])
        got = _logits(model, NAME, ids)
        out = model.generate(ids[:1], max_new_tokens=3, do_sample=False)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 7 and isinstance(model.lm_head, torch.nn.Linear)
    assert sqnr_db(got, ref) > floor_db  # (in the interpreter: int8 37 dB, fp8 25 and 24 dB)
    assert out.shape == (1, 12)


@pytest.mark.parametrize("mask", ["none", "causal", "bool"])
def test_position_bias_with_each_kind_of_mask(mask):
    """A position bias (T5's) beside no mask (every key seen, or the top-left causal order) or a
    boolean one (hidden keys): the float mask SDPA would get, bias plus -inf where hidden."""
    from qflash.reference.attention import sdpa_ref, visible_mask

    q = torch.randn(2, 3, 5, 16, device=DEVICE, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 7, 16, device=DEVICE, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(1, 3, 5, 7, device=DEVICE, dtype=torch.float64)
    seen = torch.ones(5, 7, dtype=torch.bool, device=DEVICE)
    attention_mask = None
    if mask == "causal":
        seen = visible_mask(5, 7, causal=True, bottom_right=False, device=DEVICE)
    elif mask == "bool":
        seen = torch.rand(2, 1, 5, 7, device=DEVICE) < 0.7
        seen[..., 0] = True  # a key for every query
        attention_mask = seen
    out, _ = qhf.attention_forward(torch.nn.Module(), q, k, v, attention_mask, is_causal=mask == "causal",
                                   position_bias=bias)
    ref = sdpa_ref(q, k, v, attn_mask=bias.masked_fill(~seen, float("-inf")))
    assert rel_l2_err(out, ref.transpose(1, 2)) < 1e-12


def _gpt_oss(dtype=torch.float64, **overrides):
    """Two layers, a sliding window of 4 on the first and full attention on the second, grouped-query
    heads (4 on 2, head dim 16), four experts (transformers' plain loop over them: its grouped
    products take no float64); sinks drawn at scale 2 and query / key projections scaled up, so
    that both weigh in the softmax."""
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
               layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
               experts_implementation="eager")
    cfg.update(overrides)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg)).to(DEVICE, dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 2.0)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
    return model


@torch.no_grad()
def test_gpt_oss_sinks_match_eager():
    """gpt-oss's attention sinks (``s_aux``, a learned score a head): without padding (no mask: the
    causal flag and the window reach the kernel) and left-padded (a boolean mask), against
    transformers' eager attention (gpt-oss has no SDPA path), which here computes in float64; and
    the sinks matter: with them at -inf (no sink) the logits move."""
    model = _gpt_oss()
    ids = torch.randint(0, 97, (2, 13), device=DEVICE)
    mask = torch.ones(2, 13, dtype=torch.long, device=DEVICE)
    mask[0, :4] = 0
    real = mask.bool()
    assert rel_l2_err(_logits(model, NAME, ids), _logits(model, "eager", ids)) < 1e-12
    out = _logits(model, NAME, ids, attention_mask=mask)
    assert out.isfinite().all()
    assert rel_l2_err(out[real], _logits(model, "eager", ids, attention_mask=mask)[real]) < 1e-12
    for layer in model.model.layers:
        layer.self_attn.sinks.fill_(float("-inf"))
    assert rel_l2_err(_logits(model, NAME, ids, attention_mask=mask)[real], out[real]) > 1e-2


def test_gpt_oss_training_gradients_match_eager():
    """Training gpt-oss: every parameter's gradient through qflash's backward, the sinks' among them."""
    grads = _training_grads(_gpt_oss(), ("eager", NAME))
    assert grads[NAME].keys() == grads["eager"].keys()
    assert sum(name.endswith("sinks") for name in grads[NAME]) == 2
    for name, g in grads["eager"].items():
        assert g.abs().max() > 0, name
        assert rel_l2_err(grads[NAME][name], g) < 1e-10, name


def test_unsupported_arguments_raise():
    q = torch.randn(1, 2, 5, 16, device=DEVICE)
    module = torch.nn.Module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, weights = qhf.attention_forward(module, q, q, q, None, output_attentions=True)
    assert weights is None and out.shape == (1, 5, 2, 16) and "attention weights" in str(caught[0].message)


def test_register_without_transformers_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="qflash\\[integrations\\]"):
        qhf.register()


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_bf16_logits_within_the_accuracy_rule():
    """bfloat16 on the GPU, without and with padding: logits against the float64 model, within
    twice SDPA's own bfloat16 error (plus a rounding floor)."""
    model = _llama(torch.float64, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 97, (2, 300), device=DEVICE)
    ref = _logits(model, "sdpa", ids)
    mask = torch.ones(2, 300, dtype=torch.long, device=DEVICE)
    mask[1, :37] = 0  # left padding: the boolean-mask path
    ref_padded = _logits(model, "sdpa", ids, attention_mask=mask)[mask.bool()]
    model = model.to(torch.bfloat16)
    out = _logits(model, NAME, ids).double()
    pt = _logits(model, "sdpa", ids).double()
    assert rel_l2_err(out, ref) <= 2 * rel_l2_err(pt, ref) + 1e-3
    out = _logits(model, NAME, ids, attention_mask=mask)[mask.bool()].double()
    pt = _logits(model, "sdpa", ids, attention_mask=mask)[mask.bool()].double()
    assert rel_l2_err(out, ref_padded) <= 2 * rel_l2_err(pt, ref_padded) + 1e-3


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_gpt_oss_bf16_logits_within_the_accuracy_rule():
    """gpt-oss in bfloat16 on the GPU (head dim 64 as the real model's, a window of 128 on the first
    layer; 256 tokens, so that the full-attention layer takes the Gluon kernel), without and with
    padding: logits against the float64 model, within twice eager attention's own bfloat16 error
    (plus a rounding floor)."""
    model = _gpt_oss(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                     sliding_window=128, max_position_embeddings=512)
    ids = torch.randint(0, 97, (2, 256), device=DEVICE)
    mask = torch.ones(2, 256, dtype=torch.long, device=DEVICE)
    mask[1, :37] = 0
    real = mask.bool()
    ref = _logits(model, "eager", ids)
    ref_padded = _logits(model, "eager", ids, attention_mask=mask)[real]
    model = model.to(torch.bfloat16)
    out, pt = (_logits(model, impl, ids).double() for impl in (NAME, "eager"))
    assert rel_l2_err(out, ref) <= 2 * rel_l2_err(pt, ref) + 1e-3
    out, pt = (_logits(model, impl, ids, attention_mask=mask)[real].double() for impl in (NAME, "eager"))
    assert rel_l2_err(out, ref_padded) <= 2 * rel_l2_err(pt, ref_padded) + 1e-3
