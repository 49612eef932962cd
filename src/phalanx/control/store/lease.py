"""The control loop's lease: several server processes may share one database, and exactly one of them runs the
control loop. It holds the lease row until ``expires_at``, renewing it as it works; when the lease lapses (its
holder died, froze or lost the database), another process takes it over with the epoch one higher.

Every write the loop makes first renews the lease in the same transaction (``fence``): an update that matches
only while this process holds the lease at its epoch. So the writes of a holder that froze and woke after a
takeover are refused (``Fenced``), and on PostgreSQL a takeover waits, on the row's lock, for the holder's
transaction in flight: a holder frozen in the middle of one holds the row's lock, so PostgreSQL ends the
session of a loop's transaction left idle for ``IDLE_S`` (``_bounded``), and the takeover goes on. Executor
actions are keyed by (job, attempt), so one that an old holder repeats after a takeover finds the execution
already started. Expiry is read on each process's clock: the servers' clocks must agree to well within the
lease (NTP does)."""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable

from sqlalchemy import Update, select, text, update
from sqlalchemy.orm import Session

from phalanx.control.store.database import Store
from phalanx.control.store.schema import Lease

LOOP = "control-loop"
LEASE_S = 4.0  # by default (phalanx server --lease-s): a takeover within 5 s of a holder's death
IDLE_S = 3  # a loop's transaction idle this long is ended by PostgreSQL: its process froze, or lost its way
LOCK_WAIT_S = 2  # a lease transaction waits this long at most for the row's lock, then tries at the next tick


class Fenced(Exception):
    """This process no longer holds the lease: what it was about to write is refused."""


def holder_name() -> str:
    """This process, as the lease names its holder."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class LoopLease:
    def __init__(self, store: Store, ttl_s: float, holder: str | None = None, clock: Callable[[], float] = time.time):
        if not ttl_s > 0:
            raise ValueError(f"lease of {ttl_s} s: give a positive number of seconds")
        self.store, self.ttl_s, self.clock = store, ttl_s, clock
        self.holder = holder or holder_name()
        self.epoch: int | None = None  # held at this epoch, as far as this process knows

    def hold(self) -> bool:
        """Renew the lease if this process holds it, else take it over if it lapsed. True: held (``epoch``)."""
        with self.store.write() as s:
            _bounded(s)
            if self.epoch is not None and self._renew(s):
                return True
            self.epoch = None
            now = self.clock()
            taken = s.execute(
                update(Lease)
                .where(Lease.name == LOOP, Lease.expires_at <= now)
                .values(holder=self.holder, epoch=Lease.epoch + 1, expires_at=now + self.ttl_s)
            )
            if taken.rowcount == 1:
                self.epoch = s.scalar(select(Lease.epoch).where(Lease.name == LOOP))
        return self.epoch is not None

    def fence(self, s: Session) -> None:
        """In a transaction of the loop's, first: renew the lease, or raise Fenced if this process no longer holds
        it."""
        _bounded(s)
        if self.epoch is None or not self._renew(s):
            held, self.epoch = self.epoch, None
            raise Fenced(f"its write refused: the lease of epoch {held} is no longer this process's, {self.holder}")

    def release(self) -> None:
        """Give the lease up (a server stopping): another process takes the loop over at once, not when it
        would have lapsed."""
        if self.epoch is None:
            return
        with self.store.write() as s:
            _bounded(s)
            s.execute(self._mine().values(expires_at=0.0))
        self.epoch = None

    def _renew(self, s: Session) -> bool:
        """Still this process's at its epoch (lapsed, but taken over by nobody, it still is): renewed."""
        return s.execute(self._mine().values(expires_at=self.clock() + self.ttl_s)).rowcount == 1

    def _mine(self) -> Update:
        """An update of the lease row that matches only while this process holds it at its epoch."""
        return update(Lease).where(Lease.name == LOOP, Lease.holder == self.holder, Lease.epoch == self.epoch)


def _bounded(s: Session) -> None:
    """On PostgreSQL, this transaction's waits bounded: for a lock, and idle between its statements."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text(f"SET LOCAL lock_timeout = '{LOCK_WAIT_S}s'"))
        s.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = '{IDLE_S}s'"))


def leader(s: Session, now: float) -> tuple[str, int] | None:
    """Who holds the loop's lease now, at which epoch; None if nobody does."""
    row = s.get(Lease, LOOP)
    return (row.holder, row.epoch) if row is not None and row.holder and row.expires_at > now else None
