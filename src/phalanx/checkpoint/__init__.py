"""Checkpoints: sharded sync/async saves through torch DCP, atomic commit, manifest and checksums, retention,
latest-valid discovery, resharding load, export to safetensors; local disk or any fsspec URL. The directory's
layout (``CheckpointDir``) needs no torch: the server reads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.checkpoint.directory import CheckpointDir
from phalanx.lazy import exports

if TYPE_CHECKING:
    from phalanx.checkpoint.manager import CheckpointInfo, CheckpointManager

__all__ = ["CheckpointDir", "CheckpointInfo", "CheckpointManager"]
__getattr__ = exports(__name__, dict.fromkeys(["CheckpointInfo", "CheckpointManager"], "phalanx.checkpoint.manager"))
