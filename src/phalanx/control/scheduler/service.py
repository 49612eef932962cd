"""Attained service, as discretised two-dimensional LAS counts it (Tiresias, NSDI'19): the GPU-time a job has
run since its last reset decides its level, 0 (new, or short so far) or 1. The counters are those of its
authors' simulator (SymbioticLab/Tiresias, simulator/run_sim.py, dlas-gpu), replayed over the job's runs:
time pending counts once the job has run, and a job of the second level pending ``knob`` times its executed
time has both reset to zero, which puts it back in the first level until it has run its threshold again.
``starve_s`` resets it also after that long pending, whatever it executed (Tiresias has no such bound: a job
that ran for days then waits for days)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.control.scheduler.jobs import Job


@dataclass(frozen=True)
class Levels:
    threshold_gpu_s: float  # GPU-time executed since the last reset that moves a job to level 1
    promote_knob: float  # pending this many times its executed time: reset, back to level 0
    starve_s: float = math.inf  # pending this long: reset too

    def executed_s(self, job: Job, until: float) -> float:
        """Seconds the job has run since its last reset, as of ``until`` (while pending since its last run)."""
        executed = pending = 0.0
        ended = None
        for started, stopped in (*job.ran, (until, until)):
            if ended is not None and executed > 0 and started > ended:
                pending += started - ended
                promoted = pending >= self.promote_knob * executed or pending >= self.starve_s
                if executed * job.gpus >= self.threshold_gpu_s and promoted:
                    executed = pending = 0.0
            executed += stopped - started
            ended = stopped
        return executed

    def level(self, job: Job, now: float, started: float | None = None) -> int:
        """0 or 1: the level by GPU-time executed since the last reset, a running job's current run (since
        ``started``) included."""
        if not job.ran and started is None:
            return 0  # never ran: the common case of a long queue, without replaying anything
        executed = self.executed_s(job, now if started is None else started)
        return int(job.gpus * (executed + (now - started if started is not None else 0.0)) >= self.threshold_gpu_s)
