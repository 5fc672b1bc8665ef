"""Several prepared requests as one: their questions run in the passes of one request, each row
reading its own image's prefix, and each request gets back its own questions' readouts.

Exact by the planner's rule (runtime.passes): the shape a question runs in, and its rows' bytes,
never depend on the other questions; and a row reads its image prefix by its index
(`Pass.prefix_rows`), the same keys and values as alone. So a question's readouts are the same
bytes whether its request ran alone or with others, where the backend's kernels keep that rule on
the machine: `same_readouts` is what the executor checks before it merges any
(`Executor.check_batches`).
"""

from __future__ import annotations

from runtime.contract import MAX_QUESTIONS, MAX_ROWS
from runtime.types import Prepared


def readout_bytes(readouts: list) -> list[bytes]:
    """What each question's answer is made of (`QuestionReadout`: zq, u, the picked
    log-probabilities, the first tokens'), as bytes."""
    return [
        b"".join([r.zq.tobytes(), r.u.tobytes(), *(p.tobytes() for p in r.picked)])
        + repr(r.first).encode()
        for r in readouts
    ]


def same_readouts(a: list, b: list) -> bool:
    """Whether two runs of one request gave its questions the same readout bytes."""
    return readout_bytes(a) == readout_bytes(b)


def batch_size(prepared: Prepared, prefixes: int = 1) -> float:
    """A request's share of a batch: its questions or its option rows, whichever is the larger
    part of what one request may ask (docs/contract.md §2.2), so that a batch never asks more
    than the largest single request; and, where a pass reads at most `prefixes` image
    prefixes, at least 1/`prefixes`, so that a batch never holds more images."""
    rows = sum(len(layout.rows) for layout in prepared.layouts)
    shares = [len(prepared.layouts) / MAX_QUESTIONS, rows / MAX_ROWS]
    if prefixes > 1:
        shares.append(1 / prefixes)
    return max(shares)


def merged(batch: list[Prepared]) -> tuple[Prepared, list[Prepared]]:
    """(one request holding every question of `batch` in order, the request of each image its
    rows read): requests about one image (`image_key`) share its prefix, the first of them
    standing for it; `Prepared.owners` numbers the images in order of first appearance."""
    if any(prepared.image_key is None for prepared in batch):
        raise ValueError("a merged batch needs every request's image key")
    images: dict[str, Prepared] = {}
    owners = []
    for prepared in batch:
        images.setdefault(prepared.image_key, prepared)  # type: ignore[arg-type]
        owners += [list(images).index(prepared.image_key)] * len(prepared.layouts)
    request = Prepared(
        image=batch[0].image,
        layouts=tuple(layout for prepared in batch for layout in prepared.layouts),
        prefix_length=batch[0].prefix_length,
        input_tokens=sum(prepared.input_tokens for prepared in batch),
        image_key=batch[0].image_key,
        owners=tuple(owners),
    )
    return request, list(images.values())


def split(readouts: list, batch: list[Prepared]) -> list[list]:
    """The merged request's per-question `readouts` back as one list per request of `batch`."""
    made, at = [], 0
    for prepared in batch:
        count = len(prepared.layouts)
        made.append(readouts[at : at + count])
        at += count
    return made
