"""The rolling-update drill across a state-format bump, on a stack of its own: replica 0
of this build, replica 1 of the next (its blobs' format version bumped,
tests/next_format_executor.py), one endpoint picker. A drain from the old build to the
new must refuse the old blobs and re-home the sessions from their history, with outputs
equal to one-shot: a wrong read of a blob would show as diverging outputs."""

from __future__ import annotations

import numpy as np

from custody.up import Stack
from shared.config import Settings
from tests.services_harness import stack_settings
from tests.test_epp import (
    OUTPUT,
    _with_pickers,
    drain,
    envoy,
    home,
    one_shots,
    run_turns,
    stack_client,
    wait_serving,
)


def _next_build_beside(settings: Settings) -> dict[str, tuple[str, Settings]]:
    """Replica 0 of this build, replica 1 of the next (its blobs' format bumped), and
    one picker."""
    children = _with_pickers(settings)
    for name in ("epp-b", "epp-limited"):
        del children[name]
    children["executor-1"] = ("tests.next_format_executor", children["executor-1"][1])
    return children


def test_a_drain_across_a_state_format_bump_re_homes_from_history_never_a_wrong_read(
    redis_url, redis_client, capsys
):
    """Mid rolling update, old and new builds side by side: the new replica refuses the
    old one's blobs (another format version), so every session moved re-prefills from
    its history instead, with outputs still equal to one-shot."""
    settings = stack_settings(redis_url, replicas=2)
    stack = Stack(settings, plan=_next_build_beside).start_all()
    try:
        stack.wait_healthy()
        wait_serving(stack, "epp-a")
        client, rng = stack_client(stack), np.random.default_rng(5)
        sids = []
        with envoy(stack, "epp-a") as gate:
            for _ in range(4):
                sids.append(gate.send("/open_session", {}).body)
        on_zero = [sid for sid in sids if home(client, sid) == "0"]
        assert on_zero
        history: dict[str, list[int]] = {sid: [] for sid in sids}
        run_turns(stack, sids, history, rng, pickers=("epp-a",))
        outcome = drain(stack, "0")
        assert outcome["history"] == len(on_zero) and outcome["state"] == 0, outcome
        run_turns(stack, sids, history, rng, pickers=("epp-a",), resumed=set(sids) - set(on_zero))
        expected = one_shots([history[sid][:-OUTPUT] for sid in sids])
        assert [history[sid][-OUTPUT:] for sid in sids] == expected
        with capsys.disabled():
            print(
                f"\nformat-bump drill: {len(on_zero)} sessions drained to the next build; "
                f"moved with state {outcome['state']}, re-homed from history "
                f"{outcome['history']}, failed {outcome['failed']}, lost 0"
            )
    finally:
        stack.stop()
