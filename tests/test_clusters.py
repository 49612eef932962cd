"""Slurm for real: a cluster of slurmctld and three slurmd on this machine (tests/servers.py), jobs submitted
with `phalanx slurm submit` and through `phalanx server --executor slurm`, nodes taken down with scontrol as
an operator (or a dead machine) would; and the one environment contract, checked on every backend that runs
here (local, --local-nodes, Slurm)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, Job, alive, unavailable, wait_gone
from phalanx.checkpoint import CheckpointDir
from phalanx.control.executors import Phase
from phalanx.control.executors.slurm import SlurmExecutor, _record, job_info, render, submit
from phalanx.obs import read_jsonl
from phalanx.spec import parse_spec
from servers import PhalanxServer, SlurmCluster
from test_leader import marking_spec
from test_platform import tiny, wait_for

STEPS = 150  # long enough to take a node down after the first checkpoints: ~10 s here


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    try:
        cluster = SlurmCluster(nodes=3)
    except FileNotFoundError as e:
        unavailable(str(e))
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
        "slurm: {partition: gpu, account: proj-7, qos: high, constraint: h100&ib, time_limit: '2-00:00:00',\n"
        "  sbatch_options: [--reservation=maint, --comment=run-7], rdzv_ports: 31000-31009,\n"
        "  python: /opt/venv/bin/python, setup: ['module load cuda/12.4', 'export NCCL_IB_HCA=mlx5']}\n"
    )
    script = render(spec, tmp_path / "job.yaml", tmp_path / "runs", tmp_path, tmp_path / "slurm-%j.out")
    directives = re.findall(r"^#SBATCH (\S+)$", script, re.M)
    assert directives == [
        "--job-name=big", "--nodes=16-18", "--mem=0", "--gres=gpu:8", "--time=2-00:00:00", "--partition=gpu",
        "--account=proj-7", "--qos=high", "--constraint=h100&ib", "--exclusive", "--reservation=maint",
        "--comment=run-7", f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%j.out", "--open-mode=append",
        "--wait-all-nodes=1", "--no-kill", "--requeue", "--signal=B:USR1@90",
    ]  # fmt: skip
    # whole GPU nodes: each node's agent takes every CPU the node has in the job, not srun's default of one
    assert script.count('--cpus-per-task="$step_cpus"') == 2 and "--relative=0" in script and "--relative=1" in script
    assert "module load cuda/12.4\nexport NCCL_IB_HCA=mlx5\n" in script and "agent=(/opt/venv/bin/python -m" in script
    assert "rdzv_port=$(( 31000 + SLURM_JOB_ID % 10 ))" in script
    assert script.count("scontrol show node") == 1  # one call to slurmctld for every node's address
    assert '--on-node0-lost "scontrol requeue $SLURM_JOB_ID"' in script
    cpu = parse_spec(
        "name: small\nresources: {nodes: 2, procs_per_node: 4, device: cpu}\ncommand: [python, train.py]\n"
        "slurm: {requeue: false}\n"
    )
    script = render(cpu, tmp_path / "job.yaml", tmp_path / "runs", tmp_path, tmp_path / "slurm-%j.out")
    asked = re.findall(
        r"^#SBATCH (--nodes|--cpus-per-task|--mem|--exclusive|--requeue|--no-requeue)\b(\S*)$", script, re.M
    )
    assert asked == [("--nodes", "=2"), ("--cpus-per-task", "=4"), ("--no-requeue", "")]  # a CPU per worker
    assert '--on-node0-lost "scancel $SLURM_JOB_ID"' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # it parses


def test_bad_slurm_fields_are_spec_errors_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(
        _spec("t") + "slurm: {time_limit: '2 hours', partition: 'a b', gpus: 2, sbatch_options: [--nodes=4, -w n1],"
        " stop_margin_s: 5, rdzv_ports: 80-90, mem: lots}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "slurm", "render", "job.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 2
    for field in (
        "slurm.time_limit", "slurm.partition", "slurm.gpus", "slurm.sbatch_options.0: --nodes: phalanx renders it",
        "slurm.sbatch_options.1: '-w n1': give a long option", "slurm.rdzv_ports", "slurm.mem",
    ):  # fmt: skip
        assert field in done.stderr, done.stderr
    (tmp_path / "job.yaml").write_text(_spec("t") + "slurm: {stop_margin_s: 5}\n")
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "slurm", "render", "job.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert (
        done.returncode == 2
        and "slurm.stop_margin_s: 5 s is shorter than resilience.stop_grace_s = 10 s" in done.stderr
    )


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
    node1 = slurm.node_at(joined["agents"]["1"]["addr"])
    log = (where / f"slurm-{job_id}.{node1}.out").read_text()  # each node's agent writes its own log
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
    assert "attempt 0: ranks 1..1" in (where / f"slurm-{job_id}.{victim}.out").read_text()  # kept, up to its loss
    (lost,) = _events(run, "node_lost")
    assert lost["node"] == 1
    (changed,) = _events(run, "nodes_changed")
    assert changed["members"] == [0, 2]  # the spare took node 1's place
    assert json.loads((run / "result.json").read_text())["outcome"] == "succeeded"
    assert _losses(run) == reference  # the spare ran node 1's ranks from the checkpoint: the same training


IN_PROCESS = (  # 2 x 2 HSDP (replicated across the nodes, sharded within each) with a spare node
    "name: inproc\nresources: {nodes: 2, spare_nodes: 1, procs_per_node: 2, device: cpu}\n"
    "train: {model: {preset: llama-tiny}, steps: 80, global_batch: 8, micro_batch: 2, seq_len: 32,"
    " parallel: {dp_replicate: 2, dp_shard: 2}, optimizer: {lr: 3.0e-3, warmup_steps: 2}}\n"
    "checkpoint: {every_steps: 4, keep_last: 2}\n"
    "resilience: {max_restarts: 3, restart_backoff_s: 0, stop_grace_s: 10, node_timeout_s: 5, in_process: true}\n"
)


def test_a_frozen_node_is_recovered_in_process_on_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Node 1's machine frozen (its slurmd, its step's slurmstepd, its agent and workers stopped) in the middle
    of a job that recovers in process: node 0 finds it lost by its silence, the spare node's warm spares take
    its ranks with their state from node 0's memory, node 0's workers keep their processes, no attempt
    restarts, and every step's loss is that of the same job run clean with --local-nodes."""
    job_id, where = _submit(slurm, tmp_path, IN_PROCESS)
    run = _after_checkpoint(tmp_path / "runs" / "inproc")
    deadline = time.monotonic() + 120
    while not _events(run, "spares_ready"):
        assert time.monotonic() < deadline, "the spare node's spares never got ready"
        time.sleep(0.1)
    (joined,) = _events(run, "nodes_joined")
    (began,) = _events(run, "attempt_started")
    victim = slurm.node_at(joined["agents"]["1"]["addr"])
    slurm.strike(victim, signal.SIGSTOP)
    try:
        _until(slurm, job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    finally:
        slurm.restart(victim)  # the machine rebooted: its frozen processes killed, its slurmd back
    assert _info(slurm, job_id).state == "COMPLETED", (where / f"slurm-{job_id}.out").read_text()[-3000:]
    (lost,) = _events(run, "node_lost")
    assert lost["node"] == 1 and not lost["closed"]  # found by its silence: a frozen machine closes nothing
    (recovered,) = _events(run, "recovery_started")
    assert (recovered["node"], recovered["ranks"]) == (1, [2, 3])
    assert [recovered["pids"][r] for r in "01"] == [began["pids"][r] for r in "01"]  # node 0's kept their processes
    (restored,) = _events(run, "recovered_in_process")
    assert restored["source"] == "memory" and restored["lost_steps"] <= 1, restored
    assert len(_events(run, "attempt_started")) == 1 and not _events(run, "restart_scheduled")
    (tmp_path / "clean").mkdir()
    clean = Job(tmp_path / "clean")
    done = subprocess.run(
        [*clean.argv(clean.spec(IN_PROCESS)), "--local-nodes"], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:]
    (clean_run,) = (clean.runs / "inproc").iterdir()
    assert _losses(run) == _losses(clean_run)  # every step, the one run again included: the clean run's loss


def _job_processes(job_id: str) -> list[int]:
    """Live processes of Slurm job ``job_id`` on this machine (every node's): those with its id in their
    environment (the batch script, srun, the agents, the workers)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"SLURM_JOB_ID={job_id}".encode() in environ.read_bytes().split(b"\0") and alive(
                int(environ.parent.name)
            ):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_the_job_resumes_by_itself_when_its_batch_host_is_lost(
    slurm: SlurmCluster, tmp_path: Path, sig: signal.Signals
) -> None:
    """Node 0's machine (the batch host: its slurmd, the batch script, srun, node 0's agent and workers) frozen
    or crashed. The surviving agents find it lost within node_timeout_s, stop their workers, record it, and
    ask Slurm to requeue the job; Slurm starts it again once the batch host is out of the job, and it resumes
    from its last checkpoint, exactly: the steps it redoes have the losses they had."""
    job_id, where = _submit(slurm, tmp_path, _spec("two", spares=1, steps=200))
    first = _after_checkpoint(tmp_path / "runs" / "two")
    (joined,) = _events(first, "nodes_joined")
    batch_host = slurm.node_at(joined["agents"]["0"]["addr"])
    struck = time.time()
    node0 = slurm.strike(batch_host, sig)
    try:  # requeued, held a while (cred_expire), started again on the nodes left, and trained to the end
        _until(slurm, job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    finally:
        slurm.restart(batch_host)  # the machine rebooted at last: what was left of it killed, its slurmd back
    info = _info(slurm, job_id)
    assert (info.state, info.restarts) == ("COMPLETED", 1), (where / f"slurm-{job_id}.out").read_text()[-3000:]
    lost = _events(first, "rendezvous_lost")
    assert sorted(e["node"] for e in lost) == [1, 2]  # the member and the spare
    assert all(e["ts"] - struck <= 5.0 + 2.0 for e in lost), [e["ts"] - struck for e in lost]
    result = json.loads((first / "result.json").read_text())
    assert (result["outcome"], result["failed_node"], result["node_lost"]) == ("failed", 0, True)
    survivors = [(where / f"slurm-{job_id}.{slurm.node_at(e['addr'])}.out").read_text() for e in lost]
    assert all(f"exiting (running scontrol requeue {job_id})" in log for log in survivors)  # each asked; one was first
    assert any(f"`scontrol requeue {job_id}` exited with code 0" in log for log in survivors)
    second = next(run for run in _runs(tmp_path, "two") if run != first)
    assert json.loads((second / "result.json").read_text())["outcome"] == "succeeded"
    (rejoined,) = _events(second, "nodes_joined")  # without the lost node: spares are asked as a range
    assert joined["agents"]["0"]["addr"] not in {a["addr"] for a in rejoined["agents"].values()}
    before, after = _losses(first), _losses(second)
    # resumed from a checkpoint of the first run's, no step skipped (the node may be lost right after a save
    # and before the next step, so that no step is redone)
    assert max(after) == 199 and min(after) <= max(before) + 1
    redone = sorted(set(before) & set(after))
    assert all(before[s] == after[s] for s in redone)  # bitwise the losses it had: an exact resume
    wait_gone(node0)
    assert _job_processes(job_id) == []


def test_slurm_requeue_and_time_limit_are_reported_as_such(slurm: SlurmCluster, tmp_path: Path) -> None:
    requeued_id, where = _submit(slurm, tmp_path / "requeued", _spec("requeued", nodes=1))
    timed_id, timed_where = _submit(
        slurm,
        tmp_path / "timed",
        _spec("timed", nodes=1, steps=100_000, extra="slurm: {time_limit: '1', stop_margin_s: 20}\n"),
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
    node_log = next(where.glob(f"slurm-{requeued_id}.n*.out")).read_text()
    assert f"Slurm job {requeued_id} (restart 1)" in log and "resumed from" in node_log  # the same checkpoints
    assert _info(slurm, requeued_id).state == "COMPLETED"

    # Slurm warns the batch script 20 s (or up to 60 s more) before the 1-minute limit; the job checkpoints, stops
    _until(slurm, timed_id, {"FAILED", "TIMEOUT"}, timeout=150)
    assert "the time limit is 20 s away" in (timed_where / f"slurm-{timed_id}.out").read_text()
    (timed_run,) = _runs(tmp_path / "timed", "timed")
    assert [e["signal"] for e in _events(timed_run, "signal_received")] == ["SIGTERM"]
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
    assert "its time limit was near" in status.reason and "stopped by SIGTERM" in status.reason


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
        long = client.submit(tiny("long", 100_000, every=100_000))["id"]  # no checkpoint but the emergency one
        assert wait_for(client, done, {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"
        assert "all workers exited with code 0" in client.job(done)["reason"]
        running = wait_for(client, long, {"RUNNING"}, steps=6)
        assert running["reason"].startswith("Slurm: running on n")  # what Slurm says, shown as the job's reason
        slurm_id = (tmp_path / "data" / "jobs" / long / "attempt-1" / "slurm_job_id").read_text().strip()
        client.cancel(long)
        cancelled = wait_for(client, long, {"CANCELLED"}, timeout=120)
        assert "stopped by SIGTERM" in cancelled["reason"]
        assert _info(slurm, slurm_id).state == "CANCELLED"  # scancel, not a signal
        (stopped,) = [e for e in client.events(long)["events"] if e["kind"] == "preempted"]
        saved = [(c["step"], c["problem"]) for c in client.checkpoints(long)]
        assert saved == [(stopped["step"], None)] and stopped["step"] >= 6  # checkpointed on the way out
    finally:
        server.stop()


def test_a_deepspeed_job_on_slurm_trains_as_with_local_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The DeepSpeed example on two Slurm nodes (`phalanx slurm submit`), as any job: it completes, its
    checkpoints are committed by phalanx, and its losses are those of the same spec on --local-nodes."""
    example = REPO / "examples" / "deepspeed_zero.py"
    spec = (
        "name: ds\nresources: {nodes: 2, procs_per_node: 1, device: cpu}\n"
        f'command: [python, "{example}", --zero, "3", --steps, "12"]\ncheckpoint: {{every_steps: 4}}\n'
    )
    (tmp_path / "local").mkdir()
    local = Job(tmp_path / "local")
    argv = [*local.argv(local.spec(spec)), "--local-nodes"]
    subprocess.run(argv, check=True, capture_output=True, cwd=REPO, timeout=300)
    (expected,) = [_losses(run) for run in (local.runs / "ds").iterdir()]
    job_id, where = _submit(slurm, tmp_path / "slurm", spec)
    _until(slurm, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert _info(slurm, job_id).state == "COMPLETED", (where / f"slurm-{job_id}.out").read_text()[-3000:]
    (run,) = _runs(tmp_path / "slurm", "ds")
    assert _losses(run) == expected and sorted(expected) == list(range(12))
    kept = parse_spec((run / "spec.yaml").read_text()).checkpoint.dir  # the submission's, which a requeue keeps
    assert CheckpointDir(kept).manifest(12)["framework"] == "deepspeed"


def test_a_job_submitted_twice_at_once_runs_once(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A server frozen between its sbatch and recording the Slurm job id, woken after another server submitted
    the same execution again: its submission's batch script, not the one recorded, ends unrun, and the woken
    server is handed the recorded one (and cancels its own)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    text = marking_spec("once", marks)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SLURM_CONF", str(slurm.conf))
        recorded = submit(text, tmp_path / "job", tmp_path).job_id
        late = slurm.run("sbatch", "--parsable", str(tmp_path / "job" / "job.sbatch")).strip()  # the frozen one's
        for job_id in (late, recorded):
            _until(slurm, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
        assert _record(tmp_path / "job", late) == recorded  # woken, it records its own: handed the other
    assert _info(slurm, recorded).state == "COMPLETED" and (marks / "once").read_text() == "started\n"
    assert "is not the submission recorded" in (tmp_path / "job" / f"slurm-{late}.out").read_text()


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


def test_the_server_places_a_job_on_the_slurm_gres_type_it_requires(tmp_path: Path) -> None:
    """A Slurm cluster of two GPU types (gres gpu:h100 and gpu:a100, one each): the server reads the types
    from sinfo, places a job that requires a100 on the a100 node, and Slurm runs it there (--gres=gpu:a100:1)."""
    try:
        typed = SlurmCluster(nodes=2, gres={"n0": "gpu:h100:1", "n1": "gpu:a100:1"})
    except FileNotFoundError as e:
        unavailable(str(e))
    server = None
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setenv("SLURM_CONF", str(typed.conf))
            server = PhalanxServer(tmp_path, slots=None, args=("--executor", "slurm"))
        client = server.member("team", 2, "erin")
        assert client.cluster()["types"] == {"h100": 1, "a100": 1}

        def spec(gpu_type: str) -> str:
            return (f"name: on-{gpu_type}\nresources: {{procs_per_node: 1, device: cpu, gpu_types: [{gpu_type}]}}\n"
                    f"slurm: {{gpus_per_node: 1}}\ncommand: [{sys.executable}, -c, 'print(1)']\n")  # fmt: skip

        for gpu_type, node in (("a100", "n1"), ("h100", "n0")):
            job_id = client.submit(spec(gpu_type))["id"]
            assert wait_for(client, job_id, {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"
            slurm_id = (tmp_path / "data" / "jobs" / job_id / "attempt-1" / "slurm_job_id").read_text().strip()
            assert _info(typed, slurm_id).nodes == node  # Slurm ran it on the type the scheduler placed it on
    finally:
        if server is not None:
            server.stop()
        typed.stop()
