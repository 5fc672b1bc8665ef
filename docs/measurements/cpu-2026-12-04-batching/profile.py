"""In process on the CPU (tiny demo model, ONNX Runtime): 16 one-question traffic requests about 4
screenshots, one at a time and as one batch, by stage; then one question pass of the batch
against one request's. Run from the repository root: `python <this file>`."""

from __future__ import annotations

import time

import torch

from bench import traffic
from runtime.batch import merged
from runtime.executor import load_engine
from runtime.passes import plan
from runtime.run_passes import Stopwatch
from runtime.strict_json import parse_body

REQUESTS = 16


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return round(time.perf_counter() - started, 3)


def main() -> None:
    ex = load_engine("artifacts/demo/checkpoint", "artifacts/demo/engines", "onnxruntime")
    made = [traffic.request(0, i, "suite", 1, (800, 600), "PNG", 4) for i in range(REQUESTS)]
    prepared = [ex.prepare(parse_body(r.body)) for r in made]
    print("option rows per request", [r.options for r in made])
    for p in prepared[:2]:
        ex.readouts(p)
    stages: dict[str, float] = {}
    started = time.perf_counter()
    for p in prepared:
        ex.readouts(p)
        for name, seconds in ex.stages.items():
            stages[name] = stages.get(name, 0.0) + seconds
    alone = round(time.perf_counter() - started, 3)
    print("one at a time s", alone, {k: round(v, 3) for k, v in stages.items()})
    for _ in range(3):
        seconds = timed(lambda: ex.readouts_batch(prepared))
        print("as one batch s", seconds, {k: round(v, 3) for k, v in ex.stages.items()})
    request, images = merged(prepared)
    together = plan(request, *ex.pass_shape(), joint=ex.choices.joint)
    own = plan(prepared[0], *ex.pass_shape(), joint=ex.choices.joint)
    print("batch passes", [q.rows.shape for q in together.questions], len(together.options))
    clock = Stopwatch({})
    with torch.inference_mode():
        states = ex.image_states(images, clock)
        first = ex.image_states(prepared[:1], clock)
        for _ in range(3):
            batch_pass = timed(lambda: ex.runner.run_question(together.questions[0], *states))
            one_pass = timed(lambda: ex.runner.run_question(own.questions[0], *first))
            print("question pass s: the batch's", batch_pass, "one request's", one_pass)


if __name__ == "__main__":
    main()
