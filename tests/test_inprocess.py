"""In-process recovery: a killed rank is replaced by a warm spare while the other ranks keep their processes,
the state comes back from the ranks' memory, and the run ends exactly where an uninterrupted run ends. What
it cannot handle falls back to a restart from the last checkpoint, and the events say which path was taken."""

from __future__ import annotations

import copy
import datetime
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore
from torch.utils._pytree import tree_flatten

from conftest import REPO, Job, wait_gone
from phalanx.checkpoint.memory import restore, serialize
from phalanx.launch import priority
from phalanx.launch.zygote import Forked, Zygote
from phalanx.obs import protocol, read_jsonl
from phalanx.spec import SpecError, parse_spec
from test_resilience import _weights

# Long enough that the three kills, each after a spare is ready (seconds on a loaded 2-core machine, while the job
# trains on at a tenth of a second a step), and the hang after them all land before the job's end.
STEPS = 200
AUTOGROUPS = Path("/proc/self/autogroup").exists()


def _spec(job: Job, ckpt: Path, steps: int = STEPS, in_process: bool = True, extra: str = "") -> Path:
    return job.spec(
        "name: t\nresources: {procs_per_node: 2, device: cpu}\n"
        f"train: {{model: {{preset: llama-tiny}}, steps: {steps}, global_batch: 8, micro_batch: 2, seq_len: 32,"
        " optimizer: {lr: 3.0e-3, warmup_steps: 2}}\n"
        f"checkpoint: {{dir: '{ckpt}', every_steps: 8, keep_last: 2}}\n"
        "resilience: {max_restarts: 30, restart_backoff_s: 0, stop_grace_s: 5, hang_timeout_s: 3, "
        f"in_process: {str(in_process).lower()}{extra}}}\n"
    )


