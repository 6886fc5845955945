"""The client side of `custody bench multiturn`: the workload's knobs, its conversations
and the driver that replays them against a running server, one streamed /generate per
round, recording what each round cost.

The knobs carry the names of SGLang's `benchmark/hicache/bench_multiturn.py` where they
mean the same: `num_clients` conversations of `num_rounds` rounds each; round 1 sends
`request_length` random byte ids, every later round `sub_question_input_length` new ones;
each round generates `output_length` tokens (greedy, EOS ignored). The new ids of every
(client, round) are drawn from `random.Random(f"{seed}:{client}")`, so every mode and every
rate sends the same prompts.

Arrivals: one ready queue (FIFO) of the conversations whose previous round has finished,
all of them at the start. A dispatcher sleeps exponential gaps of mean 1/`request_rate`
(a Poisson process over all clients, gaps drawn from `random.Random(seed)`, so every run
sees the same gaps scaled by its rate); at each arrival it takes the conversation first in
the queue and sends its next round; a conversation goes back in the queue only when its
round's reply has ended. An arrival that finds the queue empty, or `max_parallel` rounds
in flight, waits for a conversation or a free place: no arrival is lost, and the rate
offered never exceeds `request_rate`. Exactly `num_clients * num_rounds` arrivals run.

Two modes. `sessions`: each conversation opens a session and sends only its new ids;
the server holds the history. `stateless`: each round resends the whole conversation, the
earlier prompts and the ids the server returned, and the prefix cache may serve part of it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

MODES = ("sessions", "stateless")


@dataclass(frozen=True)
class Workload:
    """The knobs (module docstring); the defaults run in about 1.5 minutes on 2 CPU cores."""

    num_clients: int = 16
    num_rounds: int = 5
    request_length: int = 512
    sub_question_input_length: int = 64
    output_length: int = 32
    max_parallel: int = 128  # rounds in flight at once (SGLang's; binds below num_clients)
    request_rates: tuple[float, ...] = (4.0, 8.0, 16.0)  # requests/s; one run each per mode
    seed: int = 1

    def __post_init__(self) -> None:
        counts = ("num_clients", "num_rounds", "request_length", "output_length", "max_parallel")
        for name in (*counts, "sub_question_input_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.request_rates or min(self.request_rates) <= 0:
            raise ValueError("request_rates must be one or more rates > 0")
        if len({f"{r:g}" for r in self.request_rates}) < len(self.request_rates):
            raise ValueError("request_rates must differ")

    @property
    def longest(self) -> int:
        """Positions of a whole conversation: every prompt and every output."""
        new = self.request_length + (self.num_rounds - 1) * self.sub_question_input_length
        return new + self.num_rounds * self.output_length


@dataclass
class Turn:
    """One round as the client saw it."""

    client: int
    round: int  # 1: the long first prompt
    history: int  # positions of the conversation before this round's new ids
    prompt_tokens: int  # as the server counted them: the history included, in both modes
    cached_tokens: int  # of those, reused rather than computed
    output_ids: list[int]
    ttft_s: float  # request sent -> first output token
    latency_s: float  # request sent -> end of the reply

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (needs two or more tokens)."""
        return (self.latency_s - self.ttft_s) / (len(self.output_ids) - 1)


@dataclass
class Conversation:
    client: int
    prompts: list[list[int]]  # each round's new ids
    session: str | None  # the session id in the sessions mode, else None
    history: list[int] = field(default_factory=list)  # prompts and outputs so far
    turns: list[Turn] = field(default_factory=list)

    def body(self, output_length: int) -> dict:
        new = self.prompts[len(self.turns)]
        body = {
            "input_ids": new if self.session else self.history + new,
            "stream": True,
            "sampling_params": {
                "max_new_tokens": output_length,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        if self.session:
            body["session_params"] = {"id": self.session}
        return body


def conversations(workload: Workload, sessions: list[str] | None) -> list[Conversation]:
    """Every client's conversation, its prompts drawn from its own seed."""
    out = []
    for client in range(workload.num_clients):
        rng = random.Random(f"{workload.seed}:{client}")
        lengths = [workload.request_length]
        lengths += [workload.sub_question_input_length] * (workload.num_rounds - 1)
        prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
        out.append(Conversation(client, prompts, sessions[client] if sessions else None))
    return out


async def one_round(http: aiohttp.ClientSession, url: str, conv: Conversation, out: int) -> None:
    """Stream the conversation's next round; record it and extend the history."""
    body = conv.body(out)
    start, ttft, last = time.perf_counter(), None, None
    async with http.post(f"{url}/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/generate answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            last = json.loads(line[6:])
            if ttft is None and last["output_ids"]:
                ttft = time.perf_counter() - start
    latency = time.perf_counter() - start
    if last is None or ttft is None:
        raise RuntimeError(f"client {conv.client}: a reply without output")
    new, meta = conv.prompts[len(conv.turns)], last["meta_info"]
    turn = Turn(
        conv.client,
        len(conv.turns) + 1,
        len(conv.history),
        meta["prompt_tokens"],
        meta["cached_tokens"],
        last["output_ids"],
        ttft,
        latency,
    )
    conv.turns.append(turn)
    conv.history += new + turn.output_ids


async def drive(
    http: aiohttp.ClientSession,
    url: str,
    convs: list[Conversation],
    workload: Workload,
    rate: float,
) -> float:
    """Run every round of `convs` at `rate` (see the module docstring); the seconds from
    the start to the end of the last reply."""
    ready: asyncio.Queue[Conversation] = asyncio.Queue()
    for conv in convs:
        ready.put_nowait(conv)
    places = asyncio.Semaphore(workload.max_parallel)
    gaps = random.Random(workload.seed)

    async def then_requeue(conv: Conversation) -> None:
        try:
            await one_round(http, url, conv, workload.output_length)
        finally:
            places.release()
        if len(conv.turns) < workload.num_rounds:
            ready.put_nowait(conv)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as rounds:  # a failed round cancels the dispatcher
        for _ in range(workload.num_clients * workload.num_rounds):
            await asyncio.sleep(gaps.expovariate(rate))
            conv = await ready.get()
            await places.acquire()
            rounds.create_task(then_requeue(conv))
    return time.perf_counter() - start
