"""Pieces the vision tower and the language model share: norms, the MLP, the half rotation.

Follows transformers 5.17 `Qwen3_5RMSNorm`, `Qwen3_5RMSNormGated` and `Qwen3_5MLP` (docs/model.md
§2-§6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LAYER_NORM_EPS = 1e-6  # every vision LayerNorm (docs/model.md §6.2)
MASKED = torch.finfo(torch.float32).min  # finite, so a row whose keys are all masked stays finite


def fuse_linears(module: nn.Module, name: str, *linears: nn.Linear) -> None:
    """One weight for Linears that read the same input, as the non-persistent buffer `name` of
    `module`; each Linear's weight becomes a view of it, so the weights stay one copy. One
    product in place of several: fewer, wider kernels (the torch backend only; the export keeps
    the checkpoint's Linears)."""
    weight = torch.cat([linear.weight.data for linear in linears])
    at = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = weight[at : at + rows]
        at += rows
    setattr(module, name, weight)


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T`."""
    return F.linear(x, weight)


def projections(x: torch.Tensor, weight: torch.Tensor | None, *linears: nn.Linear) -> list:
    """The outputs of `linears`, in order: views of one product where `fuse_linears` made their
    fused `weight`, else each Linear's own."""
    if weight is None:
        return [linear(x) for linear in linears]
    sizes = [linear.out_features for linear in linears]
    return list(product(x, weight).split(sizes, dim=-1))


def per_row(per_source: torch.Tensor, src: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's copy of its source's tensor: a broadcast view when there is one source (every
    row continues the same state), a gather otherwise."""
    if per_source.shape[0] == 1:
        return per_source.expand(rows, *per_source.shape[1:])
    return per_source[src]


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
        self.register_buffer("gate_up", None, persistent=False)  # fuse(): gate and up as one

    def fuse(self) -> None:
        fuse_linears(self, "gate_up", self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = projections(x, self.gate_up, self.gate_proj, self.up_proj)
        return product(F.silu(gate) * up, self.down_proj.weight)
