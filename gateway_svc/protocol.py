"""The gateway's HTTP/1.1 protocol: uvicorn's h11 one, with a deadline for each request
to arrive whole.

uvicorn bounds only the idle time between requests (``timeout_keep_alive``): a client
that sends half a header, or a Content-Length it never delivers, held its connection
(a file descriptor) for ever. A probe opened 400 such connections and none was closed;
the process allows 20,000. Here a request, headers and body, must arrive within
:data:`REQUEST_READ_TIMEOUT_S` of its first chance (the connection made, or the previous
response sent); a connection whose request has not is closed. An application waiting
for that body sees the client gone, as for any hang-up.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway_svc.app import openai_error

# Seconds a request's headers and body may take to arrive: a 32 MiB body (the largest
# the gateway takes) at about 0.5 MB/s.
REQUEST_READ_TIMEOUT_S = 60.0
# Bytes a request's head (request line and headers) may take. h11's default, 16 KiB,
# bounds only a head that arrives in pieces: a 60 KB Authorization header was served
# when it came in one read and reset when TCP split it (the fresh-clone CI, once).
MAX_REQUEST_HEAD_BYTES = 256 * 1024
# h11's states of the client's side once its request is whole, or the connection ends.
_ARRIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's H11Protocol, closing a connection whose request does not arrive whole
    within ``read_timeout_s``."""

    read_timeout_s = REQUEST_READ_TIMEOUT_S
    _read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state in _ARRIVED:
            self._disarm()  # the request arrived whole (or the connection is ending)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (two Content-Lengths, a bad
        chunk size, no Host, HTTP/0.9), in OpenAI's error body as every other error of
        the gateway: it was uvicorn's plain text."""
        message = (
            f"{msg} (the request line, headers or body framing are not HTTP/1.1's); the "
            "connection is closed"
        )
        body = json.dumps(openai_error(message, "invalid_request_error")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _too_slow(self) -> None:
        self._read_deadline = None
        if self.conn.their_state not in _ARRIVED:
            self.transport.close()
