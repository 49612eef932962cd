"""``/metrics``: the server's Prometheus metrics, computed at each scrape from what is already kept (the store,
and the running jobs' run directories), so a restarted server reports the same counters and nothing is
counted twice. A scrape sees what its token may see: an admin every tenant, anyone else their own.

Per running job (labels ``tenant``, ``job_id``, ``attempt``): the last step's time, tokens/s and MFU, the goodput
ratio of the execution so far, restarts by cause and checkpoint blocking time. Per tenant: jobs by state, the
queue, GPUs allocated against quota and borrowing limit, preemptions, and the admission latency histogram."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from phalanx.control.server.views import last_line
from phalanx.control.store import JobState, Scope
from phalanx.obs.digest import digest
from phalanx.obs.rundir import RunDir

# Seconds from queued to admitted: a job that fits starts within a round; a big one can wait hours.
ADMISSION_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
# Not `job`: Prometheus gives every series the scrape job's name as `job`, and renames a target's own to
# `exported_job`.
JOB_LABELS = ("tenant", "job_id", "attempt")


class ServerCollector(Collector):
    """Everything ``caller`` may see, as metric families; one collector per scrape, in its transaction."""

    def __init__(self, caller: Scope, cluster_gpus: int):
        self.caller, self.cluster_gpus = caller, cluster_gpus

    def collect(self) -> Iterator[Metric]:
        yield from self._tenants()
        yield from self._admissions()
        yield from self._running_jobs()

    def _tenants(self) -> Iterator[Metric]:
        cluster = GaugeMetricFamily("phalanx_cluster_gpus", "GPUs (or CPU slots) the executor offers")
        cluster.add_metric([], self.cluster_gpus)
        yield cluster
        jobs = GaugeMetricFamily("phalanx_jobs", "jobs by state", labels=["tenant", "state"])
        queue = GaugeMetricFamily("phalanx_queue_jobs", "jobs waiting for admission (PENDING)", labels=["tenant"])
        allocated = GaugeMetricFamily(
            "phalanx_tenant_allocated_gpus", "GPUs held by admitted and running jobs", labels=["tenant"]
        )
        quota = GaugeMetricFamily("phalanx_tenant_nominal_gpus", "GPUs guaranteed to the tenant", labels=["tenant"])
        borrowing = GaugeMetricFamily(
            "phalanx_tenant_borrowing_limit_gpus", "GPUs the tenant may borrow from its cohort", labels=["tenant"]
        )
        preemptions = CounterMetricFamily(
            "phalanx_preemptions", "times the tenant's jobs were preempted to make room", labels=["tenant"]
        )
        for load in self.caller.tenant_loads():
            t = load.tenant
            for state in JobState:
                jobs.add_metric([t.name, state.value], load.jobs.get(state, 0))
            queue.add_metric([t.name], load.jobs_pending)
            allocated.add_metric([t.name], load.gpus_in_use)
            quota.add_metric([t.name], t.nominal_gpus)
            if t.borrowing_limit is not None:
                borrowing.add_metric([t.name], t.borrowing_limit)
            preemptions.add_metric([t.name], load.preemptions)
        yield from (jobs, queue, allocated, quota, borrowing, preemptions)

    def _admissions(self) -> Iterator[Metric]:
        """Each admission's wait since the job was last queued, from the transitions."""
        waits: dict[str, list[float]] = defaultdict(list)
        queued: dict[int, float] = {}
        for tenant, job, to, at in self.caller.queueings():
            if to == JobState.PENDING:
                queued[job] = at
            elif job in queued:
                waits[tenant].append(at - queued.pop(job))
        family = HistogramMetricFamily(
            "phalanx_admission_latency_seconds", "from queued to admitted, per admission", labels=["tenant"]
        )
        for tenant, seen in sorted(waits.items()):
            buckets = [(_le(b), sum(w <= b for w in seen)) for b in ADMISSION_BUCKETS] + [("+Inf", len(seen))]
            family.add_metric([tenant], buckets, sum(seen))
        yield family

    def _running_jobs(self) -> Iterator[Metric]:
        step = GaugeMetricFamily("phalanx_job_step_seconds", "wall time of the job's last step", labels=JOB_LABELS)
        tokens = GaugeMetricFamily("phalanx_job_tokens_per_second", "tokens/s of the last step", labels=JOB_LABELS)
        mfu = GaugeMetricFamily("phalanx_job_mfu_ratio", "model FLOPs utilisation of the last step", labels=JOB_LABELS)
        steps = GaugeMetricFamily("phalanx_job_steps", "steps done", labels=JOB_LABELS)
        goodput = GaugeMetricFamily(
            "phalanx_job_goodput_ratio", "productive time / wall time of the execution so far", labels=JOB_LABELS
        )
        restarts = CounterMetricFamily(
            "phalanx_job_restarts", "restarts within the execution, by cause", labels=[*JOB_LABELS, "cause"]
        )
        blocked = CounterMetricFamily(
            "phalanx_job_checkpoint_blocking_seconds", "training time spent blocked on checkpoints", labels=JOB_LABELS
        )
        for execution, job_id in self.caller.executions():
            if execution.ended_at is not None or not execution.run_dir:
                continue
            run = RunDir(Path(execution.run_dir))
            labels = [execution.tenant, job_id, str(execution.attempt)]
            last = last_line(run.metrics)
            last = last or {}  # a script's own metrics may lack any of these
            for family, value in (
                (steps, last["step"] + 1 if isinstance(last.get("step"), int) else None),
                (step, last.get("step_time_s")),
                (tokens, last.get("tokens_per_s")),
                (mfu, last.get("mfu")),
            ):
                if isinstance(value, int | float):
                    family.add_metric(labels, value)
            if (said := digest(run)) is None:
                continue
            for cause, n in said.restarts.items():
                restarts.add_metric([*labels, cause], n)
            blocked.add_metric(labels, said.checkpoint_blocked_s)
            goodput.add_metric(labels, said.ledger.goodput)
        yield from (step, tokens, mfu, steps, goodput, restarts, blocked)


def _le(bound: float) -> str:
    return f"{float(bound)}"


def registry(caller: Scope, cluster_gpus: int) -> CollectorRegistry:
    found = CollectorRegistry(auto_describe=False)
    found.register(ServerCollector(caller, cluster_gpus))
    return found
