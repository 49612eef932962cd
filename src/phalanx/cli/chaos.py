"""``phalanx chaos``: fault injection into a running job, to see recovery work before production needs it.

    kill     SIGKILL a rank (a crash, the OOM killer, a lost node)
    hang     SIGSTOP a rank and leave it stopped (a hung collective); the hang detector must find it
    slow     stop and continue a rank in short turns for a while (a straggler: a slow device or host)
    nan      make the next step's loss NaN (through the job's c10d store; resilience.on_nan applies)
    spike    make the next step's loss spike (one rank's loss times 10; resilience.on_nan applies)
             (both strike rank 0's loss; with a pipeline, whose rank 0 may compute none, the step's as reported)
    corrupt  flip a byte in the newest committed checkpoint (latest_valid() must skip it)

Faults reach the job's current attempt, found in its run directory's events. It is a tool of the command
line, from outside the job: it reads the run directory and reaches the attempt's store, as any user could.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from phalanx.cli.common import err
from phalanx.obs import RunDir, read_jsonl
from phalanx.obs.events import Event
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
    if RunDir(path).events.is_file() or RunDir(path).spec.is_file():
        return RunDir(path)
    if not path.is_dir() and path.parent.name != "runs":
        raise ChaosError(
            f"{path}: no such run directory. Give a run directory (runs/<name>/<run id>), or runs/<name> to "
            "strike its newest run (waiting for one to start); a job a phalanx server runs has its runs under the "
            "server's data directory: <data-dir>/jobs/<job id>/attempt-<n>/runs/<name>/"
        )
    deadline = time.monotonic() + timeout_s
    while True:
        going = [RunDir(d) for d in sorted(path.iterdir())] if path.is_dir() else []
        going = [r for r in going if r.events.is_file() and not _finished(list(read_jsonl(r.events)))]
        if going:
            return going[-1]
        if time.monotonic() > deadline:
            raise ChaosError(f"no run of {path} started within {timeout_s:g} s")
        time.sleep(0.05)


def current_attempt(run: RunDir) -> Attempt:
    if not run.events.is_file():
        raise ChaosError(f"{run.root} is not a run directory (no {run.events.name})")
    events = list(read_jsonl(run.events))
    if _finished(events):
        raise ChaosError(f"the run in {run.root} has finished")
    started = [e for e in events if e["kind"] == Event.ATTEMPT_STARTED]
    if not started:
        raise ChaosError(f"the run in {run.root} has not started its workers yet")
    last = started[-1]
    # In-process recoveries of the attempt put warm spares in dead ranks' places: the newest pids are theirs.
    recovered = [e for e in events if e["kind"] == Event.RECOVERY_STARTED and e["attempt"] == last["attempt"]]
    pids = {int(r): int(p) for r, p in (recovered[-1] if recovered else last)["pids"].items()}
    return Attempt(last["attempt"], pids, last["rendezvous_addr"], int(last["rendezvous_port"]))


def _finished(events: list[dict]) -> bool:
    return any(e["kind"] == Event.RUN_FINISHED for e in events)


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
        from torch.distributed import TCPStore

        from phalanx.obs.protocol import CHAOS_LOSS_KEY

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
    from phalanx.checkpoint import CheckpointDir

    spec = load_spec(run.spec)
    checkpoints = CheckpointDir(spec.checkpoint.dir or run.checkpoints)
    step = checkpoints.newest_committed()
    if step is None:
        raise ChaosError(f"no committed checkpoint in {checkpoints}")
    names = sorted(checkpoints.manifest(step)["files"].items(), key=lambda item: item[1]["size"])
    name = names[-1][0]
    path = f"{checkpoints.path(step)}/{name}"
    data = bytearray(checkpoints.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    checkpoints.fs.pipe_file(path, bytes(data))
    return f"flipped a byte in the middle of {checkpoints.location(step)}/{name}"


def chaos(
    run: Path = typer.Argument(
        ..., help="a running job's run directory (runs/<name>/<run id>), or runs/<name>: its newest running run"
    ),
    fault: str = typer.Argument(..., help="kill | hang | slow | nan | spike | corrupt"),
    rank: int | None = typer.Option(None, help="the rank to strike (default: one at random)"),
    at_step: str | None = typer.Option(
        None, "--at-step", help="wait until the job has done this many steps; A-B: a step drawn from A to B"
    ),
    seed: int | None = typer.Option(None, help="seed of the random rank, to repeat a chaos run"),
    slow_s: float = typer.Option(10.0, "--slow-s", help="how long `slow` keeps the rank slow"),
    slow_speed: float = typer.Option(0.5, "--slow-speed", help="the share of its speed `slow` leaves the rank"),
    timeout_s: float = typer.Option(600.0, "--timeout-s", help="how long to wait for the run and for --at-step"),
) -> None:
    """Inject a fault into a running job: kill or hang a rank, slow it down, poison a step with NaN or a loss
    spike, or corrupt the newest checkpoint. Recovery is the job's: watch it in the run's output and events."""
    import random

    if fault not in FAULTS:
        err.print(f"[bold red]unknown fault[/] {fault!r}; faults: {', '.join(FAULTS)}", highlight=False)
        raise typer.Exit(2)
    draw = random.Random(seed)
    if fault in ("nan", "spike"):  # they reach the job through its store: torch, imported before the wait, for
        import torch.distributed  # noqa: F401 -- its seconds of import would come after the step waited for
    try:
        check_slow_speed(slow_speed)
        target = running_run(run, timeout_s)
        if at_step is not None:
            low, _, high = at_step.partition("-")
            if not (low.isdigit() and (high.isdigit() or not high)):
                err.print(f"[bold red]--at-step {at_step}[/]: give a step (20) or a range (10-30)", highlight=False)
                raise typer.Exit(2)
            wait_for_step(target, draw.randint(int(low), int(high or low)), timeout_s)
        if rank is None and fault in RANK_FAULTS:
            rank = draw.randrange(len(current_attempt(target).pids))
        done = inject(target, fault, rank if rank is not None else 0, slow_s, slow_speed)
    except ChaosError as e:
        err.print(f"[bold red]cannot inject[/]: {e}", highlight=False)
        raise typer.Exit(1) from None
    err.print(done, highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(chaos)
