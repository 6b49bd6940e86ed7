"""Causal work order and output path of the Gluon forward, timed side by side.

    python3 benchmarks/gluon_order.py --out order.json [--head-dims 64,128,256] [--seqlens 512,...]
        [--groups 1,auto,all] [--consumers 2] [--block-n 64 --stages 4] [--tma-store on,off] [--graph]

bf16, batch x seqlen = 16k tokens, heads x headdim = 2048 (the attention benchmark's shapes).
Each order is checked against PyTorch's attention, then timed on the same inputs in one process;
the JSON keeps every row.
"""

import argparse
import math

import torch

from qflash.bench.harness import environment, graph_ms, save_json, time_ms
from qflash.kernels import attention_gluon
from qflash.kernels.common import sm_count


def _sdpa(q, k, v, causal):
    """PyTorch's attention on (batch, seqlen, heads, headdim) tensors."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal)
    return out.transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--groups", default="1,auto,all", help="heads per group to time: numbers, auto, all")
    parser.add_argument("--consumers", type=int, default=None, help="consumer warpgroups instead of tile_config's")
    parser.add_argument("--block-n", type=int, default=None, help="keys a tile instead of tile_config's")
    parser.add_argument("--stages", type=int, default=None, help="K/V ring slots instead of tile_config's")
    parser.add_argument("--causal", choices=("true", "false"), default="true",
                        help="false: time the tiles without a mask (one order, --groups is ignored)")
    parser.add_argument("--tma-store", default="default",
                        help="output by bulk copies (on), plain stores (off) or stores_by_tma's choice (default); "
                             "a comma-separated list times each")
    parser.add_argument("--graph", action="store_true", help="also time each build replayed from a CUDA graph")
    args = parser.parse_args()
    tile_config = attention_gluon.tile_config

    def experiment(d, causal=False, seqlen_k=0):  # tile_config with what the options replace
        consumers, block_n, stages, q_buffers = tile_config(d, causal, seqlen_k)
        return args.consumers or consumers, args.block_n or block_n, args.stages or stages, q_buffers

    attention_gluon.tile_config = experiment
    result = {"env": environment(), "rows": []}
    causal = args.causal == "true"
    for head_dim in map(int, args.head_dims.split(",")):
        heads = 2048 // head_dim
        for seqlen in map(int, args.seqlens.split(",")):
            batch = 16384 // seqlen
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            consumers, block_n, _, _ = attention_gluon.tile_config(head_dim, causal, seqlen)
            m_blocks = -(-seqlen // (consumers * attention_gluon.SUB_M))
            grid = min(batch * heads * m_blocks, sm_count(q.device))
            auto = attention_gluon.causal_heads_per_group(batch * heads, m_blocks, grid, consumers * attention_gluon.SUB_M,
                                                          block_n, seqlen, 0)
            flops = 4 * batch * heads * seqlen**2 * head_dim / (2 if causal else 1)
            # Each build is checked before it is timed: max error against a float32 reference
            # within twice PyTorch's own bf16 attention's (plus a rounding floor).
            ref = _sdpa(q.float(), k.float(), v.float(), causal)
            torch_err = (_sdpa(q, k, v, causal).float() - ref).abs().max().item()
            line = []
            named = {"auto": auto, "all": batch * heads}
            stores = {"on": True, "off": False, "default": None}
            for name in args.groups.split(",") if causal else ["all"]:
                group = named.get(name) or int(name)
                if group > batch * heads:
                    continue
                for store in args.tma_store.split(","):
                    fn = lambda g=group, t=stores[store]: attention_gluon.launch(  # noqa: E731
                        q, k, v, head_dim**-0.5, causal, True, heads_per_group=g, tma_store=t)
                    out = fn()[0]
                    err = (out.float() - ref).abs().max().item()
                    check = "ok" if err <= 2 * torch_err + 1e-3 and torch.isfinite(out).all() else "WRONG"
                    ms = time_ms(fn)["ms"]
                    ms_graph = graph_ms(fn) if args.graph else None
                    tflops = flops / ms / 1e9
                    tflops_graph = flops / ms_graph / 1e9 if ms_graph else None
                    result["rows"].append(dict(head_dim=head_dim, seqlen=seqlen, causal=causal, order=name,
                                               heads_per_group=group, consumers=consumers, block_n=block_n,
                                               tma_store=store, ms=ms, ms_graph=ms_graph, tflops=tflops,
                                               tflops_graph=tflops_graph, max_err=err, torch_max_err=torch_err,
                                               check=check))
                    graph = f"/{tflops_graph:6.1f}" if tflops_graph else ""
                    line.append(f"{name} (G={group}) store={store} {tflops:6.1f}{graph} {check}")
            print(f"D={head_dim:3d} S={seqlen:5d}  " + "  ".join(line), flush=True)
            save_json(args.out, result)
    assert math.isfinite(sum(r["ms"] for r in result["rows"]))


if __name__ == "__main__":
    main()
