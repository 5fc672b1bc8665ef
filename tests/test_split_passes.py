"""Passes longer than an engine takes (TensorRT's standard-op Gated DeltaNet: 64 tokens) run as
consecutive pieces; through ONNX Runtime on the CPU they agree with the fused variant's one pass."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.parity import compare
from reference.questions import gate_questions, pattern_png, request_body, speed_bench_questions
from runtime.executor import load_engine
from runtime.passes import empty_pass, fill_row
from runtime.run_passes import slice_pass
from tests.engine_fixtures import tiny_engines, tiny_std_engines

LONG = (
    "Pick the best description of what is visible on this screen, considering every window, "
    "button and label that you can see there carefully, and then answer. "
)


@pytest.fixture(scope="module")
def executors(tmp_path_factory):
    export, fused_dir = tiny_engines(tmp_path_factory)
    std_dir = tiny_std_engines(tmp_path_factory)
    fused = load_engine(str(export), str(fused_dir), "onnxruntime")
    std = load_engine(str(export), str(std_dir), "onnxruntime")
    return fused, std


def long_request() -> bytes:
    questions = {**speed_bench_questions(12), **gate_questions()}
    questions["long"] = {
        "type": "choice",
        "instructions": LONG * 2,  # a question text over 64 tokens
        "options": [{"key": "a", "text": "a very long option text " * 12}, {"key": "b"}],
    }
    return request_body(pattern_png(640, 480), questions)  # a 305-token image prefix


def test_engine_limit_is_read_from_the_variant(executors):
    fused, std = executors
    assert getattr(fused.backend, "max_pass_tokens", None) is None
    assert std.backend.max_pass_tokens == 64


def test_split_passes_agree_with_one_pass(executors):
    fused, std = executors
    body = long_request()
    result = compare(fused.answer(body), std.answer(body))
    assert result["input_tokens_equal"] and not result["flips"]
    assert max(result["differences"]) <= 1.0001e-4
    prepared = fused.prepare(json.loads(body))
    for a, b in zip(fused.readouts(prepared), std.readouts(prepared), strict=True):
        assert np.allclose(a.zq, b.zq, atol=1e-3)
        assert np.allclose(a.u, b.u, atol=1e-3)
        for pa, pb in zip(a.picked, b.picked, strict=True):
            assert np.allclose(pa, pb, atol=1e-3)


def test_slice_pass_keeps_readouts_in_their_piece():
    rows = empty_pass(2, 8)
    fill_row(rows, 0, list(range(1, 9)), np.tile(np.arange(8), (3, 1)))
    fill_row(rows, 1, [5, 6, 7], np.tile(np.arange(3), (3, 1)), src=1)
    rows.read_rows += [7, 8 + 2]
    rows.targets += [(3, 11), (5, 12), (8 + 1, 13)]
    first, second = slice_pass(rows, 0, 4), slice_pass(rows, 4, 8)
    assert first.lengths.tolist() == [4, 3] and second.lengths.tolist() == [4, 0]
    assert first.src.tolist() == [0, 1] and second.src.tolist() == [0, 1]
    assert first.read_index == [1] and first.read_rows == [4 + 2]
    assert second.read_index == [0] and second.read_rows == [3]
    assert first.target_index == [0, 2] and first.targets == [(3, 11), (4 + 1, 13)]
    assert second.target_index == [1] and second.targets == [(1, 12)]


def test_readout_arrays_are_padded_to_powers_of_two():
    rows = empty_pass(1, 8)
    fill_row(rows, 0, list(range(1, 6)), np.tile(np.arange(5), (3, 1)))
    assert len(rows.arrays()["read_rows"]) == 1 and len(rows.arrays()["target_rows"]) == 1
    rows.read_rows += [1, 2, 3]
    rows.targets += [(0, 7), (1, 8), (2, 9), (3, 10), (4, 11)]
    arrays = rows.arrays()
    assert arrays["read_rows"].tolist() == [1, 2, 3, 0]
    assert arrays["target_rows"].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert arrays["target_tokens"].tolist() == [7, 8, 9, 10, 11, 0, 0, 0]
