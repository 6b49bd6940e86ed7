"""FlashAttention forward for Hopper in Gluon: warp-specialized, EXPERIMENTAL.

Not used by the public ops yet: it has been built for sm_90 offline (tests/test_attention_gluon.py
checks that it compiles on any machine) but not yet run on a GPU. The ``tl`` kernel in
``attention.py`` stays the implementation; this is the schedule that ``tl`` cannot express on
Hopper in Triton 3.6 (benchmarks/NOTES.md, fourth round):

    one CTA = 128 query rows of one (batch, head), in three partitions
      consumer 0 (4 warps)   rows  0-63  \\  S = Q K^T and O += P V on the tensor cores (wgmma),
      consumer 1 (4 warps)   rows 64-127 /  the online softmax in registers, while the other
                                            warpgroup's products run
      loader     (1 warp)    Q once, then K and V tiles into a ring of STAGES shared-memory slots

    ring slot s:  loader --k_ready[s] / v_ready[s]--> consumers --kv_empty[s] (both)--> loader

The loader needs few registers (setmaxnreg gives it 24), so each consumer can hold its 64 x D
float32 accumulator, the 64 x BLOCK_N scores and the bf16 probabilities without spilling.

Scope for now: no mask (not causal, no window), dense contiguous (batch, seqlen, heads, headdim)
inputs, float16 / bfloat16, head dim 64 or 128, seqlen a multiple of 128, as many K/V heads as
query heads. The launcher refuses anything else with a clear error.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from qflash.testing import new_output

RCP_LN2 = gl.constexpr(1.4426950408889634)  # 1 / ln(2): exp(x) == exp2(x * RCP_LN2)
SUB_M = 64  # query rows a consumer warpgroup owns (wgmma's M per warpgroup)
BLOCK_M = 2 * SUB_M  # query rows a CTA owns
HEAD_DIMS = (64, 128)


# Row reductions written out: gl.max / gl.sum are triton.jit functions, which Triton's
# interpreter mode (the CPU tests) replaces by Python ones that a Gluon build cannot call.
@gluon.jit
def _maximum(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _attn_fwd_loader(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, k_ready, v_ready, kv_empty,
                     seqlen, num_heads, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the CTA's two Q tiles, then every K/V tile of its (batch, head) through the ring."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    bh = gl.program_id(1)
    b = bh // num_heads
    col = (bh % num_heads) * HEAD_DIM  # this head's columns in the (B * S, H * D) view
    row0 = b * seqlen + gl.program_id(0) * 2 * ROWS
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0, col], q_ready, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [row0 + ROWS, col], q_ready, q_smem.index(1))
    for j in range(seqlen // BLOCK_N):
        s = j % STAGES
        # Wait until both consumers released the slot; on the first lap the wait on the
        # previous (parity 1) phase of a fresh barrier passes at once.
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        key0 = b * seqlen + j * BLOCK_N
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [key0, col], k_ready.index(s), k_ring.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [key0, col], v_ready.index(s), v_ring.index(s))


@gluon.jit
def _attn_fwd_consumer(o_desc, Lse, q_smem, k_ring, v_ring, o_smem, q_ready, k_ready, v_ready, kv_empty,
                       seqlen, num_heads, qk_scale, WHICH: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: the online softmax over every K/V tile for its 64 query rows."""
    ROWS: gl.constexpr = o_desc.block_type.shape[0]
    # wgmma accumulators: scores [ROWS, BLOCK_N] and output [ROWS, HEAD_DIM], 4 warps down M.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)  # P from registers
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)  # running max (log2 domain)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)  # running sum
    acc = gl.zeros((ROWS, HEAD_DIM), dtype=gl.float32, layout=o_layout)  # [ROWS, HEAD_DIM]
    no_scores = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=s_layout)
    q = q_smem.index(WHICH)
    mbarrier.wait(q_ready, 0)
    for j in range(seqlen // BLOCK_N):
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        qk = warpgroup_mma(q, k_ring.index(s).permute((1, 0)), no_scores, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))  # [ROWS, BLOCK_N]
        # scale > 0 keeps the argmax: max of the raw products, then one FMA per element
        m_new = gl.maximum(m_i, gl.reduce(qk, 1, _maximum) * qk_scale)
        p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))  # [ROWS, BLOCK_N]
        alpha = gl.exp2(m_i - m_new)  # rescales what the accumulator holds
        l_i = l_i * alpha + gl.reduce(p, 1, _add)
        m_i = m_new
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p = gl.convert_layout(p.to(v_ring.dtype), p_layout)
        mbarrier.wait(v_ready.index(s), phase)
        acc = warpgroup_mma(p, v_ring.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(s), count=1)  # this warpgroup is done with slot s

    # One division at the end; the log-sum-exp in natural log.
    out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    bh = gl.program_id(1)
    m0 = gl.program_id(0) * 2 * ROWS + WHICH * ROWS
    o_smem.index(WHICH).store(out.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [(bh // num_heads) * seqlen + m0, (bh % num_heads) * HEAD_DIM],
                                    o_smem.index(WHICH))
    rows = m0 + gl.arange(0, ROWS, layout=row_s)
    gl.store(Lse + bh.to(gl.int64) * seqlen + rows, (m_i + gl.log2(l_i)) / RCP_LN2)
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd_consumer_1(o_desc, Lse, q_smem, k_ring, v_ring, o_smem, q_ready, k_ready, v_ready, kv_empty,
                         seqlen, num_heads, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr):
    # The second warpgroup as a worker partition of its own (partitions take runtime arguments only).
    _attn_fwd_consumer(o_desc, Lse, q_smem, k_ring, v_ring, o_smem, q_ready, k_ready, v_ready, kv_empty,
                       seqlen, num_heads, qk_scale, 1, HEAD_DIM, BLOCK_N, STAGES)


@gluon.jit
def _attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, Lse, seqlen, num_heads, qk_scale,
                        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [2, ROWS, HEAD_DIM], o_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)  # both consumers release a slot
    gl.warp_specialize([
        (_attn_fwd_consumer, (o_desc, Lse, q_smem, k_ring, v_ring, o_smem, q_ready, k_ready, v_ready, kv_empty,
                              seqlen, num_heads, qk_scale, 0, HEAD_DIM, BLOCK_N, STAGES)),
        (_attn_fwd_consumer_1, (o_desc, Lse, q_smem, k_ring, v_ring, o_smem, q_ready, k_ready, v_ready, kv_empty,
                                seqlen, num_heads, qk_scale, HEAD_DIM, BLOCK_N, STAGES)),
        (_attn_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, k_ready, v_ready, kv_empty,
                            seqlen, num_heads, HEAD_DIM, BLOCK_N, STAGES)),
    ], [4, 1], [232, 24])


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def tile_config(head_dim: int) -> Tuple[int, int]:
    """(BLOCK_N, STAGES): two slots of 128 keys fit shared memory at D = 128 (197 KB)."""
    return (128, 2) if head_dim <= 128 else (64, 2)


