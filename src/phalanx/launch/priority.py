"""A warm spare's share of the CPU: the least while it starts beside training, a rank's once it takes a rank.

Every worker runs in its own session, and with the kernel's autogroup scheduling a session weighs as its
autogroup does, whatever its processes' nice values: on a 2-core host, a busy loop at nice 19 in a session of
its own cut two busy processes' throughput by 40%; at its autogroup's nice 19, not measurably. The
autogroup's own nice value (``/proc/<pid>/autogroup``) sets that weight. Any user may set it between 0 and
19 on their own processes, but, without CAP_SYS_ADMIN, once per 100 ms on the whole host (EAGAIN otherwise):
hence the retries.
"""

from __future__ import annotations

import time
from pathlib import Path

LOWEST, NORMAL = 19, 0
RETRY_S, TRIES = 0.02, 50


def set_session_nice(pid: int, nice: int) -> bool:
    """Set the nice value of ``pid``'s session (its autogroup); False where it cannot be (no autogroups in
    this kernel, the process gone, or the host's rate limit outlasting the retries)."""
    for _ in range(TRIES):
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
            return True
        except BlockingIOError:
            time.sleep(RETRY_S)
        except OSError:
            return False
    return False
