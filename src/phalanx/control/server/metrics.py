"""``/metrics``: the server's Prometheus metrics. A tenant's and a job's are computed at each scrape from what is
already kept (the store, and the executions' run directories), so a restarted server reports the same
counters and nothing is counted twice; a scrape sees what its token may see: an admin every tenant, anyone
else their own. The server's own (request latency by route, the scheduler's round, the process) are kept as
it runs, in ``SERVER``.

Per execution of a job (labels ``tenant``, ``job_id``, ``execution``), while it runs and for ``LINGER_S`` after
(so that its last values are scraped): steps and tokens run (counters, to ``rate()``), the last step's number,
time, timestamp (to alert on a stalled job), loss, tokens/s, MFU, data wait and peak memory, the goodput of the
execution so far, restarts by cause and checkpoint blocking time; and ``phalanx_job_info`` with its name and
owner. Per tenant: jobs by state, those that ended by final state (a counter), the queue, GPUs allocated
against quota and borrowing limit, preemptions, dollars spent (a counter) and the monthly budget, and the
admission latency histogram."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from phalanx.control.server.views import last_line
from phalanx.control.store import FINAL, JobState, Scope, user_name
from phalanx.obs.digest import digest
from phalanx.obs.rundir import RunDir

# Seconds from queued to admitted: a job that fits starts within a round; a big one can wait hours.
ADMISSION_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
# Not `job`: Prometheus gives every series the scrape job's name as `job`, and renames a target's own to
# `exported_job`. `execution`: the job's n-th start by the server (restarts within one are its `attempt`s).
JOB_LABELS = ("tenant", "job_id", "execution")
LINGER_S = 300.0  # an ended execution's series stay this long: a scrape every minute or so sees its last values

SERVER = CollectorRegistry(auto_describe=True)  # the server process's own, kept as it runs
REQUEST_SECONDS = Histogram(
    "phalanx_http_request_duration_seconds", "API requests, by route template, method and status",
    ["route", "method", "status"], registry=SERVER,
)  # fmt: skip
ROUND_SECONDS = Histogram(
    "phalanx_scheduler_round_seconds", "the control loop's rounds: schedule, and record the decisions",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=SERVER,
)  # fmt: skip
ProcessCollector(registry=SERVER)  # process_cpu_seconds_total, process_resident_memory_bytes, ...


class ServerCollector(Collector):
    """Everything ``caller`` may see, as metric families; one collector per scrape, in its transaction."""

    def __init__(self, caller: Scope, cluster_gpus: int):
        self.caller, self.cluster_gpus = caller, cluster_gpus

    def collect(self) -> Iterator[Metric]:
        yield from self._tenants()
        yield from self._admissions()
        yield from self._jobs(time.time())
        yield from SERVER.collect()

    def _tenants(self) -> Iterator[Metric]:
        cluster = GaugeMetricFamily("phalanx_cluster_gpus", "GPUs (or CPU slots) the executor offers")
        cluster.add_metric([], self.cluster_gpus)
        yield cluster
        jobs = GaugeMetricFamily("phalanx_jobs", "jobs not ended, by state", labels=["tenant", "state"])
        ended = CounterMetricFamily("phalanx_jobs_ended", "jobs that ended, by final state", labels=["tenant", "state"])
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
        cost = CounterMetricFamily(
            "phalanx_tenant_cost_dollars",
            "what the tenant's executions cost, each at its placement's on-demand price when it started",
            labels=["tenant"],
        )
        budget = GaugeMetricFamily(
            "phalanx_tenant_monthly_budget_dollars", "the dollars the tenant may spend in a month", labels=["tenant"]
        )
        spent = self.caller.spend(0.0, time.time())
        for load in self.caller.tenant_loads():
            t = load.tenant
            for state in JobState:
                family = ended if state in FINAL else jobs
                family.add_metric([t.name, state.value], load.jobs.get(state, 0))
            queue.add_metric([t.name], load.jobs_pending)
            allocated.add_metric([t.name], load.gpus_in_use)
            quota.add_metric([t.name], t.nominal_gpus)
            if t.borrowing_limit is not None:
                borrowing.add_metric([t.name], t.borrowing_limit)
            preemptions.add_metric([t.name], load.preemptions)
            cost.add_metric([t.name], spent.get(t.name, (0.0, 0.0))[0])
            if t.monthly_budget is not None:
                budget.add_metric([t.name], t.monthly_budget)
        yield from (jobs, ended, queue, allocated, quota, borrowing, preemptions, cost, budget)

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

    def _jobs(self, now: float) -> Iterator[Metric]:
        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=JOB_LABELS)

        last = {  # the last step record's figures
            "step_time_s": gauge("phalanx_job_step_seconds", "wall time of the last step"),
            "ts": gauge("phalanx_job_last_step_timestamp_seconds", "when the last step was reported (Unix time)"),
            "loss": gauge("phalanx_job_loss", "the last step's loss"),
            "tokens_per_s": gauge("phalanx_job_tokens_per_second", "tokens/s of the last step"),
            "mfu": gauge("phalanx_job_mfu_ratio", "model FLOPs utilisation of the last step"),
            "data_wait_s": gauge("phalanx_job_data_wait_seconds", "of the last step, time waiting for the batch"),
            "data_fetch_wait_s": gauge(
                "phalanx_job_data_fetch_wait_seconds", "of the last step, the loader's wait for object storage"
            ),
            "data_cache_hit_rate": gauge(
                "phalanx_job_data_cache_hit_ratio", "of the chunks the last step's look-ahead needed, those cached"
            ),
            "peak_memory_bytes": gauge("phalanx_job_peak_memory_bytes", "rank 0's peak device memory"),
        }
        step = gauge("phalanx_job_last_step", "the last step done, counted from 1")
        steps = CounterMetricFamily("phalanx_job_steps", "steps run (again after a restart too)", labels=JOB_LABELS)
        tokens = CounterMetricFamily("phalanx_job_tokens", "tokens trained on", labels=JOB_LABELS)
        goodput = gauge("phalanx_job_goodput_ratio", "productive time / wall time of the execution so far")
        restarts = CounterMetricFamily(
            "phalanx_job_restarts", "restarts within the execution, by cause", labels=[*JOB_LABELS, "cause"]
        )
        blocked = CounterMetricFamily(
            "phalanx_job_checkpoint_blocking_seconds", "training time spent blocked on checkpoints", labels=JOB_LABELS
        )
        fetched = CounterMetricFamily(
            "phalanx_job_data_fetched_bytes", "bytes rank 0 fetched from object storage", labels=JOB_LABELS
        )
        info_labels = ["tenant", "job_id", "name", "owner"]
        info = GaugeMetricFamily("phalanx_job_info", "a job's name and owner", labels=info_labels)
        described: set[str] = set()
        for execution, job_id in self.caller.executions(since=now - LINGER_S):
            if not execution.run_dir:
                continue
            run = RunDir(Path(execution.run_dir))
            labels = [execution.tenant, job_id, str(execution.attempt)]
            if job_id not in described:
                job = self.caller.job(job_id)
                info.add_metric([job.tenant, job.id, job.name, user_name(job.owner)], 1)
                described.add(job_id)
            record = last_line(run.metrics) or {}  # a script's own metrics may lack any of these
            if isinstance(record.get("step"), int):
                step.add_metric(labels, record["step"] + 1)
            for field, family in last.items():
                if isinstance(value := record.get(field), int | float):
                    family.add_metric(labels, value)
            if (said := digest(run)) is None:
                continue
            steps.add_metric(labels, said.steps_run)
            tokens.add_metric(labels, said.tokens_run)
            for cause, n in said.restarts.items():
                restarts.add_metric([*labels, cause], n)
            blocked.add_metric(labels, said.checkpoint_blocked_s)
            if said.data is not None:
                fetched.add_metric(labels, said.data.fetched_bytes)
            goodput.add_metric(labels, said.ledger.goodput)
        yield from (*last.values(), step, steps, tokens, goodput, restarts, blocked, fetched, info)


def _le(bound: float) -> str:
    return f"{float(bound)}"


def registry(caller: Scope, cluster_gpus: int) -> CollectorRegistry:
    found = CollectorRegistry(auto_describe=False)
    found.register(ServerCollector(caller, cluster_gpus))
    return found
