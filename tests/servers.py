"""Real servers on loopback, for the tests and the benchmarks (bench/control_plane.py, bench/data_loader.py): a
PostgreSQL from Debian's package, run as a non-root user in a temporary directory, moto's S3-API server, and
`phalanx server` in a process of its own."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MARK = "PHALANX_TEST_MARK"  # in the environment of every process a test starts (tests/conftest.py)


def shared_env() -> dict[str, str]:
    """The environment of a server that tests share: without the mark of whichever test happened to start it,
    since it is none of that test's processes."""
    return {k: v for k, v in os.environ.items() if k != MARK}


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie, exited but not yet reaped by its parent, has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(*roots: int) -> list[int]:
    """``roots`` and every process descended from them, parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            pid, rest = stat.read_text().split(" ", 1)[0], stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(rest[1]), []).append(int(pid))
    found: list[int] = []
    todo = list(roots)
    while todo:
        if (now := todo.pop(0)) not in found:
            found.append(now)
            todo += children.get(now, [])
    return found


def signal_all(pids: list[int], sig: int) -> None:
    """``sig`` to each of ``pids`` still there (one may have ended with its killed parent before its turn)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen:
    """moto's standalone S3-API server on 127.0.0.1:``port``, once it accepts connections (60 s at most)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto's S3 server did not start on port {port}") from None
            time.sleep(0.1)


class Postgres:
    """initdb + pg_ctl in a temporary directory, as ``postgres`` when run as root (PostgreSQL refuses root),
    listening on 127.0.0.1 only. ``database()`` makes a new empty database and returns its URL."""

    def __init__(self) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not bins:
            raise FileNotFoundError("PostgreSQL is not installed: apt-get install postgresql (.ci/run does)")
        bin_dir = bins[-1].parent
        self.root = Path(tempfile.mkdtemp(prefix="phalanx-pg-"))
        as_user: list[str] = []
        if os.geteuid() == 0:
            account = pwd.getpwnam("postgres")
            os.chown(self.root, account.pw_uid, account.pw_gid)
            as_user = ["runuser", "-u", "postgres", "--"]
        data, self.port = self.root / "data", free_port()
        initdb = [str(bin_dir / "initdb"), "-D", str(data), "-U", "phalanx", "--auth=trust", "-E", "UTF8"]
        subprocess.run([*as_user, *initdb], check=True, capture_output=True, env=shared_env())
        options = f"-h 127.0.0.1 -p {self.port} -k {self.root} -c max_connections=300"
        self._pg_ctl = [*as_user, str(bin_dir / "pg_ctl"), "-D", str(data)]
        log = str(self.root / "log")
        start = [*self._pg_ctl, "-l", log, "-o", options, "-w", "start"]
        subprocess.run(start, check=True, capture_output=True, env=shared_env())
        self.url = f"postgresql+psycopg://phalanx@127.0.0.1:{self.port}/postgres"

    def database(self) -> str:
        import sqlalchemy

        name = f"t{time.time_ns()}"
        engine = sqlalchemy.create_engine(self.url, isolation_level="AUTOCOMMIT")
        with engine.connect() as c:
            c.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
        engine.dispose()
        return self.url.rsplit("/", 1)[0] + "/" + name

    def stop(self) -> None:
        subprocess.run([*self._pg_ctl, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


class PhalanxServer:
    """`phalanx server` in a process of its own, with its data directory; killed and started again at will."""

    def __init__(self, tmp: Path, slots: int | None, database: str | None = None, args: tuple[str, ...] = ()):
        from phalanx.client import Client

        self.tmp, self.slots, self.database, self.port = tmp, slots, database, free_port()
        self.args = args  # more options of `phalanx server`
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = tmp / "admin.token"
        self.log = tmp / "server.log"
        self.proc: subprocess.Popen | None = None
        self.start()
        self.admin = Client(self.url, self.token_file.read_text().strip())

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "phalanx", "server", "--data-dir", str(self.tmp / "data"), "--port",
            str(self.port), "--admin-token-file", str(self.token_file), *self.args,
        ]  # fmt: skip
        if self.slots is not None:
            argv += ["--slots", str(self.slots)]
        if self.database:
            argv += ["--db", self.database]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp)
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.url + "/openapi.json", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                assert self.proc.poll() is None, self.log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the server did not start in 60 s"
                time.sleep(0.2)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def member(self, tenant: str, quota: int, user: str):
        """A tenant with ``quota`` GPUs, a member of it, and a client with the member's token."""
        from phalanx.client import Client

        self.admin.create_tenant(tenant, quota)
        self.admin.create_user(user, "member", tenant)
        return Client(self.url, self.admin.create_token("test", user)["token"])


