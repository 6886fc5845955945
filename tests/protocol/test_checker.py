"""The checker's fairness rule on graphs small enough to read: a loop that an actor able
to act in every one of its states would leave is no violation, and a loop that every
always-able actor can keep taking is one (checker.fair_cycles can fail)."""

from __future__ import annotations

from tests.protocol.checker import components, fair_cycles

SETTLED = 3


def verdict(steps: dict[int, list[tuple[int, str]]]) -> tuple[int, list[int]]:
    back: list[list[int]] = [[] for _ in range(4)]
    for k, out in steps.items():
        for after, _ in out:
            back[after].append(k)
    found = components(back, [k != SETTLED for k in range(4)])
    return fair_cycles(found, lambda k: steps.get(k, []))


def test_a_retry_loop_that_a_replica_able_to_act_throughout_ends_is_left():
    # a front retries 1 <-> 2; the replica can settle it from either state
    steps = {0: [(1, "f")], 1: [(2, "f"), (SETTLED, "r")], 2: [(1, "f"), (SETTLED, "r")]}
    assert verdict(steps) == (1, [])


def test_a_loop_whose_way_out_comes_and_goes_traps_a_fair_schedule():
    # the replica can settle it only from state 1, and the front takes it away again
    steps = {0: [(1, "f")], 1: [(2, "f"), (SETTLED, "r")], 2: [(1, "f")]}
    assert verdict(steps) == (1, [1, 2])


def test_a_choice_nobody_must_make_obliges_no_one():
    # a client could end the loop from either state, but need not send its turn
    steps = {0: [(1, "f")], 1: [(2, "f"), (SETTLED, "choice")], 2: [(1, "f"), (SETTLED, "choice")]}
    assert verdict(steps) == (1, [1, 2])
