"""The model checker's Redis against the real one: each directory script custody runs
(fronts/directory.py's PLACE and SWAP, shared/placement.py's UNPLACE) and its model
(redis_model.py) are given the same key state and arguments, generated, and must agree
on the value after, the answer and the change notice published. What it cannot catch: a
script the model checker does not use (the moves' lease take-over), and Redis behaviour
beyond one script on one key (the model checker takes each as atomic, as Redis runs it)."""

from __future__ import annotations

import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from fronts.directory import PLACE, SWAP
from shared import streams
from shared.placement import UNPLACE, Placement
from tests.protocol import redis_model

KEY = streams.placement_key("model-check")
PLACEMENTS = [
    Placement("a", 1),
    Placement("b", 2),
    Placement("a", 1, "b", "1f"),
    Placement("a", 1, "b", "2e"),
    Placement("a", 1, "b"),
]
VALUES = st.sampled_from([p.encode() for p in PLACEMENTS])
SCRIPTS = {
    "place": (PLACE, lambda value, old, new: redis_model.place(KEY, value, new), 1),
    "swap": (SWAP, lambda value, old, new: redis_model.swap(KEY, value, old, new), 2),
    "unplace": (UNPLACE, lambda value, old, new: redis_model.unplace(KEY, value, old), 1),
}


def real(client: redis.Redis, name: str, value: str | None, old: str, new: str) -> tuple:
    """The script run on Redis with the key at `value`: (value after, answer, notice)."""
    script, _, argc = SCRIPTS[name]
    client.delete(KEY)
    if value is not None:
        client.set(KEY, value)
    notices = client.pubsub(ignore_subscribe_messages=True)
    notices.subscribe(streams.PLACEMENT_CHANGES)
    notices.get_message(timeout=1.0)  # the subscription's confirmation
    args = [new] if name == "place" else [old, new][:argc]
    answer = client.register_script(script)(keys=[KEY], args=args)
    message = notices.get_message(timeout=0.2)
    notices.close()
    after = client.get(KEY)
    notice = None if message is None else message["data"].decode()
    return (None if after is None else after.decode()), answer, notice


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(SCRIPTS)),
    value=st.none() | VALUES,
    old=VALUES,
    new=VALUES,
)
def test_each_directory_script_does_what_the_checker_assumes(
    redis_url: str, name: str, value: str | None, old: str, new: str
):
    client = redis.Redis.from_url(redis_url)
    try:
        model = SCRIPTS[name][1](value, old, new)
        assert real(client, name, value, old, new) == model, (name, value, old, new)
    finally:
        client.delete(KEY)
        client.close()
