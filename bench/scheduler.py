"""phalanx's scheduler against the baselines on Philly's October and November 2017 (bench/RESULTS.md,
docs/scheduling.md).

    python bench/scheduler.py [--seeds 3] [--traces ../shared/traces] [--sections policies,types,cost,sharing]
        [--out x.md]

1. Each month on a cluster it loads (October: 640 GPUs = 80 nodes x 8 in 10 racks; November, a quieter month:
   448 GPUs in 7 racks), the virtual clusters as tenants of one cohort with quotas from their GPU-time before
   the month, checkpoints every 30 min, commits of 20 s + 1.25 s per GPU, restarts 60 s; once per seed, every
   policy in the same run: ratios of phalanx to the baselines, mean +- sd over the seeds. Then phalanx and
   Tiresias-like again at a pessimistic setting: commits of 300 s + 1.25 s per GPU, restarts 300 s.
   Then, on the same decisions' throughput: 2. below.
2. Decision throughput of the core on a synthetic 10,000-GPU cluster (1,250 nodes x 8, racks of 16 nodes,
   200 tenants, 50,000 pending jobs of Philly's size mix), on one core: the round that fills the empty
   cluster, rounds after single job ends, and a round that plans reclaim preemptions.
3. (section "types", a report of its own) Each month on a fleet of three GPU types with the same GPUs: equal
   thirds of V100, P100 and K80 nodes, each job a workload of Gavel's table (OSDI'20: its measured rates on
   each type; sim/fleet.py) drawn per seed, the trace's durations taken as the P100's; phalanx against its own
   policy with types ignored, Kueue-like with its flavors tried in order (fastest first), and Gavel-like
   (Gavel's max-min fairness over types and its 6-minute rounds: scheduler/gavel.py). October is the month its
   knobs were tuned on; November is held out.
4. (section "cost", a report of its own) The same fleets at Google Cloud's 2020 on-demand prices, phalanx's
   policy: what each tenant and job spends in the month; then the same seed again with every tenant's budget
   at half of what it spent without one, to see whether budgets hold (the scheduling core's rule: a tenant at
   its budget starts nothing more; its running jobs go on).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from _report import Report

from phalanx.control.scheduler import Cluster, Job, Node, PredictiveLas, Queue, State, Tenant
from phalanx.control.sim.fleet import gavel_fleet
from phalanx.control.sim.report import COLUMNS, metrics
from phalanx.control.sim.scenario import Scenario, replay
from phalanx.control.sim.sharing import CHOICES, fill
from phalanx.control.sim.simulator import ReplayCosts, split_gpus
from phalanx.control.sim.trace import alibaba_2023

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


FLEET_POLICIES = ["phalanx", "phalanx-types-ignored", "kueue-like", "gavel-like"]
TYPE_NAMES = [t.name for t in gavel_fleet(64).types]
BUDGET_SHARE = 0.5  # of what each tenant spent without a budget


def fleets(report: Report, trace: Path, seeds: int) -> None:
    """Each month on three GPU types: a table of means +- sd over the seeds, each policy's share of its
    GPU-time on each type, and the ratios of average JCT."""
    columns = [c for c in COLUMNS if c[1] in ("avg_jct", "p50_jct", "p99_jct", "wait_1gpu", "wait_big", "lost_share",
                                              "preemptions_per_job")]  # fmt: skip
    for month, start, end, racks in MONTHS:
        base = Scenario(trace, start, end, racks=racks, fleet=gavel_fleet(racks * 64))
        per_seed, shares, spend, floors, took = [], [], [], [], []
        for seed in range(seeds):
            began, seeded = time.monotonic(), replace(base, seed=seed)
            results = replay(seeded, FLEET_POLICIES, workers=2)
            took.append(time.monotonic() - began)
            per_seed.append({name: metrics(r) for name, r in results.items()})
            shares.append({name: _type_shares(r.shared.records.values()) for name, r in results.items()})
            spend.append({name: sum(r.dollars for r in r.shared.records.values()) for name, r in results.items()})
            floors.append(_best_type_floor(seeded))
            print(f"{month} on three types, seed {seed}: {took[-1]:.0f} s", file=sys.stderr, flush=True)
        rows = []
        for name in FLEET_POLICIES:
            ms = [seed[name] for seed in per_seed]
            row = [name] + [mean_sd([getattr(m, attr) for m in ms], fmt) for _, attr, fmt in columns]
            row += [mean_sd([s[name][t] for s in shares], "{:.0%}") for t in TYPE_NAMES]
            jobs = len(results[name].shared.records)
            row += [mean_sd([s[name] / 1000 for s in spend]), mean_sd([s[name] / jobs for s in spend], "{:.1f}")]
            rows.append(row)
        headings = [heading for heading, _, _ in columns] + [f"GPU-time on {t}" for t in TYPE_NAMES]
        headings += ["spend, k$", "$ per job"]
        report.table([f"{month}, {base.gpus} GPUs: {' / '.join(map(str, base.fleet.nodes))} nodes of "
                      f"{' / '.join(TYPE_NAMES)}", *headings], rows)  # fmt: skip
        held = "tuned on" if month == MONTHS[0][0] else "held out"
        report.ratio(f"{month} ({held}): phalanx / phalanx-types-ignored, avg JCT",
                     ratio(per_seed, "avg_jct", "phalanx-types-ignored"), "<= 0.7")  # fmt: skip
        report.ratio(f"{month} ({held}): phalanx / kueue-like (flavors in order), avg JCT",
                     ratio(per_seed, "avg_jct", "kueue-like"))  # fmt: skip
        report.ratio(f"{month} ({held}): phalanx / gavel-like (max-min fairness, 6-min rounds), avg JCT",
                     ratio(per_seed, "avg_jct", "gavel-like"), "<= 1.0")  # fmt: skip
        report.ratio(f"{month} ({held}): phalanx / phalanx-types-ignored, p99 JCT",
                     ratio(per_seed, "p99_jct", "phalanx-types-ignored"))  # fmt: skip
        report.ratio(f"{month} ({held}): phalanx / phalanx-types-ignored, spend",
                     [s["phalanx"] / s["phalanx-types-ignored"] for s in spend])  # fmt: skip
        report.note(
            f"{month}: every job on its fastest type from its submit, never waiting, would average "
            f"{mean_sd(floors)} s (the floor of any policy's average JCT). One seed's four replays (2 processes): "
            f"{mean_sd(took)} s."
        )


def money(report: Report, trace: Path, seeds: int) -> None:
    """Each month on three GPU types, phalanx's policy: each tenant's spend without budgets, then with budgets
    at BUDGET_SHARE of it (a replay of the same seed), how far over its budget each ended, and the jobs that
    never started; the seeds two at a time."""
    for month, start, end, racks in MONTHS:
        base = Scenario(trace, start, end, racks=racks, fleet=gavel_fleet(racks * 64))
        began = time.monotonic()
        with ProcessPoolExecutor(2) as pool:
            seeded = list(pool.map(_with_and_without_budgets, [replace(base, seed=seed) for seed in range(seeds)]))
        took = time.monotonic() - began
        print(f"{month}, spend and budgets: {took:.0f} s", file=sys.stderr, flush=True)
        tenants = sorted(seeded[0][0], key=lambda t: -seeded[0][0][t])
        rows, over = [], []
        for tenant in tenants:
            free = [s[0][tenant] for s in seeded]
            capped = [s[1][tenant] for s in seeded]
            held = [s[2].get(tenant, 0) for s in seeded]
            excess = [c / (BUDGET_SHARE * f) - 1 for c, f in zip(capped, free, strict=True)]
            over.append(excess)
            rows.append([tenant, mean_sd([f / 1000 for f in free], "{:,.1f}"),
                         mean_sd([BUDGET_SHARE * f / 1000 for f in free], "{:,.1f}"),
                         mean_sd([c / 1000 for c in capped], "{:,.1f}"), mean_sd(excess, "{:+.1%}"),
                         mean_sd(held)])  # fmt: skip
        report.table([f"{month}, {base.gpus} GPUs: tenant", "spend, k$", "budget, k$", "spend with budget, k$",
                      "over budget by", "jobs never started"], rows)  # fmt: skip
        per_job = [s[3] for s in seeded]
        report.note(
            f"{month}: a job costs {mean_sd([statistics.fmean(p) for p in per_job], '{:,.1f}')} $ on average, "
            f"{mean_sd([statistics.median(p) for p in per_job], '{:,.2f}')} $ at the median, "
            f"{mean_sd([statistics.quantiles(p, n=100)[98] for p in per_job], '{:,.0f}')} $ at p99; the fleet "
            f"{mean_sd([sum(s[0].values()) / 1000 for s in seeded], '{:,.0f}')} k$ in the month. The replays: "
            f"{took:.0f} s ({seeds} seeds x 2, 2 processes)."
        )
        report.ratio(f"{month}: the most any tenant ended over its budget, / its budget",
                     [max(e[i] for e in over) for i in range(seeds)], unit="")  # fmt: skip
        report.ratio(f"{month}: the fleet's spend with budgets / without",
                     [sum(s[1].values()) / sum(s[0].values()) for s in seeded])  # fmt: skip


def sharing(report: Report, traces: Path, seeds: int) -> None:
    """Each packing choice's fill of Alibaba's 2023 fleet, once per seed (the same arrivals for every choice):
    the unallocated share of the GPUs at each arrived share, and the ratios at saturation (100%)."""
    nodes, pods = alibaba_2023(traces / "alibaba_gpu_v2023_gpu_nodes.csv", traces / "alibaba_gpu_v2023_pods.csv")
    runs = [(choice, seed) for seed in range(seeds) for choice in CHOICES]
    began = time.monotonic()
    with ProcessPoolExecutor(2) as pool:
        fills = dict(zip(runs, pool.map(_fill, [(nodes, pods, c, s) for c, s in runs]), strict=True))
    took = time.monotonic() - began
    marks = sorted(fills[runs[0]].unallocated)
    rows = [
        [choice]
        + [mean_sd([fills[choice, s].unallocated[m] for s in range(seeds)], "{:.2%}") for m in marks]
        + [mean_sd([fills[choice, s].failed for s in range(seeds)])]
        for choice in CHOICES
    ]
    gpus = sum(n[3] for n in nodes)
    report.table([f"{len(nodes):,} nodes, {gpus:,} GPUs: packing"] + [f"unallocated at {m:.0%} arrived" for m in marks]
                 + ["pods failed"], rows)  # fmt: skip
    at = {choice: [fills[choice, s].unallocated[1.0] for s in range(seeds)] for choice in CHOICES}
    for ours, peer, goal in [("phalanx", "fgd", "<= 1.0"), ("fgd", "best-fit", ""), ("phalanx", "best-fit", "")]:
        report.ratio(f"unallocated GPUs at saturation: {ours} / {peer}",
                     [a / b for a, b in zip(at[ours], at[peer], strict=True)], goal)  # fmt: skip
    shares = sum(p.gpus == 1 and p.gpu_milli < 1000 for p in pods)
    typed = sum(bool(p.gpu_types) for p in pods)
    report.note(
        f"The trace: {len(pods):,} pods, {shares:,} of them a share of one GPU, {sum(not p.gpus for p in pods):,} "
        f"without GPUs (they take CPUs on GPU nodes); {typed:,} name GPU types (the file's gpu_spec column). "
        f"The fills: {took:.0f} s ({len(runs)} fills, 2 processes)."
    )


def _fill(args: tuple) -> object:
    return fill(*args)


def _with_and_without_budgets(scenario: Scenario) -> tuple[dict, dict, dict, list[float]]:
    """(each tenant's dollars without budgets, with budgets, its jobs never started then, each job's dollars
    without budgets)."""
    free = replay(scenario, ["phalanx"], workers=1)["phalanx"].shared.records.values()
    spent = _dollars(free)
    capped = replay(replace(scenario, budgets={t: BUDGET_SHARE * d for t, d in spent.items()}), ["phalanx"],
                    workers=1)["phalanx"].shared.records.values()  # fmt: skip
    held: dict[str, int] = {}
    for r in capped:
        held[r.tenant] = held.get(r.tenant, 0) + r.held
    return spent, _dollars(capped), held, [r.dollars for r in free]


def _dollars(records) -> dict[str, float]:
    by_tenant: dict[str, float] = {}
    for r in records:
        by_tenant[r.tenant] = by_tenant.get(r.tenant, 0.0) + r.dollars
    return by_tenant


def _held(records) -> dict[str, float]:
    """GPU-seconds held on each type (a gang over several: shared equally)."""
    held: dict[str, float] = dict.fromkeys(TYPE_NAMES, 0.0)
    for record in records:
        for gpu_type, gpu_s in record.gpu_s_by_type.items():
            for part in gpu_type.split("+"):
                held[part] += gpu_s / len(gpu_type.split("+"))
    return held


def _type_shares(records) -> dict[str, float]:
    held = _held(records)
    total = sum(held.values()) or 1.0
    return {t: v / total for t, v in held.items()}


def _best_type_floor(scenario: Scenario) -> float:
    """The mean job duration on each job's fastest type: the seed's workloads, as its replay drew them."""
    truth = scenario.fleet.truth
    jobs = scenario.jobs()[0]
    return statistics.fmean(job.duration_s / max(truth.speed(job.kind, t) for t in job.gpu_types) for job in jobs)


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
    parser.add_argument(
        "--sections", default="policies,types,cost,sharing", help="policies (with the throughput), types, cost, sharing"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
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
    if "policies" in sections:
        compare(report, trace, args.seeds)
        throughput(report)
        report.finish(args.out)
    if "types" in sections:
        typed = Report(
            "Scheduler on several GPU types",
            "python bench/scheduler.py --sections types",
            "Philly's October 2017 (640 GPUs) and November 2017 (448 GPUs), as in the section above, on the same "
            "number of GPUs in equal thirds of V100, P100 and K80 nodes (8 GPUs each, racks of one type). Each "
            "job is given a workload of Gavel's job table (Narayanan et al., OSDI'20; their measured steps/s "
            "of each model on each type, alone, at 1, 2, 4 and 8 GPUs: src/phalanx/control/sim/"
            "gavel_throughputs.json, MIT licence), drawn per seed among those measured at its size (the largest "
            "measured size within it); it runs at that workload's rate on each type, its trace duration being "
            "its time on a P100, and it may not run where Gavel measured 0 (it does not fit). phalanx learns "
            "the rates from the runs (the speed table, seeded by peak FLOP/s), and so does Gavel-like (its "
            "allocation reads the same table; Gavel's quotas-free max-min fairness, rounds of 6 minutes as its "
            "paper runs them); the other baselines know nothing of them. Quotas, costs and checkpoints as above "
            "(Gavel-like's round-to-round moves are preemptions: they checkpoint, commit and restart like any); "
            "no tenant is replayed alone, so no "
            f"rho. {args.seeds} seeds: mean +- sd; ratios per seed, median and range.",
        )
        fleets(typed, trace, args.seeds)
        typed.finish(args.out.with_name(args.out.stem + "-types.md") if args.out else None)
    if "cost" in sections:
        costed = Report(
            "Scheduler: spend and budgets",
            "python bench/scheduler.py --sections cost",
            "The fleets of the section above (equal thirds of V100, P100 and K80 nodes; Gavel's workloads) at "
            "Google Cloud's 2020 on-demand prices per GPU-hour (V100 $2.48, P100 $1.46, K80 $0.45), phalanx's "
            "policy. A job's dollars are its runs' GPU-time at their types' prices, preempted runs included. "
            f"Then the same seed again with every tenant's budget at {BUDGET_SHARE:.0%} of what it spent without "
            "one: once a tenant's runs have cost its budget its pending jobs wait and the rest never start; its "
            "running jobs go on, which is what it ends over its budget by. "
            f"{args.seeds} seeds: mean +- sd; ratios per seed, median and range.",
        )
        money(costed, trace, args.seeds)
        costed.finish(args.out.with_name(args.out.stem + "-cost.md") if args.out else None)
    if "sharing" in sections:
        shared = Report(
            "Scheduler: GPU sharing, packing against FGD",
            "python bench/scheduler.py --sections sharing",
            "Alibaba's 2023 GPU-sharing trace (Weng et al., \"Beware of Fragmentation\", ATC'23; "
            "openb_pod_list_default and its 1,213 GPU nodes, read in place) filled as that paper measures "
            "fragmentation: pods drawn from the trace with replacement (a seed's draw is the same for every choice) "
            "arrive one at a time and never leave; each is placed on a node with the CPUs and GPU thousandths it "
            "asks, of a type it allows, or fails and is not tried again. Unallocated: the share of the fleet's GPUs "
            "no pod holds, when the arrived GPU requests reach 80, 90 and 100% of them (saturation), as FGD reports "
            "it. best-fit: the least room left, CPU and GPU half and half (FGD's simulator's); fgd: FGD's "
            "fragmentation measure, given the trace's whole workload as its paper does, ties to the first node; "
            "phalanx: phalanx's packing (scheduler/sharing.py), FGD's measure on the workload learned from the "
            f"pods arrived so far, ties by best fit. {args.seeds} seeds: mean +- sd; ratios per seed, median and "
            "range.",
        )
        sharing(shared, args.traces, args.seeds)
        shared.finish(args.out.with_name(args.out.stem + "-sharing.md") if args.out else None)


if __name__ == "__main__":
    main()
