"""phalanx: run PyTorch training jobs on one machine or many, and keep them running."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.lazy import exports

if TYPE_CHECKING:
    from phalanx.train.sdk import WorkerContext, init

__version__ = "0.1.0"
__all__ = ["WorkerContext", "init"]
__getattr__ = exports(__name__, dict.fromkeys(__all__, "phalanx.train.sdk"))
