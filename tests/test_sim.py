"""The trace simulator, on a small Philly-format trace the test writes itself (the real traces are not part of
the repository): every policy runs every job to completion, work is conserved, and phalanx's policy is
measured against the baselines in the same replay."""

from __future__ import annotations

import csv
import random
import re
import statistics
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from phalanx.control.scheduler import POLICIES
from phalanx.control.sim.fleet import gavel_fleet
from phalanx.control.sim.scenario import Scenario, replay
from phalanx.control.sim.trace import TraceError, philly, quotas
from phalanx.resilience.simulate import (
    LLAMA3_CAUSES,
    STRATEGIES,
    RecoveryCosts,
    failures_per_s,
    goodput_table,
    run,
    scope_shares,
    storage_interval_s,
)

START = datetime(2017, 10, 1)


def _trace(path: Path, jobs: int = 600, seed: int = 7) -> Path:
    """Philly's columns and size mix, lognormal durations, three virtual clusters, two busy days and the day
    before them."""
    rng = random.Random(seed)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["timestamp", "duration", "num_gpus", "gpu_time", "cluster"])
        for i in range(jobs + jobs // 4):  # a quarter before the window: the past quotas are set from
            submit = START + timedelta(seconds=rng.uniform(-86400, 0) if i >= jobs else rng.uniform(0, 2 * 86400))
            gpus = rng.choices([1, 2, 4, 8, 16, 32], [90, 3, 3, 2, 1, 1])[0]
            duration = round(min(rng.lognormvariate(7.5, 1.6), 4 * 86400), 1)
            vc = rng.choices(["vc-a", "vc-b", "vc-c"], [6, 3, 1])[0]
            out.writerow([submit.isoformat(sep=" "), duration, gpus, duration * gpus, vc])
    return path


def test_the_trace_is_read_in_place_with_quotas_from_past_gpu_time_shares(tmp_path: Path) -> None:
    jobs, shares = philly(_trace(tmp_path / "t.csv"), "2017-10-01", "2017-10-03")
    assert len(jobs) == 600 and all(0 <= j.submit_s < 2 * 86400 for j in jobs)
    assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
    assert sum(shares.values()) == pytest.approx(1.0) and set(shares) == {"vc-a", "vc-b", "vc-c"}
    q = quotas(shares, 64)
    assert sum(q.values()) == 64 and q["vc-a"] > q["vc-b"] > q["vc-c"]
    _, shorter = philly(tmp_path / "t.csv", "2017-10-01", "2017-10-02")  # quotas from the past only: the
    assert shorter == shares  # window's own jobs, and those after it, do not change them
    with pytest.raises(TraceError, match="no GPU-time before 2017-09-01 to set quotas from"):
        philly(tmp_path / "t.csv", "2017-09-01", "2017-10-02")
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,duration\n")
    with pytest.raises(TraceError, match=re.escape("bad.csv: missing column(s) ['cluster', 'gpu_time', 'num_gpus']")):
        philly(bad)


def test_every_policy_finishes_every_job_and_phalanx_beats_fifo(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.csv")
    scenario = Scenario(trace, "2017-10-01", "2017-10-03", racks=2, nodes_per_rack=4, gpus_per_node=8)
    results = replay(scenario, sorted(POLICIES), workers=2)
    jct = {}
    for name, result in results.items():
        records = result.shared.records.values()
        assert len(records) == 600 and all(r.finish is not None for r in records), name
        assert all(r.jct >= r.duration - 1e-6 for r in records), name  # nothing finishes faster than its work
        needed = sum(r.gpus * r.duration for r in records)
        lost = result.shared.lost_gpu_s
        assert result.shared.used_gpu_s == pytest.approx(needed + lost), name  # GPU time: the work, or lost
        jct[name] = statistics.fmean(r.jct for r in records)
        assert set(result.alone_jct) <= set(result.shared.records)  # rho's reference: each tenant alone
    assert jct["phalanx"] < jct["fifo"]
    phalanx = results["phalanx"].shared
    assert phalanx.lost_gpu_s <= 0.01 * phalanx.used_gpu_s


def test_on_three_gpu_types_every_job_runs_where_it_fits_and_no_faster_than_its_best_type(tmp_path: Path) -> None:
    """Gavel's fleet: every job ends, none ever ran on a type where its workload does not fit, none finished
    sooner than its work at its best type's pace; phalanx's speed table learned from the runs."""
    trace = _trace(tmp_path / "t.csv")
    scenario = Scenario(trace, "2017-10-01", "2017-10-03", racks=2, fleet=gavel_fleet(128))
    jobs = {job.id: job for job in scenario.jobs()[0]}
    truth = scenario.fleet.truth
    assert any(len(job.gpu_types) < 3 for job in jobs.values())  # some workloads do not fit on K80s
    for name, result in replay(scenario, ["phalanx", "phalanx-types-ignored", "kueue-like", "gavel-like"]).items():
        for r in result.shared.records.values():
            job = jobs[r.id]
            assert r.finish is not None and set(r.gpu_s_by_type) <= set(job.gpu_types), (name, r)
            assert r.jct >= r.duration / max(truth.speed(job.kind, t) for t in job.gpu_types) - 1e-6, (name, r)
        assert result.alone_jct == {}  # no tenant alone on a fleet of types: no rho
    small = replace(scenario, fleet=gavel_fleet(64))  # 24, 24 and 16 GPUs of a type: 32-GPU jobs never fit
    with pytest.raises(ValueError, match=r"job\(s\) can never start on this cluster, such as philly-\d+ \(32 GPUs\)"):
        replay(small, ["kueue-like"], workers=1)


def test_phalanx_sim_prints_one_row_per_policy_and_refuses_a_missing_trace(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.csv", jobs=200)
    cmd = [sys.executable, "-m", "phalanx", "sim", "trace", str(trace), "--end", "2017-10-03", "--racks", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["phalanx", "fifo", "kueue-like", "tiresias-like"]
    missing = subprocess.run([*cmd[:5], str(tmp_path / "nope.csv")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "nope.csv: no such trace file" in missing.stderr
    bad = subprocess.run([*cmd, "--policies", "sjf"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown polic(ies) ['sjf']" in bad.stderr
    typed = subprocess.run([*cmd[:-1], "2", "--fleet-gavel", "--policies", "phalanx,phalanx-types-ignored"],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert typed.returncode == 0, typed.stderr
    rows = [line.split("│") for line in typed.stdout.splitlines() if line.startswith("│")]
    assert [row[1].strip() for row in rows] == ["phalanx", "phalanx-types-ignored"]
    assert all(row[-3].strip() == "-" for row in rows)  # rho: no tenant replayed alone on a fleet of types


def test_goodput_simulation_matches_young_daly_and_ranks_the_strategies() -> None:
    costs = RecoveryCosts(save_s=0.5, restart_s=60.0)
    gpus = 16_384
    # Restarts with Young/Daly's interval: the simulated waste is the first-order model's, save cost per
    # interval plus, per failure, the restart and half an interval of redone work (Daly 2006), detection too.
    restart = next(s for s in STRATEGIES if s.young_daly and not s.in_process)
    tau = storage_interval_s(restart, gpus, costs)
    mtbf = 1 / failures_per_s(gpus)
    shares = scope_shares()
    detect = shares["hang"] * costs.hang_detect_s + shares["node"] * costs.node_detect_s
    detect += (shares["process"] + shares["fabric"]) * costs.detect_s
    waste = costs.save_s / tau + (tau / 2 + costs.restart_s + detect) / mtbf
    simulated = statistics.mean(run(restart, gpus, costs, 30 * 86400, seed) for seed in range(10))
    assert simulated == pytest.approx(1 - waste, abs=0.002)
    # The detection term alone (0.07 points, under the tolerance above): the same failures (the same seeds),
    # found at once, gain what the model says detection costs; without hangs' or nodes' it would be half.
    at_once = replace(costs, detect_s=0.0, node_detect_s=0.0, hang_detect_s=0.0)
    found_at_once = statistics.mean(run(restart, gpus, at_once, 30 * 86400, seed) for seed in range(10))
    assert found_at_once - simulated == pytest.approx(detect / mtbf, rel=0.25)
    # Young/Daly beats a fixed 30-minute interval, more so as jobs grow; with a minute-long restart, recovering
    # in process with spare nodes beats restarting, and reaches 98% at 16k GPUs.
    rows = {(r.strategy, r.gpus): r.goodput for r in goodput_table([1024, 16_384], costs, days=10, seeds=3)}
    fixed, daly, in_process, spares = (s.name for s in STRATEGIES)
    assert rows[daly, 1024] > rows[fixed, 1024] and rows[daly, 16_384] - rows[fixed, 16_384] > 0.05
    assert rows[spares, 16_384] > rows[in_process, 16_384] > rows[daly, 16_384]
    assert rows[spares, 16_384] >= 0.98
    assert sum(n for _, n, _ in LLAMA3_CAUSES) == 419 and shares["node"] + shares["process"] > 0.85


def test_phalanx_sim_goodput_prints_every_strategy() -> None:
    cmd = [sys.executable, "-m", "phalanx", "sim", "goodput", "--gpus", "1024,16384", "--days", "2", "--seeds", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split("│")[1].strip() for line in done.stdout.splitlines() if line.startswith("│")]
    assert rows == [s.name for s in STRATEGIES] and "one per 50,677 GPU-hours" in done.stderr
    bad = subprocess.run([*cmd[:5], "--gpus", "lots"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--gpus lots" in bad.stderr
