"""The token-packed language-model pass: rows of any length lie end to end in one flat token
dimension, each described by its start, length, parent row and image prefix; the products run
over every token at once, attention and the Gated DeltaNet recurrence per row (docs/design.md
"Packed passes").

A row is a question's text (parent -1: it continues its image prefix's state) or an option block
(parent: its question's text row in the same pass, whose keys and final recurrent state it
continues, layer by layer). A row's arithmetic reads its own tokens, its parent's and its
prefix's, in an order fixed by the row alone, so its bytes never follow the pass size, its place
in the pack or what else is packed. Text rows come first (rows < TEXT_ROWS), so that their final
states have a slot each.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from runtime.model.gdn import CORES, l2norm
from runtime.model.language import apply_rotary, grouped_attention
from runtime.model.layers import product

# text rows a packed pass holds at most: each keeps its final recurrent state for its option
# rows, a [HV, dk, dv] float32 slot (64 slots: 134 MB on the 4b, one buffer for every layer)
TEXT_ROWS = 64
# the names of a packed pass's row tables (int64 [R + 1]: the last row is empty, the row of
# every padding token)
ROW_TABLES = ("row_start", "row_length", "row_parent", "row_prefix")
# and of its per-token inputs (int64 [N], positions [3, N])
TOKEN_INPUTS = ("input_ids", "positions", "token_row", "token_step")


class Rows(NamedTuple):
    """A packed pass's row tables on the device: start, length, parent (-1: continues its image
    prefix) and image prefix of each row, and each token's row and step within it."""

    start: torch.Tensor
    length: torch.Tensor
    parent: torch.Tensor
    prefix: torch.Tensor
    token_row: torch.Tensor
    token_step: torch.Tensor

    @classmethod
    def of(cls, feeds: dict) -> Rows:
        return cls(*(feeds[name] for name in ROW_TABLES), feeds["token_row"], feeds["token_step"])

    @property
    def count(self) -> int:
        """Rows a kernel's grid covers (the empty last row aside)."""
        return self.start.shape[0] - 1

    def host(self) -> list[tuple[int, int, int, int]]:
        """(start, length, parent, prefix) of each non-empty row, for the eager forms."""
        tables = torch.stack([self.start, self.length, self.parent, self.prefix], 1).tolist()
        return [tuple(row) for row in tables[:-1] if row[1] > 0]


def conv_sources(rows: Rows, prefixes: int, taps: int) -> torch.Tensor:
    """int64 [N, taps]: where each token's conv taps read, in the table of every prefix's conv
    state columns ([prefixes · (taps − 1)], oldest first) followed by the pass's raw tokens. Tap
    j reads the token taps − 1 − j steps back in its row, before the row's start its parent's
    last tokens, before those its image prefix's state columns."""
    keep = taps - 1
    back = torch.arange(keep, -1, -1, device=rows.token_step.device)  # distance of each tap
    step = rows.token_step[:, None] - back[None, :]
    row = rows.token_row[:, None].expand_as(step)
    parent = rows.parent[row]
    has_parent = parent >= 0
    safe_parent = parent.clamp(min=0)
    parent_length = torch.where(has_parent, rows.length[safe_parent], 0)
    in_parent = has_parent & (step < 0) & (parent_length + step >= 0)
    own = rows.start[row] + step
    from_parent = rows.start[safe_parent] + parent_length + step
    column = rows.prefix[row] * keep + keep + step + parent_length
    base = prefixes * keep
    return torch.where(
        step >= 0, base + own, torch.where(in_parent, base + from_parent, column.clamp(min=0))
    )


def packed_conv(raw: torch.Tensor, past: torch.Tensor, taps: torch.Tensor, sources: torch.Tensor):
    """SiLU of the causal depthwise conv of raw [N, C] (past [Rp, C, K−1]: each prefix's last raw
    columns), taps [K, C] float32, `sources` from `conv_sources`: the sum in float32 in the taps'
    order, rounded to raw's dtype (the rectangle pass's arithmetic)."""
    table = torch.cat([past.transpose(1, 2).reshape(-1, raw.shape[1]).to(raw.dtype), raw])
    conv = table[sources[:, 0]].float() * taps[0]
    for j in range(1, taps.shape[0]):
        conv = conv + table[sources[:, j]].float() * taps[j]
    return F.silu(conv.to(raw.dtype))


