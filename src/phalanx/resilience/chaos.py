"""Fault injection into a running job (``phalanx chaos``), to see recovery work before production needs it.

    kill     SIGKILL a rank (a crash, the OOM killer, a lost node)
    hang     SIGSTOP a rank and leave it stopped (a hung collective); the hang detector must find it
    slow     stop and continue a rank in short turns for a while (a straggler: a slow device or host)
    nan      make the next step's loss NaN (through the job's c10d store; resilience.on_nan applies)
    spike    make the next step's loss spike (one rank's loss times 10; resilience.on_nan applies)
             (both strike rank 0's loss; with a pipeline, whose rank 0 may compute none, the step's as reported)
    corrupt  flip a byte in the newest committed checkpoint (latest_valid() must skip it)

Faults reach the job's current attempt, found in its run directory's events.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from torch.distributed import TCPStore

from phalanx.checkpoint import CheckpointDir
from phalanx.obs import RunDir, read_jsonl
from phalanx.obs.protocol import CHAOS_LOSS_KEY
from phalanx.spec import load_spec

RANK_FAULTS = ("kill", "hang", "slow")  # the faults that strike one rank
SLOW_TURN_S = 0.01  # a slowed rank is stopped, then runs, within each turn this long
FAULTS = (*RANK_FAULTS, "nan", "spike", "corrupt")
TAKE_TIMEOUT_S = 60.0  # how long a loss fault may wait for the job's next step


class ChaosError(RuntimeError):
    pass


@dataclass(frozen=True)
class Attempt:
    number: int
    pids: dict[int, int]
    addr: str  # the attempt's worker store
    port: int


def running_run(path: Path, timeout_s: float) -> RunDir:
    """``path`` if it is a run directory; if it is a job's directory of runs (runs/<name>), its newest run
    still going, waiting up to ``timeout_s`` for one to start (so chaos can be armed before the job)."""
    if (path / "events.jsonl").is_file() or (path / "spec.yaml").is_file():
        return RunDir(path)
    deadline = time.monotonic() + timeout_s
    while True:
        going = [RunDir(d) for d in sorted(path.iterdir()) if (d / "events.jsonl").is_file()] if path.is_dir() else []
        going = [r for r in going if not any(e["kind"] == "run_finished" for e in read_jsonl(r.events))]
        if going:
            return going[-1]
        if time.monotonic() > deadline:
            raise ChaosError(f"no run of {path} started within {timeout_s:g} s")
        time.sleep(0.05)


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
    # In-process recoveries of the attempt put warm spares in dead ranks' places: the newest pids are theirs.
    recovered = [e for e in events if e["kind"] == "recovery_started" and e["attempt"] == last["attempt"]]
    pids = {int(r): int(p) for r, p in (recovered[-1] if recovered else last)["pids"].items()}
    return Attempt(last["attempt"], pids, last["rendezvous_addr"], int(last["rendezvous_port"]))


def wait_for_step(run: RunDir, step: int, timeout_s: float) -> None:
    """Return once the run has reported ``step`` (1-based: steps completed), in any attempt."""
    deadline = time.monotonic() + timeout_s
    while True:
        if run.metrics.is_file() and any(m["step"] + 1 >= step for m in read_jsonl(run.metrics)):
            return
        if time.monotonic() > deadline:
            raise ChaosError(f"the run in {run.root} did not reach step {step} within {timeout_s:g} s")
        time.sleep(0.05)


def check_slow_speed(speed: float) -> None:
    if not 0 < speed < 1:
        raise ChaosError(f"--slow-speed {speed:g}: the share of its speed the rank keeps, above 0 and below 1")


def inject(run: RunDir, fault: str, rank: int, slow_s: float = 10.0, slow_speed: float = 0.5) -> str:
    """Inject ``fault`` into the run's current attempt; returns what was done, in words."""
    if fault == "corrupt":
        return _corrupt_newest_checkpoint(run)
    attempt = current_attempt(run)
    if fault in ("nan", "spike"):
        store = TCPStore(attempt.addr, attempt.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        store.set(CHAOS_LOSS_KEY, fault)
        what = "a NaN loss" if fault == "nan" else "a loss spike"
        deadline = time.monotonic() + TAKE_TIMEOUT_S
        while store.check([CHAOS_LOSS_KEY]):  # rank 0 deletes the key when it poisons its step
            if time.monotonic() > deadline:
                raise ChaosError(f"attempt {attempt.number} did not take {what} within {TAKE_TIMEOUT_S:g} s")
            time.sleep(0.01)
        return f"attempt {attempt.number} took {what} at its next step"
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
        check_slow_speed(slow_speed)
        # stopped and continued in turns short against a step, so every step's compute slows alike (turns of 50 ms
        # struck a step's forward pass in some steps only, and the rank's median compute hid them)
        deadline = time.monotonic() + slow_s
        while time.monotonic() < deadline:
            os.kill(pid, signal.SIGSTOP)
            time.sleep((1 - slow_speed) * SLOW_TURN_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(slow_speed * SLOW_TURN_S)
        return f"slowed rank {rank} (pid {pid}) to about {slow_speed:.0%} of its speed for {slow_s:g} s"
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
