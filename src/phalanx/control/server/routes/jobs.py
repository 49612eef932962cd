"""Jobs: submit, list, cancel, and what their runs left (logs, events, metrics, goodput, checkpoints)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import Query

from phalanx.control.server import lifecycle, views
from phalanx.control.server.deps import MAX_INT, ServerDep, Token
from phalanx.control.server.models import JobEvents, JobOut, JobStory, LogChunk, SubmitIn, TransitionOut
from phalanx.control.server.routes import router as _router
from phalanx.control.store import ACTIVE, Job, JobState, Scope

router = _router()


@router.post("/api/v1/jobs", status_code=201, tags=["jobs"])
def submit_job(body: SubmitIn, server: ServerDep, token: Token) -> JobOut:
    with server.scope(token, write=True) as caller:
        submission = lifecycle.Submission(body.spec, body.priority, body.tenant, body.workdir, body.resume_from)
        job = lifecycle.submit(
            caller, submission, server.jobs_dir, server.types, time.time(), server.unit, server.shares
        )
        queued = _job_out(caller, job, detail=False)
    server.wake()  # after the commit: the loop must see the job
    return queued


@router.get("/api/v1/jobs", tags=["jobs"])
def list_jobs(
    server: ServerDep,
    token: Token,
    state: Annotated[list[JobState] | None, Query(description="only jobs in these states")] = None,
    tenant: Annotated[str | None, Query(max_length=63)] = None,
    owner: Annotated[str | None, Query(max_length=63)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    after: Annotated[int, Query(ge=0, le=MAX_INT, description="a job's seq: the page after it")] = 0,
) -> list[JobOut]:
    with server.scope(token) as caller:
        jobs = caller.jobs(state or (), tenant, owner, limit, after)
        return [_job_out(caller, job, detail=job.state in ACTIVE) for job in jobs]


@router.get("/api/v1/jobs/{job_id}", tags=["jobs"])
def get_job(job_id: str, server: ServerDep, token: Token) -> JobOut:
    with server.scope(token) as caller:
        return _job_out(caller, caller.job(job_id), detail=True)


@router.post("/api/v1/jobs/{job_id}/cancel", tags=["jobs"])
def cancel_job(job_id: str, server: ServerDep, token: Token) -> JobOut:
    with server.scope(token, write=True) as caller:
        job = caller.job(job_id, for_update=True)
        lifecycle.cancel(caller, job, time.time())
        cancelling = _job_out(caller, job, detail=False)
    server.wake()
    return cancelling


@router.get("/api/v1/jobs/{job_id}/logs", tags=["jobs"])
def job_logs(
    job_id: str,
    server: ServerDep,
    token: Token,
    rank: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    execution: Annotated[int | None, Query(ge=1, le=MAX_INT, description="default: the latest")] = None,
    offset: Annotated[int, Query(ge=0, le=2**62, description="bytes already read")] = 0,
    supervisor: Annotated[bool, Query(description="the supervisor's log (its lines, progress, summary)")] = False,
) -> LogChunk:
    with server.scope(token) as caller:
        job = caller.job(job_id)
        return views.logs(job, views.run_dirs(caller, job), None if supervisor else rank, execution, offset)


@router.get("/api/v1/jobs/{job_id}/events", tags=["jobs"])
def job_events(job_id: str, server: ServerDep, token: Token) -> JobEvents:
    with server.scope(token) as caller:
        job = caller.job(job_id)
        transitions = [TransitionOut.model_validate(t) for t in caller.transitions(job)]
        return JobEvents(transitions=transitions, events=views.events(views.run_dirs(caller, job)))


@router.get("/api/v1/jobs/{job_id}/metrics", tags=["jobs"])
def job_metrics(job_id: str, server: ServerDep, token: Token) -> list[dict[str, Any]]:
    with server.scope(token) as caller:
        job = caller.job(job_id)
        return views.metrics(views.run_dirs(caller, job))


@router.get("/api/v1/jobs/{job_id}/goodput", tags=["jobs"])
def job_goodput(job_id: str, server: ServerDep, token: Token) -> dict[str, Any]:
    with server.scope(token) as caller:
        job = caller.job(job_id)
        return views.goodput(views.run_dirs(caller, job))


@router.get("/api/v1/jobs/{job_id}/story", tags=["jobs"])
def job_story(job_id: str, server: ServerDep, token: Token) -> JobStory:
    with server.scope(token) as caller:
        job = caller.job(job_id)
        return views.story(views.run_dirs(caller, job))


@router.get("/api/v1/jobs/{job_id}/checkpoints", tags=["jobs"])
def job_checkpoints(job_id: str, server: ServerDep, token: Token) -> list[dict[str, Any]]:
    with server.scope(token) as caller:
        return views.checkpoints(caller.job(job_id))


def _job_out(caller: Scope, job: Job, detail: bool) -> JobOut:
    out = JobOut.model_validate(job)
    if detail:
        out.steps_done, out.total_steps = views.progress(job, views.run_dirs(caller, job))
    return out
