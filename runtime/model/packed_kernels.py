"""The token-packed pass's attention and Gated DeltaNet recurrence on CUDA: Triton programs of one
query tile (attention) or one row (recurrence) and head, reading the row tables on the device, as
PyTorch custom ops that `torch.compile` and CUDA graphs keep (runtime.model.packed gives the eager
forms these follow)."""

from __future__ import annotations

import torch

from runtime.model.gdn import L2_EPS  # the eager l2norm's eps
from runtime.model.layers import MASKED
from runtime.model.packed import TEXT_ROWS, Rows

try:  # with CUDA builds of torch, and the dev extra (the tests' interpreter); else eager only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

# Folded query rows (KV group member × token, token-major) a query tile holds. One constant for
# every pass: the tile, the keys a step and the warps set the order of a row's sums, so none of
# them may follow the pass size or row count; a row's tiles then hold the same queries wherever
# it lies. Keys a step and warps: runtime.model.attention_kernels's tile of 32 query rows, whose
# registers hold a 256-wide head without spilling (ptxas, sm_90)
QUERY_ROWS = 32
KEYS_STEP = 32
ATTENTION_WARPS = 8
STAGES = 2  # K and V loads one step ahead
# value columns a delta-rule program and its warps: gdn_kernels's rows kernel's tile ([128, 16]
# float32 of the state in one warp, its sums over the key dimension within the warp)
BLOCK_V = 16
DELTA_WARPS = 1

