"""The torch backend's attention on CUDA in half precision: one Triton kernel a layer reading
the image prefix's keys, each row's past and its own keys in place, as a PyTorch custom op.

Follows `runtime.model.language.grouped_attention` (model.md §2: GQA, one softmax over the
prefix, past and own keys, masked keys out), written as an online softmax in float32.
"""

from __future__ import annotations

import torch

from runtime.model.layers import MASKED

try:  # Triton exists only beside a CUDA build of torch; the CPU keeps the eager attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

# Folded query rows (a KV head's group × tokens of one row) per program, at most: one program
# reads its row's prefix keys once for all of them. The tile follows the pass's length bucket
# only (next power of two of group × tokens, at least DOT_MIN for tl.dot), never its row count,
# and a program holds one row's queries, so a row's bytes cannot follow the rows beside it.
BLOCK_ROWS = 64
DOT_MIN = 16  # tl.dot's smallest tile side
# by query tile: (keys per step, warps). The largest tiles whose registers hold a 256-wide head
# without spilling, by ptxas for sm_90 (Triton 3.9; 64 × 32 spilled 48 bytes a thread, 32 × 32
# on 4 warps 64). Fixed, not tuned: the keys per step set the order of the softmax's sums
TILES = {16: (32, 4), 32: (32, 8), 64: (16, 8)}
STAGES = 2  # K and V loads one step ahead

