"""The first request about each image size the warm-up never saw, against the same request
once its shapes are built (`python -m bench.gpu sizes`): what a new size costs inside a
request, and the shape builds it made."""

from __future__ import annotations

import statistics
import time

from bench import traffic
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
    for index, size in enumerate(UNSEEN[:count]):
        made = traffic.request(seed, index, "held-out", questions=questions, size=size)
        first, builds, build_s = timed(executor, made.body)
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
            }
        )
    return {"rows": rows}


def table(record: dict) -> str:
    lines = [
        "| size | format | questions | first ms | warm ms | first / warm | builds | build s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in record["rows"]:
        w, h = r["size"]
        lines.append(
            f"| {w}×{h} | {r['format']} | {r['questions']} | {r['first_ms']:.1f} | "
            f"{statistics.median(r['warm_ms']):.1f} | {r['ratio']:.2f} | {r['builds']} | "
            f"{r['build_s']:.2f} |"
        )
    return "\n".join(lines)
