"""`custody demo`: one streaming session on the built-in model (or `--model DIR`), run
in process: each turn prefills only its new tokens, and the ledger is clean at the end."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from custody.inprocess import InProcess
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings

TURNS = [
    "You are a careful assistant. Keep a running list of what I tell you.\nFirst: apples.",
    "Second: a bicycle with a bell.",
    "Third: the number forty-two.",
    "Now repeat the whole list.",
]


def run(model_dir: Path | None, turns: int, max_new_tokens: int) -> int:
    local = InProcess(Settings(model=model_dir, compile=False))  # starts at once, eager
    session = local.engine.sessions.open()
    print(f"session {session.sid}: {turns} turns, {max_new_tokens} new tokens each\n")
    for k, text in enumerate((TURNS * turns)[:turns]):
        params = SamplingParams(max_new_tokens=max_new_tokens)
        start = time.perf_counter()
        tokens = np.asarray(local.tokenizer.encode(text, k == 0))
        turn = local.engine.submit_turn(session, tokens, f"turn{k}", params)
        first = None
        while not turn.done:
            local.step()
            if first is None and turn.output:
                first = time.perf_counter() - start
        print(
            f"turn {k + 1}: prompt {len(turn.prompt)} tokens, cached {turn.cached_tokens}, "
            f"first token after {first * 1e3:.0f} ms, finish {turn.finish_reason.type}"
        )
        print(f"  -> {local.tokenizer.decode(turn.output)!r}")
    local.engine.sessions.close(session.sid)
    local.run_until_idle()
    report = local.engine.check(idle=True)
    counts = {pool: c["free"] for pool, c in report.counts.items()}
    print(f"\nsession closed; idle check {'clean' if report.ok else 'FAILED'}; free slots {counts}")
    for problem in report.problems:
        print(problem)
    return 0 if report.ok else 1
