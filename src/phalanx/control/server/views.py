"""What a job's run directories say, for the API: progress, logs, events, metrics, goodput, checkpoints. The
server is not in the data path: the job's supervisor writes these files, the server only reads them."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.checkpoint import CheckpointDir
from phalanx.control import scheduler as core
from phalanx.control.server import speeds
from phalanx.control.server.models import (
    JobStory,
    KindSpeeds,
    LogChunk,
    Restart,
    SpeedTable,
    Spend,
    Stop,
    TenantSpend,
    Usage,
    UsageReport,
)
from phalanx.control.store import FINAL, Execution, Job, NotFound, Scope, month_start
from phalanx.obs.digest import digest
from phalanx.obs.events import read_jsonl
from phalanx.obs.goodput import CATEGORIES
from phalanx.obs.rundir import RunDir

LOG_CHUNK = 1 << 20


def run_dirs(scope: Scope, job: Job) -> list[tuple[int, RunDir]]:
    """The job's run directories, by execution (attempt), oldest first."""
    return [(e.attempt, RunDir(Path(e.run_dir))) for e, _ in scope.executions(job) if e.run_dir]


def progress(job: Job, runs: list[tuple[int, RunDir]]) -> tuple[int | None, int | None]:
    """(steps done, steps in all) as rank 0's metrics last said, from the newest execution that said it; the
    total from the recipe's spec or the script's own report."""
    total = job.total_steps
    for _, run in reversed(runs):
        last = last_line(run.metrics)
        if last is not None:
            return int(last["step"]) + 1, last.get("total_steps") or total
    return None, total


def logs(job: Job, runs: list[tuple[int, RunDir]], rank: int | None, execution: int | None, offset: int) -> LogChunk:
    """Up to 1 MiB of ``rank``'s log (None: the supervisor's) in one execution (default: the latest), from byte
    ``offset``."""
    latest = runs[-1][0] if runs else None
    execution = latest if execution is None else execution
    run = dict(runs).get(execution) if execution is not None else None
    if run is None and execution is not None and execution != latest:
        raise NotFound("execution", execution)
    world = job.nodes * (job.gpus // job.workers)  # spare nodes hold no rank of their own
    if rank is not None and rank >= world:
        raise NotFound("rank", rank, f"job {job.id} has {world} rank(s): 0 to {world - 1}")
    ranks = log_ranks(run)
    path = None if run is None else run.supervisor_log if rank is None else run.log(rank)
    size = path.stat().st_size if path is not None and path.is_file() else 0
    data = b""
    if path is not None and offset < size:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(LOG_CHUNK)
    return LogChunk(
        rank=rank, execution=execution, latest=latest, offset=offset, next_offset=offset + len(data), size=size,
        text=data.decode(errors="replace"), job_ended=job.state in FINAL, ranks=ranks,
    )  # fmt: skip


def log_ranks(run: RunDir | None) -> list[int]:
    """The ranks that have a log in ``run``."""
    return sorted(int(p.name.split("-")[1].split(".")[0]) for p in run.logs.glob("rank-*.log")) if run else []


def events(runs: list[tuple[int, RunDir]]) -> list[dict[str, Any]]:
    return [{"execution": n, **e} for n, run in runs if run.events.is_file() for e in read_jsonl(run.events)]


def metrics(runs: list[tuple[int, RunDir]]) -> list[dict[str, Any]]:
    return [{"execution": n, **m} for n, run in runs if run.metrics.is_file() for m in read_jsonl(run.metrics)]


def goodput(runs: list[tuple[int, RunDir]]) -> dict[str, Any]:
    """Each execution's ledger, and their sum (the job's wall time outside executions, queued, is not in it)."""
    per = []
    total = dict.fromkeys(CATEGORIES, 0.0)
    for n, run in runs:
        if (said := digest(run)) is None:
            continue
        book = said.ledger
        per.append({"execution": n, **book.to_json()})
        for name, seconds in book.seconds.items():
            total[name] += seconds
    wall = sum(p["wall_s"] for p in per)
    return {"executions": per, "wall_s": wall, "goodput": total["productive"] / wall if wall else 0.0, "seconds": total}


def story(runs: list[tuple[int, RunDir]]) -> JobStory:
    """The job's restarts, emergency checkpoints and resumptions, from its runs' digests (read again only when
    a run's files changed)."""
    restarts, stops, resumed, last = [], [], {}, None
    for n, run in runs:
        if (said := digest(run)) is None:
            continue
        restarts += [Restart(execution=n, **dataclasses.asdict(r)) for r in said.resumptions]
        stops += [Stop(execution=n, at=at, checkpoint_step=step) for at, step in said.emergency_saves]
        if said.first_step is not None and n != runs[0][0]:
            resumed[n] = said.first_step
        last = said if said.steps_done is not None else last
    ledger = goodput(runs)
    return JobStory(
        restarts=restarts, stops=stops, resumed=resumed, steps_done=last.steps_done if last else None,
        last_loss=last.last_loss if last else None, goodput=ledger["goodput"] if ledger["wall_s"] else None,
    )  # fmt: skip


def checkpoints(job: Job) -> list[dict[str, Any]]:
    if job.checkpoint_dir is None:
        return []
    found = CheckpointDir(job.checkpoint_dir)
    return [
        {"step": step, "location": found.location(step), "problem": found.verify(step), "bytes": found.size(step)}
        for step in found.steps()
    ]


def usage(scope: Scope, since: float, now: float) -> UsageReport:
    """GPU-hours from ``since`` to now, allocated (GPUs x time held) and productive (GPUs x the goodput ledger's
    productive time), the dollars they cost and the tokens trained on, per tenant and per job; an execution
    that overlaps ``since`` counts in proportion."""
    tenants: dict[str, list[float]] = defaultdict(lambda: [0.0] * 4)
    jobs: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * 4)
    for e, job_id in scope.executions(since=since):
        end = e.ended_at if e.ended_at is not None else now
        held = max(0.0, end - e.started_at)
        inside = max(0.0, end - max(e.started_at, since))
        share = inside / held if held > 0 else 0.0
        productive_s, tokens = _figures(e)
        figures = (e.gpus * inside / 3600, e.gpus * productive_s * share / 3600, e.dollars(since, now), tokens * share)
        for row in (tenants[e.tenant], jobs[(e.tenant, job_id)]):
            for i, value in enumerate(figures):
                row[i] += value
    return UsageReport(
        since=since,
        until=now,
        tenants=[_usage(t, None, figures) for t, figures in sorted(tenants.items())],
        jobs=[_usage(t, j, figures) for (t, j), figures in jobs.items()],
    )


