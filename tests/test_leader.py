"""Several `phalanx server` processes over one PostgreSQL database: each serves the API, one at a time runs the
control loop (its lease: store/lease.py), another takes the loop over when its holder is killed or frozen, and
the writes of a holder that lost the lease are refused."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from phalanx.client import Client
from phalanx.control.executors import Launch, LocalExecutor, Phase
from phalanx.control.server.main import bootstrap
from phalanx.control.store import Tenant, open_store
from phalanx.control.store.lease import Fenced, LoopLease, leader
from servers import PhalanxServer
from test_platform import cli, wait_for


def test_a_holder_that_lost_the_lease_cannot_write(postgres) -> None:
    """Two holders on a fake clock: the first holds and renews; once its lease lapses the second takes it at the
    next epoch, and the first's next transaction is refused whole, its write rolled back; then it follows. A
    holder that gives the lease up (stopping) lets the other take it at once."""
    store = open_store(postgres.database())
    now = [1000.0]
    first, second = (LoopLease(store, 5.0, f"p{i}", clock=lambda: now[0]) for i in (1, 2))
    assert first.hold() and first.epoch == 1 and not second.hold()
    now[0] += 4.0
    assert first.hold() and not second.hold()  # renewed: it lapses 5 s from now, not from the start
    now[0] += 6.0  # frozen past its lease
    assert second.hold() and second.epoch == 2
    with pytest.raises(Fenced, match="the lease of epoch 1 is no longer this process's, p1"), store.write() as s:
        s.add(Tenant(name="stale", nominal_gpus=1, created_at=now[0]))
        first.fence(s)
    with store.read() as s:
        assert s.scalar(select(Tenant).where(Tenant.name == "stale")) is None
        assert leader(s, now[0]) == ("p2", 2)
    assert first.epoch is None and not first.hold()
    with store.write() as s:
        second.fence(s)  # the holder's transactions go on, each renewing it
    second.release()  # a server stopping: the lease is another's to take at once
    assert first.hold() and first.epoch == 3
    store.engine.dispose()


def test_servers_starting_at_once_on_a_new_database_make_one_admin(postgres) -> None:
    """Four servers' starts at once on a new PostgreSQL database: the migrations run once (in turn, under a
    lock), one admin is made and its token shown once, and no start fails."""
    database = postgres.database()
    tokens, failed = [], []

    def start() -> None:
        try:
            store = open_store(database)
            tokens.append(bootstrap(store))
            store.engine.dispose()
        except Exception as e:  # what a start would die of
            failed.append(e)

    starts = [threading.Thread(target=start) for _ in range(4)]
    for thread in starts:
        thread.start()
    for thread in starts:
        thread.join(60)
    assert not failed and len(tokens) == 4 and sum(token is not None for token in tokens) == 1, (failed, tokens)


def marking_spec(name: str, marks: Path, seconds: float = 0.2) -> str:
    """A short job that notes each start of it: a job started twice leaves two lines."""
    script = f"open({str(marks / name)!r}, 'a').write('started\\n'); import time; time.sleep({seconds})"
    return f"name: {name}\nresources: {{device: cpu}}\ncommand: [{sys.executable}, -c, {script!r}]\n"


def _pid(holder: str) -> int:
    return int(holder.split(":")[-2])


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_start_interrupted_before_its_claim_is_started_once(tmp_path: Path) -> None:
    """A server frozen (or killed) in the middle of starting an execution: its directory drafted, its process
    not begun. The server that takes the loop over starts it at once; the first, woken, finds it started and
    starts nothing: its child's claim is refused. The job ran once."""
    marks = tmp_path / "marks"
    marks.mkdir()
    frozen, taker = (LocalExecutor(tmp_path / "jobs", slots=1) for _ in range(2))
    launch = Launch("j", 1, marking_spec("j", marks), str(tmp_path), {"local": 1}, 1)
    where = tmp_path / "jobs" / "j" / "attempt-1"
    draft = frozen._draft(where, launch)  # frozen here
    started = taker.start(launch)
    assert frozen._claim(where, draft, launch) == started and not draft.exists()  # woken: the same execution
    assert frozen.start(launch) == started  # and any later start of it
    deadline = time.monotonic() + 60
    while (status := taker.status(started)).phase is Phase.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert status.outcome == "succeeded", status
    assert (marks / "j").read_text() == "started\n"


