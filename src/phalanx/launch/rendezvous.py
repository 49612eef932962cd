"""The job's rendezvous: a c10d TCPStore that node 0's agent hosts and every agent joins, and the keys they
talk through. No socket protocol of our own: every exchange is a JSON value set on a key of the store
(PrefixStore ``phalanx/``), read by polling, and liveness is a counter each side keeps adding to.

    run                        node 0: the run directory, the spec's digest, the job's shape
    agent/<n>                  agent n joined: its address, host name and pid (or why it cannot run)
    agent/<n>/claim            counter: the first agent to claim node rank n has it
    agent/<n>/beat             counter: agent n is alive
    agent/<n>/signal           agent n was sent SIGINT/SIGTERM: node 0 stops the job with it
    agent/<n>/finished         agent n saw the job's end and exits
    coordinator/beat           counter: node 0 is alive
    attempt/<a>/plan           the attempt: which nodes run workers, in group-rank order (launch/node.py)
    attempt/<a>/<n>/started    node n started its workers: their pids by rank
    attempt/<a>/<n>/exit       node n's first failed rank ({rank, returncode}), or {rank: null}: all exited 0
    attempt/<a>/dump           every node: send SIGUSR1 (stack dump) to each worker
    attempt/<a>/stop           every node: stop the workers ({signal, grace_s})
    attempt/<a>/kill           every node: the grace is over, SIGKILL now
    attempt/<a>/<n>/stopped    node n's workers have all exited: their exit codes by rank
    finished                   the job is over: {exit_code, reason}
"""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
import threading
import time
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore

BEAT_S = 0.5  # how often each side adds to its liveness counter


def attempt_key(attempt: int, name: str, node: int | None = None) -> str:
    """The key of one attempt's exchange: attempt/<a>/<name>, or attempt/<a>/<node>/<name> for a node's."""
    return f"attempt/{attempt}/" + (f"{node}/{name}" if node is not None else name)


class RendezvousLost(RuntimeError):
    """The store (node 0's agent) did not answer."""


def host_store(addr: str, port: int, timeout_s: float) -> TCPStore:
    """A TCPStore server listening on ``addr`` only (TCPStore alone binds every interface), so that agents of
    one machine can each have their own loopback address. ``port`` 0: a free one."""
    listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((addr, port))
    except OSError as e:
        listener.close()
        raise OSError(f"cannot listen on {addr}:{port}: {e.strerror}") from None
    listener.listen(1024)
    port = listener.getsockname()[1]
    return TCPStore(
        addr,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),  # the store owns the socket from here, and closes it
    )


def join_store(addr: str, port: int, timeout_s: float) -> TCPStore:
    """A client of the store at ``addr:port``; waits up to ``timeout_s`` for it to come up."""
    return TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class Rendezvous:
    """JSON values on the job's store. Any store error (the host gone, or not answering within the store's
    timeout) is raised as RendezvousLost."""

    def __init__(self, store: Store):
        self.store = PrefixStore("phalanx/", store)

    def put(self, key: str, value: Any) -> None:
        with self._lost():
            self.store.set(key, json.dumps(value))

    def get(self, key: str) -> Any | None:
        """The value at ``key``, or None if it is not set."""
        with self._lost():
            return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def has(self, key: str) -> bool:
        with self._lost():
            return self.store.check([key])

    def add(self, key: str, amount: int = 1) -> int:
        with self._lost():
            return self.store.add(key, amount)

    def counters(self, keys: list[str]) -> list[int | None]:
        with self._lost():
            return [int(self.store.get(k)) if self.store.check([k]) else None for k in keys]

    @staticmethod
    @contextlib.contextmanager
    def _lost():
        try:
            yield
        except RuntimeError as e:  # DistNetworkError, DistStoreError, "Connection reset by peer"
            raise RendezvousLost(str(e).splitlines()[0]) from None


class Heartbeat:
    """Adds to ``key`` every BEAT_S from a thread of its own, on a connection of its own, so that a side busy
    stopping its workers (up to a grace period) still looks alive. Stops at the first store error: the
    main loop finds the same error on its own next call."""

    def __init__(self, connect, key: str):
        """``connect()``: a new client of the store."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(connect, key), name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self, connect, key: str) -> None:
        try:
            rdzv = Rendezvous(connect())
            while not self._stop.is_set():
                rdzv.add(key)
                self._stop.wait(BEAT_S)
        except (RendezvousLost, RuntimeError):
            return

    def stop(self) -> None:
        self._stop.set()


class Liveness:
    """When each watched counter last changed, by this machine's clock (clocks are never compared across
    machines). ``timeout_s`` bounds how late a side that is gone is found: its counter moved at most a beat
    (and a poll) before it died, so it is declared gone once unchanged for ``timeout_s - BEAT_S``, which finds
    it between ``timeout_s - 2 x BEAT_S`` and ``timeout_s`` after its death."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.silence_s = timeout_s - BEAT_S
        self._seen: dict[Any, tuple[int | None, float]] = {}

    def observe(self, who: Any, counter: int | None, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        last = self._seen.get(who)
        if last is None or last[0] != counter:
            self._seen[who] = (counter, now)

    def forget(self, who: Any) -> None:
        self._seen.pop(who, None)

    def silent_s(self, who: Any, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return now - self._seen[who][1] if who in self._seen else 0.0

    def gone(self, now: float | None = None) -> list[Any]:
        """Who has been silent for too long."""
        return [who for who in self._seen if self.silent_s(who, now) > self.silence_s]
