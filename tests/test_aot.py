"""Blocks compiled ahead of time (`runtime.backends.aot`): saved by one process, loaded by the
next without tracing, chosen by their guards, and `torch.compile` where they cannot be saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.backends import aot

pytestmark = pytest.mark.skipif(not aot.supported(), reason="this torch has no aot_compile")

SCRIPT = """
import json, sys
import torch
import torch._dynamo.utils as dynamo_utils
from torch import nn
from runtime.backends.aot import AheadOfTimeBlock


def block(layer, h, scale: float):
    return torch.relu(layer(h)) * scale


def broken(layer, h, scale: float):
    torch._dynamo.graph_break()
    return torch.relu(layer(h)) * scale


torch.manual_seed(0)
layer = nn.Linear(8, 8)
made = AheadOfTimeBlock(sys.argv[2], broken if sys.argv[2] == "broken" else block, sys.argv[1])
loaded = len(made.entries)
outputs, close = {}, True
with torch.inference_mode():
    for rows in (4, 6, 9):
        h = torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8) / 10
        y = made(layer, h, 0.5)
        outputs[rows] = y.flatten().tolist()
        close = close and torch.allclose(y, block(layer, h, 0.5))
print(json.dumps({
    "loaded": loaded, "compiled": made.compiled, "fallback": made.fallback is not None,
    "graphs": dynamo_utils.counters["stats"]["unique_graphs"], "close": close,
    "outputs": outputs,
}))
"""


def run(tmp_path: Path, name: str) -> dict:
    script = tmp_path / "aot_block.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "saved"), name],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_block_saved_ahead_of_time_loads_in_a_new_process_without_tracing(tmp_path):
    """The first process compiles one function for every row count (dynamic sizes) and saves
    it; the next loads it, traces nothing and gives the first one's bytes."""
    first = run(tmp_path, "toy")
    assert first["loaded"] == 0 and first["compiled"] == 1 and not first["fallback"]
    assert first["close"]
    assert len(list((tmp_path / "saved").glob("toy.*.aot"))) == 1
    second = run(tmp_path, "toy")
    assert second["loaded"] == 1 and second["compiled"] == 0 and second["graphs"] == 0
    assert second["outputs"] == first["outputs"]


def test_a_block_that_cannot_be_saved_falls_back_to_torch_compile(tmp_path):
    """A graph break leaves no whole graph to save: the block runs under torch.compile."""
    result = run(tmp_path, "broken")
    assert result["fallback"] and result["compiled"] == 0 and result["close"]
    assert not list((tmp_path / "saved").glob("*.aot"))


def test_the_backend_compiles_its_blocks_ahead_of_time_only_when_asked(monkeypatch, tmp_path):
    from runtime.backends import compiled

    def block(h):
        return h + 1

    monkeypatch.delenv(aot.AOT_ENV, raising=False)
    assert not isinstance(compiled.compiled_block("b", block), aot.AheadOfTimeBlock)
    monkeypatch.setenv(aot.AOT_ENV, "1")
    monkeypatch.setenv(aot.AOT_DIR_ENV, str(tmp_path))
    # the block sets Dynamo's specialize_float; its own patch puts it back (monkeypatch would
    # delete the config entry on undo)
    with torch._dynamo.config.patch(specialize_float=False, enable_aot_compile=False):
        made = compiled.compiled_block("b", block)
        # torch 2.11 gives a compiled function `aot_compile` only with enable_aot_compile on
        assert torch._dynamo.config.specialize_float and torch._dynamo.config.enable_aot_compile
        assert hasattr(made.compiler, "aot_compile")
    assert isinstance(made, aot.AheadOfTimeBlock) and made.folder == tmp_path
    assert not torch._dynamo.config.specialize_float


def test_the_custom_ops_a_saved_block_calls_are_registered_without_tracing():
    """A loaded block calls the model's ops by name before anything traces the model (on the
    H200 the fla core's op was missing): importing the ahead-of-time module registers them."""
    code = (
        "import torch, runtime.backends.aot; "
        "print(all(hasattr(torch.ops.omnijev, op) for op in "
        "('fla_gated_delta', 'option_rows_gated_delta', 'rows_gated_delta', 'floored_linear')))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"
