"""Where admitted jobs run: this machine (``local``, the default); Slurm and Kubernetes implement the same
interface (``base.Executor``)."""

from phalanx.control.executors.base import Executor, Handle, Launch, Phase, Status
from phalanx.control.executors.local import LocalExecutor

__all__ = ["Executor", "Handle", "Launch", "LocalExecutor", "Phase", "Status"]
