"""Slurm for real: a cluster of slurmctld and three slurmd on this machine (tests/servers.py), jobs submitted
with `phalanx slurm submit` and through `phalanx server --executor slurm`, nodes taken down with scontrol as
an operator (or a dead machine) would; and the one environment contract, checked on every backend that runs
here (local, --local-nodes, Slurm)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, Job
from phalanx.control.executors import Phase
from phalanx.control.executors.slurm import SlurmExecutor, job_info, render
from phalanx.obs import read_jsonl
from phalanx.spec import parse_spec
from servers import PhalanxServer, SlurmCluster
from test_platform import tiny, wait_for

STEPS = 150  # long enough to take a node down after the first checkpoints: ~10 s here


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    try:
        cluster = SlurmCluster(nodes=3)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    yield cluster
    cluster.stop()


def _spec(name: str, nodes: int = 2, spares: int = 0, steps: int = STEPS, extra: str = "") -> str:
    return (
        f"name: {name}\nresources: {{nodes: {nodes}, spare_nodes: {spares}, procs_per_node: 1, device: cpu}}\n"
        f"train: {{model: {{preset: llama-tiny}}, steps: {steps}, global_batch: 4, micro_batch: 2, seq_len: 32,"
        " optimizer: {lr: 3.0e-3, warmup_steps: 2}}\n"
        "checkpoint: {every_steps: 4, keep_last: 2}\n"
        "resilience: {max_restarts: 3, restart_backoff_s: 0, stop_grace_s: 10, hang_timeout_s: 60}\n" + extra
    )


def _submit(slurm: SlurmCluster, tmp: Path, text: str) -> tuple[str, Path]:
    """`phalanx slurm submit` from ``tmp``: the Slurm job id and the job's submission directory."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "job.yaml").write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "slurm", "submit", "job.yaml", "--runs-dir", str(tmp / "runs")],
        capture_output=True, text=True, cwd=tmp, env=slurm.env, check=True,
    )  # fmt: skip
    job_id = done.stdout.strip()
    log = Path(re.search(r"log: (\S+)", done.stderr).group(1))
    assert log.name == f"slurm-{job_id}.out" and log.is_absolute()
    return job_id, log.parent


def _until(slurm: SlurmCluster, job_id: str, states: set[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while (info := _info(slurm, job_id)).state not in states:
        assert time.monotonic() < deadline, f"Slurm job {job_id} is {info.state} after {timeout} s, not {states}"
        time.sleep(0.3)


def _info(slurm: SlurmCluster, job_id: str):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SLURM_CONF", str(slurm.conf))
        return job_info(job_id)


def _runs(tmp: Path, name: str) -> list[Path]:
    return sorted((tmp / "runs" / name).iterdir(), key=lambda p: p.stat().st_mtime_ns)


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == kind]


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}


def _after_checkpoint(run_parent: Path, timeout: float = 120) -> Path:
    """The run directory, once the job committed its first checkpoint."""
    deadline = time.monotonic() + timeout
    while True:
        runs = [p for p in run_parent.glob("*") if (p / "events.jsonl").is_file()] if run_parent.is_dir() else []
        if runs and _events(runs[0], "checkpoint_committed"):
            return runs[0]
        assert time.monotonic() < deadline, f"no checkpoint under {run_parent} in {timeout} s"
        time.sleep(0.2)


def test_the_sbatch_script_asks_slurm_for_what_the_spec_says(tmp_path: Path) -> None:
    spec = parse_spec(
        "name: big\nresources: {nodes: 16, spare_nodes: 2, procs_per_node: 8, device: cuda}\n"
        "command: [python, train.py]\n"
        "slurm: {partition: gpu, account: proj-7, qos: high, constraint: h100&ib, time_limit: '2-00:00:00'}\n"
    )
    script = render(spec, tmp_path / "job.yaml", tmp_path / "runs", tmp_path, tmp_path / "slurm-%j.out")
    directives = re.findall(r"^#SBATCH (\S+)$", script, re.M)
    assert directives == [
        "--job-name=big", "--nodes=18", "--ntasks-per-node=1", "--gres=gpu:8", "--time=2-00:00:00",
        "--partition=gpu", "--account=proj-7", "--qos=high", "--constraint=h100&ib", f"--chdir={tmp_path}",
        f"--output={tmp_path}/slurm-%j.out", "--open-mode=append", "--no-kill", "--requeue",
    ]  # fmt: skip
    assert "--nodes=1 --ntasks=1 --relative=0" in script and "--nodes=17 --ntasks=17 --relative=1" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # it parses


