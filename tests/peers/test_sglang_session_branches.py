"""custody's turn tree (services/scheduler/records/turn_tree.py) builds the history SGLang's
own session controller builds, for `rid`, `offset`, `replace` and `drop_previous_output`
alone and combined, over random sequences of turns (sglang_session_oracle.py runs the
wheel's controller).

What it can catch: any turn whose prompt differs from SGLang's for the same calls (a cut
off by one, a dropped output kept, a branch `replace` should have forgotten still
named), and a turn one side refuses that the other serves. What it cannot: whether the
engine runs that prompt from the right state (tests/engine/test_branches.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.turn_tree import TurnTree
from tests.peers.sglang_session_oracle import SGLangSession


class CustodySession:
    """What SessionManager does with a /generate turn's session_params, without the
    engine: resolve, run (the caller gives the output), commit."""

    def __init__(self) -> None:
        self.tree, self.history, self.last_rid = TurnTree(), np.zeros(0, np.int64), ""

    def turn(self, rid: str, input_ids: list[int], options: dict, output: list[int]) -> list[int]:
        branch = self.tree.resolve(options, self.history, self.last_rid)
        prompt = np.concatenate([branch.base, np.asarray(input_ids, np.int64)])
        if not len(prompt):
            raise InvalidRequest("no tokens")
        self.tree.commit(branch, rid, np.asarray(input_ids, np.int64), output)
        self.history = np.concatenate([prompt, np.asarray(output, np.int64)])
        self.last_rid = rid
        return prompt.tolist()


def random_options(rng: random.Random, rids: list[str], length: int) -> dict:
    options: dict = {}
    if rids and rng.random() < 0.6:
        options["rid"] = rng.choice([*rids, "never-run"])
    if rng.random() < 0.4:
        options["offset"] = rng.choice([0, rng.randint(-length - 2, length + 2)])
    if rng.random() < 0.25:
        options["replace"] = True
    if rng.random() < 0.3:
        options["drop_previous_output"] = True
    return options


@pytest.mark.parametrize("seed", range(40))
def test_every_turn_continues_the_history_sglang_builds(seed):
    rng = random.Random(seed)
    ours, theirs, rids = CustodySession(), SGLangSession(), []
    for n in range(30):
        rid = f"t{n}"
        options = random_options(rng, rids, len(ours.history))
        # SGLang forgets the named turn's branches before it refuses an empty turn; custody
        # changes nothing for a refused turn: no empty turn replaces here
        sizes = [1, 3, 7] if options.get("replace") else [0, 1, 3, 7]
        new_input = [rng.randrange(1, 256) for _ in range(rng.choice(sizes))]
        output = [rng.randrange(1, 256) for _ in range(rng.randint(0, 5))]
        # custody's turn without rid continues its latest turn, as SGLang's names it
        named = options if "rid" in options else options | {"rid": ours.last_rid or None}
        req = theirs.turn(rid, new_input, named, max_new_tokens=8)
        try:
            prompt = ours.turn(rid, new_input, options, output)
        except InvalidRequest:
            assert req.abort_message is not None, (n, options)
            continue
        assert req.abort_message is None, (n, options, req.abort_message)
        assert prompt == req.origin_input_ids, (n, options)
        theirs.finish(req, output)
        rids.append(rid)


def test_a_tree_survives_its_record():
    """The tree a record carries is the tree: every turn's tokens, the latest, and a
    malformed one refused, never half-built."""
    rng = random.Random(7)
    ours, rids = CustodySession(), []
    for n in range(20):
        options = random_options(rng, rids, len(ours.history))
        options.pop("replace", None)
        options["rid"] = options.get("rid") if options.get("rid") != "never-run" else None
        try:
            ours.turn(f"t{n}", [n + 1], options, [n + 100, n + 101])
        except InvalidRequest:
            continue
        rids.append(f"t{n}")
    again = TurnTree.of(ours.tree.entries(), ours.last_rid)
    assert again.latest is not None and again.latest.rid == ours.last_rid
    for rid, node in ours.tree.by_rid.items():
        assert np.array_equal(again.by_rid[rid].tokens(), node.tokens())
    entries = ours.tree.entries()
    with pytest.raises(ValueError, match="out of order"):
        TurnTree.of(entries[::-1], ours.last_rid)
