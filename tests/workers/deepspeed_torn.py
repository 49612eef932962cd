"""Test harness, never the example's: examples/deepspeed_zero.py run as it is, but in the first attempt rank 1
kills itself (SIGKILL) right after writing its first file of the checkpoint of step TEAR_STEP: a kill that
lands inside a save, after some files of that checkpoint are written and before it is whole."""

import os
import runpy
import signal
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepspeed_zero.py"
torn = f"step-{int(os.environ['TEAR_STEP']):08d}"
save = torch.save


def save_then_die(obj, f, *args, **kwargs):
    save(obj, f, *args, **kwargs)
    if os.environ["RANK"] == "1" and os.environ["PHALANX_ATTEMPT"] == "0" and torn in str(f):
        os.kill(os.getpid(), signal.SIGKILL)


torch.save = save_then_die
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
