"""`questions_mu` and `answer_questions` (the heads layer by layer over a request's questions)
give `question_mu` and `answer_question`'s bytes and refusals (issue 13: heads and finishing)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import ExecutionError
from runtime.finish import Calibration, answer_question, answer_questions
from runtime.heads import (
    HEAD_LINEARS,
    Heads,
    head_shapes,
    lm_features,
    options_features,
    question_mu,
    questions_mu,
)
from runtime.types import Question, QuestionReadout

TYPES = ("noul", "choice", "score")


def random_heads(hidden: int, seed: int = 0) -> Heads:
    rng = np.random.default_rng(seed)
    shapes = head_shapes(hidden)
    return Heads({n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s in shapes.items()})


def readout(rng: np.random.Generator, hidden: int, options: int) -> QuestionReadout:
    picked = [-rng.random(int(rng.integers(0, 4))).astype(np.float32) for _ in range(options)]
    return QuestionReadout(
        zq=rng.standard_normal(hidden).astype(np.float32),
        u=rng.standard_normal((options, hidden)).astype(np.float32),
        picked=picked,
        first=[None if p.size == 0 else -0.25 for p in picked],
    )


def mixed(rng: np.random.Generator, hidden: int, count: int) -> list[tuple[str, QuestionReadout]]:
    items = []
    for i in range(count):
        kind = TYPES[i % 3]
        items.append((kind, readout(rng, hidden, 1 if kind == "noul" else int(rng.integers(2, 9)))))
    return items


@pytest.mark.parametrize("hidden", [64, 2560])
@pytest.mark.parametrize(("ordinal", "lm_feats"), [(True, True), (False, True), (True, False)])
def test_layer_by_layer_gives_the_same_bytes(hidden, ordinal, lm_feats):
    heads, rng = random_heads(hidden), np.random.default_rng(hidden)
    items = mixed(rng, hidden, 12)
    together = questions_mu(heads, items, ordinal=ordinal, lm_feats=lm_feats)
    for (kind, r), mu in zip(items, together, strict=True):
        alone = question_mu(heads, kind, r, ordinal=ordinal, lm_feats=lm_feats)
        assert mu.dtype == alone.dtype and mu.tobytes() == alone.tobytes()


def test_refusals_come_in_question_order():
    heads, rng = random_heads(64), np.random.default_rng(1)
    items = mixed(rng, 64, 4)
    bad = QuestionReadout(np.full(64, np.nan, np.float32), items[2][1].u, [], [])
    with pytest.raises(ExecutionError, match="invalid head input"):
        questions_mu(heads, [items[0], ("choice", bad), items[3]])
    with pytest.raises(ExecutionError, match="invalid head input"):
        questions_mu(heads, [items[0], ("other", items[1][1])])


def test_an_output_refusal_together_is_the_questions_own():
    """Every input taken, the second question's output overflows: the questions together are
    refused as that question alone is, with the output's message."""
    heads, rng = random_heads(64), np.random.default_rng(5)
    items = mixed(rng, 64, 4)
    first = items[0][1]
    huge = QuestionReadout(first.zq, np.full_like(first.u, 3e38), first.picked, first.first)
    with pytest.raises(ExecutionError, match="invalid head output"):
        question_mu(heads, "choice", huge)
    with pytest.raises(ExecutionError, match="invalid head output"):
        questions_mu(heads, [items[1], ("choice", huge), items[2]])


def test_answer_questions_equals_answer_question():
    heads, rng = random_heads(64), np.random.default_rng(2)
    items = mixed(rng, 64, 6)
    questions = [
        Question(f"q{i}", kind, "?", keys, keys)
        for i, (kind, r) in enumerate(items)
        for keys in [tuple(f"k{j}" for j in range(r.u.shape[0]))]
    ]
    readouts = [r for _, r in items]
    calibration = Calibration.v11()
    together = answer_questions(heads, calibration, questions, readouts, 0.25, 0.5)
    pairs = zip(questions, readouts, strict=True)
    alone = [answer_question(heads, calibration, q, r, 0.25, 0.5) for q, r in pairs]
    assert together == alone


def questions_of(items: list[tuple[str, QuestionReadout]]) -> list[Question]:
    return [
        Question(f"q{i}", kind, "?", keys, keys)
        for i, (kind, r) in enumerate(items)
        for keys in [tuple(f"k{j}" for j in range(r.u.shape[0]))]
    ]


