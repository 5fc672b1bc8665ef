"""The Gated DeltaNet cores of the torch backend on CUDA, as PyTorch custom ops so that
`torch.compile` keeps a pass in one graph: fla-core's kernels for passes that carry their state
on, and our own recurrent kernel for option rows, which read their question's state in place.

Follows the gated delta rule of model.md §3 (S ← e^g S; v' = β(v − Sᵀk); S ← S + k v'ᵀ;
o = Sᵀq, q and k l2-normalised with eps 1e-6 and q scaled), fla-core's fused recurrent form.
"""

from __future__ import annotations

import torch

from runtime.model.gdn import L2_EPS  # fla's use_qk_l2norm_in_kernel and the eager l2norm
from runtime.model.layers import per_row

try:  # with CUDA builds of torch, and the dev extra (the tests' interpreter); else eager only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

# value columns per program of the option-row kernel and its warps: a [128, 16] float32 tile of
# the state in one warp, whose sums over the key dimension stay within the warp. The fastest of
# six tiles on the H200 for every option-pass shape (64 × 8 from 16 sources: 0.118 ms against
# 0.202 at 32 × 4; docs/measurements/h200-2026-12-01c). Fixed, not autotuned, so that every
# process sums in the same order (an autotuner may pick differently after a restart)
ROWS_BLOCK_V = 16
ROWS_WARPS = 1
# the option-row kernel loads a token's inputs while the token before it computes: a program
# is one warp walking its row's tokens one after another, so each step otherwise waited for its
# loads before any arithmetic. Same arithmetic, so the same bytes; on the H200 (4b shapes)
# rows of 24 tokens 11-23 % faster (4 × 24: 0.026 → 0.020 ms), 8-token rows unchanged
# (256 × 8: 0.264 → 0.268 ms; docs/measurements/h200-2026-12-03)
ROWS_PREFETCH = True
# passes of at most this many tokens that carry their state on (question rows) run our kernel
# (`rows_gated_delta`: the sources' states read in place, the final state written); longer
# ones (image prefixes, 64 tokens and up) fla's chunked kernel, which took 7 kernels a layer in
# a one-question pass. Timed on the H200 (4b shapes, BF16, CUDA-graph replays, ms; ours / fla
# chunked / fla recurrent): 1 × 16 0.013 / 0.026 / 0.020, 16 × 16 0.057 / 0.130 / 0.102,
# 8 × 32 0.055 / 0.080 / 0.106, 1 × 64 0.043 / 0.038 / 0.072 (docs/measurements/h200-2026-12-03b)
ROWS_MAX_TOKENS = 32


