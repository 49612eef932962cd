"""`phalanx sim goodput`: the expected goodput of one long training job on N GPUs under each recovery strategy,
by Monte Carlo over failures drawn from the Llama 3 report's interruption taxonomy, with recovery costs
measured on this machine (bench/RESULTS.md). docs/failures.md explains the model and its assumptions.

The model:
- Failures arrive as a Poisson process at the report's rate per GPU (419 unexpected interruptions in 54 days
  on 16,384 GPUs), times N. Each is drawn from the report's causes, in their proportions; a cause has a scope:
  a process (a software bug: the machine stays usable), a node (a GPU, its memory, the host: the machine
  must be replaced), the fabric (a switch or cable: several nodes), or a hang (NCCL watchdog timeouts, silent
  data corruption), which is found only after the hang timeout.
- Training runs at the step time; storage checkpoints block for ``save_s`` every interval (fixed, or Young /
  Daly's for the failures that need a restart); in-memory snapshots cost ``snapshot_s`` every
  ``snapshot_every`` steps.
- A restart: detection, then ``restart_s``, a replacement node's ``replace_s`` when the scope is a node or the
  fabric, and the work since the last storage checkpoint is redone. In process (scope: a process) or with a
  spare (scope: a node): detection, then ``in_process_s`` (``spare_s``), and the work since the last memory
  snapshot is redone.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from phalanx.obs.rates import LLAMA3_GPU_HOURS_PER_FAILURE, young_daly_s

# Llama 3 (Dubey et al., 2024), table 5: unexpected interruptions over 54 days of pre-training on 16,384 GPUs,
# by root cause, with the scope a recovery has to deal with.
LLAMA3_CAUSES: tuple[tuple[str, int, str], ...] = (
    ("faulty GPU", 148, "node"),
    ("GPU HBM3 memory", 72, "node"),
    ("software bug", 54, "process"),
    ("network switch/cable", 35, "fabric"),
    ("host maintenance", 32, "node"),
    ("GPU SRAM memory", 19, "node"),
    ("GPU system processor", 17, "node"),
    ("NIC", 7, "node"),
    ("NCCL watchdog timeouts", 7, "hang"),
    ("silent data corruption", 6, "hang"),
    ("GPU thermal interface and sensor", 6, "node"),
    ("SSD", 3, "node"),
    ("power supply", 3, "node"),
    ("server chassis", 2, "node"),
    ("IO expansion board", 2, "node"),
    ("dependency", 2, "process"),
    ("CPU", 2, "node"),
    ("system memory", 2, "node"),
)
SCOPES = ("process", "node", "fabric", "hang")


@dataclass(frozen=True)
class RecoveryCosts:
    """Seconds. Defaults: this machine's measurements (bench/RESULTS.md) where one exists; what cannot be
    measured here (a replacement node, hang detection at scale) is a parameter, said in the output."""

    step_s: float = 0.33  # llama-debug on 2 CPU processes, one thread each (bench/recovery.py)
    save_s: float = 0.007  # phalanx's async save of llama-debug: training blocked per save
    restart_s: float = 3.26  # phalanx: kill -> next step, restart from the checkpoint (bench/recovery.py)
    in_process_s: float = 0.54  # phalanx in process: kill -> next step, warm spare, state from memory (same)
    spare_s: float = 0.88  # a spare node's warm spares take a lost node's ranks in process, once it is found lost:
    # a frozen node's found-lost -> next step (bench/node_loss.py; a killed node's is 0.41, found in 0.10 s)
    snapshot_s: float = 0.065  # one in-memory snapshot of llama-debug (serialize + trade with a neighbour)
    snapshot_every: int | None = None  # steps; None: Young/Daly's for the failures recovered in process
    detect_s: float = 0.1  # a crash is seen within the supervisor's poll
    node_detect_s: float = 5.0  # resilience.node_timeout_s
    hang_detect_s: float = 120.0  # hang_timeout_s: auto's floor
    replace_s: float = 0.0  # a restart waits this long for a replacement node (0: one is at hand)
    fixed_every_s: float = 1800.0  # the fixed-interval strategy's storage checkpoints


@dataclass(frozen=True)
class Strategy:
    name: str
    young_daly: bool  # storage interval: Young/Daly's for the restart-path failures, else RecoveryCosts.fixed_every_s
    in_process: frozenset[str]  # the scopes recovered without a restart

    def recovers(self, scope: str) -> bool:
        return scope in self.in_process


STRATEGIES = (
    Strategy("restart, checkpoint every fixed interval", False, frozenset()),
    Strategy("restart, Young/Daly interval", True, frozenset()),
    Strategy("in process, state from memory", True, frozenset({"process"})),
    Strategy("in process and spare nodes", True, frozenset({"process", "node"})),
)


def failures_per_s(gpus: int, scope_share: float = 1.0) -> float:
    return gpus * scope_share / (LLAMA3_GPU_HOURS_PER_FAILURE * 3600)


def scope_shares() -> dict[str, float]:
    total = sum(n for _, n, _ in LLAMA3_CAUSES)
    return {s: sum(n for _, n, scope in LLAMA3_CAUSES if scope == s) / total for s in SCOPES}


def storage_interval_s(strategy: Strategy, gpus: int, costs: RecoveryCosts) -> float:
    """Work seconds between storage checkpoints: fixed, or Young/Daly's for the failures that restart."""
    if not strategy.young_daly:
        return costs.fixed_every_s
    restarting = sum(share for scope, share in scope_shares().items() if not strategy.recovers(scope))
    if restarting == 0:
        return math.inf
    return young_daly_s(costs.save_s, 1 / failures_per_s(gpus, restarting))


