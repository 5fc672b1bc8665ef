"""Calibration of the heads' probabilities: reading head_meta.json and the export manifest's
calibration block (the reference's `MSO1.__init__`, docs/contract.md §7.1, §8.2), checking it (ECE)
and fitting the per-type temperatures to labelled head outputs (`calibration.fit`).
"""

from calibration.meta import (
    HeadMeta,
    calibration_from_manifest,
    expected_calibration_error,
    head_meta,
    read_head_meta,
)

__all__ = [
    "HeadMeta",
    "calibration_from_manifest",
    "expected_calibration_error",
    "head_meta",
    "read_head_meta",
]
