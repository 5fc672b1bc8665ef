"""The packed planner's time (`runtime.packing.plan`) on the bench's workloads and the traffic
suite's first 150 requests, in the tree on PYTHONPATH; medians of 50 runs (workloads) and the
mean of each request's best of 5 (suite), in ms. With `prepare`: the whole preparation of the
255-option workload with the planner, as the executor runs it."""

import json
import statistics
import time

from bench import traffic, workloads
from runtime import packing
from runtime.contract import compile_request
from runtime.processing import prepare
from runtime.tokenizer import build_tokenizer

tokenizer = build_tokenizer()


def prepared_of(body: bytes):
    return prepare(compile_request(json.loads(body)), tokenizer, pack=False, resize=False)


def runs_ms(work, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1e3)
    return times


report = {}
for name in ("1 question", "12 questions", "32 options", "255 options"):
    prepared = prepared_of(workloads.bench_body(name))
    report[name] = round(statistics.median(runs_ms(lambda p=prepared: packing.plan(p), 50)), 3)
suite = [prepared_of(r.body) for r in traffic.stream(0, 150)]
best = [min(runs_ms(lambda p=p: packing.plan(p), 5)) for p in suite]
report["suite mean"] = round(statistics.mean(best), 3)
obj = json.loads(workloads.bench_body("255 options"))
whole = runs_ms(
    lambda: prepare(
        compile_request(obj), tokenizer, pack=False, resize=False, planner=packing.plan
    ),
    30,
)
report["255 options prepare"] = round(statistics.median(whole), 2)
print(json.dumps(report))
