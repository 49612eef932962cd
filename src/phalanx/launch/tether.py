"""A connection from each agent to node 0 that carries nothing but the agent's node rank, once: when the
agent's process dies, its kernel closes the connection and node 0 knows at once. The heartbeats on the store
(rendezvous.Liveness) find every loss, but only after ``resilience.node_timeout_s``; a tether finds a dead
agent, or a machine whose network stack answers with a reset, in well under a second. A frozen node
(SIGSTOP, a hung kernel) or one cut off without a reset keeps its end open: that is the heartbeats'. (The
other way needs no tether: an agent's next call on node 0's store fails at once when node 0's process died.)

Node 0 listens on one more port of the rendezvous address (a free one, published in the run's record).
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time

HELLO = struct.Struct("!ii")  # the agent's node rank and incarnation, its only message
SELECT_S = 0.2  # how often node 0's thread looks whether it is stopped


class Tethers:
    """Node 0's end: accepts each agent's tether and notes when one closes (``cut``: (node, incarnation) ->
    when; an agent started again on a lost node's machine is the node's next incarnation)."""

    def __init__(self, addr: str):
        self._listener = socket.create_server((addr, 0), family=socket.AF_INET6 if ":" in addr else socket.AF_INET)
        self.port: int = self._listener.getsockname()[1]
        self.cut: dict[tuple[int, int], float] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tethers", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            for key, _ in self._selector.select(SELECT_S):
                if key.fileobj is self._listener:
                    conn, _ = self._listener.accept()
                    conn.setblocking(False)
                    self._selector.register(conn, selectors.EVENT_READ, b"")
                else:
                    self._read(key)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _read(self, key: selectors.SelectorKey) -> None:
        conn: socket.socket = key.fileobj  # type: ignore[assignment]
        try:
            data = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # closed: the agent's process is gone, or its machine reset the connection
            if isinstance(key.data, tuple):
                self.cut[key.data] = time.monotonic()
            self._selector.unregister(conn)
            conn.close()
        elif isinstance(key.data, bytes) and len(said := key.data + data) >= HELLO.size:
            self._selector.modify(conn, selectors.EVENT_READ, HELLO.unpack(said[: HELLO.size]))
        elif isinstance(key.data, bytes):
            self._selector.modify(conn, selectors.EVENT_READ, said)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(2 * SELECT_S + 1.0)


def tie(addr: str, port: int, node: int, incarnation: int, timeout_s: float) -> socket.socket:
    """An agent's end of its tether to node 0 at ``addr:port``: kept open for as long as the agent lives."""
    sock = socket.create_connection((addr, port), timeout=timeout_s)
    sock.sendall(HELLO.pack(node, incarnation))
    return sock
