"""The worker's overlap (issue 13): with an engine that splits `execute` into `readouts` and
`respond`, a request's heads and finishing run beside the next request's passes, and the
answers are the same bytes as through `execute`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from runtime.types import Prepared
from tests.server_helpers import (
    FAIL,
    HOLD_S,
    RealishEngine,
    ThreadServer,
    decision,
    stand_in_response,
    wait_ready,
)
from tests.test_server import post, until


class Landed:
    """A flight already landed (runtime.flight.Flight's `readouts`)."""

    def __init__(self, made: list) -> None:
        self.made = made

    def readouts(self, index: int) -> list:
        return self.made[index]


class SplitEngine(RealishEngine):
    """RealishEngine with `readouts` and `respond`; `respond` of a held request waits for the
    test (the warm-up's excepted), and every call is recorded with its thread."""

    splits = True

    def __init__(self, hold_respond: bool = False) -> None:
        super().__init__()
        self.respond_gate = threading.Semaphore(0) if hold_respond else None
        self.calls: list[tuple[str, str, str]] = []  # (stage, first question id, thread name)

    def record(self, stage: str, prepared: Prepared) -> None:
        with self.lock:
            self.calls.append((stage, prepared.questions[0].id, threading.current_thread().name))

    def execute(self, prepared: Prepared) -> dict:
        raise AssertionError("a split engine is run through readouts and respond")

    def batch_key(self, prepared: Prepared) -> tuple[None, float]:
        return None, 1.0  # every request alone

    def check_batches(self) -> bool:
        return False

    def build_shapes(self) -> int:
        return 0  # nothing to build before ready

    def enqueue(self, batch: list[Prepared]) -> Landed:
        (prepared,) = batch
        self.record("readouts", prepared)
        return Landed([[len(layout.rows) for layout in prepared.layouts]])

    def respond(self, prepared: Prepared, readouts: list[int], seconds: float) -> dict:
        self.record("respond", prepared)
        assert readouts == [len(layout.rows) for layout in prepared.layouts] and seconds >= 0
        warm_up = prepared.questions[0].id == "noul"  # the built-in warm-up request's
        if self.respond_gate is not None and not warm_up:
            assert self.respond_gate.acquire(timeout=HOLD_S), "respond was never released"
        if any(q.instructions == FAIL for q in prepared.questions):
            raise RuntimeError("the test asked respond to fail")
        return stand_in_response(prepared)

    def stages(self, question: str) -> list[tuple[str, str]]:
        return [(stage, thread) for stage, first, thread in self.calls if first == question]


def noul(name: str, instructions: str | None = None) -> dict:
    return decision({name: {"type": "noul", "instructions": instructions or name}})


def test_heads_of_one_request_run_beside_the_next_requests_passes() -> None:
    engine = SplitEngine(hold_respond=True)
    with ThreadPoolExecutor(2) as pool, ThreadServer(engine) as server:
        wait_ready(server.url)
        first = pool.submit(post, server.url, noul("a"))
        until(lambda: len(engine.stages("a")) == 2, "the first request to reach respond")
        second = pool.submit(post, server.url, noul("b"))
        # the first request's respond is still held, yet the second's passes run
        until(lambda: len(engine.stages("b")) == 2, "the second request's passes and respond")
        assert not first.done()
        engine.respond_gate.release(2)
        assert first.result().status_code == 200 and second.result().status_code == 200
    for question in ("a", "b"):
        (readouts, passes_thread), (respond, respond_thread) = engine.stages(question)
        assert (readouts, respond) == ("readouts", "respond")
        assert passes_thread.startswith("omnijev-execute")
        assert respond_thread.startswith("omnijev-respond")


def test_split_answers_keep_the_order_and_a_failed_respond_is_500() -> None:
    engine = SplitEngine()
    body = decision()
    with ThreadServer(engine) as server:
        wait_ready(server.url)
        failed = post(server.url, noul("x", FAIL))
        answered = post(server.url, body)
    assert failed.status_code == 500 and failed.json() == {"detail": "inference failed"}
    assert answered.status_code == 200
    assert list(answered.json()["answers"]) == list(body["questions"])
    assert [stage for stage, _ in engine.stages("x")] == ["readouts", "respond"]


def test_the_worker_caps_torch_threads():
    """serve() caps PyTorch's CPU threads (TORCH_THREADS): more made the heads slower on the
    H200's 16-core host; fewer than the machine has stay as they are."""
    import torch

    from server.app import limit_torch_threads

    before = torch.get_num_threads()
    try:
        assert limit_torch_threads(1) == 1
        torch.set_num_threads(before)
        assert limit_torch_threads(before + 4) == before
    finally:
        torch.set_num_threads(before)
