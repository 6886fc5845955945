"""The SGLang-compatible routes: sessions, generate (plain or streamed as server-sent
events), abort, flush, health, model info and metrics. The OpenAI-compatible routes are in
`openai_routes.py`; the route table and middlewares in `app.py`.

Every refusal is a 4xx with `{"error": {"message", "type"}}` and happens before any slot
moves; a client that disconnects aborts its request, with the abort semantics of sessions
(the session keeps its cache). Handlers reach the scheduler only through its front door.
"""

from __future__ import annotations

import secrets
from importlib.metadata import version
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from services.scheduler.http import sglang_replies
from services.scheduler.http.app_keys import FRONT_DOOR, SCHEMAS, TENANCY, TOKENIZER_DIR
from services.scheduler.http.bodies import (
    any_whitespace,
    prompt_tokens,
    read_body,
    sglang_token_limit,
)
from services.scheduler.http.edge_sessions import named_session, own_session
from services.scheduler.http.events import send_events
from services.scheduler.http.generation import parallel_params, plain_turns, session_turn
from services.scheduler.http.limits import open_session_within_limits
from services.scheduler.http.logprobs import TokenTexts, check_streamed
from services.scheduler.http.replies import Flushed, Placed
from services.scheduler.http.schemas import decode_body
from services.scheduler.http.schemas_batch import is_batch
from services.scheduler.http.sglang_replies import Generation
from services.scheduler.http.tenancy import CACHE_SALT, Claim, session_id
from services.scheduler.records.sampling import InvalidRequest, SamplingParams
from services.scheduler.records.session import TURN_NAME, Session
from services.scheduler.records.turn import Turn
from shared.placement import OPENED_HEADER, PLACED_HEADER
from shared.tenancy import Refused

DEFAULT_MAX_NEW_TOKENS = 16
KEPT_BECAUSE = "borrowed by open sessions (or by a step still in flight)"


async def health(request: web.Request) -> web.Response:
    """Readiness: 200 only once a request would be served at once; until then 503 with
    Retry-After and what it waits for (SGLang's /health is 503 while it starts: a probe,
    a healthcheck or a launcher must not send traffic before)."""
    door = request.app[FRONT_DOOR]
    waiting = door.waiting_for()
    if waiting:
        body = {"status": "starting", "executor": door.executor_epoch, "waiting_for": waiting}
        return web.json_response(body, status=503, headers={"Retry-After": "1"})
    return web.json_response({"status": "ok", "executor": door.executor_epoch})


async def liveness(request: web.Request) -> web.Response:
    """The process is up and its event loop answers (restart it if not): ready or not."""
    return web.json_response({"status": "alive"})


async def health_generate(request: web.Request) -> web.Response:
    """SGLang's /health_generate: one greedy token generated end to end (scheduler,
    Redis, executor), as a request would be; 503 if it cannot be now."""
    door = request.app[FRONT_DOOR]
    if door.waiting_for():
        return await health(request)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    rid = secrets.token_hex(16)
    await door.run(session_turn(request, Claim(rid, rid), [1], params, None))
    return web.json_response({"status": "ok", "executor": door.executor_epoch})


async def metrics(request: web.Request) -> web.Response:
    body = await request.app[FRONT_DOOR].metrics()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def model_paths(request: web.Request) -> dict[str, object]:
    """What SGLang's clients read of the model, in /model_info and /server_info alike:
    its path, the directory of its tokenizer files (null: ids-only), its context."""
    s = request.app[FRONT_DOOR].settings
    tokenizer_dir = request.app.get(TOKENIZER_DIR)
    return {
        "model_path": str(s.model) if s.model else "builtin",
        "tokenizer_path": None if tokenizer_dir is None else str(tokenizer_dir),
        "context_length": s.context_len,
    }


