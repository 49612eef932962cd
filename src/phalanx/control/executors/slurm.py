"""The Slurm executor: a job becomes one sbatch allocation of nodes (and up to spare_nodes more), and ``srun``
starts a ``phalanx agent`` on each; node 0's agent (the job's supervisor) hosts the rendezvous on the
allocation's first node. Slurm places and starts; phalanx does the rest, as on any other backend.

Node 0's agent runs in a step of its own, so the batch script can take its verdict, which is the job's, as
its exit code: an agent killed with a lost node does not turn a recovered job into a failed one. The
allocation is asked with ``--no-kill``: a lost node is phalanx's to handle (a spare, or a shrink), not a
reason for Slurm to end the job. Node 0 lost is the one loss the job cannot survive in place: Slurm would not
notice (with --no-kill it drops a failed batch host from the job and lets it run on to its time limit), so the
surviving agents ask for the requeue themselves (``scontrol requeue``; ``scancel`` without ``requeue``), and
the job starts again and resumes from its last checkpoint. docs/clusters.md has the timings.

    <dir>/job.yaml              the spec the agents read (on the shared filesystem)
         /job.sbatch            the batch script
         /slurm_job_id          Slurm's id for it, once sbatch took it: the one submission that runs
         /slurm-<id>.out        the batch script's output (appended to across requeues)
         /slurm-<id>.<node>.out each node's agent's own (a node lost loses no other node's log)
         /nodes-<id>            each node's address, as slurmctld gave it once, at the start
         /time-limit-<id>       the job was warned that its time limit is near, and stopped
         /checkpoints/          unless the spec's checkpoint.dir says otherwise
         /runs/<name>/<run id>/ the run directory, unless another runs directory is given
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from phalanx.control.executors.base import Handle, Launch, Phase, Status
from phalanx.control.scheduler import ANY_TYPE, Node
from phalanx.obs.rundir import newest_run
from phalanx.spec import JobSpec, dump_spec, parse_spec
from phalanx.storage import write_atomic

CAPACITY_TTL_S = 30.0
SETTLE_S = 10  # after node 0's agent ended, how long the other agents get to see it and end on their own
CLAIM_WAIT_S = 120  # how long a submitted batch script waits for its submitter to record it (slurm_job_id)
# Job states of Slurm's in which the job is not over (squeue(1), "JOB STATE CODES").
ACTIVE = {
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
    "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT",
}  # fmt: skip
ENDED = {
    "COMPLETED": "completed",
    "FAILED": "failed (a non-zero exit)",
    "CANCELLED": "cancelled",
    "TIMEOUT": "timed out (its time limit)",
    "NODE_FAIL": "ended by a node failure",
    "PREEMPTED": "preempted by Slurm",
    "OUT_OF_MEMORY": "out of memory",
    "BOOT_FAIL": "failed to boot its nodes",
    "DEADLINE": "past its deadline",
}


class SlurmError(RuntimeError):
    """A Slurm command failed; the message has the command and what it said."""


def gpus_per_node(spec: JobSpec) -> int:
    if spec.slurm.gpus_per_node is not None:
        return spec.slurm.gpus_per_node
    return spec.resources.procs_per_node if spec.resources.device == "cuda" else 0


def directives(
    spec: JobSpec, workdir: Path, log: Path, partition: str | None = None, gpu_type: str | None = None
) -> list[str]:
    """What the batch script asks of sbatch. GPU jobs take whole nodes and all their memory unless the spec
    says otherwise; CPU jobs a CPU per worker; GPUs of ``gpu_type`` when the scheduler placed the job on
    that type (a gres type: Slurm then places it on nodes of that type, spares included). Spares are asked as
    a range, nodes to nodes + spare_nodes: the job starts with the spares that are free (a node lost before a
    requeue need not come back first)."""
    res, opts = spec.resources, spec.slurm
    gpu = res.device == "cuda"
    exclusive = opts.exclusive if opts.exclusive is not None else gpu
    cpus = opts.cpus_per_node or (None if exclusive else res.procs_per_node)
    mem = opts.mem if opts.mem is not None else ("0" if gpu else None)
    nodes = f"{res.nodes}-{res.nodes + res.spare_nodes}" if res.spare_nodes else str(res.nodes)
    gpus = gpus_per_node(spec)
    gres = (f"gpu:{gpu_type}:{gpus}" if gpu_type else f"gpu:{gpus}") if gpus else None
    asked = (
        ("cpus-per-task", cpus), ("mem", mem), ("gres", gres),
        ("time", opts.time_limit), ("partition", opts.partition or partition), ("account", opts.account),
        ("qos", opts.qos), ("constraint", opts.constraint),
    )  # fmt: skip
    return [
        f"--job-name={spec.name}",
        f"--nodes={nodes}",
        *(f"--{flag}={value}" for flag, value in asked if value is not None),
        *(["--exclusive"] if exclusive else []),
        *opts.sbatch_options,
        f"--chdir={workdir}",
        f"--output={log}",
        "--open-mode=append",
        "--wait-all-nodes=1",
        "--no-kill",
        "--requeue" if opts.requeue else "--no-requeue",
        f"--signal=B:USR1@{spec.stop_margin_s}",
    ]


def render(
    spec: JobSpec,
    job: Path,
    runs_dir: Path,
    workdir: Path,
    log: Path,
    partition: str | None = None,
    python: str = sys.executable,
    gpu_type: str | None = None,
    claim: Path | None = None,
) -> str:
    """The sbatch script of ``spec``, whose file is ``job`` (every path absolute: the script runs elsewhere);
    ``partition`` when the spec names none. ``log``: the batch script's output (``%j``: the job id); each
    node's agent writes its own beside it, <log>.<node name>.out, so that losing one node loses no other's.
    ``claim``: the file its submitter records the Slurm job id in; a job whose id is not the one recorded
    there ends at once (``submit``)."""
    opts = spec.slurm
    q = shlex.quote
    low, high = opts.ports
    stem = log.name.removesuffix(".out")
    head, _, tail = stem.partition("%j")
    node_log = q(str(log.parent / head)) + ('"$SLURM_JOB_ID"' + (q(tail) if tail else "") if "%j" in stem else "")
    after_lost = "scontrol requeue" if opts.requeue else "scancel"
    cpus = f"--cpus-per-task={opts.cpus_per_node}" if opts.cpus_per_node else '--cpus-per-task="$step_cpus"'
    # No stdin and no output through srun: a task whose I/O goes through srun is killed by its slurmstepd the
    # moment srun's connection drops (the batch host's processes killed), before it could requeue the job.
    step = (
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 --no-kill --input=none --output={q(str(log))} "
        f"--open-mode=append {cpus}"
    )
    launch = (
        'bash -c \'exec "$@" --node-rank {rank} --addr "$(node_addr "$SLURMD_NODENAME")" '
        '>> "$node_log.$SLURMD_NODENAME.out" 2>&1\' agent "${{agent[@]}}"'
    )
    lines = [
        "#!/bin/bash",
        f"# phalanx job {spec.name}: {spec.resources.nodes} node(s) + up to {spec.resources.spare_nodes} spare(s), "
        f"from {job}",
        *(f"#SBATCH {d}" for d in directives(spec, workdir, log, partition, gpu_type)),
        "set -uo pipefail",
        *(_claimed(claim) if claim is not None else []),
        *(["", "# slurm.setup: each node's environment", *opts.setup] if opts.setup else []),
        "",
        "# Every node's address, from one call to slurmctld (not one per node), in a file each agent reads its own",
        "# line of. Node 0's agent hosts the rendezvous on the first node (where this script runs), on a port of",
        "# slurm.rdzv_ports that the job id picks (the same on every start). Each agent writes its own log, so that",
        "# losing a node, this one included, loses no other node's output.",
        f'nodes={q(str(log.parent))}/nodes-"$SLURM_JOB_ID"',
        f"node_log={node_log}",
        "export nodes node_log",
        'scontrol show node -o "$SLURM_JOB_NODELIST" | awk \'{for (i = 1; i <= NF; i++) {split($i, kv, "="); '
        'f[kv[1]] = kv[2]}; print f["NodeName"], f["NodeAddr"]}\' > "$nodes"',
        'node_addr() { awk -v name="$1" \'$1 == name {print $2}\' "$nodes"; }',
        "export -f node_addr",
        'rdzv_addr=$(node_addr "$SLURMD_NODENAME")',
        f"rdzv_port=$(( {low} + SLURM_JOB_ID % {high - low + 1} ))",
        "# each step's task takes the CPUs the node has in the job: the fewest of any node (72(x2),64 -> 64)",
        "step_cpus=$(echo \"$SLURM_JOB_CPUS_PER_NODE\" | tr ',' '\\n' | sed 's/(.*//' | sort -n | head -n1)",
        f"agent=({q(opts.python or python)} -m phalanx agent {q(str(job))} --runs-dir {q(str(runs_dir))} "
        f'--rdzv "$rdzv_addr:$rdzv_port" --on-node0-lost "{after_lost} $SLURM_JOB_ID")',
        'echo "phalanx: Slurm job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, '
        'rendezvous $rdzv_addr:$rdzv_port; each node logs to $node_log.<node>.out"',
        "",
        "# Slurm's SIGTERM (scancel, preemption) reaches every agent; node 0's stops the job with a checkpoint.",
        "# This script waits for that instead of dying first, which would end the steps. The warning Slurm sends",
        "# slurm.stop_margin_s before the time limit (USR1) is passed on as that SIGTERM to the steps (srun itself",
        "# would take a SIGTERM as an order to kill its step).",
        "other_steps=",
        "time_limit_near() {",
        f'    echo "phalanx: the time limit is {spec.stop_margin_s} s away: stopping the job with a checkpoint"',
        f'    touch {q(str(log.parent))}/time-limit-"$SLURM_JOB_ID"',
        '    scancel --signal=TERM "$SLURM_JOB_ID"',
        "}",
        "trap time_limit_near USR1",
        "trap true TERM",
        f"{step} --nodes=1 --ntasks=1 --relative=0 {launch.format(rank=0)} &",
        "head_step=$!",
        'if [ "$SLURM_JOB_NUM_NODES" -gt 1 ]; then',
        f"    {step} --nodes=$((SLURM_JOB_NUM_NODES - 1)) --ntasks=$((SLURM_JOB_NUM_NODES - 1)) --relative=1 "
        + launch.format(rank="$((SLURM_PROCID + 1))")
        + " &",
        "    other_steps=$!",
        "fi",
        'while kill -0 "$head_step" 2>/dev/null; do wait "$head_step"; done',
        'wait "$head_step"; code=$?',
        "# The other agents end once they see the job's end; one that does not is stopped.",
        f'for _ in $(seq {SETTLE_S + int(spec.resilience.node_timeout_s)}); do [ -n "$other_steps" ] && '
        'kill -0 "$other_steps" 2>/dev/null || break; sleep 1; done',
        '[ -n "$other_steps" ] && { kill "$other_steps" 2>/dev/null; wait "$other_steps"; }',
        'exit "$code"',
        "",
    ]
    return "\n".join(lines)


def _claimed(claim: Path) -> list[str]:
    """The batch script's first lines: it runs only as the submission its submitter recorded."""
    q = shlex.quote(str(claim))
    return [
        "",
        "# Only the submission recorded in slurm_job_id runs. Submitted twice (a server frozen in the middle of",
        "# sbatch and woken after another submitted the job again), the other ends here; so does one whose",
        f"# submitter died before recording it ({CLAIM_WAIT_S} s on: a server submits it again).",
        f"for _ in $(seq {CLAIM_WAIT_S}); do [ -s {q} ] && break; sleep 1; done",
        f'if [ "$(cat {q} 2>/dev/null)" != "$SLURM_JOB_ID" ]; then',
        f'    echo "phalanx: Slurm job $SLURM_JOB_ID is not the submission recorded in {q}: it ends unrun"',
        "    exit 0",
        "fi",
    ]


