"""What the pass planner makes of the traffic suite, as the torch backend on a GPU runs it
(`python -m bench.gpu plans`, any device): each request's passes, their token slots and the
tokens that fill them, and how many shapes the GPU's graphs are keyed by over the stream, with
the misses of the runtime's graph caches. Plans follow the tokenizer and the image sizes alone,
so the tiny checkpoint on the CPU gives the 4b's."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator

from bench import traffic
from runtime.backends.compiled import GRAPH_SLOTS, IMAGE_SLOTS, LANES
from runtime.config import QUESTION_BATCH
from runtime.image_prefix import VISION_TABLES
from runtime.lru import LRU
from runtime.passes import (
    JointPass,
    OptionPass,
    Plan,
    QuestionPass,
    bucket_joints,
    empty_pass,
    larger_joints,
    longest_prefix,
    plan,
)
from runtime.run_passes import lane_of
from runtime.strict_json import parse_body
from runtime.types import Prepared
from runtime.warm_up import warm_up_companion, warm_up_request


def gpu_plan(prepared: Prepared) -> Plan:
    """The plan the torch backend makes on a GPU: fitted joint passes, full question batches."""
    return plan(prepared, QUESTION_BATCH, fit=True, joint=True)


def request_row(prepared: Prepared, work: Plan) -> dict:
    """A request's passes, their token slots (rows × tokens), the slots its tokens fill, and
    where the others go: `filler` rows (a fitted pass rounds its rows up to a power of two),
    `padding` after a row's tokens (its length bucket), and question texts `repeated` (a
    question's text runs again in each joint pass that reads it)."""
    parts = [(qp.rows, qp.members) for qp in work.questions]
    parts += [(op.rows, op.members) for op in work.options]
    parts += [(part.rows, part.members) for jp in work.joint for part in (jp.question, jp.options)]
    slots = filler = padding = 0
    for rows, members in parts:
        count, length = len(members), rows.shape[1]
        slots += int(rows.input_ids.size)
        filler += (rows.shape[0] - count) * length
        padding += count * length - int(rows.lengths[:count].sum())
    repeated, seen = 0, set()
    for text in [*work.questions, *(jp.question for jp in work.joint)]:
        lengths = text.rows.lengths
        repeated += sum(int(lengths[r]) for r, qi in enumerate(text.members) if qi in seen)
        seen |= set(text.members)
    return {
        "questions": len(prepared.layouts),
        "passes": len(work.questions) + len(work.options) + len(work.joint),
        "slots": slots,
        "tokens": slots - filler - padding,
        "filler": filler,
        "padding": padding,
        "repeated": repeated,
        "prefix_tokens": work.prefix_length,
    }


def graph_keys(prepared: Prepared, work: Plan) -> Iterator[tuple[str, tuple]]:
    """(cache, key) of every graph the request replays: its decoded image size (the image
    graph's slots), its patch grid (the vision tables), its prefix pass's shape and each joint
    pass's (prefix keys, question rows, option rows) shapes in its lane, the prefix keys fixed
    as the torch backend fixes them where it captures (`Capabilities.fixed_prefix_keys`)."""
    yield "image", (prepared.image.height, prepared.image.width)
    yield "grid", tuple(int(x) for x in prepared.image.grid_thw)
    yield "prefix", work.prefix.input_ids.shape
    keys = longest_prefix(work.prefix_length, prepared.image.image_tokens)
    for jp in work.joint:
        shapes = (keys, jp.question.rows.input_ids.shape, jp.options.rows.input_ids.shape)
        yield f"joint lane {lane_of(jp, LANES)}", shapes


# where a request's token slots go (`request_row`); they add up to its slots
SLOT_USES = ("tokens", "padding", "filler")
CACHES = {"image": IMAGE_SLOTS, "grid": VISION_TABLES, "prefix": GRAPH_SLOTS}


def misses(keys: Iterable[tuple], size: int) -> int:
    """How many of `keys`, in order, an LRU of `size` entries did not hold."""
    lru: LRU[tuple, bool] = LRU(size)
    for key in keys:
        if lru.get(key) is None:
            lru.put(key, True)
    return lru.misses


