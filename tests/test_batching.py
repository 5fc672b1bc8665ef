"""Batching across requests (issue 37): the scheduler runs waiting requests of one batch key as
one batch, a request that fails fails alone, and a request's answer is the same bytes whether it
ran alone or batched, in process and through the real worker over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.parity import without_latency
from bench.workloads import encode, photo_image
from reference.questions import gate_questions, pattern_png, request_body, speed_bench_questions
from server.admission import BATCH_MOST, Dropped, Scheduler, Ticket
from tests.engine_fixtures import tiny_engines
from tests.server_helpers import ThreadServer, wait_ready

HOLD_S = 10.0  # the longest a test waits for a held batch


class Recorder:
    """A batch's work for the scheduler: records each batch, holds the first until released,
    and fails for the argument "bad"."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, args: list[str]) -> list[str]:
        self.batches.append(list(args))
        if len(self.batches) == 1:
            self.started.set()
            assert self.release.wait(HOLD_S), "the first batch was never released"
        if "bad" in args:
            raise ValueError("bad argument")
        return [arg.upper() for arg in args]


async def queued(scheduler: Scheduler, run: Recorder, work: list[tuple[str, str | None, float]]):
    """Runs `work` ((argument, key, size) each) through `scheduler`, the first alone while the
    others queue behind it; each argument's result or exception, in order."""
    tickets = [Ticket() for _ in work]
    calls = []
    for ticket, (arg, key, size) in zip(tickets, work, strict=True):
        calls.append(asyncio.ensure_future(scheduler.execute_batched(ticket, run, arg, key, size)))
        if len(calls) == 1:
            await asyncio.to_thread(run.started.wait, HOLD_S)
    await asyncio.sleep(0.05)  # every call is in the queue
    run.release.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    await scheduler.close()
    return results, tickets


def test_waiting_requests_of_one_key_run_as_one_batch() -> None:
    run = Recorder()
    work = [("a", "x", 0.1), ("b", "x", 0.1), ("c", "y", 0.1), ("d", "x", 0.1), ("e", None, 0.1)]
    results, tickets = asyncio.run(queued(Scheduler(), run, work))
    assert results == ["A", "B", "C", "D", "E"]
    # the oldest waiting request and every other of its key; a None key never joins
    assert run.batches == [["a"], ["b", "d"], ["c"], ["e"]]
    assert all(t.queue_wait_s is not None and t.execute_s is not None for t in tickets)


def test_a_batch_holds_at_most_one_largest_request() -> None:
    run = Recorder()
    half = BATCH_MOST / 2
    work = [("a", "x", 0.1), ("b", "x", half), ("c", "x", half), ("d", "x", half)]
    results, _ = asyncio.run(queued(Scheduler(), run, work))
    assert results == ["A", "B", "C", "D"]
    assert run.batches == [["a"], ["b", "c"], ["d"]]


def test_a_request_that_fails_fails_alone() -> None:
    run = Recorder()
    work = [("a", "x", 0.1), ("b", "x", 0.1), ("bad", "x", 0.1), ("c", "x", 0.1)]
    results, _ = asyncio.run(queued(Scheduler(), run, work))
    assert results[:2] == ["A", "B"] and results[3] == "C"
    assert isinstance(results[2], ValueError) and str(results[2]) == "bad argument"
    # the batch failed as a whole, then ran a request at a time
    assert run.batches == [["a"], ["b", "bad", "c"], ["b"], ["bad"], ["c"]]


def test_a_request_whose_client_left_is_dropped_before_it_runs() -> None:
    async def scenario() -> tuple[list, list[list[str]]]:
        run, scheduler = Recorder(), Scheduler()
        first, gone, kept = Ticket(), Ticket(), Ticket()
        calls = [asyncio.ensure_future(scheduler.execute_batched(first, run, "a", "x", 0.1))]
        await asyncio.to_thread(run.started.wait, HOLD_S)
        for ticket, arg in ((gone, "b"), (kept, "c")):
            calls.append(
                asyncio.ensure_future(scheduler.execute_batched(ticket, run, arg, "x", 0.1))
            )
        await asyncio.sleep(0.05)
        gone.gone.set()
        await asyncio.sleep(0.05)
        assert scheduler.waiting == 1  # the dropped request left the queue at once
        run.release.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        await scheduler.close()
        return results, run.batches

    results, batches = asyncio.run(scenario())
    assert results[0] == "A" and isinstance(results[1], Dropped) and results[2] == "C"
    assert batches == [["a"], ["c"]]


