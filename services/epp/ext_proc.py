"""Envoy's external processing protocol (ext_proc v3), as the Gateway API Inference
Extension's endpoint-picker protocol uses it: one gRPC stream per HTTP request, its
messages in Envoy's order (request headers, request body chunks, response headers,
response body chunks, trailers), in the streaming mode the protocol requires (Envoy's
FULL_DUPLEX_STREAMED: the body comes in chunks, and every chunk goes back through the
picker, so the picker sends the body on itself).

A request's headers are held until its body has all come (the pick reads the body: a
session id, a prompt); then the picker answers the headers with the endpoint chosen, in
the `x-gateway-destination-endpoint` header and in the `envoy.lb` dynamic metadata (the
same value in both, as the protocol requires), and sends the body on in one piece. A
request the picker answers itself (no ready replica: 503; shedding or a session limit:
429; a body past the bound: 413) gets an ImmediateResponse and never reaches a replica.
The response's headers bring back the endpoint that served it (the gateway's
`x-gateway-destination-endpoint-served` metadata) and its status, which settles an
open's or a close's bookkeeping (fronts/decision.py, `Pick.done`); its body chunks are echoed.

Whatever a stream sends, the picker answers or ends that stream only: a malformed
message is refused (gRPC INVALID_ARGUMENT), never a fault of the process."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict
from yarl import URL

from fronts.decision import OWN_HEADERS, Decision, Pick, Refusal, endpoint
from services.epp.metrics import PickerMetrics
from shared.http_limits import MAX_BODY

log = logging.getLogger("custody.epp")
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"


class StreamFault(Exception):
    """A stream that broke the protocol (a message out of Envoy's order)."""


def _headers(message: ext.HttpHeaders) -> CIMultiDict[str]:
    """The headers as the replica's aiohttp holds them: names case-insensitive, values as
    text, every copy of a repeated header kept (Envoy sends each as its own entry), so
    `get` reads the first as aiohttp does, and a repeat stays visible."""
    return CIMultiDict(
        (h.key, h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
        for h in message.headers.headers
    )


def _path(target: str) -> str:
    """The path the replica's routes match for a request target (`:path`, which Envoy
    passes on with its percent-encoding untouched): cut as aiohttp's request parser cuts
    it, and read as its router reads it (yarl's `path_safe`: percent-decoded but for
    `%2F` and `%25`), so `/%6Fpen_session` is an open here as there."""
    path = target.partition("#")[0].partition("?")[0]
    return URL.build(path=path, encoded=True).path_safe


def _subset(request: ext.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway allows (the subset hint), or None when it sets none."""
    hint = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    return (
        [v.string_value for v in value.list_value.values]
        if value.HasField("list_value")
        else [value.string_value]
    )


def _served(request: ext.ProcessingRequest) -> str | None:
    lb = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if lb is None or SERVED not in lb.fields:
        return None
    return lb.fields[SERVED].string_value


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def picked(pick: Pick, body: bytes) -> list[ext.ProcessingResponse]:
    """The answers to a request whose endpoint is chosen: its headers (the endpoint
    set, the picker's own header set or removed, the length if the body changed), then
    its body in one streamed chunk."""
    chosen = endpoint(pick.replica)
    own = pick.upstream_headers()
    set_headers = [_header(DESTINATION, chosen)]
    set_headers += [_header(name.lower(), value) for name, value in own.items()]
    sent = body if pick.body is None else pick.body
    if pick.body is not None:
        set_headers.append(_header("content-length", str(len(sent))))
    remove = [h.lower() for h in OWN_HEADERS if h not in own]  # never the client's own
    mutation = ext.HeaderMutation(set_headers=set_headers, remove_headers=remove)
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: chosen}})
    headers = ext.ProcessingResponse(
        request_headers=ext.HeadersResponse(
            response=ext.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )
    streamed = ext.StreamedBodyResponse(body=sent, end_of_stream=True)
    body_answer = ext.ProcessingResponse(
        request_body=ext.BodyResponse(
            response=ext.CommonResponse(body_mutation=ext.BodyMutation(streamed_response=streamed))
        )
    )
    return [headers, body_answer]


def refused(refusal: Refusal) -> ext.ProcessingResponse:
    headers = [_header("content-type", "application/json")]
    headers += [_header(name.lower(), value) for name, value in refusal.headers.items()]
    return ext.ProcessingResponse(
        immediate_response=ext.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=refusal.status),
            headers=ext.HeaderMutation(set_headers=headers),
            body=refusal.body(),
            details=refusal.kind,
        )
    )


class ExternalProcessor(ext_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Decision, metrics: PickerMetrics) -> None:
        self.picker, self.metrics = picker, metrics

    async def Process(
        self,
        request_iterator: AsyncIterator[ext.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext.ProcessingResponse]:
        stream = _Stream(self.picker, self.metrics)
        try:
            async for message in request_iterator:
                for answer in await stream.on(message):
                    yield answer
        except StreamFault as fault:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(fault))
        finally:
            stream.ended()


class _Stream:
    """One HTTP request's exchange, message by message."""

    def __init__(self, picker: Decision, metrics: PickerMetrics) -> None:
        self.picker, self.metrics = picker, metrics
        self.headers: CIMultiDict[str] | None = None
        self.subset: list[str] | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.pick: Pick | None = None
        self.settled = False

    async def on(self, message: ext.ProcessingRequest) -> list[ext.ProcessingResponse]:
        which = message.WhichOneof("request")
        if which == "request_headers":
            return await self._request_headers(message)
        if which == "request_body":
            return await self._request_body(message)
        if which == "response_headers":
            return self._response_headers(message)
        if which == "response_body":
            body = message.response_body
            streamed = ext.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
            mutation = ext.BodyMutation(streamed_response=streamed)
            response = ext.CommonResponse(body_mutation=mutation)
            return [ext.ProcessingResponse(response_body=ext.BodyResponse(response=response))]
        if which == "request_trailers":
            return [ext.ProcessingResponse(request_trailers=ext.TrailersResponse())]
        if which == "response_trailers":
            return [ext.ProcessingResponse(response_trailers=ext.TrailersResponse())]
        raise StreamFault(f"an ext_proc message this picker does not take: {which}")

    async def _request_headers(self, message: ext.ProcessingRequest) -> list:
        if self.headers is not None:
            raise StreamFault("request headers twice in one stream")
        self.headers, self.subset = _headers(message.request_headers), _subset(message)
        if not message.request_headers.end_of_stream:
            return []  # answered once the body has all come
        return await self._decide()

    async def _request_body(self, message: ext.ProcessingRequest) -> list:
        if self.headers is None or self.pick is not None:
            raise StreamFault("a request body chunk outside the request")
        self.size += len(message.request_body.body)
        if self.size <= MAX_BODY:  # past it, kept no longer: refused at the end
            self.chunks.append(message.request_body.body)
        if not message.request_body.end_of_stream:
            return []
        return await self._decide()

    async def _decide(self) -> list[ext.ProcessingResponse]:
        received = time.perf_counter()
        body, self.chunks = b"".join(self.chunks), []
        kind = "other"
        try:
            if self.size > MAX_BODY:  # bounded before it is parsed, as the router bounds it
                message = f"the body is larger than {MAX_BODY} bytes"
                raise Refusal(413, message, "request_too_large")
            path = _path(self.headers.get(":path", "/"))
            self.pick = await self.picker.pick(path, self.headers, body, self.subset)
        except Refusal as refusal:
            self.metrics.refused.labels(str(refusal.status), refusal.kind).inc()
            answer = [refused(refusal)]
        else:
            kind = self.pick.kind
            self.metrics.picked.labels(self.pick.decision, self.pick.replica.id).inc()
            self.pick.replica.in_flight += 1
            answer = picked(self.pick, body)
        self.metrics.decision.labels(kind).observe(time.perf_counter() - received)
        return answer

    def _response_headers(self, message: ext.ProcessingRequest) -> list:
        served = _served(message)
        if self.pick is not None:
            match = "picked" if served in (None, endpoint(self.pick.replica)) else "other"
            self.metrics.served.labels(match).inc()
            headers = _headers(message.response_headers)
            status = headers.get(":status", "")
            self._settle(int(status) if status.isdigit() else None, headers)
        return [ext.ProcessingResponse(response_headers=ext.HeadersResponse())]

    def _settle(self, status: int | None, headers: Mapping[str, str]) -> None:
        """The pick's bookkeeping, once: with the answer's status, or None if none came."""
        if self.pick is None or self.settled:
            return
        self.settled = True
        try:
            self.pick.done(status, headers)
        except Exception:  # bookkeeping must not end the stream's answers
            log.exception("bookkeeping of a pick failed")

    def ended(self) -> None:
        """The stream is over (answered, or gone): the request no longer loads its
        replica, and a pick whose answer never came is settled as such."""
        self._settle(None, {})
        if self.pick is not None:
            self.pick.replica.in_flight -= 1