def node_log_shown(log: Path) -> str:
    """Each node's log, beside the batch script's, as the docs and messages show it."""
    return log.name.replace("%j", "<job id>").removesuffix(".out") + ".<node>.out"


@dataclass(frozen=True)
class Submitted:
    job_id: str
    dir: Path  # job.yaml, job.sbatch and the log
    log: Path
    runs_dir: Path

    def handle(self) -> Handle:
        return {"job_id": self.job_id, "dir": str(self.dir), "runs_dir": str(self.runs_dir)}


def submit(
    spec_text: str,
    where: Path,
    workdir: Path,
    runs_dir: Path | None = None,
    partition: str | None = None,
    source: str = "<spec>",
    gpu_type: str | None = None,
) -> Submitted:
    """Write the spec and its batch script into ``where`` (a new directory on the shared filesystem) and sbatch
    it. Submitting into a directory that was submitted from before returns that job, never a second one: of
    two submissions at once, the first recorded in slurm_job_id runs, and the other is cancelled (its batch
    script ends by itself if it starts first)."""
    where = where.absolute()
    spec = parse_spec(spec_text, source=source)
    runs_dir = (runs_dir or where / "runs").absolute()
    if (recorded := _recorded(where)) is not None:
        return Submitted(recorded, where, where / f"slurm-{recorded}.out", runs_dir)
    where.mkdir(parents=True, exist_ok=True)
    if spec.checkpoint.dir is None:  # one place for every start of the job: a requeued job resumes from it
        spec = spec.model_copy(
            update={"checkpoint": spec.checkpoint.model_copy(update={"dir": str(where / "checkpoints")})}
        )
        spec_text = dump_spec(spec)
    log = where / "slurm-%j.out"
    script = render(spec, where / "job.yaml", runs_dir, workdir.absolute(), log, partition, gpu_type=gpu_type,
                    claim=where / "slurm_job_id")  # fmt: skip
    for name, text in (("job.yaml", spec_text), ("job.sbatch", script)):
        _write_once(where / name, text)
    out = _run("sbatch", "--parsable", str(where / "job.sbatch"), cwd=where)
    job_id = _record(where, out.split(";")[0].strip())  # --parsable: "ID" or "ID;CLUSTER"
    return Submitted(job_id, where, where / f"slurm-{job_id}.out", runs_dir)


