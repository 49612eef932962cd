"""DeepSpeed under phalanx (``pip install phalanx[deepspeed]``): any ZeRO stage, DeepSpeed's own checkpoint files,
committed and verified by phalanx (no ``latest`` pointer of DeepSpeed's), saved on SIGTERM, and each step
reported. A script opts in with a few lines (examples/deepspeed_zero.py, docs/frameworks.md):

    ctx = phalanx.init()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loop = phalanx.integrations.deepspeed.step_loop(ctx, engine, tokens_per_step=...)
    step, client = loop.resume()                 # the newest checkpoint that verifies: its step, client state
    while step < steps:
        ...; engine.backward(loss); engine.step(); step += 1
        loop.done(step, loss=mean_loss)           # report; checkpoint when due; on SIGTERM save and exit
"""

from __future__ import annotations

from typing import Any

from phalanx.integrations.loop import StepLoop
from phalanx.train.sdk import WorkerContext


def step_loop(
    ctx: WorkerContext, engine: Any, tokens_per_step: int, flops_per_token: float | None = None,
    total_steps: int | None = None, client_state: Any = None, model: dict[str, Any] | None = None,
) -> StepLoop:  # fmt: skip
    """The loop of a DeepSpeed ``engine``. ``client_state`` (a callable returning a dict) is saved with each
    checkpoint and returned by ``resume()``. ``model``: the architecture, recorded in each checkpoint's manifest
    (for a Llama-shaped model, the recipe's config: `phalanx ckpt import` then needs no --preset)."""
    import deepspeed

    def write(root: str, tag: str) -> None:
        client = {**(client_state() if client_state is not None else {})}
        engine.save_checkpoint(root, tag=tag, client_state=client, save_latest=False)

    def read(root: str, tag: str) -> dict[str, Any]:
        path, client = engine.load_checkpoint(root, tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint {tag} under {root}, which phalanx verified")
        return client or {}

    zero = engine.zero_optimization_stage()
    about = {"framework": "deepspeed", "deepspeed": deepspeed.__version__, "zero_stage": zero, "model": model}
    return StepLoop(ctx, write, read, about, tokens_per_step, flops_per_token, total_steps)
