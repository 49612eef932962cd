"""A lost node, from its loss to the job training again: in process (a spare node's warm spares take its ranks,
the state from peers' memory) against phalanx's restart path and against phalanx at an earlier commit (the
peer: before agents were tethered to node 0), all in the same run (bench/RESULTS.md,
docs/benchmarks/node_loss.md).

    python bench/node_loss.py [--peer REF] [--runs 3] [--torchft-python PY] [--out section.md]

`phalanx run --local-nodes`: 2 nodes x 2 CPU processes of llama-tiny (HSDP 2 x 2) and spare nodes, each an
agent on its own loopback address. Once the spare node's warm spares are ready and a checkpoint is committed,
node 1's agent and workers are killed (SIGKILL: the processes gone, their kernel closes their sockets) or
frozen (SIGSTOP: a hung machine, which closes nothing). Measured from the signal: the node_lost event
(detection), and the first step completed after it. The same job under torchft (where it is installed, as
in ``make bench-env``), each node a replica group (bench/_torchft_nodes.py), node 1 killed alike. Then a run
that loses a node twice in 60 steps (two spare nodes), and its goodput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _torchft_nodes
from _report import Report, spread

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from servers import descendants, signal_all  # noqa: E402

PEER = "bf40843"  # the last commit without tethers: a lost node found by its heartbeats alone
SPEC = """name: bench
resources: {{nodes: 2, procs_per_node: 2, device: cpu, spare_nodes: {spares}}}
train: {{model: {{preset: {preset}}}, steps: {steps}, global_batch: 8, micro_batch: 2, seq_len: 32,
        parallel: {{dp_replicate: 2, dp_shard: 2}}, optimizer: {{lr: 3.0e-3, warmup_steps: 2}}}}
checkpoint: {{every_steps: {every}, keep_last: 2}}
resilience: {{max_restarts: 3, restart_backoff_s: 0, stop_grace_s: 5, node_timeout_s: 5, in_process: {in_process},
             memory_every_steps: 1}}
"""


def _jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file being appended to."""
    if not path.is_file():
        return []
    found = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            found.append(json.loads(line))
    return found


class Job:
    """One `phalanx run --local-nodes` in the background, with phalanx from ``src``."""

    def __init__(
        self, src: Path, work: Path, in_process: bool, spares: int = 1, steps: int = 400, preset: str = "llama-tiny",
        every: int = 10,
    ):  # fmt: skip
        spec = work / "job.yaml"
        lowered = str(in_process).lower()
        spec.write_text(SPEC.format(spares=spares, steps=steps, in_process=lowered, preset=preset, every=every))
        argv = [sys.executable, "-m", "phalanx", "run", str(spec), "--runs-dir", str(work / "runs"), "--local-nodes"]
        env = {**os.environ, "PYTHONPATH": str(src)}
        with (work / "out.log").open("w") as out:  # the launcher's output, every node's
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.runs, self.deadline = work / "runs" / "bench", time.monotonic() + 300
        self.in_process = in_process

    def events(self, kind: str) -> list[dict]:
        runs = list(self.runs.glob("*")) if self.runs.is_dir() else []
        return [e for e in _jsonl(runs[0] / "events.jsonl") if e["kind"] == kind] if runs else []

    def steps(self) -> list[dict]:
        runs = list(self.runs.glob("*")) if self.runs.is_dir() else []
        return _jsonl(runs[0] / "metrics.jsonl") if runs else []

    def until(self, done, what: str) -> None:
        while not done():
            if self.proc.poll() is not None or time.monotonic() > self.deadline:
                raise RuntimeError(f"the job {what}: not so")
            time.sleep(0.02)

    def ready(self, steps: int) -> None:
        """Wait until the job can lose a node the way it is meant to: a checkpoint committed, ``steps`` steps
        done, and with in-process recovery the spare node's warm spares waiting."""
        if self.in_process:
            self.until(lambda: self.events("spares_ready"), "has the spare node's spares ready")
        self.until(lambda: self.events("checkpoint_committed") and len(self.steps()) >= steps, "trained")

    def strike(self, node: int, sig: signal.Signals) -> float:
        """Send ``sig`` to ``node``'s agent and workers; when (Unix time)."""
        said = [e["agents"] for kind in ("nodes_joined", "nodes_changed") for e in self.events(kind)]
        agent = next(agents[str(node)] for agents in said if str(node) in agents)  # spares may join late
        struck = time.time()
        signal_all(descendants(agent["pid"]), sig)
        return struck

    def recovery(self, struck: float) -> tuple[float, float]:
        """(seconds from ``struck`` to the node found lost, to the next step completed after that: a step whose
        report was on its way as the node went counts for none)."""
        self.until(lambda: [e for e in self.events("node_lost") if e["ts"] > struck], "found the node lost")
        (lost,) = [e for e in self.events("node_lost") if e["ts"] > struck]
        self.until(lambda: [m for m in self.steps() if m["ts"] > lost["ts"]], "trained again")
        return lost["ts"] - struck, min(m["ts"] for m in self.steps() if m["ts"] > lost["ts"]) - struck

    def stop(self) -> None:
        signal_all(descendants(self.proc.pid)[::-1], signal.SIGKILL)
        self.proc.wait()


