"""bench/node_loss.py's torchft side: the same job as phalanx's (llama-tiny, 2 nodes x 2 CPU processes, HSDP
2 x 2, synthetic tokens, global batch 8) as torchft runs it, each node a replica group: FSDP2 over the node's
two processes, under a `torchrun` bound to the node's loopback address, and the replica groups' gradients
averaged through torchft's Manager (FSDP's all-reduce hook, as torchtitan does with torchft), with a
lighthouse. When a node is lost, the other group trains on alone: torchft drops the whole replica group.

Run as a script, it is one worker of one replica group (under torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from servers import descendants, free_port, signal_all  # noqa: E402


def one(python: str, work: Path, sig: signal.Signals, at: int = 30, timeout_s: float = 300) -> float:
    """Start both replica groups, ``sig`` to node 1's torchrun and workers once ``at`` steps are committed;
    the seconds from the signal to the next step committed (by node 0's group, training on alone)."""
    port = free_port()
    lighthouse = subprocess.Popen(
        [str(Path(python).with_name("torchft_lighthouse")), "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
         "--join_timeout_ms", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    env = {**os.environ, "BENCH_WORK": str(work), "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
           "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    nodes: list[subprocess.Popen] = []
    steps = work / "steps.jsonl"
    deadline = time.monotonic() + timeout_s
    try:
        for node in range(2):
            addr = f"127.0.0.{2 + node}"
            argv = [python, "-m", "torch.distributed.run", "--nnodes=1", "--node-rank=0", "--nproc-per-node=2",
                    f"--master-addr={addr}", f"--master-port={free_port()}", __file__]  # fmt: skip
            with (work / f"node-{node}.log").open("w") as log:
                nodes.append(subprocess.Popen(argv, env={**env, "REPLICA_GROUP_ID": str(node), "NODE_ADDR": addr},
                                              stdout=log, stderr=subprocess.STDOUT, cwd=REPO))  # fmt: skip

        def committed() -> list[dict]:
            return [json.loads(line) for line in steps.read_text().splitlines()] if steps.is_file() else []

        def until(done, what: str) -> None:
            while not done():
                if nodes[0].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"torchft's job {what}: not so (see {work}/node-0.log)")
                time.sleep(0.02)

        until(lambda: len(committed()) >= at and committed()[-1]["replicas"] == 2, f"trained {at} steps on both")
        struck = time.time()
        signal_all(descendants(nodes[1].pid), sig)
        until(lambda: [s for s in committed() if s["ts"] > struck], "trained again")
        return min(s["ts"] for s in committed() if s["ts"] > struck) - struck
    finally:
        for proc in nodes:
            signal_all(descendants(proc.pid), signal.SIGKILL)
            proc.wait()
        lighthouse.kill()
        lighthouse.wait()


def worker() -> None:
    """One rank of one replica group: FSDP2 over the group, the groups' gradients averaged by torchft; group
    rank 0 of replica group 0 writes each committed step."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from phalanx.data.synthetic import SyntheticTokens
    from phalanx.spec import parse_spec
    from phalanx.train.parallelize import build_mesh, build_model
    from phalanx.train.recipe import model_config
    from phalanx.train.state import ModelAndOptimizer

    work, replica = Path(os.environ["BENCH_WORK"]), int(os.environ["REPLICA_GROUP_ID"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = parse_spec(  # one node's part of phalanx's job: its model, built and sharded by phalanx's own code
        "name: bench\nresources: {procs_per_node: 2, device: cpu}\n"
        "train: {model: {preset: llama-tiny}, steps: 400, global_batch: 4, micro_batch: 2, seq_len: 32,"
        " parallel: {dp_shard: 2}, optimizer: {lr: 3.0e-3, warmup_steps: 2}}\n"
    )
    assert spec.train is not None
    cfg = model_config(spec)
    model, _ = build_model(cfg, build_mesh("cpu", spec.train.parallel), spec.train, torch.device("cpu"), False)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)

    state = ModelAndOptimizer(model, inner)  # what a group that joins heals from: FSDP-aware state dicts
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=state.load_state_dict,
        state_dict=state.state_dict,
        replica_id=f"node_{replica}",
        hostname=os.environ["NODE_ADDR"],
        timeout=timedelta(seconds=10),
        use_async_quorum=False,  # the quorum (and a joining group's state, read from this one) before forward:
        # read during it, FSDP's parameters were swapped under the forward (mixed Tensor and DTensor)
    )
    for module in model.modules():  # each FSDP unit's reduced gradients, averaged over the replica groups
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(lambda grad: manager.allreduce(grad).wait())
    optimizer = Optimizer(manager, inner)
    data = SyntheticTokens(cfg.vocab_size, 32, spec.train.seed)
    while (step := manager.current_step()) < 400:
        optimizer.zero_grad()  # starts the step's quorum; a group that joins heals from a live one here
        batch = data.local_batch(step, 8, replica * world + rank, 2 * world)
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()  # commits only if every member of the quorum finished the step
        if replica == 0 and rank == 0 and manager.current_step() > step:
            with (work / "steps.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "ts": time.time(), "replicas": manager.num_participants()}) + "\n")
    manager.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
