"""Request builders for the two published question sets (docs/contract.md §10.1, §10.2) and the
pattern image of the pixel fixtures (docs/contract.md §9.2), shared by the reference's tests and the
runtime's benchmarks."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
from PIL import Image

from runtime.constants import MODEL_ID

# docs/contract.md §10.1, exactly as `LF@984cf53 processing.json` case `mixed_speed_bench` writes
# them (text options carry their text as the key; "+ abstain" is a trailing {"abstain": true}).
_SPEED_BENCH = (
    ("q0", "choice", "Which operation comes next?", ("click", "type text", "scroll", "wait")),
    ("q1", "noul", "This screen shows an error dialog.", None),
    (
        "q2",
        "score",
        "How irreversible is the next action?",
        ("harmless", "needs care", "irreversible"),
    ),
    (
        "q3",
        "choice",
        "What is the main object?",
        ("a board", "a screen", "a person", "a robot", "a street"),
    ),
    ("q4", "noul", "The scene is indoors.", None),
    ("q5", "score", "How cluttered is the scene?", ("empty", "some", "busy", "packed")),
    ("q6", "regions", "Which region is most relevant?", None),
    ("q7", "noul", "Something in this image is moving.", None),
    ("q8", "score", "How risky is acting on this screen?", ("safe", "check first", "dangerous")),
    ("q9", "choice", "What should happen next?", ("continue", "stop", "ask a human")),
    ("q10", "noul", "The task looks finished.", None),
    ("q11", "choice", "Which colour dominates?", ("white", "black", "blue", "green", "red")),
)

# docs/contract.md §10.2 (`S1@1df4c2d recipe/omnijev/gate_questions.json`)
_LONG_START = "open the settings menu at the top of the screen and then select the {} item"
_CHOICE32 = (
    "game",
    "chart",
    "map",
    "menu",
    "photo",
    "diagram",
    "table",
    "form",
    "chat",
    "email",
    "video",
    "code",
    "terminal",
    "calendar",
    "document",
    "spreadsheet",
    "slide",
    "browser",
    "robot",
    "board",
    "phone",
    "street",
    "kitchen",
    "office",
    "forest",
    "beach",
    "city",
    "animal",
    "person",
    "car",
    "screen",
    "error",
)
_SCORE10 = (
    "pitch black",
    "very dark",
    "dark",
    "dim",
    "slightly dim",
    "neutral",
    "slightly bright",
    "bright",
    "very bright",
    "blinding",
)


def _text_options(texts: tuple[str, ...]) -> list[dict]:
    """Reference list form: each option keyed by its own text, then the skipped abstain entry."""
    return [{"key": text, "text": text} for text in texts] + [{"abstain": True}]


def _region_options() -> list[dict]:
    """q6: keys r0..r3 with boxes [200i, 100, 200i+180, 300] (docs/contract.md §10.1)."""
    boxes = [
        {"key": f"r{i}", "region": {"box": [200 * i, 100, 200 * i + 180, 300]}} for i in range(4)
    ]
    return boxes + [{"abstain": True}]


def _speed_bench_question(kind: str, instructions: str, values: tuple[str, ...] | None) -> dict:
    if kind == "noul":
        return {"type": "noul", "instructions": instructions}
    if kind == "score":
        return {"type": "score", "instructions": instructions, "levels": list(values)}
    if kind == "regions":
        return {"type": "choice", "instructions": instructions, "options": _region_options()}
    return {"type": "choice", "instructions": instructions, "options": _text_options(values)}


def speed_bench_questions(count: int = 12) -> dict[str, dict]:
    """The first `count` of the twelve speed-bench questions (1, 3, 6, 12: 4, 8, 18, 35 rows)."""
    if not 1 <= count <= len(_SPEED_BENCH):
        raise ValueError(f"count must be 1 to {len(_SPEED_BENCH)}")
    return {
        qid: _speed_bench_question(kind, text, values)
        for qid, kind, text, values in _SPEED_BENCH[:count]
    }


def gate_questions() -> dict[str, dict]:
    """The eight gate questions, 55 rows."""
    return {
        "one_token": {
            "type": "choice",
            "instructions": "Which button should be clicked next?",
            "options": _text_options(("click OK", "click Cancel", "click Close", "click Help")),
        },
        "long_start": {
            "type": "choice",
            "instructions": "What should the user do next?",
            "options": [
                {"key": key, "text": _LONG_START.format(key)}
                for key in ("first", "second", "third")
            ]
            + [{"abstain": True}],
        },
        "no_fit": {
            "type": "choice",
            "instructions": "Which animal is shown in the picture?",
            "options": _text_options(("a giraffe", "a whale", "a penguin")),
        },
        "score10": {
            "type": "score",
            "instructions": "How bright is the image overall?",
            "levels": list(_SCORE10),
        },
        "choice32": {
            "type": "choice",
            "instructions": "Which word best describes the image?",
            "options": _text_options(_CHOICE32),
        },
        "noul_day": {"type": "noul", "instructions": "The image was taken during the day."},
        "noul_people": {
            "type": "noul",
            "instructions": "There are more than three people in the image.",
        },
        "noul_region": {
            "type": "noul",
            "instructions": "There is text in this region.",
            "region": {"box": [100, 100, 700, 400]},
        },
    }


def pattern_png(width: int, height: int) -> bytes:
    """The pixel fixtures' pattern as an RGB PNG: R = (7x + 3y) mod 256, G = (x·y + 13) mod 256,
    B = ((x xor y)·5) mod 256 (docs/contract.md §9.2)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.int64)
    rgb = np.stack([(7 * x + 3 * y) % 256, (x * y + 13) % 256, ((x ^ y) * 5) % 256], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8), "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: bytes, mime: str = "image/png") -> str:
    """An inline image as the contract accepts it (docs/contract.md §2.3)."""
    return f"data:{mime};base64,{base64.b64encode(image).decode('ascii')}"


def build_request(image: bytes, questions: dict[str, dict], mime: str = "image/png") -> dict:
    """A request object for one image and the given questions, in their order."""
    return {"model": MODEL_ID, "state": {"images": [data_url(image, mime)]}, "questions": questions}


def request_body(image: bytes, questions: dict[str, dict], mime: str = "image/png") -> bytes:
    """The same request as the UTF-8 JSON body a client posts."""
    return json.dumps(build_request(image, questions, mime), ensure_ascii=False).encode("utf-8")
