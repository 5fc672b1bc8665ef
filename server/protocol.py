"""uvicorn's h11 protocol with a header-read deadline and HTTP-level errors that say who they are.

Follows uvicorn's `H11Protocol` (uvicorn 0.54, `protocols/http/h11_impl.py`), which waits for
headers without a limit and answers protocol errors with a bare 400: here a connection whose
request line and headers are not complete within the deadline gets 408, oversized headers get
431 (h11's own status hint), and every such answer carries an `x-request-id` and is logged.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_READ_S = 10.0  # a client has this long to send its request line and headers
MAX_HEADER_BYTES = 64 * 1024  # request line and headers; h11's default is 16 KiB
# after an error answer the rest of the client's request is read and dropped, up to this many
# bytes or seconds, so that the client reads the answer instead of a connection reset
LINGER_BYTES = 1024 * 1024
LINGER_S = 2.0
REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}

log = logging.getLogger("omnijev.requests")


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus the header deadline, 431 and `x-request-id` on HTTP-level errors."""

    header_read_s = HEADER_READ_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timer: Any = None
        self.lingering = -1  # bytes dropped since an error answer; -1 when not lingering
        self.protocol_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def recorded_next_event() -> Any:
            try:
                return next_event()
            except h11.RemoteProtocolError as error:
                self.protocol_error = error
                raise

        self.conn.next_event = recorded_next_event  # type: ignore[method-assign]

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering >= 0:
            self.lingering += len(data)
            if self.lingering > LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.arm_header_timer()  # the next request on this connection has the same deadline

    def arm_header_timer(self) -> None:
        self.disarm_header_timer()
        self.header_timer = self.loop.call_later(self.header_read_s, self.header_deadline)

    def disarm_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def waiting_for_headers(self) -> bool:
        idle_cycle = self.cycle is None or self.cycle.response_complete
        return idle_cycle and self.conn.their_state is h11.IDLE

    def header_deadline(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or not self.waiting_for_headers():
            return
        if not self.conn.trailing_data[0]:  # an idle keep-alive connection: just close it
            self.transport.close()
            return
        self.send_error(408, f"request headers not complete within {self.header_read_s:g} s")

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request: 431 for oversized headers, else 400."""
        error = self.protocol_error
        status = error.error_status_hint if error is not None else 400
        status = status if status in REASONS else 400
        detail = f"request headers exceed {MAX_HEADER_BYTES} bytes" if status == 431 else msg
        if error is not None and status == 400:
            detail = f"invalid HTTP request: {error}"
        self.send_error(status, detail)

    def send_error(self, status: int, detail: str) -> None:
        """Answer `status` with a JSON detail and an x-request-id, then linger and close."""
        self.disarm_header_timer()
        request_id = uuid.uuid4().hex
        body = json.dumps({"detail": detail}).encode()
        head = [
            b"HTTP/1.1 %d %s" % (status, REASONS[status]),
            b"content-type: application/json",
            b"content-length: %d" % len(body),
            b"connection: close",
            b"x-request-id: " + request_id.encode(),
        ]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        log.info(json.dumps({"request_id": request_id, "status": status, "outcome": detail}))
        self.lingering = 0
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
