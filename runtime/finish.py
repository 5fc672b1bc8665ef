"""Calibration and finishing: one question's mu → its answer dict (docs/contract.md §3, §7).

Follows the reference's `MSO1._finish` and `_scale` and `choice_outputs` / `jev_confidence`,
reproducing their float32 tensor steps, Python 3.10 float sums and `round(x, 4)` bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from runtime.errors import ExecutionError
from runtime.heads import Heads, question_mu, questions_mu
from runtime.types import Calibration, Question, QuestionReadout

# v1.1 head_meta.json (contract §7.1; the reference README prints the bias as 0.0531085661).

DIGITS = 4  # every answer number is round(x, 4) (contract §7.6)
IDENTITY_SLACK = 1e-6  # _scale returns its input unchanged when |t − 1| is below this
SCALE_FLOOR = 1e-9  # _scale floors each entry before raising it to 1/t
NOUL_CLAMP = 1e-9  # _finish clamps p0 into [1e-9, 1 − 1e-9] before taking its log-odds
LOGIT_LIMIT = 40.0  # _finish clamps the biased log-odds into [−40, 40]
# choice_outputs compares the float32 sum with 1 + 1e-5; torch casts the scalar to float32
VALID_LIMIT = np.float32(1.0 + 1e-5)
SCORE_SUM_FLOOR = np.float32(1e-6)  # choice_outputs(allow_abstain=False): mu / s.clamp(min=1e-6)

# torch.sum of a contiguous float32 CPU vector (ATen SumKernel.cpp `cascade_sum`): vectors of
# TORCH_VEC_FLOATS lanes summed by `row_sum` with TORCH_ILP interleaved accumulators, each a
# cascade of TORCH_LEVELS levels flushed every 2**TORCH_LEVEL_POWER rows; the tail, then the
# lanes, are added to a scalar. Shorter vectors go through the same `row_sum` one float at a time.
# 8 lanes: torch 2.13 on an AVX-512 CPU matches this emulation on every length tried (1..69, 127,
# 255, 1020), i.e. the sum runs its 256-bit kernel; 16 lanes does not.
TORCH_VEC_FLOATS = 8
TORCH_ILP = 4
TORCH_LEVELS = 4
TORCH_LEVEL_POWER = 4  # max(4, ceil(log2(rows)) // 4): 4 for any row count below 2**20


def round4(x: float) -> float:
    """Python's correctly rounded round(x, 4) of a float64 (ties to even on the binary value)."""
    return round(float(x), DIGITS)


def python310_sum(values: Sequence[float]) -> float:
    """Left-to-right float64 sum from 0, as Python 3.10's `sum` (3.12+ compensates)."""
    total = 0
    for v in values:
        total = total + v
    return total


def torch_sum_f32(values: np.ndarray) -> np.float32:
    """float32 sum of a vector in torch's CPU order (see TORCH_VEC_FLOATS)."""
    x = np.asarray(values, dtype=np.float32).reshape(-1)
    n = x.shape[0]
    if n < TORCH_VEC_FLOATS:
        return np.float32(_row_sum(x))
    whole = n // TORCH_VEC_FLOATS * TORCH_VEC_FLOATS
    lanes = _row_sum(x[:whole].reshape(-1, TORCH_VEC_FLOATS))
    total = np.float32(0)
    for v in x[whole:]:
        total = np.float32(total + v)
    for v in lanes:
        total = np.float32(total + v)
    return total


def _row_sum(items: np.ndarray) -> np.ndarray:
    """ATen `row_sum`: TORCH_ILP interleaved cascades, the remainder into the first, then fold."""
    rows = items.shape[0] // TORCH_ILP
    acc = list(_multi_row_sum(items[: rows * TORCH_ILP].reshape(rows, TORCH_ILP, *items.shape[1:])))
    for item in items[rows * TORCH_ILP :]:
        acc[0] = acc[0] + item
    for k in range(1, TORCH_ILP):
        acc[0] = acc[0] + acc[k]
    return acc[0]


