"""The worker processes of one attempt on this node.

Each worker runs in its own session (process group), so a signal reaches it and any processes it started
(data-loader workers, compile workers), and a Ctrl-C at the terminal reaches only the supervisor, which
forwards it once. Output is merged per rank and teed, line by line, to the rank's log file and to the
console with a rank prefix. A worker dies with the agent that started it (Linux's parent-death signal), as it
would with its machine: a worker outliving its agent would go on writing to the job's run directory and
checkpoints beside the next attempt.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from phalanx.launch.lifetime import die_with_parent

if TYPE_CHECKING:
    from phalanx.launch.zygote import Forked


@dataclass
class Worker:
    rank: int
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | Forked | None = None
    exited_at: float | None = None  # monotonic time the exit was seen, to order failures
    spare: int | None = None  # a warm spare of in-process recovery, until it is given ``rank``
    _pump: threading.Thread | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"spare{self.spare}" if self.spare is not None else f"rank{self.rank}"

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.exited_at is not None and self.proc else None


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class WorkerGroup:
    def __init__(self, workers: Sequence[Worker], show: Callable[[str], None]):
        """``show``: puts a line of output on the console (safe from any thread)."""
        self.workers = list(workers)
        self._show = show

    def start(self, header: str) -> None:
        for w in self.workers:
            self.start_one(w, header)

    def start_one(self, w: Worker, header: str, forked: Forked | None = None) -> None:
        """Start ``w`` (or take on ``forked``, its process the zygote forked) and tee its output."""
        with w.log_path.open("ab") as log:
            log.write(f"===== {header} =====\n".encode())
        w.proc = forked or subprocess.Popen(
            w.argv,
            env=dict(w.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()) if sys.platform == "linux" else None,
        )
        w._pump = threading.Thread(target=self._pump, args=(w,), name=f"{w.name}-output", daemon=True)
        w._pump.start()
        threading.Thread(target=self._reap, args=(w,), name=f"{w.name}-reaper", daemon=True).start()

    @staticmethod
    def _reap(w: Worker) -> None:
        """Record the moment the worker exits: the first of several failures is the root cause."""
        assert w.proc is not None
        w.proc.wait()
        w.exited_at = time.monotonic()

    def _pump(self, w: Worker) -> None:
        """Tee the worker's output until every holder of its pipe has closed it; into the log of the rank it
        is (a spare's own log until it takes a rank's place)."""
        assert w.proc is not None and w.proc.stdout is not None
        path, log = w.log_path, w.log_path.open("ab")
        try:
            for raw in w.proc.stdout:
                if w.log_path != path:
                    log.close()
                    path, log = w.log_path, w.log_path.open("ab")
                log.write(raw)
                log.flush()
                self._show(f"[{w.name}]: " + raw.decode(errors="replace").rstrip("\n"))
        finally:
            log.close()

    def exited(self) -> list[Worker]:
        """Workers whose exit has been seen, earliest first."""
        done = [w for w in self.workers if w.exited_at is not None]
        return sorted(done, key=lambda w: w.exited_at or 0.0)

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.exited_at is None]

    def send(self, sig: int) -> None:
        for w in self.running():
            assert w.proc is not None
            with contextlib.suppress(ProcessLookupError):  # it exited between the check and the signal
                os.killpg(w.proc.pid, sig)

    def send_each(self, sig: int) -> None:
        """Send ``sig`` to each running worker process alone, not to the processes it started."""
        for w in self.running():
            assert w.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, sig)

    def stop(self, sig: int, grace_s: float, abort: Callable[[], bool] = lambda: False) -> None:
        """Send ``sig`` to every running worker, give them ``grace_s`` (or until ``abort()``), then SIGKILL the rest."""
        self.send(sig)
        deadline = time.monotonic() + grace_s
        while self.running() and time.monotonic() < deadline and not abort():
            time.sleep(0.05)
        if self.running():
            self.send(signal.SIGKILL)
        self.join()
        self._end_leftovers()

    def _end_leftovers(self) -> None:
        """What a worker started outlives it when it is killed (Megatron's checkpoint writer leaves a process
        pool and its resource tracker): each worker's session, whose id is its pid, is ended with it. Once every
        worker is reaped, an id still in use is its session's: the kernel gives no new process an id that a
        session still holds, and hands a freed one out again only after going round its whole range."""
        for w in self.workers:
            assert w.proc is not None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, signal.SIGKILL)

    def join(self) -> None:
        """Wait for every worker to exit and for its output to be written out."""
        for w in self.workers:
            assert w.proc is not None
            w.proc.wait()
            if w._pump is not None:
                w._pump.join(timeout=5.0)  # a grandchild that left the session may hold the pipe; don't wait on it
