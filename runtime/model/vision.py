"""The vision tower (patches → merged image rows) and its host-side position and rotary tables.

Follows transformers 5.17 `Qwen3_5VisionModel.forward` (docs/model.md §6).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.layers import LAYER_NORM_EPS, layer_norm, rotate_half

VISION_THETA = 10000.0  # Qwen3_5VisionConfig's axial rope_theta default
# the vision tower's attention: written out in standard ops, or ONNX Runtime's fused
# `com.microsoft::MultiHeadAttention` (flash attention on the GPU in BF16; TensorRT cannot read it)
ATTENTION_VARIANTS = ("std", "ort")
# Padding patches in torch's fused attention (the torch backend on CUDA), with no mask: every
# head gains KEY_COLUMNS columns (a multiple of 8, as the fused kernels take head sizes), the
# first 1 in every query and, in a key, 0 for the image's patches and PADDING_SCORE for padding,
# so that a padding key's score is the head's scale (1/√72) × -30,000 below its own and its
# weight an exact 0 (float32's exp is 0 past -104); the image's scores gain exact zeros. A
# boolean mask sends cuDNN to its slower kernel with a bias (docs/performance.md)
KEY_COLUMNS = 8
PADDING_SCORE = -30000.0


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
    index, weight = position_taps(grid_thw, config)
    table = np.asarray(pos_embed_weight, dtype=np.float32)
    zeros = np.zeros((index.shape[1], table.shape[1]), dtype=np.float32)
    return {
        "pos_embeds": blend_taps(table, index, weight, zeros),
        **rotary_tables(grid_thw, config),
    }


def position_taps(grid_thw, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's four bilinear taps into the position table: rows int64 [4, N] and weights
    float32 [4, N], in the order `blend_taps` adds them (the frames repeat the first's)."""
    vc = config.get("vision_config", config)
    t, h, w = (int(x) for x in grid_thw)
    merge, side = vc["spatial_merge_size"], math.isqrt(vc["num_position_embeddings"])
    rows, cols = block_major_coords(h, w, merge)
    h_taps, h_weights = axis_taps(rows, h, side)
    w_taps, w_weights = axis_taps(cols, w, side)
    pairs = [(i, j) for i in range(2) for j in range(2)]
    index = np.stack([h_taps[:, i] * side + w_taps[:, j] for i, j in pairs])
    weight = np.stack([h_weights[:, i] * w_weights[:, j] for i, j in pairs])
    return np.tile(index, (1, t)), np.tile(weight, (1, t))


def blend_taps(table, index, weight, zeros):
    """The interpolated position embeddings [N, C] from `position_taps`: NumPy arrays, or torch
    tensors on the device (the same float32 products and sums one by one, the same bytes)."""
    pos = zeros
    for k in range(index.shape[0]):
        pos = pos + table[index[k]] * weight[k][:, None]
    return pos


def rotary_tables(grid_thw, config: dict) -> dict[str, np.ndarray]:
    """The tower's rotary `cos` and `sin` [N, head_dim] (float32) of one grid."""
    vc = config.get("vision_config", config)
    t, h, w = (int(x) for x in grid_thw)
    rows, cols = block_major_coords(h, w, vc["spatial_merge_size"])
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
        "cos": np.tile(np.cos(emb), repeat).astype(np.float32),
        "sin": np.tile(np.sin(emb), repeat).astype(np.float32),
    }


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


def padding_columns(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [heads, N, hd] with KEY_COLUMNS more columns each (`image` bool [N], true for
    the image's patches): a padding key scores PADDING_SCORE more than its product, v's added
    columns are zeros."""
    heads, n, _ = q.shape
    first = (torch.arange(KEY_COLUMNS, device=q.device) == 0).to(q.dtype)
    score = torch.where(image, 0.0, PADDING_SCORE).to(k.dtype)
    q = torch.cat([q, first.expand(heads, n, KEY_COLUMNS)], -1)
    k = torch.cat([k, (score[:, None] * first).expand(heads, n, KEY_COLUMNS)], -1)
    v = torch.cat([v, v.new_zeros(heads, n, KEY_COLUMNS)], -1)
    return q, k, v


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, intermediate: int):
        super().__init__()
        self.heads = heads
        self.fused = False  # export the attention as ONNX Runtime's MultiHeadAttention
        self.sdpa = False  # outside export: torch's fused attention (the torch backend on CUDA)
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim)
        self.attn.proj = nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(dim, intermediate)
        self.mlp.linear_fc2 = nn.Linear(intermediate, dim)

    def attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor | None
    ) -> torch.Tensor:
        """Full attention over the image's patches; `keys` [1, 1, N] (bool, true for the
        image's own patches) where padding patches follow them."""
        n, dim = x.shape
        q, k, v = self.attn.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)
        cos, sin = cos[None].float(), sin[None].float()
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        scale = q.shape[-1] ** -0.5
        if self.fused and torch.onnx.is_in_onnx_export():
            return self.attn.proj(fused_attention(q, k, v, scale))
        if self.sdpa and not torch.onnx.is_in_onnx_export():
            width = q.shape[-1]
            if keys is not None:
                q, k, v = padding_columns(q, k, v, keys[0, 0])
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale)[0]
            return self.attn.proj(out[..., :width].transpose(0, 1).reshape(n, dim))
        scores = (q @ k.transpose(-1, -2)) * scale
        if keys is not None:
            scores = scores.masked_fill(~keys, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        return self.attn.proj((probs @ v).transpose(0, 1).reshape(n, dim))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.attention(layer_norm(x, self.norm1), cos, sin, keys)
        hidden = F.gelu(self.mlp.linear_fc1(layer_norm(x, self.norm2)), approximate="tanh")
        return x + self.mlp.linear_fc2(hidden)


class VisionTower(nn.Module):
    """Patches [N, 1536] + host `pos_embeds`, `cos`, `sin` → merged rows [N/4, out_hidden].

    Full non-causal attention over the one image; the merger uses exact GELU (docs/model.md
    §6.2)."""

    def __init__(self, vision_config: dict, attention: str = "std"):
        super().__init__()
        vc = vision_config
        dim, self.merge = vc["hidden_size"], vc["spatial_merge_size"]
        # the widths of the inputs: a patch's pixels, the position table's rows, a head's rotary
        self.patch_width = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
        self.width, self.head_dim = dim, dim // vc["num_heads"]
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
        patches: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The image rows; with `patches` (int64 [1]), only the first that many patches are the
        image's, the rest padding that no image patch attends to (the torch backend's patch
        buckets), whose rows come out last and are never read."""
        proj = self.patch_embed.proj
        dtype = proj.weight.dtype
        # Conv3d with kernel == stride over one patch is a matrix product with the flat kernel.
        x = F.linear(
            pixel_values.to(dtype), proj.weight.reshape(proj.weight.shape[0], -1), proj.bias
        )
        x = x + pos_embeds.to(dtype)
        keys = None
        if patches is not None:
            keys = (torch.arange(x.shape[0], device=x.device) < patches)[None, None, :]
        for block in self.blocks:
            x = block(x, cos, sin, keys)
        x = layer_norm(x, self.merger.norm).reshape(-1, self.merger.linear_fc1.in_features)
        return self.merger.linear_fc2(F.gelu(self.merger.linear_fc1(x)))
