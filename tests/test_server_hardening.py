"""The worker under hostile clients (issue 14): Host and Content-Type checks, HTTP-level errors
with request ids, header and body deadlines, upload slots, shutdown, the port bound first.

Every test talks to uvicorn over real loopback HTTP (server/app.py, server/protocol.py).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from server import protocol
from server.app import cli_serve
from tests.server_helpers import (
    RealishEngine,
    SubprocessServer,
    ThreadServer,
    decision,
    listening_socket,
)

DECIDE = "/v1/systemone"
JSON_HEADERS = {"Content-Type": "application/json"}
NEW_ID = re.compile(r"[0-9a-f]{32}")
WAIT_S = 20.0
MiB = 1024 * 1024


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def read_all(sock: socket.socket, timeout: float = WAIT_S) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def head_value(raw: bytes, name: bytes) -> bytes | None:
    head = raw.split(b"\r\n\r\n", 1)[0]
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


@pytest.fixture(scope="module")
def served() -> Iterator[ThreadServer]:
    with ThreadServer(RealishEngine()) as server:
        httpx.get(server.url + "/health")  # the first request may race the warm-up
        yield server


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_decision_must_say_it_is_json(served: ThreadServer, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = json.dumps(decision()).encode()
    response = httpx.post(served.url + DECIDE, content=body, headers=headers, timeout=WAIT_S)
    assert response.status_code == 415
    assert response.json()["detail"].startswith("content type must be application/json")
    assert NEW_ID.fullmatch(response.headers["x-request-id"])
    charset = {"Content-Type": "application/json; charset=utf-8"}
    assert httpx.post(served.url + DECIDE, content=body, headers=charset).status_code == 200


def test_hosts_outside_the_allow_list_are_refused(served: ThreadServer) -> None:
    for host in ("evil.example", "127.0.0.1.evil.example", "localhost.:80"):
        response = httpx.get(served.url + "/health", headers={"Host": host})
        assert response.status_code == 400, host
        assert "is not allowed" in response.json()["detail"]
        assert response.headers["x-request-id"]
    for host in ("localhost", "LOCALHOST:8000", "127.0.0.1:1"):
        assert httpx.get(served.url + "/health", headers={"Host": host}).status_code == 200


def test_the_allow_list_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIJEV_ALLOWED_HOSTS", "worker.internal")
    with ThreadServer(RealishEngine()) as server:
        assert httpx.get(server.url + "/health", headers={"Host": "worker.internal"}).is_success
        assert httpx.get(server.url + "/health").status_code == 400  # 127.0.0.1 no more
    with ThreadServer(RealishEngine(), allowed_hosts=["*"]) as server:
        assert httpx.get(server.url + "/health", headers={"Host": "anything"}).is_success


def test_the_trailing_slash_route_is_404_not_a_redirect(served: ThreadServer) -> None:
    body = json.dumps(decision()).encode()
    response = httpx.post(served.url + DECIDE + "/", content=body, headers=JSON_HEADERS)
    assert response.status_code == 404
    assert response.headers["x-request-id"]


def test_documentation_routes_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    with ThreadServer(RealishEngine(), docs=False) as server:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(server.url + path).status_code == 404
    monkeypatch.setenv("OMNIJEV_DOCS", "0")
    with ThreadServer(RealishEngine()) as server:
        assert httpx.get(server.url + "/openapi.json").status_code == 404
    monkeypatch.delenv("OMNIJEV_DOCS")
    with ThreadServer(RealishEngine()) as server:
        assert httpx.get(server.url + "/openapi.json").status_code == 200


def test_oversized_headers_get_431_with_an_id_not_a_reset(served: ThreadServer) -> None:
    with socket.create_connection(address(served.url)) as sock:
        huge = b"x-filler: " + b"a" * (200 * 1024) + b"\r\n"
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + huge + b"\r\n")
        raw = read_all(sock)
    assert status_of(raw) == 431
    assert NEW_ID.fullmatch(head_value(raw, b"x-request-id").decode())
    assert b"request headers exceed" in raw


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n",
        b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    ],
    ids=["garbage", "bad-content-length", "conflicting-lengths"],
)
def test_http_level_errors_carry_a_request_id(
    served: ThreadServer, request_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.create_connection(address(served.url)) as sock:
        sock.sendall(request_bytes)
        raw = read_all(sock)
    assert status_of(raw) == 400
    request_id = head_value(raw, b"x-request-id").decode()
    assert NEW_ID.fullmatch(request_id)
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["detail"].startswith("invalid HTTP request")


def test_a_client_stalled_in_its_headers_gets_408_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(protocol.GuardedH11Protocol, "header_read_s", 0.5)
    caplog.set_level("INFO", "omnijev.requests")
    with ThreadServer(RealishEngine()) as server:
        with socket.create_connection(address(server.url)) as partial:
            partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            started = time.monotonic()
            raw = read_all(partial)
            waited = time.monotonic() - started
        with socket.create_connection(address(server.url)) as silent:
            assert read_all(silent) == b""  # nothing sent: closed without an answer
        assert httpx.get(server.url + "/health").status_code == 200
    assert status_of(raw) == 408
    assert 0.4 < waited < 3.0
    request_id = head_value(raw, b"x-request-id").decode()
    assert any(request_id in record.getMessage() for record in caplog.records)


def test_a_client_stalled_in_its_body_gets_408_at_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", "omnijev.requests")
    with ThreadServer(RealishEngine(), body_read_s=0.5) as server:
        with socket.create_connection(address(server.url)) as sock:
            sock.sendall(
                b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
            )
            started = time.monotonic()
            raw = read_all(sock)
            waited = time.monotonic() - started
    assert status_of(raw) == 408
    assert 0.4 < waited < 3.0
    request_id = head_value(raw, b"x-request-id").decode()
    logged = [json.loads(r.getMessage()) for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0]["status"] == 408


def test_large_uploads_take_a_slot_and_small_bodies_pass() -> None:
    with ThreadServer(RealishEngine(), uploads=1, upload_wait_s=0.5) as server:
        holder = socket.create_connection(address(server.url))
        try:  # a large upload that stalls half-way holds the only slot
            holder.sendall(
                b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n{" + b" " * MiB
            )
            time.sleep(0.3)
            big = json.dumps({**decision(), "pad": " " * (2 * MiB)}).encode()
            started = time.monotonic()
            busy = httpx.post(server.url + DECIDE, content=big, headers=JSON_HEADERS)
            assert busy.status_code == 503
            assert 0.4 < time.monotonic() - started < 5  # it waited in line for the slot
            assert busy.headers["retry-after"] == "1"
            small = httpx.post(server.url + DECIDE, json=decision())
            assert small.status_code == 200
        finally:
            holder.close()
        time.sleep(0.3)  # the slot comes back once the stalled upload is gone
        again = httpx.post(server.url + DECIDE, content=big, headers=JSON_HEADERS)
        assert again.status_code == 422  # read, parsed, and refused by the contract for "pad"


def test_sigterm_with_stalled_clients_and_work_in_flight_exits_0_promptly() -> None:
    with SubprocessServer("--execute-delay", "2") as server:
        stalled = []
        for _ in range(10):
            headers_only = socket.create_connection(address(server.url))
            headers_only.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            body_half = socket.create_connection(address(server.url))
            body_half.sendall(
                b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            stalled += [headers_only, body_half]
        results: list[int] = []
        worker = threading.Thread(
            target=lambda: results.append(
                httpx.post(server.url + DECIDE, json=decision(), timeout=WAIT_S).status_code
            )
        )
        worker.start()
        time.sleep(0.5)  # the request is executing (2 s)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        status = server.process.wait(WAIT_S)
        took = time.monotonic() - started
        worker.join(WAIT_S)
        for sock in stalled:
            sock.close()
    assert status == 0
    assert results == [200]
    assert took < 2 + 5  # in-flight work plus 5 s


def test_the_port_is_bound_before_the_model_loads() -> None:
    def never(*_: object) -> None:
        raise AssertionError("the model loaded before the port was checked")

    taken = listening_socket()
    try:
        port = taken.getsockname()[1]
        args = SimpleNamespace(
            warm_up=None, host="127.0.0.1", port=port, checkpoint="x", engines="y", backend="auto"
        )
        started = time.monotonic()
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            cli_serve(args, load=never)
        assert time.monotonic() - started < 1.0
    finally:
        taken.close()


def test_metrics_export_resident_memory(served: ThreadServer) -> None:
    text = httpx.get(served.url + "/metrics").text
    values = dict(
        line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(values["process_resident_memory_bytes"]) > 10 * MiB
    assert float(values["omnijev_resident_memory_bytes"]) > 10 * MiB
    assert "omnijev_cuda_memory_bytes" not in text  # no CUDA in this process
