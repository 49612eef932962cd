"""Entry point of a built-in-recipe worker: ``python -m phalanx.train.main`` (the supervisor runs it)."""

from torch.distributed.elastic.multiprocessing.errors import record

from phalanx.train.sdk import init
from phalanx.train.trainer import Trainer


@record
def main() -> None:
    ctx = init()
    Trainer(ctx).fit()
    ctx.close()


if __name__ == "__main__":
    main()
