"""The HTTP worker over real HTTP: statuses, order of checks, admission, disconnects, shutdown.

Every test talks to uvicorn on a free loopback port (server/app.py, docs/contract.md §1); the engine
is tests/server_helpers.RealishEngine, whose contract and preparation are the real ones.
"""

from __future__ import annotations

import gc
import json
import logging
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.admission import ADMITTED
from server.app import MAX_BODY
from tests.server_helpers import (
    FAIL,
    MODEL_ID,
    RealishEngine,
    SubprocessServer,
    ThreadServer,
    decision,
    project_frames_in_cycles,
    refused_images,
    wait_ready,
)

DECIDE = "/v1/systemone"
BUSY = {"detail": "the worker is busy"}
NEW_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex
WAIT_S = 20.0  # bound of every polling loop
MiB = 1024 * 1024
JSON_HEADERS = {"Content-Type": "application/json"}


def until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics: `name{label=value,...}` -> value."""
    response = httpx.get(url + "/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def admitted(url: str) -> float:
    return metrics(url)["omnijev_admitted_requests"]


def post(url: str, body: object, **kwargs: object) -> httpx.Response:
    return httpx.post(url + DECIDE, json=body, timeout=WAIT_S * 2, **kwargs)


def raw_post(url: str, body: bytes) -> socket.socket:
    """Send a request on a socket of our own, so that the test can close it at will."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = f"POST {DECIDE} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def ordered(response: httpx.Response) -> list:
    """The JSON body as nested (key, value) lists, so that field order can be compared."""
    return json.loads(response.content, object_pairs_hook=list)


def assert_new_id(response: httpx.Response) -> None:
    assert NEW_ID.fullmatch(response.headers["x-request-id"]), response.headers


@pytest.fixture(scope="module")
def served() -> Iterator[ThreadServer]:
    with ThreadServer(RealishEngine()) as server:
        wait_ready(server.url)
        yield server


@pytest.fixture
def requests_log(caplog: pytest.LogCaptureFixture) -> Callable[[], list[dict]]:
    caplog.set_level(logging.INFO, logger="omnijev.requests")

    def lines() -> list[dict]:
        return [json.loads(r.message) for r in caplog.records if r.name == "omnijev.requests"]

    return lines


# -- statuses ---------------------------------------------------------------------------------


