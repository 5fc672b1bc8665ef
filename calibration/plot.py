"""The reliability diagram of `omnijev calibrate --plot FILE.png`: per question type, the top
answer's accuracy against its confidence in ten bins, before and after the fitted temperatures.

Follows the customary reliability diagram (Guo et al. 2017, "On calibration of modern neural
networks", fig. 1) with the bins of `calibration.meta.expected_calibration_error`; drawn with
Pillow, the project's image library, so no plotting package is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from calibration.meta import ECE_BINS, expected_calibration_error

PANEL = 360  # pixels per side of one type's plot area
MARGIN = 56  # room for the axis labels around a panel
TITLE = 44  # room for a panel's title and ECE line
COLORS = {"before": (150, 150, 150), "after": (31, 119, 180)}
DIAGONAL = (200, 60, 60)
FONT_SIZE = 13
MIN_MARK = 2  # pixels of radius of a bin's point; more records draw a larger one (up to 8)


@dataclass(frozen=True)
class Bin:
    """One confidence bin: its records' mean confidence, accuracy and count."""

    confidence: float
    accuracy: float
    count: int


@dataclass(frozen=True)
class Panel:
    """One question type: its record count and, per curve name, (confidences, hits) arrays."""

    kind: str
    records: int
    curves: dict[str, tuple[np.ndarray, np.ndarray]]


def reliability(confidences: np.ndarray, hits: np.ndarray, bins: int = ECE_BINS) -> list[Bin]:
    """The non-empty bins of the top answer's confidence (b/B ≤ p < (b+1)/B, p = 1 in the last)."""
    p, y = np.asarray(confidences, np.float64), np.asarray(hits, np.float64)
    which = np.minimum((p * bins).astype(np.int64), bins - 1)
    return [
        Bin(float(p[which == b].mean()), float(y[which == b].mean()), int((which == b).sum()))
        for b in range(bins)
        if (which == b).any()
    ]


def draw_reliability(panels: list[Panel], path: str | Path) -> Path:
    """A PNG with one panel per question type, each curve in COLORS; returns its path."""
    if not panels:
        raise ValueError("no records to plot")
    width = len(panels) * (PANEL + 2 * MARGIN)
    height = PANEL + 2 * MARGIN + TITLE
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(FONT_SIZE)
    for index, panel in enumerate(panels):
        left, top = index * (PANEL + 2 * MARGIN) + MARGIN, MARGIN + TITLE
        ece = {name: expected_calibration_error(*curve) for name, curve in panel.curves.items()}
        draw.text((left, 8), f"{panel.kind}: {panel.records} records", fill="black", font=font)
        line = ", ".join(f"ECE {name} {value:.4f}" for name, value in ece.items())
        draw.text((left, 8 + FONT_SIZE + 6), line, fill="black", font=font)
        draw_axes(draw, left, top, font)
        for name, curve in panel.curves.items():
            draw_curve(draw, reliability(*curve), left, top, COLORS[name])
        legend_y = top + 6
        for name in panel.curves:
            draw.line((left + 8, legend_y + 7, left + 28, legend_y + 7), fill=COLORS[name], width=3)
            draw.text((left + 34, legend_y), name, fill="black", font=font)
            legend_y += FONT_SIZE + 6
    path = Path(path)
    image.save(path, format="PNG")
    return path


def to_pixels(left: int, top: int, x: float, y: float) -> tuple[float, float]:
    return left + x * PANEL, top + (1.0 - y) * PANEL


def draw_axes(draw: ImageDraw.ImageDraw, left: int, top: int, font: ImageFont.ImageFont) -> None:
    draw.rectangle((left, top, left + PANEL, top + PANEL), outline="black")
    for tick in range(0, 11, 2):
        value = tick / 10
        x, _ = to_pixels(left, top, value, 0)
        _, y = to_pixels(left, top, 0, value)
        draw.line((x, top + PANEL, x, top + PANEL + 4), fill="black")
        draw.text((x - 8, top + PANEL + 6), f"{value:.1f}", fill="black", font=font)
        draw.line((left - 4, y, left, y), fill="black")
        draw.text((left - 30, y - 7), f"{value:.1f}", fill="black", font=font)
    draw.line((*to_pixels(left, top, 0, 0), *to_pixels(left, top, 1, 1)), fill=DIAGONAL, width=1)
    draw.text((left + PANEL // 2 - 40, top + PANEL + 24), "confidence", fill="black", font=font)
    draw.text((left - MARGIN + 4, top - 18), "accuracy", fill="black", font=font)


def draw_curve(
    draw: ImageDraw.ImageDraw, bins: list[Bin], left: int, top: int, color: tuple
) -> None:
    points = [to_pixels(left, top, b.confidence, b.accuracy) for b in bins]
    if len(points) > 1:
        draw.line(points, fill=color, width=3)
    most = max(b.count for b in bins)
    for (x, y), b in zip(points, bins, strict=True):
        radius = MIN_MARK + 6 * b.count / most
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=color)
