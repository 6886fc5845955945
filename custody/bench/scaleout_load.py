"""The clients and the readings of `custody bench scaleout` (scaleout.py): streamed
multi-turn sessions (as e2e's clients), plain requests sharing prefixes, and the
router's own metrics read from its /metrics text."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple], float]  # (name, sorted labels) -> value


@dataclass
class Turn:
    sid: str
    index: int  # 0: the session's first turn
    history: int  # tokens of the session before this turn
    cached: int  # meta_info.cached_tokens of the reply
    ttft: float  # seconds, as the client saw them
    wall: float


def post(url: str, path: str, body: dict, timeout: float = 300) -> object:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return json.loads(resp.read())


def scrape(url: str) -> Samples:
    """Every sample of a /metrics exposition, by name and sorted labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def by_label(
    before: Samples, after: Samples, name: str, label: str, **where: str
) -> dict[str, float]:
    """The increase over the run of the samples of `name` whose labels include `where`,
    keyed by one label; a sample absent before counts from 0."""
    out: dict[str, float] = {}
    for (sample, labels), value in after.items():
        named = dict(labels)
        if sample == name and where.items() <= named.items():
            key = named[label]
            out[key] = out.get(key, 0.0) + value - before.get((sample, labels), 0.0)
    return out


def bucket_counts(
    before: Samples, after: Samples, name: str, **where: str
) -> list[tuple[float, float]]:
    """(upper bound, observations in that bucket alone) over the run, ascending, summed
    over the samples whose labels include `where`; the exposition's buckets are
    cumulative, so each is differenced from the one below."""
    counts = by_label(before, after, name + "_bucket", "le", **where)
    cumulative = sorted((float(le), n) for le, n in counts.items())
    below, out = 0.0, []
    for bound, n in cumulative:
        out.append((bound, n - below))
        below = n
    return out


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a histogram, interpolating linearly inside the bucket that holds
    it (as Prometheus' histogram_quantile does); one in the +Inf bucket is the highest
    finite bound. NaN without observations."""
    total = sum(n for _, n in buckets)
    if total == 0:
        return float("nan")
    rank, seen, lower = q * total, 0.0, 0.0
    for bound, n in buckets:
        if n and seen + n >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - seen) / n
        seen += n
        if bound != float("inf"):
            lower = bound
    return lower


def _streamed_turn(url: str, body: dict) -> tuple[float, float, dict]:
    """One streamed /generate: (TTFT, wall time, the last chunk)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    start = time.perf_counter()
    ttft, last = 0.0, {}
    conn.request("POST", "/generate", json.dumps(body))
    for line in conn.getresponse():
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        last = json.loads(line[6:])
        if not ttft and last["output_ids"]:
            ttft = time.perf_counter() - start
    conn.close()
    return ttft, time.perf_counter() - start, last


def session(
    url: str, sid: str, turns: int, shape: tuple[int, int], opened: Callable[[str], None]
) -> list[Turn]:
    """One session: opened (then `opened(sid)`), `turns` streamed turns of `shape`
    (input tokens, output tokens), closed. Each turn records what its reply reused."""
    rng, (new, out) = random.Random(sid), shape
    post(url, "/open_session", {"session_id": sid})
    opened(sid)
    history, record = 0, []
    for t in range(turns):
        body = {
            "input_ids": [rng.randrange(256) for _ in range(new)],
            "stream": True,
            "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": out, "ignore_eos": True},
        }
        ttft, wall, last = _streamed_turn(url, body)
        record.append(Turn(sid, t, history, last["meta_info"]["cached_tokens"], ttft, wall))
        history += new + len(last["output_ids"])
    post(url, "/close_session", {"session_id": sid})
    return record


def concurrently(jobs: list[Callable[[], list]]) -> list:
    """Run every job on a thread of its own; their results, concatenated. A job that
    raised raises here."""
    results: list[list] = [[] for _ in jobs]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as err:  # re-raised below, on the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [item for result in results for item in result]


def prefix_prompts(
    prefixes: int, length: int, suffix: int, requests: int, order: str, seed: int = 0
) -> list[list[int]]:
    """`requests` prompts, each one of `prefixes` shared prefixes of `length` tokens and
    a unique suffix. order `iid`: each prefix drawn uniformly at random; `rounds`: every
    prefix once per round, each round in a random order (seeded either way)."""
    rng = random.Random(seed)
    shared = [[rng.randrange(256) for _ in range(length)] for _ in range(prefixes)]
    if order == "iid":
        picks = [rng.randrange(prefixes) for _ in range(requests)]
    else:
        picks = []
        while len(picks) < requests:
            picks += rng.sample(range(prefixes), prefixes)
    return [shared[p] + [rng.randrange(256) for _ in range(suffix)] for p in picks[:requests]]


@dataclass
class Reply:
    cached: int  # meta_info.cached_tokens
    sent: float  # perf_counter when the request went out
    answered: float  # ... and when its reply came back


def send_plain(
    generate: Callable[[dict], dict], prompts: list[list[int]], clients: int, out: int
) -> list[Reply]:
    """Every prompt as a plain /generate (`generate(body)`: its reply, through whichever
    front), `clients` at a time, in order; what each reply reused, and when it was sent
    and answered."""
    replies = [Reply(0, 0.0, 0.0) for _ in prompts]
    cursor = iter(range(len(prompts)))
    lock = threading.Lock()

    def client() -> list:
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return []
            params = {"max_new_tokens": out, "ignore_eos": True}
            body = {"input_ids": prompts[i], "sampling_params": params}
            sent = time.perf_counter()
            cached = generate(body)["meta_info"]["cached_tokens"]
            replies[i] = Reply(cached, sent, time.perf_counter())

    concurrently([client] * clients)
    return replies


def misses(prompts: list[list[int]], replies: list[Reply], length: int) -> dict[str, int]:
    """Where the requests that reused less than their prefix (`length` tokens) stand:
    the first of their prefix (no router can help), sent while every earlier request of
    their prefix was still running (nothing was cached yet), or after one was answered
    (the prefix had been cached: it was evicted, or routed elsewhere)."""
    out = {"first": 0, "while_first_in_flight": 0, "after_cached": 0}
    answered: dict[tuple, list[float]] = {}
    for prompt, reply in zip(prompts, replies, strict=True):
        earlier = answered.setdefault(tuple(prompt[:length]), [])
        if reply.cached < length:
            if not earlier:
                out["first"] += 1
            elif min(earlier) > reply.sent:
                out["while_first_in_flight"] += 1
            else:
                out["after_cached"] += 1
        earlier.append(reply.answered)
    return out