def test_answer_is_compact_json_in_request_and_field_order(served: ThreadServer) -> None:
    response = post(served.url, decision(), headers={"x-request-id": "client-id 42"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"] == "client-id 42"
    assert b": " not in response.content and b", " not in response.content
    body = ordered(response)
    assert [key for key, _ in body] == ["model", "answers", "usage"]
    answers = dict(body)["answers"]
    assert [key for key, _ in answers] == ["zeta", "alpha", "mid"]
    fields = {qid: [key for key, _ in answer] for qid, answer in answers}
    assert fields == {
        "zeta": ["choice", "probabilities", "abstain", "valid", "confidence"]
        + ["latency_s", "latency_total_s"],
        "alpha": ["score", "probabilities", "confidence", "latency_s", "latency_total_s"],
        "mid": ["noul", "latency_s", "latency_total_s"],
    }
    parsed = response.json()
    assert parsed["model"] == MODEL_ID
    assert list(parsed["answers"]["alpha"]["probabilities"]) == ["low", "high"]
    assert parsed["usage"]["output_tokens"] == 0 and parsed["usage"]["input_tokens"] > 64


NOT_JSON = [
    b"{",
    b'{"model": "omnijev",}',
    b"{} {}",
    b'{"a": NaN}',
    b'{"a": -Infinity}',
    b'{"a": 1e400}',
    b'{"a": "\\ud800"}',
    b'{"a": {"b": 1, "b": 2}}',
    b"\xef\xbb\xbf{}",
    b'{"a": "\xff"}',
    b"[" * 128 + b"]" * 128,
    b"",
]


@pytest.mark.parametrize("body", NOT_JSON, ids=range(len(NOT_JSON)))
def test_strict_json_failures_are_400(served: ThreadServer, body: bytes) -> None:
    response = httpx.post(served.url + DECIDE, headers=JSON_HEADERS, content=body)
    assert response.status_code == 400
    assert response.json()["detail"].startswith("request body is not valid JSON: ")
    assert_new_id(response)


@pytest.mark.parametrize("body", [b"[]", b'"text"', b"16", b"null"])
def test_top_level_not_an_object_is_400(served: ThreadServer, body: bytes) -> None:
    response = httpx.post(served.url + DECIDE, headers=JSON_HEADERS, content=body)
    assert (response.status_code, response.json()) == (
        400,
        {"detail": "request body must be a JSON object"},
    )
    assert_new_id(response)


def test_body_over_12_mib_is_413_with_or_without_content_length(served: ThreadServer) -> None:
    big = b" " * (13 * MiB)
    with_length = httpx.post(served.url + DECIDE, headers=JSON_HEADERS, content=big, timeout=WAIT_S)
    chunked = httpx.post(
        served.url + DECIDE,
        headers=JSON_HEADERS,
        content=(big[i : i + MiB] for i in range(0, len(big), MiB)),
        timeout=WAIT_S,
    )
    assert "content-length" in with_length.request.headers
    assert chunked.request.headers["transfer-encoding"] == "chunked"
    for response in (with_length, chunked):
        assert response.status_code == 413
        assert response.json() == {"detail": "request body exceeds 12 MiB"}
        assert response.headers["connection"] == "close"
        assert_new_id(response)
    # exactly 12 MiB is read and parsed: the contract refuses it, not the size check
    exact = httpx.post(
        served.url + DECIDE, headers=JSON_HEADERS, content=b"{}".ljust(MAX_BODY), timeout=WAIT_S
    )
    assert (exact.status_code, exact.json()) == (422, {"detail": "request requires state"})


def test_declared_oversize_with_expect_continue_is_refused_unread(served: ThreadServer) -> None:
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(
            f"POST {DECIDE} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Expect: 100-continue\r\nContent-Length: {13 * MiB}\r\n\r\n".encode()
        )
        head = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            head += chunk
    head = head.decode()
    assert head.startswith("HTTP/1.1 413 "), head
    assert "x-request-id: " in head
    assert head.endswith('{"detail":"request body exceeds 12 MiB"}')


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"prompt": "hi"}, "request fields must be model, state and questions"),
        ({**decision(), "model": "gpt-4o"}, "requested model is not loaded"),
        ({**decision(), "state": {"images": []}}, "state.images must contain exactly one image"),
        (
            decision({"q": {"type": "score", "instructions": "x", "levels": ["a"] * 256}}),
            "question q: a question needs 1 to 255 options",
        ),
    ],
    ids=["fields", "model", "images", "options"],
)
def test_contract_refusals_are_422_with_the_contract_detail(
    served: ThreadServer, body: dict, detail: str
) -> None:
    response = post(served.url, body)
    assert (response.status_code, response.json()) == (422, {"detail": detail})
    assert_new_id(response)


def test_execution_failure_is_500_and_the_worker_keeps_serving(
    served: ThreadServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="omnijev.server")
    failing = decision({"q": {"type": "noul", "instructions": FAIL}})
    response = post(served.url, failing, headers={"x-request-id": "boom-1"})
    assert (response.status_code, response.json()) == (500, {"detail": "inference failed"})
    assert response.headers["x-request-id"] == "boom-1"
    logged = [r for r in caplog.records if "boom-1" in r.getMessage()]
    assert logged and "the test asked execute to fail" in caplog.text  # the traceback
    assert post(served.url, decision()).status_code == 200


def test_unknown_routes_and_methods_get_the_framework_defaults(served: ThreadServer) -> None:
    cases = [
        (httpx.get(served.url + "/nope"), 404, "Not Found"),
        (httpx.get(served.url + DECIDE), 405, "Method Not Allowed"),
        (httpx.post(served.url + "/health"), 405, "Method Not Allowed"),
    ]
    for response, status, detail in cases:
        assert (response.status_code, response.json()) == (status, {"detail": detail})
        assert_new_id(response)


@pytest.mark.parametrize(
    ("sent", "echoed"),
    [("abc-DEF_123", True), ("x" * 128, True), ("x" * 129, False), (b"caf\xc3\xa9", False)],
    ids=["sane", "128", "129", "non-ascii"],
)
def test_request_id_is_echoed_only_when_sane(
    served: ThreadServer, sent: str | bytes, echoed: bool
) -> None:
    response = httpx.get(served.url + "/health", headers={"x-request-id": sent})
    if echoed:
        assert response.headers["x-request-id"] == sent
    else:
        assert_new_id(response)