def check_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a clear error for anything this kernel does not take (yet)."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one (batch, seqlen, heads, headdim) shape here, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must all be float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    seqlen, head_dim = q.shape[1], q.shape[3]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS} here, got {head_dim}")
    if seqlen == 0 or seqlen % BLOCK_M:
        raise ValueError(f"seqlen must be a positive multiple of {BLOCK_M} here, got {seqlen}")
    if q.shape[0] * q.shape[2] > 65535:  # batch x heads is the grid's second axis
        raise ValueError(f"batch x heads must be at most 65535 here, got {q.shape[0] * q.shape[2]}")
    if not all(t.is_contiguous() for t in (q, k, v)):
        raise ValueError("q, k, v must be contiguous here")
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        raise RuntimeError(f"the Gluon kernel runs on Hopper (compute capability 9.x), got a tensor on {q.device}")


def attention_forward_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of non-causal attention: q, k, v (B, S, H, D) contiguous; lse (B, H, S) float32."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    check_supported(q, k, v)
    batch, seqlen, heads, head_dim = q.shape
    block_n, stages = tile_config(head_dim)
    out = new_output(q.shape, dtype=q.dtype, device=q.device)
    lse = new_output((batch, heads, seqlen), dtype=torch.float32, device=q.device)
    dtype = _GL_DTYPES[q.dtype]

    def desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
        flat = t.view(batch * seqlen, heads * head_dim)  # one head = a column band of the 2-D view
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], dtype)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, head_dim], layout)

    grid = (seqlen // BLOCK_M, batch * heads)
    _attn_fwd_ws_kernel[grid](
        desc(q, SUB_M), desc(k, block_n), desc(v, block_n), desc(out, SUB_M), lse, seqlen, heads,
        softmax_scale * RCP_LN2.value,
        HEAD_DIM=head_dim, BLOCK_N=block_n, STAGES=stages, num_warps=4,
    )
    return out, lse


def compile_for_sm90(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16):
    """Build the kernel for sm_90 without a GPU (what the CPU test checks): the compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    block_n, stages = tile_config(head_dim)
    gdt = _GL_DTYPES[dtype]
    name = {gl.float16: "fp16", gl.bfloat16: "bf16"}[gdt]

    def desc(rows: int) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gdt)
        return f"tensordesc<{name}[{rows}, {head_dim}],{layout!r}>"

    fn = _attn_fwd_ws_kernel
    signature = {"q_desc": desc(SUB_M), "k_desc": desc(block_n), "v_desc": desc(block_n), "o_desc": desc(SUB_M),
                 "Lse": "*fp32", "seqlen": "i32", "num_heads": "i32", "qk_scale": "fp32",
                 "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr"}
    index = {a: i for i, a in enumerate(fn.arg_names)}
    constants = {(index["HEAD_DIM"],): head_dim, (index["BLOCK_N"],): block_n, (index["STAGES"],): stages}
    return triton.compile(GluonASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))
