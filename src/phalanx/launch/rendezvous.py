"""The job's rendezvous: a c10d TCPStore that node 0's agent hosts and every agent joins, and the keys they
talk through. No socket protocol of our own: every exchange is a JSON value set on a key of the store
(PrefixStore ``phalanx/``), read by polling, and liveness is a counter each side keeps adding to (and a
connection that says nothing, whose closing finds a dead process at once: launch/tether.py). Every call
another node makes on the store is bounded (``Bounded``): node 0 frozen or cut off is found as surely as node 0
gone.

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
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from torch.distributed import PrefixStore, Store, TCPStore

BEAT_S = 0.5  # how often each side adds to its liveness counter


def attempt_key(attempt: int, name: str, node: int | None = None) -> str:
    """The key of one attempt's exchange: attempt/<a>/<name>, or attempt/<a>/<node>/<name> for a node's."""
    return f"attempt/{attempt}/" + (f"{node}/{name}" if node is not None else name)


class RendezvousLost(RuntimeError):
    """The store (node 0's agent) did not answer."""


T = TypeVar("T")


class Bounded:
    """Makes calls on a thread of its own and waits at most ``bound_s`` for each. A c10d store client waits for
    a reply with no bound of its own: the kernel of a host that is frozen (or cut off without a reset) still
    accepts the request, and the client's ``recv`` waits forever; ``Store.set_timeout`` bounds only the wait
    for a key to appear. A call past its bound raises RendezvousLost and is left to its thread; so is every
    later call, at once: that connection is never used again."""

    def __init__(self, bound_s: float):
        self.bound_s = bound_s
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._stuck: str | None = None
        threading.Thread(target=self._serve, name="store-calls", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, done = self._calls.get()
            try:
                done.set_result(call())
            except BaseException as e:  # handed to the caller, whatever it is
                done.set_exception(e)

    def __call__(self, call: Callable[[], T], bound_s: float | None = None) -> T:
        if self._stuck is not None:
            raise RendezvousLost(self._stuck)
        done: Future[T] = Future()
        self._calls.put((call, done))
        bound = self.bound_s if bound_s is None else bound_s
        try:
            return done.result(bound)
        except TimeoutError:
            self._stuck = f"the store at its host did not answer within {bound:g} s"
            raise RendezvousLost(self._stuck) from None


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
    """JSON values on the job's store. Any store error (the host gone) is raised as RendezvousLost, and so is
    a call not answered within ``bound``'s bound (None: the store is this process's own, node 0's)."""

    def __init__(self, store: Store, bound: Bounded | None = None):
        self.store = PrefixStore("phalanx/", store)
        self._bound = bound

    @classmethod
    def join(cls, addr: str, port: int, wait_s: float, bound_s: float) -> Rendezvous:
        """Join the store at ``addr:port``, waiting up to ``wait_s`` for it to come up; each call after that is
        bounded by ``bound_s``, and so is a wait for the connection past ``wait_s``."""
        bound = Bounded(bound_s)
        with cls._lost():
            store = bound(lambda: join_store(addr, port, wait_s), wait_s + bound_s)
        store.set_timeout(datetime.timedelta(seconds=bound_s))  # a wait for a key, too
        return cls(store, bound)

    def _call(self, call: Callable[[], T]) -> T:
        with self._lost():
            return call() if self._bound is None else self._bound(call)

    def put(self, key: str, value: Any) -> None:
        self._call(lambda: self.store.set(key, json.dumps(value)))

    def get(self, key: str) -> Any | None:
        """The value at ``key``, or None if it is not set."""
        raw = self._call(lambda: self.store.get(key) if self.store.check([key]) else None)
        return json.loads(raw) if raw is not None else None

    def has(self, key: str) -> bool:
        return self._call(lambda: self.store.check([key]))

    def add(self, key: str, amount: int = 1) -> int:
        return self._call(lambda: self.store.add(key, amount))

    def counters(self, keys: list[str]) -> list[int | None]:
        return self._call(lambda: [int(self.store.get(k)) if self.store.check([k]) else None for k in keys])

    @staticmethod
    @contextlib.contextmanager
    def _lost():
        try:
            yield
        except RendezvousLost:
            raise
        except RuntimeError as e:  # DistNetworkError, DistStoreError, "Connection reset by peer"
            raise RendezvousLost(str(e).splitlines()[0]) from None


class Heartbeat:
    """Adds to ``key`` every BEAT_S from a thread of its own, on a connection of its own, so that a side busy
    stopping its workers (up to a grace period) still looks alive. Stops at the first store error: the
    main loop finds the same error on its own next call."""

    def __init__(self, connect: Callable[[], Rendezvous], key: str):
        """``connect()``: the rendezvous on a new connection."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(connect, key), name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self, connect: Callable[[], Rendezvous], key: str) -> None:
        try:
            rdzv = connect()
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
