"""`phalanx server` for real: a server process on loopback with the local executor, jobs run by real
supervisors, driven through the CLI and the Python client. Submit to success, checkpoint-aware preemption
with no step lost or repeated, and a server killed with SIGKILL while jobs run and wait."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, alive
from phalanx.client import Client, ClientError
from phalanx.obs.events import read_jsonl
from servers import PhalanxServer

LONG = 400  # steps of a job that must outlast a server restart or a preemption: ~15 s here


def tiny(name: str, steps: int, every: int = 5) -> str:
    return (
        f"name: {name}\nresources: {{procs_per_node: 2, device: cpu}}\n"
        f"train: {{model: {{preset: llama-tiny}}, parallel: {{dp_shard: 2}}, steps: {steps}, global_batch: 8,"
        f" micro_batch: 4, seq_len: 32, optimizer: {{lr: 3.0e-3, warmup_steps: 2}}}}\n"
        f"checkpoint: {{every_steps: {every}}}\n"
    )


def wait_for(client: Client, job_id: str, states: set[str] = frozenset(), steps: int = 0, timeout: float = 180) -> dict:
    """Poll the job until it is in one of ``states`` (any, if none given) and has done ``steps`` steps."""
    deadline = time.monotonic() + timeout
    while (job := client.job(job_id))["state"] not in (states or {job["state"]}) or (job["steps_done"] or 0) < steps:
        assert time.monotonic() < deadline, f"{job_id}: {job['state']} ({job['reason']}) after {timeout} s"
        time.sleep(0.1)
    return job


def steps(client: Client, job_id: str) -> list[tuple[int, int]]:
    """(execution, step) of each step the job reported, in order."""
    return [(m["execution"], m["step"]) for m in client.metrics(job_id)]


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", *args], capture_output=True, text=True, env={**os.environ, **env}, cwd=REPO
    )


def test_a_job_through_the_cli(server: PhalanxServer, tmp_path: Path) -> None:
    """login, tenants (a budget and a borrowing limit set and removed), users, tokens, submit, jobs, status, logs
    (after the end, and followed), usage, cancel."""
    admin_env = {"PHALANX_CONFIG": str(tmp_path / "admin.json")}
    token = server.token_file.read_text().strip()
    assert cli(admin_env, "login", server.url, "--token", token).returncode == 0
    assert cli(admin_env, "tenants", "create", "vision", "--nominal-gpus", "2").returncode == 0
    huge = cli(admin_env, "tenants", "create", "huge", "--nominal-gpus", "100000")  # kept, but said
    assert huge.returncode == 0 and "quota of 100000 slots is more than the cluster's" in huge.stderr, huge.stderr
    budgeted = cli(admin_env, "tenants", "update", "huge", "--monthly-budget", "50", "--borrowing-limit", "3")
    assert "huge: 100000 slots, no cohort, borrowing limit 3, $50.00 a month" in budgeted.stderr, budgeted.stderr
    removed = cli(admin_env, "tenants", "update", "huge", "--no-monthly-budget", "--no-borrowing-limit")
    assert "huge: 100000 slots, no cohort, no borrowing limit, no budget" in removed.stderr, removed.stderr
    both = cli(admin_env, "tenants", "update", "huge", "--monthly-budget", "5", "--no-monthly-budget")
    assert both.returncode == 2 and "--monthly-budget and --no-monthly-budget: give one" in both.stderr
    assert cli(admin_env, "users", "create", "alice", "--tenant", "vision").returncode == 0
    made = cli(admin_env, "tokens", "create", "--user", "alice")
    alice = {"PHALANX_CONFIG": str(tmp_path / "alice.json")}
    assert cli(alice, "login", server.url, "--token", made.stdout.strip()).returncode == 0
    spec = tmp_path / "job.yaml"
    spec.write_text(tiny("cli", 8))
    submitted = cli(alice, "submit", str(spec))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain: {steps: 0}\n")
    refused = cli(alice, "submit", str(bad))
    assert refused.returncode == 2 and "spec.train.steps: Input should be greater than 0" in refused.stderr

    followed = cli(alice, "logs", job_id, "-f")  # returns when the job ends
    assert followed.returncode == 0 and "holds 65,696 params" in followed.stdout
    assert followed.stderr.strip().splitlines()[-1].startswith(f"{job_id} SUCCEEDED: ")  # how it ended, last
    job = server.admin.job(job_id)
    assert job["state"] == "SUCCEEDED" and job["steps_done"] == 8 and job["owner"] == "alice"
    assert cli(alice, "logs", job_id, "--rank", "1").stdout.strip()  # still readable after the end
    said = cli(alice, "logs", job_id, "--supervisor").stdout  # the supervisor's story, through the server
    assert "2 worker(s) on cpu" in said and "goodput" in said, said
    no_rank = cli(alice, "logs", job_id, "--rank", "5")
    assert no_rank.returncode == 1 and f"rank 5 not found; job {job_id} has 2 rank(s): 0 to 1" in no_rank.stderr
    status = cli(alice, "status", job_id).stdout
    assert "PENDING -> ADMITTED" in status and "RUNNING -> SUCCEEDED" in status
    listed = cli(alice, "jobs", "--state", "succeeded").stdout
    assert re.search(rf"{job_id} .* SUCCEEDED .* 8/8 ", listed), listed  # a finished job's steps, from its row
    assert " slots " in listed.splitlines()[0] and "GPU" not in listed  # --slots: CPU slots, not GPUs
    usage = cli(alice, "usage", "--since", "1h", "--by-job").stdout
    assert job_id in usage and "vision" in usage and "allocated slot-h" in usage
    report = server.admin.usage()
    assert report["jobs"][0]["allocated_gpu_hours"] > report["jobs"][0]["productive_gpu_hours"] > 0
    assert "already ended" in cli(alice, "cancel", job_id).stderr
    assert token not in server.log.read_text() and made.stdout.strip() not in server.log.read_text()  # never logged


def test_preemption_checkpoints_and_resumes_with_no_step_lost_or_repeated(server: PhalanxServer) -> None:
    """A higher-priority job arrives while a lower one holds every slot: the lower one is asked to checkpoint
    (SIGTERM: the recipe's emergency save), is requeued once its checkpoint commits, and resumes from it
    after the other ends; its steps run once each, and its losses equal an uninterrupted run's."""
    client = server.member("research", 2, "bob")
    # Long enough (~15 s) to be running when the other arrives; no periodic save: the preemption's is the one.
    low = client.submit(tiny("low", LONG, every=1000))["id"]
    wait_for(client, low, steps=5, timeout=120)
    high = client.submit(tiny("high", 6), priority=10)["id"]
    wait_for(client, high, {"SUCCEEDED"})
    wait_for(client, low, {"SUCCEEDED"})

    history = [(t["from_state"], t["to_state"]) for t in client.events(low)["transitions"]]
    assert history == [
        (None, "PENDING"), ("PENDING", "ADMITTED"), ("ADMITTED", "RUNNING"), ("RUNNING", "PREEMPTED"),
        ("PREEMPTED", "PENDING"), ("PENDING", "ADMITTED"), ("ADMITTED", "RUNNING"), ("RUNNING", "SUCCEEDED"),
    ]  # fmt: skip
    preempted = client.events(low)["transitions"][3]["cause"]
    assert f"preempted for {high}" in preempted and "priority" in preempted
    ran = steps(client, low)
    first = [s for e, s in ran if e == 1]
    assert [s for _, s in ran] == list(range(LONG)), "a step was lost or repeated"
    assert 5 <= len(first) < LONG and {e for e, _ in ran} == {1, 2}
    story = client.story(low)  # what `phalanx status` tells: the emergency checkpoint, where execution 2 began
    assert [(s["execution"], s["checkpoint_step"]) for s in story["stops"]] == [(1, len(first))]
    assert story["resumed"] == {"2": len(first)} and story["restarts"] == [] and story["steps_done"] == LONG
    assert story["last_loss"] == client.metrics(low)[-1]["loss"] and 0 < story["goodput"] < 1
    high_started = next(t["at"] for t in client.events(high)["transitions"] if t["to_state"] == "RUNNING")
    low_back = [t["at"] for t in client.events(low)["transitions"] if t["to_state"] == "RUNNING"][1]
    assert low_back > high_started

    reference = server.tmp / "reference"
    reference.mkdir()
    (reference / "job.yaml").write_text(tiny("low", LONG, every=1000))
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "run", "job.yaml"], cwd=reference, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:]
    (run,) = (reference / "runs" / "low").iterdir()
    expected = [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]
    assert [m["loss"] for m in client.metrics(low)] == expected  # bitwise: resumed exactly


