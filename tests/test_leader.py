"""Several `phalanx server` processes over one PostgreSQL database: each serves the API, one at a time runs the
control loop (its lease: store/lease.py), another takes the loop over when its holder is killed or frozen, and
the writes of a holder that lost the lease are refused."""

from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from phalanx.client import Client
from phalanx.control.store import Tenant, open_store
from phalanx.control.store.lease import Fenced, LoopLease, leader
from servers import PhalanxServer
from test_platform import wait_for


def test_a_holder_that_lost_the_lease_cannot_write(postgres) -> None:
    """Two holders on a fake clock: the first holds and renews; once its lease lapses the second takes it at the
    next epoch, and the first's next transaction is refused whole, its write rolled back; then it follows."""
    store = open_store(postgres.database())
    now = [1000.0]
    first, second = (LoopLease(store, 5.0, f"p{i}", clock=lambda: now[0]) for i in (1, 2))
    assert first.hold() and first.epoch == 1 and not second.hold()
    now[0] += 4.0
    assert first.hold() and not second.hold()  # renewed: it lapses 5 s from now, not from the start
    now[0] += 6.0  # frozen past its lease
    assert second.hold() and second.epoch == 2
    with pytest.raises(Fenced, match=r"epoch 1\) is no longer this process's \(p1\)"), store.write() as s:
        s.add(Tenant(name="stale", nominal_gpus=1, created_at=now[0]))
        first.fence(s)
    with store.read() as s:
        assert s.scalar(select(Tenant).where(Tenant.name == "stale")) is None
        assert leader(s, now[0]) == ("p2", 2)
    assert first.epoch is None and not first.hold()
    with store.write() as s:
        second.fence(s)  # the holder's transactions go on, each renewing it
    store.engine.dispose()


def _spec(name: str, marks: Path) -> str:
    """A short job that notes each start of it: a job started twice leaves two lines."""
    script = f"open({str(marks / name)!r}, 'a').write('started\\n'); import time; time.sleep(0.2)"
    return f"name: {name}\nresources: {{device: cpu}}\ncommand: [{sys.executable}, -c, {script!r}]\n"


def test_another_server_takes_the_loop_over_from_a_killed_or_frozen_one(tmp_path: Path, postgres) -> None:
    """Two servers over one PostgreSQL database and one jobs directory, two CPU slots, a lease of 2 s. The
    first runs the loop; 12 jobs are submitted through both, 2 run and 10 wait; the first is killed (-9). The
    second takes the loop over at the next epoch, and all 12 succeed, each started once. The first comes back
    as a follower, and both answer the same. Then the second, holding the loop, is frozen (SIGSTOP) with 4 more
    jobs to run: the first takes over, and the second, woken, follows; each job started once."""
    database, marks = postgres.database(), tmp_path / "marks"
    for folder in (marks, tmp_path / "a", tmp_path / "b"):
        folder.mkdir()
    args = ("--data-dir", str(tmp_path / "a" / "data"), "--lease-s", "2")  # one jobs directory; a log each
    first = PhalanxServer(tmp_path / "a", slots=2, database=database, args=args)
    shutil.copy(tmp_path / "a" / "admin.token", tmp_path / "b" / "admin.token")  # a database with users: not made
    try:
        second = PhalanxServer(tmp_path / "b", slots=2, database=database, args=args)
    except BaseException:
        first.stop()
        raise
    try:
        first.admin.create_tenant("team", 2)
        first.admin.create_user("alice", "member", "team")
        token = first.admin.create_token("test", "alice")["token"]
        clients = [Client(first.url, token), Client(second.url, token)]

        def leader_of(client: Client) -> tuple[str, int]:
            deadline = time.monotonic() + 30
            while (cluster := client.cluster())["leader"] is None:
                assert time.monotonic() < deadline, "no process took the loop in 30 s"
                time.sleep(0.1)
            return cluster["leader"], cluster["lease_epoch"]

        held, epoch = leader_of(clients[1])
        assert f":{first.proc.pid}:" in held, held  # the first started first
        jobs = [clients[i % 2].submit(_spec(f"j{i}", marks))["id"] for i in range(12)]
        deadline = time.monotonic() + 60
        while sum(clients[1].job(j)["state"] == "RUNNING" for j in jobs) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first.kill9()
        while (now := leader_of(clients[1]))[1] == epoch:
            time.sleep(0.1)
        assert f":{second.proc.pid}:" in now[0] and now[1] == epoch + 1, now
        for job_id in jobs:
            ended = wait_for(clients[1], job_id, {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=120)
            assert ended["state"] == "SUCCEEDED", ended
        first.start()  # back, as a follower: the second holds the loop
        assert leader_of(clients[0]) == now and clients[0].jobs() == clients[1].jobs()

        more = [clients[0].submit(_spec(f"k{i}", marks))["id"] for i in range(4)]
        second.proc.send_signal(signal.SIGSTOP)
        try:
            while (taken := leader_of(clients[0]))[1] == now[1]:
                time.sleep(0.1)
            assert f":{first.proc.pid}:" in taken[0] and taken[1] == now[1] + 1, taken
            for job_id in more:
                assert wait_for(clients[0], job_id, {"SUCCEEDED"}, timeout=120)["attempt"] == 1
        finally:
            second.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while "another process took the control loop over" not in second.log.read_text():
            assert time.monotonic() < deadline, "the woken server did not step down"
            time.sleep(0.1)
        assert leader_of(clients[1]) == taken
        assert {job["id"]: job["attempt"] for job in clients[1].jobs()} == dict.fromkeys([*jobs, *more], 1)
        assert {path.name: path.read_text() for path in marks.iterdir()} == {
            f"{name}": "started\n" for name in [*(f"j{i}" for i in range(12)), *(f"k{i}" for i in range(4))]
        }
    finally:
        for server in (first, second):
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)
            server.stop()
