"""The log-probability readout (docs/contract.md §5): one `omnijev::TokenLogProbs` node for
TensorRT, its standard-op expansion for ONNX Runtime, and a numpy reference of the arithmetic.

log p(token) = logit[token] − max − log Σ exp(logit − max), logits = hidden × embeddingᵀ in the
model's dtype, upcast to float32, the sum of exponentials in float64, the result float32.
"""

from __future__ import annotations

import numpy as np
import torch

DOMAIN = "omnijev"
OP_TYPE = "TokenLogProbs"
OP_VERSION = 1
CHUNK = 8192  # vocabulary rows per plugin step (a tiling hint; the result does not depend on it)
GEMM_OPSET = 18  # the graphs' default-domain opset (build_engines/onnx_export.py)


def logits(hidden_rows: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """hidden_rows × embeddingᵀ; in export one `Gemm(transB=1)` on the tied table itself, so the
    graph neither transposes [V, D] at run time nor folds a transposed copy into the file."""
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            "::Gemm", [hidden_rows, embedding], {"transB": 1}, dtype=hidden_rows.dtype,
            shape=[hidden_rows.shape[0], embedding.shape[0]], version=GEMM_OPSET,
        )  # fmt: skip
    return hidden_rows @ embedding.transpose(0, 1)


def token_logprobs_std(
    hidden_rows: torch.Tensor, embedding: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """Standard ops: hidden_rows [M, D], embedding [V, D], tokens [M] → float32 [M]."""
    scores = logits(hidden_rows, embedding).float()
    # the row maximum through TopK(1): ONNX Runtime's CUDA ReduceMax over 248,079 columns takes
    # cuDNN's generic reduce (H200, [1024, 248079]: ReduceMax 24.8 ms, TopK 0.8 ms); same value
    shifted = scores - scores.topk(1, dim=-1).values
    total = shifted.exp().double().sum(dim=-1)
    picked = shifted.gather(1, tokens[:, None])[:, 0]
    return (picked.double() - total.log()).float()


def token_logprobs_node(
    hidden_rows: torch.Tensor, embedding: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """One custom node for the TensorRT plugin; `plugin_namespace` for parsers before 10.10."""
    return torch.onnx.ops.symbolic(
        f"{DOMAIN}::{OP_TYPE}",
        [hidden_rows, embedding, tokens],
        {"chunk": CHUNK, "plugin_namespace": DOMAIN, "plugin_version": str(OP_VERSION)},
        dtype=torch.float32,
        shape=[tokens.shape[0]],
        version=OP_VERSION,
    )


def token_logprobs(
    hidden_rows: torch.Tensor, embedding: torch.Tensor, tokens: torch.Tensor, plugin: bool = False
) -> torch.Tensor:
    """The readout: the custom node while exporting the plugin variant, standard ops otherwise."""
    if plugin and torch.onnx.is_in_onnx_export():
        return token_logprobs_node(hidden_rows, embedding, tokens)
    return token_logprobs_std(hidden_rows, embedding, tokens)


def token_logprobs_reference(
    hidden: np.ndarray, embedding: np.ndarray, tokens: np.ndarray
) -> np.ndarray:
    """CPU check of the arithmetic: float32 logits, float64 sum of exponentials, float32 out."""
    logits = np.asarray(hidden, np.float32) @ np.asarray(embedding, np.float32).T
    shifted = logits - logits.max(axis=-1, keepdims=True)
    total = np.exp(shifted).astype(np.float64).sum(axis=-1)
    picked = np.take_along_axis(shifted, np.asarray(tokens, np.int64)[:, None], axis=1)[:, 0]
    return (picked.astype(np.float64) - np.log(total)).astype(np.float32)
