"""Several prepared requests as one: requests about the same image prefix run their questions in
the passes of one request, and each gets back its own questions' readouts.

Exact by the planner's rule (runtime.passes): the shape a question runs in, and its rows' bytes,
never depend on the other questions, so a question's readouts are the same bytes whether its
request ran alone or with others.
"""

from __future__ import annotations

from runtime.contract import MAX_QUESTIONS, MAX_ROWS
from runtime.types import Prepared


def batch_size(prepared: Prepared) -> float:
    """A request's share of a batch: its questions or its option rows, whichever is the larger
    part of what one request may ask (docs/contract.md §2.2), so that a batch never asks more
    than the largest single request."""
    rows = sum(len(layout.rows) for layout in prepared.layouts)
    return max(len(prepared.layouts) / MAX_QUESTIONS, rows / MAX_ROWS)


def merged(batch: list[Prepared]) -> Prepared:
    """One request holding every question of `batch`, in order; the requests share one image
    prefix (the same `image_key`), so the first's image stands for all."""
    first = batch[0]
    keys = {prepared.image_key for prepared in batch}
    if len(keys) != 1 or None in keys:
        raise ValueError("a merged batch needs one image prefix")
    return Prepared(
        image=first.image,
        layouts=tuple(layout for prepared in batch for layout in prepared.layouts),
        prefix_length=first.prefix_length,
        input_tokens=sum(prepared.input_tokens for prepared in batch),
        image_key=first.image_key,
    )


def split(readouts: list, batch: list[Prepared]) -> list[list]:
    """The merged request's per-question `readouts` back as one list per request of `batch`."""
    made, at = [], 0
    for prepared in batch:
        count = len(prepared.layouts)
        made.append(readouts[at : at + count])
        at += count
    return made
