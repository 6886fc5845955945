"""The hostile client: inputs built to break parsing, sampling or tenancy, mixed into the
load. Each is judged by its status only: a 4xx for invalid input, a 200 for valid but
extreme input (a temperature of 1e-40, the largest 64-bit seed). Their outputs are sampled
or irrelevant, so they stay out of the greedy replay; after each one the scheduler must
still answer /liveness (alive; ready or not, during chaos).

With API keys on, key B tries to abort key A's running request, by id and with abort_all:
B may be refused (403, 404) or get a no-op 200, and A's request must end normally.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import time

from custody.soak.client import Reply, Stream, call
from custody.soak.greedy import PREFIX
from custody.soak.tally import OK, REFUSED, Tally

HI = [72, 105, 33]


def generate(**sampling: object) -> dict:
    return {"input_ids": HI, "sampling_params": {"max_new_tokens": 6, **sampling}}


# (kind, body, expected): bytes where Python's JSON encoder would not write the input
CASES: list[tuple[str, dict | bytes, frozenset[str]]] = [
    ("temperature_1e-40", generate(temperature=1e-40), OK),
    ("temperature_1e-6", generate(temperature=1e-6), OK),
    ("seed_2**64-1", generate(temperature=0.8, seed=2**64 - 1), OK),
    ("seed_2**70", generate(temperature=0.8, seed=2**70), REFUSED),
    (
        "input_id_2**63",
        {"input_ids": [1, 2**63], "sampling_params": {"max_new_tokens": 4}},
        REFUSED,
    ),
    (
        "lone_surrogate",
        b'{"text": "ab\\ud800cd", "sampling_params": {"max_new_tokens": 4}}',
        REFUSED,
    ),
    ("stream_bad_param", generate(temperature=-1.0) | {"stream": True}, REFUSED),
    ("stream_unknown_param", generate(no_such_param=1) | {"stream": True}, OK),  # ignored
    ("nan_json", b'{"input_ids": [72, 105], "sampling_params": {"temperature": NaN}}', REFUSED),
    ("infinity_json", b'{"input_ids": [72, 105], "sampling_params": {"top_p": Infinity}}', REFUSED),
    ("unknown_field", generate() | {"no_such_field": 1}, OK),  # ignored, as SGLang does
    ("unknown_sampling_field", generate(no_such_param=1), OK),
    ("known_field_wrong_type", generate(top_k="k"), REFUSED),
    ("nested_5000_deep", b'{"input_ids": [72], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", REFUSED),
    ("rid_list_300000", {"input_ids": [HI, HI], "rid": [f"r{i}" for i in range(300_000)]}, REFUSED),
    (
        "streamed_logprobs_over_cap",
        generate(max_new_tokens=400)
        | {"stream": True, "return_logprob": True, "top_logprobs_num": 20},
        REFUSED,
    ),
    ("session_id_newline", {"input_ids": HI, "session_params": {"id": "s\n"}}, REFUSED),
]
# B's abort of A's work: refused, or accepted as a no-op that touches only B's own requests
ABORT_ANSWERS = frozenset({"200", "403", "404"})
ABORTED_BY_CALL = "aborted by request"  # the abort endpoint's reason


class Hostile:
    def __init__(self, port: int, tally: Tally, keys: list[str | None]) -> None:
        self.port, self.tally, self.keys = port, tally, keys
        self.tenants = len({k for k in keys if k}) >= 2  # cross-key aborts need two keys

    def worker(self, deadline: float) -> None:
        rng = random.Random(1234)
        n = 0
        while time.monotonic() < deadline:
            n += 1
            if self.tenants and n % 4 == 0:
                self.cross_key_abort(n)
            else:
                kind, body, expected = rng.choice(CASES)
                reply = call(self.port, "/generate", body, rng.choice(self.keys), timeout=60)
                self.tally.judge(kind, reply, expected, hostile=True)
            self.tally.judge("liveness", call(self.port, "/liveness", timeout=10), OK)
            time.sleep(0.2)

    def cross_key_abort(self, n: int) -> None:
        a, b = self.keys[:2]
        rid = f"soak-victim-{n}"
        body = {
            "rid": rid,
            "input_ids": PREFIX[:8],
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True},
        }
        victim = Stream(self.port, body, a)
        with contextlib.suppress(OSError, http.client.HTTPException):
            next(victim.events(), None)  # a first token: the victim is running
        for kind, abort in (
            ("cross_key_abort_rid", {"rid": rid}),
            ("cross_key_abort_all", {"abort_all": True}),
        ):
            reply = call(self.port, "/abort_request", abort, b, timeout=10)
            self.tally.judge(kind, reply, ABORT_ANSWERS, hostile=True)
        self.judge_victim(victim.finish())

    def judge_victim(self, reply: Reply) -> None:
        """A's request must end normally; chaos excuses an abort, but not one by a call."""
        if reply.aborted and ABORTED_BY_CALL in reply.text:
            detail = f"key B's abort ended key A's request: {reply.text[:300]}"
            self.tally.count("cross_key_victim", "200/aborted-by-call", False, True, detail)
        else:
            self.tally.judge("cross_key_victim", reply, OK, hostile=True)
