"""The output's log probabilities in each API's own format, for the output tokens
`output[start:end]` (a stream's chunk covers the tokens that arrived since the one
before; SGLang's cumulative chunks cover them all).

The numbers are the executor's: the raw logits' log-softmax, whatever the sampling
parameters (vLLM's default), kept per output token on the request (`Request.record`).
A token's text is its own decoding, so a token that holds part of a multi-byte
character shows as U+FFFD, as in vLLM; its `bytes` are that text's UTF-8.
"""

from __future__ import annotations

import msgspec

from services.scheduler.records.request import Request
from services.scheduler.records.sampling import InvalidRequest, SamplingParams
from shared.tokenizer import Tokenizer


class TokenTexts:
    """Each token id's own text, decoded once; `named` False: none (SGLang's null text,
    unless a request sets `return_text_in_logprobs`)."""

    def __init__(self, tokenizer: Tokenizer, named: bool = True) -> None:
        self.tokenizer, self.named = tokenizer, named
        self.seen: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        if not self.named:
            return None
        text = self.seen.get(token)
        if text is None:
            text = self.seen[token] = self.tokenizer.decode([token])
        return text


def alternatives(
    text: TokenTexts, token: int, logprob: float, top: list[tuple[int, float]]
) -> dict[str, float]:
    """/v1/completions' `top_logprobs` entry of one position: the token there, keyed by
    its text, and its top alternatives, each keyed by its text too unless a token before
    it has that text (every piece of a multi-byte character reads U+FFFD), then by
    `token_id:<id>` (vLLM's spelling of a token by id), so no alternative is lost."""
    out = {text(token): logprob}
    for alt, value in top:
        if alt != token:
            key = text(alt)
            out[key if key not in out else f"token_id:{alt}"] = value
    return out


def _top(req: Request, i: int) -> list[tuple[int, float]]:
    """The top alternatives of output position `i` (none unless asked for)."""
    if i >= len(req.top_logprobs):
        return []
    ids, lps = req.top_logprobs[i]
    return list(zip(ids, lps, strict=True))


def sglang(text: TokenTexts, req: Request, end: int | None = None) -> dict:
    """SGLang's `meta_info` fields: `input_token_logprobs` and `output_token_logprobs`
    [[logprob, id, text]] per position and, when `top_logprobs_num` asked for them,
    `input_top_logprobs` and `output_top_logprobs`."""
    end = len(req.output) if end is None else end
    pairs = list(zip(req.logprobs[:end], req.output[:end], strict=False))
    meta: dict = sglang_inputs(text, req)
    meta["output_token_logprobs"] = [[lp, tok, text(tok)] for lp, tok in pairs]
    if req.params.top_logprobs:
        meta["output_top_logprobs"] = [
            [[lp, tok, text(tok)] for tok, lp in _top(req, i)] for i in range(end)
        ]
    return meta


def sglang_inputs(text: TokenTexts, req: Request) -> dict:
    """`input_token_logprobs` (the first position's logprob null, as SGLang's) and, when
    asked for, `input_top_logprobs` (null at the first position): empty lists when no
    input logprobs were asked for (no `logprob_start_len`)."""
    inputs = req.prompt[req.scored_from :].tolist() if req.scored_from >= 0 else []
    meta: dict = {
        "input_token_logprobs": [
            [lp, tok, text(tok)] for lp, tok in zip(req.input_logprobs, inputs, strict=True)
        ]
    }
    if req.params.top_logprobs:
        meta["input_top_logprobs"] = (
            [
                None if top is None else [[lp, t, text(t)] for t, lp in zip(*top, strict=True)]
                for top in req.input_top
            ]
            if inputs
            else []
        )
    return meta


# A streamed logprob request's most entries in one chunk: (max_new_tokens + the input
# positions listed) x (top_logprobs_num + 1). An SGLang stream's chunks are cumulative, so
# it sends about max_new_tokens times that in all.
MAX_STREAMED_LOGPROBS = 4096


def check_streamed(req_params: SamplingParams, prompt_len: int) -> None:
    """Refuse a streamed logprob request over `MAX_STREAMED_LOGPROBS` (400): every
    cumulative chunk repeats the input's entries and the output's so far. `prompt_len`:
    the input's tokens, a session's history included."""
    start = req_params.logprob_start
    inputs = max(0, prompt_len - start) if start >= 0 else 0
    entries = (req_params.max_new_tokens + inputs) * (req_params.top_logprobs + 1)
    if req_params.logprobs and entries > MAX_STREAMED_LOGPROBS:
        raise InvalidRequest(
            f"a streamed request with logprobs may ask for at most {MAX_STREAMED_LOGPROBS} "
            "entries ((max_new_tokens + the input positions from logprob_start_len) x "
            f"(top_logprobs_num + 1)); this one asks for {entries}: ask for fewer tokens, "
            "positions or alternatives, or do not stream"
        )


