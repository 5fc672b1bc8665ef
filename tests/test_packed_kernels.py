"""The packed pass's kernels (runtime.model.packed_kernels) against its eager forms
(runtime.model.packed) on small random packs, padding tokens zeros, and each row's bytes the
same wherever it lies, among other rows, in another order and in a larger pass; run by Triton's
interpreter on the CPU in float32 and float16 (its BF16 is not exact), skipped where Triton is
missing."""

from __future__ import annotations

import textwrap

import torch

from tests.interpreted import run_interpreted

# Rows of two packs as the scripts build them: `specs` names each logical row's (length, parent,
# image prefix); a pack lists them in its table order (text rows first, None an empty row) and
# places their tokens in another order with random gaps; its prefixes in another order too.
# Pack B moves every row of pack A, adds a text row with an option and an option of an old one
PACKS = textwrap.dedent(
    """
    import torch

    from runtime.model.packed import Rows

    SPECS = {
        "t0": (14, None, 0), "t1": (9, None, 1), "t2": (36, None, 0),
        "o0": (3, "t0", 0), "o1": (1, "t0", 0), "o2": (7, "t0", 0), "o3": (12, "t1", 1),
        "o4": (2, "t1", 1), "o5": (20, "t2", 0), "o6": (5, "t2", 0), "o7": (1, "t2", 0),
        "t3": (6, None, 1), "o8": (4, "t3", 1), "o9": (9, "t0", 0),
    }
    TEXT_A = ["t0", "t1", "t2"]
    OPTIONS_A = ["o0", "o1", "o2", "o3", "o4", "o5", "o6", "o7"]
    A = dict(table=TEXT_A + OPTIONS_A, placing=TEXT_A + OPTIONS_A, n=160, prefixes=[0, 1], seed=1)
    B = dict(
        table=["t2", "t3", None, "t0", "t1", "o9", "o7", "o5", "o3", None, "o8", "o1", "o0",
               "o6", "o2", "o4"],
        placing=["o4", "t3", "o9", "t1", "o6", "o0", "t2", "o8", "o1", "o5", "t0", "o2", "o7",
                 "o3"],
        n=256, prefixes=[1, 0], seed=2,
    )
    COMMON = TEXT_A + OPTIONS_A

    def build(table, placing, n, prefixes, seed):
        \"\"\"The pack's Rows and each logical row's token span.\"\"\"
        count = len(table)
        index = {name: i for i, name in enumerate(table) if name}
        start = torch.full((count + 1,), n, dtype=torch.int64)  # empty rows: past the pass
        length = torch.zeros(count + 1, dtype=torch.int64)
        parent = torch.full((count + 1,), -1, dtype=torch.int64)
        prefix = torch.zeros(count + 1, dtype=torch.int64)
        token_row = torch.full((n,), count, dtype=torch.int64)
        token_step = torch.zeros(n, dtype=torch.int64)
        gen = torch.Generator().manual_seed(seed)
        spans, at = {}, 0
        for name in placing:
            at += int(torch.randint(0, 5, (), generator=gen))
            size, of, image = SPECS[name]
            i = index[name]
            start[i], length[i], prefix[i] = at, size, prefixes.index(image)
            parent[i] = index[of] if of else -1
            token_row[at : at + size] = i
            token_step[at : at + size] = torch.arange(size)
            spans[name] = slice(at, at + size)
            at += size
        assert at <= n
        return Rows(start, length, parent, prefix, token_row, token_step), spans

    def scatter(pieces, spans, n, seed):
        \"\"\"[n, ...] with each row's piece at its span, random values in the padding.\"\"\"
        gen = torch.Generator().manual_seed(seed)
        first = next(iter(pieces.values()))
        out = torch.randn(n, *first.shape[1:], generator=gen, dtype=torch.float32)
        out = out.to(first.dtype)
        for name, span in spans.items():
            out[span] = pieces[name]
        return out

    def padding(rows, n):
        return rows.token_row == rows.start.shape[0] - 1
    """
)

