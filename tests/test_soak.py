"""The chaos soak: many concurrent sessions with aborts, over-long inputs, closes,
timeouts and shared prefixes while the executor, the scheduler and the session store are
SIGKILLed and Redis restarted. Nothing may leak, the independent ledger must agree, and
every finished turn must be a greedy continuation of its history.
CUSTODY_SOAK_SECONDS sets the load's length (CI: 180)."""

import os

from custody.soak import Soak

SECONDS = float(os.environ.get("CUSTODY_SOAK_SECONDS", "180"))


def test_chaos_soak_loses_nothing():
    result = Soak(SECONDS, chaos=True).run()
    assert result["turns"] > 0 and result["finished"] > 0
    assert any(k.startswith("chaos_") for k in result["errors_by_kind"]), result
    assert result["leaked_slots"] == 0, result
    assert result["ledger_violations"] == 0, result
    assert result["wrong_outputs"] == 0, result
