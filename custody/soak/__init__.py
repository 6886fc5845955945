"""`custody soak --duration S [--chaos] [--json]`: concurrent clients against the real
services on pools small enough that evictions, dropped session state and retracts are
routine, then proof that nothing was lost.

The stack runs with two tenant keys and an operator key. The load: six greedy workers
under tenant A (sessions with random turn lengths, disconnects mid-stream, over-long
inputs, closes, idle timeouts, plain requests sharing a prefix), and one hostile client
under both keys (tiny temperatures, seed overflow, huge token ids, lone surrogates, bad
streamed input, NaN and Infinity in JSON, unknown fields, and tenant B trying to abort
tenant A's running request, by id and with abort_all). With `--chaos` the executor, the
scheduler and the session store are SIGKILLed and Redis restarted at random moments.

The end: every session is closed and the cache flushed (with the operator key), and then
every slot of every pool must be free in the session store's independent ledger, whatever
its owner kind; the ledger must have seen no violation; every greedy output must be the
fault-free model's choice, teacher-forced over its exact prompt; every reply must carry
the status its input calls for (no 5xx ever); and every service restart must follow a
kill the monkey made. Any failure exits non-zero.

What it catches: a slot never given back by any path the clients take (requests,
sessions, cache nodes, track snapshots), a transfer by a non-owner or a double free, a
greedy token that differs from the fault-free model's, a 5xx or a wrong status, a hostile
input that crashes or wedges a service, a tenant that can abort another's request.

What it cannot catch: a leak that closing the sessions or flushing the cache frees (a
session or cache node that keeps more than it should until then); a wrong output of a
sampled request (the hostile ones are judged by status and liveness only, and under chaos
an abort is excused); an aborted request's missing tail; a fault in a path no client takes
(the OpenAI routes, logprobs, stop strings, page sizes other than 16, a real checkpoint,
GPU kernels); a wrong status for an input the hostile list does not contain; a slot
moved without an ownership event (the ledger sees only what the stream announces); a
crash that the monkey's own kill happened to cover; slowness, as long as the calls end
within their timeouts.
"""

from __future__ import annotations

import json

from custody.soak.runner import Soak

__all__ = ["Soak", "run"]


def run(duration: float, chaos: bool, as_json: bool) -> int:
    result = Soak(duration, chaos).run()
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 1 if result["failed"] else 0
