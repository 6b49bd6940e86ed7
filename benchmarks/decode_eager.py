"""Eager greedy decoding with quantized linear layers and qflash's attention, against bfloat16 and
PyTorch's SDPA, with replayed launches (kernels/replay.py) and without, side by side in one process.

    python3 benchmarks/decode_eager.py --layers 4 --tokens 64 --out decode_eager.json
    python3 benchmarks/decode_eager.py --attention sdpa,qf_attention --out decode_eager.json
    python3 benchmarks/decode_eager.py --models bf16 --attention sdpa,qf_attention --rounds 9 --out d.json
    python3 benchmarks/decode_eager.py --models bf16 --attention sdpa,qf_attention --second-call-recording --out d.json

A ``LlamaForCausalLM`` of Llama-3-8B's widths (hidden 4096, MLP 14336, 32 heads, 8 KV heads, a
32000-token vocabulary) with ``--layers`` decoder layers and random weights generates ``--tokens``
new tokens after a 16-token prompt at batch 1 (transformers' ``generate``, eager, with each
attention implementation of ``--attention``: transformers' "sdpa", or qflash's "qf_attention").
The INT8 and FP8 models (``--models``) are copies made by ``quantize_model`` (``lm_head`` kept in
bfloat16). Each round times every run in turn, the order reversed every other round; ms a token is
the ``generate`` call's time over the new tokens. Besides the medians, each run's ratio to the
first run within each round (the host's pace drifts between rounds more than within one), and
their median. The tokens of a run with replays must be those without. ``--second-call-recording``
adds qflash's attention with replays whose kinds record on their second call only (the policy
before session 61: each step's new key length took the normal path in its first layer and a
recording in its second, where now the first layer records at once).
"""

import argparse
import copy
import statistics
import time

import torch

import qflash.kernels.replay as replay
from qflash.bench.harness import environment, save_json
from qflash.integrations.transformers import register
from qflash.nn import quantize_model
from qflash.ops.attention import _EAGER_FORWARDS


def _generate(model, prompt, tokens: int) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="tiny widths (a check of the script on any device)")
    parser.add_argument("--models", default="bf16,int8,fp8", help="comma-separated: bf16, int8, fp8")
    parser.add_argument("--attention", default="sdpa", help="attention implementations, comma-separated: "
                        "sdpa (transformers'), qf_attention (qflash's)")
    parser.add_argument("--second-call-recording", action="store_true",
                        help="also qf_attention runs whose replays record a kind on its second call only")
    parser.add_argument("--out")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    widths = (dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=512) if args.small else
              dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                   vocab_size=32000))
    config = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=4096, **widths)
    torch.manual_seed(0)
    with torch.device(dev):
        base = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    models = {name: base if name == "bf16" else quantize_model(copy.deepcopy(base), name, skip=["lm_head"])
              for name in args.models.split(",")}
    attentions = args.attention.split(",")
    if "qf_attention" in attentions:
        register()
    qf_modes = ("on", "off", "second") if args.second_call_recording else ("on", "off")

    def modes(name, attention):  # replays: "on", "off", "second" (on, a kind recorded on its second call)
        if (name, attention) == ("bf16", "sdpa"):  # (launches no qflash kernel: one run, the yardstick)
            return ("on",)
        return qf_modes if attention == "qf_attention" else ("on", "off")

    runs = [(name, attention, mode) for attention in attentions for name in models for mode in modes(name, attention)]
    prompt = torch.randint(0, config.vocab_size, (1, 16), device=dev)
    tokens = {}
    with torch.no_grad():
        for run in runs:  # compile, record the replays, and keep each run's tokens
            tokens[run] = _timed_generate(models, run, prompt, args.tokens)[0]
        times = {run: [] for run in runs}
        for r in range(args.rounds):
            for run in runs if r % 2 == 0 else runs[::-1]:
                times[run].append(_timed_generate(models, run, prompt, args.tokens)[1])
    replay.ENABLED, _EAGER_FORWARDS.record_after_replay = True, True
    rows = []
    yardstick = runs[0]
    base_ms = statistics.median(times[yardstick])
    for (name, attention, replays), ms in times.items():
        median = statistics.median(ms)
        same = torch.equal(tokens[name, attention, replays], tokens[name, attention, "on"])
        in_rounds = [first / t for first, t in zip(times[yardstick], ms)]  # x the first run, round by round
        rows.append(dict(model=name, attention=attention, replays=replays, ms_per_token=ms, median_ms=median,
                         x_first=base_ms / median, x_first_in_rounds=in_rounds,
                         x_first_in_rounds_median=statistics.median(in_rounds),
                         tokens_same_with_and_without_replays=same))
        print(f"{name:5s} {attention:12s} replays {replays:6s}  {median:7.3f} ms a token  "
              f"({base_ms / median:.2f} x {yardstick[0]} {yardstick[1]}; in rounds, median "
              f"{statistics.median(in_rounds):.3f})  rounds {', '.join(f'{t:.3f}' for t in ms)}"
              f"{'' if same else '  TOKENS DIFFER with and without replays'}", flush=True)
    if args.out:
        save_json(args.out, {"env": environment(), "layers": args.layers, "tokens": args.tokens,
                             "config": widths, "first_run": yardstick, "rows": rows})


def _timed_generate(models: dict, run: tuple, prompt, tokens: int):
    """(the tokens, ms a new token) of one ``generate`` of ``run`` = (model, attention, replays)."""
    name, attention, replays = run
    model = models[name]
    replay.ENABLED, _EAGER_FORWARDS.record_after_replay = replays != "off", replays != "second"
    model.config._attn_implementation = attention  # (read by every layer at each call)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = _generate(model, prompt, tokens)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / tokens * 1e3


if __name__ == "__main__":
    main()
