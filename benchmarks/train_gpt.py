"""Proof that qflash trains: a small GPT, same seed and data, qflash attention vs PyTorch SDPA.

    python benchmarks/train_gpt.py --steps 300 --out out/train_gpt.json    (writes a PNG beside it)

The data is a token stream drawn from a fixed random bigram model (vocabulary 512), so the
loss has somewhere to go (from ln 512 = 6.24 towards the chain's entropy) without any
download. Three runs: SDPA and qflash from the same initialization, and SDPA from another
seed as the yardstick of run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def bigram_stream(vocab: int, n_tokens: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    # Each token has 8 likely successors: a learnable, non-trivial distribution.
    logits = torch.full((vocab, vocab), -4.0)
    for t in range(vocab):
        logits[t, torch.randint(vocab, (8,), generator=g)] = 2.0 + torch.rand(8, generator=g) * 2
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.empty(n_tokens, dtype=torch.long)
    tokens[0] = 0
    draws = torch.rand(n_tokens, generator=g)
    cdf = probs.cumsum(dim=-1)
    for i in range(1, n_tokens):
        tokens[i] = torch.searchsorted(cdf[tokens[i - 1]], draws[i]).clamp_max(vocab - 1)
    return tokens.to(device)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, attention: str):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads)
        if self.attention == "qflash":
            import qflash

            y = qflash.flash_attn_qkvpacked_func(qkv, causal=True)  # (b, s, heads, head_dim)
        else:
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        x = x + self.proj(y.reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=512, d_model=512, layers=4, heads=8, seqlen=1024, attention="sdpa"):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seqlen, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, attention) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def train(attention: str, seed: int, data: torch.Tensor, steps: int, batch: int, seqlen: int) -> dict:
    torch.manual_seed(seed)
    model = GPT(seqlen=seqlen, attention=attention).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator(device="cpu").manual_seed(1234)  # the same batches for every run
    losses, times = [], []
    for step in range(steps):
        starts = torch.randint(len(data) - seqlen - 1, (batch,), generator=g)
        idx = torch.stack([data[s : s + seqlen] for s in starts.tolist()])
        tgt = torch.stack([data[s + 1 : s + seqlen + 1] for s in starts.tolist()])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(idx).float().view(-1, 512), tgt.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"{attention}: loss became {losses[-1]} at step {step}")
    settled = sorted(times[min(10, steps // 2):])  # leave out warm-up (compilation)
    return {"attention": attention, "seed": seed, "loss": losses, "step_ms_median": 1e3 * settled[len(settled) // 2]}


def profile_steps(attention: str, data: torch.Tensor, steps: int, batch: int, seqlen: int) -> str:
    """Where a training step's time goes: torch.profiler over ``steps`` steps after a warm-up,
    the ops and kernels by device time and by host time, and the step's wall time beside its
    device time (a step whose wall time exceeds its device time waits on the host)."""
    torch.manual_seed(0)
    model = GPT(seqlen=seqlen, attention=attention).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    idx = torch.stack([data[s : s + seqlen] for s in range(0, batch * 997, 997)])
    tgt = torch.stack([data[s + 1 : s + seqlen + 1] for s in range(0, batch * 997, 997)])

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(idx).float().view(-1, 512), tgt.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    # Host time (until the step's last launch returns) against wall time (until the GPU is done).
    host, wall = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
    host_ms, plain_ms = 1e3 * sorted(host)[10], 1e3 * sorted(wall)[10]
    # The attention op alone at this shape: host time of a forward and of its backward.
    qkv = torch.randn(batch, seqlen, 3, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    import qflash

    def attend(t):
        if attention == "qflash":
            return qflash.flash_attn_qkvpacked_func(t, causal=True)
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in t.unbind(2)), is_causal=True)

    fwd_us, bwd_us = [], []
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = attend(qkv)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        fwd_us.append((t1 - t0) * 1e6)
        bwd_us.append((t2 - t1) * 1e6)
    op = f"attention op: forward {sorted(fwd_us)[15]:.0f} us, backward {sorted(bwd_us)[15]:.0f} us of host time\n"
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]  # not the ops above them
    device_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    head = (f"{attention}: {plain_ms:.2f} ms a step, {host_ms:.2f} ms of it until the last launch returned; "
            f"profiled: {wall_ms:.2f} ms a step, kernels {device_ms:.2f} ms a step\n" + op)
    # The host's Python, function by function (cProfile), over the same number of steps.
    import cProfile
    import io
    import pstats

    with cProfile.Profile() as python:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(30)
    return (head + events.table(sort_by="self_cuda_time_total", row_limit=25) + "\n"
            + events.table(sort_by="cpu_time_total", row_limit=25) + "\n" + text.getvalue())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--out", default="train_gpt.json")
    p.add_argument("--profile", type=int, default=0, help="instead of training: profile this many steps of each")
    args = p.parse_args()
    data = bigram_stream(512, 400_000, seed=0, device="cuda")
    if args.profile:
        from qflash.bench.harness import environment

        report = "\n".join([json.dumps(environment())] + [profile_steps(a, data, args.profile, args.batch, args.seqlen)
                                                          for a in ("sdpa", "qflash")])
        with open(args.out, "w") as f:
            f.write(report)
        print(report)
        return
    runs = [train(a, s, data, args.steps, args.batch, args.seqlen) for a, s in (("sdpa", 0), ("qflash", 0), ("sdpa", 1))]
    sdpa, qf, other = (r["loss"] for r in runs)
    tail = slice(args.steps // 2, None)  # compare once the curves have settled

    def mean_gap(a, b):
        return sum(abs(x - y) for x, y in zip(a[tail], b[tail])) / len(a[tail])

    summary = {
        "final_loss": {f"{r['attention']}_seed{r['seed']}": sum(r["loss"][-20:]) / len(r["loss"][-20:]) for r in runs},
        "mean_abs_gap_second_half": {"qflash_vs_sdpa_same_seed": mean_gap(qf, sdpa),
                                     "sdpa_seed0_vs_seed1 (noise)": mean_gap(other, sdpa)},
        "step_ms_median": {f"{r['attention']}_seed{r['seed']}": r["step_ms_median"] for r in runs},
    }
    from qflash.bench.harness import environment

    result = {"env": environment(), "config": vars(args) | {"layers": 4, "d_model": 512, "heads": 8, "vocab": 512},
              "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r, style in zip(runs, ("-", "--", ":")):
        ax.plot(r["loss"], style, label=f"{r['attention']} (seed {r['seed']})")
    ax.set(xlabel="step", ylabel="training loss", title="4-layer GPT, d=512, seq 1024, bf16")
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot([a - b for a, b in zip(qf, sdpa)], label="qflash - sdpa (same seed)")
    ax2.plot([a - b for a, b in zip(other, sdpa)], label="sdpa seed 1 - sdpa seed 0 (noise)", alpha=0.7)
    ax2.set(xlabel="step", ylabel="loss difference")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)


if __name__ == "__main__":
    main()