def test_a_refusal_is_raised_in_question_order():
    """`answer_questions` raises an earlier question's output refusal before a later
    question's input refusal, as `answer_question` of that question alone."""
    heads, rng = random_heads(64), np.random.default_rng(4)
    items = mixed(rng, 64, 5)
    first = items[1][1]
    huge = np.full_like(first.u, 3e38)  # every input taken, the output overflows
    items[1] = ("choice", QuestionReadout(first.zq, huge, first.picked, first.first))
    questions, readouts = questions_of(items), [r for _, r in items]
    readouts[3].zq = np.full_like(readouts[3].zq, np.nan)  # a later question's input refusal
    with pytest.raises(ExecutionError, match="invalid head output"):
        answer_questions(heads, Calibration.v11(), questions, readouts, 0.25, 0.5)
    with pytest.raises(ExecutionError, match="invalid head output"):  # as alone
        answer_question(heads, Calibration.v11(), questions[1], readouts[1], 0.25, 0.5)


def test_every_layer_stacks_and_gives_each_question_its_own_bytes():
    """On this machine's MKL (strict mode) the wide Linears are row-invariant from 4 rows on,
    and the 1-wide ones as NARROW_WIDTH-wide products, so `questions_mu` runs each over all
    questions' rows in one product. The bytes are each question's alone either way."""
    heads, rng = random_heads(2560), np.random.default_rng(7)
    if heads.stackable != frozenset(HEAD_LINEARS):
        pytest.skip(f"MKL here is not row-invariant: {sorted(heads.stackable)}")
    items = mixed(rng, 2560, 12)
    together = questions_mu(heads, items)
    for (kind, r), mu in zip(items, together, strict=True):
        assert mu.tobytes() == question_mu(heads, kind, r).tobytes()


def test_layers_that_are_not_row_invariant_are_not_stacked(monkeypatch):
    """A Linear whose rows follow the row count (here: made so) fails the load-time check and
    keeps one product a question, still each question's own bytes."""
    import torch

    plain = torch.nn.functional.linear

    def by_row_count(x, weight, bias=None):
        return plain(x, weight, bias) + x.shape[0] * 1e-3

    monkeypatch.setattr(torch.nn.functional, "linear", by_row_count)
    heads, rng = random_heads(64), np.random.default_rng(8)
    assert heads.stackable == frozenset()
    items = mixed(rng, 64, 6)
    together = questions_mu(heads, items)
    for (kind, r), mu in zip(items, together, strict=True):
        assert mu.tobytes() == question_mu(heads, kind, r).tobytes()


# -- the MLPs on a device (Heads.use_device; on the CPU here, the same code as on CUDA) --------


@pytest.mark.parametrize("hidden", [64, 2560])
def test_device_mlps_give_each_question_the_hosts_bytes(hidden):
    """DEVICE_ROWS-row products over every question's rows give what the host gives a question
    alone: 12 mixed questions, and 255 options of one Choice (four products)."""
    heads, rng = random_heads(hidden), np.random.default_rng(hidden + 1)
    items = mixed(rng, hidden, 12) + [("choice", readout(rng, hidden, 255))]
    alone = [question_mu(heads, kind, r) for kind, r in items]
    assert heads.use_device("cpu") and heads.device_mlps is not None
    together = questions_mu(heads, items)
    for mu, own in zip(together, alone, strict=True):
        assert mu.tobytes() == own.tobytes()


def test_device_mlps_keep_the_refusals_in_question_order():
    heads, rng = random_heads(64), np.random.default_rng(3)
    items = mixed(rng, 64, 4)
    assert heads.use_device("cpu")
    bad = QuestionReadout(items[1][1].zq, np.full_like(items[1][1].u, np.inf), [], [])
    with pytest.raises(ExecutionError, match="invalid head input"):
        questions_mu(heads, [items[0], ("choice", bad), items[3]])


def test_device_mlps_that_disagree_with_the_host_are_refused():
    """A device whose products are not the host's (here: a weight off by 1e-3, as reduced
    precision would be) fails the check at load and the heads stay on the host."""
    from runtime.heads import DeviceMLPs

    class Skewed(DeviceMLPs):
        def __init__(self, heads, device):
            super().__init__(heads, device)
            weight, bias = self.t["head.opt.0"]
            self.t["head.opt.0"] = (weight + 1e-3, bias)

    heads = random_heads(64)
    assert not heads.use_device("cpu", Skewed) and heads.device_mlps is None


def test_device_mlps_whose_rows_follow_their_neighbours_are_refused(monkeypatch):
    """A product whose rows depend on the other rows (here: made so) fails the check."""
    import torch

    plain = torch.nn.functional.linear

    def by_first_row(x, weight, bias=None):
        return plain(x, weight, bias) + x[:1, :1] * 1e-3

    heads = random_heads(64)
    monkeypatch.setattr(torch.nn.functional, "linear", by_first_row)
    assert not heads.use_device("cpu")


