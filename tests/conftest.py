from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import fsspec
import pytest

from servers import MARK, PhalanxServer, Postgres, alive, free_port, start_moto

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


_tests = itertools.count()


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark``."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if f"{MARK}={mark}".encode() in environ.read_bytes().split(b"\0") and alive(int(environ.parent.name)):
                found.append(int(environ.parent.name))
    return found


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every process a test started, and all they started (supervisors, workers, agents, Slurm's tasks), is
    gone when it ends, passed or failed: those still there 15 s after it are killed and fail it, named.
    (Servers that fixtures share between tests started before it, without its mark.)"""
    mark = f"{os.getpid()}.{next(_tests)}"
    monkeypatch.setenv(MARK, mark)
    yield
    deadline = time.monotonic() + 15
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        names = {pid: _command(pid) for pid in left}
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"processes the test started outlived it (now killed): {names}", pytrace=False)


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    return "?"


def unavailable(why: str) -> NoReturn:
    """What a test needs (a server, a browser, a schema) is not on this machine: a skip here, but a failure in
    CI (CI set), where .ci/run provides everything, so that green means that every test ran."""
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI is set: .ci/run provides it)", pytrace=False)
    pytest.skip(why)


class Job:
    """A job spec written to a temporary directory, run through the real `phalanx` command."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.runs = tmp / "runs"

    def spec(self, text: str) -> Path:
        path = self.tmp / "job.yaml"
        path.write_text(text)
        return path

    def command_spec(self, script: str, *args: str, procs: int = 2, extra: str = "") -> Path:
        argv = json.dumps(["python", str(WORKERS / script), *args])
        return self.spec(f"name: t\nresources: {{procs_per_node: {procs}, device: cpu}}\ncommand: {argv}\n{extra}")

    def argv(self, spec: Path) -> list[str]:
        return [sys.executable, "-m", "phalanx", "run", str(spec), "--runs-dir", str(self.runs)]

    def run(self, spec: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(spec), capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def run_dir(self) -> Path:
        (run,) = (self.runs / "t").iterdir()
        return run


def wait_gone(pids: list[int], timeout: float = 60) -> None:
    """Wait until every one of ``pids`` has exited."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running after {timeout} s: {[p for p in pids if alive(p)]}"
        time.sleep(0.01)


@pytest.fixture
def job(tmp_path: Path) -> Job:
    return Job(tmp_path)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """A real PostgreSQL server (Debian's package; .ci/run installs it) on loopback, for the session."""
    try:
        server = Postgres()
    except FileNotFoundError as e:
        unavailable(str(e))
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path: Path) -> str:
    """A new, empty database: a SQLite file, or a database on the tests' PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'phalanx.db'}"
    return request.getfixturevalue("postgres").database()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """A real S3-API server (moto's standalone server) on loopback, with an empty bucket ``phalanx-test``.
    Yields the environment variables an S3 client (s3fs, boto) takes its endpoint and credentials from."""
    port = free_port()
    server = start_moto(port)
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "phalanx",
        "AWS_SECRET_ACCESS_KEY": "phalanx-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        fsspec.filesystem("s3", skip_instance_cache=True).mkdir("phalanx-test")
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PhalanxServer]:
    """`phalanx server` with the local executor and 2 slots; a failed test's jobs are stopped with it."""
    started = PhalanxServer(tmp_path, slots=2)
    yield started
    started.stop()
    running = [pid for f in (tmp_path / "data" / "jobs").glob("*/attempt-*/pid") if alive(pid := int(f.read_text()))]
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    wait_gone(running, timeout=60)  # each checkpoints and stops (resilience.stop_grace_s, 30 s by default)
