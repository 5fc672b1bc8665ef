"""Host time of requests, stage by stage, through the runtime's own entry points: strict JSON,
the contract, preparation (`Executor.prepare`, or `runtime.processing.prepare` with the plan as
the executor makes it on the CPU), the heads and finishing, and the response's JSON."""

from __future__ import annotations

import statistics
import time

import numpy as np

HIDDEN = 2560  # the 4b's hidden size: the synthetic heads cost what the real ones do
RUNS = 20  # warm runs per request; the median is reported
WARM_RUNS = 2  # untimed runs first: caches and pools made
HEADS_SEED = 0
LATENCY_S = 0.01  # the answers' latency fields (their value costs nothing)
# in request order; "contract" is timed on its own and again inside "prepare", which starts
# from the parsed body as the executor's does
STAGES = ("strict JSON", "contract", "prepare", "heads + finishing", "response JSON")
HOST_TOTAL = "host total"  # strict JSON, prepare, heads and response JSON timed end to end
EVERY_RUN = "runs_ms"  # each run's milliseconds by stage and total (not in the table)


class Clock:
    """Adds the seconds since the previous lap to the stage's list."""

    def __init__(self, times: dict[str, list[float]]):
        self.times = times
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.times.setdefault(stage, []).append(now - self.last)
        self.last = now


def synthetic_heads(hidden: int = HIDDEN, seed: int = HEADS_SEED):
    """Heads of the 4b's shapes with small random weights: the cost of the real ones."""
    from runtime.export_format import head_shapes
    from runtime.heads import Heads

    rng = np.random.default_rng(seed)
    tensors = {
        name: (rng.standard_normal(shape) * 0.02).astype(np.float32)
        for name, shape in head_shapes(hidden).items()
    }
    return Heads(tensors, hidden)


def synthetic_readouts(prepared, hidden: int, seed: int = HEADS_SEED) -> list:
    """Readouts shaped as the engines return them: zq, u and every option's target log-probs."""
    from runtime.types import QuestionReadout

    rng = np.random.default_rng(seed)
    readouts = []
    for layout in prepared.layouts:
        k = len(layout.rows)
        readouts.append(
            QuestionReadout(
                zq=rng.standard_normal(hidden).astype(np.float32),
                u=rng.standard_normal((k, hidden)).astype(np.float32),
                picked=[-rng.random(len(row.targets)).astype(np.float32) for row in layout.rows],
                first=[None if row.first is None else -0.5 for row in layout.rows],
            )
        )
    return readouts


class HostPath:
    """The request's host work: an executor's own (`prepare`, `respond`), or without engines the
    runtime's preparation on the CPU with the built-in tokenizer and synthetic heads."""

    def __init__(self, executor=None, tokenizer=None, heads=None, calibration=None):
        from runtime.finish import Calibration
        from runtime.tokenizer import load_tokenizer

        self.executor = executor
        if executor is not None:
            heads, tokenizer, calibration = executor.heads, executor.tokenizer, None
        self.heads = heads or synthetic_heads()
        self.tokenizer = tokenizer or load_tokenizer(None)
        self.calibration = calibration or Calibration.v11()

    def prepare(self, obj: dict):
        if self.executor is not None:
            return self.executor.prepare(obj)
        from runtime.contract import compile_request
        from runtime.passes import plan
        from runtime.processing import prepare

        return prepare(compile_request(obj), self.tokenizer, planner=plan)

    def respond(self, prepared, readouts: list) -> dict:
        if self.executor is not None:
            return self.executor.respond(prepared, readouts, LATENCY_S)
        from runtime.constants import MODEL_ID
        from runtime.finish import answer_questions

        questions = prepared.questions
        made = answer_questions(
            self.heads, self.calibration, questions, readouts, LATENCY_S, LATENCY_S
        )
        answers = {q.id: answer for q, answer in zip(questions, made, strict=True)}
        usage = {"input_tokens": prepared.input_tokens, "output_tokens": 0}
        return {"model": MODEL_ID, "answers": answers, "usage": usage}


def profile_once(body: bytes, path: HostPath, times: dict[str, list[float]]) -> None:
    """One request through every stage, each timed on its own."""
    from runtime.contract import compile_request
    from runtime.strict_json import parse_body
    from server.app import encode

    clock = Clock(times)
    obj = parse_body(body)
    clock.lap("strict JSON")
    compile_request(obj)
    clock.lap("contract")
    prepared = path.prepare(obj)
    clock.lap("prepare")
    readouts = synthetic_readouts(prepared, path.heads.hidden)
    clock.last = time.perf_counter()  # the readouts stand in for the engines: not host work
    response = path.respond(prepared, readouts)
    clock.lap("heads + finishing")
    encode(response)
    clock.lap("response JSON")


def total_once(body: bytes, path: HostPath) -> float:
    """The host work of one request end to end: seconds, the engines' stand-in left out."""
    from runtime.strict_json import parse_body
    from server.app import encode

    started = time.perf_counter()
    prepared = path.prepare(parse_body(body))
    between = time.perf_counter()
    readouts = synthetic_readouts(prepared, path.heads.hidden)
    resumed = time.perf_counter()
    encode(path.respond(prepared, readouts))
    return time.perf_counter() - resumed + between - started


def profile(
    requests: dict[str, bytes], runs: int = RUNS, executor=None, **path_parts
) -> dict[str, dict]:
    """Median milliseconds per stage for each request, `host total` timed end to end, and
    every run's under EVERY_RUN; `path_parts` (tokenizer, heads, calibration) without one."""
    path = HostPath(executor, **path_parts)
    results = {}
    for name, request in requests.items():
        for _ in range(WARM_RUNS):
            profile_once(request, path, {})
            total_once(request, path)
        times: dict[str, list[float]] = {}
        for _ in range(runs):
            profile_once(request, path, times)
            times.setdefault(HOST_TOTAL, []).append(total_once(request, path))
        row: dict = {stage: 1e3 * statistics.median(times[stage]) for stage in times}
        row[EVERY_RUN] = {k: [round(1e3 * t, 3) for t in v] for k, v in times.items()}
        results[name] = row
    return results


def table(results: dict[str, dict]) -> str:
    """Stages down, requests across, median milliseconds."""
    names = list(results)
    lines = [
        "| stage (median ms) | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    for stage in (*STAGES, HOST_TOTAL):
        cells = " | ".join(f"{results[n][stage]:.2f}" for n in names)
        lines.append(f"| {stage} | {cells} |")
    return "\n".join(lines)


def machine() -> str:
    import os
    import platform

    import torch

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, python {platform.python_version()}"
    )
