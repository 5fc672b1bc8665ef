"""The pass plan: a question's passes are the same, row for row, whether it is asked alone or
with other questions in any order; this is what makes answers invariant on the GPU, where the
kernels follow the batch shape."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reference.questions import gate_questions, pattern_png, request_body, speed_bench_questions
from runtime.contract import compile_request
from runtime.passes import plan
from runtime.processing import prepare
from runtime.strict_json import parse_body
from runtime.tokenizer import load_tokenizer

QUESTIONS = {**speed_bench_questions(12), **gate_questions()}
IMAGE = pattern_png(320, 224)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def planned(tokenizer, questions: dict, question_batch: int = 1) -> tuple:
    request = compile_request(parse_body(request_body(IMAGE, questions)))
    prepared = prepare(request, tokenizer)
    return prepared, plan(prepared, question_batch)


def passes_of(prepared, work, qid: str) -> list[dict]:
    """Every pass that holds a row of question `qid`, with its arrays and readouts."""
    qi = [layout.question.id for layout in prepared.layouts].index(qid)
    found = []
    for qp in work.questions:
        if qi in qp.members:
            assert qp.members == [qi], "a question pass holds one question"
            found.append(qp.rows.arrays())
    for op in work.options:
        owners = {member[0] for member in op.members}
        if qi in owners:
            assert owners == {qi}, "an option pass holds one question's options"
            found.append(op.rows.arrays())
    return found


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def test_a_question_gets_the_same_passes_alone_and_together(tokenizer):
    prepared, work = planned(tokenizer, QUESTIONS)
    backwards, work_backwards = planned(tokenizer, dict(reversed(list(QUESTIONS.items()))))
    for qid, question in QUESTIONS.items():
        alone, work_alone = planned(tokenizer, {qid: question})
        expected = passes_of(alone, work_alone, qid)
        assert expected, qid
        assert same(passes_of(prepared, work, qid), expected), qid
        assert same(passes_of(backwards, work_backwards, qid), expected), qid


def test_the_image_prefix_pass_is_shared(tokenizer):
    _, together = planned(tokenizer, QUESTIONS)
    _, alone = planned(tokenizer, {"q0": QUESTIONS["q0"]})
    assert json.dumps({k: v.tolist() for k, v in together.prefix.arrays().items()}) == json.dumps(
        {k: v.tolist() for k, v in alone.prefix.arrays().items()}
    )


def test_question_batching_is_opt_in(tokenizer):
    """RuntimeConfig.question_batch trades the invariance above for fewer passes."""
    prepared, work = planned(tokenizer, QUESTIONS)
    _, batched = planned(tokenizer, QUESTIONS, question_batch=16)
    assert len(work.questions) == len(QUESTIONS)
    assert len(batched.questions) < len(work.questions)
    assert max(len(qp.members) for qp in batched.questions) > 1
    assert len(batched.options) < len(work.options)
