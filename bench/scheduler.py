"""phalanx's scheduler against the baselines on Philly's October 2017 (bench/RESULTS.md, docs/scheduling.md).

    python bench/scheduler.py [--seeds 5] [--traces ../shared/traces] [--out section.md]

1. The default replay (640 GPUs = 80 nodes x 8 in 10 racks, the virtual clusters as tenants of one cohort,
   checkpoints every 30 min, restarts 60 s) once per seed, every policy in the same run: ratios of phalanx
   to the baselines, mean +- sd over the seeds.
2. Decision throughput of the core on a synthetic 10,000-GPU cluster (1,250 nodes x 8, racks of 16 nodes,
   200 tenants, 50,000 pending jobs of Philly's size mix), on one core: the round that fills the empty
   cluster, rounds after single job ends, and a round that plans reclaim preemptions.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from _report import Report

from phalanx.control.scheduler import Cluster, Job, Node, Phalanx, Queue, State, Tenant
from phalanx.control.sim.report import COLUMNS, metrics
from phalanx.control.sim.scenario import Scenario, replay
from phalanx.control.sim.simulator import gang

REPO = Path(__file__).resolve().parent.parent
POLICIES = ["phalanx", "fifo", "kueue-like", "tiresias-like"]
PHILLY_SIZES = {1: 44972, 2: 783, 4: 792, 8: 572, 12: 7, 16: 42, 24: 4, 32: 20}  # October 2017's jobs


def mean_sd(values: list[float], fmt: str = "{:,.0f}") -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{fmt.format(statistics.fmean(values))} +- {fmt.format(sd)}"


def replays(report: Report, trace: Path, seeds: int) -> None:
    per_seed, took, phalanx_s = [], [], []
    for seed in range(seeds):
        began = time.monotonic()
        results = replay(Scenario(trace, seed=seed), POLICIES, workers=2)
        took.append(time.monotonic() - began)
        per_seed.append({name: metrics(r, results["fifo"]) for name, r in results.items()})
        phalanx_s.append(results["phalanx"].shared.wall_s)
        print(f"seed {seed}: {took[-1]:.0f} s", file=sys.stderr, flush=True)
    columns = [c for c in COLUMNS if c[1] not in ("policy", "big_over_fifo")]  # that one is a ratio below
    rows = []
    for name in POLICIES:
        ms = [seed[name] for seed in per_seed]
        rows.append([name] + [mean_sd([getattr(m, attr) for m in ms], fmt) for _, attr, fmt in columns])
    report.table(["policy"] + [heading for heading, _, _ in columns], rows)
    ph = [seed["phalanx"] for seed in per_seed]
    ratio = lambda a, peer: [getattr(s["phalanx"], a) / getattr(s[peer], a) for s in per_seed]  # noqa: E731
    report.ratio("phalanx / tiresias-like, avg JCT", ratio("avg_jct", "tiresias-like"), "<= 0.75")
    report.ratio("phalanx / kueue-like, avg JCT", ratio("avg_jct", "kueue-like"), "<= 0.35")
    report.ratio("phalanx / tiresias-like, p99 JCT", ratio("p99_jct", "tiresias-like"), "<= 1.0")
    report.ratio("phalanx / fifo, avg JCT", ratio("avg_jct", "fifo"))
    report.ratio("phalanx, GPU-hours lost / used", [m.lost_share for m in ph], "<= 0.01", unit="")
    report.ratio("phalanx, share of jobs with rho <= 1", [m.rho_le_1 for m in ph], ">= 0.95", unit="")
    report.ratio("phalanx, >=32-GPU jobs waiting > 1.5x their FIFO wait", [m.big_over_fifo for m in ph], "<= 0", "")
    bound = statistics.fmean(r.duration for r in results["fifo"].shared.records.values())
    report.note(
        f"The October jobs' mean duration is {bound:,.0f} s: no policy's average JCT can be below it (a job "
        "finishes no sooner than its work), so an avg-JCT ratio under "
        f"{bound / statistics.fmean(s['tiresias-like'].avg_jct for s in per_seed):.2f}x Tiresias-like or "
        f"{bound / statistics.fmean(s['kueue-like'].avg_jct for s in per_seed):.2f}x Kueue-like cannot be reached "
        "on this scenario."
    )
    report.ratio("phalanx's October replay, s / 300 s", [r / 300 for r in phalanx_s], "<= 1")
    report.note(
        f"Wall time of one seed's replays (4 policies, and every tenant alone on its quota for rho; 2 processes): "
        f"{mean_sd(took)} s; phalanx's October replay alone: {mean_sd(phalanx_s)} s."
    )


def synthetic(seed: int = 0, lender_gpus: int = 0) -> tuple[State, Phalanx]:
    """The 10,000-GPU cluster and its 50,000 pending jobs; with ``lender_gpus``, a 201st tenant with that quota
    (taken from the others') and no jobs yet: its quota is lent out as the others fill the cluster."""
    rng = random.Random(seed)
    nodes = [Node(f"n{i:04d}", f"r{i // 16:03d}", 8) for i in range(1250)]
    tenants = [Tenant(f"t{i:03d}", 50 - lender_gpus // 200, "all") for i in range(200)]
    tenants += [Tenant("lender", lender_gpus, "all")] if lender_gpus else []
    policy = Phalanx()
    state = State(Cluster(nodes), tenants, Queue(policy.key))
    sizes, weights = list(PHILLY_SIZES), list(PHILLY_SIZES.values())
    for i in range(50_000):
        gpus = rng.choices(sizes, weights)[0]
        workers, per_worker = gang(gpus, 8)
        tenant = tenants[int(rng.paretovariate(1.2)) % 200].name  # a few big tenants, a long tail
        state.submit(Job(f"j{i}", tenant, workers, per_worker, float(i) * 0.01, 0,
                         rng.lognormvariate(7.5, 1.6)))  # fmt: skip
    return state, policy


def throughput(report: Report) -> None:
    state, policy = synthetic()
    now = 1000.0
    began = time.perf_counter()
    first = policy.schedule(state, now)
    fill_s = time.perf_counter() - began
    for admit in first.admit:
        state.start(admit.job, admit.placement, now)
    rng = random.Random(1)
    latencies, admitted = [], 0
    for _ in range(300):
        now += 1.0
        state.stop(rng.choice(sorted(state.running)), now)
        began = time.perf_counter()
        decided = policy.schedule(state, now)
        latencies.append(time.perf_counter() - began)
        for admit in decided.admit:
            state.start(admit.job, admit.placement, now)
        admitted += len(decided.admit)
        for preempt in decided.preempt:
            state.ask_to_evict(preempt.job, preempt.for_job)
            state.requeue(preempt.job, now)
    # reclaim: an idle tenant's quota is lent out; it asks for it back
    state2, _ = synthetic(seed=2, lender_gpus=400)
    fill = policy.schedule(state2, now)
    for admit in fill.admit:
        state2.start(admit.job, admit.placement, now)
    for i in range(4):
        state2.submit(Job(f"lender-{i}", "lender", 8, 8, now, 0, 3600.0))
    for i in range(64):
        state2.submit(Job(f"lender-small-{i}", "lender", 1, 1, now, 0, 3600.0))
    began = time.perf_counter()
    reclaim = policy.schedule(state2, now + 1)
    reclaim_s = time.perf_counter() - began
    latencies.sort()
    p99 = latencies[int(0.99 * len(latencies))]
    report.table(
        ["round", "admissions", "time", "admissions/s"],
        [
            ["fill the empty cluster", len(first.admit), f"{fill_s * 1000:,.0f} ms",
             f"{len(first.admit) / fill_s:,.0f}"],
            ["300 rounds, each after one job ends", admitted, f"{sum(latencies) * 1000:,.0f} ms",
             f"{admitted / sum(latencies):,.0f}"],
            ["reclaim for 4 x 64-GPU and 64 x 1-GPU jobs", f"{len(reclaim.preempt)} preemptions",
             f"{reclaim_s * 1000:,.0f} ms", ""],
        ],
    )  # fmt: skip
    report.ratio("admissions/s, filling the cluster, / 2,000", len(first.admit) / fill_s / 2000, ">= 1")
    report.ratio("p99 round after a job ends, ms / 5 ms", p99 * 1000 / 5, "<= 1")
    report.ratio("preemption-planning round, ms / 500 ms", reclaim_s * 1000 / 500, "<= 1")
    report.note(
        f"Rounds after a job ends: median {statistics.median(latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"with {len(state.queue):,} jobs pending and {len(state.running):,} running. Anchors: Kueue about 43 "
        "admissions/s in its own performance tests, Slurm 500 jobs/s, KAI 8.97 s per reclaim at 500 nodes."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trace = args.traces / "philly_pollux_jobs.csv"
    if not trace.is_file():
        sys.exit(f"{trace}: not found; give --traces, the folder holding philly_pollux_jobs.csv")
    report = Report(
        "Scheduler",
        "python bench/scheduler.py",
        f"Philly (Pollux authors' table), jobs submitted 2017-10-01..2017-11-01, on 640 GPUs (80 nodes x 8, 10 "
        f"racks); tenants: the 15 virtual clusters, quotas proportional to their GPU-time share over the whole "
        f"file, one cohort, borrowing on; checkpoints every 30 min, restart 60 s, phalanx's checkpoint-first "
        f"victims commit in 30 s. {args.seeds} seeds (submit jitter up to 60 s, checkpoint phases): mean +- sd. "
        "Durations are the trace's; phalanx predicts them from each tenant's finished jobs only.",
    )
    replays(report, trace, args.seeds)
    throughput(report)
    report.finish(args.out)


if __name__ == "__main__":
    main()
