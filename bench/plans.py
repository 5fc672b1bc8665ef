"""What the packed-pass planner makes of the traffic suite, as the torch backend runs it
(`python -m bench.gpu plans`, any device): each request's packed passes, their token slots and
the tokens that fill them, and the packed sizes (PACK_SIZES) the stream uses. Plans follow the
tokenizer and the image sizes alone, so the tiny checkpoint on the CPU gives the 4b's."""

from __future__ import annotations

import statistics
from collections import Counter

from bench import traffic
from runtime.packing import PackedPlan, plan
from runtime.passes import Plan
from runtime.strict_json import parse_body
from runtime.types import Prepared

FULL_REQUEST = 12  # the bench's largest request: its questions, reported apart


def gpu_plan(prepared: Prepared) -> PackedPlan:
    """The plan the torch backend runs (on any device): packed passes."""
    return plan(prepared)


def request_row(prepared: Prepared, work: PackedPlan | Plan) -> dict:
    """A request's passes, their token slots and the slots its tokens fill: a packed plan's
    (with each pass's size), or the portable engines' rectangles (rows × tokens a pass)."""
    row = {"questions": len(prepared.layouts), "prefix_tokens": work.prefix_length}
    if isinstance(work, PackedPlan):
        sizes = [p.size for p in work.passes]
        return {**row, "passes": len(sizes), "slots": work.slots, "tokens": work.tokens,
                "sizes": sizes}  # fmt: skip
    parts = [(qp.rows, qp.members) for qp in work.questions]
    parts += [(op.rows, op.members) for op in work.options]
    slots = sum(int(rows.input_ids.size) for rows, _ in parts)
    tokens = sum(int(rows.lengths[: len(members)].sum()) for rows, members in parts)
    return {**row, "passes": len(parts), "slots": slots, "tokens": tokens}


def plans(executor, seed: int, count: int, questions: int | None = None) -> dict:
    """The first `count` suite requests of `seed`, packed: a row each."""
    rows = []
    for index in range(count):
        made = traffic.request(seed, index, questions=questions)
        prepared = executor.prepare(parse_body(made.body))
        rows.append(
            {"index": index, "size": list(made.size), **request_row(prepared, plan(prepared))}
        )
    return {"requests": rows, "summary": summary(rows)}


def filled(rows: list[dict]) -> float | None:
    """The share of these requests' token slots that hold tokens (None for no request)."""
    slots = sum(r["slots"] for r in rows)
    return sum(r["tokens"] for r in rows) / slots if slots else None


def summary(rows: list[dict]) -> dict:
    """Passes a request, the slots filled overall and for FULL_REQUEST-question requests, and
    how many passes each packed size ran."""
    passes = [r["passes"] for r in rows]
    full = [r for r in rows if r["questions"] == FULL_REQUEST]
    used = Counter(size for r in rows for size in r["sizes"])
    return {
        "passes_median": statistics.median(passes),
        "passes_mean": statistics.fmean(passes),
        "passes_max": max(passes),
        "filled": filled(rows),
        f"filled_{FULL_REQUEST}_questions": filled(full),
        f"requests_{FULL_REQUEST}_questions": len(full),
        "sizes": {str(size): used[size] for size in sorted(used)},
    }


def table(record: dict) -> str:
    """The requests' passes and filled slots, then the packed sizes used."""
    s, count = record["summary"], len(record["requests"])
    full = s[f"filled_{FULL_REQUEST}_questions"]
    full_text = "no such request" if full is None else f"{full:.0%}"
    lines = [
        f"requests {count}: passes median {s['passes_median']}, mean {s['passes_mean']:.2f}, "
        f"max {s['passes_max']}; token slots holding tokens {s['filled']:.0%}, "
        f"{FULL_REQUEST}-question requests ({s[f'requests_{FULL_REQUEST}_questions']}) "
        f"{full_text}",
        f"packed sizes used: {len(s['sizes'])}",
        "| packed size | passes |",
        "| ---: | ---: |",
    ]
    lines += [f"| {size} | {n} |" for size, n in s["sizes"].items()]
    return "\n".join(lines)