async def model_info(request: web.Request) -> web.Response:
    s = request.app[FRONT_DOOR].settings
    return web.json_response(
        model_paths(request)
        | {
            "page_size": s.page_size,
            "kv_pages": s.kv_pages,
            "mamba_slots": s.mamba_slots,
            "max_running_requests": s.max_running_requests,
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """SGLang's /get_server_info: its settings (none secret), version, the model's paths
    and internal state, with the fields SGLang's benchmarks read (bench_one_batch_server:
    the request rows, the KV pool's tokens, the last generation throughput, the tokens a
    verify step gives on average: docs/speculative.md)."""
    door = request.app[FRONT_DOOR]
    s = door.settings
    state = {
        "requests": len(door.running_ids()),
        "queued_requests": door.queued,
        "effective_max_running_requests_per_dp": s.max_running_requests,
        "last_gen_throughput": round(door.gen_throughput, 3),
        "memory_usage": {"token_capacity": s.kv_pages * s.page_size},
        "avg_spec_accept_length": round(door.spec_accept_length, 4),
    }
    body = s.public() | model_paths(request) | {"version": version("custody")}
    return web.json_response(body | {"internal_states": [state]})


IDLE_LISTED = 100  # the most sessions /admin/idle_sessions lists


async def idle_sessions(request: web.Request) -> web.Response:
    """The longest idle sessions (operator): what holds the server's session slots
    though no client may come back for it."""
    door = request.app[FRONT_DOOR]
    return web.json_response(
        {
            "open": door.sessions_open,
            "idle_timeout": door.settings.session_idle_timeout or None,
            "sessions": door.idle_sessions(IDLE_LISTED),
        }
    )


async def open_session(request: web.Request) -> web.Response:
    body = await read_body(request, request.app[SCHEMAS].open_session)
    session = open_session_within_limits(
        request, body.session_id, body.timeout, bool(body.streaming)
    )
    session.routed = request.headers.get(PLACED_HEADER) == "1"
    mark = request.app[FRONT_DOOR].opened_mark  # read before anything else can open
    await request.app[FRONT_DOOR].durable()
    return web.json_response(session.name, headers={OPENED_HEADER: mark})


async def fork_session(request: web.Request) -> web.Response:
    """A session of the caller's, forked from one of its own (a key forks only its own
    sessions: `own_session` resolves the name within the caller's scope)."""
    body = await read_body(request, request.app[SCHEMAS].fork_session)
    parent = own_session(request, body.session_id)
    options = {"rid": body.rid, "offset": body.offset}
    options["drop_previous_output"] = body.drop_previous_output
    door = request.app[FRONT_DOOR]
    timeout = parent.timeout if body.timeout is None else body.timeout

    def open_child() -> Session:
        return open_session_within_limits(request, body.new_session_id, timeout)

    child = door.fork_session(parent, options, open_child)
    child.routed = request.headers.get(PLACED_HEADER) == "1"
    mark = door.opened_mark
    await door.durable()
    return web.json_response(child.name, headers={OPENED_HEADER: mark})


async def close_session(request: web.Request) -> web.Response:
    name = (await read_body(request, request.app[SCHEMAS].close_session)).session_id
    door = request.app[FRONT_DOOR]
    if door.forget_lost(session_id(request, name)):  # a lost one's close ends it
        await door.durable()
    else:
        session = own_session(request, name)
        await door.close_session(session)
        await door.close_recorded(session)
    return web.json_response(True)


async def place_session(request: web.Request) -> web.Response:
    body = await read_body(request, request.app[SCHEMAS].place_session)
    session = await request.app[FRONT_DOOR].place_session(body.session_id, body.tier)
    placed = Placed(session.sid, session.state_tier, session.cached_len)
    return web.json_response(msgspec.to_builtins(placed))


async def abort_request(request: web.Request) -> web.Response:
    body = await read_body(request, request.app[SCHEMAS].abort_request)
    door = request.app[FRONT_DOOR]
    targets = request.app[TENANCY].abort_targets(
        request, body.rid, body.abort_all, door.running_ids()
    )
    door.abort(targets)
    return web.json_response(True)


async def flush_cache(request: web.Request) -> web.Response:
    """200 with what the cache kept: a flush cannot take what open sessions borrow, and a
    caller relying on a cold cache must be told rather than measure a hit."""
    door = request.app[FRONT_DOOR]
    kept = door.flush_cache()
    if kept is None:
        busy = len(door.running_ids())
        message = f"the cache was not flushed: {busy} requests are queued or running"
        raise Refused(400, message, "cache_busy")
    pages, states = kept
    flushed = Flushed(True, pages, states, KEPT_BECAUSE)
    return web.json_response(msgspec.to_builtins(flushed))


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang's /generate: a request, a session turn, a batch or parallel samples; one
    reply, a list, or a stream of chunks."""
    call, door = await generation_of(request), request.app[FRONT_DOOR]
    if call.stream:
        return await send_events(request, sglang_replies.chunks(door, call))
    return web.json_response(sglang_replies.reply(call, await door.run(call.turns)))


async def generation_of(request: web.Request) -> Generation:
    """The call's body decoded and checked once: every refusal (a 4xx) comes from here,
    before anything queues or streams."""
    raw, schemas = await request.read(), request.app[SCHEMAS]
    batch = is_batch(raw)
    body = decode_body(raw, schemas.generate_batch if batch else schemas.generate)
    if body.cache_salt is not None:
        request[CACHE_SALT] = body.cache_salt
    door, n = request.app[FRONT_DOOR], body.sampling().n or 1
    logprobs = None
    if body.return_logprob:  # their tokens' texts only with return_text_in_logprobs
        logprobs = TokenTexts(door.tokenizer, body.return_text_in_logprobs)
    if batch:
        inputs = body.input_ids or [prompt_tokens(request, text, None) for text in body.text]
        turns, shown = parallel_turns(request, body, inputs, body.rid or [None] * len(inputs), n)
        return Generation(turns, shown, body.stream, True, logprobs)
    session = named_session(request, body.session_id())  # the one lookup of its session
    tokens = body.input_ids or prompt_tokens(request, body.text, session)
    if n > 1:
        if session is not None:
            raise InvalidRequest("n > 1 cannot continue a session: a session turn has one reply")
        turns, shown = parallel_turns(request, body, [tokens], [body.rid], n)
        return Generation(turns, shown, body.stream, True, logprobs)
    rid = request.app[TENANCY].claim(request, body.rid)
    params = engine_params(request, body, session, len(tokens))
    if body.stream:
        history = 0 if session is None else session.history.size
        check_streamed(params, history + len(tokens))
    options = body.session_options() | {TURN_NAME: rid.shown}  # what a later turn names
    turns = session_turn(request, rid, tokens, params, session, options)
    return Generation(turns, [rid.shown], body.stream, False, logprobs)


def parallel_turns(
    request: web.Request, body: Any, inputs: list[list[int]], rids: list[str | None], n: int
) -> tuple[list[Turn], list[str]]:
    """SGLang's batch and parallel samples: `n` requests per input (`rids`: the client's
    id of each input, which names its one request; with n > 1 it is refused), input i's
    sample j at i * n + j; and the id each request's client sees."""
    if n > 1 and any(rid is not None for rid in rids):
        raise InvalidRequest("rid names one request; with sampling_params.n > 1 leave it out")
    planned = [
        (rid, ids, params)
        for i, (rid, ids) in enumerate(zip(rids, inputs, strict=True))
        for params in parallel_params(engine_params(request, body, None, len(ids), i), n)
    ]
    claims = [request.app[TENANCY].claim(request, rid) for rid, _, _ in planned]
    if body.stream:
        for _, ids, params in planned:
            check_streamed(params, len(ids))
    turns = plain_turns(
        request, [(c, ids, p) for c, (_, ids, p) in zip(claims, planned, strict=True)]
    )
    return turns, [c.shown for c in claims]


def engine_params(
    request: web.Request, body: Any, session: Session | None, tokens: int, item: int = 0
) -> SamplingParams:
    """A /generate request's parameters (of a batch's `item`), its output budget as
    SGLang sets it."""
    sampling = body.sampling()
    limit = sglang_token_limit(
        request, session, tokens, sampling.max_new_tokens, DEFAULT_MAX_NEW_TOKENS
    )
    return sampling.engine_params(
        limit,
        body.return_logprob,
        body.top_logprobs_num,
        body.logprob_start(item),
        any_whitespace(request),
    )


ROUTES = (
    ("GET", "/health", health),
    ("GET", "/health_generate", health_generate),
    ("GET", "/liveness", liveness),
    ("GET", "/metrics", metrics),
    ("GET", "/get_model_info", model_info),
    ("GET", "/model_info", model_info),
    ("GET", "/get_server_info", server_info),
    ("GET", "/server_info", server_info),
    ("POST", "/open_session", open_session),
    ("POST", "/fork_session", fork_session),
    ("POST", "/close_session", close_session),
    ("POST", "/place_session", place_session),
    ("POST", "/abort_request", abort_request),
    ("GET", "/flush_cache", flush_cache),
    ("POST", "/flush_cache", flush_cache),
    ("POST", "/reset_prefix_cache", flush_cache),
    ("POST", "/generate", generate),
    ("GET", "/admin/idle_sessions", idle_sessions),
)
