"""`custody soak --duration S [--chaos]`: many concurrent clients against the running
services, on pools small enough that evictions, dropped session state and retracts are
routine: sessions with random turn lengths, aborts by disconnect, over-long inputs, closes,
idle timeouts, and plain requests sharing a prefix. With `--chaos`, the executor, the
scheduler and the session store are SIGKILLed and Redis restarted at random moments.

At the end, with every session closed: the idle check, ledger agreement and zero leaked
slots; and every finished turn is checked against a fault-free one-shot replay of its
history (greedy). A session whose turn failed is abandoned (closed), so a replay always
knows its exact history.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import torch

from custody.up import Stack
from services.executor.batch import ForwardBatch, Row
from services.executor.pools import DevicePools, PoolSizes
from services.executor.weights import load_model
from shared.config import Settings
from shared.redis_server import free_port

WORKERS = 6
PREFIX = [(7 * j) % 250 + 1 for j in range(48)]


class Soak:
    def __init__(self, duration: float, chaos: bool) -> None:
        self.settings = Settings(
            port=free_port(),
            store_port=free_port(),
            executor_metrics_port=free_port(),
            kv_pages=160,
            mamba_slots=40,
            max_running_requests=12,
            context_len=1024,
            chunk_size=64,
            max_step_tokens=256,
            track_interval=64,
            heartbeat_seconds=0.2,
            executor_timeout_seconds=2.0,
        )
        self.duration, self.chaos = duration, chaos
        self.errors: Counter[str] = Counter()
        self.finished: list[tuple[list[int], int, list[int]]] = []  # (prompt, n, output)
        self.turns = 0
        self.opened: set[str] = set()  # every session id handed out, closed again at the end
        self.lock = threading.Lock()
        self.stack = Stack(self.settings)

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.settings.port}{path}", data=json.dumps(body).encode()
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] += 1

    def worker(self, k: int, deadline: float) -> None:
        rng = random.Random(k)
        sid, history = None, []
        while time.monotonic() < deadline:
            try:
                if rng.random() < 0.25:
                    n = rng.randint(1, 12)
                    prompt = [*PREFIX, *(rng.randrange(256) for _ in range(rng.randint(1, 8)))]
                    out = self.post(
                        "/generate",
                        {
                            "input_ids": prompt,
                            "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
                        },
                    )
                    self.record(prompt, n, out["output_ids"])
                    continue
                if sid is None:
                    timeout = 1.0 if rng.random() < 0.1 else None  # some expire while idle
                    sid = self.post("/open_session", {"timeout": timeout} if timeout else {})
                    with self.lock:
                        self.opened.add(sid)
                    history = []
                    if timeout:
                        sid = None
                        continue
                new = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
                n = rng.randint(1, 24)
                body = {
                    "input_ids": new,
                    "session_params": {"id": sid},
                    "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
                }
                roll = rng.random()
                if roll < 0.05:
                    # over-long whatever `new` is: a clean 400 that changes nothing
                    body["input_ids"] = new * (self.settings.context_len // len(new) + 1)
                    try:
                        self.post("/generate", body)
                    except urllib.error.HTTPError as err:
                        self.error(f"http_{err.code}")
                    continue
                if roll < 0.15:
                    self.disconnect_midway(body)
                    self.error("client_disconnect")
                    sid = self.close(sid)  # its history is uncertain: abandon it
                    continue
                out = self.post("/generate", body)
                with self.lock:
                    self.turns += 1
                self.record(history + new, n, out["output_ids"])
                history += new + out["output_ids"]
                if len(history) > 700 or rng.random() < 0.1:
                    sid = self.close(sid)
            except urllib.error.HTTPError as err:
                self.error(f"http_{err.code}")
                sid = self.close(sid)
            except (OSError, http.client.HTTPException):
                self.error("connection")
                sid = self.close(sid)
                time.sleep(0.3)
        self.close(sid)

    def record(self, prompt: list[int], n: int, output: list[int]) -> None:
        with self.lock:
            self.finished.append((prompt, n, output))

    def close(self, sid: str | None) -> None:
        if sid is not None:
            with contextlib.suppress(urllib.error.URLError, OSError, http.client.HTTPException):
                self.post("/close_session", {"session_id": sid})
        return None

    def disconnect_midway(self, body: dict) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.settings.port, timeout=60)
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn.request("POST", "/generate", json.dumps(body | {"stream": True}))
            conn.getresponse().fp.readline()
        conn.close()

    def chaos_loop(self, deadline: float, rng: random.Random) -> None:
        while time.monotonic() < deadline - 10:
            time.sleep(rng.uniform(6, 12))
            victim = rng.choice(["executor", "scheduler", "session-store", "redis"])
            if victim == "redis":
                self.stack.redis.stop()
                time.sleep(0.5)
                self.stack.redis.start()
            else:
                self.stack.kill(victim, signal.SIGKILL)
            self.error(f"chaos_{victim}")

    def ledger(self) -> dict:
        url = f"http://127.0.0.1:{self.settings.store_port}/ledger"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())

    def run(self) -> dict:
        self.stack.start_all()
        try:
            self.stack.wait_healthy()
            deadline = time.monotonic() + self.duration
            threads = [
                threading.Thread(target=self.worker, args=(k, deadline)) for k in range(WORKERS)
            ]
            if self.chaos:
                threads.append(
                    threading.Thread(target=self.chaos_loop, args=(deadline, random.Random(99)))
                )
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                self.stack.supervise_once()
                time.sleep(0.2)
            self.stack.wait_healthy()
            for sid in sorted(self.opened):  # a close lost to a fault is retried now
                self.close(sid)
            self.post("/flush_cache", {})
            view, _held = self.settle()
        finally:
            self.stack.stop()
        wrong = self.replay()
        return {
            "turns": self.turns,
            "finished": len(self.finished),
            "errors_by_kind": dict(self.errors),
            "leaked_slots": sum(len(v) for v in view["leaked"].values()),
            "ledger_violations": len(view["violations"]),
            "wrong_outputs": wrong,
            "restarts": dict(self.stack.restarts),
            "violations": view["violations"][:5],
        }

    def settle(self, timeout: float = 30) -> tuple[dict, int]:
        """Wait until the store's ledger shows every slot free; returns the ledger and how
        many slots are still held if that never happens."""
        capacity = {
            "kv": self.settings.kv_pages,
            "mamba": self.settings.mamba_slots,
            "req": self.settings.max_running_requests,
        }
        deadline = time.monotonic() + timeout
        while True:
            self.stack.supervise_once()
            view = self.ledger()
            free = {p: c["free"] for p, c in view["counts"].items()}
            if free == capacity:
                return view, 0
            if time.monotonic() > deadline:
                return view, sum(capacity[p] - free.get(p, 0) for p in capacity)
            time.sleep(0.5)

    def replay(self, margin: float = 1e-3) -> int:
        """Check every finished output against a fault-free model, teacher-forced: one
        forward over prompt + output, and each produced token must be the greedy choice
        there (or tie with it within `margin`: chunking the same sequence differently moves
        logits by about 1e-6, which may flip a near-tie and is not a fault)."""
        model = load_model(None, torch.device("cpu"))
        pools = DevicePools(
            model.cfg, PoolSizes(kv_pages=2048, page_size=1, mamba_slots=1), torch.device("cpu")
        )
        wrong = 0
        for prompt, _, output in self.finished:
            tokens = torch.tensor(prompt + output[:-1])
            pools.reset()
            batch = ForwardBatch(
                [Row(tokens, 0, torch.arange(1, len(tokens) + 1), 1)], torch.device("cpu")
            )
            with torch.inference_mode():
                logits = model.lm_head(model(batch, pools)[len(prompt) - 1 :]).float()
            chosen = logits.gather(1, torch.tensor(output)[:, None])[:, 0]
            wrong += bool((chosen < logits.max(dim=1).values - margin).any())
        return wrong


def run(duration: float, chaos: bool, as_json: bool) -> int:
    result = Soak(duration, chaos).run()
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    clean = not (result["leaked_slots"] or result["ledger_violations"] or result["wrong_outputs"])
    return 0 if clean else 1
