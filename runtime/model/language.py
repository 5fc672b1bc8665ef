"""One language-model pass over right-padded rows, each continuing its image prefix (one of the
pass's `prefix_rows`) and its own state: gated attention, Gated DeltaNet, the readouts
(docs/design.md "Language-model passes").

Follows transformers 5.17 `Qwen3_5TextModel` (docs/model.md §2-§5); the Gated DeltaNet core comes
from `runtime.model.gdn` by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plugins.readout import token_logprobs
from runtime.model.gdn import CORES, GDN_VARIANTS, l2norm
from runtime.model.layers import (
    MASKED,
    MLP,
    GatedRMSNorm,
    RMSNorm,
    fuse_linears,
    per_row,
    product,
    projections,
    rotate_half,
)

READOUT_VARIANTS = ("std", "plugin")
# folded_attention pads keys to a multiple of this: the prefix pass's 641 own keys (640 + the
# empty state's one) sent cuBLAS to a slow kernel with alignment 1
KEY_ALIGN = 8


def mrope_axes(rotary_dim: int, section: list[int]) -> list[int]:
    """Position axis (0 T, 1 H, 2 W) of each rotary frequency, interleaved (docs/contract.md
    §4.6)."""
    axes = []
    for i in range(rotary_dim // 2):
        if i % 3 == 1 and i < 3 * section[1]:
            axes.append(1)
        elif i % 3 == 2 and i < 3 * section[2]:
            axes.append(2)
        else:
            axes.append(0)
    return axes


def rope_tables(tc: dict, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse frequencies (float32, as Qwen3_5TextRotaryEmbedding) and each one's axis; made
    on a real device even under a meta-device context, since no checkpoint holds them."""
    rope = tc["rope_parameters"]
    rotary_dim = int(tc["head_dim"] * rope.get("partial_rotary_factor", 1.0))
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    axes = mrope_axes(rotary_dim, rope["mrope_section"])
    return 1.0 / (rope["rope_theta"] ** exponent), torch.tensor(axes, device=device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first `rotary_dim` dims of [B, heads, T, hd]; the rest pass through."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


def grouped_attention(
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
    """q [B, H, T, hd] over its row's image prefix, row n's keys/values
    `shared_k[prefix_rows[n]]` of [R, KVH, P, hd] (gathered per row: each row's products have
    the shapes they have with one prefix, so a row's bytes do not follow the others' prefixes),
    followed by each row's past [B, KVH, Q, hd] and its own k, v [B, KVH, T, hd]; query head h
    reads KV head h // (H/KVH). `mask` [B, T, P + Q + T] is true where a key is visible. One
    softmax over all; the shared and the row's weighted sums are added in float32. Returns
    [B, T, H·hd]."""
    keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    shared_k, shared_v = shared_k[prefix_rows], shared_v[prefix_rows]
    b, heads, t, hd = q.shape
    kv_heads = keys.shape[1]
    qg = q.reshape(b, kv_heads, heads // kv_heads, t, hd)
    shared = qg @ shared_k[:, :, None].transpose(-1, -2)  # broadcast over groups
    own = qg @ keys[:, :, None].transpose(-1, -2)
    scores = torch.cat([shared, own], dim=-1) * scale
    scores = torch.where(mask[:, None, None], scores.float(), MASKED)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    p_shared, p_own = probs.split([shared_k.shape[2], keys.shape[2]], dim=-1)
    out = (p_shared @ shared_v[:, :, None]).float() + (p_own @ values[:, :, None]).float()
    out = out.to(values.dtype).reshape(b, heads, t, hd)
    return out.transpose(1, 2).reshape(b, t, heads * hd)


def aligned_keys(shared_k, shared_v, keys, values, mask):
    """The shared and own keys and values padded with masked zero keys to a multiple of
    KEY_ALIGN each, so that the attention products get aligned operands; the padding's
    probabilities are exactly 0 and add nothing."""
    p, q = shared_k.shape[2], keys.shape[2]
    p_pad, q_pad = (-p) % KEY_ALIGN, (-q) % KEY_ALIGN
    if not p_pad and not q_pad:
        return shared_k, shared_v, keys, values, mask
    pad = (0, 0, 0, p_pad)
    shared_k, shared_v = F.pad(shared_k, pad), F.pad(shared_v, pad)
    keys, values = F.pad(keys, (0, 0, 0, q_pad)), F.pad(values, (0, 0, 0, q_pad))
    masked = mask.new_zeros(*mask.shape[:-1], p_pad + q_pad)
    mask = torch.cat([mask[..., :p], masked[..., :p_pad], mask[..., p:], masked[..., p_pad:]], -1)
    return shared_k, shared_v, keys, values, mask


def folded_attention(
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
    """`grouped_attention` with every row's queries folded into one matrix product against the
    shared keys ([KVH, B·G·T, hd] × [KVH, hd, P]) and back, so that the prefix is read once per
    pass, not as B·G small products (the torch backend's form; the export keeps the other).

    With several image prefixes (R > 1), each prefix's two products run over every row's
    queries, exactly the products of the pass holding that prefix alone, and a row keeps those
    of its own prefix (`prefix_rows`): its bytes are the ones it has with its prefix alone, at
    the cost of a prefix's products for each prefix (on the CPU, each prefix its rows read)."""
    keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    shared_k, shared_v, keys, values, mask = aligned_keys(shared_k, shared_v, keys, values, mask)
    b, heads, t, hd = q.shape
    kv_heads, p = keys.shape[1], shared_k.shape[2]
    group = heads // kv_heads
    folded_rows = b * group * t
    prefixes = read_prefixes(shared_k.shape[0], prefix_rows)

    def own_prefix(parts: list[torch.Tensor]) -> torch.Tensor:
        """Each row's [B, ...] of the products of its own prefix (one part each of `prefixes`)."""
        picked = parts[0]
        for r, part in zip(prefixes[1:], parts[1:], strict=True):
            mine = (prefix_rows == r).reshape(b, *[1] * (part.dim() - 1))
            picked = torch.where(mine, part, picked)
        return picked

    qg = q.reshape(b, kv_heads, group, t, hd)
    folded = qg.permute(1, 0, 2, 3, 4).reshape(kv_heads, folded_rows, hd)
    shared = own_prefix(
        [
            (folded @ shared_k[r].transpose(-1, -2))[:, :folded_rows]
            .reshape(kv_heads, b, group, t, p)
            .permute(1, 0, 2, 3, 4)
            for r in prefixes
        ]
    )
    own = qg @ keys[:, :, None].transpose(-1, -2)
    scores = torch.cat([shared, own], dim=-1) * scale
    scores = torch.where(mask[:, None, None], scores.float(), MASKED)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    p_shared, p_own = probs.split([p, keys.shape[2]], dim=-1)
    p_folded = p_shared.permute(1, 0, 2, 3, 4).reshape(kv_heads, folded_rows, p)
    from_shared = own_prefix(
        [
            (p_folded @ shared_v[r])[:, :folded_rows]
            .reshape(kv_heads, b, group, t, hd)
            .permute(1, 0, 2, 3, 4)
            for r in prefixes
        ]
    )
    from_own = p_own @ values[:, :, None]
    out = from_shared.float() + from_own.float()
    out = out.to(values.dtype).reshape(b, heads, t, hd)
    return out.transpose(1, 2).reshape(b, t, heads * hd)


def read_prefixes(count: int, prefix_rows: torch.Tensor) -> list[int]:
    """The prefixes of [R, ...] whose products `folded_attention` runs: the one there is; on
    the CPU those its rows read (no device to wait for); elsewhere all R (no data-dependent
    shapes under compilation)."""
    if count == 1:
        return [0]
    if prefix_rows.device.type == "cpu":
        return [int(r) for r in prefix_rows.unique()]
    return list(range(count))


class GatedAttention(nn.Module):
    """Qwen3_5Attention: query + sigmoid gate per head, q/k norms, partial M-RoPE, GQA."""

    def __init__(self, tc: dict):
        super().__init__()
        hidden, self.head_dim = tc["hidden_size"], tc["head_dim"]
        self.heads, self.kv_heads = tc["num_attention_heads"], tc["num_key_value_heads"]
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, tc["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, tc["rms_norm_eps"])
        # the torch backend swaps in folded_attention, or on CUDA in half precision its kernel
        self.attend = grouped_attention
        self.register_buffer("qkv", None, persistent=False)  # fuse(): q, k and v as one

    def fuse(self) -> None:
        fuse_linears(self, "qkv", self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, mask, prefix_k, prefix_v, prefix_rows, src_k, src_v):
        q, gate, k, v = self.project(x)
        attn, k, v = self.mix(
            q, k, v, cos, sin, mask, prefix_k, prefix_v, prefix_rows, src_k, src_v
        )
        return self.output(attn, gate), k, v

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per token of x [..., D]: q [..., H, hd] (before its norm), the gate [..., H·hd], k
        and v [..., KVH·hd]."""
        lead = x.shape[:-1]
        q, k, v = projections(x, self.qkv, self.q_proj, self.k_proj, self.v_proj)
        q, gate = q.reshape(*lead, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        return q, gate.reshape(*lead, self.heads * self.head_dim), k, v

    def mix(self, q, k, v, cos, sin, mask, prefix_k, prefix_v, prefix_rows, src_k, src_v):
        """Rows [B, T] of `project`'s q, k, v, row n after image prefix `prefix_rows[n]` of
        prefix_k, prefix_v [R, KVH, P, hd]: the attention [B, T, H·hd] and the rows' own k, v
        [B, KVH, T, hd] (normalised, rotated)."""
        b, t = q.shape[:2]
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k.reshape(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = self.attend(
            q, prefix_k, prefix_v, prefix_rows, src_k, src_v, k, v, mask, self.head_dim**-0.5
        )
        return attn, k, v

    def output(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return product(attn * torch.sigmoid(gate), self.o_proj.weight)


class GatedDeltaNet(nn.Module):
    """Qwen3_5GatedDeltaNet continuing a conv and recurrent state; pads (t ≥ length) leave
    both states untouched (decay 0, beta 0; conv state = last K−1 valid raw columns)."""

    def __init__(self, tc: dict, gdn: str):
        super().__init__()
        hidden = tc["hidden_size"]
        self.k_heads, self.v_heads = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
        self.dk, self.dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        self.kernel = tc["linear_conv_kernel_dim"]
        self.gdn = gdn
        self.core = "eager"  # the core outside export; the torch backend picks "fla" on CUDA
        channels = 2 * self.k_heads * self.dk + self.v_heads * self.dv
        self.in_proj_qkv = nn.Linear(hidden, channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.v_heads * self.dv, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, self.kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.dv, tc["rms_norm_eps"])
        self.out_proj = nn.Linear(self.v_heads * self.dv, hidden, bias=False)
        self.register_buffer("in_proj", None, persistent=False)  # fuse(): the four as one

    def fuse(self) -> None:
        fuse_linears(self, "in_proj", *self.input_linears())

    def input_linears(self) -> tuple[nn.Linear, ...]:
        return (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def conv(self, raw, conv_past, lengths, want_state: bool = True):
        """SiLU(causal depthwise conv) over past + own raw columns, raw [B, T, C] and the past
        [B, C, K-1]: the output [B, T, C] and the new conv state [B, C, K-1] (which the conv
        kernel may leave out where not `want_state`)."""
        if self.core == "fla" and raw.dtype != torch.float32 and not torch.onnx.is_in_onnx_export():
            from runtime.model import gdn_kernels

            # one kernel, the same arithmetic (float32 taps)
            past = conv_past.to(raw.dtype)
            return gdn_kernels.short_conv(raw, past, self.taps(), lengths, want_state)
        # token-major ([B, K-1+T, C], channels contiguous), so that every tap reads and the
        # output writes whole rows (channel-major needed a transpose in and out)
        full = torch.cat([conv_past.transpose(1, 2), raw], dim=1)
        keep = self.kernel - 1
        index = lengths[:, None] + torch.arange(keep, device=raw.device)[None, :]
        state = full.gather(1, index[:, :, None].expand(-1, -1, full.shape[2])).transpose(1, 2)
        # Shifted multiply-adds, not Conv: cuDNN's depthwise conv was 1.5 s of a 1.9 s ORT
        # profile on the H200 and TensorRT needs no conv layer. float32 as a bfloat16 conv with
        # float accumulation would be, rounded back after.
        weight = self.taps()
        columns = full.shape[1] - self.kernel + 1
        f = full.float()
        conv = f[:, 0:columns] * weight[0]
        for j in range(1, self.kernel):
            conv = conv + f[:, j : j + columns] * weight[j]
        return F.silu(conv.to(raw.dtype)), state

    def taps(self) -> torch.Tensor:
        """The conv's weights in float32, a tap a row: [K, C]."""
        return self.conv1d.weight.float()[:, 0, :].t()

    def heads(self, x: torch.Tensor, count: int, dim: int) -> torch.Tensor:
        """[B, T, count·dim] → float32 [B, T, HV, dim], key head j // (HV/H) for value head j."""
        b, t, _ = x.shape
        x = x.float().reshape(b, t, count, 1, dim)
        return x.expand(b, t, count, self.v_heads // count, dim).reshape(b, t, self.v_heads, dim)

    def forward(self, x, valid, lengths, conv_past, rec_past, want_state: bool = True, src=None):
        y, conv_state, rec_state = self.mix(
            *self.project(x), valid, lengths, conv_past, rec_past, want_state, src
        )
        return self.output(y), conv_state, rec_state

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per token of x [..., D]: the conv's raw input, the gate z, beta's and a's logits."""
        return projections(x, self.in_proj, *self.input_linears())

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return product(y, self.out_proj.weight)

    def mix(self, raw, z, beta_raw, a, valid, lengths, conv_past, rec_past, want_state, src):
        """Rows [B, T] of `project`'s outputs: the normed core output [B, T, HV·dv] (before
        out_proj), the conv state and the recurrent state. With `src`, `rec_past` holds one
        state per source and row n continues `rec_past[src[n]]` (on CUDA read in place by the
        kernel, never gathered)."""
        b, t, _ = raw.shape
        mixed, conv_state = self.conv(raw, conv_past, lengths, want_state)
        key_width = self.k_heads * self.dk
        q, k, v = mixed.split([key_width, key_width, self.v_heads * self.dv], dim=-1)
        beta = torch.where(valid[..., None], beta_raw.sigmoid().float(), 0.0)
        a = a.float()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        g = torch.where(valid[..., None], g, 0.0)
        if self.core == "fla" and not torch.onnx.is_in_onnx_export():
            from runtime.model import gdn_kernels

            # the kernels normalise q and k and map value head j to key head j // (HV/H), and
            # read each row's source state in place by `src`. q, k and v contiguous: Inductor
            # gives a custom op's inputs buffers of their own either way, and views of the
            # conv's output made fla's chunked kernel copy them again, unfused
            q = q.reshape(b, t, self.k_heads, self.dk).contiguous()
            k = k.reshape(b, t, self.k_heads, self.dk).contiguous()
            v = v.reshape(b, t, self.v_heads, self.dv).contiguous()
            g, beta = g.contiguous(), beta.contiguous()
            if src is None:
                src = torch.arange(b, device=raw.device)
            states = rec_past.float().contiguous()
            # the recurrent state comes back wanted or not, as from the eager cores: every pass
            # that runs this core keeps it (the torch backend's "lm_state")
            out, rec_state = gdn_kernels.rows_gated_delta(
                q, k, v, g, beta, states, src, lengths, self.dk**-0.5
            )
        else:
            if src is not None:
                rec_past = per_row(rec_past, src, b)
            q = l2norm(self.heads(q, self.k_heads, self.dk)) * self.dk**-0.5
            k = l2norm(self.heads(k, self.k_heads, self.dk))
            v = v.float().reshape(b, t, self.v_heads, self.dv)
            core = CORES[self.gdn if torch.onnx.is_in_onnx_export() else self.core]
            out, rec_state = core(q, k, v, g, beta, rec_past.float())
        z = z.reshape(b, t, self.v_heads, self.dv)
        y = self.norm(out.to(raw.dtype), z).reshape(b, t, self.v_heads * self.dv)
        return y, conv_state, rec_state


class DecoderLayer(nn.Module):
    def __init__(self, tc: dict, kind: str, gdn: str):
        super().__init__()
        self.kind = kind
        if kind == "full_attention":
            self.self_attn = GatedAttention(tc)
        else:
            self.linear_attn = GatedDeltaNet(tc, gdn)
        self.mlp = MLP(tc["hidden_size"], tc["intermediate_size"])
        self.input_layernorm = RMSNorm(tc["hidden_size"], tc["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(tc["hidden_size"], tc["rms_norm_eps"])


class LanguagePass(nn.Module):
    """One pass of docs/design.md "Language-model passes" over right-padded rows [B, T].

    Returns (hidden, logprobs) and, with `return_state`, out_k.*, out_v.*, out_conv.*, out_rec.*
    in that order (index i counts attention layers, j Gated DeltaNet layers)."""

    def __init__(
        self,
        config: dict,
        return_state: bool = True,
        gdn: str = "ort",
        readout: str = "std",
        vocab: int | None = None,
    ):
        super().__init__()
        if gdn not in GDN_VARIANTS or readout not in READOUT_VARIANTS:
            raise ValueError(
                f"gdn must be one of {GDN_VARIANTS}, readout one of "
                f"{READOUT_VARIANTS}; got {gdn!r}, {readout!r}"
            )
        tc = config["text_config"]
        self.return_state, self.readout = return_state, readout
        self.image_token_id = config["image_token_id"]
        self.layer_types = list(tc["layer_types"])
        self.embed_tokens = nn.Embedding(vocab or tc["vocab_size"], tc["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(tc, kind, gdn) for kind in self.layer_types)
        self.norm = RMSNorm(tc["hidden_size"], tc["rms_norm_eps"])
        inv_freq, freq_axes = rope_tables(tc)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("freq_axes", freq_axes, persistent=False)

    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor) -> torch.Tensor:
        """Token rows, with image rows substituted for image tokens in order."""
        b, t = input_ids.shape
        rows = self.embed_tokens(input_ids)
        is_image = input_ids == self.image_token_id
        order = is_image.reshape(-1).long().cumsum(0).reshape(b, t) - 1
        # clamped so a count mismatch cannot index out of bounds on a GPU
        order = order.clamp(0, image_features.shape[0] - 1)
        return torch.where(is_image[..., None], image_features.to(rows.dtype)[order], rows)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [B, T, rotary_dim] from M-RoPE positions [3, B, T] (float32, then dtype)."""
        freqs = positions[self.freq_axes].permute(1, 2, 0).float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids,
        image_features,
        positions,
        lengths,
        prefix_k,
        prefix_v,
        prefix_mask,
        prefix_rows,
        src,
        src_k,
        src_v,
        src_mask,
        src_conv,
        src_rec,
        read_rows,
        target_rows,
        target_tokens,
    ):
        b, t = input_ids.shape
        h = self.embed(input_ids, image_features)
        cos, sin = self.rotary(positions, h.dtype)
        steps = torch.arange(t, device=input_ids.device)
        valid = steps[None, :] < lengths[:, None]
        causal = steps[None, :, None] >= steps[None, None, :]
        mask = torch.cat(
            [
                prefix_mask[prefix_rows][:, None, :].expand(-1, t, -1),
                src_mask[src][:, None, :].expand(-1, t, -1),
                causal & valid[:, None, :],
            ],
            dim=-1,
        )
        out_k, out_v, out_conv, out_rec = [], [], [], []
        for layer in self.layers:
            x = layer.input_layernorm(h)
            if layer.kind == "full_attention":
                i = len(out_k)
                x, k, v = layer.self_attn(
                    x, cos, sin, mask, prefix_k[i], prefix_v[i], prefix_rows, src_k[i][src],
                    src_v[i][src],
                )  # fmt: skip
                out_k.append(k)
                out_v.append(v)
            else:
                j = len(out_conv)
                x, conv, rec = layer.linear_attn(
                    x, valid, lengths, src_conv[j][src], src_rec[j][src]
                )
                out_conv.append(conv)
                out_rec.append(rec)
            h = h + x
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        flat = self.norm(h).reshape(b * t, -1)
        hidden = flat[read_rows].float()
        logprobs = token_logprobs(
            flat[target_rows],
            self.embed_tokens.weight,
            target_tokens,
            plugin=self.readout == "plugin",
        )
        if not self.return_state:
            return hidden, logprobs
        return (hidden, logprobs, *out_k, *out_v, *out_conv, *out_rec)


# -- graph names (docs/design.md "Language-model passes"): the ONNX export and every backend ---


def layer_counts(config: dict) -> tuple[int, int]:
    """(attention layers, Gated DeltaNet layers) of config.json."""
    types = config["text_config"]["layer_types"]
    return types.count("full_attention"), types.count("linear_attention")


def lm_input_names(config: dict) -> list[str]:
    """Inputs of both language-model graphs in `LanguagePass.forward` order."""
    attn, gdn = layer_counts(config)
    return [
        "input_ids", "image_features", "positions", "lengths",
        *[f"prefix_k.{i}" for i in range(attn)], *[f"prefix_v.{i}" for i in range(attn)],
        "prefix_mask", "prefix_rows", "src",
        *[f"src_k.{i}" for i in range(attn)], *[f"src_v.{i}" for i in range(attn)],
        "src_mask",
        *[f"src_conv.{j}" for j in range(gdn)], *[f"src_rec.{j}" for j in range(gdn)],
        "read_rows", "target_rows", "target_tokens",
    ]  # fmt: skip


def lm_output_names(config: dict, return_state: bool) -> list[str]:
    attn, gdn = layer_counts(config)
    if not return_state:
        return ["hidden", "logprobs"]
    return [
        "hidden", "logprobs",
        *[f"out_k.{i}" for i in range(attn)], *[f"out_v.{i}" for i in range(attn)],
        *[f"out_conv.{j}" for j in range(gdn)], *[f"out_rec.{j}" for j in range(gdn)],
    ]  # fmt: skip


def lm_args(feeds: dict, config: dict) -> tuple:
    """`LanguagePass.forward` arguments from inputs keyed by their ONNX names."""
    attn, gdn = layer_counts(config)

    def group(name: str, count: int) -> list:
        return [feeds[f"{name}.{i}"] for i in range(count)]

    return (
        feeds["input_ids"], feeds["image_features"], feeds["positions"], feeds["lengths"],
        group("prefix_k", attn), group("prefix_v", attn), feeds["prefix_mask"],
        feeds["prefix_rows"], feeds["src"],
        group("src_k", attn), group("src_v", attn), feeds["src_mask"],
        group("src_conv", gdn), group("src_rec", gdn),
        feeds["read_rows"], feeds["target_rows"], feeds["target_tokens"],
    )  # fmt: skip


# -- the torch backend's pass -------------------------------------------------------------------


def attention_block(layer, h, cos, sin, mask, prefix_k, prefix_v, prefix_rows, src_k, src_v):
    """One attention decoder layer of `pass_body`: (h, k, v). A function of the layer, so that
    one compilation serves every layer of its kind (regional compilation)."""
    x, k, v = layer.self_attn(
        layer.input_layernorm(h), cos, sin, mask, prefix_k, prefix_v, prefix_rows, src_k, src_v
    )
    h = h + x
    return h + layer.mlp(layer.post_attention_layernorm(h)), k, v


def delta_block(layer, h, valid, lengths, conv_past, rec_past, src, want_state: bool):
    """One Gated DeltaNet decoder layer of `pass_body`: (h, conv state, recurrent state)."""
    x, conv, rec = layer.linear_attn(
        layer.input_layernorm(h), valid, lengths, conv_past, rec_past, want_state, src
    )
    h = h + x
    return h + layer.mlp(layer.post_attention_layernorm(h)), conv, rec


BLOCKS = {"attention": attention_block, "delta": delta_block}


def pass_body(
    module: LanguagePass, feeds: dict, return_state: bool, blocks: dict | None = None
) -> dict[str, torch.Tensor]:
    """`LanguagePass.forward` up to the final norm, for the torch backend: inputs and outputs by
    their graph names, `flat` [B·T, D] (every position after the final norm) in place of the
    readouts, which the backend takes from it in fixed-size pieces; the state outputs only with
    `return_state` (option rows are leaves). Same arithmetic as forward, except the attention
    and Gated DeltaNet forms the layers were given (`attend`, `core`). `blocks` may hold
    compiled forms of `attention_block` and `delta_block`."""
    blocks = blocks or BLOCKS
    lengths, src, prefix_rows = feeds["lengths"], feeds["src"], feeds["prefix_rows"]
    h, cos, sin, valid, own = rows_inputs(module, feeds, "")
    b, t = valid.shape
    prefix_mask = per_row(feeds["prefix_mask"], prefix_rows, b)
    mask = rows_mask(prefix_mask, per_row(feeds["src_mask"], src, b), own)
    out: dict[str, torch.Tensor] = {}
    i = j = 0
    for layer in module.layers:
        if layer.kind == "full_attention":
            h, k, v = blocks["attention"](
                layer,
                h,
                cos,
                sin,
                mask,
                feeds[f"prefix_k.{i}"],
                feeds[f"prefix_v.{i}"],
                prefix_rows,
                per_row(feeds[f"src_k.{i}"], src, b),
                per_row(feeds[f"src_v.{i}"], src, b),
            )
            if return_state:
                out[f"out_k.{i}"], out[f"out_v.{i}"] = k, v
            i += 1
        else:
            h, conv, rec = blocks["delta"](
                layer,
                h,
                valid,
                lengths,
                per_row(feeds[f"src_conv.{j}"], src, b),
                feeds[f"src_rec.{j}"],
                src,
                return_state,
            )
            if return_state:
                out[f"out_conv.{j}"], out[f"out_rec.{j}"] = conv, rec
            j += 1
    out["flat"] = module.norm(h).reshape(b * t, -1)
    return out


def rows_inputs(module: LanguagePass, feeds: dict, prefix: str) -> tuple[torch.Tensor, ...]:
    """The embedded rows [B, T, D], cos and sin, which tokens are valid [B, T] and which of
    its own tokens each token sees [B, T, T] (causal, valid), from the feeds named
    `prefix` + the graph's names."""
    input_ids, lengths = feeds[prefix + "input_ids"], feeds[prefix + "lengths"]
    t = input_ids.shape[1]
    h = module.embed(input_ids, feeds["image_features"])
    cos, sin = module.rotary(feeds[prefix + "positions"], h.dtype)
    steps = torch.arange(t, device=input_ids.device)
    valid = steps[None, :] < lengths[:, None]
    causal = steps[None, :, None] >= steps[None, None, :]
    return h, cos, sin, valid, causal & valid[:, None, :]


def rows_mask(prefix_mask: torch.Tensor, past: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """[B, T, P + Q + T]: each row's prefix's valid keys [B, P], its past [B, Q], its own
    `own`."""
    t = own.shape[1]
    return torch.cat(
        [prefix_mask[:, None, :].expand(-1, t, -1), past[:, None, :].expand(-1, t, -1), own],
        dim=-1,
    )
