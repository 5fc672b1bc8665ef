"""The video tests' own forms of a clip (`bench.clips` makes the clips): the mosaic the reference
builds of a clip's frames, and request bodies."""

from __future__ import annotations

import io
import json
import math

import numpy as np
from PIL import Image

from reference.questions import data_url


def mosaic_state(frames: list[np.ndarray], timestamps, duration, cols: int = 4) -> dict:
    """The reference's form of these frames: one PNG mosaic, row-major, `cols` tiles a row."""
    height, width = frames[0].shape[:2]
    rows = math.ceil(len(frames) / cols)
    mosaic = np.zeros((rows * height, cols * width, 3), dtype=np.uint8)
    for index, frame in enumerate(frames):
        row, col = divmod(index, cols)
        mosaic[row * height : (row + 1) * height, col * width : (col + 1) * width] = frame
    png = io.BytesIO()
    Image.fromarray(mosaic).save(png, format="PNG")
    video = {
        "n_frames": len(frames),
        "cols": cols,
        "tile": [width, height],
        "timestamps": list(timestamps),
        "duration": duration,
    }
    return {"images": [data_url(png.getvalue())], "video": video}


def video_body(state: dict, questions: dict) -> bytes:
    return json.dumps(
        {"model": "tinnel123/OmniJev", "state": state, "questions": questions}
    ).encode()
