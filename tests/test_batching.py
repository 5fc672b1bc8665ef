"""Batching across requests (issue 37): the scheduler runs waiting requests of one batch key as
one batch, a request that fails fails alone, and a request's answer is the same bytes whether it
ran alone or batched, in process and through the real worker over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
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


def test_requests_queued_while_room_waits_join_the_next_batch() -> None:
    """`room` (the executor's: the device can take another batch) runs on the execution thread
    before each batch is formed; the requests that arrive while it waits join that batch."""
    calls: list[tuple[str, object, str]] = []  # ("room" | "batch", args, thread name)
    entered, release = threading.Event(), threading.Event()

    def room() -> None:
        calls.append(("room", None, threading.current_thread().name))
        entered.set()
        if not release.is_set():
            assert release.wait(HOLD_S), "room was never released"

    def run(args: list[str]) -> list[str]:
        calls.append(("batch", list(args), threading.current_thread().name))
        return [arg.upper() for arg in args]

    async def scenario() -> list:
        scheduler = Scheduler(room=room)
        work = [("a", "x"), ("b", "x"), ("c", "x"), ("d", None)]
        first = scheduler.execute_batched(Ticket(), run, "a", "x", 0.1)
        futures = [asyncio.ensure_future(first)]
        await asyncio.to_thread(entered.wait, HOLD_S)  # the execution thread is in room
        for arg, key in work[1:]:
            futures.append(
                asyncio.ensure_future(scheduler.execute_batched(Ticket(), run, arg, key, 0.1))
            )
        await asyncio.sleep(0.05)
        # nothing has run, and the first request is still queued: no batch is formed yet
        assert [c for c in calls if c[0] == "batch"] == [] and scheduler.waiting == 4
        release.set()
        results = await asyncio.gather(*futures)
        await scheduler.close()
        return results

    assert asyncio.run(scenario()) == ["A", "B", "C", "D"]
    assert [(stage, args) for stage, args, _ in calls] == [
        ("room", None),
        ("batch", ["a", "b", "c"]),
        ("room", None),
        ("batch", ["d"]),  # a None key never joins
    ]
    assert all(thread.startswith("omnijev-execute") for _, _, thread in calls)
    assert len({thread for _, _, thread in calls}) == 1


# -- the executor: the same bytes alone and batched ------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return tiny_engines(tmp_path_factory)


@pytest.fixture(scope="module")
def executor(engines):
    from runtime.executor import load_engine

    return load_engine(str(engines[0]), str(engines[1]), "onnxruntime")


@pytest.fixture(scope="module")
def torch_executor(engines):
    from runtime.executor import load_engine

    return load_engine(str(engines[0]), str(engines[1]), "torch")


def question_sets() -> list[dict]:
    """Requests about one image with different questions: 1, 3 and 12 questions, all types,
    some with the same question ids as another request."""
    gate, bench = gate_questions(), speed_bench_questions(12)
    first = dict(list(gate.items())[:1])
    return [first, dict(list(gate.items())[1:4]), bench, dict(list(bench.items())[5:7])]


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_batched_readouts_are_the_bytes_of_each_request_alone(request, executor, backend) -> None:
    from runtime.strict_json import parse_body

    if backend == "torch":
        executor = request.getfixturevalue("torch_executor")
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


def batch_counts(url: str) -> tuple[float, float]:
    """The executed batches so far and the requests they held (the batch-requests histogram)."""
    text = httpx.get(url + "/metrics").text
    return metric(text, "omnijev_batch_requests_count"), metric(text, "omnijev_batch_requests_sum")


def poster(url: str) -> Callable[[bytes], httpx.Response]:
    def post(body: bytes) -> httpx.Response:
        headers = {"content-type": "application/json"}
        return httpx.post(url + "/v1/systemone", content=body, headers=headers, timeout=60)

    return post


def until_queued(url: str, count: int) -> None:
    """Waits until `count` prepared requests wait for the execution thread."""
    deadline = time.monotonic() + HOLD_S
    while metric(httpx.get(url + "/metrics").text, "omnijev_queue_depth") < count:
        assert time.monotonic() < deadline, f"{count} requests never queued"
        time.sleep(0.02)


def answer_bytes(response: httpx.Response) -> str:
    """A 200 answer without its latency fields, as compared byte for byte."""
    assert response.status_code == 200, response.text
    return json.dumps(without_latency(response.json()))


def at_once_then_alone(engine, bodies: list[bytes]) -> tuple[tuple, tuple, float]:
    """`bodies` sent at once through the worker with a batch wait, so that they batch where the
    engine merges, then each alone; each answer must be the bytes it has alone. The batch counts
    after the warm-up, the batches and requests the bodies sent at once added, and
    `omnijev_requests_merge`."""
    with ThreadServer(engine, batch_wait_s=0.5) as server:
        wait_ready(server.url)
        post = poster(server.url)
        warmed = batch_counts(server.url)
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(post, bodies))
        served = batch_counts(server.url)
        alone = [post(body) for body in bodies]
        merge = metric(httpx.get(server.url + "/metrics").text, "omnijev_requests_merge")
    assert [answer_bytes(r) for r in together] == [answer_bytes(r) for r in alone]
    added = tuple(b - a for a, b in zip(warmed, served, strict=True))
    return warmed, added, merge


def assert_batched_as_alone(engine, bodies: list[bytes]) -> None:
    """`bodies` sent at once batch: fewer batches than requests, each answer the bytes it has
    alone."""
    warmed, (count, requests), merge = at_once_then_alone(engine, bodies)
    # the warm-up: its request alone, the batch check (the request with its companion), then
    # the common pass shapes noted for building (none on the CPU), each a turn of the thread
    assert warmed == (3, 3) and engine.merges and merge == 1.0
    assert requests == len(bodies) and count < len(bodies), "no two requests shared a batch"


def test_concurrent_requests_answer_as_each_alone_over_http(executor) -> None:
    """Distinct requests (most about one image, one about another) through the worker on ONNX
    Runtime: batched, each answer is the bytes it has alone."""
    image, other = pattern_png(320, 224), pattern_png(224, 320)
    bodies = [request_body(image, questions, "image/png") for questions in question_sets()]
    bodies.append(request_body(other, gate_questions(), "image/png"))
    assert_batched_as_alone(executor, bodies)


def test_concurrent_requests_answer_as_each_alone_over_http_on_torch(torch_executor) -> None:
    """The same through the torch backend (the GPU's), its packed passes on the CPU: distinct
    images and question sets, batched, each answer the bytes it has alone."""
    images = [pattern_png(320, 224), encode(photo_image(320, 224, 3), "PNG")]
    images.append(pattern_png(224, 320))
    bodies = [
        request_body(images[i], questions, "image/png")
        for i, questions in zip((0, 1, 2, 1), question_sets(), strict=True)
    ]
    bodies.append(request_body(images[2], gate_questions(), "image/png"))
    assert_batched_as_alone(torch_executor, bodies)


MARK = "fail inside the batch"  # a question's instructions that make `Failing` fail


def marked(prepared) -> bool:
    return any(q.instructions == MARK for q in prepared.questions)


def failing_executor(engines, base, stage: str):
    """The real executor (on `base`'s loaded backend) that raises in `stage` ("respond": that
    request's heads, on its responding thread; "enqueue": its batch's passes, on the execution
    thread) for a request marked with MARK; it records each batch it enqueues (each request's
    first question id), and once `hold` is set its execution thread waits in `room` until
    `go` is set, so that the test decides which requests share a batch."""
    from runtime.config import RuntimeConfig
    from runtime.executor import Executor

    class Failing(Executor):
        def __init__(self, *args, **kwargs) -> None:
            self.batches: list[list[str]] = []
            self.hold, self.go = threading.Event(), threading.Event()
            super().__init__(*args, **kwargs)

        def room(self) -> None:
            super().room()
            if self.hold.is_set():
                assert self.go.wait(HOLD_S), "the held batch was never let go"

        def enqueue(self, batch):
            self.batches.append([prepared.questions[0].id for prepared in batch])
            if stage == "enqueue" and any(map(marked, batch)):
                raise RuntimeError("the test asked the batch's passes to fail")
            return super().enqueue(batch)

        def respond(self, prepared, readouts, seconds):
            if stage == "respond" and marked(prepared):
                raise RuntimeError("the test asked respond to fail")
            return super().respond(prepared, readouts, seconds)

    config = RuntimeConfig.from_env(backend=base.config.backend)
    return Failing(engines[0], engines[1], config, backend=base.backend)


@pytest.mark.parametrize("stage", ["respond", "enqueue"])
def test_a_request_failing_inside_a_batch_fails_alone_over_http(
    engines, torch_executor, stage
) -> None:
    """A request whose heads (or whose batch's passes) fail, in one batch with others on the
    torch backend: it alone answers 500, the others the bytes they have alone."""
    failing = failing_executor(engines, torch_executor, stage)
    image = pattern_png(320, 224)
    sets = question_sets()[:3]
    bad = request_body(image, {"marked": {"type": "noul", "instructions": MARK}}, "image/png")
    bodies = [request_body(image, questions, "image/png") for questions in sets]
    bodies.insert(1, bad)
    with ThreadServer(failing, batch_wait_s=0.5) as server:
        wait_ready(server.url)
        post = poster(server.url)
        warmed = batch_counts(server.url)
        failing.hold.set()  # every request waits in the queue until all are there
        with ThreadPoolExecutor(len(bodies)) as pool:
            sent = [pool.submit(post, body) for body in bodies]
            until_queued(server.url, len(bodies))
            failing.go.set()
            together = [future.result() for future in sent]
        served = batch_counts(server.url)
        alone = [post(body) for body in bodies]
    count, requests = (b - a for a, b in zip(warmed, served, strict=True))
    assert (count, requests) == (1, len(bodies))  # one batch held the four
    firsts = sorted([next(iter(questions)) for questions in sets] + ["marked"])
    shared = [sorted(batch) for batch in failing.batches].index(firsts)  # ValueError: none did
    for response in (together[1], alone[1]):
        assert response.status_code == 500 and response.json() == {"detail": "inference failed"}
    kept = [0, 2, 3]
    assert [answer_bytes(together[i]) for i in kept] == [answer_bytes(alone[i]) for i in kept]
    if stage == "enqueue":  # the batch failed as a whole, then ran a request at a time
        again = failing.batches[shared + 1 : shared + 1 + len(bodies)]
        assert sorted(again) == [[first] for first in firsts]


def test_the_pass_counts_on_metrics(torch_executor) -> None:
    """/metrics counts what the executed passes held: each request sent alone is one batch of
    one request, and its packed passes, token slots, tokens and rows are its plan's."""
    from runtime.packing import PackedPlan
    from runtime.strict_json import parse_body

    names = ("pass_batches", "pass_requests", "packed_passes", "packed_token_slots")
    names += ("packed_tokens", "packed_rows", "device_busy_seconds")
    images = [pattern_png(320, 224), pattern_png(224, 320)]
    bodies = [
        request_body(image, questions, "image/png")
        for image, questions in zip(images, question_sets()[1:3], strict=True)
    ]
    plans = [torch_executor.work_of(torch_executor.prepare(parse_body(b))) for b in bodies]
    assert all(isinstance(work, PackedPlan) for work in plans)
    expected = {
        "pass_batches": len(bodies),
        "pass_requests": len(bodies),
        "packed_passes": sum(len(work.passes) for work in plans),
        "packed_token_slots": sum(work.slots for work in plans),
        "packed_tokens": sum(work.tokens for work in plans),
        "packed_rows": sum(len(p.read_rows) for work in plans for p in work.passes),
    }

    def counts(url: str) -> dict[str, float]:
        text = httpx.get(url + "/metrics").text
        return {name: metric(text, f"omnijev_{name}_total") for name in names}

    with ThreadServer(torch_executor) as server:
        wait_ready(server.url)
        before = counts(server.url)
        assert all(answer_bytes(poster(server.url)(body)) for body in bodies)
        after = counts(server.url)
        merge = metric(httpx.get(server.url + "/metrics").text, "omnijev_requests_merge")
    assert merge == float(torch_executor.merges) == 1.0  # the CPU's products keep a row's bytes
    grown = {name: after[name] - before[name] for name in expected}
    assert grown == expected
    assert after["packed_passes"] >= 1 and after["packed_rows"] > 0
    assert after["packed_token_slots"] >= after["packed_tokens"] > 0
    assert after["pass_requests"] >= after["pass_batches"] >= 1
    assert after["device_busy_seconds"] >= before["device_busy_seconds"] >= 0


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


def test_a_deployment_may_run_every_request_alone(engines) -> None:
    """`--merge off` on a backend whose batches keep every byte: no batch key, no warm-up pair,
    /metrics says 0, and requests sent at once under a batch wait each run alone."""
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine
    from runtime.strict_json import parse_body

    config = RuntimeConfig.from_env(backend="torch", merge=False)
    executor = load_engine(str(engines[0]), str(engines[1]), config)
    assert executor.backend.capabilities.merges  # the backend would merge: the setting decides
    assert not executor.merges and not executor.check_batches()
    image = pattern_png(320, 224)
    bodies = [request_body(image, questions, "image/png") for questions in question_sets()[:3]]
    assert executor.batch_key(executor.prepare(parse_body(bodies[0])))[0] is None
    _, (count, requests), merge = at_once_then_alone(executor, bodies)
    assert count == requests == len(bodies) and merge == 0.0


def test_a_machine_whose_products_move_a_rows_bytes_merges_no_request(engines) -> None:
    """Where the load-time products check finds a shape whose rows move with the pass size, the
    torch backend declares no exact batches: every request runs alone, and /metrics says so."""
    from runtime.backends.compiled import TorchBackend
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine
    from runtime.strict_json import parse_body

    class Moving(TorchBackend):  # a machine whose BLAS sums a row otherwise at 256 rows
        def check_products(self) -> list[str]:
            return ["64x64 at 256 rows"]

    config = RuntimeConfig.from_env(backend="torch")
    backend = Moving(engines[0], engines[1], config)
    executor = load_engine(str(engines[0]), str(engines[1]), config, backend=backend)
    assert executor.backend.products_differ == ["64x64 at 256 rows"]
    assert not executor.merges and not executor.check_batches()
    body = request_body(pattern_png(320, 224), question_sets()[1], "image/png")
    assert executor.batch_key(executor.prepare(parse_body(body)))[0] is None
    with ThreadServer(executor) as server:
        wait_ready(server.url)
        assert metric(httpx.get(server.url + "/metrics").text, "omnijev_requests_merge") == 0.0
