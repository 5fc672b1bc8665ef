"""Pieces the vision tower and the language model share: norms, the MLP, the half rotation.

Follows transformers 5.17 `Qwen3_5RMSNorm`, `Qwen3_5RMSNormGated` and `Qwen3_5MLP` (model.md §2-§6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LAYER_NORM_EPS = 1e-6  # every vision LayerNorm (model.md §6.2)
MASKED = torch.finfo(torch.float32).min  # finite, so a row whose keys are all masked stays finite


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