def packed_attention_eager(
    q, k, v, prefix_k, prefix_v, prefix_mask, rows: Rows, scale: float
) -> torch.Tensor:
    """Each row's queries q [N, H, hd] over its image prefix's keys (prefix_k, prefix_v
    [Rp, KVH, P, hd], prefix_mask [Rp, P] true where valid), its parent's keys (all of them) and
    its own up to itself, k, v [N, KVH, hd]: `grouped_attention` of the row alone. Returns
    [N, H·hd] in v's dtype; tokens of no row are zeros."""
    out = v.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
    for start, length, parent, prefix in rows.host():
        mine = slice(start, start + length)
        if parent >= 0:
            past_start, past_length = rows_span(rows, parent)
            past = slice(past_start, past_start + past_length)
            past_k, past_v = k[past].transpose(0, 1)[None], v[past].transpose(0, 1)[None]
        else:
            past_k = past_v = k.new_zeros(1, k.shape[1], 0, k.shape[2])
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        mask = torch.cat(
            [
                prefix_mask[prefix][None, :].expand(length, -1),
                causal.new_ones(length, past_k.shape[2]),
                causal,
            ],
            dim=-1,
        )[None]
        out[mine] = grouped_attention(
            q[mine].transpose(0, 1)[None],
            prefix_k,
            prefix_v,
            torch.tensor([prefix], device=q.device),
            past_k,
            past_v,
            k[mine].transpose(0, 1)[None],
            v[mine].transpose(0, 1)[None],
            mask,
            scale,
        )[0]
    return out


def rows_span(rows: Rows, row: int) -> tuple[int, int]:
    """(start, length) of a row, on the host."""
    return int(rows.start[row]), int(rows.length[row])


