"""A lost node, from its loss to the job training again: this commit against phalanx at an earlier commit (the
peer: before agents were tethered to node 0), in the same run (bench/RESULTS.md, docs/benchmarks/node_loss.md).

    python bench/node_loss.py [--peer REF] [--runs 3] [--out section.md]

`phalanx run --local-nodes`, 2 nodes x 2 CPU processes of llama-tiny (HSDP) and a spare node, on loopback
addresses. Once a checkpoint is committed, node 1's agent and workers are killed (SIGKILL: the process gone,
its kernel closes its sockets) or frozen (SIGSTOP: a hung machine, which closes nothing). Measured from the
signal: the node_lost event (detection), and the first step completed after it (the restart path: the spare
node takes node 1's place, every rank loads the last checkpoint).
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

from _report import Report, spread

REPO = Path(__file__).resolve().parent.parent
PEER = "bf40843"  # the last commit without tethers: a lost node found by its heartbeats alone
SPEC = """name: bench
resources: {nodes: 2, procs_per_node: 2, device: cpu, spare_nodes: 1}
train: {model: {preset: llama-tiny}, steps: 400, global_batch: 8, micro_batch: 2, seq_len: 32,
        parallel: {dp_replicate: 2, dp_shard: 2}, optimizer: {lr: 3.0e-3, warmup_steps: 2}}
checkpoint: {every_steps: 10, keep_last: 2}
resilience: {max_restarts: 3, restart_backoff_s: 0, stop_grace_s: 5, node_timeout_s: 5}
"""


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines[:-1]] + ([json.loads(lines[-1])] if lines and lines[-1] else [])


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (an agent and its workers), parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        children.setdefault(int(text.rsplit(")", 1)[1].split()[1]), []).append(int(text.split(" (", 1)[0]))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop(0))
        todo += children.get(found[-1], [])
    return found


def one(src: Path, work: Path, sig: signal.Signals) -> tuple[float, float]:
    """(seconds from ``sig`` to node 1 found lost, to the next step completed) for phalanx from ``src``."""
    spec = work / "job.yaml"
    spec.write_text(SPEC)
    env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [sys.executable, "-m", "phalanx", "run", str(spec), "--runs-dir", str(work / "runs"), "--local-nodes"]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        run = None
        while run is None or not any(e["kind"] == "checkpoint_committed" for e in _jsonl(run / "events.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, "the job did not reach its first checkpoint"
            found = list((work / "runs" / "bench").glob("*")) if (work / "runs" / "bench").is_dir() else []
            run = found[0] if found else None
            time.sleep(0.05)
        (joined,) = [e for e in _jsonl(run / "events.jsonl") if e["kind"] == "nodes_joined"]
        node1 = _tree(joined["agents"]["1"]["pid"])
        struck = time.time()
        for pid in node1:
            os.kill(pid, sig)
        while not [m for m in _jsonl(run / "metrics.jsonl") if m["ts"] > struck]:
            assert proc.poll() is None and time.monotonic() < deadline, "the job did not train again"
            time.sleep(0.02)
        (lost,) = [e for e in _jsonl(run / "events.jsonl") if e["kind"] == "node_lost"]
        stepped = min(m["ts"] for m in _jsonl(run / "metrics.jsonl") if m["ts"] > struck)
        return lost["ts"] - struck, stepped - struck
    finally:
        for pid in _tree(proc.pid)[::-1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", default=PEER, help="the git ref to compare with")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = {"killed": signal.SIGKILL, "frozen": signal.SIGSTOP}
    measured: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        peer = Path(tmp) / "peer"
        subprocess.run(["git", "worktree", "add", "--detach", str(peer), args.peer], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        try:
            for n in range(args.runs):
                for case, sig in cases.items():
                    for side, src in (("phalanx", REPO / "src"), ("peer", peer / "src")):
                        work = Path(tmp) / f"{side}-{case}-{n}"
                        work.mkdir()
                        measured.setdefault((side, case), []).append(one(src, work, sig))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(peer)], cwd=REPO, check=False)
    report = Report(
        "Node loss",
        "python bench/node_loss.py",
        f"`phalanx run --local-nodes`: 2 nodes x 2 CPU processes of llama-tiny (HSDP 2 x 2) and a spare node, on "
        f"loopback addresses, `node_timeout_s: 5`; node 1's agent and workers killed (SIGKILL) or frozen "
        f"(SIGSTOP) after the first checkpoint. This commit against `{args.peer}` (the peer: heartbeats only), "
        f"{args.runs} runs of each, alternating: median (range), seconds from the signal.",
    )
    rows = []
    for case in cases:
        for side, name in (("phalanx", "phalanx"), ("peer", args.peer)):
            runs = measured[(side, case)]
            rows.append([case, name, spread([r[0] for r in runs], fmt="{:.2f}"),
                         spread([r[1] for r in runs], fmt="{:.2f}")])  # fmt: skip
    report.table(["node 1", "phalanx at", "found lost", "next step done"], rows)
    killed, before = measured[("phalanx", "killed")], measured[("peer", "killed")]
    report.ratio("killed: found lost, s / 1 s", [d for d, _ in killed], "< 1")
    steps = [a[1] / b[1] for a, b in zip(killed, before, strict=True)]
    report.ratio(f"killed: next step, phalanx / {args.peer}", steps)
    report.note(
        "A killed node is found by its closed tether (launch/tether.py); a frozen one still by its silence, "
        "after node_timeout_s. Either way the job then restarts from its last checkpoint on the spare node: "
        "recovering a lost node's ranks in process, with their shards from peers' memory, is issue 33's next part."
    )
    report.finish(args.out)


if __name__ == "__main__":
    main()
