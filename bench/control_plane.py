"""Load on the control plane (bench/RESULTS.md, docs/platform.md): concurrent clients on loopback against
`phalanx server`, on SQLite and on PostgreSQL, in the same run.

    python bench/control_plane.py [--seconds 10] [--connections 32] [--runs 3] [--sections load,takeover]
                                  [--out section.md]

The clients are wrk (Debian's package: `apt-get install wrk`), 2 threads and --connections connections kept
alive: a load generator in C, so that the clients do not take the server's CPU (asyncio + httpx needed a whole
core here for 200 requests/s). For each database: a fresh server in its own process (the scheduling loop runs
in it, as in production) and a tenant whose quota is 0 GPUs with no cohort, so that submitted jobs stay queued
and nothing but the control plane is measured (the scheduler still goes over the growing queue every round).
Each phase runs --seconds: submit jobs (POST /jobs: authenticate, validate the spec, insert the job and its
first transition, commit); read a job (GET /jobs/ID, with its progress); list jobs (GET /jobs, 20 a page).
The peer, in the same server and run: GET /whoami, a request that authenticates and reads nothing else.

The takeover (``--sections takeover``): two servers over one PostgreSQL database with the default lease
(4 s). With the loop's holder killed (-9), a job is submitted through the other: the time from the kill to its
admission, against the same submission's admission with the holder alive (a tick), --runs times.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import Report

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from servers import PhalanxServer, Postgres  # noqa: E402

SPEC = "name: load\nresources: {procs_per_node: 1, device: cpu}\ncommand: [python, -c, pass]\n"
PHASES = ("submit", "get", "list", "whoami")
ANCHORS = (  # what others publish, on other machines and for other work per job: a scale, not a race
    "Published rates of others, measured on their own machines: Kueue admits about 43-51 workloads/s with one "
    "leader-elected scheduler (its performance tests; other replicas serve reads only); Slurm sustains about "
    "500 job submissions/s (SchedMD's high-throughput guide), with an active/passive backup controller; Armada "
    "says hundreds of jobs/s from a leader-elected scheduler over PostgreSQL. The figures above are the API's, "
    "on 2 cores shared with wrk and the database."
)
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def wrk(url: str, script: str, seconds: float, connections: int, tmp: Path) -> dict[str, float]:
    """Requests/s and latency percentiles (ms) of one wrk run; every answer must be a 2xx."""
    lua = tmp / "phase.lua"
    lua.write_text(script)
    argv = ["wrk", "-t2", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(lua), url]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"{url}: some answers were not 2xx:\n{out}")
    found = {"per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}
    for q in ("50", "99"):
        value, unit = re.search(rf"\s{q}%\s+([\d.]+)(us|ms|s)", out).groups()
        found[f"p{q}"] = float(value) * _UNITS[unit]
    return found


def measure(server: PhalanxServer, seconds: float, connections: int, tmp: Path) -> dict[str, dict[str, float]]:
    client = server.member("load", 0, "loader")
    auth = client._http.headers["Authorization"]
    head = f'wrk.headers["Authorization"] = "{auth}"\nwrk.headers["Content-Type"] = "application/json"\n'
    body = json.dumps(json.dumps({"spec": SPEC, "workdir": "/"}))  # a Lua string literal
    submit = head + f'wrk.method = "POST"\nwrk.body = {body}\n'
    base = server.url + "/api/v1"
    wrk(base + "/jobs", submit, 3, connections, tmp)  # warm-up: connections, caches, the first jobs
    found = {"submit": wrk(base + "/jobs", submit, seconds, connections, tmp)}
    ids = [job["id"] for job in client.jobs()]  # the first 1,000
    table = "local ids = {" + ",".join(f'"{i}"' for i in ids) + "}\n"
    found["get"] = wrk(base, head + table + 'request = function() return wrk.format("GET", "/api/v1/jobs/" .. '
                       'ids[math.random(#ids)]) end\n', seconds, connections, tmp)  # fmt: skip
    pages = 'request = function() return wrk.format("GET", "/api/v1/jobs?limit=20&after=" .. math.random(n)) end\n'
    found["list"] = wrk(base, head + f"local n = {len(ids)}\n" + pages, seconds, connections, tmp)
    found["whoami"] = wrk(base + "/whoami", head, seconds, connections, tmp)
    found["queued"] = {"jobs": float(client.quota()[0]["jobs_pending"])}
    return found


def admitted_after(client, spec: str, since: float) -> tuple[str, float]:
    """A job submitted now through ``client``, and the seconds from ``since`` until it is admitted."""
    job = client.submit(spec)["id"]
    deadline = time.monotonic() + 60
    while client.job(job)["state"] == "PENDING":
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} was not admitted in 60 s")
        time.sleep(0.01)
    return job, time.monotonic() - since


def takeover(postgres: Postgres, tmp: Path) -> tuple[float, float]:
    """(kill to the next admission, a submission's admission with the holder alive), in seconds."""
    spec = SPEC.replace("pass", "'import time; time.sleep(60)'")
    database, args = postgres.database(), ("--data-dir", str(tmp / "a" / "data"))
    for folder in ("a", "b"):
        (tmp / folder).mkdir()
    holder = PhalanxServer(tmp / "a", slots=4, database=database, args=args)
    shutil.copy(tmp / "a" / "admin.token", tmp / "b" / "admin.token")  # a database with users: none is made
    other = PhalanxServer(tmp / "b", slots=4, database=database, args=args)
    try:
        client = other.member("load", 4, "loader")
        first, alive = admitted_after(client, spec, time.monotonic())
        holder.kill9()
        second, taken = admitted_after(client, spec, time.monotonic())
        for job in (first, second):  # their supervisors outlive the servers: stopped through the new holder
            client.cancel(job)
        deadline = time.monotonic() + 60
        while any(client.job(job)["state"] != "CANCELLED" for job in (first, second)):
            if time.monotonic() > deadline:
                raise RuntimeError("the jobs were not cancelled in 60 s")
            time.sleep(0.1)
        return taken, alive
    finally:
        for server in (holder, other):
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3, help="takeovers measured")
    parser.add_argument("--sections", default="load,takeover", help="load (wrk), takeover (two servers)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if "load" in sections and shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install wrk (the load generator)")
    results: dict[str, dict[str, dict[str, float]]] = {}
    takeovers: list[tuple[float, float]] = []
    postgres = Postgres()
    try:
        configs = [("SQLite", None, 1)] + [(f"PostgreSQL x{n}", "postgres", n) for n in (1, 2, 4)]
        for name, database, workers in configs if "load" in sections else ():
            database = postgres.database() if database else None  # a fresh one each
            with tempfile.TemporaryDirectory() as tmp:
                server = PhalanxServer(Path(tmp), slots=1, database=database, args=("--workers", str(workers)))
                try:
                    results[name] = measure(server, args.seconds, args.connections, Path(tmp))
                finally:
                    server.stop()
            print(f"{name}: done", file=sys.stderr, flush=True)
        for _ in range(args.runs if "takeover" in sections else 0):
            with tempfile.TemporaryDirectory() as tmp:
                takeovers.append(takeover(postgres, Path(tmp)))
            print(f"takeover: {takeovers[-1][0]:.2f} s", file=sys.stderr, flush=True)
    finally:
        postgres.stop()

    report = Report(
        "Control plane",
        "python bench/control_plane.py",
        f"`phalanx server` (one process: uvicorn, the API and the scheduling loop; xN: `--workers N`, N such "
        "processes on one port, one of them running the loop) on loopback, driven by wrk "
        f"(2 threads, {args.connections} connections) on the same 2 cores; each phase {args.seconds:g} s, after "
        "3 s of submits to warm up. SQLite in WAL mode on the local disk; PostgreSQL 15 from Debian on loopback. "
        "The jobs stay queued (their tenant's quota is 0), so each scheduling round reads the whole queue. "
        f"The takeover: two servers over one PostgreSQL database, the default lease (4 s), {args.runs} runs: the "
        "loop's holder killed (-9), then a job submitted through the other server, timed to its admission.",
    )
    if results:
        rows = [
            [name, phase, f"{found[phase]['per_s']:,.0f}", f"{found[phase]['p50']:.1f}", f"{found[phase]['p99']:.1f}"]
            for name, found in results.items()
            for phase in PHASES
        ]
        report.table(["database", "request", "requests/s", "p50 ms", "p99 ms"], rows)
    if "PostgreSQL x1" in results:
        one = results["PostgreSQL x1"]["submit"]["per_s"]
        two = results["PostgreSQL x2"]
        report.ratio("PostgreSQL x2: submits/s (3x stop 52's 89/s)", two["submit"]["per_s"], ">= 267", unit="/s")
        report.ratio("PostgreSQL x2: p99 of a submit, ms", two["submit"]["p99"], "<= 100", unit=" ms")
        for n in (2, 4):
            report.ratio(f"PostgreSQL: submits/s, x{n} / x1", results[f"PostgreSQL x{n}"]["submit"]["per_s"] / one)
    for name, found in results.items():
        report.ratio(f"{name}: submits/s", found["submit"]["per_s"], ">= 500", unit="/s")
        report.ratio(f"{name}: p99 of GET /jobs/ID, ms", found["get"]["p99"], "<= 50", unit=" ms")
        report.ratio(f"{name}: p99 of GET /jobs, ms", found["list"]["p99"], "<= 50", unit=" ms")
        report.ratio(f"{name}: submits/s / whoami/s (an authenticated no-op)", found["submit"]["per_s"]
                     / found["whoami"]["per_s"])  # fmt: skip
        report.note(f"{name}: {found['queued']['jobs']:,.0f} jobs queued by the end of the submit phases.")
    if results:
        report.note(ANCHORS)
    if takeovers:
        report.ratio("the holder killed: kill to the next admission, s", [t for t, _ in takeovers], "<= 5", unit=" s")
        report.ratio("the same / a submission's admission with the holder alive", [t / a for t, a in takeovers])
    report.finish(args.out)


if __name__ == "__main__":
    main()
