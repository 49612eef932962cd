"""How long the ``phalanx`` command takes to answer, and the server to import, against phalanx at an earlier
commit (the peer), in the same run (bench/RESULTS.md, docs/benchmarks/cli_startup.md).

    python bench/cli_startup.py [--peer REF] [--repeats 15] [--out section.md]

The peer is the same interpreter and environment with ``src/`` of ``REF`` (default: the commit before the CLI
stopped importing torch) checked out in a temporary git worktree. Each command runs ``--repeats`` times,
alternating the two, in a fresh process: the wall time from exec to exit, and whether torch was imported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import Report, spread

REPO = Path(__file__).resolve().parent.parent
PEER = "70aae1e"  # the last commit whose CLI imported torch (issue 32)
# what a user types, and what a process of the server imports; each prints whether torch came in
COMMANDS = {
    "phalanx --help": ["-m", "phalanx", "--help"],
    "phalanx jobs --help": ["-m", "phalanx", "jobs", "--help"],
    "phalanx validate examples/demo.yaml": ["-m", "phalanx", "validate", "examples/demo.yaml"],
    "import the server": ["-c", "import phalanx.control.server.main"],
}
TORCH_AT_EXIT = "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr))"


def timed(src: Path, args: list[str]) -> tuple[float, bool]:
    """Seconds from exec to exit of ``python args`` with phalanx from ``src``, and whether it imported torch."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    code = ["-c", f"{TORCH_AT_EXIT}; import runpy; " + _body(args)]
    began = time.perf_counter()
    ran = subprocess.run([sys.executable, *code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - began
    if ran.returncode != 0:
        raise RuntimeError(f"{args} failed under {src}: {ran.stderr[-2000:]}")
    return took, ran.stderr.strip().splitlines()[-1] == "True"


def _body(args: list[str]) -> str:
    """``args`` as code to run after the atexit hook: ``-m phalanx ...`` as runpy does it, or ``-c`` code."""
    if args[0] == "-m":
        return f"sys.argv = {['phalanx', *args[2:]]!r}; runpy.run_module('phalanx', run_name='__main__')"
    return args[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", default=PEER, help="the git ref to compare with")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        peer = Path(tmp) / "peer"
        subprocess.run(["git", "worktree", "add", "--detach", str(peer), args.peer], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        try:
            measured = {name: {"phalanx": [], "peer": []} for name in COMMANDS}
            torch_in = {name: {} for name in COMMANDS}
            for name, command in COMMANDS.items():
                for _ in range(args.repeats):
                    for side, src in (("phalanx", REPO / "src"), ("peer", peer / "src")):
                        took, torch = timed(src, command)
                        measured[name][side].append(took)
                        torch_in[name][side] = torch
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(peer)], cwd=REPO, check=False)
    report = Report(
        "CLI start-up",
        "python bench/cli_startup.py",
        f"Wall time from exec to exit of each command, in a fresh interpreter ({sys.version.split()[0]}), this "
        f"commit against `{args.peer}` (the peer: the same environment, its `src/`), {args.repeats} runs of each "
        "alternating the two: median (range), seconds.",
    )
    rows = []
    for name in COMMANDS:
        mine, theirs = measured[name]["phalanx"], measured[name]["peer"]
        rows.append([f"`{name}`", spread(mine, fmt="{:.2f}"), "yes" if torch_in[name]["phalanx"] else "no",
                     spread(theirs, fmt="{:.2f}"), "yes" if torch_in[name]["peer"] else "no"])  # fmt: skip
    report.table(["command", "phalanx s", "imports torch", f"{args.peer} s", "imports torch"], rows)
    for name in COMMANDS:
        mine, theirs = measured[name]["phalanx"], measured[name]["peer"]
        report.ratio(f"`{name}`, phalanx / {args.peer}", [m / t for m, t in zip(mine, theirs, strict=True)])
    for name in ("phalanx --help", "phalanx jobs --help"):
        report.ratio(f"`{name}`, s / 0.5 s", [m / 0.5 for m in measured[name]["phalanx"]], "<= 1")
    report.note(
        f"Median of `phalanx --help`: {statistics.median(measured['phalanx --help']['phalanx']):.2f} s here, "
        f"{statistics.median(measured['phalanx --help']['peer']):.2f} s at {args.peer}."
    )
    report.finish(args.out)


if __name__ == "__main__":
    main()
