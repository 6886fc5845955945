"""An explicit-state model checker over `world.py`: every state reachable from the start
within the fault bound, breadth first (so the first trace found to a state is a shortest
one), safety checked in each, then liveness over the whole graph.

- Safety, in every reachable state: no acknowledged turn is missing from the history of
  the copy the directory names, while that copy serves.
- Liveness: from every reachable state some schedule without faults reaches a settled
  state (the directory names a ready copy at its epoch, not in transit and in doubt
  nowhere, no other copy, no move listed or running, no request in flight), and `depth`
  is the longest such shortest schedule (the N the test prints). This is the
  existential form: a state from which no fault-free schedule settles is a wedge; a
  state from which some unfair schedule loops forever is not reported.

It reports the states explored, and for each violation the shortest trace to it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tests.protocol.world import REPLICAS, SIDS, Rules, Session, World, moves


@dataclass
class Report:
    states: int = 0
    edges: int = 0
    depth: int = 0  # the longest shortest fault-free schedule to a settled state
    violations: list[tuple[str, list[str]]] = field(default_factory=list)

    def first(self) -> str:
        what, trace = self.violations[0]
        steps = "\n".join(f"  {i + 1}. {step}" for i, step in enumerate(trace))
        return f"{what}, in {len(trace)} steps:\n{steps}"


def harm(world: World) -> str | None:
    """A safety violation in `world`, named, or None."""
    for k in range(len(world.sessions)):
        broken = lost_turn(world, k) or twins(world, k)
        if broken:
            return broken
    return None


def lost_turn(world: World, k: int) -> str | None:
    session = world.sessions[k]
    placed = session.placed
    if session.lost or placed is None or placed.moving_to:
        return None
    copy = session.copy(placed.replica)
    if copy is None or copy.moving:
        return None
    missing = sorted(set(session.acked) - set(copy.history))
    if missing:
        return (
            f"acknowledged turns {missing} of {SIDS[k]} are missing from the history "
            f"{placed.replica} serves"
        )
    return None


def twins(world: World, k: int) -> str | None:
    """Two copies of session `k` that could each answer a turn: confirmed (no move in
    doubt), not leaving, on replicas that serve."""
    live = [
        r
        for r in REPLICAS
        if (c := world.sessions[k].copy(r)) is not None
        and not c.moving
        and not c.arrival
        and world.serving(r)
    ]
    if len(live) > 1:
        return f"two live copies of {SIDS[k]}, on {' and '.join(live)}"
    return None


def settled(world: World) -> bool:
    """Nothing in flight or held, every life started or dead for good, and each session
    either ended (placed nowhere, or lost) with no copy anywhere, or servable: placed on
    a ready replica whose copy is at its epoch, with no copy elsewhere."""
    if world.runs or world.listed or world.late or world.rehoming:
        return False
    for r in REPLICAS:
        life = world.life(r)
        if not world.proven(r):
            return False
        if life.up and not (world.serving(r) and life.registered):
            return False
        if not life.up and (life.number < 2 or life.registered):
            return False
    return all(_session_settled(world, session) for session in world.sessions)


def _session_settled(world: World, session: Session) -> bool:
    if session.delayed:
        return False
    placed = session.placed
    if placed is None or session.lost:
        return all(session.copy(r) is None for r in REPLICAS)
    if placed.moving_to or not world.life(placed.replica).up:
        return False
    copy = session.copy(placed.replica)
    others = [session.copy(r) for r in REPLICAS if r != placed.replica]
    return (
        copy is not None
        and copy.epoch == placed.epoch
        and not copy.moving
        and not copy.arrival
        and all(o is None for o in others)
    )


def explore(rules: Rules, start: World | None = None, first_harm: bool = False) -> Report:
    """Every state reachable from `start`; `first_harm`: stop at the first safety
    violation (breadth first, its trace is a shortest one) and skip liveness. States are
    numbered; each keeps its parent's number, and a trace is rebuilt by asking the
    parent's transitions again which one led there (names are not kept: memory)."""
    start = start or World()
    index: dict[World, int] = {start: 0}
    worlds, parent = [start], [-1]
    back: list[list[int]] = [[]]  # per state: the states with a fault-free edge to it
    report, i = Report(), 0
    while i < len(worlds):
        world = worlds[i]
        broken = harm(world)
        if broken:
            report.violations.append((broken, _trace(worlds, parent, i, rules)))
            if first_harm:
                break
            i += 1
            continue
        for _, after, fault in moves(world, rules):
            report.edges += 1
            j = index.get(after)
            if j is None:
                j = index[after] = len(worlds)
                worlds.append(after)
                parent.append(i)
                back.append([])
            if not fault:
                back[j].append(i)
        i += 1
    report.states = len(worlds)
    if first_harm:
        return report
    report.depth, wedged = _liveness(worlds, back, i)
    if wedged:
        report.violations.append(
            ("wedged: no fault-free schedule settles", _trace(worlds, parent, wedged[0], rules))
        )
    return report


def _liveness(worlds: list[World], back: list[list[int]], explored: int) -> tuple[int, list[int]]:
    """(the longest shortest fault-free distance to a settled state, the states from
    which none is reachable, shortest trace first), by a backward search from the
    settled states."""
    distance = [-1] * len(worlds)
    queue = deque(k for k in range(explored) if settled(worlds[k]))
    for k in queue:
        distance[k] = 0
    while queue:
        k = queue.popleft()
        for before in back[k]:
            if distance[before] < 0:
                distance[before] = distance[k] + 1
                queue.append(before)
    wedged = [k for k in range(explored) if distance[k] < 0 and not harm(worlds[k])]
    return max(distance), wedged


def _trace(worlds: list[World], parent: list[int], i: int, rules: Rules) -> list[str]:
    steps = []
    while parent[i] >= 0:
        before = worlds[parent[i]]
        steps.append(next(what for what, after, _ in moves(before, rules) if after == worlds[i]))
        i = parent[i]
    return steps[::-1]