def _usage(tenant: str, job: str | None, figures: list[float]) -> Usage:
    allocated, productive, dollars, tokens = figures
    return Usage(
        tenant=tenant, job=job, allocated_gpu_hours=allocated, productive_gpu_hours=productive, dollars=dollars,
        tokens=tokens, dollars_per_million_tokens=dollars / tokens * 1e6 if tokens > 0 else None,
    )  # fmt: skip


def spend(scope: Scope, now: float) -> Spend:
    """This calendar month's dollars per visible tenant against its budget, and the fleet's."""
    since = month_start(now)
    money = scope.spend(since, now)
    rows = []
    for tenant in scope.tenants():
        dollars, per_h = money.get(tenant.name, (0.0, 0.0))
        budget = tenant.monthly_budget
        rows.append(
            TenantSpend(
                tenant=tenant.name,
                dollars=dollars,
                monthly_budget=budget,
                left=None if budget is None else budget - dollars,
                over_budget=budget is not None and dollars >= budget,
                dollars_per_h=per_h,
            )
        )
    return Spend(
        month_start=since, until=now, dollars=sum(r.dollars for r in rows),
        budgets=sum(r.monthly_budget for r in rows if r.monthly_budget is not None),
        dollars_per_h=sum(r.dollars_per_h for r in rows), tenants=rows,
    )  # fmt: skip


def speed_table(scope: Scope, types: Mapping[str, core.GpuType]) -> SpeedTable:
    """The speed table, learned from the store, for the kinds of the caller's jobs (an admin's: every kind)."""
    table = speeds.learned(scope.session, types)
    rows = []
    for kind in scope.kinds():
        relative = table.relative(kind, list(types))
        measured = table.measured.get(kind, {})
        rows.append(KindSpeeds(
            kind=kind, relative=relative, measured=[t for t in types if t in measured],
            tokens_per_gpu_s={t: table.rate(kind, t) for t in types} if measured else {},  # else only a ratio
            fastest=max(relative, key=relative.__getitem__),
        ))  # fmt: skip
    return SpeedTable(types=list(types), kinds=rows)


def _figures(e: Execution) -> tuple[float, float]:
    """(productive seconds, tokens) of an execution: as kept when it ended; else as its run's files say (a
    running one's so far, or one that ended before both were kept)."""
    if e.productive_s is not None and e.tokens is not None:
        return e.productive_s, e.tokens
    said = digest(RunDir(Path(e.run_dir))) if e.run_dir else None
    if said is None:
        return e.productive_s or 0.0, e.tokens or 0.0
    return said.ledger.seconds["productive"], said.tokens_run


def last_line(path: Path) -> dict[str, Any] | None:
    """The last complete JSON line of a file being appended to (metrics.jsonl), read from its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue  # a line being written
    return None
