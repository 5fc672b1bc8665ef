"""The requests the worker answers before it reports ready (docs/contract.md §1.2): a small PNG and
one question of each type, so that the first client finds its shapes' sessions and graphs built;
then the same questions about it and a second image as one batch, so that a batch's are built too.
"""

from __future__ import annotations

import base64
import io

import numpy as np

from runtime.constants import MODEL_ID

WARM_UP_SIZE = (96, 64)  # the worker's warm-up image (docs/contract.md §1.2)
WARM_UP_BLUE = 128  # its blue channel
COMPANION_BLUE = 64  # the second image of the warm-up batch: other pixels, the same shapes


def warm_up_image(blue: int = WARM_UP_BLUE) -> str:
    """The worker's warm-up image: a 96×64 PNG whose pixel (x, y) is RGB (x, y, `blue`)."""
    from PIL import Image

    w, h = WARM_UP_SIZE
    x, y = np.meshgrid(np.arange(w), np.arange(h))
    rgb = np.stack([x, y, np.full_like(x, blue)], axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def warm_up_companion() -> dict:
    """The warm-up request about a second image of the same size, which the worker runs with the
    warm-up request as one batch before it reports ready: two image prefixes a pass."""
    return warm_up_request(COMPANION_BLUE)


def warm_up_request(blue: int = WARM_UP_BLUE) -> dict:
    """The request the worker runs before it reports ready (docs/contract.md §1.2)."""
    return {
        "model": MODEL_ID,
        "state": {"images": [warm_up_image(blue)]},
        "questions": {
            "noul": {
                "type": "noul",
                "instructions": "The image is mostly blue.",
                "region": {"box": [0, 0, 48, 32]},
            },
            "choice": {
                "type": "choice",
                "instructions": "Which colour dominates?",
                "criteria": {"red": None, "green": "Mostly green", "blue": None},
            },
            "score": {
                "type": "score",
                "instructions": "How bright is the image?",
                "levels": ["dark", "medium", "bright"],
            },
        },
    }
