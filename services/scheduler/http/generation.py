"""Running generations from a handler: one request or session turn, or several plain
requests at once, each to its end, after the checks that refuse it before it queues (a
full queue, stop strings without a tokenizer)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from aiohttp import web

from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.limits import check_queue
from services.scheduler.http.tenancy import cache_namespace_of
from services.scheduler.records.request import ChatTurn, Request
from services.scheduler.records.sampling import SEED_MAX, SamplingParams
from services.scheduler.records.session import Session
from services.scheduler.runtime.front_door import Progress
from shared.tokenizer import NoTokenizer, Tokenizer, TokenizerMissing


async def run_generation(
    request: web.Request,
    rid: str,
    tokens: list[int],
    params: SamplingParams,
    session: Session | None,
    session_params: dict,
    progress: Progress | None = None,
    chat: ChatTurn | None = None,
) -> Request:
    """Run a plain request, or the next turn of the caller's `session` (resolved once,
    edge_sessions.py; `chat`: a chat turn's conversation), to its end; refused with a
    503 while the waiting queue is full."""
    check_queue(request)
    door = request.app[FRONT_DOOR]
    check_text(door.tokenizer, params)
    namespace = cache_namespace_of(request)
    return await door.generate(
        rid, tokens, params, session, session_params, progress, chat, namespace
    )


def parallel_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of `n` parallel samples of one prompt (OpenAI's and SGLang's `n`):
    sample i draws with seed + i (mod 2**64), so it is what a request with that seed
    alone gives; without a seed each draws its own."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % (SEED_MAX + 1)) for i in range(n)]


@dataclass(frozen=True)
class Job:
    """One request of several run at once: an OpenAI choice, a batch item."""

    rid: str
    tokens: list[int]
    params: SamplingParams
    progress: Progress | None = None


async def run_all(request: web.Request, jobs: list[Job]) -> list[Request]:
    """Run plain requests at once, each to its end, in the order of `jobs`. All are
    counted against the queue limit before any is submitted (a 503 refuses the lot), and
    if one fails the others are aborted (their waits are cancelled, which aborts)."""
    check_queue(request, len(jobs))
    door, namespace = request.app[FRONT_DOOR], cache_namespace_of(request)
    for job in jobs:
        check_text(door.tokenizer, job.params)
    try:
        async with asyncio.TaskGroup() as group:
            runs = [
                group.create_task(
                    door.generate(
                        j.rid, j.tokens, j.params, progress=j.progress, cache_namespace=namespace
                    )
                )
                for j in jobs
            ]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [run.result() for run in runs]


def check_text(tokenizer: Tokenizer, params: SamplingParams) -> None:
    """Stop strings are matched on text: ids-only, they are refused naming the file."""
    if params.stop and isinstance(tokenizer, NoTokenizer):
        missing = tokenizer.missing
        raise TokenizerMissing(f"stop strings need text, but {missing} is missing (ids-only)")
