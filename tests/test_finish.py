"""Finishing against the reference's `MSO1._finish` outputs (finish.json, docs/contract.md §7)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from runtime.errors import ExecutionError
from runtime.finish import (
    Calibration,
    answer_question,
    finish_answer,
    python310_sum,
    round4,
    scale,
    torch_sum_f32,
)
from tests.spec import ANSWER_FIELDS, FIXTURES

FINISH = json.loads((FIXTURES / "finish.json").read_text())
TOLERANCE = 1.0001e-4  # contract §7.6: beyond four options the 4th decimal may move by one
CLOSE_TOP = 2e-4  # ... and the key may differ when the reference's top two are this close


def fixture_calibration() -> Calibration:
    return Calibration(dict(FINISH["temperatures"]), FINISH["biases"]["noul"])


def answer_of(case: dict) -> dict:
    answer = finish_answer(case["type"], case["keys"], case["mu"], fixture_calibration())
    del answer["latency_total_s"]  # the fixture predates the field
    return answer


def assert_near(actual: dict, expected: dict) -> None:
    top = sorted(expected.get("probabilities", {}).values(), reverse=True)
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, dict):
            assert list(got) == list(want)
            for k in want:
                assert abs(got[k] - want[k]) <= TOLERANCE, (key, k)
        elif isinstance(want, float) and not isinstance(want, bool):
            assert abs(got - want) <= TOLERANCE, key
        elif len(top) > 1 and top[0] - top[1] <= CLOSE_TOP:
            continue
        else:
            assert got == want, key


@pytest.mark.parametrize("index", range(len(FINISH["cases"])))
def test_fixture_case(index: int) -> None:
    case = FINISH["cases"][index]
    answer = answer_of(case)
    if len(case["keys"]) <= 4:
        assert answer == case["answer"]
    else:
        assert_near(answer, case["answer"])


def test_all_fixture_cases_are_exact() -> None:
    # stronger than the contract's tolerance: with torch's summation order all 18 match
    exact = [answer_of(c) == c["answer"] for c in FINISH["cases"]]
    assert len(exact) == 18 and all(exact)


def test_calibration_v11_equals_fixture() -> None:
    assert Calibration.v11() == fixture_calibration()


@pytest.mark.parametrize("qtype", ["noul", "choice", "score"])
def test_field_order(qtype: str) -> None:
    keys = ["yes"] if qtype == "noul" else ["a", "b"]
    mu = [0.4] if qtype == "noul" else [0.3, 0.6]
    answer = finish_answer(qtype, keys, mu, Calibration.v11(), 0.03125, 0.2469)
    assert list(answer) == ANSWER_FIELDS[qtype]
    assert answer["latency_s"] == 0.0312 and answer["latency_total_s"] == 0.2469
    assert json.dumps(answer).startswith(f'{{"{qtype}": ')


@pytest.mark.parametrize(
    ("x", "expected"),
    [(0.03125, 0.0312), (0.09375, 0.0938), (0.5, 0.5), (0.99995, 1.0), (1e-9, 0.0)],
)
def test_round4_matches_contract(x: float, expected: float) -> None:
    assert round4(x) == expected


def test_python310_sum_is_not_compensated() -> None:
    values = [1e16, 1.0, -1e16]
    assert python310_sum(values) == 0.0
    assert math.fsum(values) == 1.0
    assert python310_sum([0.1] * 10) == 0.9999999999999999


def test_scale_identity_and_floor() -> None:
    assert scale([0.2, 0.8], 1.0000001) == [0.2, 0.8]
    out = scale([0.5, 0.0], 2.0)
    assert out[1] == pytest.approx(math.sqrt(1e-9) / (math.sqrt(0.5) + math.sqrt(1e-9)))


def test_torch_sum_order_differs_from_sequential() -> None:
    # five values: torch adds x4 into the first of four accumulators, not last
    x = np.array([1.0, 1e8, -1e8, 0.0, 1.0], np.float32)
    sequential = np.float32(0)
    for v in x:
        sequential = np.float32(sequential + v)
    assert sequential == np.float32(1.0)
    assert torch_sum_f32(x) == np.float32(0.0)  # (1 + 1) + 1e8 − 1e8 loses the twos


@pytest.mark.parametrize("n", [1, 3, 4, 5, 7, 8, 9, 12, 31, 32, 33, 64, 127, 255, 1020])
def test_torch_sum_matches_torch(n: int) -> None:
    torch = pytest.importorskip("torch")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the emulated order is torch's x86 kernel")
    rng = np.random.default_rng(n)
    for _ in range(5):
        x = (rng.random(n) * rng.choice([1e-4, 1.0, 1e4], n)).astype(np.float32)
        assert torch_sum_f32(x) == torch.from_numpy(x).sum().numpy()


def test_choice_over_one_is_invalid() -> None:
    answer = finish_answer("choice", list("abcde"), [0.3, 0.3, 0.2, 0.15, 0.1], Calibration.v11())
    assert answer["valid"] is False and answer["abstain"] == 0.0
    assert answer["choice"] == "a"  # ties go to the first key


BAD_CALIBRATIONS = [
    Calibration(dict(Calibration.v11().temperatures), float("nan")),
    Calibration({"noul": 1.0, "choice": 1.0}, 0.0),
    *[
        Calibration({**Calibration.v11().temperatures, qtype: bad}, 0.0)
        for bad in (0.0, -1.0, float("nan"), float("inf"))
        for qtype in ("noul", "choice", "score")
    ],
]


@pytest.mark.parametrize("calibration", BAD_CALIBRATIONS)
@pytest.mark.parametrize("qtype", ["noul", "choice", "score"])
def test_invalid_calibration(calibration: Calibration, qtype: str) -> None:
    keys, mu = (["yes"], [0.3]) if qtype == "noul" else (["a", "b"], [0.3, 0.6])
    with pytest.raises(ExecutionError, match="^invalid calibration$"):
        finish_answer(qtype, keys, mu, calibration)


@pytest.mark.parametrize(
    ("qtype", "keys", "mu"),
    [
        ("choice", [], []),
        ("choice", ["a", "b"], [0.5]),
        ("choice", ["a"], [0.5, 0.2]),
        ("choice", ["a", "b"], [0.5, float("nan")]),
        ("score", ["a", "b"], [0.5, float("inf")]),
        ("noul", ["yes"], [float("nan")]),
        ("noul", ["yes"], [[0.5]]),
        ("other", ["a"], [0.5]),
    ],
)
def test_invalid_head_output(qtype: str, keys: list, mu: list) -> None:
    with pytest.raises(ExecutionError, match="^invalid head output$"):
        finish_answer(qtype, keys, mu, Calibration.v11())


def small_heads(hidden: int = 16):
    from runtime.heads import Heads, head_shapes

    rng = np.random.default_rng(11)
    tensors = {
        name: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        for name, shape in head_shapes(hidden).items()
    }
    return Heads(tensors)


@pytest.mark.parametrize(
    ("qtype", "keys", "picked"),
    [
        ("noul", ("yes",), [[]]),
        ("choice", ("a", "b", "c"), [[-1.0, -2.0], [-0.5], []]),
        ("score", ("low", "high"), [[], []]),
    ],
)
def test_answer_question_end_to_end(qtype: str, keys: tuple, picked: list) -> None:
    from runtime.types import Question, QuestionReadout

    heads = small_heads()
    rng = np.random.default_rng(5)
    question = Question("q", qtype, "x", keys, keys)
    readout = QuestionReadout(
        zq=rng.standard_normal(16).astype(np.float32),
        u=rng.standard_normal((len(keys), 16)).astype(np.float32),
        picked=[np.array(p, np.float32) for p in picked],
        first=[p[0] if p else None for p in picked],
    )
    answer = answer_question(heads, Calibration.v11(), question, readout, 0.25, 0.5)
    assert list(answer) == ANSWER_FIELDS[qtype]
    assert (answer["latency_s"], answer["latency_total_s"]) == (0.25, 0.5)
    # the answer follows the readout: another question state moves it
    moved = replace(readout, zq=readout.zq + 1.0)
    assert answer_question(heads, Calibration.v11(), question, moved, 0.25, 0.5) != answer
    if qtype == "choice":  # the picked log-probabilities reach it as LM features, and only so
        louder = replace(readout, picked=[p - 3.0 for p in readout.picked])
        assert answer_question(heads, Calibration.v11(), question, louder, 0.25, 0.5) != answer
        plain = [
            answer_question(heads, Calibration.v11(), question, r, 0, 0, lm_feats=False)
            for r in (readout, louder)
        ]
        assert plain[0] == plain[1]
    if qtype != "noul":
        assert answer[qtype] in keys
        assert list(answer["probabilities"]) == list(keys)
