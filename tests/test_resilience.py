"""The flagship: a deterministic training run interrupted by random kills and a hang recovers by itself and
ends exactly where a run never interrupted ends.

Over 400 lines on purpose: the flagship run and every detector and policy it relies on (hang, straggler, NaN,
shrink, goodput, chaos) are tested on the same job, so that one file says what "recovers by itself" means."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, Job
from phalanx.obs import RunDir, read_jsonl
from phalanx.obs.goodput import write_ledger
from phalanx.resilience import (
    Failure,
    HangDetector,
    Kind,
    Stall,
    Straggler,
    StragglerDetector,
    backoff_s,
    classify_exit,
)
from phalanx.resilience.elastic import Capacity, resized
from phalanx.resilience.straggler import WINDOW
from phalanx.spec import SpecError, parse_spec
from phalanx.train.guard import LossGuard

STEPS = 40


def _spec(
    job: Job, ckpt: Path, steps: int = STEPS, resilience: str = "hang_timeout_s: 3", parallel: str = "{}"
) -> Path:
    return job.spec(
        "name: t\nresources: {procs_per_node: 2, device: cpu}\n"
        f"train: {{model: {{preset: llama-tiny}}, parallel: {parallel}, steps: {steps}, global_batch: 8,"
        " micro_batch: 2, seq_len: 32,"
        " optimizer: {lr: 3.0e-3, warmup_steps: 2}}\n"
        f"checkpoint: {{dir: '{ckpt}', every_steps: 4, keep_last: 2}}\n"
        f"resilience: {{max_restarts: 5, restart_backoff_s: 0, stop_grace_s: 5, {resilience}}}\n"
    )


def _weights(ckpt: Path, out: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(ckpt / f"step-{steps:08d}", out)
    return torch.load(out, weights_only=False)["train"]["model"]


def _launch(job: Job, spec: Path, *options: str) -> tuple[subprocess.Popen[str], Path]:
    """Start ``phalanx run`` (with ``options``) in the background; return it and its run directory once that
    exists."""
    before = set((job.runs / "t").iterdir()) if (job.runs / "t").is_dir() else set()
    sup = subprocess.Popen(
        [*job.argv(spec), *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
    )
    deadline = time.monotonic() + 120
    while not (new := set((job.runs / "t").iterdir()) - before if (job.runs / "t").is_dir() else set()):
        assert sup.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.02)
    (run,) = new
    return sup, run


def _when_attempt_progressed(
    sup: subprocess.Popen[str], run: Path, attempt: int, steps: int, committed: bool = False
) -> dict[int, int]:
    """Wait until ``attempt`` of the run has reported ``steps`` steps (and, with ``committed``, committed a
    checkpoint); return its workers' pids by rank."""
    deadline = time.monotonic() + 240
    while True:
        assert sup.poll() is None and time.monotonic() < deadline, f"attempt {attempt} did not get that far"
        events = list(read_jsonl(run / "events.jsonl")) if (run / "events.jsonl").is_file() else []
        started = [e for e in events if e["kind"] == "attempt_started"]
        saved = any(e["kind"] == "checkpoint_committed" and e["attempt"] == attempt for e in events)
        if len(started) > attempt and (run / "metrics.jsonl").is_file() and (saved or not committed):
            done = sum(1 for m in read_jsonl(run / "metrics.jsonl") if m["ts"] > started[attempt]["ts"])
            if done >= steps:
                return {int(rank): int(pid) for rank, pid in started[attempt]["pids"].items()}
        time.sleep(0.02)


