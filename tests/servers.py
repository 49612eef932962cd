"""Real servers on loopback, for the tests and the benchmarks (bench/control_plane.py): a PostgreSQL from
Debian's package, run as a non-root user in a temporary directory, and `phalanx server` in a process of its
own."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """initdb + pg_ctl in a temporary directory, as ``postgres`` when run as root (PostgreSQL refuses root),
    listening on 127.0.0.1 only. ``database()`` makes a new empty database and returns its URL."""

    def __init__(self) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not bins:
            raise FileNotFoundError("PostgreSQL is not installed: apt-get install postgresql (.ci/run does)")
        bin_dir = bins[-1].parent
        self.root = Path(tempfile.mkdtemp(prefix="phalanx-pg-"))
        as_user: list[str] = []
        if os.geteuid() == 0:
            account = pwd.getpwnam("postgres")
            os.chown(self.root, account.pw_uid, account.pw_gid)
            as_user = ["runuser", "-u", "postgres", "--"]
        data, self.port = self.root / "data", free_port()
        initdb = [str(bin_dir / "initdb"), "-D", str(data), "-U", "phalanx", "--auth=trust", "-E", "UTF8"]
        subprocess.run([*as_user, *initdb], check=True, capture_output=True)
        options = f"-h 127.0.0.1 -p {self.port} -k {self.root} -c max_connections=300"
        self._pg_ctl = [*as_user, str(bin_dir / "pg_ctl"), "-D", str(data)]
        log = str(self.root / "log")
        subprocess.run([*self._pg_ctl, "-l", log, "-o", options, "-w", "start"], check=True, capture_output=True)
        self.url = f"postgresql+psycopg://phalanx@127.0.0.1:{self.port}/postgres"

    def database(self) -> str:
        import sqlalchemy

        name = f"t{time.time_ns()}"
        engine = sqlalchemy.create_engine(self.url, isolation_level="AUTOCOMMIT")
        with engine.connect() as c:
            c.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
        engine.dispose()
        return self.url.rsplit("/", 1)[0] + "/" + name

    def stop(self) -> None:
        subprocess.run([*self._pg_ctl, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


class PhalanxServer:
    """`phalanx server` in a process of its own, with its data directory; killed and started again at will."""

    def __init__(self, tmp: Path, slots: int, database: str | None = None):
        from phalanx.client import Client

        self.tmp, self.slots, self.database, self.port = tmp, slots, database, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = tmp / "admin.token"
        self.log = tmp / "server.log"
        self.proc: subprocess.Popen | None = None
        self.start()
        self.admin = Client(self.url, self.token_file.read_text().strip())

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "phalanx", "server", "--data-dir", str(self.tmp / "data"), "--port",
            str(self.port), "--slots", str(self.slots), "--admin-token-file", str(self.token_file),
        ]  # fmt: skip
        if self.database:
            argv += ["--db", self.database]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp)
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.url + "/openapi.json", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                assert self.proc.poll() is None, self.log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the server did not start in 60 s"
                time.sleep(0.2)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def member(self, tenant: str, quota: int, user: str):
        """A tenant with ``quota`` GPUs, a member of it, and a client with the member's token."""
        from phalanx.client import Client

        self.admin.create_tenant(tenant, quota)
        self.admin.create_user(user, "member", tenant)
        return Client(self.url, self.admin.create_token("test", user)["token"])