def test_openapi_describes_the_decision_route(served: ThreadServer) -> None:
    document = httpx.get(served.url + "/openapi.json").json()
    operation = document["paths"][DECIDE]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/DecisionRequest"}
    schemas = document["components"]["schemas"]
    assert {"DecisionRequest", "NoulQuestion", "ChoiceQuestion", "DecisionResponse"} <= set(schemas)
    assert {"200", "400", "413", "422", "500", "503"} <= set(operation["responses"])
    assert httpx.get(served.url + "/docs").status_code == 200


# -- warm-up, health and metrics --------------------------------------------------------------


def test_health_is_503_until_the_warm_up_request_has_run() -> None:
    engine = RealishEngine(hold_warm_up=True)
    with ThreadServer(engine) as server:
        health = httpx.get(server.url + "/health")
        assert (health.status_code, health.json()) == (503, {"status": "warming up"})
        early = post(server.url, decision())
        assert (early.status_code, early.json()) == (503, {"detail": "the worker is warming up"})
        assert early.headers["retry-after"] == "1"
        assert engine.started == 0
        engine.warm_up_gate.set()
        wait_ready(server.url)
        health = httpx.get(server.url + "/health")
        assert health.json() == {"status": "ready", "model": MODEL_ID}
        assert engine.finished == 1  # the warm-up request went through execute
        assert post(server.url, decision()).status_code == 200


def test_operator_warm_up_requests_run_before_ready() -> None:
    """`omnijev serve --warm-up FILE`: those requests run after the built-in one, and the worker
    reports ready only when they are done (their shapes' sessions and graphs exist by then)."""
    engine = RealishEngine()
    with ThreadServer(engine, warm_ups=[decision()]) as server:
        wait_ready(server.url)
        assert engine.finished == 2 and engine.executed[1] == "zeta"
        assert post(server.url, decision()).status_code == 200


def test_warm_up_repeats_once_background_sessions_have_settled() -> None:
    """An engine that built fixed-shape sessions during the first round (the GPU default) gets
    two more rounds after they settle, so that its CUDA graphs are captured before ready."""
    engine = RealishEngine()
    settled = []
    engine.settle = lambda: settled.append(True) or 3  # three sessions were being built
    with ThreadServer(engine, warm_ups=[decision()]) as server:
        wait_ready(server.url)
        assert settled == [True] and engine.finished == 2 * 3
        assert engine.executed[1::2] == ["zeta"] * 3


def test_a_failing_operator_warm_up_keeps_the_worker_unready() -> None:
    engine = RealishEngine()
    failing = decision({"bad": {"type": "noul", "instructions": FAIL}})
    with ThreadServer(engine, warm_ups=[failing]) as server:
        until(lambda: httpx.get(server.url + "/health").json()["status"] != "warming up", "warm-up")
        assert httpx.get(server.url + "/health").json() == {"status": "warm-up failed"}


def test_warm_up_files_are_checked_before_serving(tmp_path) -> None:
    from server.app import read_warm_up

    good = tmp_path / "good.json"
    good.write_text(json.dumps(decision()))
    assert read_warm_up(str(good))["questions"].keys() == decision()["questions"].keys()
    cases = {
        "missing.json": None,
        "broken.json": "{not json",
        "refused.json": json.dumps(decision({})),
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit, match=f"warm-up request {re.escape(str(path))}: "):
            read_warm_up(str(path))


def test_a_failed_warm_up_keeps_the_worker_unready() -> None:
    engine = RealishEngine()
    engine.warm_up_request = lambda: {"questions": {}}  # type: ignore[method-assign]
    with ThreadServer(engine) as server:
        until(lambda: httpx.get(server.url + "/health").json()["status"] != "warming up", "warm-up")
        health = httpx.get(server.url + "/health")
        assert (health.status_code, health.json()) == (503, {"status": "warm-up failed"})
        refused = post(server.url, decision())
        assert refused.status_code == 503 and "retry-after" not in refused.headers
        assert refused.json() == {"detail": "the worker failed to warm up"}
        assert engine.finished == 0