def _launch(job: Job, spec: Path) -> tuple[subprocess.Popen[str], Path]:
    """Start ``phalanx run`` in the background, its output to a file (a long run would fill a pipe nobody reads
    until the end); return it and its run directory once that exists."""
    before = set((job.runs / "t").glob("*/events.jsonl"))
    out = (job.tmp / "out.txt").open("w")
    sup = subprocess.Popen(job.argv(spec), stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    found = _wait(sup, "the run directory", lambda: set((job.runs / "t").glob("*/events.jsonl")) - before)
    return sup, next(iter(found)).parent


def _output(job: Job, sup: subprocess.Popen[str], timeout: float) -> str:
    sup.wait(timeout=timeout)
    return (job.tmp / "out.txt").read_text()


def _events(run: Path, kind: str) -> list[dict]:
    return (
        [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == kind] if (run / "events.jsonl").is_file() else []
    )


def _steps(run: Path) -> list[dict]:
    return list(read_jsonl(run / "metrics.jsonl")) if (run / "metrics.jsonl").is_file() else []


def _wait(sup: subprocess.Popen[str], what: str, ready, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        assert sup.poll() is None, f"the run ended (exit code {sup.returncode}) before {what}; see its out.txt"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return found


def _current_pids(run: Path) -> dict[int, int]:
    newest = (_events(run, "attempt_started") + _events(run, "recovery_started"))[-1]
    return {int(r): int(p) for r, p in newest["pids"].items()}


def _spare_ready(run: Path) -> bool:
    """Some warm spare of the current attempt says it waits and has no rank yet."""
    started = _events(run, "attempt_started")[-1]
    store = TCPStore(
        started["rendezvous_addr"], started["rendezvous_port"], is_master=False, timeout=datetime.timedelta(seconds=5)
    )
    return any(store.check([protocol.ready_key(i)]) and not store.check([protocol.assign_key(i)]) for i in range(64))


def _kill_after(sup: subprocess.Popen[str], run: Path, rank: int, recoveries: int, steps_after: int) -> None:
    """Once ``recoveries`` in-process recoveries are done, the job has made ``steps_after`` more steps and a
    spare is ready, SIGKILL ``rank``."""
    _wait(sup, f"recovery {recoveries}", lambda: len(_events(run, "recovered_in_process")) >= recoveries)
    since = _events(run, "recovered_in_process")[-1]["ts"] if recoveries else 0.0
    _wait(sup, "steps", lambda: sum(m["ts"] > since for m in _steps(run)) >= steps_after)
    _wait(sup, "a ready spare", lambda: _spare_ready(run))
    os.kill(_current_pids(run)[rank], signal.SIGKILL)


def test_killed_ranks_are_replaced_in_process_bitwise_identical_then_a_hang_restarts(job: Job, tmp_path: Path) -> None:
    straight = job.run(_spec(job, tmp_path / "straight", in_process=False), timeout=300)
    assert straight.returncode == 0, straight.stdout[-3000:]
    (straight_run,) = (job.runs / "t").iterdir()
    expected = {m["step"]: m["loss"] for m in read_jsonl(straight_run / "metrics.jsonl")}

    sup, run = _launch(job, _spec(job, tmp_path / "inprocess"))
    _kill_after(sup, run, rank=1, recoveries=0, steps_after=6)
    _kill_after(sup, run, rank=0, recoveries=1, steps_after=6)  # rank 0 too: it writes the metrics and events
    _kill_after(sup, run, rank=1, recoveries=2, steps_after=3)
    _wait(sup, "the third recovery", lambda: len(_events(run, "recovered_in_process")) >= 3)
    _wait(sup, "a checkpoint", lambda: len(_events(run, "checkpoint_committed")) >= 2)
    if AUTOGROUPS:  # rank 1 is a spare started beside training, at the lowest priority until it took the rank
        assert _session_nice(_current_pids(run)[1]) == priority.NORMAL
    zygote = Path(f"/proc/{_current_pids(run)[1]}/stat").read_text().rsplit(")", 1)[1].split()[1]
    assert b"phalanx.launch.zygote" in Path(f"/proc/{zygote}/cmdline").read_bytes()  # a fork, not a new start
    os.kill(_current_pids(run)[0], signal.SIGSTOP)  # a hang: not recovered in process
    out = _output(job, sup, timeout=240)
    assert sup.returncode == 0, out[-4000:]

    # Three recoveries in process within the first attempt, then the hang's restart from the checkpoint.
    kinds = [
        e["kind"]
        for e in read_jsonl(run / "events.jsonl")
        if e["kind"] in ("attempt_started", "recovery_started", "recovered_in_process", "hang_detected")
    ]
    in_process = ["recovery_started", "recovered_in_process"] * 3
    assert kinds == ["attempt_started", *in_process, "hang_detected", "attempt_started"]
    recovered = _events(run, "recovered_in_process")
    assert [e["ranks"] for e in recovered] == [[1], [0], [1]] and all(e["attempt"] == 0 for e in recovered)
    assert all(e["lost_steps"] <= 1 for e in recovered)  # a snapshot every step: at most the step in flight
    # Every step's loss, before and after each recovery, is the uninterrupted run's; the weights are too.
    seen = _steps(run)
    assert {m["step"] for m in seen} == set(range(STEPS))
    assert all(m["loss"] == expected[m["step"]] for m in seen)
    a = _weights(tmp_path / "straight", tmp_path / "a.pt", STEPS)
    b = _weights(tmp_path / "inprocess", tmp_path / "b.pt", STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The summary says which path each recovery took; the promoted spare writes into its rank's log.
    said = out[out.index("── phalanx run") :]
    assert said.count("in process: warm spares took rank") == 3 and "restarts   4:" in said
    assert "warm spare" in (run / "logs" / "rank-0.log").read_text()
    spent = (run / "goodput.json").read_text()
    assert '"recovery"' in spent


def _session_nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])  # "/autogroup-123 nice 19"


@pytest.mark.skipif(not AUTOGROUPS, reason="this kernel schedules without autogroups")
def test_a_spare_session_gets_the_lowest_priority_and_a_rank_s_back() -> None:
    spare = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert priority.set_session_nice(spare.pid, priority.LOWEST) and _session_nice(spare.pid) == 19
        assert priority.set_session_nice(spare.pid, priority.NORMAL) and _session_nice(spare.pid) == 0
    finally:
        spare.kill()
        spare.wait()
    assert not priority.set_session_nice(spare.pid, priority.LOWEST)  # gone


ZYGOTE_CHILD = """
import os, sys, time
warmed = []
def warm():
    warmed.append(os.getpid())
def main():
    print(os.environ["WHAT"], os.getsid(0) == os.getpid(), warmed == [os.getppid()], flush=True)
    if os.environ["WHAT"] == "raise":
        raise RuntimeError("a worker's error")
    time.sleep(60 if os.environ["WHAT"] == "sleep" else 0)
    sys.exit(3)
"""


def test_the_zygote_forks_workers_and_reports_how_they_end(tmp_path: Path) -> None:
    """What the worker group needs of a forked spare, as of a started one: its own session and output, its exit
    status (only the zygote, its parent, can wait for it), and its death with the zygote."""
    (tmp_path / "child.py").write_text(ZYGOTE_CHILD)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    zygote = Zygote("child", env)
    try:
        for tag, what in (("exits", "exit"), ("raises", "raise"), ("killed", "sleep"), ("orphaned", "sleep")):
            zygote.fork(tag, {**env, "WHAT": what}, priority.LOWEST if what == "sleep" else priority.NORMAL)
        forked: dict[str, Forked] = {}
        deadline = time.monotonic() + 60
        while len(forked) < 4 and time.monotonic() < deadline:
            forked.update(zygote.forked())
            time.sleep(0.01)
        exits, raises, killed, orphaned = (forked[tag] for tag in ("exits", "raises", "killed", "orphaned"))
        assert exits.wait(30) == 3 and exits.stdout.read() == b"exit True True\n"
        assert raises.wait(30) == 1 and b"RuntimeError: a worker's error" in raises.stdout.read()
        if AUTOGROUPS:
            assert _session_nice(killed.pid) == priority.LOWEST
        os.killpg(killed.pid, signal.SIGKILL)
        assert killed.wait(30) == -signal.SIGKILL
    finally:
        zygote.stop()
    assert orphaned.wait(30) == -signal.SIGKILL
    wait_gone([orphaned.pid], timeout=10)  # it died with the zygote


def test_twenty_recoveries_leak_no_memory_and_no_process_groups(job: Job, tmp_path: Path) -> None:
    """Rank 0 survives 20 replacements of rank 1; after each it reports its resident memory and its live process
    groups. Both stay flat: each recovery frees the old groups, model and optimizer."""
    spec = _spec(job, tmp_path / "ckpt", steps=100_000, extra=", warm_spares: 2")
    sup, run = _launch(job, spec)
    for n in range(20):
        _kill_after(sup, run, rank=1, recoveries=n, steps_after=2)
    _wait(sup, "the 20th recovery", lambda: len(_events(run, "recovered_in_process")) >= 20, timeout=180)
    sup.send_signal(signal.SIGTERM)
    out = _output(job, sup, timeout=120)
    assert sup.returncode == 128 + signal.SIGTERM, out[-3000:]
    recovered = _events(run, "recovered_in_process")
    assert len(_events(run, "attempt_started")) == 1 and len(recovered) == 20
    assert {e["process_groups"] for e in recovered} == {recovered[0]["process_groups"]}
    rss = [e["resident_bytes"] for e in recovered]
    early, late = statistics.median(rss[3:8]), statistics.median(rss[-5:])
    assert late < early + 16 * 2**20, f"resident memory grew from {early / 2**20:.0f} to {late / 2**20:.0f} MiB"


def test_a_second_failure_during_a_recovery_falls_back_to_a_restart(job: Job, tmp_path: Path) -> None:
    """Both ranks die at once: the first is being recovered in process when the second is seen, so the job
    restarts from its last checkpoint instead, and still ends as an uninterrupted run does."""
    straight = job.run(_spec(job, tmp_path / "straight", steps=24), timeout=300)
    assert straight.returncode == 0, straight.stdout[-3000:]
    sup, run = _launch(job, _spec(job, tmp_path / "both", steps=24))
    _wait(sup, "a checkpoint", lambda: _events(run, "checkpoint_committed"))
    _wait(sup, "a ready spare", lambda: _spare_ready(run))
    pids = _current_pids(run)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    out = _output(job, sup, timeout=240)
    assert sup.returncode == 0, out[-4000:]
    refused = _events(run, "in_process_refused")
    assert refused and "another failure came during the recovery of rank" in refused[0]["why"], out[-3000:]
    assert len(_events(run, "restart_scheduled")) == 1 and len(_events(run, "attempt_started")) == 2
    a = _weights(tmp_path / "straight", tmp_path / "a.pt", 24)
    b = _weights(tmp_path / "both", tmp_path / "b.pt", 24)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("resources", "extra", "says"),
    [
        ("{procs_per_node: 1}", "", "no rank would survive"),
        ("{procs_per_node: 2}", "command: [python, x.py]\n", "rebuilds the built-in recipe's state"),
    ],
)
def test_in_process_needs_the_recipe_and_two_ranks(resources: str, extra: str, says: str) -> None:
    body = extra or "train: {steps: 10, global_batch: 8, micro_batch: 1}\n"
    with pytest.raises(SpecError) as e:
        parse_spec(f"name: t\nresources: {resources}\n{body}resilience: {{in_process: true}}\n")
    assert "resilience.in_process" in str(e.value) and says in str(e.value)


