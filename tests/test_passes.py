"""The pass plan: every pass has a fixed row count per length bucket, so a question's rows run in
passes of the same shapes, with the same contents, whether it is asked alone or with other
questions in any order; this is what makes answers invariant on the GPU, where the kernels
follow the batch shape (a row's outputs in a fixed-shape pass do not depend on the other rows)."""

from __future__ import annotations

import json

import pytest

from bench.workloads import choice_with
from reference.questions import gate_questions, pattern_png, request_body, speed_bench_questions
from runtime.constants import FIT_TOKENS, QUESTION_TOKENS
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


def test_fitted_passes_hold_only_the_rows_they_need(tokenizer):
    """plan(fit=True): the next power of two of the rows a pass holds, at least MIN_FITTED_ROWS,
    at most the bucket's fixed count; the rows themselves as in the fixed plan."""
    from runtime.passes import MIN_FITTED_ROWS

    for questions in ({"q0": QUESTIONS["q0"]}, QUESTIONS):
        prepared, fixed = planned(tokenizer, questions)
        fitted = plan(prepared, QUESTION_ROWS, fit=True)
        assert len(fitted.questions) == len(fixed.questions)
        for a, b in zip(fitted.questions, fixed.questions, strict=True):
            held = len(a.members)
            assert a.rows.shape[0] == max(MIN_FITTED_ROWS, 1 << (held - 1).bit_length())
            assert a.rows.shape[0] <= b.rows.shape[0] and a.members == b.members
            assert a.rows.input_ids.tolist() == b.rows.input_ids[: a.rows.shape[0]].tolist()
        for a, b in zip(fitted.options, fixed.options, strict=True):
            assert a.rows.shape[0] <= b.rows.shape[0] and a.members == b.members
            assert a.rows.shape[0] >= len(a.members) and a.u_read == b.u_read


@pytest.mark.parametrize("fit", [False, True])
def test_option_passes_are_their_rows_filled_one_by_one(tokenizer, fit):
    """`fill_options` (a pass's option rows at once) gives every array and read that
    `fill_row` of each option's `option_span` and the per-token reads give (Score included)."""
    import numpy as np

    from runtime.passes import empty_pass, fill_row, option_span

    questions = {**QUESTIONS, "wide": choice_with(70)["wide"]}
    request = compile_request(parse_body(request_body(IMAGE, questions)))
    prepared = prepare(request, tokenizer)
    work = plan(prepared, QUESTION_ROWS, fit)
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


