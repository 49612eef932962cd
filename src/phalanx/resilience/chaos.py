"""Fault injection into a running job (``phalanx chaos``), to see recovery work before production needs it.

    kill     SIGKILL a rank (a crash, the OOM killer, a lost node)
    hang     SIGSTOP a rank and leave it stopped (a hung collective); the hang detector must find it
    slow     stop and continue a rank in turns for a while (a straggler: a slow device or host)
    nan      make the next step's loss NaN (through the job's c10d store; resilience.on_nan applies)
    corrupt  flip a byte in the newest committed checkpoint (latest_valid() must skip it)

Faults reach the job's current attempt, found in its run directory's events.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from dataclasses import dataclass

from torch.distributed import TCPStore

from phalanx.checkpoint import CheckpointDir
from phalanx.obs import RunDir, read_jsonl
from phalanx.spec import load_spec
from phalanx.train.sdk import CHAOS_NAN_KEY

FAULTS = ("kill", "hang", "slow", "nan", "corrupt")


class ChaosError(RuntimeError):
    pass


@dataclass(frozen=True)
class Attempt:
    number: int
    pids: dict[int, int]
    port: int


def current_attempt(run: RunDir) -> Attempt:
    if not run.events.is_file():
        raise ChaosError(f"{run.root} is not a run directory (no {run.events.name})")
    events = list(read_jsonl(run.events))
    if any(e["kind"] == "run_finished" for e in events):
        raise ChaosError(f"the run in {run.root} has finished")
    started = [e for e in events if e["kind"] == "attempt_started"]
    if not started:
        raise ChaosError(f"the run in {run.root} has not started its workers yet")
    last = started[-1]
    return Attempt(last["attempt"], {int(r): int(p) for r, p in last["pids"].items()}, int(last["rendezvous_port"]))


def wait_for_step(run: RunDir, step: int, timeout_s: float) -> None:
    """Return once the run has reported ``step`` (1-based: steps completed), in any attempt."""
    deadline = time.monotonic() + timeout_s
    while True:
        if run.metrics.is_file() and any(m["step"] + 1 >= step for m in read_jsonl(run.metrics)):
            return
        if time.monotonic() > deadline:
            raise ChaosError(f"the run in {run.root} did not reach step {step} within {timeout_s:g} s")
        time.sleep(0.05)


def inject(run: RunDir, fault: str, rank: int, slow_s: float = 10.0) -> str:
    """Inject ``fault`` into the run's current attempt; returns what was done, in words."""
    if fault == "corrupt":
        return _corrupt_newest_checkpoint(run)
    attempt = current_attempt(run)
    if fault == "nan":
        store = TCPStore("127.0.0.1", attempt.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        store.set(CHAOS_NAN_KEY, "1")
        return f"asked attempt {attempt.number} for a NaN loss at its next step"
    if rank not in attempt.pids:
        raise ChaosError(f"--rank {rank}: the job has ranks 0..{len(attempt.pids) - 1}")
    pid = attempt.pids[rank]
    if fault == "kill":
        os.kill(pid, signal.SIGKILL)
        return f"killed rank {rank} (pid {pid}) with SIGKILL"
    if fault == "hang":
        os.kill(pid, signal.SIGSTOP)
        return f"stopped rank {rank} (pid {pid}) with SIGSTOP; it stays stopped"
    if fault == "slow":
        deadline = time.monotonic() + slow_s
        while time.monotonic() < deadline:  # half the time stopped: the rank runs at about half speed
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.05)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
        return f"slowed rank {rank} (pid {pid}) to about half speed for {slow_s:g} s"
    raise ChaosError(f"unknown fault {fault!r}; faults: {', '.join(FAULTS)}")


def _corrupt_newest_checkpoint(run: RunDir) -> str:
    spec = load_spec(run.spec)
    checkpoints = CheckpointDir(spec.checkpoint.dir or run.checkpoints)
    committed = [s for s in checkpoints.steps() if checkpoints.committed(s)]
    if not committed:
        raise ChaosError(f"no committed checkpoint in {checkpoints}")
    step = committed[-1]
    names = sorted(checkpoints.manifest(step)["files"].items(), key=lambda item: item[1]["size"])
    name = names[-1][0]
    path = f"{checkpoints.path(step)}/{name}"
    data = bytearray(checkpoints.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    checkpoints.fs.pipe_file(path, bytes(data))
    return f"flipped a byte in the middle of {checkpoints.location(step)}/{name}"
