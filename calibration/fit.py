"""Fits the per-type temperatures of the finishing arithmetic to labelled head outputs and reports
how calibrated the answers are before and after (negative log-likelihood and ECE).

The probabilities are the runtime's own (`runtime.finish`: the reference's `_finish` with its bias,
`_scale` and float32 round trips), so a fitted temperature means what it means at serving time.
Records are JSON lines: {"type": "noul"|"choice"|"score", "mu": [...], "label": L}, with L = 1/0
for a Noul (yes/no), the option index or -1 (none fits: abstain) for a Choice, the level index for
a Score. `mu` is what the heads return (`runtime.heads.question_mu`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from calibration.meta import expected_calibration_error
from runtime.finish import (
    Calibration,
    choice_probabilities,
    noul_probability,
    score_probabilities,
)

T_RANGE = (0.25, 4.0)  # temperatures searched; v1.1's are 1.12-1.20
GOLDEN_STEPS = 60  # golden-section steps on log T: the bracket shrinks by 0.618^60
PROBABILITY_FLOOR = 1e-12  # log of an answer given probability 0 stays finite


@dataclass(frozen=True)
class Record:
    type: str
    mu: np.ndarray
    label: int


def read_records(path: str | Path) -> list[Record]:
    records = []
    for n, line in enumerate(Path(path).read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if item.get("type") not in ("noul", "choice", "score"):
            raise ValueError(f"line {n}: type must be noul, choice or score")
        mu = np.asarray(item["mu"], dtype=np.float32)
        records.append(Record(item["type"], mu, int(item["label"])))
    return records


def answer_distribution(record: Record, calibration: Calibration) -> tuple[list[float], int]:
    """The calibrated distribution over the possible answers and the index of the true one."""
    if record.type == "noul":
        p = noul_probability(record.mu, calibration)
        return [1.0 - p, p], 1 if record.label else 0
    if record.type == "choice":
        probs, abstain, _ = choice_probabilities(record.mu, calibration)
        values = [float(p) for p in probs] + [float(abstain)]
        return values, record.label if record.label >= 0 else len(values) - 1
    return score_probabilities(record.mu, calibration), record.label


def negative_log_likelihood(records: list[Record], calibration: Calibration) -> float:
    total = 0.0
    for record in records:
        values, label = answer_distribution(record, calibration)
        total -= math.log(max(values[label], PROBABILITY_FLOOR))
    return total / max(len(records), 1)


def top_answers(records: list[Record], calibration: Calibration) -> tuple[np.ndarray, np.ndarray]:
    """Each record's top answer probability, and 1.0 where that answer was right, else 0.0."""
    confidences, hits = [], []
    for record in records:
        values, label = answer_distribution(record, calibration)
        top = int(np.argmax(values))
        confidences.append(values[top])
        hits.append(top == label)
    return np.array(confidences, dtype=np.float64), np.array(hits, dtype=np.float64)


def calibration_error(records: list[Record], calibration: Calibration) -> float:
    """ECE of the top answer's probability against whether it was right."""
    return expected_calibration_error(*top_answers(records, calibration))


def with_temperature(calibration: Calibration, kind: str, t: float) -> Calibration:
    return replace(calibration, temperatures={**calibration.temperatures, kind: t})


def fit_temperature(records: list[Record], calibration: Calibration, kind: str) -> float:
    """The temperature of one question type minimizing the mean negative log-likelihood."""

    def loss(log_t: float) -> float:
        return negative_log_likelihood(
            records, with_temperature(calibration, kind, math.exp(log_t))
        )

    low, high = math.log(T_RANGE[0]), math.log(T_RANGE[1])
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = loss(a), loss(b)
    for _ in range(GOLDEN_STEPS):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = loss(a)
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = loss(b)
    return math.exp((low + high) / 2.0)


def fit(records: list[Record], calibration: Calibration) -> tuple[Calibration, list[dict]]:
    """Fitted temperatures (types without records keep theirs) and a before/after report."""
    fitted, report = calibration, []
    for kind in ("noul", "choice", "score"):
        subset = [r for r in records if r.type == kind]
        if not subset:
            continue
        t = fit_temperature(subset, calibration, kind)
        after = with_temperature(calibration, kind, t)
        fitted = with_temperature(fitted, kind, t)
        report.append({
            "type": kind, "records": len(subset),
            "temperature_before": calibration.temperatures[kind], "temperature_after": t,
            "nll_before": negative_log_likelihood(subset, calibration),
            "nll_after": negative_log_likelihood(subset, after),
            "ece_before": calibration_error(subset, calibration),
            "ece_after": calibration_error(subset, after),
        })  # fmt: skip
    return fitted, report


def report_table(report: list[dict]) -> str:
    lines = [
        "| type | records | T before | T after | NLL before | NLL after | ECE before | ECE after |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report:
        lines.append(
            f"| {r['type']} | {r['records']} | {r['temperature_before']:.4f} | "
            f"{r['temperature_after']:.4f} | {r['nll_before']:.4f} | {r['nll_after']:.4f} | "
            f"{r['ece_before']:.4f} | {r['ece_after']:.4f} |"
        )
    return "\n".join(lines)


def cli_calibrate(args) -> int:
    """`omnijev calibrate RECORDS.jsonl [--checkpoint DIR] [--plot FILE.png]`: fit and report,
    and draw the reliability diagram before and after."""
    calibration = Calibration.v11()
    if args.checkpoint:
        from runtime.export_format import load_export

        calibration = load_export(Path(args.checkpoint)).calibration
    records = read_records(args.records)
    fitted, report = fit(records, calibration)
    print(report_table(report))
    print(json.dumps({"temperatures": fitted.temperatures, "noul_bias": fitted.noul_bias}))
    if getattr(args, "plot", None):
        print(f"reliability diagram: {plot_reliability(records, calibration, fitted, args.plot)}")
    return 0


def plot_reliability(
    records: list[Record], before: Calibration, after: Calibration, path: str | Path
) -> Path:
    """The reliability diagram (calibration.plot) of each question type, before and after."""
    from calibration.plot import Panel, draw_reliability

    panels = []
    for kind in ("noul", "choice", "score"):
        subset = [r for r in records if r.type == kind]
        if subset:
            curves = {"before": top_answers(subset, before), "after": top_answers(subset, after)}
            panels.append(Panel(kind, len(subset), curves))
    return draw_reliability(panels, path)
