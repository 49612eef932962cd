"""The API's request and response bodies. Every field a client sends is bounded: names by a pattern, numbers
by a range, text by a length, so that nothing hostile reaches the database or the scheduler."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from phalanx.control.store import Role, user_name
from phalanx.spec import MAX_SPEC_CHARS

NAME = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
Name = Annotated[str, Field(pattern=NAME, description="lower-case letters, digits and '-', at most 63")]
Gpus = Annotated[int, Field(ge=0, le=1_000_000)]
Dollars = Annotated[float, Field(ge=0, le=1e12)]


# A user as the API names it: its name within its tenant (the store keys a tenant's users <tenant>/<name>).
UserName = Annotated[str, BeforeValidator(user_name)]


class In(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class TenantIn(In):
    name: Name
    nominal_gpus: Gpus = Field(description="GPUs guaranteed to the tenant (its nominal quota)")
    cohort: Name | None = Field(default=None, description="tenants of one cohort may borrow each other's idle GPUs")
    borrowing_limit: Gpus | None = Field(default=None, description="at most this many GPUs above its quota")
    monthly_budget: Dollars | None = Field(
        default=None, description="dollars its runs may cost in a calendar month (UTC); over it, its jobs wait"
    )


class TenantPatch(In):
    """The fields given change; null removes a cohort, a borrowing limit or a budget. A quota cannot be null."""

    nominal_gpus: Gpus = Field(default=None, description="leave it out to keep the quota")  # type: ignore[assignment]
    cohort: Name | None = None
    borrowing_limit: Gpus | None = None
    monthly_budget: Dollars | None = None


class TenantOut(Out):
    name: str
    nominal_gpus: int
    cohort: str | None
    borrowing_limit: int | None
    monthly_budget: float | None = None
    created_at: float
    warning: str | None = Field(default=None, description="what may not be what was meant (a create or update)")


class UserIn(In):
    name: Name
    role: Role
    tenant: Name | None = Field(default=None, description="the user's tenant (default: the caller's); none for admins")


class UserOut(Out):
    name: UserName
    tenant: str | None
    role: Role
    created_at: float


class TokenIn(In):
    name: Name = "default"
    user: Name | None = Field(default=None, description="whose token (default: the caller's)")
    tenant: Name | None = Field(
        default=None,
        description="the user's tenant: for an admin naming a user two tenants have (default: the caller's)",
    )
    expires_in_s: Annotated[float, Field(gt=0)] = Field(
        default=90 * 86400, description="seconds until it expires, at most the server's --max-token-days"
    )


class TokenOut(Out):
    id: str
    user: UserName
    name: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None


class TokenCreated(TokenOut):
    token: str = Field(description="the token itself: shown this once, stored only as a hash")


class SubmitIn(In):
    spec: Annotated[str, Field(min_length=1, max_length=MAX_SPEC_CHARS)] | None = Field(
        default=None, description="the job spec, as YAML; with resume_from, default: that job's"
    )
    priority: Annotated[int, Field(ge=-1000, le=1000)] = Field(default=0, description="higher runs first")
    tenant: Name | None = Field(default=None, description="the tenant to run under (default: the caller's)")
    workdir: Annotated[str, Field(pattern=r"^/[^\x00]{0,4095}$")] | None = Field(
        default=None,
        description="absolute directory the job runs in (relative paths in the spec); default: the server's",
    )
    resume_from: Annotated[str, Field(max_length=32)] | None = Field(
        default=None, description="a job that ended: the new one goes on from its checkpoints"
    )


class JobOut(Out):
    id: str
    name: str
    tenant: str
    owner: UserName
    state: str
    reason: str
    priority: int
    gpus: int
    submitted_at: float
    ended_at: float | None
    attempt: int
    preemptions: int
    placement: dict[str, int] | None
    gpu_milli: int = Field(default=1000, description="its share of one GPU, in thousandths; 1000: whole GPUs")
    gpu_use: float = Field(description="GPUs it uses: a share, its fraction of one")
    gpu_carve: int | None = Field(default=None, description="a share's shared GPU on its node, while it holds one")
    steps_done: int | None = Field(default=None, description="steps done, as the job last reported")
    total_steps: int | None = None
    resumed_from: str | None = Field(default=None, description="the job whose checkpoints this one went on from")


class Restart(BaseModel):
    execution: int
    at: float
    in_process: bool = Field(description="a warm spare took the failed rank's place; else every rank restarted")
    category: str = Field(description="crash, hang, node_lost, ...")
    cause: str
    resumed_from: int | None = Field(description="the steps done when training went on: its checkpoint's step")


class Stop(BaseModel):
    """A stop asked from outside (preemption, cancel): the emergency checkpoint it saved first."""

    execution: int
    at: float
    checkpoint_step: int


class JobStory(BaseModel):
    """What happened to a job, from its runs: each restart with its cause and the step it resumed from, each
    emergency checkpoint, where each execution after the first began, and how far it got."""

    restarts: list[Restart]
    stops: list[Stop]
    resumed: dict[int, int] = Field(description="execution -> the steps done when it began (after the first)")
    steps_done: int | None
    last_loss: float | None
    goodput: float | None = Field(description="productive time / the executions' wall time (not the queued time)")


class TransitionOut(Out):
    at: float
    from_state: str | None
    to_state: str
    cause: str


class JobEvents(BaseModel):
    transitions: list[TransitionOut]
    events: list[dict[str, Any]] = Field(description="the run directories' events, each with its execution")


class LogChunk(BaseModel):
    rank: int | None = Field(description="None: the supervisor's log")
    execution: int | None = Field(description="the execution this chunk is from; None: none has a log yet")
    latest: int | None = Field(description="the job's latest execution with a run directory")
    offset: int
    next_offset: int = Field(description="the offset to ask for next")
    size: int = Field(description="the log's size now, in bytes")
    text: str
    job_ended: bool
    ranks: list[int] = Field(description="the ranks with a log in this execution")


class Cluster(BaseModel):
    capacity: int = Field(description="what the executor offers in all")
    types: dict[str, int] = Field(description="what it offers of each GPU type")
    unit: str = Field(description="what it counts: GPUs, or slots (CPU slots, on a machine without GPUs)")
    leader: str | None = Field(
        default=None, description="the server process that runs the control loop (host:pid:id); none: taking over"
    )
    lease_epoch: int | None = Field(default=None, description="its lease's epoch: one more at each takeover")


class Quota(BaseModel):
    tenant: str
    nominal_gpus: int
    cohort: str | None
    borrowing_limit: int | None
    gpus_in_use: int
    jobs_running: int
    jobs_pending: int


class Usage(BaseModel):
    tenant: str
    job: str | None = None
    allocated_gpu_hours: float
    productive_gpu_hours: float
    dollars: float = Field(description="what its executions cost, each at its placement's price when it started")
    tokens: float = Field(description="tokens trained on (tokens/s x step time, where the run reports both)")
    dollars_per_million_tokens: float | None = Field(description="None: no tokens reported")


class UsageReport(BaseModel):
    since: float
    until: float
    tenants: list[Usage]
    jobs: list[Usage]


class TenantSpend(BaseModel):
    tenant: str
    dollars: float = Field(description="this month's, running executions until now")
    monthly_budget: float | None
    left: float | None = Field(description="budget - dollars; None: no budget")
    over_budget: bool = Field(description="its pending jobs wait until the month turns or the budget is raised")
    dollars_per_h: float = Field(description="what its running executions cost an hour now")


class Spend(BaseModel):
    """The fleet's spend this calendar month (UTC) against the tenants' budgets."""

    month_start: float
    until: float
    dollars: float
    budgets: float = Field(description="the budgets of the tenants that have one, summed")
    dollars_per_h: float
    tenants: list[TenantSpend]


class KindSpeeds(BaseModel):
    kind: str = Field(description="a class of jobs (the spec's kind, or one made from its model or script)")
    relative: dict[str, float] = Field(description="per GPU type: its speed per GPU over the fastest type's")
    tokens_per_gpu_s: dict[str, float] = Field(
        description="per GPU type, once a run of it was measured (else empty): measured, or estimated from there"
    )
    measured: list[str] = Field(description="the types its runs were measured on")
    fastest: str = Field(description="the type it runs fastest on, per GPU")


class SpeedTable(BaseModel):
    """How fast each kind of the caller's jobs runs on each GPU type, as the scheduler sees it: learned from
    every tenant's runs (tokens/s per GPU of productive time, smoothed); a type a kind has not run on is
    estimated from how the types compare for the kinds run on both, else from their peak FLOP/s."""

    types: list[str]
    kinds: list[KindSpeeds]