def test_another_server_takes_the_loop_over_from_a_frozen_or_killed_one(tmp_path: Path, postgres) -> None:
    """Two servers over one PostgreSQL database and one jobs directory, two CPU slots, a lease of 3 s: the first
    one process, the second `--workers 2`. The first runs the loop; 4 jobs submitted to it, it is frozen
    (SIGSTOP) at whatever point of its round it is: a worker of the second takes the loop over at the next
    epoch, the jobs succeed, and the first, woken, follows. Then 12 jobs are submitted through both servers;
    with 2 running and 10 waiting, the process holding the loop is killed (-9): another takes it over, and all
    12 succeed. Each job started once, and both servers answer the same."""
    database, marks = postgres.database(), tmp_path / "marks"
    for folder in (marks, tmp_path / "a", tmp_path / "b"):
        folder.mkdir()
    args = ("--data-dir", str(tmp_path / "a" / "data"), "--lease-s", "3")  # one jobs directory; a log each
    first = PhalanxServer(tmp_path / "a", slots=2, database=database, args=args)
    shutil.copy(tmp_path / "a" / "admin.token", tmp_path / "b" / "admin.token")  # a database with users: not made
    try:
        second = PhalanxServer(tmp_path / "b", slots=2, database=database, args=(*args, "--workers", "2"))
    except BaseException:
        first.stop()
        raise
    try:
        first.admin.create_tenant("team", 2)
        first.admin.create_user("alice", "member", "team")
        token = first.admin.create_token("test", "alice")["token"]
        clients = [Client(first.url, token), Client(second.url, token)]

        def leader_of(client: Client, other_than: int = 0) -> tuple[str, int]:
            """The loop's holder and epoch, once there is one at an epoch after ``other_than``."""
            deadline = time.monotonic() + 30
            while (cluster := client.cluster())["leader"] is None or cluster["lease_epoch"] <= other_than:
                assert time.monotonic() < deadline, f"no process took the loop over in 30 s: {cluster}"
                time.sleep(0.05)
            return cluster["leader"], cluster["lease_epoch"]

        held, epoch = leader_of(clients[1])
        assert _pid(held) == first.proc.pid, held  # the first started first
        few = [clients[0].submit(marking_spec(f"k{i}", marks))["id"] for i in range(4)]
        time.sleep(0.25)  # frozen while it admits and starts them, at whatever point
        first.proc.send_signal(signal.SIGSTOP)
        try:
            held, epoch = leader_of(clients[1], epoch)
            assert _parent(_pid(held)) == second.proc.pid, held  # one of the second's workers
            for job_id in few:
                wait_for(clients[1], job_id, {"SUCCEEDED"}, timeout=120)
        finally:
            first.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        assert f"runs the control loop (lease epoch {epoch}" in second.log.read_text()  # its workers log too
        while "another process took the control loop over (" not in first.log.read_text():  # at a write, or a tick
            assert time.monotonic() < deadline, "the woken server did not step down"
            time.sleep(0.1)

        jobs = [clients[i % 2].submit(marking_spec(f"j{i}", marks, 2.0))["id"] for i in range(12)]
        deadline = time.monotonic() + 60
        while sum(clients[0].job(j)["state"] == "RUNNING" for j in jobs) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # the holder now (a lease can change hands on a busy machine), killed while the two run: not mid-start
        held, epoch = leader_of(clients[1])
        if _pid(held) == first.proc.pid:
            first.kill9()
            first.start()  # back at once, as a follower
        else:
            os.kill(_pid(held), signal.SIGKILL)  # one of the second's workers: uvicorn starts another
        taken, _ = leader_of(clients[0], epoch)
        assert _pid(taken) != _pid(held), taken
        for job_id in jobs:
            ended = wait_for(clients[0], job_id, {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=120)
            assert ended["state"] == "SUCCEEDED", ended
        assert clients[0].jobs() == clients[1].jobs()
        assert {job["id"]: job["attempt"] for job in clients[0].jobs()} == dict.fromkeys([*few, *jobs], 1)
        names = [*(f"k{i}" for i in range(4)), *(f"j{i}" for i in range(12))]
        assert {path.name: path.read_text() for path in marks.iterdir()} == dict.fromkeys(names, "started\n")
    finally:
        for server in (first, second):
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)
            server.stop()


def test_a_sqlite_store_moves_to_postgresql_whole(tmp_path: Path, postgres) -> None:
    """A server's SQLite store (a tenant, a member's token, a job that ran and one cancelled while queued) copied
    by `phalanx db copy` into PostgreSQL: the server started on it answers the same to the same token, and a new
    job runs under a new number. A database a server runs on, and a target with rows, are refused."""
    marks, target = tmp_path / "marks", postgres.database()
    marks.mkdir()
    source = f"sqlite:///{tmp_path / 'data' / 'phalanx.db'}"
    first = PhalanxServer(tmp_path, slots=1)
    try:
        first.admin.create_tenant("team", 1)
        first.admin.create_user("alice", "member", "team")
        token = first.admin.create_token("test", "alice")["token"]
        client = Client(first.url, token)
        ran = client.submit(marking_spec("ran", marks))["id"]
        client.cancel(client.submit(marking_spec("cancelled", marks))["id"])
        wait_for(client, ran, {"SUCCEEDED"}, timeout=60)
        before = client.jobs()
        refused = cli({}, "db", "copy", source, target)
        assert refused.returncode == 2 and "a server runs on the source database" in refused.stderr, refused
    finally:
        first.stop()
    copied = cli({}, "db", "copy", source, target)
    assert copied.returncode == 0 and "jobs 2" in copied.stdout, copied
    again = cli({}, "db", "copy", source, target)
    assert again.returncode == 2 and "already has rows in tenants, users" in again.stderr, again
    moved = PhalanxServer(tmp_path, slots=1, database=target)
    try:
        client = Client(moved.url, token)
        assert client.jobs() == before
        new = client.submit(marking_spec("new", marks))["id"]
        assert new not in {job["id"] for job in before}
        assert wait_for(client, new, {"SUCCEEDED", "FAILED"}, timeout=60)["state"] == "SUCCEEDED"
    finally:
        moved.stop()
    assert sorted(path.name for path in marks.iterdir()) == ["new", "ran"]


def test_several_workers_need_postgresql(tmp_path: Path) -> None:
    refused = cli({}, "server", "--data-dir", str(tmp_path), "--workers", "2", "--port", "1")
    assert refused.returncode == 2 and "--workers 2: several processes need PostgreSQL" in refused.stderr, refused
