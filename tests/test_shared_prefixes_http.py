"""Prefix state where prefixes diverge, over HTTP on the built-in model (docs/ownership.md,
"Shared prefixes"): requests sharing a prefix off every chunk boundary, a prefix whose
length wobbles, and a fleet of sessions opened on one system prompt each reuse the shared
part less at most one page from the third on, with outputs equal to a cold run (the same
model in one process, its cache emptied before each prompt). Sessions that borrow the
prompt then take each path a session's state takes (hibernation to host, spill to disk
and back, eviction under pressure, close); every test ends with the scheduler's
integrity check (check_integrity(), run by its idle loop) and the store's independent
ledger clean (`assert_clean`). The stack keeps one step in flight (`--pipeline-depth 1`;
every other stack of the tests runs the default, two), the cold runs one step at a time,
so equal outputs also say that depth changes no token.

What it cannot see: reuse in a second replica (each replica has its own cache; the
migration of a borrowing session is in tests/test_migration.py), and interleavings
these few sequences do not reach (the engine's state machine covers those)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import redis

from custody.inprocess import InProcess
from custody.up import Stack
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings
from tests.services_harness import (
    POOLS,
    assert_clean,
    call,
    metric_sum,
    stack_settings,
    start_stack,
)

PAGE, CHUNK, OUT = POOLS["page_size"], POOLS["chunk_size"], 4
GREEDY = {"max_new_tokens": OUT, "ignore_eos": True, "temperature": 0}


def text(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


def aligned(n: int) -> int:
    return n - n % PAGE


def cold(prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone on an empty cache, in one process of the same model."""
    local = InProcess(Settings(**POOLS))
    params = SamplingParams(max_new_tokens=OUT, ignore_eos=True)
    outputs = []
    for i, prompt in enumerate(prompts):
        cache, pools = local.engine.cache, local.engine.pools
        cache.evict_kv(pools.kv_pages.capacity)
        cache.evict_mamba(pools.mamba.capacity)
        req = local.engine.submit(Request(f"cold{i}", np.asarray(prompt), params))
        local.run_until_idle()
        outputs.append(list(req.output))
    return outputs


@pytest.fixture(scope="module")
def redis_client(module_redis_client: redis.Redis) -> redis.Redis:
    """The module's stack is shared: the database is flushed once, never between tests."""
    return module_redis_client


