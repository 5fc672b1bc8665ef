"""`omnijev calibrate --plot`: the reliability diagram's bins and the PNG drawn from them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from PIL import Image

from calibration.fit import Record, fit, plot_reliability, top_answers
from calibration.plot import COLORS, PANEL, reliability
from runtime.finish import Calibration


def noul_records(n: int, seed: int, sharpen: float) -> list[Record]:
    """Noul records whose labels follow p ** (1 / sharpen), so the stated p is miscalibrated."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        p = float(rng.uniform(0.02, 0.98))
        q = p ** (1 / sharpen) / (p ** (1 / sharpen) + (1 - p) ** (1 / sharpen))
        records.append(Record("noul", np.array([p], np.float32), int(rng.random() < q)))
    return records


def test_bins_count_every_record_and_lie_in_the_unit_square() -> None:
    records = noul_records(500, 0, 0.5)
    bins = reliability(*top_answers(records, Calibration.v11()))
    assert sum(b.count for b in bins) == 500
    assert all(0.5 <= b.confidence <= 1 and 0 <= b.accuracy <= 1 for b in bins)
    assert [b.confidence for b in bins] == sorted(b.confidence for b in bins)


def test_fitting_brings_the_bins_towards_the_diagonal() -> None:
    records = noul_records(3000, 1, 0.5)
    start = Calibration.v11()
    fitted, _ = fit(records, start)

    def gap(calibration: Calibration) -> float:
        bins = reliability(*top_answers(records, calibration))
        return sum(b.count * abs(b.accuracy - b.confidence) for b in bins) / len(records)

    assert gap(fitted) < gap(start)


def test_the_png_has_a_panel_per_type_with_both_curves(tmp_path) -> None:
    rng = np.random.default_rng(3)
    records = noul_records(300, 2, 0.6)
    for _ in range(300):
        mu = rng.dirichlet(np.ones(4)).astype(np.float32)
        records.append(Record("score", mu, int(rng.choice(4, p=mu / mu.sum()))))
    fitted, _ = fit(records, Calibration.v11())
    path = plot_reliability(records, Calibration.v11(), fitted, tmp_path / "r.png")
    image = Image.open(path).convert("RGB")
    assert image.width > 2 * PANEL  # two panels: noul and score
    colors = {color for _, color in image.getcolors(image.width * image.height)}
    assert COLORS["before"] in colors and COLORS["after"] in colors


def test_the_command_line_writes_the_plot(tmp_path) -> None:
    records = tmp_path / "records.jsonl"
    lines = [
        {"type": r.type, "mu": r.mu.tolist(), "label": r.label} for r in noul_records(200, 4, 0.7)
    ]
    records.write_text("\n".join(json.dumps(line) for line in lines))
    plot = tmp_path / "reliability.png"
    command = [sys.executable, "-m", "runtime.cli", "calibrate", str(records), "--plot", str(plot)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    assert f"reliability diagram: {plot}" in result.stdout
    assert Image.open(plot).format == "PNG"
