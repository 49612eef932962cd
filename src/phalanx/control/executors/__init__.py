"""Where admitted jobs run: this machine (``local``, the default) or a Slurm cluster (``slurm``), behind one
interface (``base.Executor``). ``kubernetes`` renders and submits JobSets for `phalanx k8s`."""

from phalanx.control.executors.base import Executor, Handle, Launch, Phase, Status
from phalanx.control.executors.local import LocalExecutor
from phalanx.control.executors.slurm import SlurmExecutor

__all__ = ["Executor", "Handle", "Launch", "LocalExecutor", "Phase", "SlurmExecutor", "Status"]