def _recorded(where: Path) -> str | None:
    """The Slurm job id recorded as ``where``'s submission, if one is."""
    with contextlib.suppress(FileNotFoundError):
        return (where / "slurm_job_id").read_text().strip()
    return None


def _record(where: Path, job_id: str) -> str:
    """Record ``job_id`` as ``where``'s submission unless another was recorded first (a link made only where
    none is: all or nothing), and else cancel ``job_id``. The id of the submission that runs."""
    draft = where / f"slurm_job_id.{job_id}"
    draft.write_text(job_id + "\n")
    try:
        os.link(draft, where / "slurm_job_id")
    except FileExistsError:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # if it started, it ends by itself anyway
            subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
        return _recorded(where) or job_id
    finally:
        draft.unlink()
    return job_id


def _write_once(path: Path, text: str) -> None:
    """A file of the submission's, written whole; left as it is when another submission of it wrote it: an
    agent may be reading it."""
    if not (path.is_file() and path.read_text() == text):
        write_atomic(path, text.encode())


@dataclass(frozen=True)
class JobInfo:
    """What Slurm says about a job: its state, why (pending reason, or how it ended), and its requeues."""

    state: str
    reason: str
    restarts: int
    exit_code: str = ""
    nodes: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def describe(self) -> str:
        requeued = f", requeued by Slurm {self.restarts} time(s)" if self.restarts else ""
        why = "" if self.reason in ("", "None", "(null)") else f" ({self.reason})"
        if self.active:
            where = f" on {self.nodes}" if self.nodes and self.state == "RUNNING" else ""
            return f"Slurm: {self.state.lower()}{where}{why}{requeued}"
        exit_code = f", exit code {self.exit_code}" if self.exit_code not in ("", "0:0") else ""
        return f"Slurm: {ENDED.get(self.state, self.state.lower())}{why}{exit_code}{requeued}"


