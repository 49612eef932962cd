"""phalanx's scheduler against the baselines on Philly's October and November 2017 (bench/RESULTS.md,
docs/scheduling.md).

    python bench/scheduler.py [--seeds 3] [--traces ../shared/traces] [--out section.md]

1. Each month on a cluster it loads (October: 640 GPUs = 80 nodes x 8 in 10 racks; November, a quieter month:
   448 GPUs in 7 racks), the virtual clusters as tenants of one cohort with quotas from their GPU-time before
   the month, checkpoints every 30 min, commits of 20 s + 1.25 s per GPU, restarts 60 s; once per seed, every
   policy in the same run: ratios of phalanx to the baselines, mean +- sd over the seeds. Then phalanx and
   Tiresias-like again at a pessimistic setting: commits of 300 s + 1.25 s per GPU, restarts 300 s.
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
from dataclasses import replace
from pathlib import Path

from _report import Report

from phalanx.control.scheduler import Cluster, Job, Node, PredictiveLas, Queue, State, Tenant
from phalanx.control.sim.report import COLUMNS, metrics
from phalanx.control.sim.scenario import Scenario, replay
from phalanx.control.sim.simulator import ReplayCosts, split_gpus

REPO = Path(__file__).resolve().parent.parent
POLICIES = ["phalanx", "fifo", "kueue-like", "tiresias-like"]
MONTHS = [("October", "2017-10-01", "2017-11-01", 10), ("November", "2017-11-01", "2017-12-01", 7)]  # racks of 64
PESSIMISTIC = ReplayCosts(restart_s=300.0, commit_s=300.0)
PHILLY_SIZES = {1: 44972, 2: 783, 4: 792, 8: 572, 12: 7, 16: 42, 24: 4, 32: 20}  # October 2017's jobs


def mean_sd(values: list[float], fmt: str = "{:,.0f}") -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{fmt.format(statistics.fmean(values))} +- {fmt.format(sd)}"


def replays(report: Report, base: Scenario, month: str, seeds: int, policies: list[str]) -> list[dict]:
    """Every policy's replay of ``base`` once per seed: a table of means +- sd, and each seed's metrics."""
    per_seed, took = [], []
    for seed in range(seeds):
        began = time.monotonic()
        results = replay(replace(base, seed=seed), policies, workers=2)
        took.append(time.monotonic() - began)
        per_seed.append({name: metrics(r, results.get("fifo")) for name, r in results.items()})
        print(f"{month}, seed {seed}: {took[-1]:.0f} s", file=sys.stderr, flush=True)
    columns = [c for c in COLUMNS if c[1] not in ("policy", "big_over_fifo")]
    rows = []
    for name in policies:
        ms = [seed[name] for seed in per_seed]
        rows.append([name] + [mean_sd([getattr(m, attr) for m in ms], fmt) for _, attr, fmt in columns])
    report.table([month] + [heading for heading, _, _ in columns], rows)
    bound = statistics.fmean(r.duration for r in results[policies[0]].shared.records.values())
    report.note(
        f"{month} ({base.gpus} GPUs): the jobs' mean duration is {bound:,.0f} s, the floor of any policy's "
        f"average JCT ({bound / statistics.fmean(s['tiresias-like'].avg_jct for s in per_seed):.3f}x "
        f"Tiresias-like's). One seed's replays (every tenant alone on its quota too, for rho; 2 processes): "
        f"{mean_sd(took)} s."
    )
    return per_seed


def ratio(per_seed: list[dict], attr: str, peer: str) -> list[float]:
    """phalanx's figure over the peer's, per seed (a peer's zero wait counts as 1 s)."""
    return [getattr(s["phalanx"], attr) / max(getattr(s[peer], attr), 1.0) for s in per_seed]


def compare(report: Report, trace: Path, seeds: int) -> None:
    for month, start, end, racks in MONTHS:
        base = Scenario(trace, start, end, racks=racks)
        per_seed = replays(report, base, month, seeds, POLICIES)
        report.ratio(
            f"{month}: phalanx / tiresias-like, avg JCT", ratio(per_seed, "avg_jct", "tiresias-like"), "<= 0.95"
        )
        report.ratio(
            f"{month}: phalanx / tiresias-like, p99 JCT", ratio(per_seed, "p99_jct", "tiresias-like"), "<= 1.0"
        )
        report.ratio(f"{month}: phalanx / kueue-like, avg JCT", ratio(per_seed, "avg_jct", "kueue-like"))
        report.ratio(f"{month}: phalanx / fifo, mean wait of >=32-GPU jobs", ratio(per_seed, "wait_big", "fifo"),
                     "<= 1.0")  # fmt: skip
        report.ratio(f"{month}: phalanx, share of jobs with rho <= 1", [s["phalanx"].rho_le_1 for s in per_seed],
                     ">= 0.95", unit="")  # fmt: skip
        pessimistic = replays(report, replace(base, costs=PESSIMISTIC), f"{month}, pessimistic", seeds,
                              ["phalanx", "tiresias-like"])  # fmt: skip
        report.ratio(f"{month}, pessimistic: phalanx, GPU-hours lost / used",
                     [s["phalanx"].lost_share for s in pessimistic], "<= 0.005", unit="")  # fmt: skip
        report.ratio(f"{month}, pessimistic: phalanx / tiresias-like, avg JCT",
                     ratio(pessimistic, "avg_jct", "tiresias-like"), "<= 0.95")  # fmt: skip


def synthetic(seed: int = 0, lender_gpus: int = 0) -> tuple[State, PredictiveLas]:
    """The 10,000-GPU cluster and its 50,000 pending jobs; with ``lender_gpus``, a 201st tenant with that quota
    (taken from the others') and no jobs yet: its quota is lent out as the others fill the cluster."""
    rng = random.Random(seed)
    nodes = [Node(f"n{i:04d}", f"r{i // 16:03d}", 8) for i in range(1250)]
    tenants = [Tenant(f"t{i:03d}", 50 - lender_gpus // 200, "all") for i in range(200)]
    tenants += [Tenant("lender", lender_gpus, "all")] if lender_gpus else []
    policy = PredictiveLas()
    state = State(Cluster(nodes), tenants, Queue(policy.key))
    sizes, weights = list(PHILLY_SIZES), list(PHILLY_SIZES.values())
    for i in range(50_000):
        gpus = rng.choices(sizes, weights)[0]
        workers, per_worker = split_gpus(gpus, 8)
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
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trace = args.traces / "philly_pollux_jobs.csv"
    if not trace.is_file():
        sys.exit(f"{trace}: not found; give --traces, the folder holding philly_pollux_jobs.csv")
    report = Report(
        "Scheduler",
        "python bench/scheduler.py",
        "Philly (Pollux authors' table): the jobs submitted in October 2017 on 640 GPUs (80 nodes x 8, 10 racks) "
        "and in November 2017 on 448 GPUs (7 racks); tenants: the virtual clusters, in one cohort, quotas "
        "proportional to their GPU-time before the month (the past only), borrowing on; checkpoints every "
        "30 min; every policy's victims checkpoint on SIGTERM, their save commits in 20 s + 1.25 s per GPU; "
        "restart 60 s; the pessimistic rows: 300 s + 1.25 s per GPU and 300 s (phalanx's cost model told so, as "
        f"an operator tells its server). {args.seeds} seeds (submit jitter up to 60 s, checkpoint phases): mean "
        "+- sd. Durations are the trace's; phalanx predicts them from each tenant's finished jobs only. Waits "
        "count every time a job is pending, after preemptions too. rho: a tenant whose quota cannot carry its "
        "month's GPU-time alone is not replayed alone; its jobs count as rho <= 1.",
    )
    compare(report, trace, args.seeds)
    throughput(report)
    report.finish(args.out)


if __name__ == "__main__":
    main()
