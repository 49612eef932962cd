"""`phalanx run JOB.yaml --local-nodes`: every node of a multi-node job on this machine, to try the real
multi-node path without a cluster. One `phalanx agent` process per node and per spare, node n on its own
loopback address 127.0.0.(n + 2), node 0 hosting the rendezvous; they share this machine's filesystem, as
nodes of a cluster share theirs, but each has its own data cache (``PHALANX_DATA_CACHE``), as each node of a
cluster has its own local disk.

The agents run in sessions of their own, so a Ctrl-C at the terminal reaches this process alone, which hands
it to node 0 once (node 0 stops the job on every node); and each dies with this process. Nothing here waits
without a bound: the other agents find a frozen node 0 lost and say so (``--on-node0-lost``: a signal to this
process), and once they have left, this process kills node 0 and with it its workers, as a cluster manager
ends a job whose head node stopped answering.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from phalanx.launch.lifetime import die_with_parent
from phalanx.spec import JobSpec

POLL_S = 0.1


def local_addr(node: int) -> str:
    return f"127.0.0.{node + 2}"


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def run_local_nodes(job: Path, spec: JobSpec, runs_dir: Path) -> int:
    """Run the job's agents here; the job's exit code (node 0's, or a survivor's if node 0 died)."""
    from phalanx.data.remote import default_cache_dir

    count = spec.resources.nodes + spec.resources.spare_nodes
    rdzv = f"{local_addr(0)}:{free_port(local_addr(0))}"
    data_cache = default_cache_dir(spec.data.cache_dir if spec.data else None)
    # What a cluster manager is told by an agent that found node 0 lost: here, this process, by a signal.
    node0_lost = f"kill -USR1 {os.getpid()}"
    agents = [
        subprocess.Popen(
            [
                sys.executable, "-m", "phalanx", "agent", str(job), "--rdzv", rdzv, "--node-rank", str(node),
                "--addr", local_addr(node), "--runs-dir", str(runs_dir), "--on-node0-lost", node0_lost,
            ],
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
            env={**os.environ, "PHALANX_DATA_CACHE": str(data_cache / f"local-node-{node}")},
        )
        for node in range(count)
    ]  # fmt: skip
    reported: list[float] = []  # when an agent said node 0 is lost

    def forward(signum: int, _frame: object) -> None:
        agents[0].send_signal(signum)

    def lost(_signum: int, _frame: object) -> None:
        reported.append(time.monotonic())

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lost)
    try:
        _wait_for_node0(agents, reported, spec.resilience.node_timeout_s)
        # The others end once they see the job's end or node 0 gone; one still waiting to join, or frozen,
        # would not: stop it.
        _wait_all(agents, spec.resilience.node_timeout_s)
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
        codes = [agent.wait() for agent in agents]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return codes[0] if codes[0] >= 0 else max(codes[1:], default=1)


def _wait_for_node0(agents: list[subprocess.Popen], reported: list[float], timeout_s: float) -> None:
    """Until node 0's agent exits; or, once an agent reported node 0 lost, until every other agent has left
    (each does within ``timeout_s`` of finding it lost; at most twice that is waited): node 0 is frozen, and
    is killed with what it runs."""
    node0, others = agents[0], agents[1:]
    while node0.poll() is None:
        if reported and (all(a.poll() is not None for a in others) or time.monotonic() > reported[0] + 2 * timeout_s):
            print(f"[phalanx] node 0 was found lost: killing its agent (pid {node0.pid}) and its workers", flush=True)
            return
        time.sleep(POLL_S)


def _wait_all(agents: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
        time.sleep(POLL_S)