def _multi_row_sum(rows: np.ndarray) -> np.ndarray:
    """ATen `multi_row_sum`: per-column cascade of TORCH_LEVELS accumulators."""
    step = 1 << TORCH_LEVEL_POWER
    zero = np.zeros(rows.shape[1:], np.float32)
    acc = [zero.copy() for _ in range(TORCH_LEVELS)]
    i = 0
    while i + step <= rows.shape[0]:
        for _ in range(step):
            acc[0] = acc[0] + rows[i]
            i += 1
        for j in range(1, TORCH_LEVELS):
            acc[j] = acc[j] + acc[j - 1]
            acc[j - 1] = zero.copy()
            if i & ((step - 1) << (j * TORCH_LEVEL_POWER)):
                break
    for row in rows[i:]:
        acc[0] = acc[0] + row
    for j in range(1, TORCH_LEVELS):
        acc[0] = acc[0] + acc[j]
    return acc[0]


def scale(values: Sequence[float], temperature: float) -> list[float]:
    """`_scale`: p^(1/t) renormalized with Python floats; unchanged when t is 1."""
    if abs(temperature - 1.0) < IDENTITY_SLACK:
        return [float(v) for v in values]
    # Python's ** (C pow), not np.power: NumPy may use a SIMD pow that rounds differently
    w = [max(SCALE_FLOOR, float(v)) ** (1.0 / temperature) for v in values]
    z = python310_sum(w)
    return [v / z for v in w]


def jev_confidence(probs: np.ndarray) -> np.float32:
    """(K·max − 1)/(K − 1) clamped to [0, 1] in float32; 1 below two entries."""
    k = probs.shape[0]
    if k < 2:
        return np.float32(1.0)
    c = (np.float32(k) * probs.max() - np.float32(1.0)) / np.float32(k - 1)
    return np.float32(min(max(c, np.float32(0.0)), np.float32(1.0)))


def first_argmax(values: Sequence[float]) -> int:
    """Index of the first maximum, as `max(range(K), key=...)`."""
    return max(range(len(values)), key=lambda j: values[j])


def _check_mu(mu, keys: Sequence[str]) -> np.ndarray:
    mu = np.asarray(mu, dtype=np.float32)
    if mu.ndim != 1 or mu.shape[0] == 0 or mu.shape[0] != len(keys):
        raise ExecutionError("invalid head output")
    if not np.isfinite(mu).all():
        raise ExecutionError("invalid head output")
    return mu


def noul_probability(mu: np.ndarray, calibration: Calibration) -> float:
    """P(yes) after the log-odds bias and the temperature, unrounded (`MSO1._finish`)."""
    p0 = float(mu[0])
    bias = calibration.noul_bias
    if bias:
        p0 = min(max(p0, NOUL_CLAMP), 1.0 - NOUL_CLAMP)
        z = max(-LOGIT_LIMIT, min(LOGIT_LIMIT, math.log(p0 / (1.0 - p0)) + bias))
        p0 = 1.0 / (1.0 + math.exp(-z))
    return scale([p0, 1.0 - p0], calibration.temperatures["noul"])[0]


def _noul(mu: np.ndarray, calibration: Calibration) -> dict:
    return {"noul": round4(noul_probability(mu, calibration))}


def choice_probabilities(
    mu: np.ndarray, calibration: Calibration
) -> tuple[np.ndarray, np.float32, bool]:
    """Calibrated option probabilities, abstain and validity, unrounded (`choice_outputs`)."""
    s = torch_sum_f32(mu)
    valid = bool(s <= VALID_LIMIT)
    if valid:
        probs, abstain = mu, max(np.float32(1.0) - s, np.float32(0.0))
    else:
        probs, abstain = (mu / s).astype(np.float32), np.float32(0.0)
    full = scale([float(p) for p in probs] + [float(abstain)], calibration.temperatures["choice"])
    # the reference stores back with torch.tensor: float32
    return np.array(full[:-1], dtype=np.float32), np.float32(full[-1]), valid


