"""The simulator's table: one row per policy, every figure from the same replay of the same jobs."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from phalanx.control.sim.scenario import Replay

BIG = 32  # GPUs: "big" jobs, whose waits are compared with FIFO's


@dataclass(frozen=True)
class Metrics:
    policy: str
    jobs: int
    avg_jct: float
    p50_jct: float
    p99_jct: float
    wait_1gpu: float  # mean time pending (every wait, after preemptions too) of 1-GPU jobs
    wait_big: float  # ... of jobs of BIG GPUs or more
    alloc_busy: float  # GPUs allocated / GPUs, while the queue was not empty
    lost_gpu_h: float
    lost_share: float  # of GPU-hours used
    preemptions_per_job: float
    rho_le_1: float | None  # share of jobs with finish-time fairness rho <= 1; None: no tenant replayed alone
    worst_tenant_rho: float | None  # the worst tenant's mean rho
    big_over_fifo: int | None  # big jobs waiting more than 1.5x their FIFO wait (+ 60 s), when FIFO ran


def metrics(replay: Replay, fifo: Replay | None = None) -> Metrics:
    out = replay.shared
    records = list(out.records.values())
    jcts = sorted(r.jct for r in records)
    waits = {r.id: r.waited_s for r in records}
    rho, per_tenant = {}, {}
    for r in records:
        alone = replay.alone_jct.get(r.id)
        rho[r.id] = r.jct / alone if alone else 0.0  # a job that cannot run on its tenant's quota alone: <= 1
        per_tenant.setdefault(r.tenant, []).append(rho[r.id])
    big = [r for r in records if r.gpus >= BIG]
    over = None
    if fifo is not None:
        fifo_waits = {r.id: r.waited_s for r in fifo.shared.records.values()}
        over = sum(1 for r in big if waits[r.id] > 1.5 * fifo_waits[r.id] + 60)
    return Metrics(
        policy=out.policy,
        jobs=len(records),
        avg_jct=statistics.fmean(jcts),
        p50_jct=_quantile(jcts, 0.5),
        p99_jct=_quantile(jcts, 0.99),
        wait_1gpu=statistics.fmean(waits[r.id] for r in records if r.gpus == 1) if records else 0.0,
        wait_big=statistics.fmean(waits[r.id] for r in big) if big else 0.0,
        alloc_busy=out.busy_gpu_s / out.busy_capacity_gpu_s if out.busy_capacity_gpu_s else 1.0,
        lost_gpu_h=out.lost_gpu_s / 3600,
        lost_share=out.lost_gpu_s / out.used_gpu_s if out.used_gpu_s else 0.0,
        preemptions_per_job=sum(r.preemptions for r in records) / len(records),
        rho_le_1=sum(1 for v in rho.values() if v <= 1) / len(rho) if replay.alone_jct else None,
        worst_tenant_rho=max(statistics.fmean(v) for v in per_tenant.values()) if replay.alone_jct else None,
        big_over_fifo=over,
    )


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


COLUMNS = [  # (heading, attribute, format)
    ("policy", "policy", "{}"),
    ("avg JCT s", "avg_jct", "{:,.0f}"),
    ("p50 JCT s", "p50_jct", "{:,.0f}"),
    ("p99 JCT s", "p99_jct", "{:,.0f}"),
    ("wait 1-GPU s", "wait_1gpu", "{:,.0f}"),
    (f"wait >={BIG}-GPU s", "wait_big", "{:,.0f}"),
    ("alloc, queue busy", "alloc_busy", "{:.1%}"),
    ("GPU-h lost", "lost_gpu_h", "{:,.0f}"),
    ("lost/used", "lost_share", "{:.2%}"),
    ("preempt/job", "preemptions_per_job", "{:.3f}"),
    ("rho<=1", "rho_le_1", "{:.1%}"),
    ("worst tenant rho", "worst_tenant_rho", "{:.2f}"),
    (f">={BIG}-GPU waits >1.5x FIFO", "big_over_fifo", "{}"),
]


def rows(table: list[Metrics]) -> list[list[str]]:
    return [[fmt.format(getattr(m, attr)) if getattr(m, attr) is not None else "-" for _, attr, fmt in COLUMNS]
            for m in table]  # fmt: skip
