"""The control plane's tables. Times are Unix seconds (float), as the run directories' events are; job specs are
stored as the resolved YAML the job runs with."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String, Text, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class JobState(enum.StrEnum):
    """A job's state: PENDING, ADMITTED, RUNNING, then SUCCEEDED, FAILED or CANCELLED; a preempted job goes
    RUNNING, PREEMPTED, PENDING."""

    PENDING = "PENDING"
    ADMITTED = "ADMITTED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"


FINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE = (JobState.ADMITTED, JobState.RUNNING)  # holding GPUs


class Base(DeclarativeBase):
    type_annotation_map: ClassVar = {dict[str, Any]: JSON, list[str]: JSON}


def month_start(ts: float) -> float:
    """The start of ``ts``'s calendar month (UTC): a budget's period."""
    at = datetime.fromtimestamp(ts, UTC)
    return datetime(at.year, at.month, 1, tzinfo=UTC).timestamp()


class Tenant(Base):
    """A team: its guaranteed GPUs (``nominal_gpus``), the cohort whose idle GPUs it may borrow, and the dollars
    its runs may cost in a calendar month (``monthly_budget``; None: no budget)."""

    __tablename__ = "tenants"
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    nominal_gpus: Mapped[int] = mapped_column(Integer)
    cohort: Mapped[str | None] = mapped_column(String(63))
    borrowing_limit: Mapped[int | None] = mapped_column(Integer)
    monthly_budget: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)


def user_key(tenant: str | None, name: str) -> str:
    """A user's key: an admin's name, or ``<tenant>/<name>`` for a tenant's user."""
    return f"{tenant}/{name}" if tenant is not None else name


def user_name(key: str) -> str:
    """The name a user is known by within its tenant (or, an admin's, everywhere)."""
    return key.rpartition("/")[2]


class User(Base):
    """A person or a robot. ``tenant`` is None for admins only. ``name`` is the user's key (``user_key``): each
    tenant names its users on its own, so that creating one tells nothing of another tenant's users."""

    __tablename__ = "users"
    name: Mapped[str] = mapped_column(String(127), primary_key=True)
    tenant: Mapped[str | None] = mapped_column(ForeignKey("tenants.name"))
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[float] = mapped_column(Float)


class Token(Base):
    """An API token: ``phx_<id>_<secret>``; only the secret's SHA-256 is kept, so the token is shown once."""

    __tablename__ = "tokens"
    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    user: Mapped[str] = mapped_column(String(127), ForeignKey("users.name"), index=True)  # the user's key
    name: Mapped[str] = mapped_column(String(63))
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)


class Job(Base):
    """A submitted job and where it stands. ``seq`` orders submissions; ``attempt`` counts its executions
    (each a start on the executor, after admission or after a preemption)."""

    __tablename__ = "jobs"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(32), unique=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"))
    owner: Mapped[str] = mapped_column(String(127), ForeignKey("users.name"))  # the submitter's key
    name: Mapped[str] = mapped_column(String(128))
    spec: Mapped[str] = mapped_column(Text)
    workdir: Mapped[str] = mapped_column(Text)
    priority: Mapped[int] = mapped_column(Integer)
    # what the server reads of the spec, stored at submit so that it is never parsed again
    total_steps: Mapped[int | None] = mapped_column(Integer)  # the recipe's; None: a script, which reports its own
    nodes: Mapped[int] = mapped_column(Integer, server_default="1")  # spares not counted
    checkpoint_dir: Mapped[str | None] = mapped_column(Text)  # a path or a URL
    steps_done: Mapped[int | None] = mapped_column(Integer)  # as its last execution ended: the list reads no run
    resumed_from: Mapped[str | None] = mapped_column(String(32))  # the job whose checkpoints it went on from
    workers: Mapped[int] = mapped_column(Integer)  # the gang: workers x (gpus / workers) GPUs each
    gpus: Mapped[int] = mapped_column(Integer)
    gpu_types: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")  # empty: any
    prefer_gpu_types: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    mix_gpu_types: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    kind: Mapped[str] = mapped_column(String(64), default="", server_default="")  # the spec's job_kind
    gpu_milli: Mapped[int] = mapped_column(Integer, default=1000, server_default="1000")  # < 1000: a share of one
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    submitted_at: Mapped[float] = mapped_column(Float)
    queued_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    placement: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    gpu_carve: Mapped[int | None] = mapped_column(Integer)  # a share's: its shared GPU on its node
    handle: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # the executor's, for the current execution
    evicting_for: Mapped[str | None] = mapped_column(String(32))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    preempted_by: Mapped[list[str]] = mapped_column(JSON, default=list)

    __table_args__ = (Index("ix_jobs_tenant_state", "tenant", "state"), Index("ix_jobs_state", "state"))

    @property
    def gpu_use(self) -> float:
        """GPUs it uses: a share, its fraction of one."""
        return self.gpus * self.gpu_milli / 1000


class Transition(Base):
    """A job's state change and its cause: the job's history, never rewritten."""

    __tablename__ = "transitions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[int] = mapped_column(ForeignKey("jobs.seq"), index=True)
    at: Mapped[float] = mapped_column(Float)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str] = mapped_column(Text)


class Execution(Base):
    """One start of a job on the executor, from start to exit: what usage is counted from. Its price is fixed
    when it starts (``dollars_per_h``: its placement at its types' on-demand prices then), so a price changed
    later never rewrites what it cost."""

    __tablename__ = "executions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[int] = mapped_column(ForeignKey("jobs.seq"), index=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    gpus: Mapped[float] = mapped_column(Float)  # a share: its fraction of one
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    run_dir: Mapped[str | None] = mapped_column(Text)
    outcome: Mapped[str | None] = mapped_column(String(16))
    productive_s: Mapped[float | None] = mapped_column(Float)  # from the run's goodput ledger, once it ended
    tokens: Mapped[float | None] = mapped_column(Float)  # trained on, from its step metrics, once it ended
    gpu_type: Mapped[str | None] = mapped_column(String(64))  # of its placement's nodes ("a+b": a mixed gang)
    dollars_per_h: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")

    def dollars(self, since: float, until: float) -> float:
        """What it cost between ``since`` and ``until`` (it runs until ``until`` if it has not ended)."""
        end = min(self.ended_at, until) if self.ended_at is not None else until
        return self.dollars_per_h * max(0.0, end - max(self.started_at, since)) / 3600


class Lease(Base):
    """Who runs the control loop over this database (lease.py): one row, taken over when it lapses, each holder
    with an epoch one above the last's."""

    __tablename__ = "leases"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128), default="", server_default="")  # host:pid:random; "": none yet
    epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    expires_at: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