def test_kill9_the_server_loses_and_duplicates_nothing(server: PhalanxServer) -> None:
    """SIGKILL the server while one job runs and three wait; start it again: the running job is adopted with
    its progress (the same supervisor, never a second one), the waiting ones are still queued in order, and
    every job runs exactly once to success."""
    client = server.member("team", 2, "carol")
    running = client.submit(tiny("first", LONG, every=50))["id"]  # still running when the server is back
    wait_for(client, running, {"RUNNING"})
    queued = [client.submit(tiny(f"next{i}", 4))["id"] for i in range(3)]
    wait_for(client, running, steps=3, timeout=120)
    pid = int((server.tmp / "data" / "jobs" / running / "attempt-1" / "pid").read_text())
    server.kill9()
    assert alive(pid), "the job died with the server"
    # The server is down: the run directory tells the progress.
    metrics = next((server.tmp / "data" / "jobs" / running / "attempt-1" / "runs").glob("*/*/metrics.jsonl"))
    progress_before = len(list(read_jsonl(metrics)))
    server.start()

    adopted = client.job(running)
    assert adopted["state"] == "RUNNING" and adopted["attempt"] == 1
    assert adopted["steps_done"] >= progress_before
    waiting = client.jobs(["PENDING"])
    assert [j["id"] for j in waiting] == queued
    for job in waiting:  # why each waits, from the scheduler's round
        assert re.match(r"(quota|placement|preempting|behind|no room): .+", job["reason"]), job
    for job_id in [running, *queued]:
        wait_for(client, job_id, {"SUCCEEDED"})
    for job_id in [running, *queued]:
        job = client.job(job_id)
        assert job["attempt"] == 1, f"{job_id} ran {job['attempt']} times"
        assert [s for _, s in steps(client, job_id)] == list(range(LONG if job_id == running else 4))
    assert not alive(pid)
    started = [t["at"] for j in queued for t in client.events(j)["transitions"] if t["to_state"] == "RUNNING"]
    assert started == sorted(started), "the queue's order was not kept"


