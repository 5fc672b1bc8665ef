"""`omnijev explain`: shows what preparation makes of a request, without running the model.

Writes the field names of the reference fixture `processing.json` (docs/contract.md §9.1), so that
its output can be compared with the reference's own preparation value for value.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from runtime.errors import BodyError, ContractError
from runtime.processing import IMAGE_PAD_ID, prepare
from runtime.types import PreparedImage, PreparedVideo, QuestionLayout, Row

REFUSED_EXIT = 1  # a 400 or 422 refusal
UNREADABLE_EXIT = 2  # the request file or the checkpoint's tokenizer could not be used


def sha256_hex(array: np.ndarray, dtype: str) -> str:
    """SHA-256 of the array's bytes as little-endian `dtype`, row-major (the fixture's layout)."""
    return hashlib.sha256(np.ascontiguousarray(array, dtype=dtype).tobytes()).hexdigest()


def collapse_image_run(ids: tuple[int, ...]) -> list[int]:
    """Token ids with each run of image pads written as one negative count, as the fixture does."""
    out: list[int] = []
    for token in ids:
        if token != IMAGE_PAD_ID:
            out.append(token)
        elif out and out[-1] < 0:
            out[-1] -= 1
        else:
            out.append(-1)
    return out


def row_fields(row: Row) -> dict:
    return {
        "tokens": list(row.tokens),
        "zq": row.zq,
        "u": row.u,
        "targets": [list(target) for target in row.targets],
        "first": row.first,
    }


def question_fields(layout: QuestionLayout) -> dict:
    question = layout.question
    return {
        "id": question.id,
        "type": question.type,
        "keys": list(question.keys),
        "option_text": list(question.option_texts),
        "prompt": layout.prompt,
        "token_ids": collapse_image_run(layout.token_ids),
        "opens": list(layout.opens),
        "closes": list(layout.closes),
        "positions_sha256": sha256_hex(layout.positions, "<i8"),
        "rows": [row_fields(row) for row in layout.rows],
    }


def explain(body: bytes, tokenizer: Tokenizer) -> dict:
    """Parses, compiles and prepares a request body; raises BodyError or ContractError."""
    from runtime.contract import compile_request
    from runtime.strict_json import parse_body

    prepared = prepare(compile_request(parse_body(body)), tokenizer)
    image = prepared.image
    totals = {"prefix_length": prepared.prefix_length, "input_tokens": prepared.input_tokens}
    if isinstance(image, PreparedVideo):  # each frame as an image, in order
        frames = [image_fields(frame) for frame in image.frames]
        seen = {"timestamps": list(image.timestamps), "duration": image.duration}
        totals["video"] = {**seen, "frames": frames}
    else:
        totals.update(image_fields(image))
    return {**totals, "questions": [question_fields(layout) for layout in prepared.layouts]}


def image_fields(image: PreparedImage) -> dict:
    return {
        "image_size": [image.width, image.height],
        "image_grid_thw": list(image.grid_thw),
        "pixel_values_shape": list(image.pixel_values.shape),
        "pixel_values_sha256": sha256_hex(image.pixel_values, "<f4"),
    }


def cli_explain(args: argparse.Namespace) -> int:
    """Prints the explanation as JSON; a refusal prints the worker's message to stderr."""
    from runtime.tokenizer import check_tokenizer, load_tokenizer

    try:
        body = Path(args.request).read_bytes()
        checkpoint = Path(args.checkpoint) if args.checkpoint else None
        tokenizer = load_tokenizer(checkpoint)
        check_tokenizer(tokenizer)
    except (OSError, ValueError) as error:
        print(error, file=sys.stderr)
        return UNREADABLE_EXIT
    try:
        result = explain(body, tokenizer)
    except (BodyError, ContractError) as error:
        print(error, file=sys.stderr)
        return REFUSED_EXIT
    # UTF-8 whatever the locale: prompts and option texts hold any Unicode.
    sys.stdout.buffer.write(json.dumps(result, ensure_ascii=False, indent=1).encode() + b"\n")
    sys.stdout.flush()
    return 0
