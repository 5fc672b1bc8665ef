"""The torch backend's own Gated DeltaNet kernels for short rows (runtime.model.gdn_kernels)
against the eager chunked core on per-row gathered states; run by Triton's interpreter on the
CPU (Triton is a dev dependency; on the GPU `python -m bench.gpu parity` checks the kernels'
answers on the 4b shapes), skipped where Triton is missing. And the executor's upload and stage
clock."""

from __future__ import annotations

import textwrap

import numpy as np
import torch

from tests.interpreted import run_interpreted

KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from runtime.model import gdn_kernels
    from runtime.model.gdn import gated_delta_eager, l2norm

    torch.manual_seed(0)
    b, t, heads, value_heads, dk, dv, sources = 5, 6, 2, 4, 32, 64, 3
    mixed = torch.randn(b, t, 2 * heads * dk + value_heads * dv)
    q, k, v = mixed.split([heads * dk, heads * dk, value_heads * dv], dim=-1)
    q, k = q.reshape(b, t, heads, dk), k.reshape(b, t, heads, dk)
    v = v.reshape(b, t, value_heads, dv)
    lengths = torch.tensor([6, 3, 1, 6, 0])
    valid = (torch.arange(t)[None] < lengths[:, None])[..., None]
    g = torch.where(valid, -torch.rand(b, t, value_heads), 0.0)
    beta = torch.where(valid, torch.rand(b, t, value_heads), 0.0)
    states = torch.randn(sources, value_heads, dk, dv) * 0.1
    src = torch.tensor([2, 0, 1, 2, 0])
    out, final = gdn_kernels.rows_gated_delta(q, k, v, g, beta, states, src, lengths, dk**-0.5)
    padding = ~valid[..., 0]
    assert (out[padding] == 0).all()  # padded tokens' outputs are zeros, never read
    same, same_final = gdn_kernels.rows_gated_delta(
        q.contiguous(), k.contiguous(), v.contiguous(), g, beta, states, src, lengths, dk**-0.5)
    # views of the conv's output, as contiguous copies
    assert torch.equal(out, same) and torch.equal(final, same_final)

    def per_value_head(x):
        return x.repeat_interleave(value_heads // heads, dim=2)

    expected, state = gated_delta_eager(
        l2norm(per_value_head(q)) * dk**-0.5, l2norm(per_value_head(k)), v, g, beta, states[src]
    )
    mask = valid[..., 0]
    print(float((out - expected)[mask].abs().max()))
    print(float((final - state).abs().max()))
    """
)


def test_rows_kernel_matches_the_eager_core():
    """Outputs and final states against the eager core on gathered states, rows given as views
    of one conv output with 0 to 6 valid tokens, the same bytes as from contiguous copies."""
    outputs, states = (float(x) for x in run_interpreted(KERNEL_CHECK)[-2:])
    assert outputs < 1e-5 and states < 1e-5


CONV_CHECK = textwrap.dedent(
    """
    import torch
    from runtime.model import gdn_kernels
    from runtime.model.language import GatedDeltaNet

    torch.manual_seed(0)
    b, t, taps = 5, 11, 4
    delta = GatedDeltaNet.__new__(GatedDeltaNet)
    torch.nn.Module.__init__(delta)
    delta.kernel, delta.core = taps, "eager"
    delta.conv1d = torch.nn.Conv1d(300, 300, taps, groups=300, bias=False)
    raw, past = torch.randn(b, t, 300), torch.randn(b, 300, taps - 1)
    lengths = torch.tensor([11, 4, 0, 1, 9])
    expected, state = delta.conv(raw, past, lengths)
    weight = delta.conv1d.weight.float()[:, 0, :].t().contiguous()
    out, kept = gdn_kernels.short_conv(raw, past, weight, lengths)
    wide = torch.randn(b, t, 310)  # a column slice, read through its strides; no state
    wide[..., 5:305] = raw
    sliced, none = gdn_kernels.short_conv(wide[..., 5:305], past, weight, lengths, False)
    _, kept_too = gdn_kernels.short_conv(wide[..., 5:305], past, weight, lengths, True)
    same = torch.equal(sliced, out) and none.shape[0] == 0 and torch.equal(kept_too, state)
    print(float((out - expected).abs().max()), torch.equal(kept, state), same)
    """
)


def test_conv_kernel_matches_the_model_conv():
    """The conv kernel (past and own inputs joined in the kernel, 300 channels over two
    programs) gives the eager conv's outputs and exactly its conv state, rows of 0 to 11
    valid tokens; read in place from a column slice it gives the same bytes, and no state
    where none is wanted."""
    difference, same_state, in_place = run_interpreted(CONV_CHECK)[-1].split()
    assert float(difference) < 1e-6 and same_state == "True" and in_place == "True"


HOPPER_COMPILE = textwrap.dedent(
    """
    import pathlib, subprocess, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from runtime.model import gdn_kernels as gk
    from runtime.model import packed_kernels as pk

    tool = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    shapes = {"H": 16, "HV": 32, "K": 128, "V": 128, "EPS": 1e-6}
    conv = {"raw": "*bf16", "past": "*bf16", "weight": "*fp32", "lengths": "*i64",
            "out": "*bf16", "state": "*bf16", "T": "i32", "C": "i32", "row_stride": "i64",
            "token_stride": "i64"}
    packed = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*fp32",
              "states": "*fp32", "slots": "*fp32", "row_start": "*i64", "row_length": "*i64",
              "row_parent": "*i64", "row_prefix": "*i64", "out": "*fp32", "scale": "fp32",
              "sq_n": "i64", "sv_n": "i64"}
    kernels = [
        (gk._short_conv_kernel, conv, dict(KEEP=3, KP=4, TAPS=4, BT=gk.CONV_TOKENS,
         BC=gk.CONV_CHANNELS, STATE=state), 4)
        for state in (True, False)
    ] + [
        (pk._packed_delta_kernel, packed, dict(shapes, BV=pk.BLOCK_V, TEXT=text,
         SLOTS=pk.TEXT_ROWS), pk.DELTA_WARPS)
        for text in (True, False)
    ]
    for fn, types, constants, warps in kernels:
        signature = {**types, **{name: "constexpr" for name in constants}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constants)
        done = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
        path = pathlib.Path("hopper.cubin")
        path.write_bytes(done.asm["cubin"])
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(path)],
                               capture_output=True, text=True).stdout
        path.unlink()
        print(fn.__name__, usage.split("STACK:")[1].split()[0])
    """
)


def test_the_kernels_compile_for_hopper_without_spilling(tmp_path):
    """Triton compiles the conv and packed delta kernels for the H200 (sm_90) here, without a
    GPU: the interpreter runs Python and accepts code the compiler refuses (a conv kernel that
    the H200's Triton once refused), and their shipped tiles keep their registers (a first
    chunked kernel spilled and ran slower than the recurrent)."""
    import os
    import subprocess
    import sys

    import pytest

    from tests.interpreted import ROOT

    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", HOPPER_COMPILE], capture_output=True, text=True, cwd=tmp_path,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    stacks = [line.split() for line in done.stdout.strip().splitlines()]
    assert [name for name, _ in stacks] == ["_short_conv_kernel"] * 2 + ["_packed_delta_kernel"] * 2
    assert all(stack == "0" for _, stack in stacks), stacks


def test_the_kernels_are_custom_ops_with_fakes():
    from runtime.model import gdn_kernels

    q = torch.empty(3, 4, 2, 32, device="meta")
    v = torch.empty(3, 4, 4, 64, device="meta")
    gates = torch.empty(3, 4, 4, device="meta")
    states = torch.empty(2, 4, 32, 64, device="meta")
    src = torch.empty(3, dtype=torch.int64, device="meta")
    out, final = gdn_kernels.fla_gated_delta(
        q, q, v, gates, gates, states[:1].expand(3, -1, -1, -1), 0.5
    )
    assert out.shape == v.shape and final.shape == (3, 4, 32, 64)
    assert final.dtype == torch.float32
    out, final = gdn_kernels.rows_gated_delta(q, q, v, gates, gates, states, src, src, 0.5)
    assert out.shape == v.shape and out.is_contiguous() and final.shape == (3, 4, 32, 64)
    assert final.dtype == torch.float32
    raw = torch.empty(3, 4, 300, device="meta")
    out, state = gdn_kernels.short_conv(raw, torch.empty(3, 300, 3, device="meta"),
                                        torch.empty(4, 300, device="meta"), src)  # fmt: skip
    assert out.shape == raw.shape and state.shape == (3, 300, 3)


def test_pass_integers_travel_in_one_copy_as_views_of_their_arrays():
    from runtime.run_passes import upload_ints

    arrays = {
        "input_ids": np.arange(12, dtype=np.int64).reshape(3, 4),
        "positions": np.arange(36, dtype=np.int64).reshape(3, 3, 4) * 7,
        "lengths": np.array([4, 2, 1], dtype=np.int64),
        "read_rows": np.array([3], dtype=np.int64),
    }
    views = upload_ints(arrays, torch.device("cpu"))
    assert list(views) == list(arrays)
    base = views["input_ids"].untyped_storage().data_ptr()
    for name, array in arrays.items():
        assert views[name].dtype == torch.int64
        assert views[name].untyped_storage().data_ptr() == base  # one upload
        np.testing.assert_array_equal(views[name].numpy(), array)


def test_stage_clock_adds_interleaved_laps_and_waits_when_asked():
    from runtime.run_passes import Stopwatch

    waits = []
    stages = {"vision": 9.0, "prepare": 1.0}
    clock = Stopwatch(stages, sync=lambda: waits.append(1))
    assert "vision" not in stages and stages["prepare"] == 1.0  # the last request's laps go
    for stage in ("questions", "options", "questions", "options"):
        clock.lap(stage)
    assert len(waits) == 4
    assert set(stages) == {"prepare", "questions", "options"}
    assert all(stages[s] >= 0.0 for s in stages)
