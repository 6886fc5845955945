"""The executor's Redis traffic off its compute thread: a reader thread fetches and
decodes the next steps while a step runs, a writer thread writes each answer (its
result and the entry's acknowledgement) while the next one runs. The compute thread
only takes a decoded step, runs it and hands its answer over, so a GPU waits for no
round trip between two steps (the scheduler has usually published the next one long
before: it plans a step ahead).

Order is kept: entries are queued in stream order, run in that order, answered in that
order. Faults are waited out in the thread that met them, counted and logged, never
raised into the compute thread:

- the writer retries its batch until Redis takes it (a refused write, OOM or READONLY,
  holds the answers, never drops them; an answer written twice is passed over by the
  scheduler, which expects each step once);
- a reader whose read failed may have lost a reply Redis did deliver (its entries are
  then pending for this consumer, never to be read again with ">"): so after a fault it
  reads this consumer's pending entries first, and queues those it has not queued yet.
  Entries it queued are remembered until acknowledged, and acknowledgements go in
  stream order, so an entry at or before the last acknowledged one is done: an entry
  never runs twice.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import redis

from shared import streams
from shared.messages.envelope import WireError
from shared.messages.forward import Step, decode_step
from shared.retry import Retry

log = logging.getLogger("custody.executor")
READ_COUNT = 8  # entries per read
QUEUED = 16  # entries read ahead of the compute thread, at most


@dataclass(frozen=True)
class Entry:
    """A forward-stream entry as the compute thread gets it: decoded, or the reason it
    did not decode (`raw` kept for its head); `raw` None: an entry deleted from the
    stream, acknowledged without an answer."""

    entry_id: bytes
    raw: bytes | None
    step: Step | None = None
    error: WireError | None = None


def entry_key(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id's order: (milliseconds, sequence)."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


class StepIO:
    def __init__(
        self,
        client: redis.Redis,
        keys: streams.Keys,
        consumer: str,
        maxlen: int,
        retries: Callable[[str], Retry],
        block_ms: int,
    ) -> None:
        """`client` is shared (each thread takes its own connection from its pool);
        `retries(name)`: a Retry for the thread named; `block_ms`: how long one read
        waits for new entries."""
        self.client, self.keys, self.consumer = client, keys, consumer
        self.maxlen, self.retries, self.block_ms = maxlen, retries, block_ms
        self.inbox: queue.Queue[Entry] = queue.Queue(QUEUED)
        self.outbox: queue.Queue[tuple[bytes, bytes | None]] = queue.Queue()
        self._lock = threading.Lock()
        self._queued: set[bytes] = set()  # queued or run, not yet acknowledged
        self._acked: tuple[int, int] = (0, 0)  # the last entry acknowledged
        self._unwritten = 0  # answers handed over and not yet written
        self._written = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._reader = threading.Thread(target=self._read_forever, name="step-reader", daemon=True)

    def start(self) -> StepIO:
        self._reader.start()
        threading.Thread(target=self._write_forever, name="step-writer", daemon=True).start()
        return self

    def stop(self) -> None:
        """Read no more: returns once the reader's last read is over (answers handed
        over are still written). For tests, which run several services in one process."""
        self._stopping.set()
        if self._reader.is_alive():
            self._reader.join()

    # ---- the compute thread's side ----
    def next(self, timeout: float) -> Entry | None:
        """The next entry in stream order, or None after `timeout` seconds."""
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def answer(self, entry_id: bytes, result: bytes | None) -> None:
        """Write `result` (None: nobody waits for one) and acknowledge the entry."""
        with self._lock:
            self._unwritten += 1
        self.outbox.put((entry_id, result))

    def flush(self, timeout: float) -> bool:
        """Wait until every answer handed over is written (tests, shutdown)."""
        with self._written:
            return self._written.wait_for(lambda: self._unwritten == 0, timeout)

    # ---- reading ----
    def _read_forever(self) -> None:
        client, retry = self.client, self.retries("executor_read")
        pending: bytes | None = None  # after a fault: this consumer's pending entries after it
        while not self._stopping.is_set():
            try:
                entries = self._read(client, pending)
            except Exception as err:  # Redis away or refusing, or the thread's own fault
                pending = b"0"
                retry.wait_sync(err)
                continue
            retry.ok()
            if pending is not None:
                pending = entries[-1][0] if entries else None
            for entry in self._unseen(entries):
                self.inbox.put(entry)

    def _read(self, client: redis.Redis, pending: bytes | None) -> list[tuple[bytes, dict]]:
        reply = client.xreadgroup(
            streams.EXECUTOR_GROUP,
            self.consumer,
            {self.keys.forward: ">" if pending is None else pending},
            count=READ_COUNT,
            block=self.block_ms if pending is None else None,
        )
        return reply[0][1] if reply else []

    def _unseen(self, entries: list[tuple[bytes, dict]]) -> list[Entry]:
        """The entries not queued before, decoded, and now remembered as queued."""
        fresh = []
        with self._lock:
            for entry_id, fields in entries:
                if entry_id in self._queued or entry_key(entry_id) <= self._acked:
                    continue
                self._queued.add(entry_id)
                fresh.append((entry_id, fields.get(b"m", b"") if fields else None))
        return [_decoded(entry_id, raw) for entry_id, raw in fresh]

    # ---- writing ----
    def _write_forever(self) -> None:
        client, retry = self.client, self.retries("executor_write")
        while True:
            batch = [self.outbox.get()]
            while not self.outbox.empty() and len(batch) < 64:
                batch.append(self.outbox.get_nowait())
            while True:
                try:
                    self._write(client, batch)
                    break
                except Exception as err:  # Redis away or refusing: the answers wait
                    retry.wait_sync(err)
            retry.ok()
            with self._written:
                for entry_id, _ in batch:
                    self._queued.discard(entry_id)
                self._acked = max(self._acked, entry_key(batch[-1][0]))
                self._unwritten -= len(batch)
                self._written.notify_all()

    def _write(self, client: redis.Redis, batch: list[tuple[bytes, bytes | None]]) -> None:
        pipe = client.pipeline(transaction=False)
        for result in [r for _, r in batch if r is not None]:
            pipe.xadd(self.keys.results, {"m": result}, maxlen=self.maxlen, approximate=True)
        pipe.xack(self.keys.forward, streams.EXECUTOR_GROUP, *[e for e, _ in batch])
        pipe.execute()


def _decoded(entry_id: bytes, raw: bytes | None) -> Entry:
    """Decoding here, in the reader, runs while the compute thread runs a step."""
    if raw is None:
        return Entry(entry_id, None)
    try:
        return Entry(entry_id, raw, decode_step(raw), None)
    except WireError as err:
        return Entry(entry_id, raw, None, err)
