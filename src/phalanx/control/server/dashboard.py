"""What the dashboard's pages show, as JSON: the jobs table, one job in full, the fleet. Computed from the store
and the run directories in the caller's scope (another tenant's job is not found), for the GET routes and for
the live channel (a WebSocket that sends a view again whenever it changed)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from phalanx.control.scheduler import GpuType
from phalanx.control.server import views
from phalanx.control.store import FINAL, Execution, Job, JobState, Scope, user_name
from phalanx.obs.digest import digest
from phalanx.obs.events import BAD_STEPS, FAILURES, RESTARTS, Event
from phalanx.obs.ranks import read_ranks

JOBS_SHOWN = 500  # the newest; the API pages through all of them
UTILISATION_POINTS = 120
MAX_POINTS = 2_000  # steps sent to the job page's charts
SERIES = ("loss", "tokens_per_s", "mfu", "step_time_s", "peak_memory_bytes")


def job_row(caller: Scope, job: Job) -> dict[str, Any]:
    """One row of the jobs table: state, progress, ETA (at the recent pace, as the supervisor's line has it),
    speed, goodput and restarts, as the job last said."""
    runs = views.run_dirs(caller, job)
    done, total = views.progress(job, runs)
    last = views.last_line(runs[-1][1].metrics) if runs else None
    digests = [digest(run) for _, run in runs]
    pace = digests[-1].pace_s if digests and digests[-1] is not None else None
    eta = (total - done) * pace if job.state == JobState.RUNNING and done and total and pace else None
    return {
        "id": job.id,
        "name": job.name,
        "tenant": job.tenant,
        "owner": user_name(job.owner),
        "state": job.state,
        "reason": job.reason,
        "priority": job.priority,
        "gpus": job.gpu_use,
        "submitted_at": job.submitted_at,
        "ended_at": job.ended_at,
        "steps_done": done,
        "total_steps": total,
        "progress": done / total if done is not None and total else None,
        "eta_s": eta,
        "tokens_per_s": (last or {}).get("tokens_per_s"),
        "mfu": (last or {}).get("mfu"),
        "goodput": digests[-1].ledger.goodput if digests and digests[-1] is not None else None,
        "restarts": sum(d.restart_count for d in digests if d is not None) + max(0, len(runs) - 1),
        "preemptions": job.preemptions,
    }


def jobs(caller: Scope) -> dict[str, Any]:
    return {"jobs": [job_row(caller, job) for job in caller.jobs(limit=JOBS_SHOWN, newest_first=True)]}


def job(caller: Scope, job_id: str) -> dict[str, Any]:
    """Everything the job page shows: its row, each step's metrics by execution and attempt, the restarts with
    their causes, the goodput breakdown, the timeline, each rank's memory and GPU use, the ranks that have
    logs, and the stack dumps."""
    found = caller.job(job_id)
    runs = views.run_dirs(caller, found)
    events = views.events(runs)
    marks = [  # the vertical lines of the job's charts: failures seen, restarts, recoveries, bad steps
        {"kind": kind, "execution": e["execution"], "ts": e["ts"]} for e in events if (kind := _mark(e)) is not None
    ]
    steps = [
        {"execution": m["execution"], "step": m["step"], "ts": m["ts"], **{k: m.get(k) for k in SERIES}}
        for m in views.metrics(runs)
    ]
    timeline = [
        {"ts": t.at, "kind": "state", "text": f"{t.from_state or 'new'} -> {t.to_state}: {t.cause}"}
        for t in caller.transitions(found)
    ] + [
        {"ts": e["ts"], "kind": e["kind"], "execution": e["execution"], "text": _describe(e)}
        for e in events
        if e["kind"] != Event.CHECKPOINT_COMMITTED
    ]
    restarts = [
        {"execution": e["execution"], "ts": e["ts"], "cause": e.get("category", "crash"), "reason": e["reason"]}
        for e in events
        if e["kind"] in RESTARTS
    ]
    latest = runs[-1][1] if runs else None
    said = [d for _, run in runs if (d := digest(run)) is not None]
    stepped = [d for d in said if d.steps_done is not None]
    summary = {  # the card atop the page; goodput and restarts are the row's
        "outcome": found.state,
        "reason": found.reason,
        "last_loss": stepped[-1].last_loss if stepped else None,
        "runtime_s": sum(d.ledger.wall_s for d in said),
        "tokens": sum(d.tokens_run for d in said),
        "data": None,  # from object storage: bytes fetched, the wait for them, the cache's hit rate
    }
    if fetching := [d.data for d in said if d.data is not None]:
        summary["data"] = {
            "fetched_bytes": sum(f.fetched_bytes for f in fetching),
            "wait_s": sum(f.wait_s for f in fetching),
            "hit_rate": fetching[-1].hit_rate,
        }
    stacks = {}
    for rank in views.log_ranks(latest):  # a rank's Python stacks, dumped when the job was found hung
        dump = latest.stacks(rank)
        text = dump.read_text(errors="replace").strip() if dump.is_file() else ""
        if text:
            stacks[str(rank)] = text[-20_000:]
    if len(steps) > MAX_POINTS:  # what a chart can show; the API's /metrics has every step
        stride = -(-len(steps) // MAX_POINTS)
        steps = steps[::stride] + ([steps[-1]] if (len(steps) - 1) % stride else [])
    return {
        "job": job_row(caller, found),
        "summary": summary,
        "spec": found.spec,  # resolved at submit: defaults filled in
        "steps": steps,
        "marks": marks,
        "restarts": restarts,
        "goodput": views.goodput(runs),
        "timeline": sorted(timeline, key=lambda e: e["ts"]),
        "ranks": views.log_ranks(latest),
        "per_rank": read_ranks(latest) if latest is not None else [],  # the latest execution's heartbeats
        "stacks": stacks,
        "final": found.state in FINAL,
    }


def fleet(caller: Scope, capacity: int, types: Mapping[str, GpuType], now: float | None = None) -> dict[str, Any]:
    """GPUs in use per tenant against quota and borrowing, the queue with why each job waits, preemptions, the
    GPUs allocated over the last day, this month's spend against the budgets, and the speed table."""
    now = time.time() if now is None else now
    queue = caller.jobs(states=[JobState.PENDING], limit=JOBS_SHOWN)
    since = now - 24 * 3600
    executions = caller.executions(since=since)
    return {
        "capacity": capacity,
        "tenants": [
            {
                "name": load.tenant.name,
                "nominal_gpus": load.tenant.nominal_gpus,
                "borrowing_limit": load.tenant.borrowing_limit,
                "cohort": load.tenant.cohort,
                "gpus_in_use": load.gpus_in_use,
                "preemptions": load.preemptions,
            }
            for load in caller.tenant_loads()
        ],
        "queue": [_queued(j, now) for j in queue],
        "utilisation": _utilisation([e for e, _ in executions], since, now),
        "spend": views.spend(caller, now).model_dump(),
        "speeds": views.speed_table(caller, types).model_dump(),
    }


def _queued(job: Job, now: float) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": job.name,
        "tenant": job.tenant,
        "gpus": job.gpu_use,
        "priority": job.priority,
        "waiting_s": now - job.queued_at,
        "why": job.reason,
    }


