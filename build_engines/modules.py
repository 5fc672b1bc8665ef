"""Export modules: the vision tower and the language-model pass of docs/design.md in plain PyTorch.

Follows transformers 5.17 `Qwen3_5VisionModel` and `Qwen3_5TextModel` (model.md §2-§6); the Gated
DeltaNet core is `torch_chunk_gated_delta_rule` in eager mode and an ONNX-specific form in export.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plugins.readout import token_logprobs

GDN_CHUNK = 64  # torch_chunk_gated_delta_rule's chunk (model.md §3)
STD_MAX_TOKENS = GDN_CHUNK  # the standard-op GDN graph is one chunk: passes of at most 64 tokens
L2_EPS = 1e-6  # l2norm inside the kernel (use_qk_l2norm_in_kernel, model.md §3)
LAYER_NORM_EPS = 1e-6  # every vision LayerNorm (model.md §6.2)
VISION_THETA = 10000.0  # Qwen3_5VisionConfig's axial rope_theta default
MASKED = torch.finfo(torch.float32).min  # finite, so a row whose keys are all masked stays finite
GDN_VARIANTS = ("ort", "std")
# the vision tower's attention: written out in standard ops, or ONNX Runtime's fused
# `com.microsoft::MultiHeadAttention` (flash attention on the GPU in BF16; TensorRT cannot read it)
ATTENTION_VARIANTS = ("std", "ort")
READOUT_VARIANTS = ("std", "plugin")


# -- host-side vision inputs ---------------------------------------------------------------


def block_major_coords(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Patch (row, col) in the tower's order: merge×merge blocks row-major, row-major inside."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(
        0, 2, 1, 3
    ).ravel()


def axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps on one axis, align-corners sampling `linspace(0, side-1, size)` (float32)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
    return taps, weights.astype(np.float32)


def vision_inputs(grid_thw, pos_embed_weight: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """`pos_embeds` [N, C] and rotary `cos`, `sin` [N, head_dim] (float32) for one image grid,
    as `Qwen3_5VisionModel.forward` computes them; `config` is config.json or its vision part."""
    vc = config.get("vision_config", config)
    t, h, w = (int(x) for x in grid_thw)
    merge, side = vc["spatial_merge_size"], math.isqrt(vc["num_position_embeddings"])
    rows, cols = block_major_coords(h, w, merge)
    h_taps, h_weights = axis_taps(rows, h, side)
    w_taps, w_weights = axis_taps(cols, w, side)
    table = np.asarray(pos_embed_weight, dtype=np.float32)
    pos = np.zeros((rows.size, table.shape[1]), dtype=np.float32)
    for i in range(2):
        for j in range(2):
            weight = (h_weights[:, i] * w_weights[:, j])[:, None]
            pos = pos + table[h_taps[:, i] * side + w_taps[:, j]] * weight
    head_dim = vc["hidden_size"] // vc["num_heads"]
    theta = (vc.get("rope_parameters") or {}).get("rope_theta", VISION_THETA)
    half = head_dim // 2
    inv_freq = np.float32(1.0) / (
        np.float32(theta) ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))
    )
    freqs = np.concatenate(
        [rows[:, None].astype(np.float32) * inv_freq, cols[:, None].astype(np.float32) * inv_freq],
        axis=-1,
    )
    emb = np.concatenate([freqs, freqs], axis=-1)
    repeat = (t, 1)
    return {
        "pos_embeds": np.tile(pos, repeat),
        "cos": np.tile(np.cos(emb), repeat).astype(np.float32),
        "sin": np.tile(np.sin(emb), repeat).astype(np.float32),
    }


# -- shared pieces -------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """LayerNorm in float32, written out (TensorRT 10 has no Myelin kernel for the fused op)."""
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True)
    scaled = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + LAYER_NORM_EPS)
    return (scaled * norm.weight.float() + norm.bias.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) · (1 + w), in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet's output norm (Qwen3_5RMSNormGated): plain-weight RMSNorm, · silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# -- vision tower --------------------------------------------------------------------------


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Full attention of q, k, v [heads, N, hd] as one `com.microsoft::MultiHeadAttention` node
    (its 3-D layout, [1, N, heads·hd]); the kernel keeps the softmax in float32, as the
    standard-op form does.
    Returns [N, heads·hd]."""
    heads, n, hd = q.shape
    flat = [x.transpose(0, 1).reshape(1, n, heads * hd) for x in (q, k, v)]
    out = torch.onnx.ops.symbolic(
        "com.microsoft::MultiHeadAttention",
        flat,
        {"num_heads": heads, "scale": scale},
        dtype=q.dtype,
        shape=[1, n, heads * hd],
        version=1,
    )
    return out.reshape(n, heads * hd)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, intermediate: int):
        super().__init__()
        self.heads = heads
        self.fused = False  # export the attention as ONNX Runtime's MultiHeadAttention
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim)
        self.attn.proj = nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(dim, intermediate)
        self.mlp.linear_fc2 = nn.Linear(intermediate, dim)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        q, k, v = self.attn.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)
        cos, sin = cos[None].float(), sin[None].float()
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        scale = q.shape[-1] ** -0.5
        if self.fused and torch.onnx.is_in_onnx_export():
            return self.attn.proj(fused_attention(q, k, v, scale))
        scores = (q @ k.transpose(-1, -2)) * scale
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        return self.attn.proj((probs @ v).transpose(0, 1).reshape(n, dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(layer_norm(x, self.norm1), cos, sin)
        hidden = F.gelu(self.mlp.linear_fc1(layer_norm(x, self.norm2)), approximate="tanh")
        return x + self.mlp.linear_fc2(hidden)


class VisionTower(nn.Module):
    """Patches [N, 1536] + host `pos_embeds`, `cos`, `sin` → merged rows [N/4, out_hidden].

    Full non-causal attention over the one image; the merger uses exact GELU (model.md §6.2)."""

    def __init__(self, vision_config: dict, attention: str = "std"):
        super().__init__()
        vc = vision_config
        dim, self.merge = vc["hidden_size"], vc["spatial_merge_size"]
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            vc["in_channels"],
            dim,
            (vc["temporal_patch_size"], vc["patch_size"], vc["patch_size"]),
            stride=(vc["temporal_patch_size"], vc["patch_size"], vc["patch_size"]),
        )
        self.blocks = nn.ModuleList(
            VisionBlock(dim, vc["num_heads"], vc["intermediate_size"]) for _ in range(vc["depth"])
        )
        self.set_attention(attention)
        merged = dim * self.merge**2
        self.merger = nn.Module()
        self.merger.norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.merger.linear_fc1 = nn.Linear(merged, merged)
        self.merger.linear_fc2 = nn.Linear(merged, vc["out_hidden_size"])

    def set_attention(self, attention: str) -> None:
        """How export writes each block's attention (ATTENTION_VARIANTS); eager is unchanged."""
        for block in self.blocks:
            block.fused = attention == "ort"

    def forward(
        self,
        pixel_values: torch.Tensor,
        pos_embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        proj = self.patch_embed.proj
        dtype = proj.weight.dtype
        # Conv3d with kernel == stride over one patch is a matrix product with the flat kernel.
        x = F.linear(
            pixel_values.to(dtype), proj.weight.reshape(proj.weight.shape[0], -1), proj.bias
        )
        x = x + pos_embeds.to(dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = layer_norm(x, self.merger.norm).reshape(-1, self.merger.linear_fc1.in_features)
        return self.merger.linear_fc2(F.gelu(self.merger.linear_fc1(x)))


# -- language model: attention -------------------------------------------------------------


def mrope_axes(rotary_dim: int, section: list[int]) -> list[int]:
    """Position axis (0 T, 1 H, 2 W) of each rotary frequency, interleaved (contract.md §4.6)."""
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
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, T, hd] over the shared keys/values [1, KVH, P, hd] (the image prefix, read by
    every row in place, never copied per row) followed by each row's own [B, KVH, L, hd]; query
    head h reads KV head h // (H/KVH). `mask` [B, T, P + L] is true where a key is visible.
    One softmax over both parts; the two weighted sums are added in float32.
    Returns [B, T, H·hd]."""
    b, heads, t, hd = q.shape
    kv_heads = keys.shape[1]
    qg = q.reshape(b, kv_heads, heads // kv_heads, t, hd)
    shared = qg @ shared_k[:, :, None].transpose(-1, -2)  # broadcast over rows and groups
    own = qg @ keys[:, :, None].transpose(-1, -2)
    scores = torch.cat([shared, own], dim=-1) * scale
    scores = torch.where(mask[:, None, None], scores.float(), MASKED)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    p_shared, p_own = probs.split([shared_k.shape[2], keys.shape[2]], dim=-1)
    out = (p_shared @ shared_v[:, :, None]).float() + (p_own @ values[:, :, None]).float()
    out = out.to(values.dtype).reshape(b, heads, t, hd)
    return out.transpose(1, 2).reshape(b, t, heads * hd)


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

    def forward(self, x, cos, sin, mask, prefix_k, prefix_v, src_k, src_v):
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(b, t, self.heads * self.head_dim)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys = torch.cat([src_k, k], dim=2)
        values = torch.cat([src_v, v], dim=2)
        attn = grouped_attention(q, prefix_k, prefix_v, keys, values, mask, self.head_dim**-0.5)
        return self.o_proj(attn * torch.sigmoid(gate)), k, v


# -- language model: Gated DeltaNet --------------------------------------------------------


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def chunk_step(q, k, v, g, beta, state, inverse):
    """One chunk of the gated delta rule; q, k [..., C, dk], v [..., C, dv], g, beta [..., C],
    state [..., dk, dv]. `inverse(a, rhs)` solves (I + strict_lower(a)) x = rhs."""
    cum = g.cumsum(-1)
    size = g.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    decay = torch.where(lower, (cum[..., :, None] - cum[..., None, :]).exp(), 0.0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values, k_cumdecay = inverse(system, v_beta, k_beta * cum.exp()[..., None])
    v_new = new_values - k_cumdecay @ state
    out = (q * cum.exp()[..., None]) @ state + intra @ v_new
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    state = state * cum[..., -1].exp()[..., None, None] + k_decayed.transpose(-1, -2) @ v_new
    return out, state


def solve_unit_lower(system, *rhs):
    """Eager: torch's triangular solver, as torch_chunk_gated_delta_rule."""
    return tuple(
        torch.linalg.solve_triangular(system, r, upper=False, unitriangular=True) for r in rhs
    )


def block_inverse_unit_lower(system, *rhs):
    """Standard ops: (I + strict_lower(system))⁻¹ for a 64×64 chunk by block doubling
    ([[A,0],[C,D]]⁻¹ = [[A⁻¹,0],[−D⁻¹CA⁻¹,D⁻¹]]), 12 matmuls and no loop; stable, unlike
    repeated squaring of the Neumann series, whose partial products can reach 1e8."""
    size = system.shape[-1]
    index = torch.arange(size, device=system.device)
    lower = system * (index[:, None] > index[None, :])
    inverse = torch.eye(size, dtype=system.dtype, device=system.device).expand_as(system)
    block = 1
    while block < size:
        same_pair = (index[:, None] // (2 * block)) == (index[None, :] // (2 * block))
        cross = same_pair & ((index[:, None] // block) != (index[None, :] // block))
        inverse = inverse - inverse @ (lower * cross) @ inverse
        block *= 2
    return tuple(inverse @ r for r in rhs)


def gated_delta_eager(q, k, v, g, beta, state):
    """[B, T, HV, d] inputs (q, k normalised, q scaled), chunks of 64 as transformers."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    t = q.shape[2]
    pad = (-t) % GDN_CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    outs = []
    for start in range(0, t + pad, GDN_CHUNK):
        piece = slice(start, start + GDN_CHUNK)
        out, state = chunk_step(
            q[:, :, piece],
            k[:, :, piece],
            v[:, :, piece],
            g[..., piece],
            beta[..., piece],
            state,
            solve_unit_lower,
        )
        outs.append(out)
    return torch.cat(outs, dim=2)[:, :, :t].transpose(1, 2), state


def gated_delta_std(q, k, v, g, beta, state):
    """Standard ONNX ops: the pass (at most 64 tokens) padded to one chunk of 64."""
    t = q.shape[1]
    pad = GDN_CHUNK - t
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g.transpose(1, 2), (0, pad)), F.pad(beta.transpose(1, 2), (0, pad))
    out, state = chunk_step(q, k, v, g, beta, state, block_inverse_unit_lower)
    return out[:, :, :t].transpose(1, 2), state


def gated_delta_ort(q, k, v, g, beta, state):
    """onnxruntime's fused `com.microsoft::LinearAttention` (update_rule gated_delta): the same
    recurrence, S = e^g S; S += k (β (v − Sᵀk))ᵀ; o = Sᵀq, with q, k normalised outside."""
    b, t, heads, dk = q.shape
    dv = v.shape[-1]
    out, new_state = torch.onnx.ops.symbolic_multi_out(
        "com.microsoft::LinearAttention",
        [
            q.reshape(b, t, heads * dk),
            k.reshape(b, t, heads * dk),
            v.reshape(b, t, heads * dv),
            state,
            g,
            beta,
        ],
        {
            "q_num_heads": heads,
            "kv_num_heads": heads,
            "update_rule": "gated_delta",
            "scale": 1.0,
            "chunk_size": GDN_CHUNK,
        },
        dtypes=[torch.float32, torch.float32],
        shapes=[[b, t, heads * dv], list(state.shape)],
        version=1,
    )
    return out.reshape(b, t, heads, dv), new_state


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

    def conv(self, raw, conv_past, lengths):
        """SiLU(causal depthwise conv) over past + own raw columns; the new conv state."""
        full = torch.cat([conv_past, raw.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
        keep = self.kernel - 1
        index = lengths[:, None] + torch.arange(keep, device=raw.device)[None, :]
        state = full.gather(2, index[:, None, :].expand(-1, full.shape[1], -1))
        # Shifted multiply-adds, not Conv: cuDNN's depthwise conv was 1.5 s of a 1.9 s ORT
        # profile on the H200 and TensorRT needs no conv layer. float32 as a bfloat16 conv with
        # float accumulation would be, rounded back after.
        weight = self.conv1d.weight.float()[:, 0, :]  # [C, K]
        columns = full.shape[-1] - self.kernel + 1
        f = full.float()
        conv = f[:, :, 0:columns] * weight[None, :, 0:1]
        for j in range(1, self.kernel):
            conv = conv + f[:, :, j : j + columns] * weight[None, :, j : j + 1]
        return F.silu(conv.to(raw.dtype)).transpose(1, 2), state

    def heads(self, x: torch.Tensor, count: int, dim: int) -> torch.Tensor:
        """[B, T, count·dim] → float32 [B, T, HV, dim], key head j // (HV/H) for value head j."""
        b, t, _ = x.shape
        x = x.float().reshape(b, t, count, 1, dim)
        return x.expand(b, t, count, self.v_heads // count, dim).reshape(b, t, self.v_heads, dim)

    def forward(self, x, valid, lengths, conv_past, rec_past):
        b, t, _ = x.shape
        mixed, conv_state = self.conv(self.in_proj_qkv(x), conv_past, lengths)
        key_width = self.k_heads * self.dk
        q, k, v = mixed.split([key_width, key_width, self.v_heads * self.dv], dim=-1)
        q = l2norm(self.heads(q, self.k_heads, self.dk)) * self.dk**-0.5
        k = l2norm(self.heads(k, self.k_heads, self.dk))
        v = v.float().reshape(b, t, self.v_heads, self.dv)
        beta = torch.where(valid[..., None], self.in_proj_b(x).sigmoid().float(), 0.0)
        a = self.in_proj_a(x).float()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        g = torch.where(valid[..., None], g, 0.0)
        if not torch.onnx.is_in_onnx_export():
            core = gated_delta_eager
        else:
            core = gated_delta_ort if self.gdn == "ort" else gated_delta_std
        out, rec_state = core(q, k, v, g, beta, rec_past.float())
        z = self.in_proj_z(x).reshape(b, t, self.v_heads, self.dv)
        y = self.norm(out.to(x.dtype), z).reshape(b, t, self.v_heads * self.dv)
        return self.out_proj(y), conv_state, rec_state


# -- language model: the pass --------------------------------------------------------------


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
                prefix_mask[:, None, :].expand(b, t, -1),
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
                    x, cos, sin, mask, prefix_k[i], prefix_v[i], src_k[i][src], src_v[i][src]
                )
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
