"""The torch backend's attention on CUDA in half precision: one Triton kernel a layer reading
each row's image prefix's keys, its past and its own keys in place, as a PyTorch custom op; the
image prefix's own pass by PyTorch's fused causal attention.

Follows `runtime.model.language.grouped_attention` (docs/model.md §2: GQA, one softmax over the
prefix, past and own keys, masked keys out), written as an online softmax in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.layers import MASKED

try:  # with CUDA builds of torch, and the dev extra (the tests' interpreter); else eager only
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
# Shared keys a program: a one-question pass has 8-16 programs a layer, each walking the 640
# prefix keys in 20-40 steps; in chunks of 128 each walks 8 and a second kernel merges them
# (faster on the H200 for passes of up to 64 rows, slower for 256 rows). The chunks follow the
# prefix's length alone, so a row's bytes do not follow the others
CHUNK_KEYS = 128
# passes of more rows walk every key in one program. Invariance needs the choice to be a
# function of the row's own question: fitted passes give a row 2-64 rows whatever else was
# asked (runtime.passes: question parts 16 at most, option families 32 and 64), and only a
# question with more options than the joining family runs in a larger pass, alone
# (runtime.passes.ALONE_ROWS), whose rows follow its own option count
CHUNK_MAX_ROWS = 64
# Those larger passes (one question's option rows, alone) read the shared keys for several rows
# a program: every row of them reads the same prefix keys (one question's rows: one image prefix,
# that of the program's first row, `attend_rows`), so a program of this many folded
# query rows (whole rows' tiles, e.g. 2 rows of 32) reads each key once for all of them, and a
# second kernel goes on from its softmax state per row over the row's past and own keys. A
# row's sums over the shared keys come in the same order wherever it sits (the shared keys are
# the same for every row: no other row's key enters a row's products), so its bytes still do
# not follow its neighbours; a small gain on the H200 over one row a program
SHARED_ROWS = 64
# The image prefix's pass is the only one whose shared and past keys are one key each: the
# empty state's, masked (runtime.executor.empty_state). Its attention is then causal over its
# own keys (right padding: a valid token sees no padding), which PyTorch's fused attention
# does at once; the kernel's 160 programs walked 640 keys each, 0.095 ms a layer (4b, H200)
PREFIX_KEYS = 1

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
    def _query_tile(KVH, T, G: tl.constexpr, BM: tl.constexpr):
        """This program's query tile: its index, row and KV head, which of its BM folded rows
        (group member, token) exist, and each one's token and query head."""
        i_m = tl.program_id(0)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_kvh = i_bh // KVH, i_bh % KVH
        o_f = i_m * BM + tl.arange(0, BM)
        row_ok = o_f < G * T
        o_t = tl.where(row_ok, o_f % T, 0)
        head = i_kvh * G + tl.where(row_ok, o_f // T, 0)
        return i_m, i_bh, i_b, i_kvh, row_ok, o_t, head

    @triton.jit
    def _store_tile(out, result, i_b, o_t, head, row_ok, T, KVH, G: tl.constexpr, D):
        """A query tile's attention into out [B, T, H·D] at each row's token and query head."""
        o_d = tl.arange(0, D)
        at = (i_b * T + o_t[:, None]) * (KVH * G * D) + head[:, None] * D + o_d[None, :]
        tl.store(out + at, result.to(out.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _shared_rows_kernel(
        q, shared_k, shared_v, prefix_rows, mask, part_acc, part_ml, scale, B, T, P, Q, KVH,
        sq_b, sq_h, sq_t, ss_b, ss_h, ss_n,
        G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, R: tl.constexpr,
        BN: tl.constexpr,
    ):  # fmt: skip
        """One program: R rows' query tiles (BM folded rows each, as `_query_tile` lays out a
        row of one tile) of one KV head against every key of the image prefix of the first of
        them (`attend_rows`: the real rows of such a pass read one prefix); writes each row's
        softmax state (weighted values, max, sum) for `_attention_kernel` to go on from
        (RESUME)."""
        i_kvh = tl.program_id(1)
        o = tl.arange(0, R * BM)
        f = o % BM
        i_b = tl.program_id(0) * R + o // BM
        real = i_b < B
        i_b = tl.where(real, i_b, 0).to(tl.int64)
        row_ok = real & (f < G * T)
        o_t = tl.where(row_ok, f % T, 0)
        head = i_kvh * G + tl.where(row_ok, f // T, 0)
        o_d = tl.arange(0, D)
        rows = q + i_b[:, None] * sq_b + head[:, None] * sq_h + o_t[:, None] * sq_t + o_d[None, :]
        b_q = tl.load(rows, mask=row_ok[:, None], other=0.0)
        acc = tl.zeros([R * BM, D], dtype=tl.float32)
        m_i = tl.full([R * BM], MASKED_SCORE, dtype=tl.float32)
        l_i = tl.zeros([R * BM], dtype=tl.float32)
        visible = mask + (i_b * T + o_t) * (P + Q + T)
        at = tl.load(prefix_rows + tl.program_id(0) * R) * ss_b + i_kvh * ss_h
        acc, m_i, l_i = _keys_step(
            acc, m_i, l_i, b_q, shared_k + at, shared_v + at, ss_n, P, visible, row_ok, scale,
            D, BN,
        )  # fmt: skip
        piece = i_b * KVH + i_kvh  # the row's one query tile, as `_attention_kernel` numbers it
        tl.store(part_acc + (piece * BM + f)[:, None] * D + o_d[None, :], acc, mask=real[:, None])
        tl.store(part_ml + piece * 2 * BM + f, m_i, mask=real)
        tl.store(part_ml + piece * 2 * BM + BM + f, l_i, mask=real)

    @triton.jit
    def _attention_kernel(
        q, shared_k, shared_v, prefix_rows, past_k, past_v, own_k, own_v, mask, out, part_acc,
        part_ml, scale, T, P, Q, KVH,
        sq_b, sq_h, sq_t, ss_b, ss_h, ss_n, sp_b, sp_h, sp_n, so_b, so_h, so_n,
        G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        CHUNK: tl.constexpr, RESUME: tl.constexpr,
    ):  # fmt: skip
        """One program: BM folded query rows (group member, token) of one row and KV head,
        against its image prefix's keys (`prefix_rows` of the row), the row's past and its own
        keys up to its tile's last token (own keys are causal). With CHUNK, program (…, c)
        takes the shared keys [c·CHUNK, (c+1)·CHUNK) only, the last one the past and own keys,
        and each writes its softmax's running max, sum and weighted values for
        `_merge_kernel`. With RESUME (one tile a row), the shared keys' state comes from
        `_shared_rows_kernel` instead."""
        i_m, i_bh, i_b, i_kvh, row_ok, o_t, head = _query_tile(KVH, T, G, BM)
        o_d = tl.arange(0, D)
        rows = q + i_b * sq_b + head[:, None] * sq_h + o_t[:, None] * sq_t + o_d[None, :]
        b_q = tl.load(rows, mask=row_ok[:, None], other=0.0)
        shared = P
        if RESUME:
            o_r = tl.arange(0, BM)
            acc = tl.load(part_acc + (i_bh * BM + o_r)[:, None] * D + o_d[None, :])
            m_i = tl.load(part_ml + i_bh * 2 * BM + o_r)
            l_i = tl.load(part_ml + i_bh * 2 * BM + BM + o_r)
            shared = 0
        else:
            acc = tl.zeros([BM, D], dtype=tl.float32)
            m_i = tl.full([BM], MASKED_SCORE, dtype=tl.float32)
            l_i = tl.zeros([BM], dtype=tl.float32)
        visible = mask + (i_b * T + o_t) * (P + Q + T)
        last = tl.max(tl.where(row_ok, o_t, 0)) + 1  # no token sees a later one of its row
        first, past_count = 0, Q
        if CHUNK:
            i_c = tl.program_id(2)
            first = i_c * CHUNK
            shared = tl.maximum(tl.minimum(P - first, CHUNK), 0)  # none for the last program
            mine = i_c == tl.num_programs(2) - 1
            past_count = tl.where(mine, Q, 0)
            last = tl.where(mine, last, 0)
        at = tl.load(prefix_rows + i_b) * ss_b + i_kvh * ss_h + first * ss_n
        acc, m_i, l_i = _keys_step(
            acc, m_i, l_i, b_q, shared_k + at, shared_v + at, ss_n, shared, visible + first,
            row_ok, scale, D, BN,
        )  # fmt: skip
        past = i_b * sp_b + i_kvh * sp_h
        acc, m_i, l_i = _keys_step(
            acc, m_i, l_i, b_q, past_k + past, past_v + past, sp_n, past_count, visible + P,
            row_ok, scale, D, BN,
        )  # fmt: skip
        own = i_b * so_b + i_kvh * so_h
        acc, m_i, l_i = _keys_step(
            acc, m_i, l_i, b_q, own_k + own, own_v + own, so_n, last, visible + P + Q,
            row_ok, scale, D, BN,
        )  # fmt: skip
        if CHUNK:
            piece = (i_bh * tl.num_programs(0) + i_m) * tl.num_programs(2) + tl.program_id(2)
            o_r = tl.arange(0, BM)
            tl.store(part_acc + piece * BM * D + o_r[:, None] * D + o_d[None, :], acc)
            tl.store(part_ml + piece * 2 * BM + o_r, m_i)
            tl.store(part_ml + piece * 2 * BM + BM + o_r, l_i)
        else:
            _store_tile(out, acc / l_i[:, None], i_b, o_t, head, row_ok, T, KVH, G, D)

    @triton.jit
    def _merge_kernel(
        part_acc, part_ml, out, T, KVH, CHUNKS,
        G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        """The attention of `_attention_kernel`'s CHUNKS pieces of one query tile, in their
        order: the largest max first, then each piece's sum and values weighted by it."""
        i_m, i_bh, i_b, _, row_ok, o_t, head = _query_tile(KVH, T, G, BM)
        o_r, o_d = tl.arange(0, BM), tl.arange(0, D)
        base = (i_bh * tl.num_programs(0) + i_m) * CHUNKS
        m_all = tl.full([BM], MASKED_SCORE, dtype=tl.float32)
        for c in range(0, CHUNKS):
            m_all = tl.maximum(m_all, tl.load(part_ml + (base + c) * 2 * BM + o_r))
        l_all = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, D], dtype=tl.float32)
        for c in range(0, CHUNKS):
            weight = tl.exp(tl.load(part_ml + (base + c) * 2 * BM + o_r) - m_all)
            l_all += tl.load(part_ml + (base + c) * 2 * BM + BM + o_r) * weight
            piece = tl.load(part_acc + (base + c) * BM * D + o_r[:, None] * D + o_d[None, :])
            acc += piece * weight[:, None]
        _store_tile(out, acc / l_all[:, None], i_b, o_t, head, row_ok, T, KVH, G, D)


@torch.library.custom_op("omnijev::rows_attention", mutates_args=())
def rows_attention(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    prefix_rows: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`grouped_attention`'s rows q [B, H, T, hd] over their image prefixes' keys/values
    [R, KVH, P, hd] (row n's at `prefix_rows[n]`, int64 [B]), each row's past [B, KVH, Q, hd]
    (a broadcast view where the rows share one) and their own k, v [B, KVH, T, hd], all read in
    place (any strides but a unit last one); `mask` [B, T, P + Q + T] is true where a key is
    visible, and a token sees none of its row's later tokens; where P and Q are both
    PREFIX_KEYS (the image prefix's pass) those keys are the empty state's, masked. Returns
    [B, T, H·hd] in v's dtype. The image prefix's pass runs `prefix_attention`, others the
    kernel with `pass_chunk` shared keys a program."""
    return attend_rows(q, shared_k, shared_v, prefix_rows, past_k, past_v, k, v, mask, scale)


@rows_attention.register_fake
def _(q, shared_k, shared_v, prefix_rows, past_k, past_v, k, v, mask, scale):
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


def prefix_attention(q, k, v, scale: float) -> torch.Tensor:
    """The image prefix's attention: each token over its own row's keys up to itself, by
    PyTorch's fused attention (its shared and past keys are the empty state's, masked)."""
    b, heads, t, hd = q.shape
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, t, heads * hd).to(v.dtype)


def pass_chunk(rows: int) -> int:
    """Shared keys a program in a pass of `rows` rows: CHUNK_KEYS up to CHUNK_MAX_ROWS rows,
    else 0 (one program walks every key)."""
    return CHUNK_KEYS if rows <= CHUNK_MAX_ROWS else 0


def shared_rows(rows: int, tiles: int, tile: int) -> int:
    """Rows a `_shared_rows_kernel` program takes in a pass of `rows` rows (0: that kernel is
    not used): passes of more than CHUNK_MAX_ROWS rows (one question's, alone) read in one
    program (no chunks), each row in one query tile, SHARED_ROWS // tile rows of them a
    program where that is two or more."""
    if rows <= CHUNK_MAX_ROWS or tiles != 1:
        return 0
    count = SHARED_ROWS // tile
    return count if count >= 2 else 0


def attend_rows(
    q, shared_k, shared_v, prefix_rows, past_k, past_v, k, v, mask, scale
) -> torch.Tensor:
    """`rows_attention`'s body: the image prefix's pass by `prefix_attention`, others by the
    kernel with `pass_chunk` shared keys a program, each program reading its row's prefix at
    `prefix_rows[row]`. A `shared_rows` program reads the prefix of its first row for all its
    rows: such passes (more than CHUNK_MAX_ROWS rows) hold one question alone, whose real rows
    read one prefix and come first; padding rows after them are never read. Not checked here:
    that would wait for the device."""
    b, heads, t, hd = q.shape
    kv_heads, p, past = k.shape[1], shared_k.shape[2], past_k.shape[2]
    if p == past == PREFIX_KEYS:
        return prefix_attention(q, k, v, scale)
    if triton is None:
        raise RuntimeError("the attention kernel needs triton")
    chunk = pass_chunk(b)
    if hd & (hd - 1) or heads % kv_heads:
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
    tiles = triton.cdiv(group * t, tile)
    mask, prefix_rows = mask.contiguous(), prefix_rows.contiguous()
    rows_a_program = shared_rows(b, tiles, tile)
    chunks = triton.cdiv(p, chunk) + 1 if chunk else 1
    grid = (tiles, b * kv_heads, chunks)
    pieces = tiles * b * kv_heads * chunks if chunk else 0
    if rows_a_program:
        pieces = b * kv_heads
    part_acc = q.new_empty(pieces, tile, hd, dtype=torch.float32)
    part_ml = q.new_empty(pieces, 2, tile, dtype=torch.float32)
    if rows_a_program:
        shared_step, shared_warps = TILES[rows_a_program * tile]
        _shared_rows_kernel[(triton.cdiv(b, rows_a_program), kv_heads)](
            q, shared_k, shared_v, prefix_rows, mask, part_acc, part_ml, scale, b, t, p, past,
            kv_heads, q.stride(0), q.stride(1), q.stride(2), shared_k.stride(0),
            shared_k.stride(1), shared_k.stride(2),
            G=group, D=hd, BM=tile, R=rows_a_program, BN=shared_step, num_warps=shared_warps,
            num_stages=STAGES,
        )  # fmt: skip
    _attention_kernel[grid](
        q, shared_k, shared_v, prefix_rows, past_k, past_v, k, v, mask, out, part_acc, part_ml,
        scale, t, p, past, kv_heads,
        q.stride(0), q.stride(1), q.stride(2),
        shared_k.stride(0), shared_k.stride(1), shared_k.stride(2),
        past_k.stride(0), past_k.stride(1), past_k.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        G=group, D=hd, BM=tile, BN=keys_per_step, CHUNK=chunk, RESUME=rows_a_program > 0,
        num_warps=warps, num_stages=STAGES,
    )  # fmt: skip
    if chunk:
        _merge_kernel[(tiles, b * kv_heads)](
            part_acc, part_ml, out, t, kv_heads, chunks, G=group, D=hd, BM=tile,
            num_warps=warps,
        )  # fmt: skip
    return out
