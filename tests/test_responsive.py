"""The API keeps answering: while the executor blocks for seconds (sbatch on a busy Slurm controller) and
while clients send hostile specs. Functional bounds, not speed figures: each request is answered well
within the time the executor, or the hostile spec, would otherwise have held the server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from phalanx.client import Client
from phalanx.control.executors import Handle, Launch, LocalExecutor, Status
from phalanx.control.server.app import create_app
from phalanx.control.server.main import Settings, build
from servers import PhalanxServer, free_port

BLOCK_S = 4.0  # how long the slow executor's start and status take
ANSWERED_S = 2.0  # every request is answered within this, well under BLOCK_S
JOB = "name: sleeper\nresources: {procs_per_node: 1, device: cpu}\ncommand: [python, -c, 'import time; time.sleep(60)']"


class SlowCluster(LocalExecutor):
    """The local executor behind a cluster manager that takes BLOCK_S to answer anything; it records when it
    was busy, to check the requests measured meanwhile really overlapped it."""

    def __init__(self, root: Path):
        super().__init__(root, slots=2)
        self.busy: list[tuple[float, float]] = []

    def _slowly(self, call, *args):
        began = time.monotonic()
        time.sleep(BLOCK_S)
        try:
            return call(*args)
        finally:
            self.busy.append((began, time.monotonic()))

    def start(self, launch: Launch) -> Handle:
        return self._slowly(super().start, launch)

    def status(self, handle: Handle) -> Status:
        return self._slowly(super().status, handle)


@pytest.fixture
def slow_server(tmp_path: Path) -> Iterator[tuple[str, str, SlowCluster]]:
    """The real app and control loop in this process, served by uvicorn on loopback, over a SlowCluster:
    (URL, the admin's token, the executor)."""
    executor = SlowCluster(tmp_path / "jobs")
    server, controller, token = build(Settings(tmp_path / "data", tick_s=0.2), executor)
    web = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    while not web.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    controller.start()
    url = f"http://127.0.0.1:{web.config.port}"
    try:
        yield url, token, executor
    finally:
        for job in Client(url, token).jobs(states=["RUNNING"]):
            Client(url, token).cancel(job["id"])
        controller.stop()
        web.should_exit = True
        thread.join(timeout=30)
        for handle in executor._children.values():
            handle.kill()


def _timed(call) -> float:
    began = time.monotonic()
    call()
    return time.monotonic() - began


def test_reads_and_submits_are_answered_while_the_executor_blocks(slow_server) -> None:
    """The loop starts a job (BLOCK_S) and then asks its status every round (BLOCK_S each): meanwhile whoami,
    job listings and new submissions are answered, each within ANSWERED_S. Before the loop acted with no
    transaction open, a submission waited for the loop's write lock, and with it the event loop and every
    request."""
    url, admin_token, executor = slow_server
    admin = Client(url, admin_token)
    admin.create_tenant("team", 2)
    admin.create_user("dana", "member", "team")
    dana = Client(url, admin.create_token("t", "dana")["token"])
    first = dana.submit(JOB)["id"]
    took: list[tuple[str, float, float]] = []  # (what, when it began, how long it took)
    deadline = time.monotonic() + 3 * BLOCK_S
    while time.monotonic() < deadline:
        for what, call in (
            ("whoami", dana.whoami),
            ("jobs", dana.jobs),
            ("submit", lambda: dana.submit(JOB)),
            ("job", lambda: dana.job(first)),
        ):
            began = time.monotonic()
            took.append((what, began, _timed(call)))
        time.sleep(0.2)
    assert dana.job(first)["state"] == "RUNNING"  # started, through the slow start, and watched since
    during = [t for t in took if any(t[1] < e and b < t[1] + t[2] for b, e in executor.busy)]  # they overlap
    slowest = max(during, key=lambda t: t[2])
    assert slowest[2] < ANSWERED_S, f"{slowest[0]} took {slowest[2]:.2f} s while the executor was busy"
    assert {what for what, *_ in during} == {"whoami", "jobs", "submit", "job"}, executor.busy


def _bomb(depth: int = 7) -> str:
    """The issue's 468-byte spec: aliases nested 7 deep, 9 each, 4.8 million values once expanded."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, depth)]
    return "\n".join([*lines, "name: bomb", "command: [python]", f"env: *a{depth - 1}", ""])


HOSTILE = {
    "alias bomb": _bomb(),
    "self-referencing alias": "a: &a [*a, *a]\nname: t\ncommand: [python]\nenv: *a\n",
    "deep nesting": "name: t\ncommand: [python]\nenv: " + "[" * 5000 + "]" * 5000 + "\n",
    "huge integer": "name: t\ncommand: [python]\nresources: {nodes: " + "9" * 5000 + "}\n",
    "over-long path component": f"name: t\ntrain: {{}}\ndata: {{sources: [{{path: {'d' * 300}/x}}]}}\n",
    "many values": "name: t\ncommand: [python]\nenv: {" + ", ".join(f"k{i}: {i}" for i in range(20_000)) + "}\n",
}


def test_the_server_stays_responsive_while_hostile_specs_are_refused(server: PhalanxServer) -> None:
    """Four clients send hostile specs as fast as they are answered; each gets a short 422, and whoami, asked
    meanwhile, is answered within ANSWERED_S (the alias bomb alone used to hold the event loop for 5.8 s and
    answer with 72 MB)."""
    client = server.member("team", 2, "erin")
    headers = {"Authorization": client._http.headers["Authorization"]}
    refused: list[tuple[str, int, int]] = []
    stop = threading.Event()

    def hostile(names: list[str]) -> None:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            while not stop.is_set():
                for name in names:
                    answer = http.post("/api/v1/jobs", json={"spec": HOSTILE[name]})
                    refused.append((name, answer.status_code, len(answer.content)))

    names = list(HOSTILE)
    senders = [threading.Thread(target=hostile, args=(names[i::4],)) for i in range(4)]
    for sender in senders:
        sender.start()
    waits = []
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            waits.append(_timed(client.whoami))
            time.sleep(0.05)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=120)
    assert {name for name, *_ in refused} == set(HOSTILE)
    assert all(code == 422 and size < 4096 for _, code, size in refused), {(n, c, s) for n, c, s in refused}
    assert max(waits) < ANSWERED_S, f"whoami waited {max(waits):.2f} s"
