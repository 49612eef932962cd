"""The processes the launcher starts (workers, spares, the zygote, local agents) end with the thread that
started them, through Linux's parent-death signal armed before exec; and the launcher's own SIGINT and SIGTERM
are recorded for its loop to act on, not to die of. A bottom module that all of them use."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Iterator

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In the forked child, before exec: SIGKILL this process when the thread that started it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent was already gone before the signal was armed
        os._exit(1)


@contextlib.contextmanager
def recorded_signals(into: list[int]) -> Iterator[None]:
    """Append each SIGINT and SIGTERM to ``into`` instead of dying on it (the loop forwards or hands it on);
    restore the handlers after."""
    caught = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, _frame: into.append(signum)) for sig in caught}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
