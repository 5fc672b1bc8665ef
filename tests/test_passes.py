"""The pass plan: every pass has a fixed row count per length bucket, so a question's rows run in
passes of the same shapes, with the same contents, whether it is asked alone or with other
questions in any order; this is what makes answers invariant on the GPU, where the kernels
follow the batch shape (a row's outputs in a fixed-shape pass do not depend on the other rows)."""

from __future__ import annotations

import json

import pytest

from bench.workloads import choice_with
from reference.questions import gate_questions, pattern_png, request_body, speed_bench_questions
from runtime.constants import QUESTION_TOKENS
from runtime.contract import compile_request
from runtime.passes import (
    OPTION_ROWS,
    QUESTION_ROWS,
    SMALL_QUESTION_OPTIONS,
    option_family,
    plan,
    rows_for,
)
from runtime.processing import prepare
from runtime.strict_json import parse_body
from runtime.tokenizer import load_tokenizer

QUESTIONS = {**speed_bench_questions(12), **gate_questions()}
IMAGE = pattern_png(320, 224)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def planned(tokenizer, questions: dict, rows: int = QUESTION_ROWS, **options) -> tuple:
    request = compile_request(parse_body(request_body(IMAGE, questions)))
    prepared = prepare(request, tokenizer)
    return prepared, plan(prepared, rows, **options)


def row_of(p, row: int) -> dict:
    """One row of a pass: its tokens, positions and length, and the shape it runs in."""
    return {
        "shape": p.shape,
        "input_ids": p.input_ids[row].tolist(),
        "positions": p.positions[:, row].tolist(),
        "length": int(p.lengths[row]),
    }


def rows_of(prepared, work, qid: str) -> list[dict]:
    """Every row question `qid` owns (its text, then its options in order), with the shape of
    its pass and, for option rows, the shape of the question pass whose state it continues."""
    qi = [layout.question.id for layout in prepared.layouts].index(qid)
    found = []
    for qp in work.questions:
        if qi in qp.members:
            found.append(row_of(qp.rows, qp.members.index(qi)))
    options = {}
    for op in work.options:
        for row, (owner, k) in enumerate(op.members):
            if owner == qi:
                entry = row_of(op.rows, row)
                entry["source_shape"] = work.questions[op.question_pass].rows.shape
                options[k] = entry
    return found + [options[k] for k in sorted(options)]


def test_every_pass_has_its_buckets_row_count(tokenizer):
    prepared, work = planned(tokenizer, QUESTIONS)
    for qp in work.questions:
        length = qp.rows.shape[1]
        assert qp.rows.shape[0] == rows_for(length, QUESTION_ROWS, QUESTION_TOKENS)
    for op in work.options:
        (qi, _), *_ = op.members
        family = option_family(len(prepared.layouts[qi].opens))
        assert op.rows.shape[0] == rows_for(op.rows.shape[1], *family)
    assert len(work.questions) < len(QUESTIONS)  # questions share passes
    _, alone = planned(tokenizer, {"q0": QUESTIONS["q0"]})
    assert [qp.rows.shape for qp in alone.questions] == [(QUESTION_ROWS, 16)]


def test_rows_for_long_buckets():
    assert rows_for(16, 16, 256) == 16 and rows_for(32, 16, 256) == 8
    assert rows_for(8, 64, 512) == 64 and rows_for(24, 64, 512) == 16
    assert rows_for(1000, 64, 512) == 1 and rows_for(16, 1, 256) == 1


def test_a_questions_rows_are_the_same_alone_and_together(tokenizer):
    prepared, work = planned(tokenizer, QUESTIONS)
    backwards, work_backwards = planned(tokenizer, dict(reversed(list(QUESTIONS.items()))))
    for qid, question in QUESTIONS.items():
        alone, work_alone = planned(tokenizer, {qid: question})
        expected = rows_of(alone, work_alone, qid)
        assert len(expected) == 1 + len(alone.layouts[0].opens), qid
        assert rows_of(prepared, work, qid) == expected, qid
        assert rows_of(backwards, work_backwards, qid) == expected, qid


def test_option_families_follow_the_questions_own_option_count(tokenizer):
    """A question's options run in 32-row passes up to SMALL_QUESTION_OPTIONS options, in
    64-row passes beyond, whatever the other questions ask: a small question beside a 255-option
    one keeps the rows it has alone."""
    wide = choice_with(255)
    small = {"q0": QUESTIONS["q0"]}
    prepared, work = planned(tokenizer, {**small, **wide})
    shapes = {}
    for op in work.options:
        for qi, _ in op.members:
            shapes.setdefault(prepared.layouts[qi].question.id, set()).add(op.rows.shape)
    assert {rows for rows, _ in shapes["wide"]} == {OPTION_ROWS}
    assert {rows for rows, _ in shapes["q0"]} == {32}
    alone, work_alone = planned(tokenizer, small)
    assert rows_of(alone, work_alone, "q0") == rows_of(prepared, work, "q0")
    assert option_family(SMALL_QUESTION_OPTIONS) == (32, 256)
    assert option_family(SMALL_QUESTION_OPTIONS + 1) == (OPTION_ROWS, 512)
    with pytest.raises(ValueError, match="at most 255 options"):
        option_family(256)


def test_option_rows_continue_their_own_questions_row(tokenizer):
    prepared, work = planned(tokenizer, QUESTIONS)
    for op in work.options:
        members = work.questions[op.question_pass].members
        for row, (qi, _) in enumerate(op.members):
            assert members[op.rows.src[row]] == qi


def test_the_image_prefix_pass_is_shared(tokenizer):
    _, together = planned(tokenizer, QUESTIONS)
    _, alone = planned(tokenizer, {"q0": QUESTIONS["q0"]})
    assert json.dumps({k: v.tolist() for k, v in together.prefix.arrays().items()}) == json.dumps(
        {k: v.tolist() for k, v in alone.prefix.arrays().items()}
    )


