"""Test engine and servers for the HTTP worker's tests: uvicorn in a thread or in a subprocess.

`RealishEngine` replaces only the model: the contract and preparation are the real ones
(runtime.contract, runtime.processing, the built-in tokenizer), as in runtime.executor.
Run as `python -m tests.server_helpers`, it serves a RealishEngine in a process of its own.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from runtime.contract import compile_request
from runtime.processing import prepare
from runtime.tokenizer import load_tokenizer
from runtime.types import Prepared
from runtime.warm_up import warm_up_request
from server.app import Engine, ListeningServer, create_app, worker_config
from tools import fuzz
from tools.fuzz import data_url, png_bytes  # noqa: F401 - the tests import them from here

MODEL_ID = "tinnel123/OmniJev"  # docs/contract.md §1.3
FAIL = "make execute fail"  # instructions that make RealishEngine.execute raise
HOLD_S = 30.0  # a held stage gives up after this, so that a broken test cannot hang
START_S = 30.0  # a server that does not answer within this failed to start
ROOT = Path(__file__).resolve().parents[1]
UNSENT = ("4096 squared from 50 kB", "over 8 MiB")  # answered; refused too, but 11 MB to send


class RealishEngine:
    """An Engine whose model is a deterministic stand-in; everything before the model is real.

    `prepare` is runtime.executor's: compile_request then processing.prepare. `execute` does not
    run any model: it sleeps `execute_delay` seconds and waits for `release`, raises if a
    question's instructions are FAIL, and builds the response shape of docs/contract.md §3 from the
    prepared layout. `hold_*` make a stage wait until the test lets it go (the warm-up request,
    always the first, excepted), so that tests need no timing guesses.
    """

    model_id = MODEL_ID
    splits = False  # `execute` whole

    def __init__(
        self,
        *,
        execute_delay: float = 0.0,
        hold_execute: bool = False,
        hold_prepare: bool = False,
        hold_warm_up: bool = False,
    ) -> None:
        self.tokenizer = builtin_tokenizer()
        self.execute_delay = execute_delay
        self.execute_gate = threading.Semaphore(0) if hold_execute else None
        self.prepare_gate = threading.Semaphore(0) if hold_prepare else None
        self.warm_up_gate = threading.Event() if hold_warm_up else None
        self.lock = threading.Lock()
        self.prepared = 0  # calls so far, the warm-up's included
        self.started = 0
        self.finished = 0
        self.running = 0
        self.most_running = 0  # executions at once, at most
        self.executed: list[str] = []  # first question id of each finished execution, in order

    def settle(self) -> int:
        return 0  # nothing builds in the background

    def prefix_lookups(self) -> None:
        return None  # no image-prefix cache

    def shape_builds(self) -> tuple[int, float]:
        return 0, 0.0  # no pass shapes to build

    def warm_up_request(self) -> dict:
        if self.warm_up_gate is not None and not self.warm_up_gate.wait(HOLD_S):
            raise TimeoutError("warm-up was never released")
        return warm_up_request()

    def prepare(self, obj: dict) -> Prepared:
        with self.lock:
            self.prepared += 1
            warm_up = self.prepared == 1  # the server runs nothing else before its warm-up
        if not warm_up:
            wait(self.prepare_gate, "prepare")
        return prepare(compile_request(obj), self.tokenizer)

    def execute(self, prepared: Prepared) -> dict:
        with self.lock:
            self.started += 1
            warm_up = self.started == 1
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if not warm_up:
                time.sleep(self.execute_delay)
                wait(self.execute_gate, "execute")
            if any(q.instructions == FAIL for q in prepared.questions):
                raise RuntimeError("the test asked execute to fail")
            return stand_in_response(prepared)
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1
                self.executed.append(prepared.questions[0].id)

    def release(self, executes: int = 0, prepares: int = 0) -> None:
        """Let that many held executions and preparations go on."""
        if executes:
            self.execute_gate.release(executes)
        if prepares:
            self.prepare_gate.release(prepares)

    def open_gates(self) -> None:
        """Hold nothing any more, so that a server can stop after a failed test."""
        for gate in (self.execute_gate, self.prepare_gate):
            if gate is not None:
                gate.release(1000)
        if self.warm_up_gate is not None:
            self.warm_up_gate.set()


@functools.cache
def builtin_tokenizer() -> object:
    return load_tokenizer(None)


def decision(questions: dict | None = None, image: str | None = None) -> dict:
    """A valid request: questions in an order that is not sorted, of every type, 32×32 image."""
    return fuzz.decision(questions, image, size=(32, 32))


def refused_images() -> list[str]:
    """Image strings a worker must refuse (422) quickly: tools.fuzz's, less the one it answers,
    the one over 8 MiB and the 2,000-chunk bombs, and an empty string."""
    bombs = f"x{fuzz.ICCP_CHUNKS}"
    images = fuzz.hostile_images()
    kept = [image for name, image in images.items() if name not in UNSENT and bombs not in name]
    return [*kept, ""]


def project_frames_in_cycles() -> list[str]:
    """The project's frames that only a garbage collection would free (collected here)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        frames = [item for item in gc.garbage if type(item).__name__ == "frame"]
        names = [f"{frame.f_code.co_name} ({frame.f_code.co_filename})" for frame in frames]
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    return [name for name in names if str(ROOT / "runtime") in name or str(ROOT / "server") in name]