ATTENTION_CHECK = PACKS + textwrap.dedent(
    """
    from runtime.model.packed import packed_attention_eager
    from runtime.model.packed_kernels import packed_attention

    torch.manual_seed(0)
    heads, kv_heads, hd, p, scale = 4, 2, 32, 40, 32**-0.5
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        pieces = {
            name: [torch.randn(size, h, hd).to(dtype) for h in (heads, kv_heads, kv_heads)]
            for name, (size, _, _) in SPECS.items()
        }
        prefix_k, prefix_v = (torch.randn(2, kv_heads, p, hd).to(dtype) for _ in range(2))
        prefix_mask = torch.rand(2, p) > 0.3
        outputs = []
        for pack, extra in ((A, 0), (B, 2 * p + 5)):
            rows, spans = build(**pack)
            n = pack["n"]
            q, k, v = (scatter({m: x[j] for m, x in pieces.items() if m in spans}, spans, n, j)
                       for j in range(3))
            order = pack["prefixes"]
            # pack B's prefixes padded with masked random keys, as a pass of longer ones
            wide_k, wide_v = (
                torch.cat([x[order], torch.randn(2, kv_heads, extra, hd).to(dtype)], 2)
                for x in (prefix_k, prefix_v))
            wide_mask = torch.cat([prefix_mask[order], torch.zeros(2, extra, dtype=torch.bool)], 1)
            args = (q, k, v, wide_k, wide_v, wide_mask, rows, scale)
            got = packed_attention(*args)
            assert got.dtype == dtype and got.shape == (n, heads * hd)
            assert (got[padding(rows, n)] == 0).all(), "padding tokens not zeros"
            if pack is A:
                expected = packed_attention_eager(*args)
                worst = float((got.float() - expected.float()).abs().max())
                assert worst < tolerance, (dtype, worst)
                print(dtype, worst)
                # the same pack with k, v as views of a wider layout (the rotary's transposes)
                views = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v)]
                assert torch.equal(packed_attention(*views, *args[3:]), got), "views differ"
            outputs.append({name: got[spans[name]] for name in COMMON})
        for name in COMMON:
            assert torch.equal(outputs[0][name], outputs[1][name]), (dtype, name)
    print("ok")
    """
)

DELTA_CHECK = PACKS + textwrap.dedent(
    """
    from runtime.model.packed import packed_delta_eager
    from runtime.model.packed_kernels import packed_gated_delta

    torch.manual_seed(0)
    heads, value_heads, dk, dv, scale = 2, 4, 16, 16, 16**-0.5
    pieces = {
        name: [torch.randn(size, heads, dk), torch.randn(size, heads, dk),
               torch.randn(size, value_heads, dv), -torch.rand(size, value_heads),
               torch.rand(size, value_heads)]
        for name, (size, _, _) in SPECS.items()
    }
    states = torch.randn(2, value_heads, dk, dv) * 0.1
    outputs = []
    for pack in (A, B):
        rows, spans = build(**pack)
        n = pack["n"]
        q, k, v, g, beta = (scatter({m: x[j] for m, x in pieces.items() if m in spans}, spans, n, j)
                            for j in range(5))
        args = (q, k, v, g, beta, states[pack["prefixes"]], rows, scale)
        got = packed_gated_delta(*args)
        assert got.dtype == torch.float32 and got.shape == (n, value_heads, dv)
        assert (got[padding(rows, n)] == 0).all(), "padding tokens not zeros"
        if pack is A:
            worst = float((got - packed_delta_eager(*args)).abs().max())
            assert worst < 1e-5, worst
            print(worst)
            # q and k as column slices of one wider projection, as the conv's split gives them
            mixed = torch.cat([q, k, torch.randn(n, 1, dk)], 1)
            assert torch.equal(packed_gated_delta(mixed[:, :2], mixed[:, 2:4], *args[2:]), got)
        outputs.append({name: got[spans[name]] for name in COMMON})
    for name in COMMON:
        assert torch.equal(outputs[0][name], outputs[1][name]), name
    print("ok")
    """
)


def test_packed_attention_matches_the_eager_and_keeps_a_rows_bytes():
    """float32 within 1e-5 and float16 within 4e-3 of the eager; a row's bytes the same in a
    larger pack, at other offsets, in another table order, among added rows and empty ones,
    with its prefix at another index and padded with masked keys."""
    assert run_interpreted(ATTENTION_CHECK)[-1] == "ok"


def test_packed_gated_delta_matches_the_eager_and_keeps_a_rows_bytes():
    """float32 within 1e-5 of the eager, option rows from their text row's final state; a row's
    bytes the same in a larger pack, at other offsets, in another order, among other rows."""
    assert run_interpreted(DELTA_CHECK)[-1] == "ok"


def test_packed_kernels_are_custom_ops_with_fakes():
    from runtime.model import packed_kernels
    from runtime.model.packed import Rows

    meta = {"device": "meta"}
    n, rows = 64, 5
    tables = [torch.zeros(rows + 1, dtype=torch.int64, **meta) for _ in range(6)]
    tables[4:] = [torch.zeros(n, dtype=torch.int64, **meta)] * 2
    packed_rows = Rows(*tables)
    q = torch.empty(n, 4, 32, dtype=torch.float16, **meta)
    kv = torch.empty(n, 2, 32, dtype=torch.float16, **meta)
    prefix = torch.empty(2, 2, 24, 32, dtype=torch.float16, **meta)
    mask = torch.empty(2, 24, dtype=torch.bool, **meta)
    out = packed_kernels.packed_attention(q, kv, kv, prefix, prefix, mask, packed_rows, 0.5)
    assert out.shape == (n, 4 * 32) and out.dtype == torch.float16
    v = torch.empty(n, 4, 16, dtype=torch.float16, **meta)
    gates = torch.empty(n, 4, **meta)
    states = torch.empty(2, 4, 32, 16, **meta)
    out = packed_kernels.packed_gated_delta(q, q, v, gates, gates, states, packed_rows, 0.5)
    assert out.shape == (n, 4, 16) and out.dtype == torch.float32
