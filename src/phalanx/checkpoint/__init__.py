"""Checkpoints: sharded sync/async saves through torch DCP, atomic commit, manifest and checksums, retention,
latest-valid discovery, resharding load."""

from phalanx.checkpoint.manager import CheckpointInfo, CheckpointManager, saved_steps, step_dir, verify

__all__ = ["CheckpointInfo", "CheckpointManager", "saved_steps", "step_dir", "verify"]
