"""The worker <-> supervisor protocol: the keys of the attempt's c10d store, which the supervisor hosts, and
the exchanges over them. It sits at the bottom layer so that the workers' side (train/, checkpoint/) and the
supervisor's (launch/) reach it without importing upward.

Heartbeats: each rank sets ``HEARTBEAT_KEY`` (its step, and its compute time for straggler detection).
Chaos: ``phalanx chaos nan|spike`` sets ``CHAOS_LOSS_KEY``; rank 0 makes its next step's loss bad and
deletes it.

In-process recovery: a rank whose collective failed because a peer died keeps its process, leaves the broken
process group, joins the next one (a fresh prefix of the attempt's store, the same ranks and world size, a
warm spare in the dead rank's place; train/sdk.py) and restores its state from memory.

Gloo cannot abort a collective in flight, so recovery is built on how its collectives end: a dead peer's
sockets are closed by its kernel, and every collective waiting on it fails at once with a connection error
(``peer_lost``); a survivor waiting only on other survivors fails when they leave the old group and close
theirs. Gloo's transfers between two ranks (the all-to-all of the memory snapshots' trade) do not always
fail so: a peer killed in the middle of one can leave it waiting for ever. Those are waited on in slices,
and given up (``PeerLost``) once the supervisor has started a recovery. What does not end either way
(a hung peer, a node whose machine vanished, a rank holding the GIL) is the supervisor's: no decision comes
within ``resilience.recovery_timeout_s``, or the supervisor sees no rank done in that time, and the job
falls back to a restart from its last checkpoint.

The keys:

    phalanx/heartbeat/<r>            rank r's last step
    phalanx/chaos/loss               nan | spike: the next step's loss is made bad
    phalanx/recovery/<g>             supervisor: generation g gives ``ranks`` (one, or a lost node's) to spares
    phalanx/recovery/<g>/have/<r>    survivor r of generation g: the snapshot steps it holds whole
    phalanx/recovery/<g>/done/<r>    rank r has restored its state and trains in generation g
    phalanx/spare/<i>/ready          spare i is warm and waiting
    phalanx/spare/<i>/assign         supervisor: spare i is rank ``rank`` of generation ``generation``
    phalanx/pg/<g>/...               generation g's process group (generation 0 is torch's env:// group)
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch.distributed as dist

HEARTBEAT_KEY = "phalanx/heartbeat/{rank}"
CHAOS_LOSS_KEY = "phalanx/chaos/loss"  # set by `phalanx chaos nan|spike`: the next step's loss is made bad
# How a gloo collective fails when a peer's process is gone (its sockets closed by its kernel).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


class PeerLost(RuntimeError):
    """A peer died while this rank waited on it in a transfer that did not fail by itself."""


class NoRecovery(RuntimeError):
    """In-process recovery cannot go on: the worker exits and the supervisor restarts the job."""


def last_heartbeat(store: dist.Store, rank: int) -> dict[str, Any] | None:
    """The last heartbeat ``rank`` sent through the worker SDK ({step, ts, compute_s}), if it sent any."""
    key = HEARTBEAT_KEY.format(rank=rank)
    return json.loads(store.get(key)) if store.check([key]) else None


def last_step(store: dist.Store, rank: int) -> int | None:
    beat = last_heartbeat(store, rank)
    return beat["step"] if beat is not None else None


def decision_key(generation: int) -> str:
    return f"phalanx/recovery/{generation}"


def have_key(generation: int, rank: int) -> str:
    return f"phalanx/recovery/{generation}/have/{rank}"


def done_key(generation: int, rank: int) -> str:
    return f"phalanx/recovery/{generation}/done/{rank}"


def ready_key(spare: int) -> str:
    return f"phalanx/spare/{spare}/ready"


def assign_key(spare: int) -> str:
    return f"phalanx/spare/{spare}/assign"


def peer_lost(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because a peer process died."""
    text = str(error)
    return isinstance(error, PeerLost) or (isinstance(error, RuntimeError) and any(s in text for s in PEER_GONE))


def recovering(store: dist.Store, generation: int) -> bool:
    """Whether the supervisor has started recovery ``generation`` (some rank has died)."""
    return store.check([decision_key(generation)])


def _get(store: dist.Store, key: str, timeout_s: float | None) -> dict[str, Any]:
    if timeout_s is None:
        while True:  # a spare waits as long as its attempt lasts
            try:
                store.wait([key], datetime.timedelta(seconds=3600))
                break
            except dist.DistStoreError:
                continue
    else:
        try:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            raise NoRecovery(f"no word from the supervisor on {key} within {timeout_s:g} s") from None
    return json.loads(store.get(key))


def decision(store: dist.Store, generation: int, timeout_s: float) -> dict[str, Any]:
    """Wait for the supervisor to start ``generation`` ({ranks, reached}: the ranks spares take, the steps the
    job had completed); NoRecovery if it does not."""
    return _get(store, decision_key(generation), timeout_s)


def assignment(store: dist.Store, spare: int) -> dict[str, Any]:
    """Spare ``spare``: say it is ready, then wait until the supervisor gives it a rank ({rank, generation})."""
    store.set(ready_key(spare), "1")
    return _get(store, assign_key(spare), None)


def agree(
    store: dist.Store, generation: int, rank: int, joiners: list[int], steps: list[int], timeout_s: float
) -> int | None:
    """The newest snapshot step every survivor holds whole (None: there is none); each survivor publishes
    ``steps`` (the joiners none) and every rank reads them all."""
    world = dist.get_world_size()
    if rank not in joiners:
        store.set(have_key(generation, rank), json.dumps(steps))
    keys = [have_key(generation, r) for r in range(world) if r not in joiners]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        raise NoRecovery(f"the survivors did not say which snapshots they hold within {timeout_s:g} s") from None
    common = set.intersection(*(set(json.loads(store.get(k))) for k in keys))
    return max(common) if common else None