def joint_shape(jp: JointPass) -> tuple:
    return jp.question.rows.shape, jp.options.rows.shape


def has_bucket(shape: tuple, built: set[tuple]) -> bool:
    """Whether a joint pass of `shape` runs in a built shape: its own, or one of its
    `larger_joints` (the runner's choice, `PassRunner.run_joint`)."""
    larger = {joint_shape(jp) for jp in larger_joints(bucket_pass(shape))}
    return shape in built or bool(larger & built)


def bucket_pass(shape: tuple) -> JointPass:
    """A joint pass of filler rows of this shape."""
    (q_rows, q_length), (o_rows, o_length) = shape
    return JointPass(
        QuestionPass(empty_pass(q_rows, q_length), [], {}, {}),
        OptionPass(empty_pass(o_rows, o_length), 0, [], {}, {}),
    )


def unbuilt(executor, shapes: list[tuple]) -> dict:
    """Of these joint passes in turn, how many met no built shape (`has_bucket`) after the
    built-in warm-up (its request and companion, and `bucket_joints`); each shape is built
    after its first pass, as the worker does (in the request, or when idle)."""
    built = {joint_shape(jp) for jp in bucket_joints(QUESTION_BATCH)}
    for body in (warm_up_request(), warm_up_companion()):
        built |= {joint_shape(jp) for jp in gpu_plan(executor.prepare(body)).joint}
    missed = 0
    for shape in shapes:
        missed += not has_bucket(shape, built)
        built.add(shape)
    return {"passes": len(shapes), "unbuilt": missed}


def plans(executor, seed: int, count: int, questions: int | None = None) -> dict:
    """The first `count` suite requests of `seed`: a row each, and every graph cache's distinct
    keys and misses over them (the misses past the distinct keys are evictions)."""
    rows, seen, shapes = [], {}, []
    for index in range(count):
        made = traffic.request(seed, index, questions=questions)
        prepared = executor.prepare(parse_body(made.body))
        work = gpu_plan(prepared)
        rows.append({"index": index, "size": list(made.size), **request_row(prepared, work)})
        for cache, key in graph_keys(prepared, work):
            seen.setdefault(cache, []).append(key)
        shapes += [joint_shape(jp) for jp in work.joint]
    caches = {
        cache: {
            "distinct": len(set(keys)),
            "size": CACHES.get(cache, GRAPH_SLOTS),
            "misses": misses(keys, CACHES.get(cache, GRAPH_SLOTS)),
            "runs": len(keys),
        }
        for cache, keys in sorted(seen.items())
    }
    return {"requests": rows, "caches": caches, "joint_unbuilt": unbuilt(executor, shapes)}


def table(record: dict) -> str:
    """The requests' medians and means, then one line a graph cache."""
    rows = record["requests"]
    slots = max(sum(r["slots"] for r in rows), 1)
    share = {key: sum(r[key] for r in rows) / slots for key in (*SLOT_USES, "repeated")}
    lines = [
        f"requests {len(rows)}: passes median {statistics.median(r['passes'] for r in rows)}, "
        f"mean {statistics.fmean(r['passes'] for r in rows):.2f}, max "
        f"{max(r['passes'] for r in rows)}; token slots a request {slots / len(rows):.0f}: "
        + ", ".join(f"{key} {share[key]:.0%}" for key in SLOT_USES)
        + f" (question texts run again: {share['repeated']:.0%})",
        "| graphs | distinct keys | cache size | runs | misses |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for cache, c in record["caches"].items():
        lines.append(f"| {cache} | {c['distinct']} | {c['size']} | {c['runs']} | {c['misses']} |")
    unbuilt = record["joint_unbuilt"]
    lines.append(
        f"joint passes with no built shape of their lengths after the built-in warm-up: "
        f"{unbuilt['unbuilt']} of {unbuilt['passes']}"
    )
    return "\n".join(lines)
