"""`omnijev bench`'s many clients: the engine served by the real worker on a loopback port and
the traffic suite's requests sent by 1, 4 and 16 closed-loop clients in turn (`bench.load`),
each request's answers compared across the client counts."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx

from bench import traffic
from bench.load import differing_answers, run_load
from server.admission import ADMITTED

CLIENTS = (1, 4, 16)
REQUESTS = 64  # suite requests a client count
READY_S = 1800.0  # a cold GPU start compiles every shape before /health turns 200
RETRIES = 30  # a 503's Retry-After honoured, as the SDKs do


@contextlib.contextmanager
def served(engine, admitted: int = ADMITTED) -> Iterator[str]:
    """The worker's app (warm-up included), admitting `admitted`, on a free loopback port in a
    thread: its URL once /health answers 200."""
    from server.app import ListeningServer, bind, create_app, worker_config

    app = create_app(engine, admitted=admitted)
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = worker_config(app, lifespan="on", log_level="warning")
    server = ListeningServer(config, app.state.draining)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + READY_S
        while not ready(url):
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the worker was not ready within {READY_S:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def client_runs(engine, counts=CLIENTS, requests: int = REQUESTS, seed: int = 0) -> dict:
    """The same suite requests at each client count: each run's report (without its requests)
    and the requests whose answers differed between runs."""
    bodies = [traffic.request(seed, index).body for index in range(requests)]
    with served(engine) as url:
        reports = [run_load(url + "/v1/systemone", bodies, n, RETRIES) for n in counts]
    differing = differing_answers(reports)
    for report in reports:
        del report["records"]
    return {"runs": reports, "answers_differing": differing}
