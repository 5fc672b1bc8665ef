"""The wire formats the worker serves beside its native contract: each one a thin translation of
its request into the native request object and of the native answers back into its own shape.

A format module gives a `Wire`: its route, its translation and its error body. The native route's
`Wire` translates nothing, so that the three routes share one path through the worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.finish import round4 as rounded  # every number rounded as the native answers are

NATIVE_PATH = "/v1/systemone"  # docs/contract.md §1.3


class FormatError(ValueError):
    """A request the format's translation refuses: `status` and a message naming the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 422) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def unchanged(response: dict) -> dict:
    """The native route's answers: the native response itself."""
    return response


@dataclass(frozen=True)
class Translation:
    """The native request object and how to turn the native response into the format's."""

    native: dict
    answer: Callable[[dict], dict] = unchanged


@dataclass(frozen=True)
class Wire:
    """One served format: its route, its translation of a parsed body (raises FormatError), its
    error body for a status and message (and the field at fault), and the status it gives the
    native contract's refusals."""

    path: str
    translate: Callable[[dict], Translation]
    error_body: Callable[[int, str, str | None], dict]
    refusal_status: int = 422
    native_param: Callable[[str], tuple[str, str | None]] = field(
        default=lambda message: (message, None)
    )


def detail_body(status: int, message: str, param: str | None = None) -> dict:
    """The native worker's error body (docs/contract.md §1.5)."""
    return {"detail": message}


NATIVE = Wire(NATIVE_PATH, Translation, detail_body)


def normalised(probabilities: Sequence[float]) -> list[float]:
    """The probabilities divided by their sum (uniform where they sum to nothing)."""
    total = math.fsum(probabilities)
    if total <= 0:
        return [1.0 / len(probabilities)] * len(probabilities)
    return [p / total for p in probabilities]


def choice_confidence(probabilities: Sequence[float]) -> float:
    """TypeSafe's choice confidence `(max p − 1/n) / (1 − 1/n)`, 1 for one option."""
    if len(probabilities) == 1:
        return 1.0
    floor = 1.0 / len(probabilities)
    return (max(normalised(probabilities)) - floor) / (1.0 - floor)


def score_confidence(probabilities: Sequence[float]) -> float:
    """TypeSafe's score confidence `max(0, 1 − Σ p_i·|i − mode| / MAD_uniform)`, 1 for one level,
    with `MAD_uniform = Σ |i − (k−1)/2| / k` and the first most likely level as the mode."""
    k = len(probabilities)
    if k == 1:
        return 1.0
    p = normalised(probabilities)
    mode = max(range(k), key=p.__getitem__)
    spread = math.fsum(pi * abs(i - mode) for i, pi in enumerate(p))
    uniform = math.fsum(abs(i - (k - 1) / 2) for i in range(k)) / k
    return max(0.0, 1.0 - spread / uniform)


def expected_level(probabilities: Sequence[float]) -> float:
    """The score `Σ i·p_i` over the normalised level probabilities."""
    return math.fsum(i * p for i, p in enumerate(normalised(probabilities)))


def option_probabilities(answer: dict) -> list[float]:
    """A native Choice's option probabilities renormalised without its abstain share (formats
    with no abstain), rounded; a Score's as they are."""
    values = list(answer["probabilities"].values())
    return [rounded(p) for p in normalised(values)] if "abstain" in answer else values


def check_keys(obj: dict, allowed: Sequence[str], where: str, status: int = 422) -> None:
    """Refuses the first key of `obj` not in `allowed`, naming it."""
    for key in obj:
        if key not in allowed:
            name = f"{where}.{key}" if where else key
            raise FormatError(
                f"{name}: unknown field (allowed: {', '.join(allowed)})", name, status
            )


def json_type(value: Any) -> str:
    """A JSON value's type name for messages."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}
    names.update({dict: "object", type(None): "null"})
    return names.get(type(value), type(value).__name__)