if triton is not None:
    # a jitted function reads only constexpr globals
    MASKED_SCORE = tl.constexpr(MASKED)

    @triton.jit
    def _keys_step(
        acc, m_i, l_i, b_q, keys, values, stride_n, count, visible_at, row_ok, scale,
        D: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        """Online softmax over `count` keys of one segment (keys [count, D] by `stride_n`),
        `visible_at` the mask's pointers of each query row at the segment's first key."""
        o_d = tl.arange(0, D)
        for start in range(0, count, BN):
            o_n = start + tl.arange(0, BN)
            inside = o_n < count
            b_k = tl.load(
                keys + o_n[:, None] * stride_n + o_d[None, :], mask=inside[:, None], other=0.0
            )
            s = tl.dot(b_q, tl.trans(b_k)) * scale
            seen = tl.load(
                visible_at[:, None] + o_n[None, :], mask=row_ok[:, None] & inside, other=0
            )
            s = tl.where(seen != 0, s, MASKED_SCORE)  # finite: no visible key, still finite
            s = tl.where(inside[None, :], s, float("-inf"))  # past the segment: no weight at all
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            # zeros past the segment: their weights are 0, and 0 × a stray NaN would not be
            b_v = tl.load(
                values + o_n[:, None] * stride_n + o_d[None, :], mask=inside[:, None], other=0.0
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _attention_kernel(
        q, shared_k, shared_v, past_k, past_v, own_k, own_v, mask, out, scale,
        T, P, Q, KVH,
        sq_b, sq_h, sq_t, ss_h, ss_n, sp_b, sp_h, sp_n, so_b, so_h, so_n,
        G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        """One program: BM folded query rows (group member, token) of one row and KV head,
        against the shared prefix keys, the row's past and its own keys up to its tile's last
        token (own keys are causal)."""
        i_m = tl.program_id(0)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_kvh = i_bh // KVH, i_bh % KVH
        o_f = i_m * BM + tl.arange(0, BM)
        row_ok = o_f < G * T
        o_t = tl.where(row_ok, o_f % T, 0)
        head = i_kvh * G + tl.where(row_ok, o_f // T, 0)
        o_d = tl.arange(0, D)
        rows = q + i_b * sq_b + head[:, None] * sq_h + o_t[:, None] * sq_t + o_d[None, :]
        b_q = tl.load(rows, mask=row_ok[:, None], other=0.0)
        acc = tl.zeros([BM, D], dtype=tl.float32)
        m_i = tl.full([BM], MASKED_SCORE, dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        visible = mask + (i_b * T + o_t) * (P + Q + T)
        acc, m_i, l_i = _keys_step(
            acc, m_i, l_i, b_q, shared_k + i_kvh * ss_h, shared_v + i_kvh * ss_h, ss_n, P,
            visible, row_ok, scale, D, BN,
        )  # fmt: skip
        past = i_b * sp_b + i_kvh * sp_h
        acc, m_i, l_i = _keys_step(
            acc, m_i, l_i, b_q, past_k + past, past_v + past, sp_n, Q, visible + P, row_ok,
            scale, D, BN,
        )  # fmt: skip
        mine = i_b * so_b + i_kvh * so_h
        last = tl.max(tl.where(row_ok, o_t, 0)) + 1  # no token sees a later one of its row
        acc, m_i, l_i = _keys_step(
            acc, m_i, l_i, b_q, own_k + mine, own_v + mine, so_n, last, visible + P + Q,
            row_ok, scale, D, BN,
        )  # fmt: skip
        result = acc / l_i[:, None]
        written = out + (i_b * T + o_t[:, None]) * (KVH * G * D) + head[:, None] * D + o_d[None, :]
        tl.store(written, result.to(out.dtype.element_ty), mask=row_ok[:, None])


@torch.library.custom_op("omnijev::rows_attention", mutates_args=())
def rows_attention(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`grouped_attention`'s rows q [B, H, T, hd] over the shared keys/values [1, KVH, P, hd]
    (the image prefix), each row's past [B, KVH, Q, hd] (a broadcast view where the rows share
    one) and their own k, v [B, KVH, T, hd], all read in place (any strides but a unit last
    one); `mask` [B, T, P + Q + T] is true where a key is visible, and a token sees none of its
    row's later tokens. Returns [B, T, H·hd] in v's dtype."""
    return attend_rows(q, shared_k, shared_v, past_k, past_v, k, v, mask, scale)


@rows_attention.register_fake
def _(q, shared_k, shared_v, past_k, past_v, k, v, mask, scale):
    b, heads, t, hd = q.shape
    return v.new_empty(b, t, heads * hd)


def query_tile(group: int, tokens: int) -> int:
    """Folded query rows per program: a function of the length bucket alone."""
    rows = DOT_MIN
    while rows < group * tokens and rows < BLOCK_ROWS:
        rows *= 2
    return rows


def unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attend_rows(q, shared_k, shared_v, past_k, past_v, k, v, mask, scale) -> torch.Tensor:
    """`rows_attention`'s launch (the op's body, also called by scripts/gpu_torch.py)."""
    if triton is None:
        raise RuntimeError("the attention kernel needs triton")
    b, heads, t, hd = q.shape
    kv_heads, p, past = k.shape[1], shared_k.shape[2], past_k.shape[2]
    if hd & (hd - 1) or heads % kv_heads or shared_k.shape[0] != 1:
        raise ValueError(f"attention kernel: head dim {hd}, heads {heads}/{kv_heads}")
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    shared_k, shared_v = unit_last(shared_k), unit_last(shared_v)
    past_k, past_v = unit_last(past_k), unit_last(past_v)
    if shared_k.stride() != shared_v.stride() or past_k.stride() != past_v.stride():
        shared_k, shared_v = shared_k.contiguous(), shared_v.contiguous()
        past_k, past_v = past_k.contiguous(), past_v.contiguous()
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    group = heads // kv_heads
    tile = query_tile(group, t)
    out = v.new_empty(b, t, heads * hd)
    keys_per_step, warps = TILES[tile]
    grid = (triton.cdiv(group * t, tile), b * kv_heads)
    _attention_kernel[grid](
        q, shared_k, shared_v, past_k, past_v, k, v,
        mask.contiguous(), out, scale, t, p, past, kv_heads,
        q.stride(0), q.stride(1), q.stride(2),
        shared_k.stride(1), shared_k.stride(2),
        past_k.stride(0), past_k.stride(1), past_k.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        G=group, D=hd, BM=tile, BN=keys_per_step, num_warps=warps, num_stages=STAGES,
    )  # fmt: skip
    return out