@pytest.mark.parametrize("fit", [False, True])
def test_joint_passes_hold_option_passes_with_the_rows_they_continue(tokenizer, fit):
    """plan(joint=True): the questions with at most JOINT_OPTIONS options (their own count)
    run in joint passes: each option pass with a question part of exactly the questions its
    rows continue (`src` pointing at the same question), sized as a question pass of that
    bucket; the others, fitted, in joint passes of their own (`plan_alone`, after the shared
    ones), else in question and option passes as before. Every option row once, every
    question's readouts once."""
    from runtime.passes import (
        JOINT_OPTIONS,
        fitted_rows,
        plan_options,
        plan_questions,
        question_span,
        shared_tokens,
    )

    questions = {**QUESTIONS, "wide": choice_with(70)["wide"]}
    request = compile_request(parse_body(request_body(IMAGE, questions)))
    prepared = prepare(request, tokenizer)
    layouts = prepared.layouts
    work = plan(prepared, QUESTION_ROWS, fit, joint=True)
    joining = {qi for qi, layout in enumerate(layouts) if len(layout.opens) <= JOINT_OPTIONS}
    others = set(range(len(layouts))) - joining
    assert work.joined and work.joint and others
    assert {qi for qp in work.questions for qi in qp.members} == (set() if fit else others)
    alone = [jp for jp in work.joint if not set(jp.question.members) <= joining]
    assert bool(alone) == fit and work.joint[len(work.joint) - len(alone) :] == alone
    assert {qi for jp in alone for qi in jp.question.members} == (others if fit else set())
    alone_ids = {id(jp) for jp in alone}

    rows = [m for jp in work.joint for m in jp.options.members]
    rows += [m for op in work.options for m in op.members]
    assert sorted(rows) == sorted((qi, k) for qi, lay in enumerate(layouts)
                                  for k in range(len(lay.opens)))  # fmt: skip
    read = [qi for qp in work.questions for qi in qp.zq_read]
    for jp in work.joint:
        part, op = jp.question, jp.options
        assert op.members
        if id(jp) in alone_ids:
            assert len(part.members) == 1
        else:
            assert jp.tokens <= FIT_TOKENS and set(part.members) <= joining
        assert sorted(part.members) == sorted({qi for qi, _ in op.members})
        for row, (qi, _) in enumerate(op.members):
            assert part.members[op.rows.src[row]] == qi
        length = part.rows.shape[1]
        size = rows_for(length, QUESTION_ROWS, QUESTION_TOKENS)
        assert part.rows.shape[0] == fitted_rows(len(part.members), size, fit)
        # an alone text runs on through its options' shared leading tokens (<|opt|> at least)
        alone_pass = id(jp) in alone_ids
        for row, qi in enumerate(part.members):
            shared = shared_tokens(layouts[qi]) if alone_pass else 0
            ids, positions = question_span(layouts[qi], work.prefix_length, shared)
            assert part.rows.input_ids[row, : len(ids)].tolist() == ids
            assert part.rows.positions[:, row, : len(ids)].tolist() == positions.tolist()
        for qi, index in part.zq_read.items():
            layout = layouts[qi]
            shared = shared_tokens(layout) if alone_pass else 0
            assert shared >= alone_pass
            ids, _ = question_span(layout, work.prefix_length, shared)
            zq_flat = part.members.index(qi) * length + len(ids) - 1 - shared
            assert part.rows.read_rows[index] == zq_flat
            for k, (o, c) in enumerate(zip(layout.opens, layout.closes, strict=True)):
                block = layout.token_ids[o : c + 1]
                assert block[:shared] == layout.token_ids[layout.opens[0] :][:shared]
                at = part.open_read.get((qi, k), [])
                # text token j of the block, read at the token before it in the question row
                expected = [(zq_flat + j, block[j]) for j in range(1, min(shared, c - o - 1) + 1)]
                assert [part.rows.targets[i] for i in at] == expected
        assert {qi for qi, _ in part.first_read} <= set(part.zq_read)
        read += list(part.zq_read)
    assert sorted(read) == list(range(len(layouts)))
    # the joint passes hold the option passes' own, one each
    spans = [question_span(layout, work.prefix_length) for layout in layouts]
    mine = plan_questions(prepared, spans, QUESTION_ROWS, fit, only=joining)
    option_passes = plan_options(prepared, mine, fit)
    shared_passes = [jp for jp in work.joint if id(jp) not in alone_ids]
    assert [jp.options.members for jp in shared_passes] == [op.members for op in option_passes]
    apart = plan(prepared, QUESTION_ROWS, fit)
    assert apart.joint == [] and not apart.joined


def joint_rows_of(prepared, work, qid: str) -> list[dict]:
    """Every row question `qid` owns in a joint plan, with the shapes of its joint pass: its
    question part's row and each option row, in the joint passes' order."""
    qi = [layout.question.id for layout in prepared.layouts].index(qid)
    found = []
    for jp in work.joint:
        op = jp.options
        shapes = [jp.question.rows.shape, op.rows.shape]
        if qi in jp.question.members:
            found.append((shapes, row_of(jp.question.rows, jp.question.members.index(qi))))
        for row, (owner, _) in enumerate(op.members):
            if owner == qi:
                found.append((shapes, row_of(op.rows, row)))
    return found


