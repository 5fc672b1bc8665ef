"""The Gated DeltaNet kernels of the torch backend on CUDA, as PyTorch custom ops so that
`torch.compile` keeps a pass in one graph: fla-core's kernels for long passes that carry their
state on, our own recurrent kernel for short ones, and the short conv before the core.

Follows the gated delta rule of docs/model.md §3 (S ← e^g S; v' = β(v − Sᵀk); S ← S + k v'ᵀ;
o = Sᵀq, q and k l2-normalised with eps 1e-6 and q scaled) in fla-core's fused recurrent form.
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

# value columns per program of the rows kernel and its warps: a [128, 16] float32 tile of the
# state in one warp, whose sums over the key dimension stay within the warp; the fastest tile on
# the H200 for every option-pass shape. Fixed, not autotuned, so that every process sums in the
# same order (an autotuner may pick differently after a restart). The kernel loads a token's
# inputs while the token before it computes (the same arithmetic, so the same bytes)
ROWS_BLOCK_V = 16
ROWS_WARPS = 1
# passes of at most this many tokens that carry their state on (question rows) run our kernel
# (`rows_gated_delta`: the sources' states read in place, the final state written); longer
# ones (image prefixes, 64 tokens and up) fla's chunked kernel, which is faster from 64 tokens
# on and took 7 kernels a layer below
ROWS_MAX_TOKENS = 32
# The short causal conv before the core is one kernel a layer (`short_conv`), where Inductor
# made two; it reads its input, a column slice of the fused input projection, in place through
# its strides, and writes no conv state for option rows (a leaf's state is never read)
CONV_TOKENS = 8  # token slots a program
CONV_CHANNELS = 256  # channels a program


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
    def delta_step(h, b_q, b_k, b_v, b_g, b_beta, scale, EPS: tl.constexpr):
        """One token of the gated delta rule on a float32 state tile h [K, BV]: (the state
        after it, the token's output [BV]). q and k are normalised here. Both sums over the key
        dimension read the state the token starts from, so they run side by side and the next
        token waits on one sum, not two: h·k and h·q scaled by the decay, the output h·q plus
        (k·q) times the token's update."""
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + EPS) * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + EPS)
        decay = tl.exp(b_g)
        h_k = tl.sum(h * b_k[:, None], 0) * decay
        h_q = tl.sum(h * b_q[:, None], 0) * decay
        b_v = b_beta * (b_v - h_k)
        h = h * decay + b_k[:, None] * b_v[None, :]
        return h, h_q + tl.sum(b_k * b_q) * b_v

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
    ):
        """One program: one row, one value head, BV value columns, the row's valid tokens in
        order, zeros for its padding (whose outputs no valid token reads), then the tile's final
        state. The next token's inputs are loaded before this token's arithmetic."""
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
            b_q, b_k, b_v = n_q.to(tl.float32), n_k.to(tl.float32), n_v.to(tl.float32)
            b_g, b_beta = n_g.to(tl.float32), n_beta.to(tl.float32)
            after = tl.minimum(token + 1, last)
            n_q = tl.load(q + (after * H + i_h) * K + o_k)
            n_k = tl.load(k + (after * H + i_h) * K + o_k)
            n_v = tl.load(v + (after * HV + i_hv) * V + o_v)
            n_g = tl.load(g + after * HV + i_hv)
            n_beta = tl.load(beta + after * HV + i_hv)
            h, b_o = delta_step(h, b_q, b_k, b_v, b_g, b_beta, scale, EPS)
            tl.store(out + (token * HV + i_hv) * V + o_v, b_o.to(out.dtype.element_ty))
            token += 1
            t += 1
        while t < T:
            tl.store(out + (token * HV + i_hv) * V + o_v, tl.zeros([BV], out.dtype.element_ty))
            token += 1
            t += 1
        kept = final + (i_n * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(kept, h)

    @triton.jit
    def _short_conv_kernel(
        raw,
        past,
        weight,
        lengths,
        out,
        state,
        T,
        C,
        row_stride,
        token_stride,
        KEEP: tl.constexpr,
        KP: tl.constexpr,
        TAPS: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        STATE: tl.constexpr,
    ):
        """One program: BT token slots of one row, BC channels. A slot's taps read the row's
        joined inputs (KEEP past columns, then its own T; raw's channels contiguous, its rows
        and tokens at the given strides), the sum in float32 in the taps' order, rounded to the
        inputs' dtype, then SiLU; with STATE the first program of a row also writes the KEEP
        joined inputs from the row's length on (its conv state; KP: KEEP's power of two)."""
        i_t = tl.program_id(0)
        i_c = tl.program_id(1)
        i_b = tl.program_id(2).to(tl.int64)
        o_t = i_t * BT + tl.arange(0, BT)
        o_c = i_c * BC + tl.arange(0, BC)
        channel = o_c < C
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(TAPS):
            w = tl.load(weight + j * C + o_c, mask=channel, other=0.0)
            acc += (
                joined(raw, past, i_b, o_t + j, o_c, channel, T, C, row_stride, token_stride, KEEP)
                * w[None, :]
            )
        x = acc.to(out.dtype.element_ty).to(tl.float32)
        y = x / (1.0 + tl.exp(-x))
        at = (i_b * T + o_t)[:, None] * C + o_c[None, :]
        tl.store(out + at, y.to(out.dtype.element_ty), mask=(o_t < T)[:, None] & channel[None, :])
        if STATE:
            if i_t == 0:
                length = tl.load(lengths + i_b)
                o_j = tl.arange(0, KP)
                kept = joined(
                    raw, past, i_b, length + o_j, o_c, channel, T, C, row_stride, token_stride, KEEP
                )
                kept_at = (i_b * C + o_c)[None, :] * KEEP + o_j[:, None]
                kept = kept.to(state.dtype.element_ty)
                tl.store(state + kept_at, kept, mask=(o_j < KEEP)[:, None] & channel[None, :])

    @triton.jit
    def joined(
        raw, past, i_b, column, o_c, channel, T, C, row_stride, token_stride, KEEP: tl.constexpr
    ):
        """Columns [N] of a row's joined inputs (KEEP past columns, then T own) at channels
        o_c, as float32; zeros past the end."""
        mine = (column >= KEEP) & (column < KEEP + T)
        before = column < KEEP
        own = tl.load(
            raw + i_b * row_stride + (column - KEEP)[:, None] * token_stride + o_c[None, :],
            mask=mine[:, None] & channel[None, :],
            other=0.0,
        )
        old = tl.load(
            past + (i_b * C + o_c)[None, :] * KEEP + column[:, None],
            mask=before[:, None] & channel[None, :],
            other=0.0,
        )
        return tl.where(before[:, None], old.to(tl.float32), own.to(tl.float32))


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
    """Rows that carry their state on: row n continues `states[src[n]]` (float32 [S, HV, dk,
    dv]) and returns its outputs [B, T, HV, dv] in v's dtype and its final state [B, HV, dk, dv]
    (float32). q, k [B, T, H, dk] and v [B, T, HV, dv] in any layout (made contiguous); g, beta
    float32 [B, T, HV]. Passes of at most ROWS_MAX_TOKENS tokens run our kernel (the sources'
    states read in place, never gathered per row; a row's first `lengths[n]` tokens walked, zeros
    written after them: a padded token, g = β = 0, leaves the state as it is and no valid token
    reads its output); longer ones (image prefixes) fla's on the gathered states
    (`fla_gated_delta`). The choice is made here, out of the compiler's sight, so that it adds no
    guard on the length."""
    if q.shape[1] <= ROWS_MAX_TOKENS:
        return option_rows(q, k, v, g, beta, states, src, lengths, scale)
    # one source (an image prefix's empty state): a view, where a gather was a kernel a layer
    return fla_gated_delta(q, k, v, g, beta, per_row(states, src, q.shape[0]), scale)


@rows_gated_delta.register_fake
def _(q, k, v, g, beta, states, src, lengths, scale):
    b, _, heads, dv = v.shape
    final = states.new_empty(b, heads, q.shape[3], dv, dtype=torch.float32)
    return v.new_empty(v.shape), final


def option_rows(q, k, v, g, beta, states, src, lengths, scale):
    """The rows kernel: (out, final state), shapes as `rows_gated_delta`."""
    if triton is None:
        raise RuntimeError("the rows kernel needs triton")
    b, t, heads, dk = q.shape
    value_heads, dv = v.shape[2], v.shape[3]
    if dv % ROWS_BLOCK_V or dk & (dk - 1) or value_heads % heads:
        raise ValueError(f"rows kernel: dk {dk}, dv {dv}, heads {heads}/{value_heads}")
    out = v.new_empty(b, t, value_heads, dv)
    final = states.new_empty(b, value_heads, dk, dv, dtype=torch.float32)
    grid = (dv // ROWS_BLOCK_V, b * value_heads)
    _rows_kernel[grid](
        *contiguous(q, k, v, g, beta, states, src, lengths),
        out,
        final,
        scale,
        t,
        H=heads,
        HV=value_heads,
        K=dk,
        V=dv,
        BV=ROWS_BLOCK_V,
        EPS=L2_EPS,
        num_warps=ROWS_WARPS,
    )
    return out, final


def contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels' tensor arguments, each contiguous (a copy only where one is not)."""
    return [t.contiguous() for t in tensors]


@torch.library.custom_op("omnijev::short_conv", mutates_args=())
def short_conv(
    raw: torch.Tensor,
    past: torch.Tensor,
    weight: torch.Tensor,
    lengths: torch.Tensor,
    want_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gated DeltaNet's causal depthwise conv and SiLU: raw [B, T, C] (half precision),
    the past [B, C, K-1] in raw's dtype, weight float32 [K, C], lengths [B]. Returns
    SiLU(conv) [B, T, C] in raw's dtype and the conv state [B, C, K-1]: the joined inputs'
    K-1 columns from each row's length on (runtime.model.language's `conv`, one kernel).
    raw is read through its strides (channels contiguous: a copy only where they are not), and
    without `want_state` the state is [0, C, K-1], not written."""
    if triton is None:
        raise RuntimeError("the conv kernel needs triton")
    b, t, c = raw.shape
    taps = weight.shape[0]
    raw = raw if raw.stride(2) == 1 else raw.contiguous()
    state_rows = conv_state_rows(b, want_state)
    out = raw.new_empty(b, t, c)
    state = raw.new_empty(state_rows, c, taps - 1)
    grid = (triton.cdiv(t, CONV_TOKENS), triton.cdiv(c, CONV_CHANNELS), b)
    _short_conv_kernel[grid](
        raw,
        past.contiguous(),
        weight.contiguous(),
        lengths.contiguous(),
        out,
        state,
        t,
        c,
        raw.stride(0),
        raw.stride(1),
        KEEP=taps - 1,
        KP=triton.next_power_of_2(taps - 1),
        TAPS=taps,
        BT=CONV_TOKENS,
        BC=CONV_CHANNELS,
        STATE=state_rows > 0,
    )
    return out, state


@short_conv.register_fake
def _(raw, past, weight, lengths, want_state=True):
    b, t, c = raw.shape
    state = raw.new_empty(conv_state_rows(b, want_state), c, weight.shape[0] - 1)
    return raw.new_empty(b, t, c), state


def conv_state_rows(rows: int, want_state: bool) -> int:
    """Rows of the conv state `short_conv` returns: none where it is not wanted."""
    return rows if want_state else 0
