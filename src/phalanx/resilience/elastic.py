"""Elastic shrink: when a slot of the machine (a device, and the rank on it) keeps failing, go on without it.

A local slot whose rank is the first to fail in two attempts in a row is taken for lost capacity (a device
that fell off the bus, a GPU with failing memory) rather than bad luck. With ``resilience.allow_shrink`` the
next attempt runs on the remaining slots, down to ``resilience.min_procs``: the data-parallel shard degree is
refilled for the smaller world and the checkpoint is resharded into it on load; the global batch stays, so
training goes on along the same curve with more accumulation per rank.

Whether a left-out device works again cannot be seen from here, so growing back is tried: once a shrunk
attempt has trained for ``resilience.regrow_after_s``, the supervisor stops it with SIGTERM (the recipe saves
a checkpoint and exits) and starts the next attempt on every slot. A slot taken back that fails first again is
left out at once, and the next try waits twice as long.
"""

from __future__ import annotations

from phalanx.spec import JobSpec, validate_spec

FAILURES_TO_EXCLUDE = 2  # first to fail in this many attempts in a row


class Capacity:
    def __init__(self, procs: int, allow_shrink: bool, min_procs: int, regrow_after_s: float | None = None):
        self.full = procs
        self.slots = list(range(procs))  # usable local slots; the attempt's rank r runs on slots[r]
        self.allow_shrink, self.min_procs, self.regrow_after_s = allow_shrink, min_procs, regrow_after_s
        self._streak: tuple[int | None, int] = (None, 0)  # (slot, failures in a row)
        self._probation: set[int] = set()  # slots taken back by regrow(): their next first failure excludes them

    @property
    def shrunk(self) -> bool:
        return len(self.slots) < self.full

    def after_failure(self, rank: int | None) -> int | None:
        """Record that ``rank`` of the last attempt failed first; return the slot that is now excluded, if any."""
        slot = self.slots[rank] if rank is not None and rank < len(self.slots) else None
        count = self._streak[1] + 1 if slot is not None and slot == self._streak[0] else 1
        if slot in self._probation:
            count = FAILURES_TO_EXCLUDE
        self._streak = (slot, count)
        if slot is None or count < FAILURES_TO_EXCLUDE or not self.allow_shrink:
            return None
        if len(self.slots) - 1 < self.min_procs:
            return None
        self.slots.remove(slot)
        self._streak = (None, 0)
        return slot

    def keep(self, slot: int) -> None:
        """Undo the exclusion of ``slot`` (the job cannot run without it)."""
        self.slots = sorted({*self.slots, slot})

    def regrow(self) -> list[int]:
        """Take every left-out slot back, on probation; the wait before the next regrow doubles. Returns them."""
        back = sorted(set(range(self.full)) - set(self.slots))
        self._probation |= set(back)
        self.slots = list(range(self.full))
        if self.regrow_after_s is not None:
            self.regrow_after_s *= 2
        return back


def resized(spec: JobSpec, procs: int) -> JobSpec:
    """``spec`` on ``procs`` processes: the data-parallel shard degree refilled (tp and dp_replicate kept).
    Raises SpecError if the job cannot run that way (e.g. the world no longer divides by tp)."""
    data = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["resources"]["procs_per_node"] = procs
    if data.get("train") is not None:
        data["train"]["parallel"]["dp_shard"] = -1
    return validate_spec(data, f"{spec.name} on {procs} process(es)")