def test_a_lone_request_waits_for_company_only_when_asked() -> None:
    async def scenario(wait_s: float) -> list[list[str]]:
        seen: list[list[str]] = []

        def run(args: list[str]) -> list[str]:
            seen.append(list(args))
            return args

        scheduler = Scheduler(batch_wait_s=wait_s)
        first = asyncio.ensure_future(scheduler.execute_batched(Ticket(), run, "a", "x", 0.1))
        await asyncio.sleep(0.02)
        second = asyncio.ensure_future(scheduler.execute_batched(Ticket(), run, "b", "x", 0.1))
        await asyncio.gather(first, second)
        await scheduler.close()
        return seen

    assert asyncio.run(scenario(0.0)) == [["a"], ["b"]]
    assert asyncio.run(scenario(0.5)) == [["a", "b"]]


# -- the executor: the same bytes alone and batched ------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return tiny_engines(tmp_path_factory)


@pytest.fixture(scope="module")
def executor(engines):
    from runtime.executor import load_engine

    return load_engine(str(engines[0]), str(engines[1]), "onnxruntime")


def question_sets() -> list[dict]:
    """Requests about one image with different questions: 1, 3 and 12 questions, all types,
    some with the same question ids as another request."""
    gate, bench = gate_questions(), speed_bench_questions(12)
    first = dict(list(gate.items())[:1])
    return [first, dict(list(gate.items())[1:4]), bench, dict(list(bench.items())[5:7])]


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_batched_readouts_are_the_bytes_of_each_request_alone(engines, executor, backend) -> None:
    from runtime.executor import load_engine
    from runtime.strict_json import parse_body

    if backend != "onnxruntime":
        executor = load_engine(str(engines[0]), str(engines[1]), backend)
    # three images of one prefix shape (two of one size), requests about each: three prefixes
    # a pass, the second image's asked about first after the first's
    images = [pattern_png(320, 224), encode(photo_image(320, 224, 3), "PNG")]
    images.append(pattern_png(224, 320))
    batch = [
        executor.prepare(parse_body(request_body(images[i], questions, "image/png")))
        for i, questions in zip((0, 1, 1, 2), question_sets(), strict=True)
    ]
    keys = {executor.batch_key(prepared)[0] for prepared in batch}
    assert len(keys) == 1 and None not in keys
    assert len({prepared.image_key for prepared in batch}) == 3
    together = executor.readouts_batch(batch)
    for prepared, readouts in zip(batch, together, strict=True):
        alone = executor.readouts(prepared)
        assert len(alone) == len(readouts) == len(prepared.layouts)
        for a, b in zip(alone, readouts, strict=True):
            assert a.zq.tobytes() == b.zq.tobytes() and a.u.tobytes() == b.u.tobytes()
            assert [p.tobytes() for p in a.picked] == [p.tobytes() for p in b.picked]
            assert a.first == b.first
        answers = executor.respond(prepared, readouts, 0.0)
        assert without_latency(answers) == without_latency(executor.execute(prepared))


def test_a_batch_that_changes_a_byte_makes_every_request_run_alone(engines, executor) -> None:
    """The batch check before ready: an executor whose batches keep the bytes merges requests;
    one whose batched readouts differ by one ulp (as kernels that follow a pass's shape would)
    runs every request alone from then on, as does one whose backend does not declare its
    batches exact."""
    from dataclasses import replace

    import numpy as np

    from runtime.config import RuntimeConfig
    from runtime.executor import Executor
    from runtime.strict_json import parse_body

    class Drifting(Executor):
        def readouts_batch(self, batch):
            made = super().readouts_batch(batch)
            if len(batch) > 1:
                made[-1][0].zq = np.nextafter(made[-1][0].zq, np.float32(np.inf))
            return made

    assert executor.check_batches() and executor.merges
    drifting = Drifting(engines[0], engines[1], RuntimeConfig(backend="onnxruntime"))
    body = parse_body(request_body(pattern_png(320, 224), gate_questions(), "image/png"))
    assert drifting.batch_key(drifting.prepare(body))[0] is not None
    assert drifting.check_batches() is False
    assert drifting.batch_key(drifting.prepare(body))[0] is None
    # a backend that does not declare its batches exact (a GPU's, today) is never batched
    backend = drifting.backend
    backend.capabilities = replace(backend.capabilities, merges=False)
    held = Executor(engines[0], engines[1], RuntimeConfig(backend="onnxruntime"), backend=backend)
    assert held.batch_key(held.prepare(body))[0] is None and held.check_batches() is False


def test_requests_batch_by_their_image_prefix_shape(executor) -> None:
    """Where a pass reads several image prefixes (ONNX Runtime's do), requests whose image
    prefixes have one pass shape share a key, whatever their images."""
    from runtime.strict_json import parse_body

    assert executor.backend.capabilities.prefixes > 1
    questions = gate_questions()
    keys = [
        executor.batch_key(executor.prepare(parse_body(request_body(image, questions, mime))))
        for image, mime in (
            (pattern_png(320, 224), "image/png"),
            (pattern_png(224, 320), "image/png"),  # other pixels, as many image tokens
            (pattern_png(640, 480), "image/png"),  # a longer image prefix
        )
    ]
    assert keys[0] == keys[1] and keys[0][0] != keys[2][0]
    assert 0 < keys[0][1] <= BATCH_MOST