def test_bad_slurm_fields_are_spec_errors_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(_spec("t") + "slurm: {time_limit: '2 hours', partition: 'a b', gpus: 2}\n")
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "slurm", "render", "job.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 2
    for field in ("slurm.time_limit", "slurm.partition", "slurm.gpus"):
        assert field in done.stderr, done.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of the 2-node job run with --local-nodes: what every Slurm run of it must reproduce."""
    local = Job(tmp_path_factory.mktemp("reference"))
    spec = local.spec(_spec("two"))
    subprocess.run([*local.argv(spec), "--local-nodes"], check=True, capture_output=True, cwd=REPO, timeout=300)
    (run,) = (local.runs / "two").iterdir()
    return _losses(run)


def test_two_node_job_trains_on_slurm_as_it_does_on_local_nodes(
    slurm: SlurmCluster, reference: dict[int, float], tmp_path: Path
) -> None:
    job_id, where = _submit(slurm, tmp_path, _spec("two"))
    _until(slurm, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert _info(slurm, job_id).state == "COMPLETED", (where / f"slurm-{job_id}.out").read_text()[-3000:]
    (run,) = _runs(tmp_path, "two")
    assert json.loads((run / "result.json").read_text())["outcome"] == "succeeded"
    # both nodes' ranks logged into the run directory, and the agents ran on two Slurm nodes' addresses
    assert all((run / "logs" / f"rank-{r}.log").read_text() for r in range(2))
    (joined,) = _events(run, "nodes_joined")
    assert {a["addr"] for a in joined["agents"].values()} == {"127.0.0.2", "127.0.0.3"}
    log = (where / f"slurm-{job_id}.out").read_text()
    assert "[phalanx node 1] the job ended: all workers exited with code 0" in log
    assert _losses(run) == reference and len(reference) == STEPS  # the same job as with --local-nodes, bitwise


def test_a_node_taken_down_mid_run_is_replaced_by_the_spare(
    slurm: SlurmCluster, reference: dict[int, float], tmp_path: Path
) -> None:
    job_id, where = _submit(slurm, tmp_path, _spec("two", spares=1))
    run = _after_checkpoint(tmp_path / "runs" / "two")
    (joined,) = _events(run, "nodes_joined")
    victim = slurm.node_at(joined["agents"]["1"]["addr"])
    slurm.run("scontrol", "update", f"nodename={victim}", "state=down", "reason=phalanx-test")
    try:
        _until(slurm, job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    finally:  # back in service (Slurm may have done it already: ReturnToService=2 and its slurmd answers)
        subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], env=slurm.env, capture_output=True)
    log = (where / f"slurm-{job_id}.out").read_text()
    assert _info(slurm, job_id).state == "COMPLETED", log[-3000:]
    (lost,) = _events(run, "node_lost")
    assert lost["node"] == 1
    (changed,) = _events(run, "nodes_changed")
    assert changed["members"] == [0, 2]  # the spare took node 1's place
    assert json.loads((run / "result.json").read_text())["outcome"] == "succeeded"
    assert _losses(run) == reference  # the spare ran node 1's ranks from the checkpoint: the same training


def test_slurm_requeue_and_time_limit_are_reported_as_such(slurm: SlurmCluster, tmp_path: Path) -> None:
    requeued_id, where = _submit(slurm, tmp_path / "requeued", _spec("requeued", nodes=1))
    timed_id, _ = _submit(
        slurm, tmp_path / "timed", _spec("timed", nodes=1, steps=100_000, extra="slurm: {time_limit: '1'}\n")
    )
    _after_checkpoint(tmp_path / "requeued" / "runs" / "requeued")
    slurm.run("scontrol", "requeue", requeued_id)
    _until(slurm, requeued_id, {"PENDING"})
    info = _info(slurm, requeued_id)
    assert info.restarts == 1 and "requeued by Slurm 1 time(s)" in info.describe()
    slurm.run("scontrol", "update", f"jobid={requeued_id}", "StartTime=now")  # Slurm holds a requeued job a while
    _until(slurm, requeued_id, {"COMPLETED", "FAILED"})
    first, _ = _runs(tmp_path / "requeued", "requeued")  # a run directory per start
    assert json.loads((first / "result.json").read_text())["outcome"] == "stopped"  # checkpointed on SIGTERM
    log = (where / f"slurm-{requeued_id}.out").read_text()
    assert f"Slurm job {requeued_id} (restart 1)" in log and "resumed from" in log  # the same checkpoints
    assert _info(slurm, requeued_id).state == "COMPLETED"

    _until(slurm, timed_id, {"TIMEOUT"}, timeout=150)  # at its 1 minute: Slurm's SIGTERM, then the checkpoint
    executor = SlurmExecutor(tmp_path)
    handle = {
        "dir": str(_submission(tmp_path / "timed")),
        "job_id": timed_id,
        "runs_dir": str(tmp_path / "timed" / "runs"),
    }
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SLURM_CONF", str(slurm.conf))
        status = executor.status(handle)
    assert status.phase is Phase.EXITED and status.outcome == "stopped"
    assert "timed out" in status.reason and "stopped by SIGTERM" in status.reason


def _submission(tmp: Path) -> Path:
    (where,) = (tmp / "runs" / ".slurm").iterdir()
    return where


def test_the_server_runs_jobs_on_slurm_and_cancel_is_scancel(slurm: SlurmCluster, tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SLURM_CONF", str(slurm.conf))
        server = PhalanxServer(tmp_path, slots=None, args=("--executor", "slurm"))
    try:
        client = server.member("team", 6, "dana")
        done = client.submit(tiny("short", 8))["id"]
        long = client.submit(tiny("long", 100_000))["id"]
        assert wait_for(client, done, {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"
        assert "all workers exited with code 0" in client.job(done)["reason"]
        running = wait_for(client, long, {"RUNNING"}, steps=6)
        assert running["reason"].startswith("Slurm: running on n")  # what Slurm says, shown as the job's reason
        slurm_id = (tmp_path / "data" / "jobs" / long / "attempt-1" / "slurm_job_id").read_text().strip()
        client.cancel(long)
        cancelled = wait_for(client, long, {"CANCELLED"}, timeout=120)
        assert "stopped by SIGTERM" in cancelled["reason"]
        assert _info(slurm, slurm_id).state == "CANCELLED"  # scancel, not a signal
        assert any(c["problem"] is None for c in client.checkpoints(long))  # it checkpointed on the way out
    finally:
        server.stop()


@pytest.mark.parametrize("backend", ["local", "local-nodes", "slurm"])
def test_every_backend_gives_workers_the_same_environment(backend: str, request, tmp_path: Path) -> None:
    """The contract (phalanx.launch.node.CONTRACT): rank, world size, node rank, restart count, run directory,
    checkpoint directory, the rendezvous."""
    out = tmp_path / "out"
    out.mkdir()
    job = Job(tmp_path)
    nodes, procs = (1, 2) if backend == "local" else (2, 1)
    text = (
        f"name: t\nresources: {{nodes: {nodes}, procs_per_node: {procs}, device: cpu}}\n"
        f"command: {json.dumps(['python', str(REPO / 'tests' / 'workers' / 'allreduce.py'), str(out)])}\n"
        f"checkpoint: {{dir: {tmp_path / 'ckpt'}}}\n"
    )
    if backend == "slurm":
        slurm = request.getfixturevalue("slurm")
        job_id, _ = _submit(slurm, tmp_path, text)
        _until(slurm, job_id, {"COMPLETED", "FAILED"})
    else:
        argv = job.argv(job.spec(text)) + (["--local-nodes"] if backend == "local-nodes" else [])
        subprocess.run(argv, check=True, capture_output=True, cwd=REPO, timeout=300)
    (run,) = _runs(tmp_path, "t")
    for rank in range(2):
        seen = json.loads((out / f"rank-{rank}.json").read_text())
        assert seen["sum"] == 3.0
        node = rank // procs
        assert {k: v for k, v in seen["env"].items() if k not in ("MASTER_ADDR", "MASTER_PORT")} == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % procs),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": str(procs),
            "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(nodes),
            "PHALANX_NODE_RANK": str(node),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "PHALANX_RUN_ID": f"t/{run.name}",
            "PHALANX_RUN_DIR": str(run),
            "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        }
        assert seen["env"]["MASTER_ADDR"] in ("127.0.0.1", "127.0.0.2") and int(seen["env"]["MASTER_PORT"]) > 0
