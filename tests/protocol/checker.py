"""An explicit-state model checker over `world.py`: every state reachable from the start
within the fault bound, breadth first (so the first trace found to a state is a shortest
one), safety checked in each, then liveness over the whole graph.

- Safety, in every reachable state: no acknowledged turn is missing from the history of
  the copy the directory names, while that copy serves; no two copies of a session
  could each answer a turn; no copy of a session lives once its client heard its close
  answered.
- Liveness, once faults stop, over the graph of fault-free steps:
  - from every reachable state some schedule reaches a settled state (the directory
    names a ready copy at its epoch, not in transit and in doubt nowhere, no other
    copy, no move listed or running, no request in flight); `depth` is the longest such
    shortest schedule (the N the test prints). A state with none is a wedge.
  - every schedule settles under weak fairness: each cycle of unsettled states (each
    strongly connected component) is checked to be one that no weakly fair schedule
    stays in for ever: some actor (a front, a replica, the store, the network carrying
    a message) can act in every state of it and never does within it. Retries loop by
    design (a settle asked again while a replica cannot answer): such loops are counted
    (`cycles`), and a cycle a fair schedule could stay in is a violation. Choices nobody
    must make (a client's next turn, a drain's next move) oblige no one. Because the
    loops are there, no bound N holds for every schedule; N is the existential one.

It reports the states explored, and for each violation the shortest trace to it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.protocol.world import CHOICE, FAULT, REPLICAS, SIDS, Rules, Session, World, moves


@dataclass
class Report:
    states: int = 0
    edges: int = 0
    depth: int = 0  # the longest shortest fault-free schedule to a settled state
    cycles: int = 0  # cycles of unsettled states, each left by every weakly fair schedule
    violations: list[tuple[str, list[str]]] = field(default_factory=list)

    def first(self) -> str:
        what, trace = self.violations[0]
        steps = "\n".join(f"  {i + 1}. {step}" for i, step in enumerate(trace))
        return f"{what}, in {len(trace)} steps:\n{steps}"


def harm(world: World) -> str | None:
    """A safety violation in `world`, named, or None."""
    for k in range(len(world.sessions)):
        broken = lost_turn(world, k) or twins(world, k) or closed_but_live(world, k)
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


def closed_but_live(world: World, k: int) -> str | None:
    """A copy of session `k` that could answer a turn (as `twins` counts them) after its
    client heard its close answered: it lives on, placed or not, holding its state and
    its key's quota."""
    session = world.sessions[k]
    if not session.closed:
        return None
    live = [
        r
        for r in REPLICAS
        if (c := session.copy(r)) is not None
        and not c.moving
        and not c.arrival
        and world.serving(r)
    ]
    if live:
        return f"{SIDS[k]} was closed for its client, yet a copy lives on {' and '.join(live)}"
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
    if session.delayed or session.closing:
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
    harmed: list[bool] = []  # per state explored: whether it breaks safety
    report, i = Report(), 0
    while i < len(worlds):
        world = worlds[i]
        broken = harm(world)
        harmed.append(broken is not None)
        if broken:
            report.violations.append((broken, _trace(worlds, parent, i, rules)))
            if first_harm:
                break
            i += 1
            continue
        for _, after, by in moves(world, rules):
            report.edges += 1
            j = index.get(after)
            if j is None:
                j = index[after] = len(worlds)
                worlds.append(after)
                parent.append(i)
                back.append([])
            if by != FAULT:
                back[j].append(i)
        i += 1
    report.states = len(worlds)
    if first_harm:
        return report
    done = [settled(w) for w in worlds]
    report.depth, wedged = _liveness(back, done, harmed)
    if wedged:
        report.violations.append(
            ("wedged: no fault-free schedule settles", _trace(worlds, parent, wedged[0], rules))
        )
    open_ = [not d and not h for d, h in zip(done, harmed, strict=True)]
    report.cycles, trapped = fair_cycles(
        components(back, open_), lambda k: [(index[a], by) for _, a, by in moves(worlds[k], rules)]
    )
    if trapped:
        report.violations.append(
            (
                "a fault-free cycle a weakly fair schedule may never leave",
                _trace(worlds, parent, trapped[0], rules),
            )
        )
    return report


def _liveness(back: list[list[int]], done: list[bool], harmed: list[bool]) -> tuple[int, list[int]]:
    """(the longest shortest fault-free distance to a settled (`done`) state, the states
    from which none is reachable and that break no safety property, shortest trace
    first), by a backward search from the settled states."""
    distance = [-1] * len(back)
    queue = deque(k for k, d in enumerate(done) if d)
    for k in queue:
        distance[k] = 0
    while queue:
        k = queue.popleft()
        for before in back[k]:
            if distance[before] < 0:
                distance[before] = distance[k] + 1
                queue.append(before)
    wedged = [k for k, d in enumerate(distance) if d < 0 and not harmed[k]]
    return max(distance), wedged


def fair_cycles(
    found: list[list[int]], steps: Callable[[int], list[tuple[int, str]]]
) -> tuple[int, list[int]]:
    """(how many of the components `found` there are, the states of the first one a
    weakly fair schedule may stay in for ever, lowest first); `steps(k)`: state k's
    steps, each (the state it leads to, who takes it). A component is left by every fair
    schedule when some actor can act in each of its states and none of its steps stays
    inside; then so is every cycle within it."""
    trapped: list[int] = []
    for component in found:
        inside = set(component)
        always: set[str] | None = None
        stays: set[str] = set()
        for k in component:
            able = set()
            for after, by in steps(k):
                if by in (FAULT, CHOICE):
                    continue
                able.add(by)
                if after in inside:
                    stays.add(by)
            always = able if always is None else always & able
        if always is not None and always <= stays:
            trapped = sorted(component)
            break
    return len(found), trapped


def components(back: list[list[int]], open_: list[bool]) -> list[list[int]]:
    """The strongly connected components of the `open_` states that hold a cycle (more
    than one state, or a step to itself), by Tarjan's algorithm without recursion over
    `back`, the reversed graph of fault-free steps (its components are the graph's)."""
    n = len(back)
    order, low = [-1] * n, [0] * n
    stacked = [False] * n
    stack: list[int] = []
    found: list[list[int]] = []
    counter = 0
    for root in range(n):
        if order[root] >= 0 or not open_[root]:
            continue
        work = [(root, 0)]
        while work:
            v, at = work.pop()
            if at == 0:
                order[v] = low[v] = counter
                counter += 1
                stack.append(v)
                stacked[v] = True
            edges = back[v]
            descended = False
            while at < len(edges):
                u = edges[at]
                at += 1
                if not open_[u]:
                    continue
                if order[u] < 0:
                    work += [(v, at), (u, 0)]
                    descended = True
                    break
                if stacked[u]:
                    low[v] = min(low[v], order[u])
            if descended:
                continue
            if low[v] == order[v]:
                component = []
                while True:
                    u = stack.pop()
                    stacked[u] = False
                    component.append(u)
                    if u == v:
                        break
                if len(component) > 1 or v in back[v]:
                    found.append(component)
            if work:
                above = work[-1][0]
                low[above] = min(low[above], low[v])
    return found


def _trace(worlds: list[World], parent: list[int], i: int, rules: Rules) -> list[str]:
    steps = []
    while parent[i] >= 0:
        before = worlds[parent[i]]
        steps.append(next(what for what, after, _ in moves(before, rules) if after == worlds[i]))
        i = parent[i]
    return steps[::-1]
