"""Token-packed passes (issue 46): the planner puts a request's questions in as few passes of
PACK_SIZES as hold them, and a question's answer is the same bytes whether its rows were packed
alone, with its request's other questions in any order, or with another request's rows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench.parity import without_latency
from reference.questions import gate_questions, pattern_png, request_body, speed_bench_questions
from runtime import packing
from tests.engine_fixtures import tiny_engines


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    from runtime.executor import load_engine

    checkpoint, engines = tiny_engines(tmp_path_factory)
    return load_engine(str(checkpoint), str(engines), "torch")


def prepared_of(executor, questions: dict, image: bytes | None = None):
    from runtime.strict_json import parse_body

    body = request_body(image or pattern_png(320, 224), questions, "image/png")
    return executor.prepare(parse_body(body))


def test_a_twelve_question_request_is_one_mostly_full_pass(executor) -> None:
    work = packing.plan(prepared_of(executor, speed_bench_questions(12)))
    assert len(work.passes) == 1
    assert work.tokens / work.slots >= 0.75
    (only,) = work.passes
    rows = int((only.row_length > 0).sum())
    assert only.size == packing.pack_size(only.used, rows) and only.used == work.tokens
    # text rows first, each option row's parent one of them, rows end to end
    texts = int((only.row_parent[: only.row_length.nonzero()[0].size] < 0).sum())
    assert texts == 12 and (only.row_parent[:texts] == -1).all()
    lengths = only.row_length[only.row_length > 0]
    assert lengths.sum() == only.used
    assert (only.row_start[1 : lengths.size] == np.cumsum(lengths)[:-1]).all()


def test_the_tokens_every_option_begins_with_end_the_text_row_once(executor) -> None:
    """255 options "option 0" … "option 254": `<|opt|>`, "option" and the space once, at the
    end of the text row, each option row the rest of its block (its close at least), the
    reads of the shared tokens taken from the text row: 1,024 slots where whole blocks took
    1,792."""
    from bench.workloads import choice_with

    prepared = prepared_of(executor, choice_with(255))
    layout = prepared.layouts[0]
    shared = packing.shared_length(layout)
    assert shared == 3 and layout.token_ids[layout.opens[0]] == 248077
    (only,) = packing.plan(prepared).passes
    assert only.size == 1024
    text = int(only.row_length[0])
    for k in (0, 1, 254):
        row = 1 + k
        block = layout.token_ids[layout.opens[k] : layout.closes[k] + 1]
        start, n = int(only.row_start[row]), int(only.row_length[row])
        assert list(only.input_ids[start : start + n]) == list(block[shared:])
        assert only.read_rows[only.options.u_read[(0, k)]] == start + n - 1  # its close
        reads = [only.targets[i] for i in only.options.text_reads[(0, k)]]
        # "option" read at <|opt|>, the space at "option", each digit at the token before it
        assert reads[:2] == [(text - 3, block[1]), (text - 2, block[2])]
        assert reads[2] == (text - 1, block[3])
        assert [r[0] for r in reads[3:]] == list(range(start, start + len(reads) - 3))
    zq = only.read_rows[only.question.zq_read[0]]
    assert zq == text - 1 - shared and only.input_ids[zq + 1] == 248077


def test_pack_sizes_hold_every_pass_and_rows_fit_their_tables() -> None:
    assert packing.pack_size(1, 1) == packing.PACK_SIZES[0]
    assert packing.pack_size(257, 2) == 384
    assert packing.pack_size(100, 80) == 384  # 80 rows need a table of 96
    with pytest.raises(ValueError, match="at most 8192 tokens"):
        packing.pack_size(8193, 1)


def test_questions_past_the_largest_pass_go_on_in_the_next(executor) -> None:
    """64 long questions: passes of at most the largest size, every question's rows in one
    pass, each question's text read once, the passes filled in question order."""
    text = "Is the highlighted element the one a careful user would pick here? " * 25
    questions = {f"q{i}": {"type": "noul", "instructions": f"{i}: {text}"} for i in range(64)}
    work = packing.plan(prepared_of(executor, questions))
    assert len(work.passes) > 1
    assert all(p.used <= p.size <= packing.MAX_PACK for p in work.passes)
    reads = [qi for p in work.passes for qi in p.question.zq_read]
    assert reads == list(range(64))
    for p in work.passes:
        parents = p.row_parent[p.row_length > 0]
        texts = len(p.question.members)
        assert (parents[:texts] == -1).all() and (parents[texts:] < texts).all()


def test_every_answer_is_the_same_bytes_alone_together_in_any_order_and_batched(
    executor,
) -> None:
    """The torch backend's packed passes on the CPU: a question asked alone, with its request's
    other questions in two orders, and in a batch with another request's rows (each reading its
    own image prefix) gives the same answer bytes."""
    from runtime.executor import Executor

    assert executor.choices.packed
    questions = speed_bench_questions(12)
    image = pattern_png(320, 224)
    whole = without_latency(executor.execute(prepared_of(executor, questions, image)))
    for qid, question in questions.items():
        alone = executor.execute(prepared_of(executor, {qid: question}, image))
        assert without_latency(alone)[qid] == whole[qid], qid
    order = list(questions.items())
    random.Random(0).shuffle(order)
    shuffled = without_latency(executor.execute(prepared_of(executor, dict(order), image)))
    assert shuffled == whole
    other = prepared_of(executor, gate_questions(), pattern_png(224, 320))
    mine = prepared_of(executor, questions, image)
    together = Executor.readouts_batch(executor, [other, mine])
    answers = executor.respond(mine, together[1], 0.0)
    assert without_latency(answers) == whole


def test_the_products_check_names_each_shape_whose_rows_move_with_the_pass_size() -> None:
    """`products_differ`: this machine's products keep a row's bytes at every pass size for
    each weight shape of a layer of each kind (fused weights too); a library whose sums change
    order below 384 rows is caught at 256, shape by shape."""
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    from build_engines.presets import config_kwargs
    from runtime.model.language import DecoderLayer
    from runtime.model.packed import products_differ

    tc = config_kwargs("tiny")["text_config"]
    torch.manual_seed(0)
    layers = [DecoderLayer(tc, kind, "eager") for kind in tc["layer_types"]]
    for layer in layers:
        (layer.self_attn if layer.kind == "full_attention" else layer.linear_attn).fuse()
        layer.mlp.fuse()
    module = SimpleNamespace(layers=layers)
    assert products_differ(module, packing.PACK_SIZES) == []

    def reordered(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, w)
        return y if x.shape[0] < 384 else y + 1e-3

    # the fused weights and the outputs' (o_proj, out_proj, down_proj), not the fused views
    attention, delta = layers[tc["layer_types"].index("full_attention")], layers[0]
    read = [attention.self_attn.qkv, attention.self_attn.o_proj.weight, delta.linear_attn.in_proj]
    read += [delta.linear_attn.out_proj.weight, delta.mlp.gate_up, delta.mlp.down_proj.weight]
    shapes = {tuple(t.shape) for t in read}
    differ = products_differ(module, packing.PACK_SIZES, multiply=reordered)
    assert differ == [f"{n}x{k} at 256 rows" for n, k in sorted(shapes)]
