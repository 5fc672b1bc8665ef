"""The packed planner of the tree on PYTHONPATH against an earlier one's (its
runtime/packing.py copied to the path given), on the traffic suite's first 150 requests, 60
of its held-out stream, the bench's workloads and 47 merged batches: every array, readout
list and target the same. Usage: python plan_equal.py OLD_PACKING_PY"""

import dataclasses
import importlib.util
import json
import sys

import numpy as np

from bench import traffic, workloads
from runtime import packing
from runtime.batch import merged
from runtime.contract import compile_request
from runtime.processing import prepare
from runtime.tokenizer import build_tokenizer

ARRAYS = ("input_ids", "positions", "token_row", "token_step")
ARRAYS += ("row_start", "row_length", "row_parent", "row_prefix")


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("packing_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["packing_old"] = module
    spec.loader.exec_module(module)
    return module


def same(a, b) -> None:
    assert a.prefix_length == b.prefix_length and len(a.passes) == len(b.passes)
    for p, q in zip(a.passes, b.passes, strict=True):
        for name in ARRAYS:
            x, y = getattr(p, name), getattr(q, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        assert (p.read_rows, p.targets, p.used) == (q.read_rows, q.targets, q.used)
        assert (p.options.members, p.options.u_read) == (q.options.members, q.options.u_read)
        assert p.options.text_reads == q.options.text_reads
        assert (p.question.members, p.question.zq_read) == (q.question.members, q.question.zq_read)


old = load_old(sys.argv[1])
tokenizer = build_tokenizer()
bodies = [r.body for r in traffic.stream(0, 150)]
bodies += [r.body for r in traffic.stream(1, 60, held_out=True)]
bodies += list(workloads.bench_bodies().values())
preps = [
    prepare(compile_request(json.loads(body)), tokenizer, pack=False, resize=False)
    for body in bodies
]
for prepared in preps:
    same(packing.plan(prepared), old.plan(prepared))
types = sorted({layout.question.type for p in preps for layout in p.layouts})
print(f"{len(preps)} requests the same; question types {types}")
keyed = [dataclasses.replace(p, image_key=f"image {i % 7}") for i, p in enumerate(preps[:40])]
batches = 0
for size in (2, 3, 4, 6):
    for start in range(0, 40 - size, size):
        batch, _ = merged(keyed[start : start + size])
        try:
            expected = old.plan(batch)
        except ValueError:  # past the largest pass
            continue
        same(packing.plan(batch), expected)
        batches += 1
print(f"{batches} merged batches the same")