def snapshot_every(strategy: Strategy, gpus: int, costs: RecoveryCosts) -> int:
    """Steps between memory snapshots: Young/Daly's optimum applies to them as to storage checkpoints, with
    the snapshot's cost and the failures recovered in process."""
    if costs.snapshot_every is not None:
        return costs.snapshot_every
    recovered = sum(share for scope, share in scope_shares().items() if strategy.recovers(scope))
    seconds = young_daly_s(costs.snapshot_s, 1 / failures_per_s(gpus, recovered))
    return max(1, round(seconds / costs.step_s))


def run(strategy: Strategy, gpus: int, costs: RecoveryCosts, work_s: float, seed: int) -> float:
    """One simulated job of ``work_s`` seconds of training: its goodput (work / wall time)."""
    rng = random.Random(seed)
    causes = [scope for _, n, scope in LLAMA3_CAUSES for _ in range(n)]
    rate = failures_per_s(gpus)
    interval = storage_interval_s(strategy, gpus, costs)
    every = snapshot_every(strategy, gpus, costs) if strategy.in_process else 0
    snapshot_work_s = every * costs.step_s
    # Wall seconds per second of work: training slowed by the memory snapshots, when they are taken.
    slowdown = 1 + (costs.snapshot_s / snapshot_work_s if every else 0.0)
    wall = kept = pending = 0.0  # kept: work in a storage checkpoint; pending: since the last one
    next_failure = rng.expovariate(rate)
    while kept + pending < work_s:
        # Run until the next save, the end of the work, or the failure, whichever comes first.
        to_save = min(interval - pending, work_s - kept - pending)
        if wall + to_save * slowdown <= next_failure:
            wall += to_save * slowdown
            pending += to_save
            if kept + pending < work_s:
                wall += costs.save_s
                kept, pending = kept + pending, 0.0
            continue
        pending += (next_failure - wall) / slowdown
        wall = next_failure
        scope = rng.choice(causes)
        detect = {"hang": costs.hang_detect_s, "node": costs.node_detect_s}.get(scope, costs.detect_s)
        if strategy.recovers(scope):  # back to the last memory snapshot, in the processes that live
            lost = min(pending, rng.uniform(0, snapshot_work_s))
            wall += detect + (costs.in_process_s if scope == "process" else costs.spare_s)
            pending -= lost
        else:
            wall += detect + costs.restart_s + (costs.replace_s if scope in ("node", "fabric") else 0.0)
            pending = 0.0
        next_failure = wall + rng.expovariate(rate)
    return work_s / wall


@dataclass(frozen=True)
class Row:
    strategy: str
    gpus: int
    goodput: float  # mean over the seeds
    spread: float  # their standard deviation
    interval_s: float  # between storage checkpoints
    snapshot_every: int  # steps between memory snapshots (0: none)


def goodput_table(gpu_counts: list[int], costs: RecoveryCosts, days: float, seeds: int) -> list[Row]:
    rows = []
    for strategy in STRATEGIES:
        for gpus in gpu_counts:
            runs = [run(strategy, gpus, costs, days * 86400, seed) for seed in range(seeds)]
            spread = statistics.stdev(runs) if len(runs) > 1 else 0.0
            every = snapshot_every(strategy, gpus, costs) if strategy.in_process else 0
            interval = storage_interval_s(strategy, gpus, costs)
            rows.append(Row(strategy.name, gpus, statistics.mean(runs), spread, interval, every))
    return rows