if triton is not None:
    from runtime.model.gdn_kernels import delta_step  # the rows kernel's token step

    # a jitted function reads only constexpr globals
    MASKED_SCORE = tl.constexpr(MASKED)

    @triton.jit
    def _segment(
        acc, m_i, l_i, b_q, keys, values, stride_n, count, seen, o_t, scale,
        SEEN: tl.constexpr, CAUSAL: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Online softmax over one segment's `count` keys (keys [count, D] by `stride_n`), from
        key 0 in steps of BN. A key scores MASKED where `seen` (bool [count], with SEEN) is
        false or, with CAUSAL, past the query row's token o_t."""
        o_d = tl.arange(0, D)
        for start in range(0, count, BN):
            o_n = start + tl.arange(0, BN)
            inside = o_n < count
            b_k = tl.load(
                keys + o_n[:, None] * stride_n + o_d[None, :], mask=inside[:, None], other=0.0
            )
            s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale
            visible = inside[None, :]
            if SEEN:
                visible = visible & (tl.load(seen + o_n, mask=inside, other=0) != 0)[None, :]
            if CAUSAL:
                visible = visible & (o_n[None, :] <= o_t[:, None])
            s = tl.where(visible, s, MASKED_SCORE)  # finite: no visible key, still finite
            s = tl.where(inside[None, :], s, float("-inf"))  # past the segment: no weight at all
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            # zeros past the segment: their weights are 0, and 0 × a stray NaN would not be
            b_v = tl.load(
                values + o_n[:, None] * stride_n + o_d[None, :], mask=inside[:, None], other=0.0
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision=PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _packed_attention_kernel(
        q, k, v, prefix_k, prefix_v, prefix_mask, row_start, row_length, row_parent, row_prefix,
        tile_ends, rows, out, scale, P, sq_n, sq_h, sk_n, sk_h, sp_r, sp_h, sp_n, so_n,
        G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One program: one query tile of BM folded rows of one row and one KV head, over its
        prefix's keys, its parent's and its own up to the tile's last token. `tile_ends`: each
        row's tiles counted up to and including it (int64 [rows]); programs past the last tile
        do nothing."""
        i_p = tl.program_id(0)
        i_kvh = tl.program_id(1)
        # the row of tile i_p: the first whose count of tiles so far passes it
        low = 0
        high = rows
        while low < high:
            middle = (low + high) // 2
            if tl.load(tile_ends + middle) > i_p:
                high = middle
            else:
                low = middle + 1
        i_r = tl.minimum(low, rows - 1)
        length = tl.load(row_length + i_r)
        first_tile = tl.load(tile_ends + i_r) - tl.cdiv(G * length, BM)
        tile = i_p - first_tile
        start = tl.load(row_start + i_r)
        parent = tl.load(row_parent + i_r)
        prefix = tl.load(row_prefix + i_r)
        safe_parent = tl.maximum(parent, 0)
        parent_start = tl.load(row_start + safe_parent)
        parent_length = tl.where(parent >= 0, tl.load(row_length + safe_parent), 0)
        shared = prefix * sp_r + i_kvh * sp_h
        past = parent_start * sk_n + i_kvh * sk_h
        own = start * sk_n + i_kvh * sk_h
        seen = prefix_mask + prefix * P
        o_d = tl.arange(0, D)
        if low < rows:  # none past the last tile
            o_f = tile * BM + tl.arange(0, BM)
            row_ok = o_f < G * length
            o_t = tl.where(row_ok, o_f // G, 0)
            head = i_kvh * G + o_f % G
            token = start + o_t
            at_q = token[:, None] * sq_n + head[:, None] * sq_h + o_d[None, :]
            b_q = tl.load(q + at_q, mask=row_ok[:, None], other=0.0)
            acc = tl.zeros([BM, D], dtype=tl.float32)
            m_i = tl.full([BM], MASKED_SCORE, dtype=tl.float32)
            l_i = tl.zeros([BM], dtype=tl.float32)
            acc, m_i, l_i = _segment(
                acc, m_i, l_i, b_q, prefix_k + shared, prefix_v + shared, sp_n, P, seen, o_t,
                scale, True, False, D, BN, PRECISION,
            )  # fmt: skip
            acc, m_i, l_i = _segment(
                acc, m_i, l_i, b_q, k + past, v + past, sk_n, parent_length, seen, o_t, scale,
                False, False, D, BN, PRECISION,
            )  # fmt: skip
            # keys past the tile's last token would only add exact zeros: not read
            last = tl.max(tl.where(row_ok, o_t, 0)) + 1
            acc, m_i, l_i = _segment(
                acc, m_i, l_i, b_q, k + own, v + own, sk_n, last, seen, o_t, scale, False,
                True, D, BN, PRECISION,
            )  # fmt: skip
            at_out = token[:, None] * so_n + head[:, None] * D + o_d[None, :]
            result = (acc / l_i[:, None]).to(out.dtype.element_ty)
            tl.store(out + at_out, result, mask=row_ok[:, None])

    @triton.jit
    def _packed_delta_kernel(
        q, k, v, g, beta, states, slots, row_start, row_length, row_parent, row_prefix, out,
        scale, sq_n, sv_n,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BV: tl.constexpr, EPS: tl.constexpr, TEXT: tl.constexpr, SLOTS: tl.constexpr,
    ):  # fmt: skip
        """One program: one row, one value head, BV value columns, the row's tokens in order
        (`gdn_kernels._rows_kernel` on the packed layout). TEXT: text rows only, from their
        prefix's state, each final state kept in its slot; else option rows only, from their
        parent's slot. Other rows and empty ones do nothing. The next token's inputs are loaded
        before this token's arithmetic."""
        # rows × heads on the first axis: the second takes at most 65,535 (the largest pass's
        # 2,048 rows × 32 heads are 65,536)
        i_rh = tl.program_id(0).to(tl.int64)
        i_v = tl.program_id(1)
        i_r = i_rh // HV
        i_hv = i_rh % HV
        i_h = i_hv // (HV // H)
        start = tl.load(row_start + i_r)
        parent = tl.load(row_parent + i_r)
        o_k = tl.arange(0, K)
        o_v = i_v * BV + tl.arange(0, BV)
        at_state = i_hv * K * V + o_k[:, None] * V + o_v[None, :]
        # a pass's grid covers every row it could hold, the other launch's rows and empty ones
        # too: they neither read a state nor keep one (8 KB each a program, 2 MB a row a layer);
        # the mask in the state's shape, as Triton's interpreter wants it
        length = tl.load(row_length + i_r)
        if TEXT:
            mine = (parent < 0) & (length > 0)
            source = tl.where(mine, tl.load(row_prefix + i_r), 0)
            at_source = states + source * HV * K * V
        else:
            mine = parent >= 0
            at_source = slots + tl.maximum(parent, 0) * HV * K * V
        reading = (tl.zeros([K, BV], dtype=tl.int32) + mine.to(tl.int32)) != 0
        h = tl.load(at_source + at_state, mask=reading, other=0.0)
        count = tl.where(mine, length, 0)
        token = start
        last = start + count - 1  # the row's last token: a load ahead never leaves the row
        first = tl.where(count > 0, start, 0)  # an empty row's start may lie past the pass
        n_q = tl.load(q + first * sq_n + i_h * K + o_k)
        n_k = tl.load(k + first * sq_n + i_h * K + o_k)
        n_v = tl.load(v + first * sv_n + i_hv * V + o_v)
        n_g = tl.load(g + first * HV + i_hv)
        n_beta = tl.load(beta + first * HV + i_hv)
        t = 0
        while t < count:
            b_q, b_k, b_v = n_q.to(tl.float32), n_k.to(tl.float32), n_v.to(tl.float32)
            b_g, b_beta = n_g.to(tl.float32), n_beta.to(tl.float32)
            after = tl.minimum(token + 1, last)
            n_q = tl.load(q + after * sq_n + i_h * K + o_k)
            n_k = tl.load(k + after * sq_n + i_h * K + o_k)
            n_v = tl.load(v + after * sv_n + i_hv * V + o_v)
            n_g = tl.load(g + after * HV + i_hv)
            n_beta = tl.load(beta + after * HV + i_hv)
            h, b_o = delta_step(h, b_q, b_k, b_v, b_g, b_beta, scale, EPS)
            tl.store(out + (token * HV + i_hv) * V + o_v, b_o.to(out.dtype.element_ty))
            token += 1
            t += 1
        if TEXT:
            if mine & (i_r < SLOTS):
                tl.store(slots + i_r * HV * K * V + at_state, h)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_mask: torch.Tensor,
    rows: Rows,
    scale: float,
) -> torch.Tensor:
    """`runtime.model.packed.packed_attention_eager` by the kernel: [N, H·hd] in v's dtype,
    zeros for tokens of no row."""
    return packed_attention_op(
        q, k, v, prefix_k, prefix_v, prefix_mask, rows.start, rows.length, rows.parent,
        rows.prefix, scale,
    )  # fmt: skip


def packed_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    rows: Rows,
    scale: float,
) -> torch.Tensor:
    """`runtime.model.packed.packed_delta_eager` by the kernel: float32 [N, HV, dv], zeros for
    tokens of no row."""
    return packed_gated_delta_op(
        q, k, v, g, beta, states, rows.start, rows.length, rows.parent, rows.prefix, scale
    )


@torch.library.custom_op("omnijev::packed_attention", mutates_args=())
def packed_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_mask: torch.Tensor,
    row_start: torch.Tensor,
    row_length: torch.Tensor,
    row_parent: torch.Tensor,
    row_prefix: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [N, H, hd], k, v [N, KVH, hd], prefix_k, prefix_v [Rp, KVH, P, hd] (any strides but a
    unit last one), prefix_mask bool [Rp, P], the row tables int64 [R + 1]. Grid (R, KVH)."""
    if triton is None:
        raise RuntimeError("the packed attention kernel needs triton")
    n, heads, hd = q.shape
    kv_heads, p = k.shape[1], prefix_k.shape[2]
    if hd & (hd - 1) or heads % kv_heads:
        raise ValueError(f"packed attention: head dim {hd}, heads {heads}/{kv_heads}")
    q = unit_last(q)
    k, v = same_strides(k, v)
    prefix_k, prefix_v = same_strides(prefix_k, prefix_v)
    out = v.new_zeros(n, heads * hd)
    group, rows = heads // kv_heads, row_start.shape[0]
    tile_ends = torch.cumsum(
        torch.div(group * row_length + QUERY_ROWS - 1, QUERY_ROWS, rounding_mode="floor"), 0
    )
    # a grid of every tile the pass could hold (rows share no token: at most its folded rows'
    # tiles, and one more a row for each row's partial tile), those past the last doing nothing
    grid = (-(-group * n // QUERY_ROWS) + rows, kv_heads)
    _packed_attention_kernel[grid](
        q, k, v, prefix_k, prefix_v, prefix_mask.contiguous(), row_start.contiguous(),
        row_length.contiguous(), row_parent.contiguous(), row_prefix.contiguous(), tile_ends,
        rows, out, scale, p,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        prefix_k.stride(0), prefix_k.stride(1), prefix_k.stride(2), out.stride(0),
        G=group, D=hd, BM=QUERY_ROWS, BN=KEYS_STEP, PRECISION=dot_precision(q),
        num_warps=ATTENTION_WARPS, num_stages=STAGES,
    )  # fmt: skip
    return out


@packed_attention_op.register_fake
def _(
    q, k, v, prefix_k, prefix_v, prefix_mask, row_start, row_length, row_parent, row_prefix, scale
):
    n, heads, hd = q.shape
    return v.new_empty(n, heads * hd)


@torch.library.custom_op("omnijev::packed_gated_delta", mutates_args=())
def packed_gated_delta_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    row_start: torch.Tensor,
    row_length: torch.Tensor,
    row_parent: torch.Tensor,
    row_prefix: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q, k [N, H, dk], v [N, HV, dv] (each token's heads contiguous, tokens at any stride),
    g, beta float32 [N, HV], states float32 [Rp, HV, dk, dv], the row tables int64 [R + 1].
    Two launches: over the first TEXT_ROWS rows, where text rows lie, their final states into
    as many slots; then over every row, option rows from their parent's slot."""
    if triton is None:
        raise RuntimeError("the packed delta kernel needs triton")
    n, heads, dk = q.shape
    value_heads, dv = v.shape[1], v.shape[2]
    if dv % BLOCK_V or dk & (dk - 1) or value_heads % heads:
        raise ValueError(f"packed delta: dk {dk}, dv {dv}, heads {heads}/{value_heads}")
    q, k = same_strides(tokens_at_stride(q), tokens_at_stride(k))
    v = tokens_at_stride(v)
    out = torch.zeros(n, value_heads, dv, dtype=torch.float32, device=v.device)
    slots = torch.empty(TEXT_ROWS, value_heads, dk, dv, dtype=torch.float32, device=v.device)
    inputs = [t.contiguous() for t in (g, beta, states.float())]
    tables = [t.contiguous() for t in (row_start, row_length, row_parent, row_prefix)]
    rows = row_start.shape[0] - 1
    for text in (True, False):
        grid = ((min(rows, TEXT_ROWS) if text else rows) * value_heads, dv // BLOCK_V)
        _packed_delta_kernel[grid](
            q, k, v, *inputs, slots, *tables, out, scale, q.stride(0), v.stride(0),
            H=heads, HV=value_heads, K=dk, V=dv, BV=BLOCK_V, EPS=L2_EPS, TEXT=text,
            SLOTS=TEXT_ROWS, num_warps=DELTA_WARPS,
        )  # fmt: skip
    return out


@packed_gated_delta_op.register_fake
def _(q, k, v, g, beta, states, row_start, row_length, row_parent, row_prefix, scale):
    n, value_heads, dv = v.shape
    return torch.empty(n, value_heads, dv, dtype=torch.float32, device=v.device)


def dot_precision(x: torch.Tensor) -> str:
    """The kernel's products in float32 as float32 (the eager's arithmetic), not TF32."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def same_strides(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b with a unit last stride and one set of strides (the kernels index both alike)."""
    a, b = unit_last(a), unit_last(b)
    if a.stride() != b.stride():
        a, b = a.contiguous(), b.contiguous()
    return a, b


def tokens_at_stride(x: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d] with each token's heads contiguous (a copy only where they are not)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