def _utilisation(executions: list[Execution], since: float, now: float) -> dict[str, list[float]]:
    """GPUs held in each of UTILISATION_POINTS equal spans from ``since`` to ``now``: the most at any moment
    of the span, and the mean over it (a sample at one moment would miss a busy span between samples)."""
    span = (now - since) / UTILISATION_POINTS
    held = sum(e.gpus for e in executions if e.started_at <= since and (e.ended_at is None or e.ended_at > since))
    changes = sorted(  # after ``since``, in time order; at one moment, ends before starts
        [(e.started_at, e.gpus) for e in executions if e.started_at > since]
        + [(e.ended_at, -e.gpus) for e in executions if e.ended_at is not None and since < e.ended_at <= now]
    )
    starts, most, mean, i = [], [], [], 0
    for b in range(UTILISATION_POINTS):
        begin, end = since + b * span, since + (b + 1) * span
        peak, area, at = held, 0.0, begin
        while i < len(changes) and changes[i][0] < end:
            when, gpus = changes[i]
            area, at = area + held * (when - at), when
            held += gpus
            peak, i = max(peak, held), i + 1
        starts.append(begin)
        most.append(float(peak))
        mean.append((area + held * (end - at)) / span if span > 0 else float(held))
    return {"ts": starts, "max": most, "mean": mean}


def _mark(event: dict[str, Any]) -> str | None:
    """What a run's event marks on the job's charts, if anything (the first attempt of the first execution
    is no restart)."""
    kind = event["kind"]
    if kind in FAILURES:
        return "failure"
    if kind == Event.ATTEMPT_STARTED and (event.get("attempt", 0) > 0 or event["execution"] > 1):
        return "restart"
    if kind == Event.RECOVERY_STARTED:
        return "recovery"
    return "bad" if kind in BAD_STEPS else None


def _describe(event: dict[str, Any]) -> str:
    """An event of the run as a sentence; one phalanx has no sentence for (a script's own), as its fields."""
    e, kind = event, event["kind"]
    said = {
        Event.RUN_STARTED: lambda: "the run started",
        Event.ATTEMPT_STARTED: lambda: f"attempt {e.get('attempt')} began with {len(e.get('pids') or {})} worker(s)",
        Event.WORKER_FAILED: lambda: f"rank {e.get('rank')} failed" + (f": {e['error']}" if e.get("error") else ""),
        Event.HANG_DETECTED: lambda: f"a hang was detected: {e.get('reason') or e.get('cause') or ''}".rstrip(": "),
        Event.NODE_LOST: lambda: f"node {e.get('node')} was lost (silent {e.get('silent_s', 0):.1f} s)",
        Event.RESTART_SCHEDULED: lambda: f"restart {e.get('restart')}: {e.get('reason', '')}",
        Event.RECOVERY_STARTED: lambda: f"recovery {e.get('restart')} in process: {e.get('reason', '')}",
        Event.SIGNAL_RECEIVED: lambda: f"{e.get('signal')} reached the supervisor: checkpoint and stop",
        Event.PREEMPTED: lambda: f"emergency checkpoint of step {e.get('step')} committed",
        Event.BAD_STEP_SKIPPED: lambda: f"bad step {e.get('step')} skipped: {e.get('problem')}",
        Event.BAD_STEP_ROLLBACK: lambda: f"bad step {e.get('step')}: rolled back to step {e.get('to_step')}",
        Event.RUN_FINISHED: lambda: f"the run finished: {e.get('outcome')}: {e.get('reason', '')}",
    }.get(kind)
    if said is not None:
        return said()[:300]
    shown = {k: v for k, v in event.items() if k not in ("ts", "kind", "execution", "argv", "pids")}
    return ", ".join(f"{k}={v}" for k, v in shown.items())[:300]
