"""The local supervisor, end to end: real worker processes, a real gloo process group, real signals."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, Job, alive
from phalanx.obs import read_jsonl


def test_two_rank_allreduce_with_torchrun_env(job: Job, tmp_path: Path) -> None:
    result = job.run(job.command_spec("allreduce.py", str(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [s["sum"] for s in seen] == [3.0, 3.0]  # 1 + 2
    run = job.run_dir()
    for rank, s in enumerate(seen):
        env = s["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["PHALANX_RUN_ID"] == f"t/{run.name}" and env["PHALANX_RUN_DIR"] == str(run)
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
    # output is teed: prefixed on the console, whole in each rank's log file
    assert "[rank0]: all-reduce sum 3.0" in result.stdout and "[rank1]: all-reduce sum 3.0" in result.stdout
    assert "all-reduce sum 3.0" in (run / "logs" / "rank-1.log").read_text()
    assert json.loads((run / "result.json").read_text())["outcome"] == "succeeded"
    assert (run / "spec.yaml").read_text().startswith("name: t\n")
    kinds = [e["kind"] for e in read_jsonl(run / "events.jsonl")]
    assert kinds == ["run_started", "attempt_started", "run_finished"]


@pytest.mark.parametrize(
    "mode, cause",
    [
        ("exit", "exited with code 3"),
        ("raise", "exited with code 1: RuntimeError: rank 1 lost its accelerator"),
        ("report", "exited with code 3 after step 7"),  # the last step its SDK heartbeat reported (0-6), from 1
    ],
)
def test_failing_rank_is_named_and_the_others_are_stopped(job: Job, tmp_path: Path, mode: str, cause: str) -> None:
    extra = "resilience: {stop_grace_s: 5, max_restarts: 0}\n"
    result = job.run(job.command_spec("fail_rank.py", mode, str(tmp_path), extra=extra))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"failed: rank 1 {cause}" in result.stdout
    assert "rank 1 is about to fail" in result.stdout.split("failed: rank 1")[1]  # the log tail is shown
    outcome = json.loads((job.run_dir() / "result.json").read_text())
    assert (outcome["outcome"], outcome["failed_rank"], outcome["exit_code"]) == ("failed", 1, 1)
    assert not alive(int((tmp_path / "pid-0").read_text()))
    (failure,) = [e for e in read_jsonl(job.run_dir() / "events.jsonl") if e["kind"] == "worker_failed"]
    assert failure["rank"] == 1 and failure["then"] == ["rank 0 was killed by SIGTERM"]
    survivor = (job.run_dir() / "logs" / "rank-0.log").read_text().splitlines()[-1]  # its errors, explained
    assert survivor.startswith(f"[phalanx] rank 0 was stopped because rank 1 {cause.split(':')[0]};"), survivor


def _start_and_wait_ready(job: Job, spec: Path, out: Path, ranks: int = 2) -> subprocess.Popen[str]:
    sup = subprocess.Popen(job.argv(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline = time.monotonic() + 60
    while not all((out / f"ready-{r}").exists() for r in range(ranks)):
        assert sup.poll() is None and time.monotonic() < deadline, "workers never got ready"
        time.sleep(0.05)
    return sup


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded_to_every_worker(job: Job, tmp_path: Path, sig: signal.Signals) -> None:
    sup = _start_and_wait_ready(job, job.command_spec("signals.py", "graceful", str(tmp_path)), tmp_path)
    sup.send_signal(sig)
    output, _ = sup.communicate(timeout=60)
    assert sup.returncode == 128 + sig, output
    assert [(tmp_path / f"got-{r}").read_text() for r in range(2)] == [sig.name, sig.name]
    assert f"stopped by {sig.name}" in output
    assert json.loads((job.run_dir() / "result.json").read_text())["outcome"] == "stopped"


def test_workers_that_ignore_the_signal_are_killed_after_the_grace_period(job: Job, tmp_path: Path) -> None:
    spec = job.command_spec("signals.py", "ignore", str(tmp_path), extra="resilience: {stop_grace_s: 1}\n")
    sup = _start_and_wait_ready(job, spec, tmp_path)
    sent = time.time()
    sup.send_signal(signal.SIGTERM)
    output, _ = sup.communicate(timeout=60)
    assert sup.returncode == 128 + signal.SIGTERM, output
    assert [(tmp_path / f"got-{r}").read_text() for r in range(2)] == ["SIGTERM", "SIGTERM"]
    lived = [float((tmp_path / f"alive-{r}").read_text()) - sent for r in range(2)]
    assert min(lived) > 0.9, lived  # each kept running through the 1 s grace period (written every 10 ms) ...
    assert not any(alive(int((tmp_path / f"ready-{r}").read_text())) for r in range(2))  # ... and was then killed


def test_plain_torchrun_script_runs_unchanged_and_matches_torchrun(job: Job, tmp_path: Path) -> None:
    script = REPO / "examples" / "ddp_toy.py"
    ours, theirs = tmp_path / "phalanx.pt", tmp_path / "torchrun.pt"
    spec = job.spec(
        f"name: t\nresources: {{procs_per_node: 2, device: cpu}}\n"
        f'command: [python, "{script}", --steps, "20", --out, "{ours}"]\n'
    )
    result = job.run(spec)
    assert result.returncode == 0, result.stdout + result.stderr
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    reference = [*argv, "--steps", "20", "--out", str(theirs)]
    torchrun = subprocess.run(reference, capture_output=True, text=True, timeout=120)
    if torchrun.returncode != 0 and "terminate called without an active exception" in torchrun.stderr:
        # The reference, not phalanx: torch's gloo teardown occasionally aborts a worker at exit (seen once
        # in this session's CI runs). Run the reference again rather than fail on torch's flake.
        torchrun = subprocess.run(reference, capture_output=True, text=True, timeout=120)
    assert torchrun.returncode == 0, torchrun.stderr
    a, b = torch.load(ours), torch.load(theirs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_multi_node_spec_is_refused_with_a_clear_error(job: Job) -> None:
    result = job.run(job.spec("name: t\nresources: {nodes: 2, procs_per_node: 1, device: cpu}\ncommand: ['true']\n"))
    assert result.returncode == 2
    assert "resources.nodes = 2" in result.stderr and "use nodes: 1" in result.stderr
    assert "phalanx run JOB.yaml --local-nodes" in result.stderr and "phalanx agent JOB.yaml --rdzv" in result.stderr


def _events(job: Job, kind: str) -> list[dict]:
    return [e for e in read_jsonl(job.run_dir() / "events.jsonl") if e["kind"] == kind]


def test_user_error_is_not_retried(job: Job) -> None:
    result = job.run(job.command_spec("flaky.py", "user", extra="resilience: {max_restarts: 3, stop_grace_s: 5}\n"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "not restarting: ValueError: train.lr must be positive (an error in the code or spec" in result.stdout
    assert len(_events(job, "attempt_started")) == 1 and _events(job, "worker_failed")[0]["failure"] == "user"
    outcome = json.loads((job.run_dir() / "result.json").read_text())
    assert outcome["restarts"] == 0 and outcome["reason"].endswith("(a user error: not retried)")


def test_crash_is_restarted_until_it_succeeds(job: Job) -> None:
    spec = job.command_spec("flaky.py", "crash-once", extra="resilience: {restart_backoff_s: 0.2}\n")
    result = job.run(spec)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "failed: rank 1 exited with code 3 after step 2" in result.stdout
    assert "restart 1/3 in 0.2 s" in result.stdout and "[rank0]: attempt 1 done" in result.stdout
    (restart,) = _events(job, "restart_scheduled")
    assert restart["failure"] == "infrastructure" and restart["category"] == "crash" and restart["backoff_s"] == 0.2
    assert [e["attempt"] for e in _events(job, "attempt_started")] == [0, 1]
    assert json.loads((job.run_dir() / "result.json").read_text())["restarts"] == 1


def test_restart_budget_is_kept(job: Job) -> None:
    spec = job.command_spec("flaky.py", "crash-always", extra="resilience: {max_restarts: 2, restart_backoff_s: 0.1}\n")
    result = job.run(spec)
    assert result.returncode == 1
    assert [e["backoff_s"] for e in _events(job, "restart_scheduled")] == [0.1, 0.2]  # doubled each time
    assert "not restarting: all 2 restart(s) of resilience.max_restarts used" in result.stdout
    outcome = json.loads((job.run_dir() / "result.json").read_text())
    assert outcome["restarts"] == 2 and outcome["reason"].endswith("(after 2 restart(s))")


def test_hang_is_detected_stacks_are_dumped_and_the_job_restarts(job: Job) -> None:
    spec = job.command_spec("flaky.py", "hang-once", extra="resilience: {hang_timeout_s: 2, restart_backoff_s: 0}\n")
    result = job.run(spec)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 1 hung: no progress past step 2 for" in result.stdout and "(hang timeout 2.0 s)" in result.stdout
    (found,) = _events(job, "hang_detected")  # steps counted from 1, as everywhere a person reads them
    assert found["rank"] == 1 and found["step"] == 2 and found["silent_s"] > 2
    stacks = (job.run_dir() / "logs" / "rank-1.stacks.txt").read_text()
    assert "in stuck" in stacks and "flaky.py" in stacks  # the hung rank's own Python stack
    assert "barrier" in (job.run_dir() / "logs" / "rank-0.stacks.txt").read_text()  # rank 0 waits for it
    assert "[rank0]: attempt 1 done" in result.stdout


def test_own_script_example_resumes_from_its_checkpoint_with_the_same_losses(job: Job, tmp_path: Path) -> None:
    """examples/own_script.py (docs/sdk.md): stopped at step 40 and run again to 60, it continues from its
    checkpoint with the losses of a run that never stopped."""

    def run(name: str, steps: int) -> tuple[str, dict[int, float]]:
        spec = job.spec(
            f"name: {name}\nresources: {{procs_per_node: 2, device: cpu}}\n"
            f'command: [python, "{REPO / "examples" / "own_script.py"}", --steps, "{steps}"]\n'
            f"checkpoint: {{dir: '{tmp_path / name / 'ckpt'}', every_steps: 20}}\n"
        )
        result = job.run(spec)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        run_dir = max((job.runs / name).iterdir())  # the newest run of this job
        return result.stdout, {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}

    _, straight = run("straight", 60)
    _, first = run("stopped", 40)
    said, second = run("stopped", 60)
    assert "rank 0: resumed at step 40" in said and "rank 1: resumed at step 40" in said
    assert sorted(first) == list(range(40)) and sorted(second) == list(range(40, 60))
    assert {**first, **second} == straight