# -- the real worker over HTTP ----------------------------------------------------------------


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_concurrent_requests_answer_as_each_alone_over_http(executor) -> None:
    """Distinct requests sent at once (most about one image, one about another) through the
    worker with a batch wait, so that they batch; each answer is the bytes it has alone."""
    image, other = pattern_png(320, 224), pattern_png(224, 320)
    bodies = [request_body(image, questions, "image/png") for questions in question_sets()]
    bodies.append(request_body(other, gate_questions(), "image/png"))
    with ThreadServer(executor, batch_wait_s=0.5) as server:
        wait_ready(server.url)
        url = server.url + "/v1/systemone"
        headers = {"content-type": "application/json"}

        def post(body: bytes) -> httpx.Response:
            return httpx.post(url, content=body, headers=headers, timeout=60)

        def batches() -> tuple[float, float]:
            text = httpx.get(server.url + "/metrics").text
            return (
                metric(text, "omnijev_batch_requests_count"),
                metric(text, "omnijev_batch_requests_sum"),
            )

        warmed = batches()
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(post, bodies))
        served = batches()
        alone = [post(body) for body in bodies]
    # the warm-up: its request alone, the batch check (the request with its companion), then
    # the common pass shapes noted for building (none on the CPU), each a turn of the thread
    assert warmed == (3, 3) and executor.merges
    assert [r.status_code for r in together] == [200] * len(bodies)
    for batched, single in zip(together, alone, strict=True):
        assert json.dumps(without_latency(batched.json())) == json.dumps(
            without_latency(single.json())
        )
    count, requests = (b - a for a, b in zip(warmed, served, strict=True))
    assert requests == len(bodies) and count < len(bodies), "no two requests shared a batch"


# -- the plan of a merged batch -----------------------------------------------------------------


def rows_of(work) -> dict:
    """Each question's rows in a plan: (part, pass shape, tokens, positions, length) per row,
    and the prefix each reads; question rows' sources too."""
    made: dict = {}

    def add(rows, members, part: str) -> None:
        for row, member in enumerate(members):
            qi = member if part == "question" else member[0]
            shape, length = rows.shape, int(rows.lengths[row])
            seen = (part, shape, rows.input_ids[row].tobytes(), rows.positions[:, row].tobytes())
            made.setdefault(qi, []).append((*seen, length))
            made.setdefault(("prefix", qi), set()).add(int(rows.prefix_rows[row]))
            if part == "question":
                made.setdefault(("src", qi), set()).add(int(rows.src[row]))

    for qp in work.questions:
        add(qp.rows, qp.members, "question")
    for op in work.options:
        add(op.rows, op.members, "option")
    return made


def test_a_merged_plan_gives_each_question_its_rows_alone(executor) -> None:
    from runtime.batch import merged
    from runtime.passes import QUESTION_ROWS, plan
    from runtime.strict_json import parse_body

    images = [pattern_png(320, 224), pattern_png(640, 480), pattern_png(320, 224)]
    batch = [
        executor.prepare(parse_body(request_body(image, questions, "image/png")))
        for image, questions in zip(images, question_sets(), strict=False)
    ]
    request, firsts = merged(batch)
    assert request.owners == (0,) * 1 + (1,) * 3 + (0,) * 12
    assert len(firsts) == 2 and firsts[0] is batch[0] and firsts[1] is batch[1]
    together = rows_of(plan(request, QUESTION_ROWS))
    at = 0
    for prepared in batch:
        alone = rows_of(plan(prepared, QUESTION_ROWS))
        for qi in range(len(prepared.layouts)):
            owner = request.owners[at + qi]
            assert sorted(set(together[at + qi])) == sorted(set(alone[qi]))
            assert together[("prefix", at + qi)] == together[("src", at + qi)] == {owner}
        at += len(prepared.layouts)


def test_the_batch_measurement_finds_every_byte_kept_where_it_is(executor) -> None:
    """`bench.gpu batches`' comparison, on the CPU where batches keep every byte: the bench's
    requests (one image) alone, again, batched with itself, and in one batch."""
    from bench.batches import batches, requests_table, table

    record = batches(executor, 0, 0)
    assert all(r["repeatable"] and r["twice_same"] for r in record["requests"])
    assert all(0 < r["tokens"] <= r["slots"] for r in record["requests"])
    assert record["batches"] and all(all(b["same"]) for b in record["batches"])
    assert all(b["gap"] == 0 and all(b["same_as_twice"]) for b in record["batches"])
    assert all(all(b["same_answers"]) for b in record["batches"])
    assert "same bytes" in table(record) and "| prefix tokens |" in requests_table(record)