def test_wide_questions_join_alone_in_passes_of_their_own(tokenizer):
    """plan(joint=True, fit=True): a question with more than JOINT_OPTIONS options runs its text
    and its options in joint passes holding nothing else (ALONE_FAMILY: 255 options of at most
    8 tokens in one 256 × 8 part), so its rows and their passes' shapes are the same alone,
    beside a small question or beside another wide one, in either order."""
    from runtime.passes import ALONE_ROWS

    # "option 0" … "option 254": every block begins <|opt|> "option" " ", then 1-3 digits and
    # the <|/opt|>: rows of 2-4 tokens
    wide, other = choice_with(255)["wide"], choice_with(70)["wide"]
    small = {"q0": QUESTIONS["q0"]}

    def joint_plan(questions):
        request = compile_request(parse_body(request_body(IMAGE, questions)))
        prepared = prepare(request, tokenizer)
        return prepared, plan(prepared, QUESTION_ROWS, fit=True, joint=True)

    prepared, work = joint_plan({"wide": wide})
    assert [(jp.question.rows.shape, jp.options.rows.shape) for jp in work.joint] == [
        ((2, 32), (ALONE_ROWS, 4))
    ]
    expected = joint_rows_of(prepared, work, "wide")
    assert len(expected) == 1 + 255
    for questions in (
        {**small, "wide": wide},
        {"wide": wide, **small},
        {"other": other, "wide": wide},
        {"wide": wide, "other": other, **small},
    ):
        together, work_together = joint_plan(questions)
        assert joint_rows_of(together, work_together, "wide") == expected
    prepared, work = joint_plan(small)
    expected = joint_rows_of(prepared, work, "q0")
    together, work_together = joint_plan({"wide": wide, **small})
    assert joint_rows_of(together, work_together, "q0") == expected


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


@pytest.mark.parametrize("joint", [False, True])
def test_host_readouts_take_each_read_where_the_plan_put_it(tokenizer, joint):
    """HostReadouts gathers a pass's readouts in one indexing: each question's zq, u,
    picked and first are the rows and entries its plan names (u from one pass or from several:
    a 70-option question's four option passes apart, its one pass joined), float32."""
    import numpy as np

    from runtime.readouts import HostReadouts

    request = compile_request(parse_body(request_body(IMAGE, {**QUESTIONS, **choice_with(70)})))
    prepared = prepare(request, tokenizer)
    work = plan(prepared, QUESTION_ROWS, fit=joint, joint=joint)
    rng = np.random.default_rng(0)

    def outputs(p) -> tuple:
        arrays = p.arrays(pad=False)
        return (
            rng.random((len(arrays["read_rows"]), 8), dtype=np.float32),
            rng.random(len(arrays["target_tokens"]), dtype=np.float32),
        )

    taken, zq, first, u, picked, opened = HostReadouts(), {}, {}, {}, {}, {}
    passes = [
        (qp, [op for op in work.options if op.question_pass == i])
        for i, qp in enumerate(work.questions)
    ]
    passes += [(jp.question, [jp.options]) for jp in work.joint]
    for qp, ops in passes:
        hidden, logprobs = outputs(qp.rows)
        taken.take_question(qp, hidden, logprobs)
        zq.update({qi: hidden[i] for qi, i in qp.zq_read.items()})
        first.update({pair: float(logprobs[i]) for pair, i in qp.first_read.items()})
        opened.update({pair: logprobs[i] for pair, i in qp.open_read.items()})
        for op in ops:
            hidden, logprobs = outputs(op.rows)
            taken.take_options(op, hidden, logprobs)
            u.update({pair: hidden[i] for pair, i in op.u_read.items()})
            picked.update({pair: logprobs[i] for pair, i in op.text_reads.items()})
    # a question alone (fitted joint plans: the 70-option one) reads each option's first text
    # tokens over its options' shared leading tokens, the first of the option's picked values
    assert bool(opened) == joint
    for pair, value in opened.items():
        picked[pair] = np.concatenate([value, picked.get(pair, np.zeros(0, np.float32))])
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