class SlurmCluster:
    """A real Slurm cluster on this machine (Debian's slurm-wlm and munge), in a temporary directory: munged,
    slurmctld, and one slurmd per node (`slurmd -N NAME`), node i at 127.0.0.(i + 2) on a port of its own, so
    that each node has its own address as on a real cluster. Its commands find it through SLURM_CONF, which
    ``env`` holds."""

    def __init__(self, nodes: int = 3, gres: dict[str, str] | None = None) -> None:
        """``gres``: node -> its GPU, as Slurm names it ("gpu:h100:1"): one, whose device file is /dev/null
        (nothing here has GPUs; slurmd counts a GPU by its file, and the jobs that ask for one run on CPUs)."""
        for daemon in ("munged", "slurmctld", "slurmd", "sbatch"):
            if shutil.which(daemon) is None:
                raise FileNotFoundError(f"{daemon} is not installed: apt-get install slurm-wlm munge (.ci/run does)")
        self.root = Path(tempfile.mkdtemp(prefix="phalanx-slurm-"))
        self.nodes = [f"n{i}" for i in range(nodes)]
        self.addrs = {name: f"127.0.0.{i + 2}" for i, name in enumerate(self.nodes)}
        key = self.root / "munge.key"
        if Path("/etc/munge/munge.key").is_file():  # the package's key; any key will do, the cluster is ours alone
            shutil.copyfile("/etc/munge/munge.key", key)
        else:
            key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        munge = self.root / "munge.socket"
        subprocess.run(
            ["munged", "--force", "-S", str(munge), "--key-file", str(key), "--pid-file", str(self.root / "munged.pid"),
             "--log-file", str(self.root / "munged.log"), "--seed-file", str(self.root / "munged.seed")],
            check=True, capture_output=True, env=shared_env(),
        )  # fmt: skip
        user = pwd.getpwuid(os.getuid()).pw_name
        host = socket.gethostname()
        conf = [
            "ClusterName=phalanx-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={munge},cred_expire=20",  # a requeued job waits this long (120 s by default)
            "CredType=cred/munge",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdTimeout=30",
            "KillWait=15",
            "SchedulerParameters=bf_interval=5,sched_interval=10",  # a requeued job's wait ends: started soon after
            "MinJobAge=600",
            "JobCompType=jobcomp/filetxt",  # what sacct --completion reads on a cluster without slurmdbd
            f"JobCompLoc={self.root / 'jobcomp.txt'}",
            *(["GresTypes=gpu"] if gres else []),
            *(
                f"NodeName={name} NodeHostname={host} NodeAddr={addr} Port={free_port()} CPUs={os.cpu_count()} "
                + (f"Gres={gres[name]} " if gres and name in gres else "")
                + "State=UNKNOWN"
                for name, addr in self.addrs.items()
            ),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE",
        ]
        self.conf = self.root / "slurm.conf"
        self.conf.write_text("\n".join(conf) + "\n")
        lines = []
        for name, spec in (gres or {}).items():  # "gpu:h100:1": Name=gpu Type=h100 File=/dev/null
            kind, gpu_type, count = spec.split(":")
            assert count == "1", f"{name}: {spec}; a node here has one GPU (a device file each)"
            lines.append(f"NodeName={name} Name={kind} Type={gpu_type} File=/dev/null")
        (self.root / "gres.conf").write_text("\n".join(lines) + "\n")  # beside slurm.conf, where slurmd reads it
        self.env = {**shared_env(), "SLURM_CONF": str(self.conf)}
        (self.root / "spool").mkdir()
        try:
            subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, capture_output=True, env=self.env)
            for name in self.nodes:
                argv = ["slurmd", "-f", str(self.conf), "-N", name]
                subprocess.run(argv, check=True, capture_output=True, env=self.env)
            deadline = time.monotonic() + 60
            while self.states() != {name: "idle" for name in self.nodes}:
                assert time.monotonic() < deadline, f"the nodes did not come up: {self.states()}; logs in {self.root}"
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def run(self, *args: str) -> str:
        return subprocess.run(list(args), check=True, capture_output=True, text=True, env=self.env).stdout

    def states(self) -> dict[str, str]:
        done = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %T"], capture_output=True, text=True, env=self.env)
        return dict(line.split() for line in done.stdout.splitlines()) if done.returncode == 0 else {}

    def node_at(self, addr: str) -> str:
        return next(name for name, a in self.addrs.items() if a == addr)

    def processes(self, name: str) -> list[int]:
        """Every process of node ``name``, as if it were a machine: its slurmd, the slurmstepds of the steps it
        runs (each listens on a socket in the node's spool directory) and all their descendants, parents first."""
        spool = f"{self.root / 'spool' / name}/"
        sockets = {
            f"socket:[{fields[6]}]"
            for line in Path("/proc/net/unix").read_text().splitlines()[1:]
            if len(fields := line.split()) >= 8 and fields[7].startswith(spool)
        }
        roots = [int((self.root / f"slurmd-{name}.pid").read_text())]
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) in sockets for fd in (proc / "fd").iterdir()):
                    roots.append(int(proc.name))
        return descendants(*roots)

    def strike(self, name: str, sig: int) -> list[int]:
        """``sig`` to every process of node ``name`` (SIGSTOP: the machine frozen; SIGKILL: it crashed). A crashed
        machine's processes halt together, so all are stopped before any is killed, and children die before their
        parents: killed one by one, the survivors would see the others die (srun's end cancels its step on every
        node), and a dead parent would orphan a stopped process group, which the kernel wakes with SIGHUP."""
        pids = self.processes(name)
        if sig == signal.SIGKILL:
            signal_all(pids, signal.SIGSTOP)
            pids = pids[::-1]
        signal_all(pids, sig)
        return pids

    def restart(self, name: str) -> None:
        """Node ``name`` rebooted: what is left of it killed, its slurmd started again, and back in service."""
        self.strike(name, signal.SIGKILL)
        subprocess.run(["slurmd", "-f", str(self.conf), "-N", name], check=True, capture_output=True, env=self.env)
        deadline = time.monotonic() + 120
        while self.states().get(name, "").rstrip("*") not in ("idle", "mixed", "allocated"):
            assert time.monotonic() < deadline, f"{name} did not come back: {self.states()}"
            time.sleep(0.5)

    def stop(self) -> None:
        """Every job cancelled, every node's processes and the daemons gone, the directory removed."""
        subprocess.run(["scancel", "--full", "--user", pwd.getpwuid(os.getuid()).pw_name], env=self.env)
        left: list[int] = []
        for name in self.nodes:  # its slurmd, its steps and their tasks
            with contextlib.suppress(OSError, ValueError):
                left += self.processes(name)
        for pid_file in [self.root / "slurmctld.pid", self.root / "munged.pid"]:
            with contextlib.suppress(OSError, ValueError):
                left.append(int(pid_file.read_text()))
        signal_all(left, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in left) and time.monotonic() < deadline:
            time.sleep(0.1)
        signal_all([pid for pid in left if alive(pid)], signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


class Prometheus:
    """Debian's Prometheus in a temporary directory, scraping ``target`` (HOST:PORT) every second with a bearer
    token from ``token_file``; ``query`` asks its HTTP API."""

    def __init__(self, root: Path, target: str, token_file: Path) -> None:
        if shutil.which("prometheus") is None:
            raise FileNotFoundError("prometheus is not installed: apt-get install prometheus (.ci/run does)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = root / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: phalanx\n"
            "    metrics_path: /metrics\n"
            f"    authorization: {{type: Bearer, credentials_file: {token_file}}}\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.log = root / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def query(self, expr: str) -> list[dict]:
        """The instant vector of ``expr`` (empty until a scrape has it)."""
        try:
            response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5)
        except httpx.HTTPError:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            return []
        response.raise_for_status()
        return response.json()["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
