"""Multi-node, end to end on one machine: `phalanx run --local-nodes` starts a real agent process per node, each
on its own loopback address (127.0.0.2, .3, ...), and the workers of every node form one gloo group. Runs are
compared with one-node runs of the same job, and after failures with a clean run, weight for weight."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import REPO, Job, wait_gone
from phalanx.launch.rendezvous import BEAT_S, Liveness
from phalanx.obs import read_jsonl
from phalanx.resilience.elastic import NoCapacity, Nodes
from servers import descendants, signal_all
from test_resilience import _launch as launch_in_background
from test_resilience import _weights

STEPS = 24


def _spec(
    job: Job, ckpt: Path, nodes: int = 2, procs: int = 2, extra: str = "", parallel: str = "{}", steps: int = STEPS,
    resilience: str = "",
) -> Path:  # fmt: skip
    return job.spec(
        f"name: t\nresources: {{nodes: {nodes}, procs_per_node: {procs}, device: cpu{extra}}}\n"
        f"train: {{model: {{preset: llama-tiny}}, steps: {steps}, global_batch: 8, micro_batch: 2, seq_len: 32,"
        f" parallel: {parallel}, optimizer: {{lr: 3.0e-3, warmup_steps: 2}}}}\n"
        f"checkpoint: {{dir: '{ckpt}', every_steps: 4, keep_last: 2}}\n"
        "resilience: {max_restarts: 3, restart_backoff_s: 0, stop_grace_s: 5, hang_timeout_s: 5, allow_shrink: true"
        f"{resilience}}}\n"
    )


def _in_process_spec(job: Job, ckpt: Path, memory_every_steps: int = 1) -> Path:
    """2 x 2 HSDP (replicated across the nodes, sharded within each) with a spare node, recovering in process."""
    parallel = "{dp_replicate: 2, dp_shard: 2}"
    resilience = f", in_process: true, memory_every_steps: {memory_every_steps}"
    return _spec(job, ckpt, extra=", spare_nodes: 1", parallel=parallel, steps=60, resilience=resilience)


def _argv(job: Job, spec: Path) -> list[str]:
    return [*job.argv(spec), "--local-nodes"]


def _run(job: Job, spec: Path, local_nodes: bool = True) -> tuple[str, Path]:
    before = set((job.runs / "t").iterdir()) if (job.runs / "t").is_dir() else set()
    argv = _argv(job, spec) if local_nodes else job.argv(spec)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (run,) = set((job.runs / "t").iterdir()) - before
    return result.stdout, run


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == kind]


def _launch(job: Job, spec: Path) -> tuple[subprocess.Popen[str], Path]:
    return launch_in_background(job, spec, "--local-nodes")


def _after_checkpoint(sup: subprocess.Popen[str], run: Path, steps: int = 6) -> dict:
    """Wait until attempt 0 has committed a checkpoint and reported ``steps`` steps; its attempt_started event."""
    deadline = time.monotonic() + 240
    while True:
        assert sup.poll() is None and time.monotonic() < deadline, "attempt 0 did not get that far"
        events = list(read_jsonl(run / "events.jsonl")) if (run / "events.jsonl").is_file() else []
        saved = any(e["kind"] == "checkpoint_committed" for e in events)
        if saved and (run / "metrics.jsonl").is_file() and len(list(read_jsonl(run / "metrics.jsonl"))) >= steps:
            return next(e for e in events if e["kind"] == "attempt_started")
        time.sleep(0.02)


def _agent_pid(run: Path, node: int) -> int:
    (joined,) = _events(run, "nodes_joined")
    return joined["agents"][str(node)]["pid"]


def _clean_run(factory: pytest.TempPathFactory, name: str, spec: Callable[[Job, Path], Path]) -> tuple[Path, Path]:
    """A run of ``spec(job, checkpoints)`` with nothing lost: (its run directory, its checkpoints)."""
    tmp = factory.mktemp(name)
    job = Job(tmp)
    _, run = _run(job, spec(job, tmp / "ckpt"))
    return run, tmp / "ckpt"


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A clean 2 nodes x 2 processes FSDP2 run."""
    return _clean_run(tmp_path_factory, "clean", lambda job, ckpt: _spec(job, ckpt))