def test_device_mlps_that_fail_to_start_leave_the_heads_on_the_host():
    """A device whose MLPs raise while made (a graph it would not capture) is refused, and
    the heads answer as before."""
    from runtime.heads import DeviceMLPs

    class Fails(DeviceMLPs):
        def __init__(self, heads, device):
            raise RuntimeError("capture refused")

    heads, rng = random_heads(64), np.random.default_rng(4)
    items = mixed(rng, 64, 3)
    alone = [question_mu(heads, kind, r) for kind, r in items]
    assert not heads.use_device("cpu", Fails) and heads.device_mlps is None
    together = questions_mu(heads, items)
    assert [mu.tobytes() for mu in together] == [mu.tobytes() for mu in alone]


def test_narrow_layers_are_plain_linears_within_a_float32_rounding():
    """A 1-wide Linear as a NARROW_WIDTH-wide product (zero weight rows) is nn.Linear's output,
    up to the order the product sums in."""
    import torch

    heads, rng = random_heads(2560), np.random.default_rng(9)
    x = rng.standard_normal((37, 1024)).astype(np.float32)
    weight, bias = heads.t["head.score.weight"], heads.t["head.score.bias"]
    plain = torch.nn.functional.linear(torch.from_numpy(x), weight, bias).numpy()
    made = heads._dense("head.score", x)
    assert made.shape == (37, 1)
    np.testing.assert_allclose(made, plain, rtol=1e-5, atol=1e-6)


def test_features_of_several_questions_are_each_questions_own():
    rng = np.random.default_rng(10)
    questions = [(r.picked, r.first) for _, r in mixed(rng, 8, 9)]
    together = options_features(questions)
    alone = np.concatenate([lm_features(picked, first) for picked, first in questions])
    assert together.tobytes() == alone.tobytes()


def test_mlp_outputs_a_readout_brings_are_used_in_place_of_the_heads_own():
    """`QuestionReadout.mlps` (made on the device behind the passes) stand in for the MLPs:
    the bytes the heads would make give the same mu without the MLPs running; other values
    move the mu; a readout that brings only some of its MLPs has the rest made."""
    from runtime.heads import mlp_names

    heads, rng = random_heads(64), np.random.default_rng(5)
    items = mixed(rng, 64, 6)
    expected = questions_mu(heads, items)
    for kind, r in items:
        zq_mlp, u_mlp = mlp_names(kind)
        r.mlps = {zq_mlp: heads._mlp(zq_mlp, r.zq[None, :]), u_mlp: heads._mlp(u_mlp, r.u)}

    def refused(*args):
        raise AssertionError("the MLPs ran")

    heads._mlp = refused  # every MLP output comes from the readouts
    together = questions_mu(heads, items)
    assert [m.tobytes() for m in together] == [m.tobytes() for m in expected]
    kind, r = items[1]
    r.mlps = {name: values + np.float32(0.5) for name, values in r.mlps.items()}
    assert questions_mu(heads, [items[1]])[0].tobytes() != expected[1].tobytes()
    del heads._mlp
    r.mlps = {mlp_names(kind)[0]: r.mlps[mlp_names(kind)[0]]}  # one of its two: both made here
    assert questions_mu(heads, [items[1]])[0].tobytes() == expected[1].tobytes()


def test_mlps_behind_give_applys_bytes_and_are_refused_where_they_do_not():
    """`DeviceMLPs.behind` (rows already on the device, not waited for) gives each row the
    bytes `apply` gives it; where it did not at load, the executor does not use it."""
    import torch

    from runtime.heads import DEVICE_ROWS, DeviceMLPs

    heads = random_heads(64)
    assert heads.use_device("cpu") and heads.device_mlps.behind_usable
    mlps = heads.device_mlps
    x = torch.randn(3 * DEVICE_ROWS, 64, generator=torch.Generator().manual_seed(2))
    for name in ("head.opt", "ord.cut"):
        made = mlps.behind({name: x})[name]
        assert torch.equal(made, mlps.mlp_on_host_rows(name, x))
        assert made.shape == (3 * DEVICE_ROWS, mlps.widths[f"{name}.2"])

    class SkewedBehind(DeviceMLPs):
        def behind(self, rows):
            return {name: values + 1 for name, values in super().behind(rows).items()}

    assert heads.use_device("cpu", SkewedBehind) and not heads.device_mlps.behind_usable
