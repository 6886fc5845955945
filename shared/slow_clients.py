"""Connection timeouts against slow clients (slowloris): a request's head must arrive
within `read_timeout` of its first byte and its body within `read_timeout` of its head,
and a keep-alive connection idle for `keepalive_timeout` is closed. The time a request
spends generating is never bounded: the body has fully arrived by then.

aiohttp closes idle connections (its keep-alive timer) but has no timeout on reading a
request: a head sent a byte at a time holds its connection until the keep-alive timer
fires, and a body sent slowly holds it for ever. So the server's connections are
`GuardedConnection`s, whose timer is armed by the bytes of a new head, re-armed for the
body when the head is complete, and which close the connection when it fires early.
"""

from __future__ import annotations

import asyncio

from aiohttp import StreamReader, web
from aiohttp.web_protocol import RequestHandler


class GuardedConnection(RequestHandler):
    def __init__(self, manager: web.Server, *, read_timeout: float, **kwargs: object) -> None:
        super().__init__(manager, **kwargs)
        self.read_timeout = read_timeout
        self.body: StreamReader | None = None  # the latest request's; None before the first
        self.timer: asyncio.TimerHandle | None = None
        self.timing_head = False
        self.handling = False  # a handler runs: a pipelined head waits for it, untimed

    def data_received(self, data: bytes) -> None:
        between_requests = self.body is None or self.body.is_eof()
        if data and between_requests and not self.handling and not self.timing_head:
            self._arm(head=True)  # these bytes begin a request head
        super().data_received(data)

    def head_arrived(self, body: StreamReader) -> None:
        """The head is parsed; the body, unless already in, gets its own deadline."""
        self.body, self.handling = body, True
        self._disarm()
        if not body.is_eof():
            self._arm(head=False)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.handling = False

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's own refusals (a malformed request line or header, which never reach
        the app's middleware) in the API's JSON error shape."""
        plain = super().handle_error(request, status, exc, message)
        resp = web.json_response(
            {"error": {"message": message or plain.reason or "bad request", "type": "http_error"}},
            status=status,
        )
        resp.force_close()
        return resp

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, head: bool) -> None:
        self._disarm()
        self.timing_head = head
        self.timer = asyncio.get_running_loop().call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.timing_head = None, False

    def _expired(self) -> None:
        late = self.timing_head or (self.body is not None and not self.body.is_eof())
        self.timer, self.timing_head = None, False
        if late:
            self.force_close()


class GuardedServer(web.Server):
    """aiohttp's server for the app's handler, making `GuardedConnection`s, each told
    when a request's head is complete."""

    def __init__(self, made: web.Server, read_timeout: float, keepalive_timeout: float) -> None:
        super().__init__(
            made.request_handler,
            request_factory=self._head_arrived,
            handler_cancellation=made.handler_cancellation,
        )
        self.make_request = made.request_factory
        self.read_timeout, self.keepalive_timeout = read_timeout, keepalive_timeout

    def _head_arrived(self, message, payload, protocol, writer, task) -> web.BaseRequest:
        protocol.head_arrived(payload)
        return self.make_request(message, payload, protocol, writer, task)

    def __call__(self) -> GuardedConnection:
        return GuardedConnection(
            self,
            loop=asyncio.get_running_loop(),
            read_timeout=self.read_timeout,
            keepalive_timeout=self.keepalive_timeout,
        )


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections time out slow clients; a client that disconnects
    cancels its handler (and so aborts its request: at the router, the cancelled upstream
    request closes its connection, which the replica takes as an abort). The scheduler's
    edge and the router's both run on one."""

    def __init__(
        self,
        app: web.Application,
        read_timeout: float,
        keepalive_timeout: float,
        **runner_options: object,
    ) -> None:
        super().__init__(app, handler_cancellation=True, **runner_options)
        self.read_timeout, self.keepalive_timeout = read_timeout, keepalive_timeout

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # runs the app's startup, as AppRunner does
        return GuardedServer(made, self.read_timeout, self.keepalive_timeout)
