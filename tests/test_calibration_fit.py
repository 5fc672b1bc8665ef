"""Temperature fitting on the runtime's own finishing arithmetic: recovers a known temperature,
improves the likelihood, and keeps the types apart."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from calibration.fit import Record, fit, negative_log_likelihood, read_records
from runtime.finish import Calibration


def tempered_choices(t_true: float, n: int, seed: int) -> list[Record]:
    """Choice records whose labels are drawn from mu sharpened by 1/t_true (abstain included)."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        logits = rng.normal(0, 2.0, size=5)
        mu = np.exp(logits) / np.exp(logits).sum()
        mu = (mu * 0.9).astype(np.float32)  # abstain takes the remaining 0.1
        full = np.append(mu, 0.1).astype(np.float64) ** (1.0 / t_true)
        label = int(rng.choice(6, p=full / full.sum()))
        records.append(Record("choice", mu, -1 if label == 5 else label))
    return records


def test_recovers_the_temperature_the_labels_were_drawn_with():
    start = Calibration.v11()
    records = tempered_choices(0.7, 3000, seed=1)
    fitted, report = fit(records, start)
    assert abs(fitted.temperatures["choice"] - 0.7) < 0.07
    assert fitted.temperatures["noul"] == start.temperatures["noul"]  # no Noul records
    (row,) = report
    assert row["nll_after"] < row["nll_before"]
    assert negative_log_likelihood(records, fitted) == row["nll_after"]


def test_noul_and_score_records(tmp_path):
    rng = np.random.default_rng(2)
    lines = []
    for _ in range(400):
        p = float(rng.uniform(0.05, 0.95))
        lines.append({"type": "noul", "mu": [p], "label": int(rng.random() < p)})
        mu = rng.dirichlet(np.ones(4)).tolist()
        lines.append({"type": "score", "mu": mu, "label": int(rng.choice(4, p=mu))})
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    records = read_records(path)
    fitted, report = fit(records, Calibration.v11())
    assert [r["type"] for r in report] == ["noul", "score"]
    for row in report:  # labels drawn from mu itself: the best temperature is near 1
        assert 0.75 < row["temperature_after"] < 1.35, row
        assert row["nll_after"] <= row["nll_before"] + 1e-12
    command = [sys.executable, "-m", "runtime.cli", "calibrate", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["temperatures"]["choice"] == 1.1199