def _choice(keys: Sequence[str], mu: np.ndarray, calibration: Calibration) -> dict:
    probs, abstain, valid = choice_probabilities(mu, calibration)
    values = [float(p) for p in probs]
    confidence = jev_confidence(np.append(probs, abstain))
    return {
        "choice": keys[first_argmax(values)],
        "probabilities": {key: round4(p) for key, p in zip(keys, values, strict=True)},
        "abstain": round4(abstain),
        "valid": valid,
        "confidence": round4(confidence),
    }


def score_probabilities(mu: np.ndarray, calibration: Calibration) -> list[float]:
    """Calibrated level probabilities, unrounded (`choice_outputs` without abstain)."""
    s = torch_sum_f32(mu)
    probs = (mu / max(s, SCORE_SUM_FLOOR)).astype(np.float32)
    full = scale([float(p) for p in probs] + [0.0], calibration.temperatures["score"])
    values = [float(p) for p in np.array(full[:-1], dtype=np.float32)]
    total = python310_sum(values) or 1.0
    return [p / total for p in values]  # float64 renormalization over the levels


def _score(keys: Sequence[str], mu: np.ndarray, calibration: Calibration) -> dict:
    values = score_probabilities(mu, calibration)
    return {
        "score": keys[first_argmax(values)],
        "probabilities": {key: round4(p) for key, p in zip(keys, values, strict=True)},
        "confidence": round4(jev_confidence(np.array(values, dtype=np.float32))),
    }


def finish_answer(
    question_type: str,
    keys: Sequence[str],
    mu,
    calibration: Calibration,
    latency_s: float = 0.0,
    latency_total_s: float = 0.0,
) -> dict:
    """The answer object of one question, fields in contract §3's order."""
    calibration.validate()
    return with_latency(
        answer_fields(question_type, keys, mu, calibration), latency_s, latency_total_s
    )


def answer_fields(question_type: str, keys: Sequence[str], mu, calibration: Calibration) -> dict:
    """`finish_answer` without the latency fields, which come last (`with_latency`)."""
    mu = _check_mu(mu, keys)
    if question_type == "noul":
        return _noul(mu, calibration)
    if question_type == "choice":
        return _choice(keys, mu, calibration)
    if question_type == "score":
        return _score(keys, mu, calibration)
    raise ExecutionError("invalid head output")


def with_latency(fields: dict, latency_s: float, latency_total_s: float) -> dict:
    """An answer's fields, then its two latency fields (contract §3's order)."""
    return {**fields, "latency_s": round4(latency_s), "latency_total_s": round4(latency_total_s)}


def answer_question(
    heads: Heads,
    calibration: Calibration,
    question: Question,
    readout: QuestionReadout,
    latency_s: float,
    latency_total_s: float,
    ordinal: bool = True,
    lm_feats: bool = True,
) -> dict:
    """LM features and heads, then finishing, for one question."""
    calibration.validate()
    mu = question_mu(heads, question.type, readout, ordinal=ordinal, lm_feats=lm_feats)
    return finish_answer(question.type, question.keys, mu, calibration, latency_s, latency_total_s)


def answer_questions(
    heads: Heads,
    calibration: Calibration,
    questions: Sequence[Question],
    readouts: Sequence[QuestionReadout],
    latency_s: float,
    latency_total_s: float,
    ordinal: bool = True,
    lm_feats: bool = True,
) -> list[dict]:
    """`answer_question` of every question, the heads' large Linears applied layer by layer
    (`questions_mu`): the same answers, faster for many questions."""
    calibration.validate()
    items = [(q.type, r) for q, r in zip(questions, readouts, strict=True)]
    mus = questions_mu(heads, items, ordinal=ordinal, lm_feats=lm_feats)
    return [
        with_latency(answer_fields(q.type, q.keys, mu, calibration), latency_s, latency_total_s)
        for q, mu in zip(questions, mus, strict=True)
    ]
