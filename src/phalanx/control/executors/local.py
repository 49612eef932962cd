"""The local executor: this machine is the cluster, one node with its GPUs (or a configured number of CPU
slots), and each execution is a ``phalanx run`` supervisor started in its own session, so that it outlives the
server: a restarted server finds it again by the pid it wrote, checked against the process's start time (a
reused pid is not mistaken for it).

An execution's directory is claimed whole: its starter fills a draft beside it, and the child, once it wrote its
own pid there, renames the draft into place before it becomes the supervisor. Of two starts of one (job,
attempt) (a server frozen in the middle of one, and the server that took the control loop over), the first
rename wins and the other's child exits; a starter that died before its child claimed leaves a draft and no
execution, and the next start begins at once.

    <root>/<job id>/attempt-<n>/job.yaml         the resolved spec
                               /pid              the supervisor's pid, written by the process itself
                               /devices.json     the GPU indices it holds (a share: and its shared GPU's id)
                               /supervisor.log   the supervisor's own output
                               /runs/<name>/<run id>/   its run directory (logs, events, metrics, result)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phalanx.control.executors.base import Handle, Launch, Phase, Status
from phalanx.control.scheduler import ANY_TYPE, Node
from phalanx.obs.rundir import newest_run

PID_WAIT_S = 10.0
LOST_CLAIM = 75  # the exit code of a child whose draft another start's claim beat
# The child ($1: the draft, $2: the execution's directory) writes its own pid, then claims the directory by
# renaming the draft into place (refused if another claimed it: rename(2) never replaces a directory that has
# files), then becomes the supervisor. A server that dies right after the fork still finds the execution.
_CLAIM = (
    f'echo $$ > "$1/pid" && mv -T "$1" "$2" 2>/dev/null || {{ rm -rf "$1"; exit {LOST_CLAIM}; }}; shift 2; exec "$@"'
)


class LocalExecutor:
    name = "local"
    shares = True  # shares of one GPU run on the same device, each capping its CUDA memory at its share

    def __init__(self, root: str | Path, slots: int | None = None, gpu_types: dict[str, int] | None = None):
        """``slots``: CPU slots to offer (a job takes procs_per_node x nodes of them). None: this machine's
        GPUs, each job seeing only its own through CUDA_VISIBLE_DEVICES; on a machine with none, a slot per
        CPU core. ``gpu_types``: the slots (or GPUs, in device order) of each GPU type, declared, each type a
        node of its own; None: all of one type, the GPUs' model (``gpu_type_name``)."""
        import torch

        self.root = Path(root).absolute()
        self.gpus = slots is None and torch.cuda.device_count() > 0
        if gpu_types is not None:
            if slots is not None and slots != sum(gpu_types.values()):
                raise ValueError(f"--slots {slots} and --gpu-types {gpu_types} disagree: give one")
            slots = sum(gpu_types.values())
        if slots is None:
            slots = torch.cuda.device_count() or os.cpu_count() or 1
        if slots < 1 or any(n < 1 for n in (gpu_types or {}).values()):
            raise ValueError(f"the local executor needs at least one slot of each type; got {gpu_types or slots}")
        self.slots = slots
        self.unit = "GPUs" if self.gpus else "slots"
        if gpu_types is None:
            found = gpu_type_name(torch.cuda.get_device_name(0)) if self.gpus else ANY_TYPE
            gpu_types = {found: slots}
        first, self.nodes = 0, {}  # node -> (its type, its device indices)
        for gpu_type, count in gpu_types.items():
            name = "local" if len(gpu_types) == 1 else f"local-{gpu_type}"
            self.nodes[name] = (gpu_type, list(range(first, first + count)))
            first += count
        self._devices: dict[str, list[int]] = {}  # execution dir -> GPU indices it holds
        self._shared: dict[str, tuple[str, int]] = {}  # execution dir -> (node, shared GPU) of a share
        self._children: dict[int, subprocess.Popen] = {}  # started by this server: reaped here

    def capacity(self) -> list[Node]:
        return [Node(name, "local", len(devices), gpu_type) for name, (gpu_type, devices) in self.nodes.items()]

    def start(self, launch: Launch) -> Handle:
        where = self.root / launch.job_id / f"attempt-{launch.attempt}"
        # Started before (by this server before a crash, or by another): found, never a second one.
        started = where.exists()
        handle = self._handle(where) if started else self._claim(where, self._draft(where, launch), launch)
        self.adopt(handle)  # the GPUs it holds, whichever start began it
        return handle

    def _draft(self, where: Path, launch: Launch) -> Path:
        """The execution's directory, filled beside where it goes: its spec, and the GPUs it is to hold."""
        where.parent.mkdir(parents=True, exist_ok=True)
        draft = Path(tempfile.mkdtemp(prefix=f"{where.name}.starting-", dir=where.parent))
        (draft / "job.yaml").write_text(launch.spec)
        if self.gpus:
            name = next(iter(launch.placement))  # one node: all its devices are of one type
            shared = (name, launch.carve) if launch.carve is not None else None
            neighbours = [self._devices[d] for d, key in self._shared.items() if key == shared]
            if neighbours:  # the shared GPU's other shares run: the same device
                devices = neighbours[0]
            else:
                held = {d for devices in self._devices.values() for d in devices}
                devices = [d for d in self.nodes[name][1] if d not in held][: sum(launch.placement.values())]
            (draft / "devices.json").write_text(json.dumps({"devices": devices, "shared": shared}))
        return draft

    def _claim(self, where: Path, draft: Path, launch: Launch) -> Handle:
        """Start the child that claims ``where`` with ``draft``, then becomes the supervisor; the handle of
        whichever start claimed it."""
        env = dict(os.environ)
        if self.gpus:
            devices = json.loads((draft / "devices.json").read_text())["devices"]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        argv = [sys.executable, "-m", "phalanx", "run", str(where / "job.yaml"), "--runs-dir", str(where / "runs")]
        if launch.nodes > 1:
            argv.append("--local-nodes")
        with open(draft / "supervisor.log", "ab") as log:  # the open file follows the draft's rename
            child = subprocess.Popen(
                ["/bin/sh", "-c", _CLAIM, "sh", str(draft), str(where), *argv],
                cwd=launch.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session: no signal meant for the server reaches it
            )
        self._children[child.pid] = child
        handle = self._handle(where, child)
        if handle["pid"] != child.pid:  # another start claimed it first: this one's child exits, the other's runs
            self._children.pop(child.pid).wait(PID_WAIT_S)
        return handle

    def adopt(self, handle: Handle) -> None:
        devices = Path(handle["dir"]) / "devices.json"
        if devices.is_file():
            held = json.loads(devices.read_text())
            if isinstance(held, list):  # written by a server from before shares
                held = {"devices": held, "shared": None}
            self._devices[handle["dir"]] = held["devices"]
            if held["shared"] is not None:
                self._shared[handle["dir"]] = tuple(held["shared"])

    def status(self, handle: Handle) -> Status:
        where = Path(handle["dir"])
        run = newest_run(where / "runs")
        run_dir = run.root if run is not None else None
        if self._alive(handle):
            return Status(Phase.RUNNING, run_dir)
        self._devices.pop(handle["dir"], None)
        self._shared.pop(handle["dir"], None)
        self._children.pop(handle["pid"], None)
        if run is not None and (ended := run.read_result()) is not None:
            return Status(Phase.EXITED, run_dir, ended.outcome, ended.exit_code, ended.reason)
        tail = _tail(where / "supervisor.log")
        return Status(
            Phase.LOST,
            run_dir,
            reason=f"its supervisor (pid {handle['pid']}) is gone and left no result"
            + (f"; its last output: {tail}" if tail else ""),
        )

    def signal(self, handle: Handle, signum: int) -> None:
        if self._alive(handle):
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle["pid"], signum)

    def cancel(self, handle: Handle) -> None:
        self.signal(handle, signal.SIGTERM)

    def _handle(self, where: Path, child: subprocess.Popen | None = None) -> Handle:
        """The execution in ``where`` once it is claimed (by ``child``, this start's, or another start's)."""
        pid_file = where / "pid"  # a claimed directory has it (one made before claims: its child writes it soon)
        deadline = time.monotonic() + PID_WAIT_S
        while not pid_file.is_file():
            code = child.poll() if child is not None else None
            if code not in (None, LOST_CLAIM):
                raise RuntimeError(f"the execution for {where} did not begin: its starter exited with code {code}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the execution in {where} wrote no pid in {PID_WAIT_S:g} s")
            time.sleep(0.01)
        pid = int(pid_file.read_text())
        return {"dir": str(where), "pid": pid, "started": _start_ticks(pid)}

    def _alive(self, handle: Handle) -> bool:
        child = self._children.get(handle["pid"])
        if child is not None:
            return child.poll() is None
        ticks = _start_ticks(handle["pid"])
        return ticks is not None and ticks == handle["started"]


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None if there is no such live process (zombies
    included: exited, not yet reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _tail(path: Path, chars: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return ""


def gpu_type_name(device: str) -> str:
    """A GPU's model as a type name, from the name its driver gives: "NVIDIA H100 80GB HBM3" -> "H100",
    "NVIDIA A100-SXM4-80GB" -> "A100", "AMD Instinct MI300X" -> "MI300X", "NVIDIA GeForce RTX 4090" ->
    "RTX-4090"."""
    words = [w for w in device.replace("-", " ").split() if w not in ("NVIDIA", "AMD", "Tesla", "Instinct", "GeForce")]
    if not words:
        return ANY_TYPE
    if words[0] in ("RTX", "Quadro", "TITAN") and len(words) > 1:
        return f"{words[0]}-{words[1]}"
    return words[0]
