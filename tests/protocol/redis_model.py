"""The model checker's model of the directory's Lua scripts (fronts/directory.py,
shared/placement.py): each a pure function of the key's value (None: no key) and the
script's arguments, giving the value after, the script's answer and the notice it
publishes (None: none). The world (world.py) moves placements only through these, and
tests/protocol/test_redis_model.py runs each script on a real Redis beside its model
over generated inputs: where they disagree, the checker explored a Redis that is not
the one custody runs on."""

from __future__ import annotations

Value = str | None
Outcome = tuple[Value, int, str | None]  # (value after, answer, notice published)


def place(key: str, value: Value, new: str) -> Outcome:
    """`PLACE`: set if absent (`SET NX`), publishing the new value."""
    if value is not None:
        return value, 0, None
    return new, 1, f"{key} {new}"


def swap(key: str, value: Value, old: str, new: str) -> Outcome:
    """`SWAP`: compare-and-set, publishing the new value."""
    if value != old:
        return value, 0, None
    return new, 1, f"{key} {new}"


def unplace(key: str, value: Value, old: str) -> Outcome:
    """`UNPLACE`: compare-and-delete, publishing the key alone (a removal)."""
    if value != old:
        return value, 0, None
    return None, 1, key
