"""Checkpoints: sharded sync/async saves through torch DCP, atomic commit, manifest and checksums, retention,
latest-valid discovery, resharding load, export to safetensors; local disk or any fsspec URL."""

from phalanx.checkpoint.directory import CheckpointDir
from phalanx.checkpoint.manager import CheckpointInfo, CheckpointManager

__all__ = ["CheckpointDir", "CheckpointInfo", "CheckpointManager"]
