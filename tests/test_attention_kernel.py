"""The torch backend's attention kernel (runtime.model.attention_kernels), in one program or in
chunks of the shared keys, and the image prefix's pass by fused attention, against the eager
grouped attention, and a row's bytes alone, among others and reversed; run by Triton's
interpreter on the CPU in float32 (Triton is a dev dependency; its interpreter's BF16 dots are
not exact: `python -m bench.gpu parity` checks BF16 on the GPU), skipped where Triton is missing."""

from __future__ import annotations

import textwrap

import torch

from tests.interpreted import run_interpreted

KERNEL_CHECK = textwrap.dedent(
    """
    import torch

    from runtime.model.attention_kernels import (
        CHUNK_KEYS, CHUNK_MAX_ROWS, pass_chunk, query_tile, rows_attention, shared_rows)
    from runtime.model.language import grouped_attention

    torch.manual_seed(0)
    worst = 0.0
    large = CHUNK_MAX_ROWS + 2
    # (rows, query heads, KV heads, tokens, head dim, shared keys, past keys, one past source):
    # passes of up to CHUNK_MAX_ROWS rows in chunks of the shared keys (one chunk, three); the
    # image prefix's pass; larger passes (one question's, alone) in one program for every key,
    # the shared keys for several rows a program (4 or 2 here), or for one where a row's
    # queries take two tiles
    cases = [
        (3, 4, 2, 5, 32, 7, 3, False), (2, 8, 2, 8, 64, 2 * CHUNK_KEYS + 9, 16, True),
        (1, 4, 2, 40, 32, 1, 1, True),
        (large, 4, 2, 5, 32, 7, 3, False), (large, 8, 2, 8, 64, 70, 16, True),
        (large, 8, 2, 20, 32, 30, 3, False),
    ]
    for b, heads, kv_heads, t, hd, p, past, shared in cases:
        if b > CHUNK_MAX_ROWS:
            tile = query_tile(heads // kv_heads, t)
            tiles = -(-heads // kv_heads * t // tile)
            assert pass_chunk(b) == 0
            assert (shared_rows(b, tiles, tile) >= 2) == (tiles == 1)
        q = torch.randn(b, t, heads, hd).transpose(1, 2)  # views, as mix gives them
        k, v = (torch.randn(b, t, kv_heads, hd).transpose(1, 2) for _ in range(2))
        shared_k, shared_v = torch.randn(1, kv_heads, p, hd), torch.randn(1, kv_heads, p, hd)
        if shared:
            past_k, past_v = (
                torch.randn(1, kv_heads, past, hd).expand(b, -1, -1, -1) for _ in range(2))
        else:
            past_k, past_v = torch.randn(b, kv_heads, past, hd), torch.randn(b, kv_heads, past, hd)
        lengths = torch.randint(1, t + 1, (b,))
        steps = torch.arange(t)
        valid = steps[None] < lengths[:, None]
        own = (steps[None, :, None] >= steps[None, None, :]) & valid[:, None, :]
        seen = torch.cat([torch.rand(1, p) > 0.2, torch.zeros(1, past, dtype=torch.bool)], -1)
        seen = seen.expand(b, -1).clone()
        seen[:, p:] = torch.rand(b, past) > 0.3
        if p == past == 1:  # the image prefix's pass: the empty state's masked keys
            seen[:] = False
        mask = torch.cat([seen[:, None].expand(-1, t, -1), own], dim=-1)
        prefixes = torch.zeros(b, dtype=torch.int64)
        args = (q, shared_k, shared_v, prefixes, past_k, past_v, k, v, mask)
        expected = grouped_attention(*args, 0.3)
        got = rows_attention(*args, 0.3)
        # over valid tokens: a padding token's output is never read
        worst = max(worst, float((got - expected)[valid].abs().max()))
        alone = rows_attention(*(x[:1] if x.shape[0] == b else x for x in args), 0.3)
        back = torch.arange(b - 1, -1, -1)
        flipped = rows_attention(*(x[back] if x.shape[0] == b else x for x in args), 0.3)
        if p != 1:  # the prefix padded with masked zero keys (runtime.run_passes.padded_prefix)
            extra = 2 * CHUNK_KEYS + 5
            wide_k, wide_v = (torch.nn.functional.pad(x, (0, 0, 0, extra)) for x in args[1:3])
            hidden = torch.zeros(b, t, extra, dtype=torch.bool)
            wide_mask = torch.cat([mask[..., :p], hidden, mask[..., p:]], dim=-1)
            wide = (q, wide_k, wide_v, prefixes, past_k, past_v, k, v, wide_mask)
            assert torch.equal(rows_attention(*wide, 0.3), got), "padded prefix keys differ"
        if b <= CHUNK_MAX_ROWS:
            assert torch.equal(alone, got[:1]), "a row alone differs"
            assert torch.equal(flipped, got[back]), "reversed rows differ"
        else:  # a row alone runs in chunks; several rows in one product: the interpreter's
            # products are NumPy's, whose blocking rounds a row by where it sits (the H200
            # check is byte for byte: the GPU's invariance checks)
            assert torch.allclose(alone, got[:1], rtol=0, atol=1e-5), "a row alone differs"
            assert torch.allclose(flipped, got[back], rtol=0, atol=1e-5), "reversed differ"
    print(worst)
    """
)


def test_attention_kernel_matches_grouped_attention():
    assert float(run_interpreted(KERNEL_CHECK)[-1]) < 1e-5


def test_attention_kernel_is_a_custom_op_with_a_fake():
    from runtime.model import attention_kernels

    q = torch.empty(3, 8, 5, 64, device="meta").transpose(1, 2).transpose(1, 2)
    shared = torch.empty(1, 2, 7, 64, device="meta")
    past = torch.empty(1, 2, 4, 64, device="meta").expand(3, -1, -1, -1)
    own = torch.empty(3, 2, 5, 64, device="meta")
    mask = torch.empty(3, 5, 7 + 4 + 5, dtype=torch.bool, device="meta")
    rows = torch.zeros(3, dtype=torch.int64, device="meta")
    out = attention_kernels.rows_attention(q, shared, shared, rows, past, past, own, own, mask, 0.5)
    assert out.shape == (3, 5, 8 * 64) and out.is_contiguous()


def test_the_query_tile_follows_the_length_bucket_only():
    from runtime.model.attention_kernels import BLOCK_ROWS, DOT_MIN, TILES, query_tile

    assert query_tile(4, 2) == DOT_MIN and query_tile(4, 8) == 32
    assert query_tile(4, 16) == query_tile(4, 640) == BLOCK_ROWS
    assert {query_tile(4, t) for t in (1, 2, 4, 8, 16, 24, 32, 640)} <= set(TILES)