def job_info(job_id: str) -> JobInfo | None:
    """The job as the controller knows it (``scontrol show job``, the data squeue shows), else as accounting
    keeps it once the controller forgot it (``sacct``; on a cluster without slurmdbd, the job completion log
    through ``sacct --completion``). None when no source knows it."""
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    if done.returncode == 0 and done.stdout.strip():
        fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
        return JobInfo(
            fields["JobState"],
            fields.get("Reason", ""),
            int(fields.get("Restarts", "0") or 0),
            fields.get("ExitCode", ""),
            fields.get("NodeList", ""),
        )
    for completion in ([], ["--completion"]):
        done = subprocess.run(
            ["sacct", *completion, "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode"],
            capture_output=True,
            text=True,
        )
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            jid, state, exit_code = [*line.split("|"), "", ""][:3]
            if jid == job_id:
                return JobInfo(state.split()[0], "", 0, exit_code)  # "CANCELLED by 0" -> CANCELLED
    return None


class SlurmExecutor:
    """The control plane's executor for a Slurm cluster: each execution is one sbatch job. The scheduler admits
    against the partition's nodes; Slurm places the job within it."""

    name = "slurm"
    shares = False  # a share of a GPU would need Slurm's gres sharding or MPS configured: whole GPUs only

    def __init__(self, root: str | Path, partition: str | None = None):
        for command in ("sbatch", "scontrol", "scancel", "sinfo"):
            if shutil.which(command) is None:
                raise SlurmError(f"the slurm executor needs Slurm's `{command}` on PATH (Debian: slurm-client)")
        self.root, self.partition = Path(root).absolute(), partition
        self._capacity: tuple[float, list[Node]] | None = None
        self.unit = "GPUs"  # "slots" once sinfo shows a partition without GPUs

    def capacity(self) -> list[Node]:
        """Each node of the partition with its GPUs (gres) and their type (the gres type of most of them;
        none: ANY_TYPE), or its CPUs as slots on a cluster without GPUs; asked of Slurm at most every
        CAPACITY_TTL_S, not every scheduling round."""
        if self._capacity is not None and time.monotonic() - self._capacity[0] < CAPACITY_TTL_S:
            return self._capacity[1]
        args = ["sinfo", "-N", "-h", "-o", "%N|%G|%c"] + (["-p", self.partition] if self.partition else [])
        nodes: dict[str, Node] = {}
        any_gpus = False
        for line in _run(*args).splitlines():
            name, gres, cpus = line.split("|")
            typed = [(int(n), t or ANY_TYPE) for t, n in re.findall(r"gpu(?::([^:(,]+))?:(\d+)", gres)]
            gpus = sum(n for n, _ in typed)
            nodes[name] = Node(name, name, gpus or int(cpus), max(typed)[1] if typed else ANY_TYPE)
            any_gpus = any_gpus or gpus > 0
        self.unit = "GPUs" if any_gpus else "slots"
        if not nodes:
            raise SlurmError(f"sinfo lists no nodes{f' in partition {self.partition}' if self.partition else ''}")
        self._capacity = (time.monotonic(), list(nodes.values()))
        return self._capacity[1]

    def start(self, launch: Launch) -> Handle:
        where = self.root / launch.job_id / f"attempt-{launch.attempt}"
        typed = {node.name: node.gpu_type for node in self.capacity()}
        types = {typed.get(name, ANY_TYPE) for name in launch.placement}  # several: a gang allowed to mix them
        gpu_type = types.pop() if len(types) == 1 and ANY_TYPE not in types else None
        done = submit(launch.spec, where, Path(launch.workdir), partition=self.partition,
                      source=f"job {launch.job_id}", gpu_type=gpu_type)  # fmt: skip
        return done.handle()

    def adopt(self, handle: Handle) -> None:
        return None  # Slurm holds the job's nodes; nothing to count here

    def status(self, handle: Handle) -> Status:
        run = newest_run(handle["runs_dir"])
        run_dir = run.root if run is not None else None
        info = job_info(handle["job_id"])
        if info is None:
            return Status(Phase.LOST, run_dir, reason=f"Slurm no longer knows job {handle['job_id']}")
        if info.active:
            return Status(Phase.RUNNING, run_dir, reason=info.describe())
        if run is not None and (ended := run.read_result()) is not None:
            said = info.describe()
            if (Path(handle["dir"]) / f"time-limit-{handle['job_id']}").is_file():  # the batch script's USR1 trap
                said = "Slurm: its time limit was near (slurm.time_limit, warned slurm.stop_margin_s before)"
            reason = ended.reason + (f" ({said})" if info.state != "COMPLETED" else "")
            return Status(Phase.EXITED, run_dir, ended.outcome, ended.exit_code, reason)
        return Status(Phase.LOST, run_dir, reason=f"{info.describe()}; the job left no result")

    def signal(self, handle: Handle, signum: int) -> None:
        """The signal to every agent of the job (node 0's stops the job; the others hand it to node 0)."""
        name = signal.Signals(signum).name.removeprefix("SIG")
        subprocess.run(["scancel", f"--signal={name}", handle["job_id"]], capture_output=True)

    def cancel(self, handle: Handle) -> None:
        """scancel: Slurm sends SIGTERM to every process of the job, then SIGKILL after its KillWait."""
        subprocess.run(["scancel", handle["job_id"]], capture_output=True)


def _run(*args: str, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"`{shlex.join(args)}` failed: {e}") from e
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        raise SlurmError(f"`{shlex.join(args)}` failed (exit {done.returncode}): {said}")
    return done.stdout