def test_agents_give_workers_node_major_ranks_and_the_torchrun_environment(job: Job, tmp_path: Path) -> None:
    spec = job.command_spec("allreduce.py", str(tmp_path), extra="")
    spec.write_text(spec.read_text().replace("procs_per_node: 2", "nodes: 2, procs_per_node: 2"))
    out, run = _run(job, spec)
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    assert [s["sum"] for s in seen] == [10.0] * 4  # 1 + 2 + 3 + 4 over both nodes
    for rank, s in enumerate(seen):
        env = s["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["PHALANX_NODE_RANK"]) == (
            str(rank),
            str(rank % 2),
            str(rank // 2),
            str(rank // 2),
        )
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("4", "2", "2")
        assert env["MASTER_ADDR"] == "127.0.0.2" and env["PHALANX_RUN_DIR"] == str(run)
    # one run directory: every node's rank logs in it, one events log, one result
    assert all("all-reduce sum 10.0" in (run / "logs" / f"rank-{r}.log").read_text() for r in range(4))
    (joined,) = _events(run, "nodes_joined")
    assert {n: a["addr"] for n, a in joined["agents"].items()} == {"0": "127.0.0.2", "1": "127.0.0.3"}
    assert _events(run, "attempt_started")[0]["nodes"] == {"0": 0, "1": 1}
    assert json.loads((run / "result.json").read_text())["outcome"] == "succeeded"
    assert "[phalanx node 1] the job ended: all workers exited with code 0" in out


def _two_nodes(spec: Path) -> Path:
    spec.write_text(spec.read_text().replace("procs_per_node: 2", "nodes: 2, procs_per_node: 1"))
    return spec


def test_a_signal_to_the_job_stops_the_workers_of_every_node(job: Job, tmp_path: Path) -> None:
    sup = subprocess.Popen(
        _argv(job, _two_nodes(job.command_spec("signals.py", "graceful", str(tmp_path)))),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{r}").exists() for r in range(2)):
        assert sup.poll() is None and time.monotonic() < deadline, "workers never got ready"
        time.sleep(0.05)
    sup.send_signal(signal.SIGTERM)  # to `phalanx run --local-nodes`, which hands it to node 0
    out, _ = sup.communicate(timeout=60)
    assert sup.returncode == 128 + signal.SIGTERM, out
    assert [(tmp_path / f"got-{r}").read_text() for r in range(2)] == ["SIGTERM", "SIGTERM"]  # rank 1: node 1
    assert "[phalanx node 1] the job ended: stopped by SIGTERM" in out


def test_an_agent_given_another_spec_is_refused_before_the_job_starts(job: Job, tmp_path: Path) -> None:
    spec = _two_nodes(job.command_spec("allreduce.py", str(tmp_path)))
    other = tmp_path / "other.yaml"
    other.write_text(spec.read_text() + "env: {X: '1'}\n")
    argv = [*job.argv(spec)[:3], "agent"]
    node0 = subprocess.Popen(
        [*argv, str(spec), "--rdzv", "127.0.0.2:0", "--node-rank", "0", "--runs-dir", str(job.runs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (said := re.search(r"waiting for 1 more node\(s\) at 127.0.0.2:(\d+)", node0.stdout.readline())):
        assert node0.poll() is None and time.monotonic() < deadline, "node 0 did not start"
    rdzv = f"127.0.0.2:{said.group(1)}"
    node1 = subprocess.run(
        [*argv, str(other), "--rdzv", rdzv, "--node-rank", "1", "--addr", "127.0.0.3", "--runs-dir", str(job.runs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert node1.returncode == 2 and "its job spec differs from node 0's" in node1.stderr
    out, _ = node0.communicate(timeout=60)
    assert node0.returncode == 1 and "node 1 (127.0.0.3) cannot run the job: its job spec differs" in out
    assert not any(tmp_path.glob("rank-*.json"))  # no worker ran


@pytest.mark.parametrize("parallel", ["{}", "{dp_replicate: 2, dp_shard: 2}"], ids=["fsdp", "hsdp"])
def test_two_nodes_train_with_the_losses_of_one_node(job: Job, tmp_path: Path, parallel: str) -> None:
    """2 nodes x 2 processes against 1 node x 4: the same ranks in the same mesh, so the same losses (HSDP:
    replicated across the nodes, sharded within each)."""
    _, one = _run(job, _spec(job, tmp_path / "one", nodes=1, procs=4, parallel=parallel), local_nodes=False)
    _, two = _run(job, _spec(job, tmp_path / "two", parallel=parallel))
    assert _losses(two) == _losses(one) and len(_losses(one)) == STEPS


def test_a_lost_node_is_replaced_by_the_spare_and_the_weights_end_bitwise_identical(
    job: Job, tmp_path: Path, clean: tuple[Path, Path]
) -> None:
    clean_run, clean_ckpt = clean
    """Node 1 frozen (its agent and workers stopped: a hung machine, which answers nothing): found lost by its
    silence, replaced by the spare; the frozen processes are killed when the job ends."""
    sup, run = _launch(job, _spec(job, tmp_path / "ckpt", extra=", spare_nodes: 1"))
    first = _after_checkpoint(sup, run)
    node1 = descendants(_agent_pid(run, 1))
    killed = time.time()
    try:
        signal_all(node1, signal.SIGSTOP)
        out, _ = sup.communicate(timeout=300)
    finally:
        sup.kill()
    assert sup.returncode == 0, out[-4000:]
    (lost,) = _events(run, "node_lost")
    assert lost["node"] == 1 and lost["addr"] == "127.0.0.3" and not lost["closed"]  # frozen: its tether stays open
    assert lost["ts"] - killed <= 5.0  # resilience.node_timeout_s: 5 by default
    assert "node 1 (127.0.0.3) lost: no heartbeat from its agent" in out
    (changed,) = _events(run, "nodes_changed")
    assert changed["change"] == "node 1 replaced by spare node 2 (lost)" and changed["members"] == [0, 2]
    second = _events(run, "attempt_started")[1]
    assert (first["nodes"], second["nodes"]) == ({"0": 0, "1": 1}, {"0": 0, "1": 2})
    wait_gone([*node1, *first["pids"].values()])  # the frozen node's processes, killed with its agent
    summary = out[out.index("── phalanx run") :]
    assert "1. node 1 (127.0.0.3) lost" in summary and "replaced by spare node 2" in summary
    a = _weights(clean_ckpt, tmp_path / "a.pt", STEPS)
    b = _weights(tmp_path / "ckpt", tmp_path / "b.pt", STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(run) == _losses(clean_run)  # every step, redone ones included, has the clean run's loss


@pytest.fixture(scope="module")
def clean_in_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A clean run of the in-process job."""
    return _clean_run(tmp_path_factory, "clean-in-process", _in_process_spec)


def _spares_ready(sup: subprocess.Popen[str], run: Path) -> None:
    """Wait until node 2's spares wait for a rank: a node lost from then on is recovered in process."""
    deadline = time.monotonic() + 120
    while not (run / "events.jsonl").is_file() or not _events(run, "spares_ready"):
        assert sup.poll() is None and time.monotonic() < deadline, "the spare node's spares never got ready"
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["killed", "frozen", "rank crashed", "killed, memory stale"])
def test_a_lost_node_is_recovered_in_process_by_the_spare_nodes_warm_spares(
    job: Job, tmp_path: Path, clean_in_process: tuple[Path, Path], how: str
) -> None:
    """Node 1's agent and workers killed (found lost at once: its tether closed), frozen (found by its
    silence; the survivors waiting on its ranks in a collective cut their connections to get out), or only its
    rank 3 killed (a GPU failure, say: node 1 is replaced whole and waits as a spare), at a step the test draws:
    the spare node's warm spares take ranks 2 and 3 with their state from node 0's memory (or, where the
    snapshots are older than the storage checkpoint, every rank from that checkpoint), ranks 0 and 1 keep their
    processes, no attempt restarts, and the job ends with the clean run's weights and losses."""
    clean_run, clean_ckpt = clean_in_process
    at = random.randrange(12, 40)
    stale = how == "killed, memory stale"  # the snapshot taken as training began, then none: storage is newer
    sup, run = _launch(job, _in_process_spec(job, tmp_path / "ckpt", memory_every_steps=1000 if stale else 1))
    _spares_ready(sup, run)
    first = _after_checkpoint(sup, run, steps=at)
    node1 = descendants(_agent_pid(run, 1))
    struck = [first["pids"]["3"]] if how == "rank crashed" else node1
    try:
        signal_all(struck, signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
        out, _ = sup.communicate(timeout=300)
    finally:
        signal_all(node1, signal.SIGKILL)  # a frozen node's processes, if the job did not end them
        sup.kill()
    assert sup.returncode == 0, f"{how} after step {at}: " + out[-4000:]
    if how == "rank crashed":
        (failed,) = _events(run, "worker_failed")
        assert failed["rank"] == 3 and not _events(run, "node_lost")
        assert "node 1 replaced by spare node 2" in out and "a spare node took this node's ranks" in out
    else:
        (lost,) = _events(run, "node_lost")
        assert lost["node"] == 1 and lost["closed"] == (how != "frozen")  # killed: its tether, at once
    (began,) = _events(run, "recovery_started")
    assert (began["node"], began["spare_node"], began["ranks"]) == (1, 2, [2, 3])
    assert [began["pids"][r] for r in "01"] == [first["pids"][r] for r in "01"]  # the survivors kept their processes
    (recovered,) = _events(run, "recovered_in_process")
    assert recovered["ranks"] == [2, 3] and recovered["source"] == ("storage" if stale else "memory"), recovered
    if stale:  # the newest checkpoint committed by then (its write may have gone on beside a step or two)
        committed = [e["step"] for e in _events(run, "checkpoint_committed") if e["ts"] < recovered["ts"]]
        assert recovered["step"] == max(committed), (recovered, committed)
    else:
        assert recovered["lost_steps"] <= 1, recovered  # a snapshot every step
    assert len(_events(run, "attempt_started")) == 1 and not _events(run, "restart_scheduled")
    assert f"warm spares took node 1's ranks on spare node 2, step {recovered['step']} from" in out
    if how != "rank crashed":
        wait_gone(node1)
    a = _weights(clean_ckpt, tmp_path / "a.pt", 60)
    b = _weights(tmp_path / "ckpt", tmp_path / "b.pt", 60)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{how} after step {at}"
    assert _losses(run) == _losses(clean_run)  # every step, one run again included, has the clean run's loss


def test_a_crash_on_the_node_that_took_a_lost_ones_place_is_seen_and_restarts(
    job: Job, tmp_path: Path, clean_in_process: tuple[Path, Path]
) -> None:
    """After node 2's spares took node 1's ranks in process, they are that node's workers: one of them killed is
    reported by node 2's agent as the failure, and not recovered in process (too soon after the last recovery,
    and no spare node is ready in this attempt): the job restarts from its checkpoint, and still ends with the
    clean run's weights and losses."""
    clean_run, clean_ckpt = clean_in_process
    sup, run = _launch(job, _in_process_spec(job, tmp_path / "ckpt"))
    try:
        _spares_ready(sup, run)
        first = _after_checkpoint(sup, run, steps=12)
        deadline = time.monotonic() + 120
        os.kill(first["pids"]["3"], signal.SIGKILL)
        while not _events(run, "recovered_in_process"):
            assert sup.poll() is None and time.monotonic() < deadline, "no recovery in process"
            time.sleep(0.05)
        (began,) = _events(run, "recovery_started")
        os.kill(began["pids"]["2"], signal.SIGKILL)  # rank 2, now node 2's
        out, _ = sup.communicate(timeout=300)
    finally:
        sup.kill()
    assert sup.returncode == 0, out[-4000:]
    failed = _events(run, "worker_failed")
    assert [(f["rank"], f["node"]) for f in failed] == [(3, 1), (2, 2)], failed
    (refused,) = _events(run, "in_process_refused")  # too soon after the last recovery, or no spare ready
    assert (refused["rank"], refused["node"]) == (2, 2), refused
    assert len(_events(run, "attempt_started")) == 2
    a = _weights(clean_ckpt, tmp_path / "a.pt", 60)
    b = _weights(tmp_path / "ckpt", tmp_path / "b.pt", 60)
    assert all(torch.equal(a[k], b[k]) for k in a) and _losses(run) == _losses(clean_run)


def test_without_a_spare_allow_shrink_goes_on_with_one_node(job: Job, tmp_path: Path, clean: tuple[Path, Path]) -> None:
    clean_run, _ = clean
    sup, run = _launch(job, _spec(job, tmp_path / "ckpt"))
    _after_checkpoint(sup, run)
    os.kill(_agent_pid(run, 1), signal.SIGKILL)
    out, _ = sup.communicate(timeout=300)
    assert sup.returncode == 0, out[-4000:]
    (lost,) = _events(run, "node_lost")  # found by its tether's closing, not after node_timeout_s of silence
    assert lost["closed"] and "node 1 (127.0.0.3) lost: its agent's connection to node 0 closed" in out
    assert "shrinking to 1 node(s) without node 1 (lost); no spare left" in out
    assert "nodes: 1" in (run / "spec.attempt-1.yaml").read_text()
    second = _events(run, "attempt_started")[1]
    assert second["nodes"] == {"0": 0} and len(second["pids"]) == 2
    # The checkpoint of 4 ranks, resharded into 2; the global batch kept: the curve of the 2-node run.
    after = {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl") if m["ts"] > second["ts"]}
    expected = _losses(clean_run)
    assert max(after) == STEPS - 1
    assert [after[s] for s in sorted(after)] == pytest.approx([expected[s] for s in sorted(after)], rel=1e-4)


def test_a_lost_node_started_again_rejoins_as_a_spare_and_the_shrunk_job_grows_back(job: Job, tmp_path: Path) -> None:
    """Node 1's agent killed with no spare: the job shrinks to node 0. An agent started again for node 1 (as a
    cluster manager would, on that machine) rejoins as a spare, and once the shrunk attempt has trained
    regrow_after_s the job checkpoints and grows back to both nodes."""
    spec = _spec(job, tmp_path / "ckpt", steps=200, resilience=", regrow_after_s: 1")
    sup, run = _launch(job, spec)
    _after_checkpoint(sup, run)
    os.kill(_agent_pid(run, 1), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while len(_events(run, "attempt_started")) < 2:  # shrunk to node 0
        assert sup.poll() is None and time.monotonic() < deadline, "the job did not go on without node 1"
        time.sleep(0.05)
    rdzv = re.search(r"waiting for 1 more node\(s\) at (\S+) ", (run / "logs" / "supervisor.log").read_text())
    assert rdzv is not None
    argv = [*job.argv(spec)[:3], "agent", str(spec), "--rdzv", rdzv.group(1), "--node-rank", "1", "--addr", "127.0.0.3"]
    again = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        out, _ = sup.communicate(timeout=300)
        said, _ = again.communicate(timeout=60)
    finally:
        sup.kill()
        again.kill()
    assert sup.returncode == 0 and again.returncode == 0, out[-3000:] + said[-2000:]
    assert "shrinking to 1 node(s) without node 1 (lost); no spare left" in out
    assert "node 1 (127.0.0.3) rejoined as a spare" in out and "growing back to 2 node(s) with node(s) 1" in out
    assert [e["nodes"] for e in _events(run, "attempt_started")] == [{"0": 0, "1": 1}, {"0": 0}, {"0": 0, "1": 1}]
    assert (run / "spec.attempt-1.yaml").is_file() and len(_events(run, "regrow_stop")) == 1
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")][-1] == 199


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_when_the_rendezvous_host_dies_or_freezes_every_node_stops_and_says_why(
    job: Job, tmp_path: Path, sig: signal.Signals
) -> None:
    """Node 0's whole process tree killed (its sockets closed) or stopped (what a frozen or powered-off machine
    looks like: no FIN, no RST; the other agents' calls on its store get no answer): every other agent stops
    its workers, records why and exits within node_timeout_s (+ 2 s), and no process of the job is left."""
    sup, run = _launch(job, _spec(job, tmp_path / "ckpt", extra=", spare_nodes: 1"))
    first = _after_checkpoint(sup, run, steps=2)
    (joined,) = _events(run, "nodes_joined")
    agents = [a["pid"] for a in joined["agents"].values()]
    node0 = descendants(_agent_pid(run, 0))
    struck = time.time()
    try:
        signal_all(node0, sig)
        out, _ = sup.communicate(timeout=120)
    finally:  # a failure leaves nothing frozen behind: the agents die with `--local-nodes`, workers with them
        signal_all(node0, signal.SIGKILL)
        sup.kill()
    assert sup.returncode == 1, out[-4000:]
    wait_gone([*agents, *first["pids"].values(), *node0])  # node 0's frozen tree killed by `--local-nodes`
    lost = _events(run, "rendezvous_lost")
    assert sorted(e["node"] for e in lost) == [1, 2]  # the member and the spare
    assert all(e["ts"] - struck <= 5.0 + 2.0 for e in lost), [e["ts"] - struck for e in lost]
    result = json.loads((run / "result.json").read_text())
    assert result["outcome"] == "failed" and result["failed_node"] == 0 and result["node_lost"]
    assert result["reason"].startswith("node 0 (127.0.0.2), the rendezvous host, lost")
    # each survivor told the cluster manager (here `--local-nodes`, which then killed what was left of node 0)
    assert out.count("killing this node's workers and exiting (running kill -USR1") == 2, out[-4000:]
    if sig == signal.SIGSTOP:
        assert "did not answer within 5 s" in result["reason"] or "heartbeat stopped" in result["reason"]
        assert "node 0 was found lost: killing its agent (pid" in out


def test_a_hung_worker_on_node_1_dumps_every_node_stacks_and_the_job_restarts(job: Job, tmp_path: Path) -> None:
    sup, run = _launch(job, _spec(job, tmp_path / "ckpt"))
    first = _after_checkpoint(sup, run, steps=2)
    os.kill(first["pids"]["3"], signal.SIGSTOP)
    out, _ = sup.communicate(timeout=300)
    assert sup.returncode == 0, out[-4000:]
    (found,) = _events(run, "hang_detected")
    # The stopped rank cannot answer the stack dump; every other rank, on both nodes, writes its stacks.
    assert (found["rank"], found["node"], found["unresponsive"]) == (3, 1, [3]) and found["host"]
    assert sorted(Path(p).name for p in found["stacks"]) == [f"rank-{r}.stacks.txt" for r in range(3)]
    assert "Thread" in (run / "logs" / "rank-2.stacks.txt").read_text()  # on node 1
    assert "failed: rank 3 on node 1 (127.0.0.3, host" in out and "hung: no progress past step" in out
    assert [e["attempt"] for e in _events(run, "attempt_started")] == [0, 1]
    assert max(_losses(run)) == STEPS - 1


def test_node_policy_replaces_then_excludes_then_shrinks() -> None:
    nodes = Nodes(2, allow_shrink=True, min_nodes=1)
    nodes.add_spare(2)
    assert nodes.after_failure(1, lost=False) == "node 1 replaced by spare node 2"
    assert (nodes.members, nodes.spares) == ([0, 2], [1])  # alive: it waits as a spare
    assert nodes.after_failure(2, lost=False) == "node 2 replaced by spare node 1"
    # node 1's second attempt as a member, and it failed first again: out for good
    assert nodes.after_failure(1, lost=False) == (
        "node 1 replaced by spare node 2 (first to fail in 2 of its attempts in a row)"
    )
    assert (nodes.members, nodes.spares, list(nodes.out)) == ([0, 2], [], [1])
    assert nodes.after_failure(0, lost=False) is None  # node 2's failures were not in a row: 0 failed between
    assert nodes.after_failure(2, lost=False) is None  # once, no spare: the same nodes again
    assert nodes.after_failure(2, lost=True).startswith("shrinking to 1 node(s) without node 2 (lost)")
    assert nodes.members == [0]
    fixed = Nodes(2, allow_shrink=False, min_nodes=1)
    with pytest.raises(NoCapacity, match=r"node 1 is lost and no spare node is left.*allow_shrink: true"):
        fixed.after_failure(1, lost=True)
    kept = Nodes(2, allow_shrink=False, min_nodes=1)
    assert kept.after_failure(0, lost=False) is None and kept.after_failure(0, lost=False) is None
    assert kept.members == [0, 1] and not kept.out  # failing twice, but the job cannot run without it


def test_liveness_finds_a_silent_side_within_the_timeout() -> None:
    """A dead side's counter is read again and again, unchanged: that must not count as a beat."""
    watch = Liveness(5.0)
    watch.observe("a", 1, now=0.0)
    watch.observe("a", 2, now=BEAT_S)  # its last beat
    watch.observe("b", 7, now=0.0)
    for poll in range(1, 50):  # every side read each 0.1 s: a's counter stays at 2, b's keeps moving
        watch.observe("a", 2, now=BEAT_S + poll * 0.1)
        watch.observe("b", 7 + poll, now=poll * 0.1)
    assert watch.gone(now=5.0 - 0.01) == []
    assert watch.gone(now=5.0 + 0.01) == ["a"]  # at most 5 s after it died (after its last beat)
