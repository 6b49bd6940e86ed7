"""Attention sinks (gpt-oss) on the H200: what the sink costs, and what a model runs without it.

gpt-oss's attention: 64 query heads on 8 key/value heads, head dim 64, bfloat16; full causal
layers and sliding-window layers of 128 keys; one sink score a query head. Side by side, one run:

- prefill, forward and forward + backward: qflash with sinks and without (the sink's cost);
  FlexAttention (compiled, the same mask) with the sink put in afterwards from its log-sum-exp,
  ``out * exp(lse - logaddexp(lse, sink))``, as one adds sinks onto a kernel that has none; and
  transformers' eager attention of gpt-oss (its default: scores materialized), where they fit;
- decoding (``flash_attn_with_kvcache``, one new token a sequence), from CUDA graphs: qflash with
  sinks and without.

Each provider's output is compared with qflash's (``max_diff``), so that a provider that got the
sink wrong shows. Batch x seqlen = 16k tokens for prefill.
"""

import argparse
import math

import torch

from qflash.bench.harness import compiled_flex_attention, environment, graph_ms, save_json, time_ms
from qflash.testing import attention_sinks

HEADS, HEADS_KV, HEAD_DIM = 64, 8, 64
EAGER_MAX_SCORES = 2**31  # score elements eager attention may materialize (bf16: 4 GB, then its softmax's copies)


def _sinks(seed: int):
    return attention_sinks(HEADS, dtype=torch.bfloat16, device="cuda", seed=seed)


def qflash_prefill(q, k, v, sinks, window):
    import qflash

    size = (window - 1, 0) if window else (-1, -1)
    return lambda: qflash.flash_attn_func(q, k, v, causal=True, window_size=size, sinks=sinks)


def flex_prefill(q, k, v, sinks, window):
    from torch.nn.attention.flex_attention import create_block_mask

    n = q.shape[1]

    def visible(b, h, i, j):
        return (j <= i) & (i - j < window) if window else j <= i

    mask = create_block_mask(visible, None, None, n, n, device=q.device)
    compiled = compiled_flex_attention()
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def run():
        out, lse = compiled(qt, kt, vt, block_mask=mask, enable_gqa=True, return_lse=True)
        # the sink's share, taken from each row's weight: exp(lse) / (exp(lse) + exp(sink))
        keep = torch.exp(lse - torch.logaddexp(lse, sinks.float()[None, :, None]))
        return (out * keep[..., None].to(out.dtype)).transpose(1, 2)

    return run


def eager_prefill(q, k, v, sinks, window):
    """transformers' gpt-oss eager attention, written out (its module wants a whole layer)."""
    n = q.shape[1]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    i = torch.arange(n, device=q.device)
    hidden = (i[None, :] > i[:, None]) | ((i[:, None] - i[None, :] >= window) if window else False)
    bias = torch.zeros(n, n, device=q.device, dtype=q.dtype).masked_fill(hidden, float("-inf"))

    def run():
        kr, vr = (t.repeat_interleave(HEADS // HEADS_KV, dim=1) for t in (kt, vt))
        scores = torch.matmul(qt, kr.transpose(2, 3)) / math.sqrt(HEAD_DIM) + bias
        column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, n, 1).to(scores.dtype)
        logits = torch.cat([scores, column], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1].to(vr.dtype)
        return torch.matmul(probs, vr).transpose(1, 2)

    return run


def _with_backward(fn, leaves, dout):
    def run():
        out = fn()
        torch.autograd.grad(out, leaves, dout)
        return out

    return run


# provider -> (builder, whether it takes the sinks)
PREFILL = {"qflash_sinks": (qflash_prefill, True), "qflash_no_sinks": (qflash_prefill, False),
           "flex_sinks_after": (flex_prefill, True), "eager_hf": (eager_prefill, True)}


def prefill_rows(seqlens, windows, backward, rows, save):
    for n in seqlens:
        batch = max(1, 16384 // n)
        g = torch.Generator(device="cuda").manual_seed(n)
        q = torch.randn(batch, n, HEADS, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
        k, v = (torch.randn(batch, n, HEADS_KV, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
                for _ in range(2))
        sinks = _sinks(n)
        for window in windows:
            names = [name for name in PREFILL if name != "eager_hf" or batch * HEADS * n * n <= EAGER_MAX_SCORES]
            ref = qflash_prefill(q, k, v, sinks, window)().float()
            visible = sum(min(i + 1, window) if window else i + 1 for i in range(n))
            flops = 4.0 * batch * HEADS * HEAD_DIM * visible * (3.5 if backward else 1.0)
            for name in names:
                build, takes_sinks = PREFILL[name]
                try:
                    # leaves of their own for the backward (the sinks among them where taken)
                    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v, sinks)][:4 if takes_sinks else 3]
                    fn = build(*leaves[:3], leaves[3] if takes_sinks else None, window)
                    diff = float((fn().float() - ref).abs().max())
                    if backward:
                        fn = _with_backward(fn, leaves, torch.randn_like(q))
                    t = time_ms(fn, rep_ms=100)
                except Exception as e:  # noqa: BLE001 - a provider that cannot run this shape: its row says why
                    rows.append(dict(part="prefill", provider=name, seqlen=n, batch=batch, window=window,
                                     backward=backward, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    print(rows[-1], flush=True)
                    torch.cuda.empty_cache()
                    continue
                rows.append(dict(part="prefill", provider=name, seqlen=n, batch=batch, window=window,
                                 backward=backward, ms=t["ms"], ms_p20=t["ms_p20"], ms_p80=t["ms_p80"],
                                 tflops=flops / t["ms"] / 1e9, max_diff=diff))
                print(rows[-1], flush=True)
                save()
        del q, k, v
        torch.cuda.empty_cache()


def decode_rows(batches, caches, rows, save):
    import qflash

    for batch in batches:
        for slots in caches:
            g = torch.Generator(device="cuda").manual_seed(batch * 7 + slots)
            q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
            k_cache, v_cache = (torch.randn(batch, slots, HEADS_KV, HEAD_DIM, device="cuda", generator=g)
                                .to(torch.bfloat16) for _ in range(2))
            lens = torch.full((batch,), slots, dtype=torch.int32, device="cuda")
            sinks = _sinks(batch)
            ref = qflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, sinks=sinks).float()
            for name, s in (("qflash_sinks", sinks), ("qflash_no_sinks", None)):
                def fn(s=s):
                    return qflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, sinks=s)
                diff = float((fn().float() - ref).abs().max())
                rows.append(dict(part="decode", provider=name, batch=batch, cache=slots, us=1e3 * graph_ms(fn),
                                 max_diff=diff))
                print(rows[-1], flush=True)
                save()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--windows", default="0,128", help="0: full causal")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--caches", default="4096,65536")
    p.add_argument("--parts", default="decode,prefill")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    result = dict(environment=environment(), rows=[], complete=False)

    def save():  # after every row: a run cut short keeps what it measured
        if args.out:
            save_json(args.out, result)

    parts = args.parts.split(",")
    if "decode" in parts:
        decode_rows(ints(args.batches), ints(args.caches), result["rows"], save)
    if "prefill" in parts:
        for backward in (False, True):
            prefill_rows(ints(args.seqlens), ints(args.windows), backward, result["rows"], save)
    result["complete"] = True
    save()


if __name__ == "__main__":
    main()
