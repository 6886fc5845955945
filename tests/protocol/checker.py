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

from tests.protocol.world import REPLICAS, Rules, World, moves


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


def lost_turn(world: World) -> str | None:
    placed = world.placed
    if placed is None or placed.moving_to:
        return None
    copy = world.copy(placed.replica)
    if copy is None or copy.moving:
        return None
    missing = sorted(set(world.acked) - set(copy.history))
    if missing:
        return f"acknowledged turns {missing} are missing from the history {placed.replica} serves"
    return None


def settled(world: World) -> bool:
    placed = world.placed
    if placed is None or placed.moving_to or world.listed or world.runs or world.late:
        return False
    copy = world.copy(placed.replica)
    others = [world.copy(r) for r in REPLICAS if r != placed.replica]
    return (
        copy is not None
        and copy.epoch == placed.epoch
        and not copy.moving
        and not copy.arrival
        and all(o is None for o in others)
    )


def explore(rules: Rules, start: World | None = None) -> Report:
    start = start or World()
    parent: dict[World, tuple[World, str] | None] = {start: None}
    calm: dict[World, list[World]] = {}  # fault-free successors
    queue, report = deque([start]), Report()
    while queue:
        world = queue.popleft()
        broken = lost_turn(world)
        if broken:
            report.violations.append((broken, _trace(parent, world)))
            continue
        calm[world] = []
        for what, after, fault in moves(world, rules):
            report.edges += 1
            if not fault:
                calm[world].append(after)
            if after not in parent:
                parent[after] = (world, what)
                queue.append(after)
    report.states = len(parent)
    report.depth, wedged = _liveness(calm)
    for world in sorted(wedged, key=lambda w: len(_trace(parent, w)))[:1]:
        report.violations.append(("wedged: no fault-free schedule settles", _trace(parent, world)))
    return report


def _liveness(calm: dict[World, list[World]]) -> tuple[int, list[World]]:
    """(the longest shortest fault-free distance to a settled state, the states from
    which none is reachable), by a backward search from the settled states."""
    back: dict[World, list[World]] = {}
    for world, nexts in calm.items():
        for after in nexts:
            back.setdefault(after, []).append(world)
    distance = {w: 0 for w in calm if settled(w)}
    queue = deque(distance)
    while queue:
        world = queue.popleft()
        for before in back.get(world, []):
            if before not in distance:
                distance[before] = distance[world] + 1
                queue.append(before)
    wedged = [w for w in calm if w not in distance]
    return max(distance.values(), default=0), wedged


def _trace(parent: dict[World, tuple[World, str] | None], world: World) -> list[str]:
    steps = []
    while parent[world] is not None:
        world, what = parent[world]
        steps.append(what)
    return steps[::-1]