class _Odd:
    """A Stateful holding tensors a training state can have: 0-d, empty, bool, bf16, a strided view."""

    def __init__(self, base: torch.Tensor, step: int = 7):
        self.tensors = {
            "scalar": base[0, 0].clone(),
            "empty": torch.empty(0, 3),
            "mask": base > 0,
            "bf16": base.to(torch.bfloat16),
            "transposed": base.t(),
            "step": step,
        }

    def state_dict(self) -> dict:
        return self.tensors

    def load_state_dict(self, state: dict) -> None:
        self.tensors = state


def _leaves(state: dict) -> list:
    return tree_flatten({k: copy.deepcopy(v.state_dict()) for k, v in state.items()})[0]


def _same(a: object, b: object) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype
    return type(a) is type(b) and a == b


def test_a_memory_snapshot_restores_every_tensor_exactly_and_stays_unchanged() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    state = {"model": model, "optimizer": optimizer, "odd": _Odd(torch.randn(3, 4))}
    blob = serialize(state)
    kept = blob.clone()
    expected = _leaves(state)

    # A target unlike the state in every value it can hold: other weights, moments, step counts and settings
    fresh = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    other = torch.optim.AdamW(fresh.parameters(), lr=0.5, betas=(0.1, 0.2), eps=0.3, weight_decay=0.4)
    for _ in range(2):
        fresh(torch.randn(4, 5)).sum().backward()
        other.step()
    into = {"model": fresh, "optimizer": other, "odd": _Odd(torch.zeros(3, 4), step=0)}
    differ = [b for a, b in zip(_leaves(into), expected, strict=True) if not _same(a, b)]
    assert sum(not isinstance(b, torch.Tensor) for b in differ) >= 6  # lr, both betas, eps, weight decay, step
    restore(blob, into)
    restored = _leaves(into)
    assert len(restored) == len(expected)
    for a, b in zip(restored, expected, strict=True):  # bit for bit, dtype and shape included
        assert _same(a, b), (a, b)
    odd = into["odd"].tensors
    assert odd["transposed"].shape == (4, 3) and odd["mask"].dtype == torch.bool and odd["step"] == 7
    fresh[0].weight.data.add_(1)  # training on after a restore leaves the snapshot as it was
    next(iter(into["optimizer"].state.values()))["exp_avg"].add_(1)
    assert torch.equal(blob, kept)