def wait(gate: threading.Semaphore | None, stage: str) -> None:
    if gate is not None and not gate.acquire(timeout=HOLD_S):
        raise TimeoutError(f"{stage} was never released")


def stand_in_response(prepared: Prepared) -> dict:
    """A response of the right shape: each option weighs its row length (no model involved)."""
    total = round(prepared.prepare_seconds, 4)
    per_question = round(total / len(prepared.layouts), 4)
    answers = {}
    for layout in prepared.layouts:
        question = layout.question
        weights = [len(row.tokens) for row in layout.rows]
        probabilities = [round(w / sum(weights), 4) for w in weights]
        best = max(range(len(weights)), key=probabilities.__getitem__)
        by_key = dict(zip(question.keys, probabilities, strict=True))
        if question.type == "noul":
            answer = {"noul": round(1 / (1 + len(question.instructions)), 4)}
        elif question.type == "choice":
            answer = {
                "choice": question.keys[best],
                "probabilities": by_key,
                "abstain": 0.0,
                "valid": True,
                "confidence": probabilities[best],
            }
        else:
            answer = {
                "score": question.keys[best],
                "probabilities": by_key,
                "confidence": probabilities[best],
            }
        answers[question.id] = {**answer, "latency_s": per_question, "latency_total_s": total}
    usage = {"input_tokens": prepared.input_tokens, "output_tokens": 0}
    return {"model": MODEL_ID, "answers": answers, "usage": usage}


def listening_socket() -> socket.socket:
    """A socket bound to a free loopback port and listening, for uvicorn to serve on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def server_config(app: object) -> uvicorn.Config:
    """The worker's own uvicorn settings (server.app.worker_config), quieter and quicker to stop."""
    return worker_config(app, lifespan="on", log_level="warning", timeout_graceful_shutdown=30)


def worker_server(app: Any) -> ListeningServer:
    return ListeningServer(server_config(app), app.state.draining)


class ThreadServer:
    """uvicorn serving an app in a background thread of the test process."""

    def __init__(self, engine: Engine, **options: Any) -> None:
        self.engine = engine
        self.sock = listening_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = worker_server(create_app(engine, **options))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + START_S
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        if isinstance(self.engine, RealishEngine):
            self.engine.open_gates()
        self.server.should_exit = True
        self.thread.join(START_S)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not stop"


class SubprocessServer:
    """This module run with -m: a worker process of its own, for signals and its RSS.

    With `cli=True` it serves through `omnijev serve` (runtime.cli, server.app.serve) on a free
    port, so that the production settings (graceful shutdown, logging) are the ones tested.
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None, cli: bool = False) -> None:
        self.sock = listening_socket()
        port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        if cli:
            self.sock.close()  # the CLI binds the port itself
            where = ["--port", str(port)]
        else:
            where = ["--fd", str(self.sock.fileno())]
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.server_helpers", *where, *args],
            cwd=ROOT,
            pass_fds=() if cli else (self.sock.fileno(),),
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def __enter__(self) -> SubprocessServer:
        wait_ready(self.url, self.process)
        return self

    def __exit__(self, *_: object) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(START_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(START_S)
        self.sock.close()
        self.log.close()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


def wait_ready(url: str, process: subprocess.Popen | None = None) -> None:
    """Poll /health until it answers 200."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert process is None or process.poll() is None, "server exited"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="serve on this inherited listening socket")
    where.add_argument("--port", type=int, help="serve through `omnijev serve` on this port")
    parser.add_argument("--execute-delay", type=float, default=0.0)
    args = parser.parse_args()
    engine = RealishEngine(execute_delay=args.execute_delay)
    if args.port is not None:
        from runtime.cli import build_parser
        from server.app import cli_serve

        unused = os.devnull
        argv = ["serve", "--checkpoint", unused, "--engines", unused, "--port", str(args.port)]
        cli_serve(build_parser().parse_args(argv), load=lambda *_: engine)
        return
    server = worker_server(create_app(engine))
    server.run(sockets=[socket.socket(fileno=args.fd)])  # exits 0 after SIGTERM


if __name__ == "__main__":
    main()
