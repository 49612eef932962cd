"""What a framework's training loop tells phalanx, in one call a step (``StepLoop.done``): the step's figures
(heartbeat for the hang and straggler detectors, rank 0's metrics for the progress line, the dashboard and the
goodput ledger), a checkpoint when one is due, and on SIGTERM (a preemption, a cancel, Slurm's time limit) a
checkpoint and a stop within ``resilience.stop_grace_s``, as the recipe's own trainer does."""

from __future__ import annotations

import signal
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from phalanx.checkpoint.framework import FrameworkCheckpoints, Read, Write
from phalanx.obs.events import Event
from phalanx.obs.metrics import mfu, peak_flops, peak_memory_bytes
from phalanx.spec.model import Checkpoint
from phalanx.train.sdk import WorkerContext


class StepLoop:
    """A framework's loop under phalanx: ``resume()`` once, then ``done(step, loss)`` after each optimizer step."""

    def __init__(
        self, ctx: WorkerContext, write: Write, read: Read, about: dict[str, Any], tokens_per_step: int,
        flops_per_token: float | None = None, total_steps: int | None = None,
    ):  # fmt: skip
        """``write``/``read``: the framework's own save and load of a step's checkpoint; ``tokens_per_step``: the
        global batch's tokens; ``flops_per_token`` (forward and backward), where known, gives MFU."""
        policy = ctx.spec.checkpoint if ctx.spec is not None else Checkpoint()
        if policy.every_steps == "auto":  # the recipe times its own saves for it
            raise ValueError("checkpoint.every_steps: auto is the built-in recipe's; give a framework's job a number")
        root = ctx.checkpoint_location() if ctx.spec is not None else "checkpoints"  # plain `python`: ./checkpoints
        self.ctx, self.write, self.read, self.every = ctx, write, read, policy.every_steps
        self.checkpoints = FrameworkCheckpoints(root, policy, about, log=self._say, event=ctx.event)
        self.tokens_per_step, self.flops_per_token, self.total_steps = tokens_per_step, flops_per_token, total_steps
        precision = ctx.spec.train.precision if ctx.spec is not None and ctx.spec.train is not None else "bf16"
        self.peak = peak_flops(ctx.device, precision, None)
        self.stop_asked_at: float | None = None
        self._last_end: float | None = None
        self._checkpoint_s = 0.0
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def resume(self) -> tuple[int, dict[str, Any]]:
        """The newest checkpoint that verifies, loaded: (its step, its client state); (0, {}) with none."""
        found = self.checkpoints.load_newest(self.read)
        self._last_end = time.perf_counter()
        if found is None:
            return 0, {}
        step, client = found
        self._say(f"resumed from {self.checkpoints.dir.path(step)} at step {step}")
        return step, client

    def done(self, step: int, loss: float, **figures: Any) -> None:
        """After the optimizer step that made ``step`` steps done: report, checkpoint when due; on SIGTERM (any
        rank's: every rank learns it here) checkpoint and exit as a process stopped by SIGTERM does."""
        now = time.perf_counter()
        took = now - self._last_end if self._last_end is not None else None
        stop = torch.tensor(float(self.stop_asked_at is not None), device=self.ctx.device)  # NCCL: on the device
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        report: dict[str, Any] = {"loss": loss, "checkpoint_s": self._checkpoint_s, **figures}
        if took is not None:
            per_device = self.tokens_per_step / took / self.ctx.world_size
            report |= {"step_time_s": took, "tokens_per_s": self.tokens_per_step / took}
            if self.flops_per_token is not None:
                report["mfu"] = mfu(self.flops_per_token, per_device, self.peak)
        report["peak_memory_bytes"] = peak_memory_bytes(self.ctx.device)
        if self.total_steps is not None:
            report["total_steps"] = self.total_steps
        self.ctx.report(step - 1, **report)  # a step's record is its index, as the recipe's are
        self._checkpoint_s, self._last_end = 0.0, now  # a save below is in the next step's time, as the recipe's
        if stop.item() > 0:
            self._save_and_stop(step)
        if step % self.every == 0 or step == self.total_steps:
            self._checkpoint_s = self.checkpoints.save(step, self.write)

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        self.stop_asked_at = time.monotonic()

    def _save_and_stop(self, step: int) -> NoReturn:
        self.checkpoints.save(step, self.write)
        since = time.monotonic() - self.stop_asked_at if self.stop_asked_at is not None else 0.0
        grace = self.ctx.spec.resilience.stop_grace_s if self.ctx.spec is not None else None
        print(
            f"rank {self.ctx.rank} stopped by SIGTERM: emergency checkpoint of step {step} committed {since:.1f} s "
            f"after the signal" + (f" (grace {grace:g} s)" if grace is not None else ""),
            flush=True,
        )
        self.ctx.event(Event.PREEMPTED, step=step, saved_after_s=since)
        raise SystemExit(128 + signal.SIGTERM)

    def _say(self, message: str) -> None:
        if self.ctx.is_main:
            print(message, flush=True)
