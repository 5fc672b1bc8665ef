"""Gated DeltaNet cores: the chunked gated delta rule in its eager, standard-op and ONNX Runtime
forms, chosen by name (`CORES`); the CUDA kernels of the torch backend are in `gdn_kernels`.

Follows transformers 5.17 `torch_chunk_gated_delta_rule` (docs/model.md §3): chunks of 64, q and k
normalised and q scaled before the core, float32 throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GDN_CHUNK = 64  # torch_chunk_gated_delta_rule's chunk (docs/model.md §3)
STD_MAX_TOKENS = GDN_CHUNK  # the standard-op GDN graph is one chunk: passes of at most 64 tokens
L2_EPS = 1e-6  # l2norm inside the kernel (use_qk_l2norm_in_kernel, docs/model.md §3)


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


# name -> core(q, k, v, g, beta, state) -> (out, state); "eager" runs outside export, the others
# are what an ONNX export writes (GDN_VARIANTS)
CORES = {"eager": gated_delta_eager, "std": gated_delta_std, "ort": gated_delta_ort}
GDN_VARIANTS = ("ort", "std")
