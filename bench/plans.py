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
MERGE = 4  # vision patches an image token merges (2 × 2)


def token_products() -> tuple[int, int, int]:
    """Multiply-adds a token meets in the 4b's products (docs/model.md): a language-model token
    (every layer's projections and MLP), a vision patch (its embedding and every block), and a
    merged image token (the merger). Attention and the recurrence are left out: a few per cent
    of a language-model token's at the suite's lengths."""
    from build_engines.presets import LAYER_PATTERN, REAL_TEXT, REAL_VISION

    t, v = REAL_TEXT, REAL_VISION
    h, heads, dim = t["hidden_size"], t["num_attention_heads"], t["head_dim"]
    kv = t["num_key_value_heads"]
    dk = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    dv = t["linear_num_value_heads"] * t["linear_value_head_dim"]
    mlp = 3 * h * t["intermediate_size"]
    attention = h * (2 * heads * dim + 2 * kv * dim) + heads * dim * h  # q with its gate, k, v, o
    delta = h * (2 * dk + 2 * dv + 2 * t["linear_num_value_heads"]) + dv * h
    layers = t["num_hidden_layers"]
    full = layers * LAYER_PATTERN.count("full_attention") // len(LAYER_PATTERN)
    text = full * attention + (layers - full) * delta + layers * mlp
    width, merged = v["hidden_size"], v["hidden_size"] * MERGE
    patch = 1536 * width + v["depth"] * (4 * width * width + 2 * width * v["intermediate_size"])
    return text, patch, merged * merged + merged * v["out_hidden_size"]


def products_tflop(prepared: Prepared, work: PackedPlan) -> dict:
    """A request's products in TFLOP (2 a multiply-add): the image prefix's and the vision
    tower's, and its packed passes' over the tokens and over the token slots run."""
    text, patch, merged = token_products()
    vision = prepared.image.image_tokens * (MERGE * patch + merged)
    return {
        "tflop_tokens": round(2 * (vision + text * (work.prefix_length + work.tokens)) / 1e12, 3),
        "tflop_slots": round(2 * (vision + text * (work.prefix_length + work.slots)) / 1e12, 3),
    }


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
        work = plan(prepared)
        row = {"index": index, "size": list(made.size), **request_row(prepared, work)}
        rows.append({**row, **products_tflop(prepared, work)})
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
        "tflop_tokens_mean": statistics.fmean(r["tflop_tokens"] for r in rows),
        "tflop_slots_mean": statistics.fmean(r["tflop_slots"] for r in rows),
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
        f"products a request (4b): {s['tflop_tokens_mean']:.2f} TFLOP over its tokens, "
        f"{s['tflop_slots_mean']:.2f} over the slots run",
        f"packed sizes used: {len(s['sizes'])}",
        "| packed size | passes |",
        "| ---: | ---: |",
    ]
    lines += [f"| {size} | {n} |" for size, n in s["sizes"].items()]
    return "\n".join(lines)