@torch.library.custom_op("omnijev::fla_gated_delta", mutates_args=())
def fla_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core's gated delta rule carrying the state on: q, k [B, T, H, dk] and v [B, T, HV, dv]
    in the model's dtype, normalised in the kernel; g, beta float32 [B, T, HV]; state float32
    [B, HV, dk, dv]. Float32 passes take the recurrent kernel, whose arithmetic is float32
    throughout (the chunked one's Triton dots would round float32 operands to TF32)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    exact = q.dtype == torch.float32
    kernel = fused_recurrent_gated_delta_rule if exact else chunk_gated_delta_rule
    out, final = kernel(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g=g.contiguous(),
        beta=beta.contiguous(),
        scale=scale,
        initial_state=state.contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    # fla's chunked kernel returns a transposed view; the op's outputs are contiguous, as faked
    return out.to(v.dtype).contiguous(), final.float().contiguous()


@fla_gated_delta.register_fake
def _(q, k, v, g, beta, state, scale):
    b, _, heads, dv = v.shape
    final = state.new_empty(b, heads, q.shape[3], dv, dtype=torch.float32)
    return v.new_empty(v.shape), final


if triton is not None:

    @triton.jit
    def _rows_kernel(
        q,
        k,
        v,
        g,
        beta,
        states,
        src,
        lengths,
        out,
        final,
        scale,
        T,
        H: tl.constexpr,
        HV: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BV: tl.constexpr,
        EPS: tl.constexpr,
        PREFETCH: tl.constexpr,
        STATE: tl.constexpr,
    ):
        """One program: one row, one value head, BV value columns, the row's valid tokens in
        order, zeros for its padding (whose outputs no valid token reads). With PREFETCH the
        next token's inputs are loaded before this token's arithmetic, which is unchanged; with
        STATE the tile's final state is written."""
        i_v = tl.program_id(0)
        i_nh = tl.program_id(1).to(tl.int64)
        i_n = i_nh // HV
        i_hv = i_nh % HV
        i_h = i_hv // (HV // H)
        source = tl.load(src + i_n).to(tl.int64)
        o_k = tl.arange(0, K)
        o_v = i_v * BV + tl.arange(0, BV)
        tile = states + (source * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        h = tl.load(tile).to(tl.float32)
        valid = tl.load(lengths + i_n).to(tl.int32)
        token = i_n * T
        last = token + T - 1  # the row's last slot: a load ahead never leaves the row
        # the first token's inputs (a row with none reads a padding slot, unused); each step
        # then loads the next token's while the current one's arithmetic runs
        n_q = tl.load(q + (token * H + i_h) * K + o_k)
        n_k = tl.load(k + (token * H + i_h) * K + o_k)
        n_v = tl.load(v + (token * HV + i_hv) * V + o_v)
        n_g = tl.load(g + token * HV + i_hv)
        n_beta = tl.load(beta + token * HV + i_hv)
        t = 0
        while t < valid:
            if PREFETCH:
                b_q, b_k, b_v = n_q.to(tl.float32), n_k.to(tl.float32), n_v.to(tl.float32)
                b_g, b_beta = n_g.to(tl.float32), n_beta.to(tl.float32)
                after = tl.minimum(token + 1, last)
                n_q = tl.load(q + (after * H + i_h) * K + o_k)
                n_k = tl.load(k + (after * H + i_h) * K + o_k)
                n_v = tl.load(v + (after * HV + i_hv) * V + o_v)
                n_g = tl.load(g + after * HV + i_hv)
                n_beta = tl.load(beta + after * HV + i_hv)
            else:
                b_q = tl.load(q + (token * H + i_h) * K + o_k).to(tl.float32)
                b_k = tl.load(k + (token * H + i_h) * K + o_k).to(tl.float32)
                b_v = tl.load(v + (token * HV + i_hv) * V + o_v).to(tl.float32)
                b_g = tl.load(g + token * HV + i_hv).to(tl.float32)
                b_beta = tl.load(beta + token * HV + i_hv).to(tl.float32)
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + EPS) * scale
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + EPS)
            h = h * tl.exp(b_g)
            b_v = b_beta * (b_v - tl.sum(h * b_k[:, None], 0))
            h = h + b_k[:, None] * b_v[None, :]
            b_o = tl.sum(h * b_q[:, None], 0)
            tl.store(out + (token * HV + i_hv) * V + o_v, b_o.to(out.dtype.element_ty))
            token += 1
            t += 1
        while t < T:
            tl.store(out + (token * HV + i_hv) * V + o_v, tl.zeros([BV], out.dtype.element_ty))
            token += 1
            t += 1
        if STATE:
            kept = final + (i_n * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
            tl.store(kept, h)


@torch.library.custom_op("omnijev::option_rows_gated_delta", mutates_args=())
def option_rows_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    src: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Option rows as leaves: row n continues `states[src[n]]` (float32 [S, HV, dk, dv], read
    in place, never gathered per row) and returns only its outputs [B, T, HV, dv] in v's dtype.
    q, k [B, T, H, dk] and v [B, T, HV, dv] in any layout (made contiguous); g, beta float32
    [B, T, HV]. The kernel walks each row's first
    `lengths[n]` tokens and writes zeros after them: a padded token (g = β = 0) leaves the
    state as it is and no valid token reads its output (h200-2026-12-02h: 1,675 of the
    255-option pass's 2,048 tokens)."""
    return option_rows(q, k, v, g, beta, states, src, lengths, scale)


@option_rows_gated_delta.register_fake
def _(q, k, v, g, beta, states, src, lengths, scale):
    return v.new_empty(v.shape)


@torch.library.custom_op("omnijev::rows_gated_delta", mutates_args=())
def rows_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    src: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that carry their state on: row n continues `states[src[n]]` and returns its
    outputs and its final state [B, HV, dk, dv] (float32). Passes of at most ROWS_MAX_TOKENS
    tokens run our kernel (the sources' states read in place); longer ones (image prefixes)
    fla's on the gathered states (`fla_gated_delta`). Shapes as `option_rows_gated_delta`; the
    choice is made here, out of the compiler's sight, so that it adds no guard on the length."""
    if q.shape[1] <= ROWS_MAX_TOKENS:
        return option_rows(q, k, v, g, beta, states, src, lengths, scale, state=True)
    # one source (an image prefix's empty state): a view, where a gather was a kernel a layer
    return fla_gated_delta(q, k, v, g, beta, per_row(states, src, q.shape[0]), scale)


@rows_gated_delta.register_fake
def _(q, k, v, g, beta, states, src, lengths, scale):
    b, _, heads, dv = v.shape
    final = states.new_empty(b, heads, q.shape[3], dv, dtype=torch.float32)
    return v.new_empty(v.shape), final


def option_rows(
    q,
    k,
    v,
    g,
    beta,
    states,
    src,
    lengths,
    scale,
    block_v=ROWS_BLOCK_V,
    warps=ROWS_WARPS,
    prefetch=ROWS_PREFETCH,
    state=False,
):
    """The rows kernel at a given tile (value columns per program, warps), with or without its
    loads a token ahead, and with (`state`: returns (out, final)) or without the final state:
    the custom ops run the fixed ROWS_BLOCK_V × ROWS_WARPS with ROWS_PREFETCH;
    scripts/gpu_torch.py times the others."""
    if triton is None:
        raise RuntimeError("the rows kernel needs triton")
    b, t, heads, dk = q.shape
    value_heads, dv = v.shape[2], v.shape[3]
    if dv % block_v or dk & (dk - 1) or value_heads % heads:
        raise ValueError(f"rows kernel: dk {dk}, dv {dv}, heads {heads}/{value_heads}")
    out = v.new_empty(b, t, value_heads, dv)
    final = states.new_empty(b, value_heads, dk, dv, dtype=torch.float32) if state else out
    grid = (dv // block_v, b * value_heads)
    _rows_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        states.contiguous(),
        src.contiguous(),
        lengths.contiguous(),
        out,
        final,
        scale,
        t,
        H=heads,
        HV=value_heads,
        K=dk,
        V=dv,
        BV=block_v,
        EPS=L2_EPS,
        PREFETCH=prefetch,
        STATE=state,
        num_warps=warps,
    )
    return (out, final) if state else out