def test_metrics_count_requests_stages_admission_and_tokens() -> None:
    with ThreadServer(RealishEngine()) as server:
        wait_ready(server.url)
        answered = [post(server.url, decision()) for _ in range(2)]
        tokens = sum(r.json()["usage"]["input_tokens"] for r in answered)
        assert (
            httpx.post(server.url + DECIDE, headers=JSON_HEADERS, content=b"{").status_code == 400
        )
        assert post(server.url, {"prompt": 1}).status_code == 422
        failing = decision({"q": {"type": "noul", "instructions": FAIL}})
        assert post(server.url, failing).status_code == 500
        samples = metrics(server.url)
    requests = {
        key: value for key, value in samples.items() if key.startswith("omnijev_requests_total")
    }
    assert requests == {
        "omnijev_requests_total{status=200}": 2,
        "omnijev_requests_total{status=400}": 1,
        "omnijev_requests_total{status=422}": 1,
        "omnijev_requests_total{status=500}": 1,
    }
    assert samples["omnijev_admitted_total"] == 4  # the 400 never reached admission
    assert samples["omnijev_rejected_total"] == 0
    assert samples["omnijev_input_tokens_total"] == tokens
    assert samples["omnijev_questions_total"] == 6
    stage_counts = {
        stage: samples[f"omnijev_stage_seconds_count{{stage={stage}}}"]
        for stage in ("prepare", "queue_wait", "execute", "total")
    }
    assert stage_counts == {"prepare": 4, "queue_wait": 4, "execute": 3, "total": 5}
    assert samples["omnijev_admitted_requests"] == 0
    assert samples["omnijev_queue_depth"] == 0


# -- admission --------------------------------------------------------------------------------


def test_8_requests_past_the_admitted_get_503_busy() -> None:
    engine = RealishEngine(hold_execute=True)
    with ThreadPoolExecutor(ADMITTED + 8) as pool, ThreadServer(engine) as server:
        wait_ready(server.url)
        body = decision()
        futures = [pool.submit(post, server.url, body) for _ in range(ADMITTED + 8)]
        until(lambda: sum(f.done() for f in futures) == 8, "8 refusals")
        assert admitted(server.url) == ADMITTED
        # the JSON check comes before admission, so a malformed body still gets its 400
        assert (
            httpx.post(server.url + DECIDE, headers=JSON_HEADERS, content=b"{,}").status_code == 400
        )
        busy = [f.result() for f in futures if f.done()]
        engine.release(executes=ADMITTED)
        responses = [f.result() for f in futures]
    assert sorted(r.status_code for r in responses) == [200] * ADMITTED + [503] * 8
    for response in busy:
        assert (response.status_code, response.json()) == (503, BUSY)
        assert response.headers["retry-after"] == "1"
        assert_new_id(response)
    assert engine.finished == 1 + ADMITTED  # the warm-up, then every admitted request
    assert engine.most_running == 1


def test_a_large_body_while_the_admitted_are_full_gets_503_before_it_is_sent() -> None:
    engine = RealishEngine(hold_execute=True)
    with ThreadPoolExecutor(ADMITTED) as pool, ThreadServer(engine) as server:
        wait_ready(server.url)
        futures = [pool.submit(post, server.url, decision()) for _ in range(ADMITTED)]
        until(lambda: admitted(server.url) == ADMITTED, "the admitted full")
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            # a large body's first byte only: read, it could never be parsed before the deadline
            sock.sendall(
                f"POST {DECIDE} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {5 * MiB}\r\n\r\n{{".encode()
            )
            sock.settimeout(WAIT_S)
            raw = b""
            while b"\r\n\r\n" not in raw:
                raw += sock.recv(65536)
            head, _, body = raw.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: (\d+)", head)[1])
            while len(body) < length:
                body += sock.recv(65536)
        assert admitted(server.url) == ADMITTED
        engine.release(executes=ADMITTED)
        assert [f.result().status_code for f in futures] == [200] * ADMITTED
    assert head.startswith(b"HTTP/1.1 503") and re.search(rb"(?i)retry-after: 1", head)
    assert json.loads(body) == BUSY


def test_execution_is_serial_and_first_in_first_out() -> None:
    engine = RealishEngine(hold_execute=True)
    with ThreadPoolExecutor(4) as pool, ThreadServer(engine) as server:
        wait_ready(server.url)
        futures = []
        for depth, name in enumerate("abcd"):
            body = decision({name: {"type": "noul", "instructions": name}})
            futures.append(pool.submit(post, server.url, body))
            if depth == 0:
                until(lambda: engine.started == 2, "the first request to execute")
            else:
                until(lambda n=depth: metrics(server.url)["omnijev_queue_depth"] == n, "queueing")
        engine.release(executes=4)
        assert [f.result().status_code for f in futures] == [200] * 4
    assert engine.executed[1:] == ["a", "b", "c", "d"]
    assert engine.most_running == 1