class SglangStream:
    """SGLang's logprob fields of one stream: each position serialized once, when it
    first goes out, so a cumulative chunk costs a copy of bytes already made, not the
    serializing of every entry so far again (300 tokens cost 33.5 MB of new JSON that
    way, on the loop every client shares)."""

    def __init__(self, text: TokenTexts, top: bool) -> None:
        self.text, self.top = text, top
        self.tokens: list[bytes] = []
        self.tops: list[bytes] = []
        self.inputs: dict[str, msgspec.Raw] = {}

    def fields(self, req: Request, start: int, end: int) -> dict[str, msgspec.Raw]:
        """The fields for output positions [start, end), encoded (a chunk's JSON
        splices them in as they are); the input's, known once the prompt is computed,
        in every chunk from `start` 0 (each cumulative chunk, an incremental stream's
        first)."""
        if not self.inputs:
            inputs = sglang_inputs(self.text, req)
            self.inputs = {k: msgspec.Raw(msgspec.json.encode(v)) for k, v in inputs.items()}
        for i in range(len(self.tokens), end):
            tok = req.output[i]
            self.tokens.append(msgspec.json.encode([req.logprobs[i], tok, self.text(tok)]))
            if self.top:
                top = [[lp, t, self.text(t)] for t, lp in _top(req, i)]
                self.tops.append(msgspec.json.encode(top))
        out = dict(self.inputs) if start == 0 else {}
        out["output_token_logprobs"] = _array(self.tokens[start:end])
        if self.top:
            out["output_top_logprobs"] = _array(self.tops[start:end])
        return out


def _array(encoded: list[bytes]) -> msgspec.Raw:
    return msgspec.Raw(b"[" + b",".join(encoded) + b"]")


def completion(
    tokenizer: Tokenizer, req: Request, start: int = 0, end: int | None = None, offset: int = 0
) -> dict:
    """/v1/completions' `choice.logprobs`: per token its text, logprob, a dict of the top
    `logprobs` alternatives and the sampled token (so up to logprobs + 1 entries, as
    OpenAI says), and its text's offset; `offset`: the characters sent before `start`."""
    text, end = TokenTexts(tokenizer), len(req.output) if end is None else end
    tokens, offsets, tops = [], [], []
    for i in range(start, end):
        tok = req.output[i]
        offsets.append(offset)
        tokens.append(text(tok))
        offset += len(tokens[-1])
        tops.append(alternatives(text, tok, req.logprobs[i], _top(req, i)))
    return {
        "tokens": tokens,
        "token_logprobs": req.logprobs[start:end],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echoed_prompt(tokenizer: Tokenizer, req: Request) -> dict:
    """/v1/completions' `choice.logprobs` of an echoed prompt (its tokens after any
    session history), as vLLM gives them: the first token's logprob and alternatives
    null, each other's as an output token's; offsets from 0."""
    text, offset = TokenTexts(tokenizer), 0
    tokens, offsets, tops = [], [], []
    for i, tok in enumerate(req.prompt[req.scored_from :].tolist()):
        offsets.append(offset)
        tokens.append(text(tok))
        offset += len(tokens[-1])
        lp, top = req.input_logprobs[i], req.input_top[i] if req.input_top else ((), ())
        pairs = [] if top is None else list(zip(*top, strict=True))
        tops.append(None if lp is None else alternatives(text, tok, lp, pairs))
    return {
        "tokens": tokens,
        "token_logprobs": list(req.input_logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def joined(first: dict, then: dict, shift: int) -> dict:
    """Two `choice.logprobs` end to end, `then`'s offsets moved by `shift` characters."""
    offsets = first["text_offset"] + [x + shift for x in then["text_offset"]]
    keys = ("tokens", "token_logprobs", "top_logprobs")
    return {key: first[key] + then[key] for key in keys} | {"text_offset": offsets}


def openai(
    tokenizer: Tokenizer,
    req: Request,
    chat: bool,
    start: int = 0,
    end: int | None = None,
    offset: int = 0,
) -> dict | None:
    """A choice's `logprobs` in the route's format, or None when the request did not ask
    for them (OpenAI's null)."""
    if not req.params.logprobs:
        return None
    if chat:
        return chat_logprobs(tokenizer, req, start, end)
    return completion(tokenizer, req, start, end, offset)


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(
    tokenizer: Tokenizer, req: Request, start: int = 0, end: int | None = None
) -> dict:
    """/v1/chat/completions' `choice.logprobs`: per token its text, logprob and bytes,
    and the `top_logprobs` most likely tokens in the same shape."""
    text, end = TokenTexts(tokenizer), len(req.output) if end is None else end
    content = []
    for i in range(start, end):
        entry = _entry(text(req.output[i]), req.logprobs[i])
        entry["top_logprobs"] = [_entry(text(t), lp) for t, lp in _top(req, i)]
        content.append(entry)
    return {"content": content}
