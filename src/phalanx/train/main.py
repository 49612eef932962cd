"""Entry point of a built-in-recipe worker: ``python -m phalanx.train.main`` (the supervisor runs it)."""

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from phalanx.checkpoint import memory
from phalanx.spec import load_spec
from phalanx.train.sdk import init
from phalanx.train.trainer import Trainer, warm_up


@record
def main() -> None:
    if "PHALANX_SPARE" in os.environ:  # a warm spare of in-process recovery: warm, then wait for a rank
        warm_up(load_spec(os.environ["PHALANX_SPEC"]))
    ctx = init()
    Trainer(ctx).fit()
    ctx.close()
    if memory.abandoned():  # a process group holds a transfer gloo never ends: its destructor would wait for ever
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
