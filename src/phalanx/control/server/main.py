"""``phalanx server``: open the store, make the first admin on a new database, start the scheduling loop
over the executor's cluster, and serve the API."""

from __future__ import annotations

import base64
import gc
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from phalanx.control import scheduler as core
from phalanx.control.executors import Executor, LocalExecutor, SlurmExecutor
from phalanx.control.server import auth, cluster_config
from phalanx.control.server.app import create_app
from phalanx.control.server.deps import MAX_TOKEN_S, Server
from phalanx.control.server.loop import Controller
from phalanx.control.store import Role, Store, User, open_store
from phalanx.control.store.lease import LEASE_S, LoopLease

log = logging.getLogger("phalanx.server")
SETTINGS_ENV = "PHALANX_SERVER_SETTINGS"  # a --workers process's settings, from the process that started it


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database: str | None = None  # default: SQLite in data_dir
    host: str = "127.0.0.1"
    port: int = 8470
    slots: int | None = None  # CPU slots the local executor offers; None: this machine's GPUs
    admin_token_file: Path | None = None
    tick_s: float = 0.5
    executor: str = "local"  # local | slurm
    slurm_partition: str | None = None  # the slurm executor's partition, for jobs whose spec names none
    max_token_s: float = MAX_TOKEN_S  # the longest a token may live, whoever makes it
    cost: core.PreemptionCost = field(default_factory=core.PreemptionCost)  # on this cluster: the scheduler's budget
    gpu_types: dict[str, int] | None = None  # the local executor's slots by GPU type, declared; None: as found
    priced: tuple[core.GpuType, ...] = ()  # the GPU types as the operator described them (cluster_config.py)
    lease_s: float = LEASE_S  # servers sharing a database: the control loop's lease (store/lease.py)
    workers: int = 1  # processes serving the API over the database, each a contender for the lease

    @property
    def database_url(self) -> str:
        return self.database or f"sqlite:///{self.data_dir.absolute() / 'phalanx.db'}"


def bootstrap(store: Store) -> str | None:
    """On a database with no users: the first admin, and its token (None when there are users already, or
    another server starting on the same new database made the admin first)."""
    try:
        with store.write() as s:
            if s.scalar(select(User).limit(1)) is not None:
                return None
            now = time.time()
            admin = User(name="admin", tenant=None, role=Role.ADMIN, created_at=now)
            s.add(admin)
            s.flush()
            row, token = auth.issue(admin, "bootstrap", now, expires_at=None)
            s.add(row)
    except IntegrityError:  # the admin's row is another server's: its token was shown there
        return None
    return token


def make_executor(settings: Settings, jobs_dir: Path) -> Executor:
    if settings.executor == "slurm":
        return SlurmExecutor(jobs_dir, settings.slurm_partition)
    if settings.executor == "local":
        return LocalExecutor(jobs_dir, settings.slots, settings.gpu_types)
    raise ValueError(f"--executor {settings.executor}: give local or slurm")


def build(settings: Settings, executor: Executor | None = None) -> tuple[Server, Controller, str | None]:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = open_store(settings.database_url)
    jobs_dir = settings.data_dir.absolute() / "jobs"
    executor = executor or make_executor(settings, jobs_dir)
    token = bootstrap(store)
    policy = core.PredictiveLas(cost=settings.cost)
    lease = LoopLease(store, settings.lease_s)
    controller = Controller(store, executor, policy, tick_s=settings.tick_s, types=settings.priced, lease=lease)
    nodes = executor.capacity()
    types: dict[str, int] = {}
    for node in nodes:
        types[node.gpu_type] = types.get(node.gpu_type, 0) + node.gpus
    described = cluster_config.fleet(nodes, executor.unit, settings.priced).types
    server = Server(
        store, jobs_dir, types, controller.wake.set, settings.max_token_s, executor.unit, described, executor.shares
    )
    return server, controller, token


def serve(settings: Settings) -> None:
    """Serve in this process, or in ``settings.workers`` processes over the same database, each serving the API
    and contending for the control loop's lease (uvicorn's workers, on one socket)."""
    import uvicorn

    if settings.workers > 1:
        if not settings.database_url.startswith("postgresql"):
            raise ValueError(
                f"--workers {settings.workers}: several processes need PostgreSQL (--db postgresql+psycopg://...); "
                "SQLite takes one writer process"
            )
        store = open_store(settings.database_url)  # migrated once, before the workers open it
        token = bootstrap(store)
        store.engine.dispose()
        _welcome(settings, token)
        os.environ[SETTINGS_ENV] = base64.b64encode(pickle.dumps(settings)).decode()
        uvicorn.run(f"{__name__}:worker_app", factory=True, workers=settings.workers, host=settings.host,
                    port=settings.port, log_level="info")  # fmt: skip
        return
    server, controller, token = build(settings)
    _welcome(settings, token)
    # Everything imported so far (hundreds of thousands of objects) lives as long as the server:
    # out of the garbage collector's sight, a full collection no longer stalls requests for a tenth of a second.
    gc.freeze()
    uvicorn.run(create_app(server, controller), host=settings.host, port=settings.port, log_level="info")


def log_to_stderr() -> None:
    """The server's log lines (jobs' transitions, the loop's lease), with uvicorn's."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def worker_app() -> FastAPI:
    """One of ``--workers`` processes, made by uvicorn in each: the API, and a contender for the loop's lease."""
    log_to_stderr()  # a process of its own: uvicorn starts it afresh
    settings = pickle.loads(base64.b64decode(os.environ[SETTINGS_ENV]))  # written by serve(), this server's parent
    server, controller, _ = build(settings)
    return create_app(server, controller)


def _welcome(settings: Settings, token: str | None) -> None:
    """The admin's token on a new database (once), and the next step, after the migrations' lines and before
    the web server's, so that it is not buried in them."""
    url = f"http://{settings.host}:{settings.port}"
    login = f"phalanx login {url} --token "
    if token is not None and settings.admin_token_file is not None:
        fd = os.open(settings.admin_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        login += f"$(cat {settings.admin_token_file})"
        said = f"new database: the admin's token is in {settings.admin_token_file} (shown once)"
    elif token is not None:
        login += token
        said = f"new database: the admin's token, shown once:\n\n    {token}"
    else:
        login += "<your token>"
        said = "the database has users: log in with your token"
    print(f"\n{said}\n\nnext:      {login}\ndashboard: {url}/ui/\n", flush=True)