def test_one_row_question_passes_keep_one_question_a_pass(tokenizer):
    """RuntimeConfig.question_batch = 1: the plan before batching, still fixed-shape."""
    prepared, work = planned(tokenizer, QUESTIONS, rows=1)
    assert len(work.questions) == len(QUESTIONS)
    assert all(len(qp.members) == 1 for qp in work.questions)


def test_option_passes_are_their_rows_filled_one_by_one(tokenizer):
    """`fill_options` (a pass's option rows at once) gives every array and read that
    `fill_row` of each option's `option_span` and the per-token reads give (Score included)."""
    import numpy as np

    from runtime.passes import empty_pass, fill_row, option_span

    questions = {**QUESTIONS, "wide": choice_with(70)["wide"]}
    request = compile_request(parse_body(request_body(IMAGE, questions)))
    prepared = prepare(request, tokenizer)
    work = plan(prepared, QUESTION_ROWS)
    assert any(prepared.layouts[qi].question.type == "score" for op in work.options
               for qi, _ in op.members)  # fmt: skip
    for op in work.options:
        batch, length = op.rows.shape
        expected = empty_pass(batch, length)
        targets, reads = [], {}
        for row, (qi, k) in enumerate(op.members):
            layout = prepared.layouts[qi]
            ids, positions = option_span(layout, k)
            fill_row(expected, row, ids, positions, src=int(op.rows.src[row]))
            assert op.rows.read_rows[op.u_read[(qi, k)]] == row * length + len(ids) - 1
            reads[(qi, k)] = []
            if layout.question.type != "score":
                for j in range(1, len(ids) - 1):
                    reads[(qi, k)].append(len(targets))
                    targets.append((row * length + j - 1, ids[j]))
        assert op.rows.targets == targets and op.text_reads == reads
        for name in ("input_ids", "positions", "lengths", "src"):
            got, want = getattr(op.rows, name), getattr(expected, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_unpadded_targets_keep_their_count(tokenizer):
    """Pass.arrays(pad=False): the log-probability lists as planned (one read of token 0 at row
    0 where there is none), each target row once (`target_slots` saying which row a target
    reads: the question pass reads every option's first token at one row), the hidden reads
    still padded; padded, a power of two."""
    prepared, work = planned(tokenizer, {"wide": choice_with(70)["wide"]})
    for p in (work.options[0].rows, work.questions[0].rows):
        arrays, padded = p.arrays(pad=False), p.arrays()
        rows = [t[0] for t in p.targets]
        assert len(arrays["target_slots"]) == len(rows) == len(arrays["target_tokens"])
        assert arrays["target_rows"].tolist() == sorted(set(rows))
        assert arrays["target_rows"][arrays["target_slots"]].tolist() == rows
        assert arrays["target_tokens"].tolist() == [t[1] for t in p.targets]
        assert padded["target_rows"].tolist()[: len(rows)] == rows
        assert len(padded["target_rows"]) == 1 << (len(rows) - 1).bit_length()
        assert arrays["read_rows"].tolist() == padded["read_rows"].tolist()
    assert len(work.questions[0].rows.arrays(pad=False)["target_rows"]) == 1  # 70 at its zq
    empty = work.prefix.arrays(pad=False)
    assert empty["target_rows"].tolist() == [0] and empty["target_tokens"].tolist() == [0]
    assert empty["target_slots"].tolist() == [0]


def test_host_readouts_take_each_read_where_the_plan_put_it(tokenizer):
    """HostReadouts gathers a pass's readouts in one indexing: each question's zq, u,
    picked and first are the rows and entries its plan names (u from one pass or from several:
    a 70-option question's option passes), float32."""
    import numpy as np

    from runtime.readouts import HostReadouts

    request = compile_request(parse_body(request_body(IMAGE, {**QUESTIONS, **choice_with(70)})))
    prepared = prepare(request, tokenizer)
    work = plan(prepared, QUESTION_ROWS)
    rng = np.random.default_rng(0)

    def outputs(p) -> tuple:
        arrays = p.arrays(pad=False)
        return (
            rng.random((len(arrays["read_rows"]), 8), dtype=np.float32),
            rng.random(len(arrays["target_tokens"]), dtype=np.float32),
        )

    taken, zq, first, u, picked = HostReadouts(), {}, {}, {}, {}
    passes = [
        (qp, [op for op in work.options if op.question_pass == i])
        for i, qp in enumerate(work.questions)
    ]
    for qp, ops in passes:
        hidden, logprobs = outputs(qp.rows)
        taken.take_question(qp, hidden, logprobs)
        zq.update({qi: hidden[i] for qi, i in qp.zq_read.items()})
        first.update({pair: float(logprobs[i]) for pair, i in qp.first_read.items()})
        for op in ops:
            hidden, logprobs = outputs(op.rows)
            taken.take_options(op, hidden, logprobs)
            u.update({pair: hidden[i] for pair, i in op.u_read.items()})
            picked.update({pair: logprobs[i] for pair, i in op.text_reads.items()})
    which = list(range(len(prepared.layouts)))[::-1]
    for qi, got in zip(which, taken.collect(prepared, which), strict=True):
        k = len(prepared.layouts[qi].rows)
        assert got.zq.dtype == got.u.dtype == np.float32
        assert np.array_equal(got.zq, zq[qi])
        assert np.array_equal(got.u, np.stack([u[(qi, j)] for j in range(k)]))
        assert got.first == [first.get((qi, j)) for j in range(k)]
        for j, values in enumerate(got.picked):
            assert values.dtype == np.float32
            assert np.array_equal(values, picked.get((qi, j), np.zeros(0)))
