"""The per-node supervisor: start the workers, watch them, stop them, say how the job ended.

Why not torch.distributed.elastic's agent (LocalElasticAgent, what torchrun runs)? We evaluated it and use
its protocols but not its control loop:
- its monitor loop restarts on every failure alike, with no room to classify failures (a user's import error
  should not be retried, a lost node should), to watch heartbeats for hangs, to dump every rank's stacks
  before a kill, or to shrink the world by our own policy; all of that is phalanx's job (resilience/);
- its process layer (elastic.multiprocessing.PContext) installs process-wide signal handlers, closes workers
  with a fixed SIGTERM and 30 s on any failure, and tees output by polling log files.
What we keep from torch.distributed, so that a plain torchrun script runs unchanged: the supervisor hosts a
c10d TCPStore per attempt and workers join it through the agent-store protocol
(TORCHELASTIC_USE_AGENT_STORE, MASTER_ADDR/PORT), the torchrun environment variables, and the elastic error
file (TORCHELASTIC_ERROR_FILE, written by ``@record``) for a rank's root cause.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import json
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from torch.distributed import TCPStore

from phalanx.launch.workers import Worker, WorkerGroup, describe_exit
from phalanx.obs import EventLog
from phalanx.obs.console import Console
from phalanx.obs.goodput import write_ledger
from phalanx.obs.plot import plot_loss
from phalanx.obs.progress import Progress, step_line
from phalanx.obs.rundir import RunDir
from phalanx.obs.summary import summary
from phalanx.resilience import Failure, HangDetector, Kind, Stall, StragglerDetector, backoff_s, classify_exit, hang
from phalanx.resilience.elastic import FAILURES_TO_EXCLUDE, Capacity, resized
from phalanx.resilience.straggler import WINDOW as STRAGGLER_WINDOW
from phalanx.spec import JobSpec, SpecError, dump_spec
from phalanx.train.sdk import HEARTBEAT_KEY

POLL_S = 0.1  # how often exits and signals are checked: a crash is seen within this
HANG_CHECK_S = 0.5  # how often the heartbeats are read
STACK_DUMP_S = 2.0  # how long hung workers get to write their stacks before they are killed
REGROW = Failure(Kind.INFRASTRUCTURE, "stopped to grow back")  # not a failure: the attempt ends on purpose


class Outcome(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class RunResult:
    outcome: Outcome
    exit_code: int  # 0 succeeded, 1 a worker failed, 128 + signal when stopped by a signal
    reason: str
    run_dir: str
    failed_rank: int | None = None
    restarts: int = 0


class LaunchError(RuntimeError):
    """The job cannot start on this machine as specified (not a failure of the job itself)."""


def resolve_device(requested: str, procs_per_node: int) -> str:
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        have = torch.cuda.device_count()
        if have < procs_per_node:
            raise LaunchError(
                f"resources.device = cuda with procs_per_node = {procs_per_node}, but this machine has {have} "
                f"CUDA device(s); use procs_per_node <= {have} or device: cpu"
            )
    return requested


def worker_argv(spec: JobSpec) -> list[str]:
    """What each worker runs; ``python`` in a command means this interpreter, as a venv user expects."""
    if spec.command is None:
        return [sys.executable, "-m", "phalanx.train.main"]
    head, *rest = spec.command
    return [sys.executable, *rest] if head in ("python", "python3") else list(spec.command)


class Supervisor:
    def __init__(self, spec: JobSpec, runs_root: str | Path, console: TextIO = sys.stdout):
        """Check the job can start here, then create its run directory under ``runs_root``."""
        if spec.resources.nodes != 1:
            raise LaunchError(
                f"resources.nodes = {spec.resources.nodes}: `phalanx run` runs one node on this machine; "
                "use nodes: 1 (multi-node jobs need a cluster executor, which phalanx does not have yet)"
            )
        self.spec = spec
        self.device = resolve_device(spec.resources.device, spec.resources.procs_per_node)
        self.run_dir = RunDir.create(runs_root, spec.name)
        self.console = Console(console)
        self.progress = Progress(self.run_dir.metrics, spec.train.steps if spec.train is not None else None)
        self.started = time.monotonic()
        self.restarts = 0
        self.events = EventLog(self.run_dir.events)
        self._signals: list[int] = []
        self.hangs = HangDetector(spec.resilience.hang_timeout_s)
        r = spec.resilience
        self.capacity = Capacity(spec.resources.procs_per_node, r.allow_shrink, r.min_procs, r.regrow_after_s)
        self.attempt_spec, self.attempt_spec_path = spec, self.run_dir.spec  # what the next attempt runs
        self.stragglers = StragglerDetector(spec.resilience.straggler_factor)

    def say(self, message: str) -> None:
        self.console.line(f"[phalanx] {message}")

    def _show_progress(self) -> None:
        """New steps: on a terminal into the live status line; elsewhere as a line each."""
        for record in self.progress.poll():
            if not self.console.live:
                self.console.line(step_line(record, self.progress.total_steps))
        self.console.status(self.progress.status(time.monotonic() - self.started, self.restarts))

    def run(self) -> RunResult:
        self.run_dir.spec.write_text(dump_spec(self.spec))
        self.events.emit(
            "run_started",
            run_id=self.run_dir.run_id,
            world_size=self.spec.resources.world_size,
            device=self.device,
            argv=worker_argv(self.spec),
        )
        with self._forwarded_signals():
            try:
                result = self._attempts()
            finally:
                self._show_progress()
                self.console.end_status()
        self.events.emit("run_finished", **asdict(result))
        self.run_dir.result.write_text(json.dumps(asdict(result), indent=2) + "\n")
        ledger = write_ledger(self.run_dir)
        try:
            plot = plot_loss(self.run_dir)
        except Exception as e:  # a plot is a convenience: it never fails a run that ran
            self.say(f"no loss curve: {type(e).__name__}: {e}")
            plot = None
        self.console.show(summary(self.run_dir, ledger, self.progress.latest, self.progress.total_steps, plot))
        return result

    def _attempts(self) -> RunResult:
        """Run attempts until one succeeds, a signal stops the job, or a failure is not worth retrying
        (a user error, or the restart budget is spent). Each restart resumes from the last valid checkpoint."""
        policy = self.spec.resilience
        attempt = restarts = 0
        while True:
            result, failure = self._attempt(attempt)
            attempt += 1
            result = replace(result, restarts=restarts)
            if failure is None:
                return result
            if failure is REGROW:
                self._regrow(attempt)
                continue
            if not failure.retryable:
                self.say(f"not restarting: {failure.why}")
                return replace(result, reason=f"{result.reason} (a user error: not retried)")
            if restarts >= policy.max_restarts:
                self.say(f"not restarting: all {policy.max_restarts} restart(s) of resilience.max_restarts used")
                return replace(result, reason=f"{result.reason} (after {restarts} restart(s))")
            restarts = self.restarts = restarts + 1
            self._maybe_shrink(result.failed_rank, attempt)
            wait = backoff_s(restarts, policy.restart_backoff_s)
            self.say(f"restart {restarts}/{policy.max_restarts} in {wait:g} s, from the last valid checkpoint")
            self.events.emit(
                "restart_scheduled",
                restart=restarts,
                backoff_s=wait,
                failure=failure.kind,
                cause=failure.why,
                reason=result.reason,
            )
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and not self._signals:
                time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
            if self._signals:
                name = signal.Signals(self._signals[0]).name
                self.say(f"stopped by {name} before restarting")
                stopped = RunResult(Outcome.STOPPED, 128 + self._signals[0], f"stopped by {name}", result.run_dir)
                return replace(stopped, restarts=restarts)

    def _maybe_shrink(self, failed_rank: int | None, attempt: int) -> None:
        """With allow_shrink, leave out the slot whose rank keeps failing first; later attempts run without it."""
        slot = self.capacity.after_failure(failed_rank)
        if slot is None:
            return
        procs = len(self.capacity.slots)
        try:
            self.attempt_spec = resized(self.spec, procs)
        except SpecError as e:
            self.capacity.keep(slot)
            self.say(f"cannot shrink to {procs} process(es): {'; '.join(map(str, e.issues))}; keeping all of them")
            return
        self.attempt_spec_path = self.run_dir.root / f"spec.attempt-{attempt}.yaml"
        self.attempt_spec_path.write_text(dump_spec(self.attempt_spec))
        self.say(
            f"shrinking to {procs} process(es) without local slot {slot}: its rank failed first in "
            f"{FAILURES_TO_EXCLUDE} attempts in a row (spec of the next attempts: {self.attempt_spec_path})"
        )
        self.events.emit("shrunk", slot=slot, slots=self.capacity.slots, procs=procs)

    def _regrow(self, attempt: int) -> None:
        back = self.capacity.regrow()
        self.attempt_spec, self.attempt_spec_path = self.spec, self.run_dir.spec
        self.say(
            f"growing back to {self.capacity.full} process(es) with slot(s) {back}; a slot that fails first again "
            "is left out at once"
        )
        self.events.emit("grown", slots=back, procs=self.capacity.full, attempt=attempt)

    def _stop_to_regrow(self, group: WorkerGroup) -> tuple[RunResult, Failure]:
        """Stop a shrunk attempt that has trained for regrow_after_s (SIGTERM: the recipe checkpoints first)."""
        self.say(
            f"{len(group.workers)} process(es) trained for {self.capacity.regrow_after_s:g} s since the shrink: "
            f"stopping them (SIGTERM, they checkpoint) to try all {self.capacity.full} again"
        )
        self.events.emit("regrow_stop", procs=len(group.workers), after_s=self.capacity.regrow_after_s)
        group.stop(signal.SIGTERM, self.spec.resilience.stop_grace_s)
        return RunResult(Outcome.STOPPED, 0, "stopped to grow back", str(self.run_dir.root)), REGROW

    def _attempt(self, attempt: int) -> tuple[RunResult, Failure | None]:
        store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300)
        )
        group = WorkerGroup(self._workers(attempt, store.port), self.console.line)
        self.say(
            (f"run {self.run_dir.run_id}" if attempt == 0 else f"attempt {attempt}")
            + f": {len(group.workers)} worker(s) on {self.device}, logs in {self.run_dir.logs}"
        )
        group.start(header=f"attempt {attempt}")
        self.events.emit(
            "attempt_started",
            attempt=attempt,
            rendezvous_port=store.port,
            pids={w.rank: w.proc.pid for w in group.workers if w.proc},
        )
        self.hangs.reset()
        self.stragglers.reset()
        next_hang_check = time.monotonic()
        while True:
            self._show_progress()
            if self._signals:
                return self._stop_on_signal(group), None
            failed = [w for w in group.exited() if w.returncode != 0]
            if failed:
                return self._stop_on_failure(group, failed[0], store)
            if not group.running():
                group.join()
                self.say(f"succeeded: all {len(group.workers)} worker(s) exited with code 0")
                return RunResult(Outcome.SUCCEEDED, 0, "all workers exited with code 0", str(self.run_dir.root)), None
            if time.monotonic() >= next_hang_check:
                next_hang_check = time.monotonic() + HANG_CHECK_S
                if (stall := self._stalled(store, group)) is not None:
                    return self._stop_on_hang(group, stall)
                if self._regrow_due():
                    return self._stop_to_regrow(group)
            time.sleep(POLL_S)

    def _regrow_due(self) -> bool:
        """A shrunk attempt has trained (reported steps) for regrow_after_s, and has steps left to train."""
        wait, since = self.capacity.regrow_after_s, self.hangs.first_progress
        if not self.capacity.shrunk or wait is None or since is None or time.monotonic() - since < wait:
            return False
        train, step = self.spec.train, self.hangs.latest_step
        return train is None or step is None or step + 1 < train.steps

    def _stalled(self, store: TCPStore, group: WorkerGroup) -> Stall | None:
        """Read the heartbeats: report a straggler if one appeared; return the hang if there is one."""
        now = time.monotonic()
        for w in group.workers:
            if (beat := last_heartbeat(store, w.rank)) is not None:
                self.hangs.observe(w.rank, beat["step"], now)
                if beat.get("compute_s") is not None:
                    self.stragglers.observe(w.rank, beat["step"], beat["compute_s"])
        if (slow := self.stragglers.check()) is not None:
            node = f"node 0 ({socket.gethostname()})"
            self.say(
                f"rank {slow.rank} on {node} is a straggler: {slow.compute_s * 1e3:.1f} ms of compute per step, "
                f"{slow.ratio:.2f}x the other ranks' {slow.others_s * 1e3:.1f} ms (median of the last "
                f"{STRAGGLER_WINDOW} steps); every step waits for it"
            )
            self.events.emit("straggler", rank=slow.rank, node=node, compute_s=slow.compute_s, others_s=slow.others_s)
        return self.hangs.stalled(now)

    def _stop_on_hang(self, group: WorkerGroup, stall: Stall) -> tuple[RunResult, Failure]:
        """Dump every rank's Python stacks into the run directory, then kill them all: a collective stalled on
        a peer cannot be aborted in place."""
        failure = hang(stall)
        self.say(
            f"rank {stall.rank} {failure.why}; dumping every rank's Python stacks to "
            f"{self.run_dir.logs}/rank-<r>.stacks.txt, then killing the workers"
        )
        group.send_each(signal.SIGUSR1)
        time.sleep(STACK_DUMP_S)
        group.stop(signal.SIGKILL, 0)
        stacks = [str(self.run_dir.stacks(w.rank)) for w in group.workers if self.run_dir.stacks(w.rank).is_file()]
        self.events.emit(
            "hang_detected",
            rank=stall.rank,
            step=stall.step,
            silent_s=stall.silent_s,
            timeout_s=stall.timeout_s,
            stacks=stacks,
        )
        reason = f"rank {stall.rank} {failure.why}"
        self.say(f"failed: {reason}")
        return RunResult(Outcome.FAILED, 1, reason, str(self.run_dir.root), failed_rank=stall.rank), failure

    def _workers(self, attempt: int, port: int) -> list[Worker]:
        spec = self.attempt_spec
        res = spec.resources
        devices = {}  # after a shrink on CUDA: rank r runs on the device of slot slots[r]
        if self.device == "cuda" and len(self.capacity.slots) < self.spec.resources.procs_per_node:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            names = visible.split(",") if visible else [str(i) for i in range(self.spec.resources.procs_per_node)]
            devices["CUDA_VISIBLE_DEVICES"] = ",".join(names[slot] for slot in self.capacity.slots)
        base = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get(
                "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // res.procs_per_node))
            ),
            **spec.env,
            **devices,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(res.world_size),
            "LOCAL_WORLD_SIZE": str(res.procs_per_node),
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": str(res.nodes),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(res.world_size),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": self.run_dir.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(self.spec.resilience.max_restarts),
            "PYTHONUNBUFFERED": "1",
            "PHALANX_RUN_ID": self.run_dir.run_id,
            "PHALANX_RUN_DIR": str(self.run_dir.root),
            "PHALANX_SPEC": str(self.attempt_spec_path),
            "PHALANX_ATTEMPT": str(attempt),
            "PHALANX_DEVICE": self.device,
        }
        workers = []
        for local_rank in range(res.procs_per_node):
            rank = local_rank  # node 0 of 1
            error_file = self.run_dir.error_file(rank)
            error_file.unlink(missing_ok=True)
            env = {
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "ROLE_RANK": str(rank),
                "TORCHELASTIC_ERROR_FILE": str(error_file),
                "PHALANX_STACKS_FILE": str(self.run_dir.stacks(rank)),
            }
            workers.append(Worker(rank, worker_argv(spec), env, self.run_dir.log(rank)))
        return workers

    def _stop_on_failure(self, group: WorkerGroup, first: Worker, store: TCPStore) -> tuple[RunResult, Failure]:
        assert first.proc is not None and first.returncode is not None
        step = last_step(store, first.rank)
        cause = describe_exit(first.returncode) + (f" after step {step}" if step is not None else "")
        detail = recorded_error(self.run_dir.error_file(first.rank))
        failure = classify_exit(first.returncode, detail)
        self.say(f"rank {first.rank} (pid {first.proc.pid}) {cause}; stopping the other workers")
        group.stop(signal.SIGTERM, self.spec.resilience.stop_grace_s)
        others = [
            f"rank {w.rank} {describe_exit(w.returncode)}"
            for w in group.workers
            if w is not first and w.returncode not in (None, 0)
        ]
        self.events.emit(
            "worker_failed",
            rank=first.rank,
            pid=first.proc.pid,
            returncode=first.returncode,
            error=detail or None,
            failure=failure.kind,
            then=others,
        )
        tail = _tail(self.run_dir.log(first.rank), 15)
        self.say(
            f"failed: rank {first.rank} {cause}"
            + (f": {detail}" if detail else "")
            + (f"\n  last lines of {self.run_dir.log(first.rank)}:\n" + tail if tail else "")
        )
        reason = f"rank {first.rank} {cause}" + (f": {detail}" if detail else "")
        return RunResult(Outcome.FAILED, 1, reason, str(self.run_dir.root), failed_rank=first.rank), failure

    def _stop_on_signal(self, group: WorkerGroup) -> RunResult:
        sig = self._signals[0]
        name = signal.Signals(sig).name
        self.say(
            f"received {name}: forwarding it to {len(group.running())} worker(s), "
            f"{self.spec.resilience.stop_grace_s:g} s before SIGKILL (send it again to kill now)"
        )
        self.events.emit("signal_received", signal=name)
        group.stop(sig, self.spec.resilience.stop_grace_s, abort=lambda: len(self._signals) > 1)
        self.say(f"stopped by {name}")
        return RunResult(Outcome.STOPPED, 128 + sig, f"stopped by {name}", str(self.run_dir.root))

    @contextlib.contextmanager
    def _forwarded_signals(self):
        """Record SIGINT/SIGTERM for the loop to forward instead of dying on them; restore the handlers after."""
        caught = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, lambda signum, _frame: self._signals.append(signum)) for sig in caught}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def last_heartbeat(store: TCPStore, rank: int) -> dict[str, Any] | None:
    """The last heartbeat ``rank`` sent through the worker SDK ({step, ts, compute_s}), if it sent any."""
    key = HEARTBEAT_KEY.format(rank=rank)
    return json.loads(store.get(key)) if store.check([key]) else None


def last_step(store: TCPStore, rank: int) -> int | None:
    beat = last_heartbeat(store, rank)
    return beat["step"] if beat is not None else None


def recorded_error(error_file: Path) -> str:
    """The root cause a worker wrote with torch's ``@record`` (elastic error-file format), or ""."""
    try:
        message = json.loads(error_file.read_text()).get("message", "")
    except (OSError, ValueError):
        return ""
    return message.get("message", "") if isinstance(message, dict) else str(message)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in text[-lines:])
