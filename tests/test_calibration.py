"""head_meta.json and manifest calibration parsing (MSO1.__init__, contract §7.1, §8.2) and ECE."""

from __future__ import annotations

import json

import numpy as np
import pytest

from calibration.meta import (
    calibration_from_manifest,
    expected_calibration_error,
    head_meta,
    read_head_meta,
)
from runtime.finish import Calibration

RELEASE_META = {
    "temperature": 1.15,
    "temperatures": {"noul": 1.1991, "choice": 1.1199, "score": 1.1909},
    "biases": {"noul": 0.05310856608843584},
    "lm_feats": True,
    "ordinal": True,
    "branch": True,
    "norm": "softmax",
}


def test_release_meta() -> None:
    meta = head_meta(RELEASE_META)
    assert meta.calibration == Calibration.v11()
    assert meta.lm_feats and meta.ordinal and meta.norm == "softmax"


def test_defaults_follow_mso1() -> None:
    meta = head_meta({})
    assert meta.calibration == Calibration({"noul": 1.0, "choice": 1.0, "score": 1.0}, 0.0)
    assert not meta.lm_feats and not meta.ordinal and meta.norm == "sigmoid"


def test_single_temperature_fills_missing_types() -> None:
    meta = head_meta({"temperature": 1.3, "temperatures": {"choice": 0.9}, "biases": None})
    assert meta.calibration.temperatures == {"noul": 1.3, "choice": 0.9, "score": 1.3}
    assert meta.calibration.noul_bias == 0.0


@pytest.mark.parametrize("biases", [{"choice": 0.1}, {"noul": 0.1, "score": -0.2}])
def test_non_noul_bias_is_refused(biases: dict) -> None:
    with pytest.raises(ValueError, match="only noul"):
        head_meta({**RELEASE_META, "biases": biases})


def test_read_head_meta(tmp_path) -> None:
    (tmp_path / "head_meta.json").write_text(json.dumps(RELEASE_META))
    assert read_head_meta(tmp_path).calibration == Calibration.v11()
    assert read_head_meta(tmp_path / "head_meta.json").ordinal
    assert read_head_meta(tmp_path / "absent").calibration.noul_bias == 0.0


MANIFEST_CALIBRATION = {
    "temperatures": {"noul": 1.1991, "choice": 1.1199, "score": 1.1909},
    "noul_bias": 0.05310856608843584,
}


def test_manifest_calibration() -> None:
    manifest = {"format": "omnijev-merged/1", "calibration": MANIFEST_CALIBRATION}
    assert calibration_from_manifest(manifest) == Calibration.v11()


@pytest.mark.parametrize(
    "block",
    [
        None,
        {"temperatures": {"noul": 1.0, "choice": 1.0}, "noul_bias": 0.0},
        {"temperatures": {"noul": 1.0, "choice": 1.0, "score": 1.0, "x": 1.0}, "noul_bias": 0.0},
        {"temperatures": {"noul": 0.0, "choice": 1.0, "score": 1.0}, "noul_bias": 0.0},
        {"temperatures": {"noul": -1.0, "choice": 1.0, "score": 1.0}, "noul_bias": 0.0},
        {"temperatures": {"noul": 1.0, "choice": float("inf"), "score": 1.0}, "noul_bias": 0.0},
        {"temperatures": {"noul": 1.0, "choice": 1.0, "score": "1"}, "noul_bias": 0.0},
        {"temperatures": {"noul": 1.0, "choice": 1.0, "score": True}, "noul_bias": 0.0},
        {"temperatures": {"noul": 1.0, "choice": 1.0, "score": 1.0}, "noul_bias": float("nan")},
        {"temperatures": {"noul": 1.0, "choice": 1.0, "score": 1.0}},
    ],
)
def test_manifest_calibration_refused(block) -> None:
    with pytest.raises(ValueError, match="calibration"):
        calibration_from_manifest({"calibration": block})


def test_ece_of_perfect_calibration_is_zero() -> None:
    # in every bin the outcome frequency equals the stated probability
    probs = [0.25] * 4 + [0.75] * 4
    outcomes = [1, 0, 0, 0] + [1, 1, 1, 0]
    assert expected_calibration_error(probs, outcomes) == 0.0


def test_ece_by_hand() -> None:
    # bin [0.8, 0.9): p 0.8, 0.8, frequency 0.5 → gap 0.3 over 2 of 5
    # bin [0.1, 0.2): p 0.1, 0.1, 0.1, frequency 0 → gap 0.1 over 3 of 5
    probs = [0.8, 0.8, 0.1, 0.1, 0.1]
    outcomes = [1, 0, 0, 0, 0]
    assert expected_calibration_error(probs, outcomes) == pytest.approx(0.4 * 0.3 + 0.6 * 0.1)


def test_ece_edges_and_bins() -> None:
    # p = 1 falls in the last bin; with one bin ECE is |mean outcome − mean p|
    assert expected_calibration_error([1.0, 1.0], [1, 1]) == 0.0
    assert expected_calibration_error([0.9, 0.1], [1, 1], bins=1) == pytest.approx(0.5)
    assert expected_calibration_error([0.9, 0.1], [1, 1], bins=2) == pytest.approx(0.5)


def test_ece_detects_overconfidence() -> None:
    rng = np.random.default_rng(3)
    truth = rng.random(20000)
    outcomes = (rng.random(20000) < truth).astype(float)
    honest = expected_calibration_error(truth, outcomes)
    sharpened = expected_calibration_error(np.clip(0.5 + 1.6 * (truth - 0.5), 0, 1), outcomes)
    assert honest < 0.02 < sharpened


@pytest.mark.parametrize(
    ("probs", "outcomes", "bins"),
    [([], [], 10), ([0.5], [1, 0], 10), ([1.5], [1], 10), ([0.5], [2], 10), ([0.5], [1], 0)],
)
def test_ece_refuses_bad_input(probs, outcomes, bins) -> None:
    with pytest.raises(ValueError):
        expected_calibration_error(probs, outcomes, bins)
