"""A stand-in for Envoy in front of the endpoint picker (services/epp/): for each HTTP
request it opens an ext_proc stream and sends what Envoy sends, in Envoy's order, in
the full-duplex streaming mode the Inference Extension configures (request headers,
body chunks; then, once the request is answered upstream, response headers with the
served endpoint's metadata, body chunks), applies the picker's header and body
mutations, and sends the request to the endpoint the picker chose, as a gateway would.
The tests and `custody bench scaleout --gateway epp` drive the picker through it: no
Envoy binary runs here, so this is the gateway's half of the protocol, written from the
protocol's text (docs/kubernetes.md)."""

from __future__ import annotations

import http.client
import json
import queue
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict

DESTINATION = "x-gateway-destination-endpoint"
CHUNK = 1 << 16  # body bytes per ext_proc message, as Envoy streams a body in pieces
_END = object()
Headers = list[tuple[str, str]]  # in order, a repeated header once per copy, as Envoy sends


@dataclass
class Answer:
    """What came back for one request: the picker's choice, or its own refusal."""

    status: int
    body: dict | str
    endpoint: str | None = None  # the endpoint the picker chose (None: refused)
    metadata: dict = field(default_factory=dict)  # the picker's dynamic metadata
    headers: dict[str, str] = field(default_factory=dict)  # the answer's, lower-cased


def _header_map(headers: Headers) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
    )


def _without(headers: Headers, key: str) -> Headers:
    return [(k, v) for k, v in headers if k != key]


def _metadata(namespace: str, key: str, value: object) -> base_pb2.Metadata:
    inner = struct_pb2.Struct()
    inner.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: inner})


def _decoded(raw: bytes) -> dict | str:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class Envoy:
    def __init__(self, ext_proc_address: str, timeout: float = 120.0) -> None:
        self.channel = grpc.insecure_channel(ext_proc_address)
        self.stub = ext_grpc.ExternalProcessorStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Envoy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(
        self,
        path: str,
        body: dict | None = None,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        subset: list[str] | None = None,
        served: str | None = None,
    ) -> Answer:
        """POST `body` to `path` (sent as written: no percent-encoding normalised, as
        Envoy's default) through the picker. `headers`: a mapping, or pairs to send a
        header more than once; `subset`: the endpoints this gateway allows (the subset
        hint); `served`: the endpoint reported as having served it (default: the one
        picked)."""
        raw = b"" if body is None else json.dumps(body).encode()
        pairs = list(headers.items() if isinstance(headers, Mapping) else headers)
        sent: queue.Queue = queue.Queue()
        answers = self.stub.Process(_drain(sent), timeout=self.timeout)
        try:
            return self._exchange(path, raw, pairs, subset, served, sent, answers)
        finally:
            sent.put(_END)
            answers.cancel()

    def _exchange(
        self,
        path: str,
        raw: bytes,
        headers: Headers,
        subset: list[str] | None,
        served: str | None,
        sent: queue.Queue,
        answers: Iterator[ext.ProcessingResponse],
    ) -> Answer:
        request_headers = [
            (":method", "POST" if raw else "GET"),
            (":path", path),
            (":authority", "gateway"),
            ("content-type", "application/json"),
            ("content-length", str(len(raw))),
            *((k.lower(), v) for k, v in headers),
        ]
        context = (
            _metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset)
            if subset is not None
            else None
        )
        sent.put(
            ext.ProcessingRequest(
                request_headers=ext.HttpHeaders(
                    headers=_header_map(request_headers), end_of_stream=not raw
                ),
                metadata_context=context,
            )
        )
        for start in range(0, len(raw), CHUNK):
            piece = raw[start : start + CHUNK]
            last = start + CHUNK >= len(raw)
            sent.put(
                ext.ProcessingRequest(request_body=ext.HttpBody(body=piece, end_of_stream=last))
            )
        first = next(answers)
        if first.HasField("immediate_response"):
            immediate = first.immediate_response
            refusal_headers = {
                h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers
            }
            return Answer(immediate.status.code, _decoded(immediate.body), headers=refusal_headers)
        mutation = first.request_headers.response.header_mutation
        for key in mutation.remove_headers:
            request_headers = _without(request_headers, key)
        for option in mutation.set_headers:  # OVERWRITE_IF_EXISTS_OR_ADD: one copy left
            key = option.header.key
            request_headers = _without(request_headers, key)
            request_headers.append((key, option.header.raw_value.decode()))
        metadata = MessageToDict(first.dynamic_metadata)
        body = b""
        if raw:
            for answer in answers:  # the body comes back streamed, maybe mutated
                streamed = answer.request_body.response.body_mutation.streamed_response
                body += streamed.body
                if streamed.end_of_stream:
                    break
        chosen = dict(request_headers)[DESTINATION]
        status, reply, reply_headers = _forward(chosen, path, body, request_headers, self.timeout)
        served_context = _metadata(
            "envoy.lb", "x-gateway-destination-endpoint-served", served or chosen
        )
        response_headers = [(":status", str(status)), *reply_headers.items()]
        sent.put(
            ext.ProcessingRequest(
                response_headers=ext.HttpHeaders(
                    headers=_header_map(response_headers), end_of_stream=False
                ),
                metadata_context=served_context,
            )
        )
        next(answers)
        sent.put(ext.ProcessingRequest(response_body=ext.HttpBody(body=reply, end_of_stream=True)))
        echoed = next(answers).response_body.response.body_mutation.streamed_response.body
        return Answer(status, _decoded(echoed), chosen, metadata, reply_headers)


def _drain(sent: queue.Queue) -> Iterator[ext.ProcessingRequest]:
    while (message := sent.get()) is not _END:
        yield message


def _forward(
    endpoint: str, path: str, body: bytes, headers: Headers, timeout: float
) -> tuple[int, bytes, dict[str, str]]:
    """The request sent to the endpoint as the gateway sends it: pseudo-headers out, the
    path as it came, every copy of a header."""
    host, _, port = endpoint.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.putrequest("POST" if body else "GET", path)
        for key, value in headers:
            if not key.startswith(":") and key != DESTINATION:
                connection.putheader(key, value)
        connection.endheaders(body or None)
        reply = connection.getresponse()
        return reply.status, reply.read(), {k.lower(): v for k, v in reply.getheaders()}
    finally:
        connection.close()
