"""A job's states and the only ways between them. Every change is a ``Transition`` row with its cause, written
in the same transaction as the change, so a job's history is complete whatever crashes.

    PENDING -> ADMITTED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
                                   -> PREEMPTED -> PENDING (its checkpoint committed; it resumes from it)
    ADMITTED, RUNNING -> PENDING when the execution was lost (its process gone without a result)
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from phalanx.control.store import FINAL, Job, JobState, Role, Scope, Transition
from phalanx.launch.preflight import preflight
from phalanx.spec import JobSpec, SpecError, SpecIssue, dump_spec, parse_spec

log = logging.getLogger("phalanx.server")

_NEXT: dict[JobState, set[JobState]] = {
    JobState.PENDING: {JobState.ADMITTED, JobState.CANCELLED},
    JobState.ADMITTED: {JobState.RUNNING, JobState.PENDING, JobState.FAILED, JobState.CANCELLED},
    JobState.RUNNING: {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED, JobState.PENDING},
    JobState.PREEMPTED: {JobState.PENDING},
}


class Conflict(Exception):
    """The request does not fit the job's state (cancelling a job that ended, say): 409."""


class Invalid(ValueError):
    """The request is incomplete in a way the schema cannot say (a tenant needed, none given): 422."""


def move(session: Session, job: Job, to: JobState, cause: str, now: float) -> None:
    before = JobState(job.state)
    if to not in _NEXT.get(before, set()):
        raise Conflict(f"job {job.id} is {before}; it cannot become {to}")
    job.state, job.reason = to, cause
    if to in FINAL:
        job.ended_at = now
    _record(session, job, before, to, cause, now)


def _record(session: Session, job: Job, before: JobState | None, to: JobState, cause: str, now: float) -> None:
    """The transition's row, and a line in the server's log: a job's life can be read there too."""
    session.add(Transition(job=job.seq, at=now, from_state=before, to_state=to, cause=cause))
    log.info("job %s (%s, tenant %s): %s -> %s: %s", job.id, job.name, job.tenant, before or "new", to, cause)


@dataclass(frozen=True)
class Submission:
    spec: str | None  # the job spec, YAML as in a file (None: the spec of the job it resumes from)
    priority: int
    tenant: str | None
    workdir: str | None  # None: the resumed job's, or the server's
    resume_from: str | None = None  # a job that ended: the new one goes on from its checkpoints


def gang_shape(spec: JobSpec) -> tuple[int, int]:
    """(workers, GPUs each) the scheduler places: an agent per node, spares included."""
    res = spec.resources
    return res.nodes + res.spare_nodes, res.procs_per_node


def submit(
    scope: Scope,
    sub: Submission,
    jobs_dir: Path,
    types: dict[str, int],
    now: float,
    unit: str = "GPUs",
    shares: bool = True,
) -> Job:
    """Validate and queue a job, new or going on from a job that ended (``resume_from``: its checkpoints, and
    by default its spec and directory); ``types``: the cluster's GPUs of each type; ``shares``: whether its
    executor runs shares of a GPU (``resources.gpu_fraction``). Raises SpecError (every
    issue, with its field path), NotFound for a tenant or job the caller cannot see, Forbidden for a viewer,
    Conflict for resuming a job still going."""
    who = scope.who
    before = scope.job(sub.resume_from) if sub.resume_from is not None else None  # another tenant's: not found
    name = sub.tenant or (before.tenant if before is not None else who.tenant)
    if name is None:
        raise Invalid("tenant: an admin belongs to no tenant; name the tenant to submit to")
    tenant = scope.tenant(name)  # first: another tenant's is not found, whatever the role
    scope.require(Role.TENANT_ADMIN, Role.MEMBER, action="submitting a job")
    if before is not None and before.tenant != tenant.name:
        raise Invalid(f"resume_from: job {before.id} is tenant {before.tenant}'s; resume it in that tenant")
    if before is None and sub.spec is None:
        raise Invalid("spec: give the job spec, or resume_from: a job to go on from")
    text = sub.spec if sub.spec is not None else before.spec  # type: ignore[union-attr]
    workdir = sub.workdir or (before.workdir if before is not None else os.getcwd())
    spec = parse_spec(text, source="the submitted spec")
    if before is not None:
        spec = _resuming(spec, before)
    preflight(spec, workdir, remote_data=False)
    workers, per_worker = gang_shape(spec)
    if issue := _fits(spec, workers * per_worker, types, unit, shares):
        raise SpecError("the submitted spec", [issue])
    job_id = f"{spec.name[:20]}-{secrets.token_hex(4)}"
    if spec.checkpoint.dir is None:  # every execution of the job resumes from the same checkpoints
        spec = spec.model_copy(
            update={"checkpoint": spec.checkpoint.model_copy(update={"dir": str(jobs_dir / job_id / "checkpoints")})}
        )
    job = Job(
        id=job_id,
        tenant=tenant.name,
        owner=who.key,
        name=spec.name,
        spec=dump_spec(spec),
        workdir=workdir,
        priority=sub.priority,
        total_steps=spec.train.steps if spec.train is not None else None,
        nodes=spec.resources.nodes,
        checkpoint_dir=spec.checkpoint.dir,
        workers=workers,
        gpus=workers * per_worker,
        gpu_types=spec.resources.gpu_types,
        prefer_gpu_types=spec.resources.prefer_gpu_types,
        mix_gpu_types=spec.resources.mix_gpu_types,
        gpu_milli=spec.resources.gpu_milli,
        kind=spec.job_kind,
        state=JobState.PENDING,
        reason="queued",
        submitted_at=now,
        queued_at=now,
        attempt=0,
        cancel_requested=False,
        preemptions=0,
        preempted_by=[],
        resumed_from=before.id if before is not None else None,
    )
    scope.session.add(job)
    scope.session.flush()  # its seq
    cause = f"submitted by {who.user} with priority {sub.priority}"
    if before is not None:
        cause += f", going on from job {before.id}'s checkpoints ({spec.checkpoint.dir})"
    _record(scope.session, job, None, JobState.PENDING, cause, now)
    return job


