"""Batching across requests in process: the traffic suite's requests (and the bench's, which
share one image) each alone and in the batches the worker's scheduler forms, their readouts
compared byte for byte and their times and shape builds taken (`python -m bench.gpu batches`)."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from bench import traffic
from bench.parity import without_latency
from bench.plans import request_row
from bench.workloads import bench_bodies
from runtime.batch import batch_size, same_readouts
from runtime.strict_json import parse_body
from server.admission import BATCH_MOST

RUNS = 3  # timed runs of each request alone and of each batch (the first builds its shapes)


def largest_gap(a: list, b: list) -> float:
    """The largest absolute difference between two requests' readouts (zq, u, log-probs)."""
    gaps = [0.0]
    for x, y in zip(a, b, strict=True):
        gaps.append(float(np.abs(x.zq - y.zq).max()))
        gaps.append(float(np.abs(x.u - y.u).max()) if x.u.size else 0.0)
        gaps += [
            float(np.abs(p - q).max()) for p, q in zip(x.picked, y.picked, strict=True) if p.size
        ]
    return max(gaps)


def answer(executor, prepared, readouts: list) -> str:
    """The request's answers from these readouts (heads and finishing), latency fields aside."""
    return json.dumps(without_latency(executor.respond(prepared, readouts, 0.0)), sort_keys=True)


def scheduled(executor, prepared: list) -> list[list[int]]:
    """The batches the worker's scheduler would take from this queue, all waiting at once,
    were the backend's batches declared exact (`Capabilities.merges`): the oldest request and
    the next ones of its image prefix's pass shape while their shares fit BATCH_MOST."""
    prefixes = executor.backend.capabilities.prefixes
    keys = [executor.work_of(p).prefix.shape for p in prepared]
    sizes = [batch_size(p, prefixes) for p in prepared]
    left, batches = list(range(len(prepared))), []
    while left:
        head = left[0]
        batch, total = [], 0.0
        for i in left:
            if keys[i] == keys[head] and total + sizes[i] <= BATCH_MOST:
                batch.append(i)
                total += sizes[i]
        batches.append(batch)
        left = [i for i in left if i not in batch]
    return batches


def timed(executor, call) -> tuple[list[float], list[int], object]:
    """Milliseconds of RUNS calls, the shapes the backend built during each, the first's result."""
    times, builds, results = [], [], []
    for _ in range(RUNS):
        before = executor.shape_builds()[0]
        started = time.perf_counter()
        results.append(call())
        times.append(1e3 * (time.perf_counter() - started))
        builds.append(executor.shape_builds()[0] - before)
    return times, builds, results[0]


def batches(executor, seed: int, count: int) -> dict:
    """Each request alone (twice, and once in a batch with itself, its rows after its copy's),
    then each scheduled batch of two or more, against those."""
    bodies = [*bench_bodies().values(), *(traffic.request(seed, i).body for i in range(count))]
    prepared = [executor.prepare(parse_body(body)) for body in bodies]
    alone, twins, record = [], [], {"requests": [], "batches": []}
    for p in prepared:
        times, builds, first = timed(executor, lambda p=p: executor.readouts(p))
        again = executor.readouts(p)
        twice = executor.readouts_batch([p, p])[1]
        alone.append(first)
        twins.append(twice)
        plan = request_row(p, executor.work_of(p))
        record["requests"].append(
            {
                "questions": len(p.layouts),
                "rows": sum(len(layout.rows) for layout in p.layouts),
                **{key: plan[key] for key in ("prefix_tokens", "passes", "slots", "tokens")},
                "ms": times,
                "builds": builds,
                "repeatable": same_readouts(again, first),
                "twice_same": same_readouts(twice, first),
                "twice_gap": largest_gap(twice, first),
            }
        )
    for batch in scheduled(executor, prepared):
        if len(batch) < 2:
            continue
        members = [prepared[i] for i in batch]
        times, builds, together = timed(executor, lambda m=members: executor.readouts_batch(m))
        pairs = list(zip(batch, together, strict=True))  # (request, its readouts batched)
        record["batches"].append(
            {
                "requests": batch,
                "images": len({p.image_key for p in members}),
                "ms": times,
                "alone_ms": sum(statistics.median(record["requests"][i]["ms"]) for i in batch),
                "builds": builds,
                "same": [same_readouts(t, alone[i]) for i, t in pairs],
                "gap": max(largest_gap(t, alone[i]) for i, t in pairs),
                "same_as_twice": [same_readouts(t, twins[i]) for i, t in pairs],
                # the heads and finishing too: readouts the same, answers other would point there
                "same_answers": [
                    answer(executor, prepared[i], t) == answer(executor, prepared[i], alone[i])
                    for i, t in pairs
                ],
            }
        )
    return record


def table(record: dict) -> str:
    """One line a batch: its requests, images, times against the sum alone, bytes the same."""
    lines = [
        "| requests | images | first ms | warm ms | alone ms (sum) | builds | same bytes | gap "
        "| as batched with itself | same answers |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | --- |",
    ]
    for b in record["batches"]:
        same = sum(b["same"])
        lines.append(
            f"| {b['requests']} | {b['images']} | {b['ms'][0]:.1f} | "
            f"{statistics.median(b['ms'][1:]):.1f} | {b['alone_ms']:.1f} | {b['builds']} | "
            f"{same}/{len(b['same'])} | {b['gap']:.2g} | "
            f"{sum(b['same_as_twice'])}/{len(b['same'])} | "
            f"{sum(b['same_answers'])}/{len(b['same'])} |"
        )
    requests = record["requests"]
    repeatable = sum(r["repeatable"] for r in requests)
    two = sum(r["twice_same"] for r in requests)
    gap = max(r["twice_gap"] for r in requests)
    lines.append(f"alone twice, the same bytes: {repeatable}/{len(requests)}")
    lines.append(f"batched with itself, the same bytes: {two}/{len(requests)} (gap {gap:.2g})")
    return "\n".join(lines)


def requests_table(record: dict) -> str:
    """One line a request alone: what it asks, its passes, its times and builds."""
    lines = [
        "| request | questions | rows | prefix tokens | passes | token slots | first ms "
        "| warm ms | builds | again same | with itself same |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for i, r in enumerate(record["requests"]):
        lines.append(
            f"| {i} | {r['questions']} | {r['rows']} | {r['prefix_tokens']} | {r['passes']} | "
            f"{r['slots']} | "
            f"{r['ms'][0]:.1f} | {statistics.median(r['ms'][1:]):.1f} | {r['builds']} | "
            f"{r['repeatable']} | {r['twice_same']} |"
        )
    return "\n".join(lines)