def test_random_kills_and_a_hang_end_bitwise_identical(job: Job, tmp_path: Path) -> None:
    straight = job.run(_spec(job, tmp_path / "straight"), timeout=300)
    assert straight.returncode == 0, straight.stdout[-3000:]
    (straight_run,) = (job.runs / "t").iterdir()
    expected = {m["step"]: m["loss"] for m in read_jsonl(straight_run / "metrics.jsonl")}

    launched = time.time()
    sup, run = _launch(job, _spec(job, tmp_path / "chaos"))
    rng = random.Random(7)
    for attempt, sig in enumerate([signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP]):  # two crashes, a hang
        pids = _when_attempt_progressed(sup, run, attempt, rng.randint(3, 8), committed=attempt == 0)
        os.kill(pids[rng.randint(0, 1)], sig)
    out, _ = sup.communicate(timeout=240)
    assert sup.returncode == 0, out[-4000:]
    ran_s = time.time() - launched

    events = list(read_jsonl(run / "events.jsonl"))
    assert [e["kind"] for e in events if e["kind"] in ("worker_failed", "hang_detected")] == [
        "worker_failed",
        "worker_failed",
        "hang_detected",
    ]
    assert [e["attempt"] for e in events if e["kind"] == "attempt_started"] == [0, 1, 2, 3]
    # Every step's loss, in every attempt that ran it (steps redone after a failure appear again), is the
    # uninterrupted run's: the same samples in the same order, none skipped, none repeated within a run.
    seen = [(m["step"], m["loss"], m["ts"]) for m in read_jsonl(run / "metrics.jsonl")]
    assert {s for s, _, _ in seen} == set(range(STEPS))
    assert all(loss == expected[s] for s, loss, _ in seen)
    # Each attempt ran a contiguous range of steps, from a checkpoint (a multiple of every_steps) no later than
    # where the attempt before it stopped.
    starts = [e["ts"] for e in events if e["kind"] == "attempt_started"]
    ends = [*starts[1:], float("inf")]
    ranges = [[s for s, _, ts in seen if lo < ts < hi] for lo, hi in zip(starts, ends, strict=True)]
    assert all(r == list(range(r[0], r[-1] + 1)) for r in ranges if r) and ranges[0][0] == 0
    for before, after in itertools.pairwise(ranges):
        assert after[0] % 4 == 0 and after[0] <= before[-1] + 1
    assert ranges[-1][-1] == STEPS - 1
    a = _weights(tmp_path / "straight", tmp_path / "a.pt")
    b = _weights(tmp_path / "chaos", tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The ledger accounts for the lost time: redone steps, the hang's detection, three recoveries.
    ledger = json.loads((run / "goodput.json").read_text())
    spent, wall = ledger["seconds"], ledger["wall_s"]
    assert sum(spent.values()) == pytest.approx(wall, rel=0.01) and 0 < wall < ran_s  # within the run's own time
    assert spent["lost"] > 0 and spent["recovery"] > 0 and spent["detection"] >= 3.0  # hang_timeout_s: 3
    # The end summary names each restart's cause; the loss curve is drawn, an attempt a line.
    said = out[out.index("── phalanx run") :]
    assert (
        f"goodput    {spent['productive'] / wall:.1%} of {wall:.1f} s: productive" in said and "restarts   3:" in said
    )
    causes = re.findall(r"^ +(\d)\. rank \d (was killed by SIGKILL|hung)", said, re.MULTILINE)
    assert causes == [("1", "was killed by SIGKILL"), ("2", "was killed by SIGKILL"), ("3", "hung")]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _chaos(job: Job, *args: str) -> subprocess.Popen[str]:
    """`phalanx chaos` on the job's newest running run, started before the job so that its start-up (Python,
    torch) is not a race against a short job: it waits for the run to appear."""
    argv = [sys.executable, "-m", "phalanx", "chaos", str(job.runs / "t"), *args, "--timeout-s", "120"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _chaos_loss(
    job: Job, spec: Path, at_step: int, fault: str = "nan"
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run the job, and with `phalanx chaos` poison (nan | spike) the step after ``at_step``; the run's output
    and directory."""
    chaos = _chaos(job, fault, "--at-step", str(at_step))
    sup, run = _launch(job, spec)
    _, said = chaos.communicate(timeout=180)
    assert chaos.returncode == 0 and "took a" in said, said
    out, _ = sup.communicate(timeout=240)
    return subprocess.CompletedProcess(sup.args, sup.returncode, out, ""), run


def test_nan_rollback_replays_from_the_checkpoint_and_ends_bitwise_identical(job: Job, tmp_path: Path) -> None:
    straight = job.run(_spec(job, tmp_path / "straight", steps=32), timeout=300)
    assert straight.returncode == 0, straight.stdout[-3000:]
    result, run = _chaos_loss(job, _spec(job, tmp_path / "nan", steps=32, resilience="on_nan: rollback"), 6)
    assert result.returncode == 0, result.stdout[-3000:]
    (rollback,) = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "bad_step_rollback"]
    assert rollback["to_step"] % 4 == 0 and rollback["to_step"] < rollback["step"]
    assert f"rolled back to the checkpoint of step {rollback['to_step']}, replaying from it" in result.stdout
    a = _weights(tmp_path / "straight", tmp_path / "a.pt", 32)
    b = _weights(tmp_path / "nan", tmp_path / "b.pt", 32)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the transient fault left no trace


@pytest.mark.parametrize(
    "fault, at_step, steps, parallel",
    [("nan", 4, 30, "{}"), ("spike", 12, 40, "{}"), ("nan", 4, 30, "{pp: 2}"), ("spike", 12, 40, "{pp: 2}")],
    ids=["nan", "spike", "nan-pipeline", "spike-pipeline"],  # a pipeline's rank 0 computes no loss
)
def test_a_bad_step_is_skipped_and_training_goes_on(
    job: Job, tmp_path: Path, fault: str, at_step: int, steps: int, parallel: str
) -> None:
    spec = _spec(job, tmp_path / "ckpt", steps=steps, resilience="on_nan: skip", parallel=parallel)
    result, run = _chaos_loss(job, spec, at_step, fault)
    assert result.returncode == 0, result.stdout[-3000:]
    (skipped,) = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "bad_step_skipped"]
    assert "batch skipped (resilience.on_nan: skip)" in result.stdout
    assert skipped["problem"].startswith("non-finite loss" if fault == "nan" else "loss spike")
    losses = {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}
    bad, good = losses.pop(skipped["step"] - 1), list(losses.values())
    assert sorted([*losses, skipped["step"] - 1]) == list(range(steps))
    assert math.isnan(bad) if fault == "nan" else bad > 3 * statistics.median(good)
    assert all(math.isfinite(v) and v < 3 * statistics.median(good) for v in good)


def test_nan_stop_fails_and_is_not_retried(job: Job, tmp_path: Path) -> None:
    result, run = _chaos_loss(job, _spec(job, tmp_path / "ckpt", steps=200, resilience="on_nan: stop"), 4)
    assert result.returncode == 1
    assert "BadLoss: non-finite loss nan" in result.stdout and "(resilience.on_nan: stop)" in result.stdout
    assert "not restarting" in result.stdout
    assert [e["kind"] for e in read_jsonl(run / "events.jsonl")].count("attempt_started") == 1


def test_ledger_attributes_every_second(tmp_path: Path) -> None:
    """A hand-made timeline: attempt 0 runs steps 0-2 and crashes; attempt 1 resumes at step 2 and finishes."""
    run = RunDir(tmp_path)
    events = [
        ("run_started", 100.0),
        ("attempt_started", 100.0),  # start-up until the first step begins at 104
        ("worker_failed", 109.0),  # the last step ended at 107: 2 s to see the failure and stop the workers
        ("attempt_started", 110.0),  # recovery 109 -> 113 (the first step of attempt 1 begins at 113)
        ("run_finished", 120.0),
    ]
    steps = [  # (step, end, step time, checkpoint blocking, data wait, beside a background checkpoint write)
        (0, 105.0, 1.0, 0.0, 0.0, False),
        (1, 106.0, 1.0, 0.5, 0.0, False),
        (2, 107.0, 1.0, 0.0, 0.25, False),  # redone in attempt 1: lost
        (2, 114.0, 1.0, 0.0, 0.0, False),
        (3, 116.0, 2.0, 0.0, 0.0, True),  # 1 s slower than its attempt's other step: the write's cost
    ]  # then 4 s of end of run (final save, shutdown): idle
    run.events.write_text("".join(json.dumps({"kind": k, "ts": ts}) + "\n" for k, ts in events))
    run.metrics.write_text(
        "".join(
            json.dumps(
                {"step": s, "ts": ts, "step_time_s": took, "checkpoint_s": c, "data_wait_s": d, "checkpoint_writing": w}
            )
            + "\n"
            for s, ts, took, c, d, w in steps
        )
    )
    ledger = write_ledger(run)
    assert ledger.wall_s == 20.0
    assert ledger.seconds == {
        "productive": 1 + 0.5 + 1 + 1,  # step 0, step 1 less its checkpoint, step 2 (again), step 3 less the write's
        "lost": 0.75,
        "checkpoint": 0.5 + 1,
        "data": 0.25,
        "detection": 2.0,
        "recovery": 1.0 + 3.0,
        "idle": 4.0 + 4.0,
    }
    assert sum(ledger.seconds.values()) == ledger.wall_s
    assert json.loads(run.goodput.read_text())["goodput"] == pytest.approx(3.5 / 20)


def test_chaos_kill_then_corrupt(job: Job, tmp_path: Path) -> None:
    """`phalanx chaos kill` at a random step of a running job: it restarts and finishes; `chaos corrupt`
    then breaks its newest checkpoint, and verification says so."""
    spec = _spec(job, tmp_path / "ckpt", steps=12)
    kill = _chaos(job, "kill", "--at-step", "3-6", "--seed", "1")
    sup, run = _launch(job, spec)
    _, said = kill.communicate(timeout=180)
    assert kill.returncode == 0 and "with SIGKILL" in said, said
    chaos = [sys.executable, "-m", "phalanx", "chaos", str(run)]
    out, _ = sup.communicate(timeout=240)
    assert sup.returncode == 0 and "was killed by SIGKILL" in out and "restart 1/5" in out, out[-3000:]
    late = subprocess.run([*chaos, "kill"], capture_output=True, text=True)
    assert late.returncode == 1 and "has finished" in late.stderr
    job_id = subprocess.run([*chaos[:-1], "t-0123abcd", "kill"], capture_output=True, text=True, timeout=60)
    assert job_id.returncode == 1 and "t-0123abcd: no such run directory" in job_id.stderr  # at once, not in 600 s
    corrupt = subprocess.run([*chaos, "corrupt"], capture_output=True, text=True)
    assert corrupt.returncode == 0 and "step-00000012" in corrupt.stderr, corrupt.stderr
    verify = subprocess.run(
        [sys.executable, "-m", "phalanx", "ckpt", "verify", str(tmp_path / "ckpt")], text=True, capture_output=True
    )
    assert verify.returncode == 1 and "does not match its xxh3_128" in verify.stdout


def test_a_slowed_rank_is_reported_as_a_straggler(job: Job, tmp_path: Path) -> None:
    spec = job.spec(
        "name: t\nresources: {procs_per_node: 2, device: cpu}\n"
        "train: {model: {preset: llama-debug}, steps: 60, global_batch: 8, micro_batch: 4, seq_len: 64,"
        " optimizer: {warmup_steps: 2}}\n"
        f"checkpoint: {{dir: '{tmp_path / 'ckpt'}', every_steps: 1000}}\nresilience: {{straggler_factor: 1.3}}\n"
    )
    slow = _chaos(job, "slow", "--rank", "1", "--slow-s", "12", "--slow-speed", "0.3", "--at-step", "3")
    sup, run = _launch(job, spec)
    _, said = slow.communicate(timeout=180)
    assert slow.returncode == 0 and "slowed rank 1" in said, said
    out, _ = sup.communicate(timeout=240)
    assert sup.returncode == 0, out[-3000:]
    assert "rank 1 on node 0" in out and "is a straggler" in out
    # rank 1, slowed, is reported (a loaded machine can make the other rank look slow for a while too)
    found = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "straggler" and e["rank"] == 1]
    assert found and all(e["compute_s"] > 1.3 * e["others_s"] for e in found), found


def test_failure_classification_and_backoff() -> None:
    assert classify_exit(-signal.SIGKILL, "") == Failure(Kind.INFRASTRUCTURE, "killed by SIGKILL", "killed")
    assert classify_exit(1, "ValueError: bad lr").kind is Kind.USER
    assert classify_exit(1, "ValueError: bad lr").category == "user_error"
    assert classify_exit(1, "RuntimeError: NCCL timeout").category == "crash"
    assert classify_exit(1, "phalanx.train.trainer.BadLoss: loss nan").kind is Kind.USER
    assert classify_exit(1, "torch.distributed.DistBackendError: connection reset").retryable
    assert classify_exit(3, "").why == "exited with code 3 without recording an error"
    assert [backoff_s(n, 1.0) for n in (1, 2, 3, 7, 8)] == [1.0, 2.0, 4.0, 60.0, 60.0]
    assert backoff_s(3, 0.0) == 0.0


def test_hang_timeout_and_the_rank_behind() -> None:
    auto = HangDetector("auto")
    assert auto.timeout_s() == 120.0  # the floor, before any step was timed
    for step in range(5):
        auto.observe(0, step, 100.0 * step)
    assert auto.timeout_s() == 300.0  # 3x the p99 of 100 s steps
    fixed = HangDetector(5.0)
    fixed.observe(0, 7, 0.0)
    fixed.observe(1, 6, 1.0)
    assert fixed.stalled(4.5) is None
    assert fixed.stalled(5.5) == Stall(rank=1, step=7, silent_s=5.5, timeout_s=5.0)  # behind, 7 steps done


def test_straggler_detector() -> None:
    even, slow = StragglerDetector(1.5), StragglerDetector(1.5)
    for step in range(WINDOW):
        for rank in range(4):
            even.observe(rank, step, 0.010)
            slow.observe(rank, step, 0.030 if rank == 2 else 0.010)
    assert even.check() is None
    assert slow.check() == Straggler(rank=2, compute_s=0.030, others_s=0.010)
    assert slow.check() is None  # reported once per attempt


def test_a_slot_that_keeps_failing_is_left_out_then_taken_back(job: Job, tmp_path: Path) -> None:
    """allow_shrink: rank 1 is killed first in two attempts in a row; the job goes on with one process, from its
    checkpoint resharded, with the global batch and the loss curve of the two-process run; after
    regrow_after_s it stops itself (checkpointing) and goes on with both processes again. The one process is
    held (SIGSTOP) from its first step until the supervisor decides to grow back, so that neither a fast
    machine (finishing before the regrow) nor a slow one changes what happens."""
    straight = job.run(_spec(job, tmp_path / "straight", steps=120), timeout=300)
    assert straight.returncode == 0, straight.stdout[-3000:]
    (straight_run,) = (job.runs / "t").iterdir()
    expected = {m["step"]: m["loss"] for m in read_jsonl(straight_run / "metrics.jsonl")}
    resilience = "allow_shrink: true, regrow_after_s: 0.5, hang_timeout_s: 60"
    sup, run = _launch(job, _spec(job, tmp_path / "shrink", steps=120, resilience=resilience))
    os.kill(_when_attempt_progressed(sup, run, 0, 5, committed=True)[1], signal.SIGKILL)
    os.kill(_when_attempt_progressed(sup, run, 1, 1)[1], signal.SIGKILL)
    alone = _when_attempt_progressed(sup, run, 2, 1)[0]
    os.kill(alone, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not any(e["kind"] == "regrow_stop" for e in read_jsonl(run / "events.jsonl")):
        assert sup.poll() is None and time.monotonic() < deadline, "no regrow while the process was held"
        time.sleep(0.02)
    os.kill(alone, signal.SIGCONT)  # it takes the supervisor's SIGTERM now, and checkpoints
    out, _ = sup.communicate(timeout=240)
    assert sup.returncode == 0, out[-4000:]
    assert "shrinking to 1 process(es) without local slot 1" in out and "growing back to 2 process(es)" in out
    assert "[rank0]: rank 0 stopped by SIGTERM: emergency checkpoint of step" in out  # before it was stopped
    events = list(read_jsonl(run / "events.jsonl"))
    (shrunk,) = [e for e in events if e["kind"] == "shrunk"]
    assert shrunk["slots"] == [0] and shrunk["procs"] == 1
    (grown,) = [e for e in events if e["kind"] == "grown"]
    assert grown["slots"] == [1] and grown["procs"] == 2
    assert [len(e["pids"]) for e in events if e["kind"] == "attempt_started"] == [2, 2, 1, 2]
    resized = (run / "spec.attempt-2.yaml").read_text()
    assert "procs_per_node: 1" in resized and "dp_shard: -1" in resized
    starts = [e["ts"] for e in events if e["kind"] == "attempt_started"]
    seen = list(read_jsonl(run / "metrics.jsonl"))
    on_one = {m["step"]: m["loss"] for m in seen if starts[2] < m["ts"] < starts[3]}
    on_two = {m["step"]: m["loss"] for m in seen if m["ts"] > starts[3]}
    assert on_one and max(on_two) == 119 and min(on_two) <= max(on_one) + 1
    assert [on_one[s] for s in sorted(on_one)] == pytest.approx([expected[s] for s in sorted(on_one)], rel=1e-4)
    assert [on_two[s] for s in sorted(on_two)] == pytest.approx([expected[s] for s in sorted(on_two)], rel=1e-3)


def test_capacity_excludes_a_slot_only_after_failures_in_a_row() -> None:
    capacity = Capacity(4, allow_shrink=True, min_procs=3, regrow_after_s=10.0)
    assert capacity.after_failure(1) is None and capacity.after_failure(2) is None  # different ranks: no streak
    assert capacity.after_failure(2) == 2 and capacity.slots == [0, 1, 3]
    assert capacity.after_failure(2) is None and capacity.after_failure(2) is None  # rank 2 is now slot 3: min 3
    assert capacity.slots == [0, 1, 3]
    assert capacity.regrow() == [2] and capacity.slots == [0, 1, 2, 3]
    assert capacity.after_failure(2) == 2  # on probation: its first failure leaves it out again
    assert capacity.regrow_after_s == 20.0
    capacity.keep(2)
    assert capacity.slots == [0, 1, 2, 3]
    off = Capacity(2, allow_shrink=False, min_procs=1)
    assert off.after_failure(1) is None and off.after_failure(1) is None and off.slots == [0, 1]


def test_resized_spec_refills_the_shard_degree_or_says_why_not() -> None:
    spec = parse_spec(
        "name: t\nresources: {procs_per_node: 4, device: cpu}\n"
        "train: {parallel: {tp: 2, dp_shard: 2}, global_batch: 8, micro_batch: 2, optimizer: {warmup_steps: 2}}\n"
    )
    kept = {"pp": 1, "pp_schedule": "1F1B", "pp_stages_per_rank": 1, "dp_replicate": 1, "tp": 2}
    assert resized(spec, 2).parallel.model_dump() == {**kept, "dp_shard": 1}
    with pytest.raises(SpecError) as e:
        resized(spec, 3)  # 3 ranks do not divide by tp 2
    assert [issue.path for issue in e.value.issues] == ["train.parallel"]


def test_loss_guard() -> None:
    guard = LossGuard(spike_factor=3.0, on_nan="skip")
    assert guard.problem(float("nan"), 1.0) == "non-finite loss nan / grad norm 1.0"
    assert guard.problem(2.0, float("inf")) == "non-finite loss 2.0 / grad norm inf"
    assert guard.problem(100.0, 1.0) is None  # no history yet: a spike cannot be judged
    for loss in [5.0, 4.0, 3.5, 3.0, 3.0, 2.9, 2.8, 2.8, 2.7, 2.6]:
        guard.good(loss)
    assert guard.problem(8.0, 1.0) is None and guard.problem(9.0, 1.0).startswith("loss spike 9 (over 3x")
    assert LossGuard(spike_factor=None, on_nan="skip").problem(1e9, 1.0) is None