def _fits(spec: JobSpec, gpus: int, types: dict[str, int], unit: str, shares: bool) -> SpecIssue | None:
    """Why the job can never run on this cluster, if it cannot: a share of a GPU where the executor runs none,
    none of the GPU types it allows, or more GPUs than they hold (than the largest of them holds, for a gang
    that may not span types)."""
    res = spec.resources
    if res.gpu_fraction is not None and not shares:
        return SpecIssue(
            "resources.gpu_fraction", "this server's executor places whole GPUs only (shares run on the local one)"
        )
    allowed = {t: n for t, n in types.items() if not res.gpu_types or t in res.gpu_types}
    if not allowed:
        have = f"{res.gpu_types}: this cluster has none of them; its types: {sorted(types)}"
        return SpecIssue("resources.gpu_types", have)
    if gpus > sum(allowed.values()):
        return SpecIssue("resources", f"the job needs {gpus} {unit}; the cluster has {sum(allowed.values())} in all")
    largest = max(allowed, key=lambda t: allowed[t])
    if gpus > allowed[largest] and not res.mix_gpu_types:
        return SpecIssue(
            "resources.mix_gpu_types",
            f"the job needs {gpus} {unit} of one type; {largest}, the largest of its types, has {allowed[largest]}: "
            "allow the gang to span types, or ask for fewer",
        )
    return None


def _resuming(spec: JobSpec, before: Job) -> JobSpec:
    """``spec``, reading and writing ``before``'s checkpoints, so that it starts from the newest valid one (a
    recipe, or a script that loads ``ctx.checkpoint_location()``'s newest)."""
    if before.state not in FINAL:
        raise Conflict(f"job {before.id} is {before.state}: resume from a job that ended (cancel it first)")
    if before.checkpoint_dir is None:
        raise Invalid(f"resume_from: job {before.id} has no checkpoint location to go on from")
    if spec.checkpoint.dir is not None and spec.checkpoint.dir != before.checkpoint_dir:
        raise SpecError(
            "the submitted spec",
            [SpecIssue("checkpoint.dir", f"{spec.checkpoint.dir!r}: the job goes on from job {before.id}'s "
                       f"checkpoints in {before.checkpoint_dir!r}; leave checkpoint.dir out, or give that")],
        )  # fmt: skip
    return spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"dir": before.checkpoint_dir})})


def cancel(scope: Scope, job: Job, now: float) -> bool:
    """Cancel at once if the job holds nothing; else ask the loop to stop it (True)."""
    scope.may_cancel(job)
    if job.state in FINAL:
        raise Conflict(f"job {job.id} already ended: {job.state}")
    if job.state in (JobState.PENDING, JobState.PREEMPTED):
        if job.state == JobState.PREEMPTED:
            move(scope.session, job, JobState.PENDING, "requeued to be cancelled", now)
        move(scope.session, job, JobState.CANCELLED, f"cancelled by {scope.who.user}", now)
        return False
    job.cancel_requested = True
    job.reason = f"cancelling at the request of {scope.who.user}: the job checkpoints and stops"
    return True
