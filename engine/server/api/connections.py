"""Limits on connections, below the app: a deadline for reading each request, and a cap on one client's open
connections.

A client that sends its request a byte at a time holds a connection (and a task waiting on its body) for as long as
it likes: uvicorn's only timer is the keep-alive one, which every byte re-arms. Here each request must arrive whole,
headers and body, within `read_timeout_s` of its first byte (of the connection's opening, for the first request); past
it the client gets a 408 and the connection is closed. A client (by peer address: behind a proxy, the proxy) may hold
`max_per_client` connections at once; a connection past that is answered 429 and closed before anything is read.

The guard's counts belong to one API process's event loop, which alone touches them (each process of
--api-server-count has its own).
"""
from __future__ import annotations

import collections
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class ConnectionGuard:
    def __init__(self, read_timeout_s: float, max_per_client: int):
        if not read_timeout_s > 0:
            raise ValueError(f"--request-read-timeout must be > 0, got {read_timeout_s}")
        if max_per_client < 0:
            raise ValueError(f"--max-connections-per-client must be >= 0 (0: no cap), got {max_per_client}")
        self.read_timeout_s, self.max_per_client = read_timeout_s, max_per_client
        self.open: collections.Counter = collections.Counter()     # peer address -> open connections
        self.dropped = 0                                            # connections closed at their read deadline

    @classmethod
    def from_args(cls, args) -> ConnectionGuard:
        """The guard `specdec serve`'s --request-read-timeout and --max-connections-per-client ask for."""
        return cls(args.request_read_timeout, args.max_connections_per_client)

    def protocol(self) -> type:
        """The uvicorn HTTP protocol class (uvicorn.Config's `http`) that applies this guard."""
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    guard: ConnectionGuard

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else None
        self._counted = False
        self._deadline = None
        g = self.guard
        if g.max_per_client and self._peer is not None and g.open[self._peer] >= g.max_per_client:
            transport.write(_response(429, "Too Many Requests", f"this client has {g.open[self._peer]} connections "
                                      f"open; at most {g.max_per_client} (--max-connections-per-client)",
                                      "too_many_connections"))
            transport.close()
            return
        g.open[self._peer] += 1
        self._counted = True
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            self.guard.open[self._peer] -= 1
            if self.guard.open[self._peer] <= 0:
                del self.guard.open[self._peer]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()                 # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()              # read whole (or the connection is done)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY:
            self._arm()                 # answered before its body came (a 413): the rest must still come in time

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.guard.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.guard.dropped += 1
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_response(408, "Request Timeout", "the request did not arrive whole within "
                                           f"{self.guard.read_timeout_s:g} s (--request-read-timeout)",
                                           "request_timeout"))
        self.transport.close()