def test_a_running_request_keeps_its_slot_after_its_client_leaves(
    requests_log: Callable[[], list[dict]],
) -> None:
    engine = RealishEngine(hold_execute=True)
    with ThreadPoolExecutor(ADMITTED) as pool, ThreadServer(engine) as server:
        wait_ready(server.url)
        leaver = raw_post(server.url, json.dumps(decision()).encode())
        until(lambda: engine.started == 2, "the first request to execute")
        others = [pool.submit(post, server.url, decision()) for _ in range(ADMITTED - 1)]
        until(lambda: admitted(server.url) == ADMITTED, "the admitted full")
        leaver.close()
        time.sleep(0.3)  # ample for the server to see the connection close on loopback
        for _ in range(3):
            assert post(server.url, decision()).json() == BUSY
        assert admitted(server.url) == ADMITTED
        engine.release(executes=1)  # only the running request, whose client has gone
        until(lambda: admitted(server.url) == ADMITTED - 1, "the running request to end")
        late: Future[httpx.Response] = pool.submit(post, server.url, decision())
        until(lambda: admitted(server.url) == ADMITTED, "one more request to be admitted")
        engine.release(executes=ADMITTED)
        assert [f.result().status_code for f in [*others, late]] == [200] * ADMITTED
    gone = [line for line in requests_log() if line.get("outcome") == "client gone"]
    assert len(gone) == 1 and gone[0]["status"] == 200 and gone[0]["execute_s"] > 0


@pytest.mark.parametrize("stage", ["prepare", "execute"])
def test_a_waiting_request_whose_client_leaves_is_dropped_unrun(
    stage: str, requests_log: Callable[[], list[dict]]
) -> None:
    engine = RealishEngine(hold_prepare=stage == "prepare", hold_execute=stage == "execute")
    with ThreadPoolExecutor(2) as pool, ThreadServer(engine, preparing=2) as server:
        wait_ready(server.url)
        # hold both preparation slots, or the execution permit
        count = 2 if stage == "prepare" else 1
        holders = [pool.submit(post, server.url, decision()) for _ in range(count)]
        if stage == "prepare":
            until(lambda: engine.prepared == 1 + count, "both holders to prepare")
        else:
            until(lambda: engine.started == 2, "the holder to execute")
        leaver = raw_post(server.url, json.dumps(decision()).encode())
        until(lambda: admitted(server.url) == count + 1, "the leaver to be admitted")
        waiting = "omnijev_preparing_requests" if stage == "prepare" else "omnijev_queue_depth"
        until(lambda: metrics(server.url)[waiting] == (2 if stage == "prepare" else 1), "a wait")
        leaver.close()
        until(lambda: admitted(server.url) == len(holders), "the leaver's slot to be released")
        engine.release(**{f"{stage}s": len(holders)})
        assert [f.result().status_code for f in holders] == [200] * len(holders)
        assert metrics(server.url)[waiting] == 0
    # the leaver reached neither the stage it waited for nor any after it
    assert engine.prepared == 1 + len(holders) + (stage == "execute")
    assert engine.finished == 1 + len(holders)
    dropped = [line for line in requests_log() if line.get("outcome") == "dropped"]
    assert len(dropped) == 1 and dropped[0]["status"] == 499


# -- shutdown and the real executor -----------------------------------------------------------


def test_sigterm_lets_in_flight_work_finish() -> None:
    """Through `omnijev serve`, so that the production shutdown settings are the ones tested."""
    cli = SubprocessServer("--execute-delay", "1.5", cli=True)
    with ThreadPoolExecutor(1) as pool, cli as server:
        in_flight = pool.submit(post, server.url, decision(), headers={"x-request-id": "last"})
        until(
            lambda: (
                metrics(server.url)["omnijev_admitted_requests"] == 1
                and metrics(server.url)["omnijev_preparing_requests"] == 0
            ),
            "the request to execute",
        )
        server.process.send_signal(signal.SIGTERM)
        response = in_flight.result()
        assert response.status_code == 200, server.output()
        assert response.json()["model"] == MODEL_ID
        assert server.process.wait(WAIT_S) == 0  # a clean shutdown, not 128 + SIGTERM
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/health", timeout=2)
        output = server.output()
    assert f"OmniJev worker listening on {server.url.removeprefix('http://')}" in output
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    last = [line for line in lines if line["request_id"] == "last"]
    assert last and last[0]["status"] == 200 and last[0]["execute_s"] >= 1.5


