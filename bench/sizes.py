"""The first request about each image size the warm-up never saw, against the same request
once its shapes are built (`python -m bench.gpu sizes`): what a new size costs inside a
request, the shape builds it made, and its plan; the warm times fitted on the plans' passes
and token slots (what a pass and a slot cost on the machine)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench import traffic
from bench.plans import gpu_plan, request_row
from runtime.strict_json import parse_body

# (width, height): none of traffic.SIZES, the warm-up's; phones, laptops, an ultrawide, scans
UNSEEN = (
    (1080, 2400),
    (1440, 900),
    (1600, 1200),
    (2048, 1536),
    (720, 1280),
    (1000, 1000),
    (3440, 1440),
    (640, 480),
    (2880, 1800),
    (1536, 2048),
)
WARM_RUNS = 5  # runs of each request once its shapes are built
# the warm times fitted as ms ≈ a + b × passes + c × thousands of token slots (`fit`): what a
# pass costs whatever it holds, and what its slots cost (products, kernels over its rows)
FIT_TERMS = ("ms", "ms a pass", "ms a thousand slots")


def timed(executor, body: bytes) -> tuple[float, int, float]:
    """(milliseconds of the whole request, shapes built during it, their seconds)."""
    builds, seconds = executor.shape_builds()
    started = time.perf_counter()
    executor.execute(executor.prepare(parse_body(body)))
    ms = 1e3 * (time.perf_counter() - started)
    after, after_seconds = executor.shape_builds()
    return ms, after - builds, after_seconds - seconds


def sizes(
    executor, seed: int, questions: int | None, count: int = len(UNSEEN), runs: int = WARM_RUNS
) -> dict:
    """The first `count` unseen sizes' first request each, then `runs` of it warm."""
    rows = []
    for size in UNSEEN[:count]:
        made = unseen_request(seed, size, questions)
        first, builds, build_s = timed(executor, made.body)
        plan = planned(executor, made.body)
        warm = [timed(executor, made.body)[0] for _ in range(runs)]
        rows.append(
            {
                "size": list(size),
                "format": made.format,
                "questions": made.questions,
                "first_ms": first,
                "builds": builds,
                "build_s": build_s,
                "warm_ms": warm,
                "ratio": first / statistics.median(warm),
                "plan": plan,
            }
        )
    return {"rows": rows, "fit": fit(rows)}


def unseen_request(seed: int, size: tuple[int, int], questions: int | None):
    """The measured request about an UNSEEN size: the seed's held-out stream at its index."""
    return traffic.request(seed, UNSEEN.index(size), "held-out", questions=questions, size=size)


def planned(executor, body: bytes) -> dict:
    """The request's passes and token slots as the torch backend on a GPU plans them."""
    prepared = executor.prepare(parse_body(body))
    return request_row(prepared, gpu_plan(prepared))


def read_record(path: Path) -> dict:
    """A `sizes` record from its JSON file, its rows checked: ValueError says what is wrong."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: {error}") from None
    rows = record.get("rows") if isinstance(record, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: no sizes record (it has no rows)")
    for index, row in enumerate(rows):
        if not (isinstance(row, dict) and sizes_row(row)):
            raise ValueError(f"{path}: row {index} is not a row of `bench.gpu sizes`")
    return record


def sizes_row(row: dict) -> bool:
    """Whether a record's row has what `replanned` and `table` read, of the right kinds."""
    numbers = [row.get(key) for key in ("first_ms", "ratio", "build_s")]
    warm = row.get("warm_ms")
    return (
        tuple(row.get("size") or ()) in UNSEEN
        and row.get("format") in traffic.FORMATS
        and isinstance(row.get("questions"), int)
        and isinstance(row.get("builds"), int)
        and isinstance(warm, list)
        and bool(warm)
        and all(isinstance(x, int | float) for x in [*numbers, *warm])
    )


def replanned(executor, record: dict, seed: int, questions: int | None) -> dict:
    """A sizes record measured before its rows carried plans, with them and the fit: its
    requests made again (the `seed` and `questions` it was measured with) and planned here
    (plans follow the tokenizer and the image sizes, so the tiny checkpoint on the CPU gives
    the 4b's)."""
    rows = []
    for row in record["rows"]:
        size = tuple(row["size"])
        made = unseen_request(seed, size, questions)
        if (made.format, made.questions) != (row["format"], row["questions"]):
            raise ValueError(f"the {size} request is not the record's: other seed or questions")
        rows.append({**row, "plan": planned(executor, made.body)})
    return {**record, "rows": rows, "fit": fit(rows)}


def fit(rows: list[dict]) -> dict | None:
    """Least squares of the warm medians on the plans' passes and token slots, with each
    request's residual; None for fewer requests than terms."""
    if len(rows) < len(FIT_TERMS) + 1:
        return None
    terms = np.array([[1.0, r["plan"]["passes"], r["plan"]["slots"] / 1e3] for r in rows])
    warm = np.array([statistics.median(r["warm_ms"]) for r in rows])
    coefficients = np.linalg.lstsq(terms, warm, rcond=None)[0]
    residuals = warm - terms @ coefficients
    return {
        **dict(zip(FIT_TERMS, map(float, coefficients), strict=True)),
        "residual_ms": [float(x) for x in residuals],
    }


def table(record: dict) -> str:
    lines = [
        "| size | format | questions | first ms | warm ms | first / warm | builds | build s "
        "| passes | token slots | filled |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in record["rows"]:
        w, h = r["size"]
        plan = r.get("plan") or {"passes": "–", "slots": "–", "tokens": 0}
        filled = f"{plan['tokens'] / plan['slots']:.0%}" if plan["tokens"] else "–"
        lines.append(
            f"| {w}×{h} | {r['format']} | {r['questions']} | {r['first_ms']:.1f} | "
            f"{statistics.median(r['warm_ms']):.1f} | {r['ratio']:.2f} | {r['builds']} | "
            f"{r['build_s']:.2f} | {plan['passes']} | {plan['slots']} | {filled} |"
        )
    made = record.get("fit")
    if made:
        terms = " + ".join(f"{made[term]:.1f} {term}" for term in FIT_TERMS)
        spread = max(abs(x) for x in made["residual_ms"])
        lines.append(f"warm ≈ {terms} (least squares; residuals within {spread:.1f} ms)")
    return "\n".join(lines)