# a Choice whose option texts all begin "a red", one of them nothing more: its blocks share
# <|opt|> "a" " red", and that option's row is its <|/opt|> alone
SHARED_LEAD = {
    "lead": {
        "type": "choice",
        "instructions": "Which object is it?",
        "options": [{"key": "plain", "text": "a red"}]
        + [{"key": f"k{i}", "text": f"a red {w}"} for i, w in enumerate(
            ["dog", "cat", "car", "box", "cup", "hat", "pen", "bag", "bed", "bus", "fan",
             "jar", "key", "map", "mug", "net", "pot", "rug", "saw", "toy", "van", "wig",
             "bat", "bow", "can", "fig", "gem", "hen", "ink", "jet", "kit", "lid", "log"]
        )],
    }
}  # fmt: skip


def test_shared_tokens_are_the_blocks_common_lead_leaving_each_its_close(tokenizer):
    """`shared_tokens`: the leading tokens every option block has in common, at most all but
    the shortest block's <|/opt|>; an alone question's rows are the blocks after them, and its
    question part reads their text tokens (an option whose text is all shared reads all of
    it there)."""
    from runtime.constants import CLOSE_ID, OPEN_ID
    from runtime.passes import shared_tokens

    prepared, work = planned(tokenizer, SHARED_LEAD, fit=True, joint=True)
    layout = prepared.layouts[0]
    pairs = zip(layout.opens, layout.closes, strict=True)
    blocks = [list(layout.token_ids[o : c + 1]) for o, c in pairs]
    shared = shared_tokens(layout)
    assert shared == len(blocks[0]) - 1 and blocks[0][-1] == CLOSE_ID  # <|opt|> "a" " red"
    assert all(b[:shared] == blocks[0][:shared] and b[0] == OPEN_ID for b in blocks)
    assert len({b[shared] for b in blocks}) > 1
    (jp,) = work.joint
    op = jp.options
    rows = {pair: op.rows.input_ids[r, : op.rows.lengths[r]].tolist()
            for r, pair in enumerate(op.members)}  # fmt: skip
    assert rows[(0, 0)] == [CLOSE_ID]
    assert all(rows[(0, k)] == b[shared:] for k, b in enumerate(blocks))
    reads = jp.question.open_read
    assert [jp.question.rows.targets[i][1] for i in reads[(0, 0)]] == blocks[0][1:shared]
    assert all(len(reads[(0, k)]) == shared for k in range(1, len(blocks)))


def test_larger_joint_passes_are_the_same_rows_in_more_filler_rows(tokenizer):
    """`larger_joints`: the fitted joint passes the planner makes for more rows of the same
    lengths, fewest token slots first, each holding the pass's rows where they were and its
    reads unchanged; none for a question joining alone (its option rows are its own shape)."""
    from runtime.passes import OPTION_FAMILIES, grown, larger_joints

    prepared, work = planned(
        tokenizer, {**speed_bench_questions(3), **choice_with(40)}, fit=True, joint=True
    )
    small = [jp for jp in work.joint if jp.options.rows.shape[0] <= OPTION_FAMILIES[0][1]]
    alone = [jp for jp in work.joint if jp.options.rows.shape[0] > OPTION_FAMILIES[0][1]]
    assert small and alone and all(larger_joints(jp) == [] for jp in alone)
    for jp in small:
        larger = larger_joints(jp)
        assert larger
        slots = [sum(p.rows.input_ids.size for p in (x.question, x.options)) for x in larger]
        assert slots == sorted(slots) and slots[0] > sum(
            p.rows.input_ids.size for p in (jp.question, jp.options)
        )
        for bigger in larger:
            for part, mine in ((bigger.question, jp.question), (bigger.options, jp.options)):
                rows, count = part.rows, mine.rows.shape[0]
                assert rows.shape[1] == mine.rows.shape[1] and rows.shape[0] >= count
                assert (rows.input_ids[:count] == mine.rows.input_ids).all()
                assert (rows.src[:count] == mine.rows.src).all()
                assert (rows.lengths[count:] == 1).all() and not rows.input_ids[count:].any()
                assert rows.read_rows == mine.rows.read_rows
                assert rows.targets == mine.rows.targets
    same = grown(work.joint[0].question.rows, 1)
    assert same is work.joint[0].question.rows
