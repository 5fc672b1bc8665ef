"""Calibration sources and checks: a checkpoint's head_meta.json, the export manifest's block, ECE.

`head_meta` follows the reference's `MSO1.__init__` (docs/contract.md §7.1); the manifest block is
docs/contract.md §8.2-8.3; `expected_calibration_error` is the usual equal-width-bin ECE.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.finish import Calibration
from runtime.types import QUESTION_TYPES

DEFAULT_TEMPERATURE = 1.0  # MSO1: `temperature` absent (or no head_meta.json) means no scaling
DEFAULT_NOUL_BIAS = 0.0  # MSO1: no `biases.noul` means no log-odds shift
# OptionScorer's constructor default; the reference reads `norm` through `head_norm_of`,
# whose default is not in the spec (assumption)
DEFAULT_NORM = "sigmoid"
ECE_BINS = 10  # the customary ten equal-width bins


@dataclass(frozen=True)
class HeadMeta:
    """What MSO1 takes from head_meta.json: calibration and the head flags."""

    calibration: Calibration
    lm_feats: bool
    ordinal: bool
    norm: str


def head_meta(meta: dict) -> HeadMeta:
    """Parse a head_meta.json object as MSO1.__init__ does; a non-noul bias is refused."""
    temp = float(meta.get("temperature", DEFAULT_TEMPERATURE))
    given = meta.get("temperatures") or {}
    temperatures = {t: float(given.get(t, temp)) for t in QUESTION_TYPES}
    biases = meta.get("biases") or {}
    stray = sorted(k for k in biases if k != "noul")
    if stray:
        # a constant shift cannot move a renormalized softmax over several options
        raise ValueError(f"head_meta.json has biases for {', '.join(stray)}; only noul is allowed")
    bias = float(biases.get("noul", DEFAULT_NOUL_BIAS))
    return HeadMeta(
        calibration=Calibration(temperatures, bias),
        lm_feats=bool(meta.get("lm_feats")),
        ordinal=bool(meta.get("ordinal")),
        norm=str(meta.get("norm", DEFAULT_NORM)),
    )


def read_head_meta(path: str | Path) -> HeadMeta:
    """head_meta.json of a checkpoint directory (or the file itself); defaults when absent."""
    path = Path(path)
    if path.is_dir():
        path = path / "head_meta.json"
    if not path.exists():
        return head_meta({})
    return head_meta(json.loads(path.read_text(encoding="utf-8")))


def calibration_from_manifest(manifest: dict) -> Calibration:
    """The export manifest's `calibration` block: three positive finite temperatures, a bias."""
    block = manifest.get("calibration")
    temps = block.get("temperatures") if isinstance(block, dict) else None
    bias = block.get("noul_bias") if isinstance(block, dict) else None
    if not isinstance(temps, dict) or sorted(temps) != sorted(QUESTION_TYPES):
        raise ValueError("export manifest calibration is invalid")
    values = [temps[t] for t in QUESTION_TYPES] + [bias]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ValueError("export manifest calibration is invalid")
    if not all(math.isfinite(v) for v in values) or min(values[:-1]) <= 0:
        raise ValueError("export manifest calibration is invalid")
    return Calibration({t: float(temps[t]) for t in QUESTION_TYPES}, float(bias))


def expected_calibration_error(probs, outcomes, bins: int = ECE_BINS) -> float:
    """ECE = Σ_b (n_b/N)·|mean outcome − mean probability| over equal-width bins of [0, 1].

    `probs` are predicted probabilities of an event (a Noul's P(yes), or a top answer's
    confidence); `outcomes` are 1/0 (or observed frequencies). Bin b holds b/B ≤ p < (b+1)/B;
    p = 1 goes to the last bin. Empty bins add nothing."""
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    y = np.asarray(outcomes, dtype=np.float64).reshape(-1)
    if p.size == 0 or p.shape != y.shape or bins < 1:
        raise ValueError("ece needs matching non-empty inputs and at least one bin")
    if not (np.all((p >= 0) & (p <= 1)) and np.all((y >= 0) & (y <= 1))):
        raise ValueError("ece inputs must lie in [0, 1]")
    which = np.minimum((p * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in range(bins):
        members = which == b
        if members.any():
            gap = abs(y[members].mean() - p[members].mean())
            total += members.sum() / p.size * gap
    return float(total)
