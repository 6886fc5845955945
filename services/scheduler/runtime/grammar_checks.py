"""Whether a grammar compiles, asked of the executor before a constrained request is
admitted: the scheduler imports no torch, so it has no xgrammar; the executor compiles
on a thread of its own (services/executor/grammars.py), which also leaves the grammar
compiled for the request's first step. A spec that does not compile is a 400 naming
why; verdicts are kept (bounded), so a schema sent again is not asked again.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

import msgspec
import redis.asyncio as aioredis
from aiohttp import web

from services.scheduler.records.sampling import InvalidRequest
from shared import streams
from shared.messages.grammar import GrammarCheck, GrammarSpec, decode_verdict

VERDICTS_KEPT = 1024
CHECK_TIMEOUT_SECONDS = 30  # a compile taking longer is refused as unavailable


class GrammarChecks:
    def __init__(self, redis: aioredis.Redis, keys: streams.Keys) -> None:
        self.redis, self.keys = redis, keys
        self.verdicts: OrderedDict[str, str | None] = OrderedDict()  # key -> error or None

    async def check(self, spec: GrammarSpec) -> None:
        """Return if `spec` compiles; InvalidRequest naming why not; a 503 if the
        executor does not answer in time (it is starting, or gone)."""
        key = spec.key
        if key not in self.verdicts:
            self._keep(key, await self._ask(spec))
        self.verdicts.move_to_end(key)
        error = self.verdicts[key]
        if error is not None:
            raise InvalidRequest(error)

    async def _ask(self, spec: GrammarSpec) -> str | None:
        reply = self.keys.grammar_verdict(secrets.token_hex(8))
        check = msgspec.msgpack.encode(GrammarCheck(spec=spec, reply=reply))
        await self.redis.rpush(self.keys.grammar_checks, check)
        answer = await self.redis.blpop([reply], timeout=CHECK_TIMEOUT_SECONDS)
        if answer is None:
            raise web.HTTPServiceUnavailable(
                reason=f"the executor did not check the {spec.kind} in time; try again"
            )
        return decode_verdict(answer[1]).error

    def _keep(self, key: str, error: str | None) -> None:
        self.verdicts[key] = error
        while len(self.verdicts) > VERDICTS_KEPT:
            self.verdicts.popitem(last=False)
