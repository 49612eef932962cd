"""The supervisor's view of a run: the progress it follows, the console it draws, the summary and loss curve
it leaves. These read and write real run-directory files; the end-to-end runs are in test_resilience."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from rich.console import Console as RichConsole

from phalanx.obs import EventLog, RunDir, read_jsonl
from phalanx.obs.console import Console
from phalanx.obs.digest import digest
from phalanx.obs.goodput import write_ledger
from phalanx.obs.plot import plot_loss
from phalanx.obs.progress import ProgressFeed, clock, step_line
from phalanx.obs.rundir import Outcome, RunResult
from phalanx.obs.summary import summary


def _append(path: Path, *records: dict, partial: str = "") -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + partial)


def test_progress_follows_the_file_and_waits_for_whole_lines(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    progress = ProgressFeed(metrics, total_steps=100)
    assert progress.poll() == [] and progress.eta_s() is None  # no file yet
    _append(metrics, {"step": 0, "ts": 10.0, "loss": 5.0, "step_time_s": 3.0}, partial='{"step": 1, "ts"')
    assert [r["step"] for r in progress.poll()] == [0]
    assert progress.eta_s() == 99 * 3.0  # one step: its own step time is the pace
    with metrics.open("a") as f:
        f.write(': 12.0, "loss": 4.0}\n')
    assert [r["step"] for r in progress.poll()] == [1] and progress.poll() == []
    assert progress.eta_s() == 98 * 2.0  # the interval between steps, which counts what the step time leaves out


def test_eta_takes_the_pace_of_consecutive_steps_only(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    progress = ProgressFeed(metrics, total_steps=20)
    _append(metrics, *({"step": s, "ts": float(s)} for s in range(6)))
    # A restart: back to the checkpoint at step 4, 60 s later. The gap is recovery, not the pace of a step.
    _append(metrics, {"step": 4, "ts": 65.0}, {"step": 5, "ts": 66.0}, {"step": 6, "ts": 67.0})
    progress.poll()
    assert progress.eta_s() == 13 * 1.0
    assert ProgressFeed(metrics, total_steps=None).eta_s() is None
    # the server's digest (the dashboard's ETA) takes the same pace: a slow last step (a checkpoint) and a
    # script's record without a whole step do not swing it
    _append(metrics, {"step": 7, "ts": 77.0, "step_time_s": 10.0}, {"step": "?", "ts": 78.0})
    (tmp_path / "events.jsonl").write_text(json.dumps({"ts": 0.0, "kind": "run_started"}) + "\n")
    said = digest(RunDir(tmp_path))
    assert said is not None and said.pace_s == 1.0 and said.steps_done == 8 and said.steps_run == 11


def test_step_line_and_status_show_what_the_step_reported() -> None:
    record = {"step": 9, "loss": 2.5, "tokens_per_s": 12345.6, "mfu": 0.4212, "lr": 1e-3, "custom": 7}
    assert step_line(record, 60) == "step    10/60 | loss   2.5000 | lr 1.00e-03 | tok/s    12,346 | mfu  42.1%"
    assert step_line({"step": 0}, None) == "step     1"
    assert clock(3725.4) == "1:02:05"


def test_status(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    progress = ProgressFeed(metrics, total_steps=10)
    assert progress.status(4.0, 0) == "waiting for the first step | 0:00:04 elapsed"
    _append(metrics, {"step": 0, "ts": 0.0, "loss": 3.0, "grad_norm": 1.0}, {"step": 1, "ts": 2.0, "loss": 2.0})
    progress.poll()
    assert progress.status(30.0, 2) == ("step     2/10 | loss   2.0000 | 0:00:30 elapsed | ETA 0:00:16 | 2 restart(s)")


def test_console_keeps_a_live_status_line_below_the_output() -> None:
    out = io.StringIO()
    console = Console(out, live=True)
    console.status("step 1/10 | ETA 0:00:09")
    console.line("[rank0]: hello")
    console.status("step 2/10 | ETA 0:00:08")
    console.end_status()
    console.line("done")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the terminal's control sequences
    assert "step 1/10" in text and "step 2/10" in text
    assert text.index("[rank0]: hello") < text.index("step 2/10") < text.rindex("done")

    plain = io.StringIO()
    quiet = Console(plain)  # not a terminal: no status line, just the lines
    quiet.status("step 1/10")
    quiet.line("[phalanx] a [bold]line[/] with brackets")
    assert plain.getvalue() == "[phalanx] a [bold]line[/] with brackets\n"


def _run_with_a_restart(tmp_path: Path) -> RunDir:
    """A run of 10 steps over 20 s, by its clock: a second each; steps 4 and 5 run twice (rank 1 killed after
    step 5, the restart from step 4's checkpoint), so 10 s are productive, 2 lost, and the rest is start-up,
    the failure's detection, the recovery and the end."""
    run = RunDir.create(tmp_path, "t")
    events = EventLog(run.events)
    metrics = EventLog(run.metrics)
    events.emit("run_started", ts=0.0)
    events.emit("attempt_started", attempt=0, ts=1.0)
    for step in range(6):  # steps 0-5 end at t=3..8
        metrics.write(step=step, loss=5.0 - step * 0.5, step_time_s=1.0, ts=3.0 + step)
    events.emit("worker_failed", rank=1, ts=9.0)
    events.emit(
        "restart_scheduled",
        restart=1,
        backoff_s=1.0,
        failure="infrastructure",
        cause="killed by SIGKILL",
        reason="rank 1 was killed by SIGKILL after step 5",
        ts=9.5,
    )
    events.emit("attempt_started", attempt=1, ts=10.0)
    for step in range(4, 10):  # steps 4-9 again, ending at t=12..17
        metrics.write(step=step, loss=3.0 - step * 0.1, step_time_s=1.0, ts=8.0 + step)
        if step == 7:
            events.emit("bad_step_skipped", step=8, loss=float("nan"), problem="loss is nan", policy="skip", ts=15.5)
    events.emit("run_finished", ts=20.0)
    run.write_result(RunResult(Outcome.SUCCEEDED, 0, "all workers exited", str(run.root)))
    return run


def test_the_ledger_accounts_for_every_second(tmp_path: Path) -> None:
    ledger = write_ledger(_run_with_a_restart(tmp_path))
    assert ledger.wall_s == 20.0 and ledger.goodput == 0.5
    assert ledger.seconds == {
        "productive": 10.0,  # steps 0-3 of the first attempt, 4-9 of the second
        "lost": 2.0,  # steps 4 and 5 of the first attempt, redone
        "checkpoint": 0.0,
        "data": 0.0,
        "detection": 1.0,  # from the last step (t=8) to the failure seen (t=9)
        "recovery": 2.0,  # then to the second attempt's first step's start (t=11)
        "idle": 5.0,  # the first attempt's start-up (t=0..2), the end after the last step (t=17..20)
    }


def test_summary_says_the_outcome_each_restart_and_the_goodput(tmp_path: Path) -> None:
    run = _run_with_a_restart(tmp_path)
    ledger = write_ledger(run)
    plot = plot_loss(run)
    out = io.StringIO()
    last = list(read_jsonl(run.metrics))[-1]
    RichConsole(file=out, width=200).print(summary(run, ledger, last, 10, plot))
    said = out.getvalue()
    assert "succeeded (exit code 0): all workers exited" in said
    assert "steps      10 of 10, last loss 2.1000" in said
    assert "restarts   1:\n" in said and "1. rank 1 was killed by SIGKILL after step 5 (infrastructure)" in said
    assert "goodput    50.0% of 20.0 s: productive 10.0 s, lost 2.0 s, detection 1.0 s, recovery 2.0 s, idle" in said
    assert f"loss curve {run.root / 'loss.png'}" in said


def test_loss_curve_is_a_png_and_needs_steps(tmp_path: Path) -> None:
    run = _run_with_a_restart(tmp_path)
    plot = plot_loss(run)
    assert plot == run.root / "loss.png" and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = RunDir.create(tmp_path, "empty")
    EventLog(empty.events).emit("run_started")
    assert plot_loss(empty) is None and not (empty.root / "loss.png").exists()  # no steps: no curve


def test_a_line_still_being_written_is_not_read_yet(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    log.emit("one")
    log.emit("two")
    with open(log.path, "a") as f:
        f.write('{"ts": 3.0, "kind": "thr')  # the writer is mid-line
    assert [e["kind"] for e in read_jsonl(log.path)] == ["one", "two"]


def test_the_ledger_of_a_run_still_going_accounts_for_every_second_so_far(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    started = [{"ts": 100.0, "kind": "run_started"}, {"ts": 101.0, "kind": "attempt_started", "attempt": 0}]
    run.events.write_text("".join(json.dumps(e) + "\n" for e in started))
    steps = [{"ts": 102.0 + step, "step": step, "step_time_s": 1.0} for step in range(10)]  # after the last event
    run.metrics.write_text("".join(json.dumps(m) + "\n" for m in steps))
    book = write_ledger(run)
    assert book.wall_s == 111.0 - 100.0
    assert all(s >= 0 for s in book.seconds.values()), book.seconds
    assert abs(sum(book.seconds.values()) - book.wall_s) < 1e-9
