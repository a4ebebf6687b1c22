"""What a connection may hold before it is a request: a deadline for its headers and body,
and a cap on connections.

uvicorn reads a request's headers and body for as long as the client takes, and holds as
many idle connections as it is sent: a thousand sockets sending a byte a second would be
kept for ever, each with its descriptor and buffers (slow loris). Here, a connection has
`read_timeout_s` from its opening (or from its previous response) to the last byte of a
request's body, else it is answered 408 (headers not yet in) or dropped (the route sees
the client leave); beyond `max_connections` a new one is answered 503 at once. The route's
own deadline (`request_timeout_s`) still bounds the answer.
"""

from __future__ import annotations

import asyncio
import resource

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: h11's parser
    HttpToolsProtocol = None

from .limits import GatewayLimits

_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
              b"Content-Length: 0\r\n\r\n")
_FULL = (b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
         b"Content-Length: 0\r\n\r\n")
_SPARE_FILES = 256  # descriptors beyond the connections: models, logs, Ray, gRPC


def protocol(limits: GatewayLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol, with `limits`' read deadline and connection cap:
    httptools' parser where it is installed (a request's way in and out costs about
    0.4 ms less than h11's, pure Python), else h11's."""
    base = _HttpTools if _HttpTools is not None else _H11

    class Guarded(base):
        _reading: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(_FULL)
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection, if one comes

        def _read_in_full(self) -> None:
            self._disarm()  # the request is read in full: the route's deadline now

        def _arm(self) -> None:
            self._disarm()
            self._reading = self.loop.call_later(limits.read_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._reading is not None:
                self._reading.cancel()
                self._reading = None

        def _timed_out(self) -> None:
            self._reading = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(_TIMED_OUT)  # nothing of an answer was sent yet
            self.transport.close()

    return Guarded


class _H11(H11Protocol):
    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle  # the last request's until the next one's headers are in
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            self._read_in_full()


if HttpToolsProtocol is not None:
    class _HttpTools(HttpToolsProtocol):
        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._read_in_full()
else:
    _HttpTools = None


def config(app, host: str, port: int, log_level: str) -> uvicorn.Config:
    """uvicorn's config for `app` (created by `create_app`, whose limits it reads), with
    the descriptor limit raised to hold its connections."""
    limits = getattr(app.state, "limits", None) or GatewayLimits()
    raise_file_limit(limits.max_connections + _SPARE_FILES)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=protocol(limits))


def raise_file_limit(wanted: int) -> int:
    """The soft descriptor limit raised toward `wanted` (never past the hard one);
    returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft
