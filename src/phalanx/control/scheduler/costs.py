"""What preempting a run costs it, by the figures of the cluster's operator: the one cost model the scheduler
budgets its preemptions with, the simulator charges its victims, and `phalanx server` and `phalanx sim` take
their options' defaults from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreemptionCost:
    """A victim's emergency checkpoint commits in ``commit_s`` plus ``commit_s_per_gpu`` for each of its GPUs
    (every GPU holds a shard, and the shards share the storage's bandwidth: 30 s for 8 GPUs by default); its
    restart costs ``restart_s`` more before its work resumes."""

    restart_s: float = 60.0
    commit_s: float = 20.0
    commit_s_per_gpu: float = 1.25

    def commit(self, gpus: int) -> float:
        return self.commit_s + self.commit_s_per_gpu * gpus

    def gpu_s(self, gpus: int, gpus_sq: int) -> float:
        """GPU-seconds that victims holding ``gpus`` in all (``gpus_sq``: the sum of their squares) lose to
        their commits and restarts."""
        return gpus * (self.restart_s + self.commit_s) + self.commit_s_per_gpu * gpus_sq
