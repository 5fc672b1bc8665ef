"""The Gated DeltaNet cores of the torch backend on CUDA, as PyTorch custom ops so that
`torch.compile` keeps a pass in one graph: fla-core's kernels for passes that carry their state
on, and our own recurrent kernel for option rows, which read their question's state in place.

Follows the gated delta rule of model.md §3 (S ← e^g S; v' = β(v − Sᵀk); S ← S + k v'ᵀ;
o = Sᵀq, q and k l2-normalised with eps 1e-6 and q scaled), fla-core's fused recurrent form.
"""

from __future__ import annotations

import logging

import torch

from runtime.model.gdn import L2_EPS  # fla's use_qk_l2norm_in_kernel and the eager l2norm

try:  # Triton exists only beside a CUDA build of torch; the CPU runs the eager cores instead
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

log = logging.getLogger("omnijev.torch")

# value columns per program of the option-row kernel and its warps: a [128, 16] float32 tile of
# the state in one warp, whose sums over the key dimension stay within the warp. The fastest of
# six tiles on the H200 for every option-pass shape (64 × 8 from 16 sources: 0.118 ms against
# 0.202 at 32 × 4; docs/measurements/h200-2026-12-01c). Fixed, not autotuned, so that every
# process sums in the same order (an autotuner may pick differently after a restart)
ROWS_BLOCK_V = 16
ROWS_WARPS = 1
# fla: passes of at most this many tokens run the fused recurrent kernel, longer ones the chunked
# one. Measured as CUDA-graph replays on the H200 (4b shapes, BF16; scripts/gpu_torch.py
# crossover, docs/measurements/h200-2026-12-01): recurrent faster only for 64 rows × 8 tokens
# (0.20 against 0.27 ms); chunked faster from 16 tokens up (16 × 16: 0.08 against 0.10 ms,
# 1 × 640: 0.08 against 0.70 ms)
FLA_RECURRENT_MAX_TOKENS = 8
# Option rows of at most this many tokens (their pass's bucket) run the chunked option kernel:
# the shared initial states enter through matrix products over CHUNK_TOKENS token rows of
# several option rows at once, each source's state tile read once per program, where the
# recurrent kernel re-reads a 2 MB state per row and walks its tokens one by one (24 of its
# calls were 10.3 ms of the 255-option pass's 52.9 ms on the H200, h200-2026-12-02h). Longer
# rows would need [T, T] tiles past the registers: they keep the recurrent kernel
CHUNK_MAX_TOKENS = 32
CHUNK_TOKENS = 64  # token rows of a program: 8 option rows of 8 tokens, 4 of 16, 2 of 32
CHUNK_BLOCK_V = 32  # value columns per program
CHUNK_WARPS = 4
# the products' arithmetic: float32 operands in three TF32 products (a float32 rounding, on the
# tensor cores) for the half-precision engines; plain float32 for the float32 engine, whose
# parity with the float32 reference allows no TF32 (see fla_gated_delta)
CHUNK_PRECISION = {torch.float32: "ieee"}
CHUNK_HALF_PRECISION = "tf32x3"


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

    short = q.shape[1] <= FLA_RECURRENT_MAX_TOKENS or q.dtype == torch.float32
    kernel = fused_recurrent_gated_delta_rule if short else chunk_gated_delta_rule
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
    def _option_rows_kernel(
        q,
        k,
        v,
        g,
        beta,
        states,
        src,
        out,
        scale,
        T,
        H: tl.constexpr,
        HV: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BV: tl.constexpr,
        EPS: tl.constexpr,
    ):
        """One program: one row, one value head, BV value columns, the row's T tokens in order."""
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
        for t in range(0, T):
            token = i_n * T + t
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

    @triton.jit
    def _option_chunks_kernel(
        q,
        k,
        v,
        g,
        beta,
        states,
        src,
        out,
        scale,
        B,
        T: tl.constexpr,
        TP: tl.constexpr,
        R: tl.constexpr,
        H: tl.constexpr,
        HV: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BV: tl.constexpr,
        EPS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program: R rows of T tokens (TP, T's power of two, slots each), one value head,
        BV value columns. Per row, from its source state S0 and the cumulative gates G:
        u = (I + L)⁻¹ β(v − e^G K S0), L[t,s] = β_t e^(G_t−G_s) k_t·k_s (s < t), by forward
        substitution; o = e^G Q S0 + (e^(G_t−G_s) q_t·k_s)_(s≤t) u. Every product keeps a row's
        values to itself, so a row's bytes do not follow the other rows of its program."""
        i_v = tl.program_id(0)
        i_hv = tl.program_id(1).to(tl.int64)
        i_b = tl.program_id(2).to(tl.int64)
        i_h = i_hv // (HV // H)
        flat = tl.arange(0, R * TP)
        row = i_b * R + flat // TP
        step = flat % TP
        live = (row < B) & (step < T)
        token = row * T + step
        o_k = tl.arange(0, K)
        o_v = i_v * BV + tl.arange(0, BV)
        at_qk = (token * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + at_qk, mask=live[:, None], other=0.0).to(tl.float32)
        b_k = tl.load(k + at_qk, mask=live[:, None], other=0.0).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + EPS)[:, None] * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + EPS)[:, None]
        at_v = (token * HV + i_hv)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + at_v, mask=live[:, None], other=0.0).to(tl.float32)
        b_g = tl.load(g + token * HV + i_hv, mask=live, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + token * HV + i_hv, mask=live, other=0.0).to(tl.float32)
        same_row = (flat[:, None] // TP) == (flat[None, :] // TP)
        upto = same_row & (step[None, :] <= step[:, None])  # s ≤ t within a row
        before = same_row & (step[None, :] < step[:, None])
        cum = tl.sum(tl.where(upto, b_g[None, :], 0.0), 1)
        decay = tl.where(upto, tl.exp(tl.where(upto, cum[:, None] - cum[None, :], 0.0)), 0.0)
        kk = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
        lower = tl.where(before, kk * decay, 0.0) * b_beta[:, None]
        inside = tl.where(upto, tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * decay, 0.0)
        sources = tl.load(src + row, mask=row < B, other=0).to(tl.int64)
        first = tl.min(tl.where(row < B, sources, 1 << 40))
        last = tl.max(tl.where(row < B, sources, -1))
        ks = tl.zeros([R * TP, BV], dtype=tl.float32)
        qs = tl.zeros([R * TP, BV], dtype=tl.float32)
        source = first
        while source <= last:  # each source of the program's rows (one, in a wide pass)
            tile = states + (source * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
            b_s = tl.load(tile).to(tl.float32)
            mine = (sources == source)[:, None]
            ks = tl.where(mine, tl.dot(b_k, b_s, input_precision=PRECISION), ks)
            qs = tl.where(mine, tl.dot(b_q, b_s, input_precision=PRECISION), qs)
            source += 1
        gamma = tl.exp(cum)[:, None]
        rhs = b_beta[:, None] * (b_v - gamma * ks)
        u = tl.where((step == 0)[:, None], rhs, 0.0)
        for t in tl.static_range(1, TP):
            solved = rhs - tl.dot(lower, u, input_precision=PRECISION)
            u = tl.where((step == t)[:, None], solved, u)
        b_o = gamma * qs + tl.dot(inside, u, input_precision=PRECISION)
        tl.store(out + at_v, b_o.to(out.dtype.element_ty), mask=live[:, None])


@torch.library.custom_op("omnijev::option_rows_gated_delta", mutates_args=())
def option_rows_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    src: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Option rows as leaves: row n continues `states[src[n]]` (float32 [S, HV, dk, dv], read
    in place, never gathered per row) and returns only its outputs [B, T, HV, dv] in v's dtype.
    Shapes as `fla_gated_delta`; padded tokens have g = β = 0, which leave the state as it is.
    Rows of at most CHUNK_MAX_TOKENS tokens take the chunked kernel, longer ones the recurrent."""
    if q.shape[1] <= CHUNK_MAX_TOKENS and not CHUNKS_REFUSED:
        try:
            return option_chunks(q, k, v, g, beta, states, src, scale)
        except Exception as error:  # a Triton that cannot build it: the recurrent kernel
            CHUNKS_REFUSED.append(repr(error))
            log.warning("chunked option-row kernel refused, recurrent from now: %r", error)
    return option_rows(q, k, v, g, beta, states, src, scale)


CHUNKS_REFUSED: list[str] = []  # why the chunked kernel failed in this process, if it did


def option_chunks(
    q, k, v, g, beta, states, src, scale, block_v=CHUNK_BLOCK_V, warps=CHUNK_WARPS
) -> torch.Tensor:
    """The chunked option-row kernel at a given tile (value columns per program, warps)."""
    if triton is None:
        raise RuntimeError("the option rows kernel needs triton")
    b, t, heads, dk = q.shape
    value_heads, dv = v.shape[2], v.shape[3]
    if dv % block_v or dk & (dk - 1) or value_heads % heads or t > CHUNK_MAX_TOKENS:
        raise ValueError(f"option chunks kernel: dk {dk}, dv {dv}, heads {heads}/{value_heads}")
    slots = triton.next_power_of_2(t)
    rows = max(1, CHUNK_TOKENS // slots)
    out = v.new_empty(v.shape)
    grid = (dv // block_v, value_heads, triton.cdiv(b, rows))
    _option_chunks_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        states.contiguous(),
        src.contiguous(),
        out,
        scale,
        b,
        T=t,
        TP=slots,
        R=rows,
        H=heads,
        HV=value_heads,
        K=dk,
        V=dv,
        BV=block_v,
        EPS=L2_EPS,
        PRECISION=CHUNK_PRECISION.get(q.dtype, CHUNK_HALF_PRECISION),
        num_warps=warps,
    )
    return out


def option_rows(q, k, v, g, beta, states, src, scale, block_v=ROWS_BLOCK_V, warps=ROWS_WARPS):
    """The option-row kernel at a given tile (value columns per program, warps): the custom op
    runs the fixed ROWS_BLOCK_V × ROWS_WARPS; scripts/gpu_torch.py times the others."""
    if triton is None:
        raise RuntimeError("the option rows kernel needs triton")
    b, t, heads, dk = q.shape
    value_heads, dv = v.shape[2], v.shape[3]
    if dv % block_v or dk & (dk - 1) or value_heads % heads:
        raise ValueError(f"option rows kernel: dk {dk}, dv {dv}, heads {heads}/{value_heads}")
    out = v.new_empty(v.shape)
    grid = (dv // block_v, b * value_heads)
    _option_rows_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        states.contiguous(),
        src.contiguous(),
        out,
        scale,
        t,
        H=heads,
        HV=value_heads,
        K=dk,
        V=dv,
        BV=block_v,
        EPS=L2_EPS,
        num_warps=warps,
    )
    return out


@option_rows_gated_delta.register_fake
def _(q, k, v, g, beta, states, src, scale):
    return v.new_empty(v.shape)
