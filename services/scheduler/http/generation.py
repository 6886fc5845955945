"""The turns a handler hands the core (records/turn.py), built once its body is decoded:
the check that refuses a generation before it queues (stop strings without a
tokenizer; a full queue is the core's to refuse, FrontDoor.follow), the tenant's cache
namespace, and the parameters of parallel samples."""

from __future__ import annotations

from dataclasses import replace

from aiohttp import web

from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.tenancy import Claim, cache_namespace_of, tenant_of
from services.scheduler.records.request import ChatTurn
from services.scheduler.records.sampling import SEED_MAX, SamplingParams
from services.scheduler.records.session import Session
from services.scheduler.records.turn import Turn
from shared.tokenizer import NoTokenizer, Tokenizer, TokenizerMissing


def plain_turns(
    request: web.Request, planned: list[tuple[Claim, list[int], SamplingParams]]
) -> list[Turn]:
    """Plain requests run at once, (ids, prompt, parameters) each."""
    door, namespace = request.app[FRONT_DOOR], cache_namespace_of(request)
    for _, _, params in planned:
        check_text(door.tokenizer, params)
    tenant = tenant_of(request)
    return [
        Turn(
            rid=claim.server,
            shown=claim.shown,
            tenant=tenant,
            tokens=tokens,
            params=params,
            cache_namespace=namespace,
        )
        for claim, tokens, params in planned
    ]


def session_turn(
    request: web.Request,
    claim: Claim,
    tokens: list[int],
    params: SamplingParams,
    session: Session | None,
    options: dict | None = None,
    chat: ChatTurn | None = None,
) -> list[Turn]:
    """One request, or the next turn of the caller's `session` (resolved once,
    edge_sessions.py; `options`: a /generate turn's session_params; `chat`: a chat turn's
    conversation)."""
    check_text(request.app[FRONT_DOOR].tokenizer, params)
    turn = Turn(
        rid=claim.server,
        shown=claim.shown,
        tenant=tenant_of(request),
        tokens=tokens,
        params=params,
        session=session,
        session_options=options or {},
        chat=chat,
        cache_namespace=cache_namespace_of(request),
    )
    return [turn]


def parallel_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of `n` parallel samples of one prompt (OpenAI's and SGLang's `n`):
    sample i draws with seed + i (mod 2**64), so it is what a request with that seed
    alone gives; without a seed each draws its own."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % (SEED_MAX + 1)) for i in range(n)]


def check_text(tokenizer: Tokenizer, params: SamplingParams) -> None:
    """Stop strings are matched on text: ids-only, they are refused naming the file."""
    if params.stop and isinstance(tokenizer, NoTokenizer):
        missing = tokenizer.missing
        raise TokenizerMissing(f"stop strings need text, but {missing} is missing (ids-only)")
