"""SGLang's own streaming-session kit (sglang 0.5.23's `StreamingSessionKitMixin` and
`AbortLeakReproKitMixin`), unmodified from the wheel, against `custody up` on the stacks
the kit's tests need: a 131,072-token context (its abort-recovery turns ask for
`max_new_tokens: 100000`) and SGLang's abort-repro shape (512-token context, 256-token
pages, 4,096-token prefill chunks).

What it can catch: a session turn that does not inherit the previous turn's state
(`cached_tokens`), a session left unusable or holding stale context after an abort
before or during its first or a later turn, a leak or crash under concurrent sessions
with output and input logprobs and under retract pressure (each ends with /health,
which is 200 only while the scheduler's invariants hold). What it cannot: the kit
checks SGLang's outward contract only; custody's ledgers are checked by its own tests.

`--compile false`: the kit checks behaviour, and torch.compile's warm-up would add a
minute per stack on two cores; the compiled and eager decode paths are checked equal by
tests/executor/test_compiled_decode.py.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
from typing import ClassVar

from sglang.test.kits.streaming_session_kit import (
    AbortLeakReproKitMixin,
    StreamingSessionKitMixin,
)
from sglang.test.server_fixtures.streaming_session_fixture import (
    ABORT_REPRO_CHUNKED_PREFILL_SIZE,
    ABORT_REPRO_CONTEXT_LEN,
    ABORT_REPRO_PAGE_SIZE,
    StreamingSessionServerBase,
)

KIT_FILES = (
    "sglang/test/kits/streaming_session_kit.py",
    "sglang/test/server_fixtures/streaming_session_fixture.py",
)


class TestSGLangStreamingSessionKit(StreamingSessionKitMixin, StreamingSessionServerBase):
    extra_args: ClassVar[list[str]] = [
        "--context-length",
        "131072",
        "--kv-pages",
        "16384",
        "--compile",
        "false",
    ]


class TestSGLangAbortLeakRepro(AbortLeakReproKitMixin, StreamingSessionServerBase):
    extra_args: ClassVar[list[str]] = [
        "--context-length",
        str(ABORT_REPRO_CONTEXT_LEN),
        "--page-size",
        str(ABORT_REPRO_PAGE_SIZE),
        "--chunked-prefill-size",
        str(ABORT_REPRO_CHUNKED_PREFILL_SIZE),
        "--max-step-tokens",
        str(ABORT_REPRO_CHUNKED_PREFILL_SIZE),
        "--track-interval",
        str(ABORT_REPRO_PAGE_SIZE),
        "--kv-pages",
        "64",
        "--compile",
        "false",
    ]


def test_the_kit_is_the_wheel_s_file_as_shipped(capfd):
    """Each kit file's sha256 is the one the wheel's RECORD lists; printed past pytest's
    capture, so a CI log shows which kit ran."""
    dist = importlib.metadata.distribution("sglang")
    record = {row[0]: row[1] for row in csv.reader(dist.read_text("RECORD").splitlines())}
    for name in KIT_FILES:
        data = (dist.locate_file(name)).read_bytes()
        digest = hashlib.sha256(data).digest()
        shipped = "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        with capfd.disabled():
            print(f"\n{name} (sglang {dist.version}) sha256 {digest.hex()}")
        assert record[name] == shipped, name
