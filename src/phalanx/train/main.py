"""Entry point of a built-in-recipe worker: ``python -m phalanx.train.main`` (the supervisor runs it). Warm
spares of in-process recovery are forks of a zygote (launch/zygote.py) that imported this module and ran
``warm()`` once; each then runs ``main()``."""

import gc
import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from phalanx.checkpoint import memory
from phalanx.spec import load_spec
from phalanx.train.ft import warm_up
from phalanx.train.sdk import init
from phalanx.train.trainer import Trainer


def warm() -> None:
    """In the zygote, before any spare is forked from it: run the recipe's code paths once (``warm_up``), so
    that every spare starts warm and costs training no CPU. On one thread: a process that forks must not have
    started OpenMP's thread pool (GNU OpenMP's does not survive a fork); each spare sets its own."""
    torch.set_num_threads(1)
    warm_up(load_spec(os.environ["PHALANX_SPEC"]))
    _settle()


def _settle() -> None:
    """What exists by now (torch's modules and the like, a few hundred thousand objects) lives as long as the
    process: out of the collector's sight, a full collection then takes milliseconds, not 0.16 s. An
    in-process recovery makes one, on its critical path, to free the old model before building the new."""
    gc.collect()
    gc.freeze()


@record
def main() -> None:
    if "PHALANX_SPARE" in os.environ:  # forked from the zygote, warm and settled: its threads, then wait for a rank
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    else:
        _settle()
    ctx = init()
    Trainer(ctx).fit()
    ctx.close()
    # A process group may hold a transfer gloo never ends (its destructor would wait for ever), and a process that
    # recovered in process, torn down by the interpreter's exit, was seen to abort ("terminate called without an
    # active exception") after its last step, which the supervisor took for a failure: such a worker, done and
    # its groups closed, ends without destructors.
    if memory.abandoned() or (ctx.spec is not None and ctx.spec.resilience.in_process):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
