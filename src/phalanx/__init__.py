"""phalanx: run PyTorch training jobs on one machine or many, and keep them running."""

from phalanx.train.sdk import WorkerContext, init

__version__ = "0.1.0"
__all__ = ["WorkerContext", "init"]
