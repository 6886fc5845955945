"""Why a request stops after the token it just sampled, if it does."""

from __future__ import annotations

from services.scheduler.records.finish import FinishReason
from services.scheduler.records.request import Request


def finish_reason(
    req: Request,
    token: int,
    eos_token_ids: frozenset[int],
    context_len: int,
) -> FinishReason | None:
    """A stop token (its id is `matched`), a stop string (found in the output's text,
    detokenized incrementally: `records/request.py`'s `text`), the request's token
    limit, or the context length; None to go on."""
    if req.params.stops_at(token, eos_token_ids):
        return FinishReason("stop", matched=token)
    if req.params.stop and req.text is not None:
        stop = req.text.find_stop(req.output)
        if stop is not None:
            return FinishReason("stop", matched=stop)
    return length_limit(req, context_len)


def length_limit(req: Request, context_len: int, pending: int = 0) -> FinishReason | None:
    """The token limit or the context length, reached once `pending` more tokens are
    sampled: the one way to end that is known before the token is."""
    produced = len(req.output) + pending
    if produced >= req.params.max_new_tokens:
        return FinishReason("length", length=req.params.max_new_tokens)
    if req.length + pending >= context_len:
        return FinishReason("length", length=produced)
    return None
