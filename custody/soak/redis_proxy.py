"""A TCP proxy in front of Redis, for the fault campaign: one replica's scheduler and
executor reach Redis only through it, so the campaign can partition that replica, slow
it down or cut its connections while every other process keeps its own path to Redis.
The same proxy stands in front of each replica's HTTP port, between it and the router
(at the address the replica advertises), for the replies a front never gets.

Modes, switched at run time:
- `pass`: bytes flow both ways;
- `partition`: nothing flows and new connections are accepted but get nothing, as on a
  network that drops packets (a client waits on its own timeouts) until `heal`;
- `latency`: each chunk waits `delay` seconds before it goes on;
- `lose_replies`: what is sent goes through, and whatever comes back is dropped with
  its connection (the request ran, its answer is lost) until `heal`;
- `cut()`: every open connection is reset at once (new ones pass);
- `trap(patterns, action)`: the next command sent that carries every one of `patterns`
  waits for `action` to run before it goes on (a fault that must land at one exact point of a
  process's life, such as a pause at its first read of its session records).

No registry here ships a proxy server, so this is one: a thread per direction per
connection, which is plenty for two processes' connections."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable

CHUNK = 65536
POLL = 0.05  # how often a held pump looks at the mode again


class RedisProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1", listen: str = "") -> None:
        """Forwards to `host`:`target_port`, listening on a free port of `host`, or on
        `listen`:`target_port` (another loopback address, the same port)."""
        self.host, self.target_port = host, target_port
        self.server = socket.create_server((listen, target_port) if listen else (host, 0))
        self.port = self.server.getsockname()[1]
        self.mode = "pass"
        self.delay = 0.0
        self._open: set[socket.socket] = set()
        self._trap: tuple[tuple[bytes, ...], Callable[[], None]] | None = None
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def partition(self) -> None:
        self.mode = "partition"

    def slow(self, delay: float) -> None:
        self.mode, self.delay = "latency", delay

    def lose_replies(self) -> None:
        self.mode = "lose_replies"

    def heal(self) -> None:
        self.mode, self.delay = "pass", 0.0

    def trap(self, patterns: tuple[bytes, ...], action: Callable[[], None]) -> None:
        """Run `action` once, when a write carrying all of `patterns` is sent, before it
        goes on (a pattern split across two reads is not seen: commands are small)."""
        with self._lock:
            self._trap = (patterns, action)

    def disarm(self) -> None:
        """The trap set, if it has not sprung, never will."""
        with self._lock:
            self._trap = None

    def cut(self) -> None:
        """Reset every connection open now (RST, not FIN: as a middlebox dropping it)."""
        with self._lock:
            victims = list(self._open)
        for sock in victims:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the accepting thread (close alone won't)
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self.cut()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(POLL)  # out of descriptors, an aborted handshake: not the end
                continue
            try:
                upstream = socket.create_connection((self.host, self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, upstream}
            for src, dst, sent in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, sent), daemon=True).start()

    def _sprung(self, data: bytes) -> None:
        """Run the trap's action if `data` (a command on its way) carries its patterns."""
        with self._lock:
            trap = self._trap
            if trap is None or not all(p in data for p in trap[0]):
                return
            self._trap = None
        trap[1]()

    def _pump(self, src: socket.socket, dst: socket.socket, sent: bool) -> None:
        try:
            while True:
                while self.mode == "partition":
                    time.sleep(POLL)
                data = src.recv(CHUNK)
                if not data:
                    break
                while self.mode == "partition":  # read before the partition: held too
                    time.sleep(POLL)
                if self.mode == "latency":
                    time.sleep(self.delay)
                if sent:
                    self._sprung(data)
                elif self.mode == "lose_replies":
                    break  # dropped, and the connection with it
                dst.sendall(data)
        except OSError:
            pass  # a reset (cut) or the other side gone: this connection is over
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.close()
            with self._lock:
                self._open -= {src, dst}