def test_cancelling_a_running_job_checkpoints_it_first_and_resume_goes_on_from_it(server: PhalanxServer) -> None:
    """A cancelled job saves an emergency checkpoint; `phalanx resume` submits it again, with its lineage, and
    the new job's first step is the one after that checkpoint."""
    client = server.member("ops", 2, "dave")
    job_id = client.submit(tiny("cancelled", LONG, every=1000))["id"]
    wait_for(client, job_id, steps=3, timeout=120)
    with pytest.raises(ClientError) as still_going:
        client.submit(None, resume_from=job_id)
    assert still_going.value.status == 409 and "resume from a job that ended" in str(still_going.value)
    asked = client.cancel(job_id)
    assert asked["state"] == "RUNNING" and asked["reason"].startswith("cancelling at the request of dave")
    done = wait_for(client, job_id, {"CANCELLED"})
    (saved,) = client.checkpoints(job_id)  # the emergency save, the only one
    assert saved["problem"] is None and saved["step"] == done["steps_done"]
    assert [e["kind"] for e in client.events(job_id)["events"]].count("signal_received") == 1  # one SIGTERM

    env = {"PHALANX_URL": server.url, "PHALANX_TOKEN": server.admin.create_token("cli", "dave")["token"]}
    resumed = cli(env, "resume", job_id)
    assert resumed.returncode == 0 and f"going on from {job_id}'s checkpoints" in resumed.stderr, resumed.stderr
    again = wait_for(client, resumed.stdout.strip(), {"SUCCEEDED"})
    assert again["resumed_from"] == job_id and again["steps_done"] == LONG
    ran = [s for _, s in steps(client, again["id"])]
    assert ran == list(range(saved["step"], LONG))  # from the emergency checkpoint on, each step once
