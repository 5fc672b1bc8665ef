"""Shared by the wire-format tests: one real worker on the tiny checkpoint's ONNX Runtime engines
a module, the pattern images, and the native route's answers to compare with."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from reference.questions import data_url, pattern_png
from runtime import panels
from tests.server_helpers import ThreadServer, wait_ready

FIXTURE = Path(__file__).parent / "fixtures" / "wire" / "panels.json"
# the panel fixture's images: three sizes, so that the cells, the thumbnails and the grid differ
PANEL_SIZES = {
    "two": [(64, 48), (40, 80)],
    "five": [(64, 48), (40, 80), (900, 300), (30, 30)] + [(50, 50)],
}
IMAGE = data_url(pattern_png(64, 48))
MODEL = "tinnel123/OmniJev"
INSTRUCTIONS = {
    "noul": "A person is visible.",
    "choice": "Which operation comes next?",
    "score": "How severe is the issue?",
}
CHOICES = {"click": None, "wait": "wait for the page to load", "scroll": None}
LEVELS = ["minor", "normal", "major", "critical"]


def served_tiny(tmp_path_factory) -> Iterator[str]:
    """The URL of a real worker over runtime.executor on the tiny model, for one module."""
    from runtime import executor
    from tests.engine_fixtures import tiny_engines  # built once a run, shared with other modules

    export, engines = tiny_engines(tmp_path_factory)
    engine = executor.load_engine(str(export), str(engines), "onnxruntime")
    with ThreadServer(engine) as server:
        wait_ready(server.url)
        yield server.url


def native_questions() -> dict:
    """The three questions in the native contract's form."""
    return {
        "present": {"type": "noul", "instructions": INSTRUCTIONS["noul"]},
        "next": {"type": "choice", "instructions": INSTRUCTIONS["choice"], "criteria": CHOICES},
        "severity": {"type": "score", "instructions": INSTRUCTIONS["score"], "levels": LEVELS},
    }


def native_answers(url: str, images: list[str]) -> dict:
    """The native route's answers for the image the formats make of `images`."""
    body = {"state": {"images": [panels.one_image(images)]}, "questions": native_questions()}
    response = httpx.post(url + "/v1/systemone", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["answers"]


def renormalised(probabilities: dict[str, float]) -> list[float]:
    """A native Choice's option probabilities without the abstain share, as the formats give
    them (README: the abstain share)."""
    total = sum(probabilities.values())
    return [round(p / total, 4) for p in probabilities.values()]


def expected_level(probabilities: list[float]) -> float:
    return round(sum(i * p for i, p in enumerate(probabilities)) / sum(probabilities), 4)


def panel_record(sizes: list[tuple[int, int]]) -> dict:
    """What the fixture pins of one panel: its size, its pixels' and its JPEG's SHA-256."""
    urls = [data_url(pattern_png(w, h)) for w, h in sizes]
    picture = panels.tile([panels.thumbnail(url) for url in urls])
    jpeg = panels.panel_jpeg(urls)
    with Image.open(io.BytesIO(jpeg)) as decoded:
        assert decoded.size == picture.size
    return {
        "sizes": sizes,
        "panel_size": list(picture.size),
        "pixels_sha256": hashlib.sha256(np.asarray(picture).tobytes()).hexdigest(),
        "jpeg_sha256": hashlib.sha256(jpeg).hexdigest(),
    }


def write_fixture() -> None:
    """`python -m tests.wire_helpers`: writes tests/fixtures/wire/panels.json from docs/model.md
    §8.2's rule as runtime.panels follows it."""
    cases = {name: panel_record(sizes) for name, sizes in PANEL_SIZES.items()}
    FIXTURE.write_text(json.dumps(cases, indent=1) + "\n", "utf-8")


if __name__ == "__main__":
    write_fixture()