@pytest.fixture(scope="module")
def shared_stack(
    redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """With a disk tier below the host tier, so a session can go anywhere; one step in
    flight, the depth no other stack of the tests runs."""
    state_dir = tmp_path_factory.mktemp("state")
    stack = start_stack(stack_settings(redis_url, state_dir=state_dir, pipeline_depth=1))
    yield stack
    stack.stop()


@pytest.fixture
def port(shared_stack: Stack) -> Iterator[int]:
    """The stack's port, its prefix cache emptied before the test and checked clean after."""
    port = shared_stack.settings.port
    assert call(port, "/flush_cache", {})["flushed"] is True
    yield port
    assert_clean(shared_stack)


def generate(port: int, ids: list[int], sid: str | None = None) -> dict:
    body: dict = {"input_ids": ids, "sampling_params": GREEDY}
    if sid is not None:
        body["session_params"] = {"id": sid}
    return call(port, "/generate", body)


def run_in_order(port: int, prompts: list[list[int]]) -> list[dict]:
    """Each answered before the next is sent, so each finds what the last left."""
    return [generate(port, p) for p in prompts]


@pytest.mark.parametrize("shared", [50, 93, 2 * CHUNK])
def test_requests_sharing_a_prefix_reuse_it_whatever_their_suffix(port: int, shared: int):
    prefix = text(shared, 1)
    prompts = [prefix + text(n, 10 + i) for i, n in enumerate([7, 19, 45, 70, 3, 30])]
    answers = run_in_order(port, prompts)
    assert [a["output_ids"] for a in answers] == cold(prompts)
    for answer in answers[2:]:
        assert answer["meta_info"]["cached_tokens"] >= aligned(shared)


def test_a_prefix_whose_length_wobbles_is_reused_from_the_third_request(port: int):
    base = text(70, 2)
    prompts = [base[:n] + text(12, 20 + i) for i, n in enumerate([66, 69, 67, 70, 65, 68])]
    answers = run_in_order(port, prompts)
    assert [a["output_ids"] for a in answers] == cold(prompts)
    for answer in answers[2:]:
        assert answer["meta_info"]["cached_tokens"] >= aligned(65) - PAGE


def fleet(
    port: int, system: list[int], n: int, seed: int, borrowers_from: int = 2
) -> tuple[list[str], list[list[int]]]:
    """`n` sessions opened on `system`, each with its own first message; their ids and
    histories. From the `borrowers_from`th on, each borrows the system prompt from the
    cache (the first donates it, the second its junction)."""
    sids = [call(port, "/open_session", {}) for _ in range(n)]
    firsts = [system + text(9 + i, seed + i) for i in range(n)]
    answers = [generate(port, first, sid) for sid, first in zip(sids, firsts, strict=True)]
    assert [a["output_ids"] for a in answers] == cold(firsts)
    for answer in answers[borrowers_from:]:
        assert answer["meta_info"]["cached_tokens"] >= aligned(len(system))
    return sids, [f + a["output_ids"] for f, a in zip(firsts, answers, strict=True)]


def second_turns(port: int, sids: list[str], histories: list[list[int]]) -> None:
    """Each session's next turn resumes from its own state, wherever it was, and equals a
    cold run of its whole history."""
    more = text(5, 41)
    answers = [generate(port, more, sid) for sid in sids]
    assert [a["output_ids"] for a in answers] == cold([h + more for h in histories])
    for history, answer in zip(histories, answers, strict=True):
        assert answer["meta_info"]["cached_tokens"] >= len(history) - 1
    for sid in sids:
        call(port, "/close_session", {"session_id": sid})


def place(port: int, sid: str, tier: str) -> None:
    assert call(port, "/place_session", {"session_id": sid, "tier": tier})["tier"] == tier


def test_sessions_opened_on_one_system_prompt_share_it(port: int):
    """Eight sessions, one system prompt, each its own first message: from the third on,
    each first turn reuses the system prompt; the second turns resume each session's own
    state; every output equals a cold run of the session's whole history."""
    sids, histories = fleet(port, text(90, 3), 8, 30)
    second_turns(port, sids, histories)


def test_borrowing_sessions_hibernate_to_host_and_disk_and_resume(port: int):
    """A borrower that leaves the device copies the borrowed pages with its own and gives
    its lock back; the prompt stays in the cache for the others, and for a new session."""
    system = text(90, 5)
    sids, histories = fleet(port, system, 4, 50)
    place(port, sids[2], "host")
    place(port, sids[3], "host")
    place(port, sids[3], "disk")
    late, late_history = fleet(port, system, 1, 60, borrowers_from=0)
    place(port, sids[2], "device")
    second_turns(port, sids + late, histories + late_history)


def test_pressure_evicts_around_a_borrowed_prefix_and_never_through_it(port: int):
    """Plain prompts that together need more pages than the pool holds evict the cache
    repeatedly while the fleet's sessions sit idle on their borrowed prompt: the locked
    path survives (each session resumes from its own state), and what does go is counted."""
    system = text(90, 6)
    sids, histories = fleet(port, system, 3, 70)
    evicted = metric_sum(port, "custody_prefix_states_evicted_total")
    pool_tokens = POOLS["kv_pages"] * PAGE
    flood = [text(200, 80 + i) for i in range(pool_tokens // 200 + 2)]
    answers = run_in_order(port, flood)
    assert [a["output_ids"] for a in answers] == cold(flood)
    assert metric_sum(port, "custody_prefix_states_evicted_total") > evicted
    second_turns(port, sids, histories)


def kept(port: int) -> tuple[int, int]:
    """What a flush could not evict: (KV pages, Mamba states)."""
    reply = call(port, "/flush_cache", {})
    assert reply["flushed"] is True
    return reply["kv_pages_kept"], reply["mamba_slots_kept"]


def test_a_flush_says_what_an_open_session_kept(port: int):
    """A session borrows its history's pages from the cache, so a flush cannot evict them:
    it says so (the prompt's pages but its last, and the state there), and once the session
    closes the same flush keeps nothing."""
    assert kept(port) == (0, 0)
    sid = call(port, "/open_session", {})
    prompt = text(64, 7)
    generate(port, prompt, sid)
    pages, states = kept(port)
    assert pages >= len(prompt) // PAGE - 1 and states == 1
    warm = generate(port, prompt)  # what the bench measured as a recompute
    assert warm["meta_info"]["cached_tokens"] >= len(prompt) - PAGE
    call(port, "/close_session", {"session_id": sid})
    assert kept(port) == (0, 0)


def test_a_fresh_cache_salt_recomputes_what_a_session_holds(port: int):
    """The honest recompute: a plain request on a session's very tokens, with a salt no
    request used, matches nothing in the cache (0 cached tokens) and gives the same
    tokens as the session's turn."""
    sid = call(port, "/open_session", {})
    prompt = text(64, 8)
    turn = generate(port, prompt, sid)
    body = {"input_ids": prompt, "sampling_params": GREEDY, "cache_salt": "fresh-8"}
    salted = call(port, "/generate", body)
    assert salted["meta_info"]["cached_tokens"] == 0
    assert salted["output_ids"] == turn["output_ids"]
    call(port, "/close_session", {"session_id": sid})
