"""One HTTP call of a soak client, as a `Reply` that never raises: a 4xx or a 5xx is data
the verdict judges, and so is no answer at all (refused, reset or timed out), which chaos
makes routine. Bodies may be raw bytes, so hostile clients can send JSON that Python's
encoder would never write (NaN, lone surrogates)."""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass

NO_ANSWER = "connection"  # the outcome of a call that got no HTTP status
# An edge worker's own word that the scheduling core died under the call (503 before
# sending it, 502 after): to a client, the same as no answer from the core. Counting
# both as no answer is the conservative reading (the call may have run).
CORE_DIED = frozenset({"core_gone", "core_lost"})


@dataclass(frozen=True)
class Reply:
    status: int | None  # None: no answer
    body: object  # the parsed JSON, or None
    text: str
    cut: bool = False  # the status came, the body broke off (or a stream ended without [DONE])

    @property
    def aborted(self) -> bool:
        """A 200 whose request ended by abort (a refused step, an abort call, quarantine)."""
        reason = self.body.get("meta_info", {}).get("finish_reason") if self.is_dict else None
        return isinstance(reason, dict) and reason.get("type") == "abort"

    @property
    def error_type(self) -> str | None:
        error = self.body.get("error") if self.is_dict else None
        return error.get("type") if isinstance(error, dict) else None

    @property
    def is_dict(self) -> bool:
        return isinstance(self.body, dict)

    @property
    def outcome(self) -> str:
        """What status counts are kept by: "200", "200/abort", "200/cut", "404", "connection"."""
        if self.status is None or self.error_type in CORE_DIED:
            return NO_ANSWER
        if self.cut:
            return f"{self.status}/cut"
        return f"{self.status}/abort" if self.status == 200 and self.aborted else str(self.status)


def encode(body: dict | bytes | None) -> bytes | None:
    return body if body is None or isinstance(body, bytes) else json.dumps(body).encode()


def headers(key: str | None) -> dict[str, str]:
    out = {"Content-Type": "application/json"}
    if key:
        out["Authorization"] = f"Bearer {key}"
    return out


def call(
    port: int,
    path: str,
    body: dict | bytes | None = None,
    key: str | None = None,
    timeout: float = 120,
) -> Reply:
    """POST `body` (GET when None) to 127.0.0.1:`port`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET" if body is None else "POST", path, encode(body), headers(key))
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException):
        conn.close()
        return Reply(None, None, "")
    try:
        text = resp.read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        return Reply(resp.status, None, "", cut=True)
    finally:
        conn.close()
    return Reply(resp.status, _json(text), text)


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


class Stream:
    """A streamed /generate: the status first, then its server-sent events one by one."""

    def __init__(self, port: int, body: dict, key: str | None, timeout: float = 120) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.resp: http.client.HTTPResponse | None = None  # None: no answer
        with contextlib.suppress(OSError, http.client.HTTPException):
            self.conn.request("POST", "/generate", encode(body | {"stream": True}), headers(key))
            self.resp = self.conn.getresponse()
        self.last: object = None
        self.done = False  # [DONE] seen: the stream ended as the server meant it to

    def events(self) -> Iterator[object]:
        """Each event's JSON until [DONE]; stops early if the connection ends."""
        if self.resp is None or self.resp.status != 200:
            return
        for raw in self.resp:  # readline through the chunked framing
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                self.done = True
                return
            with contextlib.suppress(ValueError):
                self.last = json.loads(line[len("data: ") :])
                yield self.last

    def finish(self) -> Reply:
        """Read to the end; the reply is the last event, as a plain call would return it."""
        if self.resp is None:
            return Reply(None, None, "")
        status = self.resp.status
        try:
            if status != 200:
                text = self.resp.read().decode("utf-8", errors="replace")
                return Reply(status, _json(text), text)
            for _ in self.events():
                pass
        except (OSError, http.client.HTTPException):
            pass  # cut off: not done
        finally:
            self.conn.close()
        text = json.dumps(self.last) if self.last is not None else ""
        return Reply(200, self.last, text, cut=not self.done)