def value_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, H, d] → float32 [T, HV, d]: key head j // (HV/H) for value head j."""
    t, count, dim = x.shape
    x = x.float()[:, :, None].expand(t, count, heads // count, dim)
    return x.reshape(t, heads, dim)


def packed_delta_eager(q, k, v, g, beta, states, rows: Rows, scale: float) -> torch.Tensor:
    """The gated delta rule of each row: q, k [N, H, dk] (normalised here), v [N, HV, dv], g and
    beta float32 [N, HV]; a text row (parent -1) starts from its prefix's state (states float32
    [Rp, HV, dk, dv]), an option row from its parent's final state. The eager chunked core of a
    row alone. Returns float32 [N, HV, dv]; tokens of no row are zeros."""
    heads = v.shape[1]
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    finals: dict[int, torch.Tensor] = {}
    for row, (start, length, parent, prefix) in enumerate_rows(rows):
        mine = slice(start, start + length)
        initial = states[prefix] if parent < 0 else finals[parent]
        row_q = l2norm(value_heads(q[mine], heads)) * scale
        row_k = l2norm(value_heads(k[mine], heads))
        made, final = CORES["eager"](
            row_q[None],
            row_k[None],
            v[mine].float()[None],
            g[mine][None],
            beta[mine][None],
            initial[None].float(),
        )
        out[mine] = made[0]
        if parent < 0:
            finals[row] = final[0]
    return out


def enumerate_rows(rows: Rows) -> list[tuple[int, tuple[int, int, int, int]]]:
    """(row index, (start, length, parent, prefix)) of each non-empty row, on the host."""
    tables = torch.stack([rows.start, rows.length, rows.parent, rows.prefix], 1).tolist()
    return [(r, tuple(row)) for r, row in enumerate(tables[:-1]) if row[1] > 0]


# -- the machine's products -----------------------------------------------------------------


def multiplied(layer) -> list[torch.Tensor]:
    """The weights a layer's products take: its fused weights (buffers) and every matrix that is
    no view of one (a fused Linear's own weight is, and no product reads it)."""
    fused = [t for t in layer.buffers() if t.dim() == 2 and t.is_floating_point()]
    held = {t.untyped_storage().data_ptr() for t in fused}
    return fused + [
        t for t in layer.parameters() if t.dim() == 2 and t.untyped_storage().data_ptr() not in held
    ]


def products_differ(module, sizes: tuple[int, ...], multiply=product) -> list[str]:
    """Where this machine's products give a row other bytes at another pass size: each of the
    language model's weight shapes (a layer of each kind, its fused weights included) at each
    of `sizes` rows, against the same rows of the largest size ("NxK at M rows"). A BLAS
    library picks its kernel, and with it the order of a row's sums, by the row count; a pass
    merges rows of several requests only where none differs."""
    weights = {}
    for layer in {layer.kind: layer for layer in module.layers}.values():
        for tensor in multiplied(layer):
            weights.setdefault(tuple(tensor.shape), tensor)
    generator = torch.Generator(device=next(iter(weights.values())).device).manual_seed(0)
    differ = []
    for (n, k), weight in sorted(weights.items()):
        x = torch.randn(
            max(sizes), k, generator=generator, device=weight.device, dtype=weight.dtype
        )
        full = multiply(x, weight)
        differ += [
            f"{n}x{k} at {m} rows"
            for m in sizes
            if m < len(x) and not torch.equal(multiply(x[:m], weight), full[:m])
        ]
    return differ


# -- one layer of each kind, and the pass ---------------------------------------------------


def attention_layer(layer, h, cos, sin, rows: Rows, prefix_k, prefix_v, prefix_mask):
    """One attention decoder layer over the packed tokens h [N, D]."""
    attn = layer.self_attn
    q, gate, k, v = attn.project(layer.input_layernorm(h))
    n = h.shape[0]
    q = attn.q_norm(q)  # [N, H, hd]
    k = attn.k_norm(k.reshape(n, attn.kv_heads, attn.head_dim))
    v = v.reshape(n, attn.kv_heads, attn.head_dim)
    q = apply_rotary(q.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    k = apply_rotary(k.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    attend = getattr(attn, "packed_attend", packed_attention_eager)
    mixed = attend(q, k, v, prefix_k, prefix_v, prefix_mask, rows, attn.head_dim**-0.5)
    h = h + attn.output(mixed, gate)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def delta_layer(layer, h, rows: Rows, sources, conv_past, rec_past):
    """One Gated DeltaNet decoder layer over the packed tokens h [N, D]."""
    delta = layer.linear_attn
    raw, z, beta_raw, a = delta.project(layer.input_layernorm(h))
    n = h.shape[0]
    mixed = packed_conv(raw, conv_past, delta.taps(), sources)
    key_width = delta.k_heads * delta.dk
    q, k, v = mixed.split([key_width, key_width, delta.v_heads * delta.dv], dim=-1)
    beta = beta_raw.sigmoid().float()
    g = -delta.A_log.float().exp() * F.softplus(a.float() + delta.dt_bias.float())
    core = getattr(delta, "packed_core", packed_delta_eager)
    out = core(
        q.reshape(n, delta.k_heads, delta.dk),
        k.reshape(n, delta.k_heads, delta.dk),
        v.reshape(n, delta.v_heads, delta.dv),
        g,
        beta,
        rec_past.float(),
        rows,
        delta.dk**-0.5,
    )
    z = z.reshape(n, delta.v_heads, delta.dv)
    y = delta.norm(out.to(raw.dtype), z).reshape(n, delta.v_heads * delta.dv)
    h = h + delta.output(y)
    return h + layer.mlp(layer.post_attention_layernorm(h))


PACKED_BLOCKS = {"attention": attention_layer, "delta": delta_layer}


def packed_body(module, feeds: dict, blocks: dict | None = None) -> dict[str, torch.Tensor]:
    """A packed pass (the torch backend's `lm_packed`): every token after the final norm, `flat`
    [N, D], from which the backend takes the readouts. Feeds: TOKEN_INPUTS, ROW_TABLES, each
    image prefix's keys and values (`prefix_k.i`, `prefix_v.i` [Rp, KVH, P, hd], `prefix_mask`
    [Rp, P]) and its after-prefix states (`src_conv.j` [Rp, C, K−1], `src_rec.j`
    [Rp, HV, dk, dv])."""
    blocks = blocks or PACKED_BLOCKS
    rows = Rows.of(feeds)
    h = module.embed(feeds["input_ids"][None], feeds["image_features"])[0]
    cos, sin = module.rotary(feeds["positions"][:, None], h.dtype)
    taps = next(
        (layer.linear_attn.kernel for layer in module.layers if layer.kind != "full_attention"),
        0,
    )
    sources = None
    if taps:
        prefixes = feeds["src_conv.0"].shape[0]
        sources = conv_sources(rows, prefixes, taps)
    i = j = 0
    for layer in module.layers:
        if layer.kind == "full_attention":
            h = blocks["attention"](
                layer, h, cos, sin, rows, feeds[f"prefix_k.{i}"], feeds[f"prefix_v.{i}"],
                feeds["prefix_mask"],
            )  # fmt: skip
            i += 1
        else:
            h = blocks["delta"](
                layer, h, rows, sources, feeds[f"src_conv.{j}"], feeds[f"src_rec.{j}"]
            )
            j += 1
    return {"flat": module.norm(h)}
