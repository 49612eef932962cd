"""The processes the launcher starts (workers, spares, the zygote, local agents) end with the thread that
started them, through Linux's parent-death signal armed before exec; a bottom module that all of them use."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In the forked child, before exec: SIGKILL this process when the thread that started it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent was already gone before the signal was armed
        os._exit(1)