def test_the_real_executor_end_to_end(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The worker over runtime.executor on the tiny checkpoint's ONNX Runtime engines."""
    executor = pytest.importorskip("runtime.executor")
    pytest.importorskip("build_engines.onnx_export")
    from tests.engine_fixtures import tiny_engines  # shared with test_executor: built once

    export, engines = tiny_engines(tmp_path_factory)
    engine = executor.load_engine(str(export), str(engines), "onnxruntime")
    with ThreadServer(engine) as server:
        wait_ready(server.url)
        first, again = post(server.url, decision()), post(server.url, decision())
        refused = post(server.url, {**decision(), "model": "other"})
        gc.collect()
        gc.disable()  # the real preparation's refusals leave no cycle behind (see test_server_fuzz)
        try:
            images = [post(server.url, decision(image=image)) for image in refused_images()]
            left = project_frames_in_cycles()
        finally:
            gc.enable()
    assert {response.status_code for response in images} == {422} and left == []
    assert first.status_code == 200, first.text
    body = ordered(first)
    assert [key for key, _ in body] == ["model", "answers", "usage"]
    assert [key for key, _ in dict(body)["answers"]] == ["zeta", "alpha", "mid"]
    answers = first.json()["answers"]
    assert list(answers["zeta"]["probabilities"]) == ["a", "b"]
    assert again.json()["answers"]["zeta"]["probabilities"] == answers["zeta"]["probabilities"]
    assert refused.status_code == 422
    assert refused.json() == {"detail": "requested model is not loaded"}


def test_shape_builds_after_ready_are_counted_as_serving(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """ONNX Runtime with a session per pass shape (its dimensions fixed; the CUDA default, here
    on the CPU): the warm-up's builds are counted as such, and a request of an image size the
    warm-up never ran builds while serving, with its seconds. (The CPU's other engines build
    nothing per shape: the torch engine runs eagerly there, ONNX Runtime in one dynamic session.)
    """
    executor = pytest.importorskip("runtime.executor")
    pytest.importorskip("build_engines.onnx_export")
    from reference.questions import data_url, pattern_png
    from runtime.backends.ort import OrtBackend
    from tests.engine_fixtures import tiny_engines

    export, engines = tiny_engines(tmp_path_factory)
    backend = OrtBackend(engines, static_shapes=True)
    engine = executor.load_engine(str(export), str(engines), "onnxruntime", backend=backend)
    builds, seconds = "omnijev_shape_builds_total", "omnijev_shape_build_seconds_total"
    with ThreadServer(engine) as server:
        wait_ready(server.url)
        ready = metrics(server.url)
        assert ready[f"{builds}{{phase=warm-up}}"] > 0 and ready[f"{seconds}{{phase=warm-up}}"] > 0
        assert ready[f"{builds}{{phase=serving}}"] == ready[f"{seconds}{{phase=serving}}"] == 0
        again = post(server.url, engine.warm_up_request())  # the warm-up's shapes: none new
        assert again.status_code == 200, again.text
        assert metrics(server.url)[f"{builds}{{phase=serving}}"] == 0
        other = decision(image=data_url(pattern_png(96, 64)))

        def built_while_serving() -> bool:
            # a new shape's session builds in the background, installed at a later sight
            assert post(server.url, other).status_code == 200
            return metrics(server.url)[f"{builds}{{phase=serving}}"] >= 1

        until(built_while_serving, "a build while serving")
        after = metrics(server.url)
    assert after[f"{seconds}{{phase=serving}}"] > 0
    assert after[f"{builds}{{phase=warm-up}}"] == ready[f"{builds}{{phase=warm-up}}"]


def test_threads_are_not_leaked_by_stopped_servers() -> None:
    before = threading.active_count()
    with ThreadServer(RealishEngine()) as server:
        wait_ready(server.url)
        assert post(server.url, decision()).status_code == 200
    until(lambda: threading.active_count() <= before, "the worker threads to stop", 5)
