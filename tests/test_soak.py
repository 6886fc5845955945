"""The chaos soak: many concurrent sessions with aborts, over-long inputs, closes,
timeouts, shared prefixes and hostile inputs, under two API keys, while the executor, the
scheduler and the session store are SIGKILLed and Redis restarted. With every session
closed and the cache flushed, no slot of any pool may be held in the independent ledger,
the ledger must have seen no violation, every greedy output must be a fault-free greedy
continuation, every reply must carry its expected status, and every restart must follow
an injected kill. CUSTODY_SOAK_SECONDS sets the load's length (CI: 180)."""

import os

from custody.soak import Soak

SECONDS = float(os.environ.get("CUSTODY_SOAK_SECONDS", "180"))


def test_chaos_soak_loses_nothing():
    result = Soak(SECONDS, chaos=True).run()
    assert result["turns"] > 0 and result["finished"] > 0, result
    assert sum(result["service_restarts"]["injected"].values()) > 0, result
    assert result["hostile_requests"], result
    assert result["ledger_ready"], result
    assert result["leaked_slots"] == 0, result["leaked_by_pool"]
    assert result["ledger_violations"] == 0, result["violations"]
    assert result["wrong_outputs"] == 0, result
    assert result["unexpected_statuses"] == 0, result["unexpected_examples"]
    assert sum(result["service_restarts"]["unexplained"].values()) == 0, result
    assert result["failed"] == [], result