def one(src: Path, work: Path, in_process: bool, sig: signal.Signals) -> tuple[float, float]:
    job = Job(src, work, in_process)
    try:
        job.ready(steps=30)
        return job.recovery(job.strike(1, sig))
    finally:
        job.stop()


def twice(work: Path) -> tuple[float, float, float]:
    """A 60-step run of llama-debug that loses node 1 after step 20 and the node that took its place after step
    40, with two spare nodes: (its goodput, its goodput over the time it trained: the start-up and the end left
    out, its wall seconds)."""
    job = Job(REPO / "src", work, True, spares=2, steps=60, preset="llama-debug", every=30)
    try:
        job.ready(steps=20)
        job.recovery(job.strike(1, signal.SIGKILL))
        (began,) = job.events("recovery_started")
        job.until(lambda: len(job.events("spares_ready")) >= 2 and len(job.steps()) >= 40, "trained on")
        job.recovery(job.strike(began["spare_node"], signal.SIGKILL))
        job.until(lambda: job.proc.poll() is not None, "ended")
        if job.proc.returncode != 0:
            raise RuntimeError(f"the run that lost two nodes exited {job.proc.returncode}")
        ledger = json.loads(next(job.runs.glob("*/goodput.json")).read_text())
        trained = ledger["wall_s"] - ledger["seconds"]["idle"]
        return ledger["goodput"], ledger["seconds"]["productive"] / trained, ledger["wall_s"]
    finally:
        job.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", default=PEER, help="the git ref whose restart path to compare with")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--torchft-python",
        default=str(REPO / ".venv-bench" / "bin" / "python"),
        help="an interpreter with torchft (`make bench-env`); without it, torchft's row is left out",
    )
    args = parser.parse_args()
    probe = [args.torchft_python, "-c", "import torchft"]
    torchft = Path(args.torchft_python).is_file() and subprocess.run(probe, capture_output=True).returncode == 0
    # (row, phalanx from the peer's src, in process, signal)
    cases = [
        ("in process, node killed", False, True, signal.SIGKILL),
        ("in process, node frozen", False, True, signal.SIGSTOP),
        ("restart, node killed", False, False, signal.SIGKILL),
        (f"restart, node killed, at {args.peer}", True, False, signal.SIGKILL),
    ]
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in cases}
    theirs: list[float] = []  # torchft's: from the kill to the next step
    with tempfile.TemporaryDirectory() as tmp:
        peer = Path(tmp) / "peer"
        subprocess.run(["git", "worktree", "add", "--detach", str(peer), args.peer], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        try:
            for n in range(args.runs):
                for name, at_peer, in_process, sig in cases:
                    work = Path(tmp) / f"{len(measured[name])}-{n}-{name.replace(' ', '-').replace(',', '')}"
                    work.mkdir()
                    measured[name].append(one(peer / "src" if at_peer else REPO / "src", work, in_process, sig))
                if torchft:
                    work = Path(tempfile.mkdtemp(dir=tmp))
                    theirs.append(_torchft_nodes.one(args.torchft_python, work, signal.SIGKILL))
            two = [twice(Path(tempfile.mkdtemp(dir=tmp))) for _ in range(args.runs)]
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(peer)], cwd=REPO, check=False)
    report = Report(
        "Node loss",
        "python bench/node_loss.py",
        "`phalanx run --local-nodes`: 2 nodes x 2 CPU processes of llama-tiny (HSDP 2 x 2) and a spare node, each "
        "agent on its own loopback address, `node_timeout_s: 5`; node 1's agent and workers killed (SIGKILL) or "
        "frozen (SIGSTOP) after step 30, once a checkpoint is committed (and, in process, the spare node's "
        f"warm spares wait). {args.runs} runs of each, alternating; median (range), seconds from the signal. "
        f"The peer is phalanx at `{args.peer}` (the same environment, its `src/` in a git worktree): a lost node "
        "found by its heartbeats alone."
        + (
            " torchft 0.2.0 (bench/_torchft_nodes.py): the same job, each node a replica group of 2 processes "
            "under its own torchrun on the node's address (FSDP2 within it, torchft's Manager averaging the "
            "groups' gradients, a lighthouse with its defaults but join_timeout_ms 1000, as in bench/recovery.py: "
            "its heartbeat timeout, 5 s, finds a lost group), node 1's torchrun and workers killed after step 30: "
            "node 0's group trains on alone, with half the data parallelism (torchft drops a lost replica group; "
            "it is not the same training)."
            if torchft
            else ""
        ),
    )
    rows = [[name, spread([r[0] for r in runs], fmt="{:.2f}"), spread([r[1] for r in runs], fmt="{:.2f}")]
            for name, runs in measured.items()]  # fmt: skip
    if theirs:
        rows.append(["torchft, node killed (its replica group dropped)", "", spread(theirs, fmt="{:.2f}")])
    report.table(["node 1", "found lost", "next step done"], rows)
    killed = measured["in process, node killed"]
    restart, peer_restart = measured["restart, node killed"], measured[f"restart, node killed, at {args.peer}"]
    step_s = 0.1  # llama-tiny's step here is 50-110 ms: "2 s plus one step" with the slowest
    report.ratio("in process, killed: next step / (2 s + a step)", [r[1] / (2 + step_s) for r in killed], "<= 1")
    report.ratio("in process / restart path, killed: next step", [a[1] / b[1] for a, b in zip(killed, restart,
                 strict=True)], "<= 0.3")  # fmt: skip
    if theirs:
        report.ratio("in process / torchft, killed: next step", [a[1] / b for a, b in zip(killed, theirs, strict=True)])
    report.ratio(f"restart path, killed: next step, phalanx / {args.peer}",
                 [a[1] / b[1] for a, b in zip(restart, peer_restart, strict=True)])  # fmt: skip
    report.ratio("two nodes lost in 60 steps: goodput of the training time", [t[1] for t in two], ">= 0.9", unit="")
    report.note(
        f"Two nodes lost in 60 steps of llama-debug (node 1 after step 20, the spare that took its place after "
        f"step 40; two spare nodes; a checkpoint every 30 steps, a memory snapshot every step): goodput "
        f"{spread([t[0] for t in two], 100, '{:.1f}')}% of the whole run, "
        f"{spread([t[1] for t in two], 100, '{:.1f}')}% of the time it trained (the run's start-up and end, "
        f"'idle' in its ledger, left out), of {spread([t[2] for t in two], fmt='{:.1f}')} s of wall time in all."
    )
    report.finish(args.out)


if __name__ == "__main__":
    main()
