"""The packed recurrence alone on the GPU, on synthetic packs in the 4b's shapes: this tree's
`packed_gated_delta` against another file's (a previous `runtime/model/packed_kernels.py`), each
pack's median time a call (one layer: the text launch, then the options') and the largest
difference of their outputs, printed as a table. No checkpoint needed: the lease's shortest
check of a change to the kernel.

    python -m bench.delta_step --other OLD_PACKED_KERNELS.py --out delta-step.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

from runtime.model.packed import Rows
from runtime.model.packed_kernels import packed_gated_delta

HEADS, VALUE_HEADS, DK, DV = 16, 32, 128, 128  # the 4b's Gated DeltaNet (build_engines.presets)
# (pass size, row table size, text rows, tokens a text row, options a text row, tokens an
# option): the three requests as the planner packs them, roughly
PACKS = {
    "1 question": (256, 64, 1, 30, 4, 2),
    "12 questions": (512, 128, 12, 34, 3, 2),
    "255 options": (1024, 512, 1, 40, 255, 3),
}
RUNS = 50


def other_module(path: Path):
    """The other file's kernels under other op names (one process cannot register an op twice)."""
    source = path.read_text("utf-8").replace('"omnijev::', '"omnijev_other::')
    spec = importlib.util.spec_from_loader("other_packed_kernels", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def pack(spec: tuple, device: str = "cuda", dims: tuple = (HEADS, VALUE_HEADS, DK, DV)):
    """The rows and the inputs of one pack (`PACKS`' spec) on `device`, seeded; `dims`: key
    heads, value heads, key and value widths."""
    size, table, texts, text_tokens, options, option_tokens = spec
    heads, value_heads, dk, dv = dims
    gen = torch.Generator().manual_seed(0)
    start = torch.full((table + 1,), size, dtype=torch.int64)
    length = torch.zeros(table + 1, dtype=torch.int64)
    parent = torch.full((table + 1,), -1, dtype=torch.int64)
    token_row = torch.full((size,), table, dtype=torch.int64)
    token_step = torch.zeros(size, dtype=torch.int64)
    at, row = 0, 0
    for _ in range(texts):
        parent_row = row
        spans = [(text_tokens, -1)] + [(option_tokens, parent_row)] * options
        for tokens, of in spans:
            start[row], length[row], parent[row] = at, tokens, of
            token_row[at : at + tokens] = row
            token_step[at : at + tokens] = torch.arange(tokens)
            at, row = at + tokens, row + 1
    assert at <= size and row <= table, (at, row)
    rows = Rows(start, length, parent, torch.zeros_like(start), token_row, token_step)
    rows = Rows(*(t.to(device) for t in rows))
    half = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's: float32
    q = torch.randn(size, heads, dk, generator=gen).to(device, half)
    k = torch.randn(size, heads, dk, generator=gen).to(device, half)
    v = torch.randn(size, value_heads, dv, generator=gen).to(device, half)
    g = (-torch.rand(size, value_heads, generator=gen) * 0.1).to(device)
    beta = torch.rand(size, value_heads, generator=gen).to(device)
    states = (torch.randn(1, value_heads, dk, dv, generator=gen) * 0.05).to(device)
    return (q, k, v, g, beta, states, rows, dk**-0.5)


def timed(run, args) -> tuple[float, torch.Tensor]:
    """Median ms a call over RUNS after three warm calls, and the output."""
    for _ in range(3):
        out = run(*args)
    times = []
    for _ in range(RUNS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = run(*args)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.delta_step")
    parser.add_argument("--other", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    other = other_module(args.other)
    record = {"device": torch.cuda.get_device_name(), "packs": {}}
    print("| pack | this tree ms | other ms | this / other | max difference |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, spec in PACKS.items():
        inputs = pack(spec)
        ours, out = timed(packed_gated_delta, inputs)
        theirs, other_out = timed(other.packed_gated_delta, inputs)
        difference = float((out - other_out).abs().max())
        record["packs"][name] = {"ms": ours, "other_ms": theirs, "max_difference": difference}
        print(f"| {name} | {ours:.4f} | {theirs:.4f} | {ours / theirs:.3f} | {difference:.2e} |")
    args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
