"""GPU sharing (scheduler/sharing.py): fractions never overcommit a GPU or a node's CPUs and honour GPU types,
over random fleets and tasks (hypothesis), whatever the packing choice, and through every policy's rounds in
the scheduling core, where shares are kept apart from gangs; FGD's measure and best fit by example; and the
fill of a fleet as FGD's paper measures it (sim/sharing.py), on a fleet small enough to know."""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from phalanx.client import ClientError
from phalanx.control.scheduler import POLICIES, Cluster, GpuType, Job, Node, PredictiveLas, Queue, State, Tenant
from phalanx.control.scheduler.sharing import MILLI, Ask, BestFit, Fragmentation, Packing, Room, Workload
from phalanx.control.sim.sharing import CHOICES, fill, score_for
from phalanx.control.sim.trace import TraceError, alibaba_2023
from servers import PhalanxServer
from test_platform import wait_for

asks = st.builds(
    Ask,
    cpu_milli=st.sampled_from([0, 1000, 4000, 8000]),
    gpus=st.just(1),
    gpu_milli=st.sampled_from([200, 250, 470, 500, 810, 1000]),
    gpu_types=st.sampled_from([(), ("A",), ("B",), ("A", "B")]),
) | st.builds(Ask, cpu_milli=st.sampled_from([0, 4000, 12000]), gpus=st.sampled_from([0, 2, 4]))


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[tuple[str, str, int, int]], list]:
    nodes = [
        (f"n{i}", draw(st.sampled_from("AB")), draw(st.sampled_from([4000, 16000, 64000])), draw(st.integers(0, 8)))
        for i in range(draw(st.integers(1, 6)))
    ]
    ops = draw(st.lists(st.one_of(asks, st.integers(0, 30)), min_size=1, max_size=40))  # an int: a task leaves
    return nodes, ops


def test_fractions_never_overcommit_a_gpu_and_types_are_honoured() -> None:
    """Every choice, every step: a placed task is on a node of its types with the GPUs and CPUs it asked for
    free; each GPU's thousandths held add up to what it lacks, never over 1000; a task finds no node only when
    none holds it; and a booking past what is left is refused."""
    seen: defaultdict[str, int] = defaultdict(int)

    @seed(3)
    @settings(max_examples=300, deadline=None, database=None)
    @given(worlds(), st.sampled_from(CHOICES))
    def check(world: tuple, choice: str) -> None:
        nodes, ops = world
        packing = Packing(nodes)
        score, learns = score_for(choice, packing, [op for op in ops if isinstance(op, Ask)])
        held: list[tuple[str, Ask, tuple[int, ...]]] = []
        for op in ops:
            if isinstance(op, int):
                if held:
                    packing.give_back(*held.pop(op % len(held)))
                    seen["left"] += 1
            else:
                learns.observe(op)
                where = packing.place(op, score)
                if where is None:
                    assert not any(room.holds(op) for room in packing.rooms.values())
                    seen["found no node"] += 1
                else:
                    name, gpus = where
                    room = packing.rooms[name]
                    assert not op.gpus or not op.gpu_types or room.gpu_type in op.gpu_types
                    packing.take(name, op, gpus)
                    held.append((name, op, gpus))
                    seen["shares" if op.gpu_milli < MILLI else "whole"] += 1
                    # the same again where it no longer fits is refused, whole
                    if any(packing.rooms[name].gpus[i] < op.gpu_milli for i in gpus):
                        before = packing.rooms[name]
                        with pytest.raises(ValueError, match="cannot take"):
                            packing.take(name, op, gpus)
                        assert packing.rooms[name] == before
                        seen["refused"] += 1
            used: defaultdict[tuple[str, int], int] = defaultdict(int)
            cpus: defaultdict[str, int] = defaultdict(int)
            for name, ask, gpus in held:
                cpus[name] += ask.cpu_milli
                for i in gpus:
                    used[name, i] += ask.gpu_milli
            for name, room in packing.rooms.items():
                whole = packing.capacity[name]
                assert room.cpu_milli == whole.cpu_milli - cpus[name] >= 0
                assert all(0 <= g == MILLI - used[name, i] for i, g in enumerate(room.gpus)), (room, used)

    check()
    # each path is taken often (seed 3: 372 shares, 593 whole, 227 found no node, 431 refused, 406 left); a
    # floor at half that
    assert seen["shares"] >= 186 and seen["whole"] >= 296 and seen["found no node"] >= 113, seen
    assert seen["refused"] >= 215 and seen["left"] >= 203, seen


@st.composite
def shared_fleets(draw: st.DrawFn) -> tuple[Cluster, list[tuple[str, Job | int]]]:
    """A few small nodes of two types, two tenants with small quotas in one cohort, and shares of a GPU among
    gangs of whole GPUs, at several priorities; an int: the run that many places into the running jobs ends."""
    sizes = draw(st.lists(st.tuples(st.integers(1, 4), st.sampled_from("AB")), min_size=1, max_size=3))
    nodes = [Node(f"n{i}", "r", gpus, gpu_type) for i, (gpus, gpu_type) in enumerate(sizes)]
    events: list[tuple[str, Job | int]] = []
    for i in range(draw(st.integers(1, 40))):
        if draw(st.integers(0, 3)) == 0:
            events.append(("end", draw(st.integers(0, 20))))
            continue
        milli = draw(st.sampled_from([250, 400, 500, 700, MILLI, MILLI, MILLI, MILLI]))
        workers, per_worker = (1, 1) if milli < MILLI else draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]))
        job = Job(f"j{i}", draw(st.sampled_from("tu")), workers, per_worker, float(i), draw(st.integers(0, 1)),
                  draw(st.sampled_from([60.0, 60000.0])), gpu_types=draw(st.sampled_from([(), ("A",), ("B",)])),
                  gpu_milli=milli)  # fmt: skip
        events.append(("arrive", job))
    return Cluster(nodes, types=(GpuType("A", 100.0), GpuType("B", 50.0))), events


def test_shares_through_every_policy_never_overcommit_and_stay_apart_from_gangs() -> None:
    """Every policy's rounds over random fleets of shares and gangs: a share lands on one node of its types,
    on a GPU carved for shares, whose shares never hold more than 1000 thousandths; a node's free, carved and
    whole-held GPUs add up to its GPUs; no gang lands on a carved GPU; shares preempt nothing and are never
    asked to leave for another job (Gavel-like may move one, for itself, as it moves any job)."""
    seen: Counter[str] = Counter()

    @seed(4)
    @settings(max_examples=300, deadline=None, database=None)
    @given(shared_fleets(), st.sampled_from(sorted(POLICIES)))
    def check(fleet: tuple, name: str) -> None:
        cluster, events = fleet
        policy = POLICIES[name]()
        if isinstance(policy, PredictiveLas):
            policy = replace(policy, budget=1.0)  # a budget these small worlds reach: preemptions happen
        tenants = [Tenant(t, max(1, cluster.total_gpus // 2), "c") for t in "tu"]
        state = State(cluster, tenants, Queue(policy.key))
        for now, (what, item) in enumerate(events):
            if what == "arrive":
                state.submit(item)
            elif state.running:
                state.stop(list(state.running)[item % len(state.running)], float(now))
            for _ in range(4):
                decided = policy.schedule(state, float(now))
                for admit in decided.admit:
                    job = state.queue.jobs[admit.job]
                    if job.shares:
                        ((node, count),) = admit.placement.items()
                        assert count == 1 and admit.carve is not None
                        assert not job.gpu_types or cluster.nodes[node].gpu_type in job.gpu_types
                        seen["shares"] += 1
                    else:
                        assert admit.carve is None
                        seen["whole"] += 1
                    state.start(admit.job, admit.placement, float(now), admit.carve)  # raises on any overcommit
                for preempt in decided.preempt:
                    victim, by = state.running[preempt.job].job, state.queue.jobs.get(preempt.for_job)
                    assert by is None or not by.shares, preempt  # None: a run moved, for itself
                    assert not victim.shares or preempt.for_job == preempt.job, preempt
                    seen["preempted"] += 1
                    state.ask_to_evict(preempt.job, preempt.for_job)
                    state.requeue(preempt.job, float(now))
                if not decided.admit and not decided.preempt:
                    break
            shares: defaultdict[tuple[str, int], int] = defaultdict(int)
            whole: Counter[str] = Counter()
            for run in state.running.values():
                if run.carve is not None:
                    shares[next(iter(run.placement)), run.carve] += run.job.gpu_milli
                else:
                    whole.update(run.placement)
            if cluster.carved and any(not job.shares for job in state.queue):
                seen["gangs waiting beside shares"] += 1
            assert {(n, c): MILLI - left for n, gpus in cluster.carved.items() for c, left in gpus.items()} == shares
            for name, node in cluster.nodes.items():
                assert cluster.free[name] + len(cluster.carved.get(name, {})) + whole[name] == node.gpus, name

    check()
    # each path is taken often (seed 4: 919 shares and 407 gangs admitted, 34 preemptions, 2,017 rounds that
    # left gangs waiting while shares held GPUs); a floor at half that
    assert seen["shares"] >= 459 and seen["whole"] >= 203 and seen["preempted"] >= 17, seen
    assert seen["gangs waiting beside shares"] >= 1008, seen


def test_a_share_neither_preempts_a_gang_nor_is_preempted_for_one() -> None:
    """One GPU, and a tenant with a quota of one: two halves of a GPU run on the same carved GPU (together they
    count as the one GPU they fill); a gang of a higher priority, of the same tenant, waits for them rather
    than preempting them, whatever the policy; once they end, it runs. Then a share of a higher priority waits
    for the gang."""
    for name, policy_type in sorted(POLICIES.items()):
        policy = policy_type()
        cluster = Cluster([Node("n", "r", 1)])
        state = State(cluster, [Tenant("t", 1)], Queue(policy.key))
        at = [400.0 * i for i in range(8)]  # each moment a round of Gavel-like's (every 360 s) too
        halves = [Job(f"half{i}", "t", 1, 1, at[i], gpu_milli=500) for i in range(2)]
        gang = Job("gang", "t", 1, 1, at[2], priority=5, predicted_s=60.0)
        for now, job in zip(at, [*halves, gang], strict=False):
            state.submit(job)
            for admit in policy.schedule(state, now).admit:
                state.start(admit.job, admit.placement, now, admit.carve)
        assert {r.id: r.carve for r in state.running.values()} == {"half0": 0, "half1": 0}, name
        assert state.held == {"t": 1}
        decided = policy.schedule(state, at[3])
        assert not decided.admit and not decided.preempt, (name, decided)
        for job in halves:
            state.stop(job.id, at[4])
        assert [a.job for a in policy.schedule(state, at[4]).admit] == ["gang"], name
        state.start("gang", {"n": 1}, at[4])
        state.submit(Job("urgent", "t", 1, 1, at[5], priority=9, gpu_milli=300))
        decided = policy.schedule(state, at[6])
        assert not decided.admit and not decided.preempt, (name, decided)


def test_fgd_keeps_whole_gpus_whole_where_best_fit_breaks_one() -> None:
    """A 0.4-GPU task, with whole-GPU and 0.4-GPU tasks equally expected. Best fit takes the node with the
    least room, n1, and breaks one of its whole GPUs; FGD's measure says that costs 300 thousandths of
    fragmentation, and filling n2's 600-thousandth GPU lowers it by 100: it goes there."""
    packing = Packing([("n1", "A", 4000, 2), ("n2", "A", 64000, 2)])
    packing.take("n2", Ask(0, 1, 400), (1,))
    task, whole = Ask(2000, 1, 400), Ask(2000, 1)
    fgd = Fragmentation(Workload([task, whole]))
    assert fgd.of(packing.rooms["n1"]) == 0 and fgd.of(packing.rooms["n2"]) == 300  # 600 left: no whole GPU
    assert packing.place(task, BestFit.of(packing)) == ("n1", (0,))
    assert packing.place(task, fgd) == ("n2", (1,))
    assert fgd(packing.rooms["n2"], task, (1,)) == (-100.0,)
    # FGD finds the two GPUs of n1 alike; best fit, as the tie-break, takes the fuller of otherwise equal nodes
    packing = Packing([("n1", "A", 64000, 2), ("n2", "A", 8000, 2)])
    assert packing.place(whole, Fragmentation(Workload([whole]))) == ("n1", (0,))
    assert packing.place(whole, Fragmentation(Workload([whole]), tie_break=BestFit.of(packing))) == ("n2", (0,))


def test_a_fill_counts_what_stays_unallocated_as_fgd_reports_it() -> None:
    """Halves fill a 2-GPU node exactly; 0.6s leave 0.4 of each GPU, which the two arrivals after cannot use;
    a task whose CPUs no node has fails and leaves all unallocated."""
    node = [("n", "A", 64000, 2)]
    assert fill(node, [Ask(1000, 1, 500)], "fgd", seed=0, marks=(0.5, 1.0)).unallocated == {0.5: 0.5, 1.0: 0.0}
    sixths = fill(node, [Ask(1000, 1, 600)], "phalanx", seed=0, marks=(1.0,))
    assert sixths.unallocated == {1.0: pytest.approx(0.4)} and (sixths.placed, sixths.failed) == (2, 2)
    assert fill(node, [Ask(128000, 1)], "best-fit", seed=0, marks=(1.0,)).unallocated == {1.0: 1.0}
    with pytest.raises(ValueError, match="packing choice 'worst-fit'; one of best-fit, fgd, phalanx"):
        fill(node, [Ask(1000, 1)], "worst-fit", seed=0)
    with pytest.raises(ValueError, match="a share is of one GPU only"):
        Ask(0, 2, 500)
    assert Room("A", 0, (MILLI,)).holds(Ask(0, 1, 500, ("A",))) and not Room("B", 0, (MILLI,)).holds(
        Ask(0, 1, 5, ("A",))
    )


def test_alibabas_2023_trace_is_read_with_its_shares_and_type_lists(tmp_path: Path) -> None:
    nodes, pods = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,96000,1,8,G2\nn1,8000,1,1,V100M16\n")
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n"
        "p0,6000,1,1,460,,LS\np1,12000,1,0,0,,BE\np2,4000,1,2,1000,V100M16|V100M32,LS\n"
    )
    assert alibaba_2023(nodes, pods) == (
        [("n0", "G2", 96000, 8), ("n1", "V100M16", 8000, 1)],
        [Ask(6000, 1, 460), Ask(12000, 0), Ask(4000, 2, MILLI, ("V100M16", "V100M32"))],
    )
    pods.write_text("name,cpu_milli,num_gpu,gpu_milli,gpu_spec\np0,6000,2,460,\n")
    with pytest.raises(TraceError, match=r"pods.csv:2: .*a share is of one GPU only"):
        alibaba_2023(nodes, pods)
    with pytest.raises(TraceError, match="missing column"):
        alibaba_2023(pods, nodes)


def test_the_server_runs_two_halves_on_one_gpu_and_a_gang_after_them(tmp_path: Path) -> None:
    """`phalanx server` with one declared L4 at $3,600 an hour: two jobs of `gpu_fraction: 0.5` run at once on
    its one shared GPU, each worker told its share (which caps its CUDA memory on a GPU); a whole-GPU job waits
    for room rather than preempting them, and runs once they end. A server killed and started again adopts the
    shares where they were. Each share costs half the GPU's price and counts half its GPU-hours; a share is
    refused for more than one process."""
    prices = tmp_path / "prices.yaml"  # $1 per GPU-second
    prices.write_text("gpu_types:\n  L4: {price_per_gpu_h: 3600}\n")
    server = PhalanxServer(tmp_path, slots=None, args=("--gpu-types", "L4:1", "--cluster-config", str(prices)))
    try:
        client = server.member("team", 2, "alice")  # the two halves count as one GPU: the whole job is within it

        def spec(name: str, resources: str) -> str:
            told = tmp_path / f"{name}.fraction"
            tell = f"open({str(told)!r}, 'w').write(os.environ.get('PHALANX_GPU_FRACTION', ''))"
            script = f"import os, time; {tell}; time.sleep(60)"
            return f"name: {name}\nresources: {{device: cpu{resources}}}\ncommand: [{sys.executable}, -c, {script!r}]\n"

        submitted = time.time()
        halves = [client.submit(spec(f"half{i}", ", gpu_fraction: 0.5"))["id"] for i in range(2)]
        for job_id in halves:
            job = wait_for(client, job_id, {"RUNNING"}, timeout=60)
            assert (job["placement"], job["gpu_milli"], job["gpu_carve"], job["gpu_use"]) == ({"local": 1}, 500, 0, 0.5)
        running = time.time()
        assert client.quota()[0]["gpus_in_use"] == 1
        whole = client.submit(spec("whole", ""))["id"]
        deadline = time.monotonic() + 30
        while not (job := client.job(whole))["reason"].startswith("behind: no room: 0 of 1 slot free"):
            assert job["state"] == "PENDING" and time.monotonic() < deadline, job["reason"]
            time.sleep(0.1)
        server.kill9()
        server.start()
        time.sleep(1.0)  # a few rounds of the new server: the shares adopted, the whole job still waiting
        assert [client.job(j)["state"] for j in (*halves, whole)] == ["RUNNING", "RUNNING", "PENDING"]
        for i in range(2):
            assert (tmp_path / f"half{i}.fraction").read_text() == "0.5"
        cancelled = time.time()
        for job_id in halves:
            client.cancel(job_id)
        for job_id in halves:
            wait_for(client, job_id, {"CANCELLED"}, timeout=60)
        ended = time.time()
        wait_for(client, whole, {"RUNNING"}, timeout=60)
        assert client.job(whole)["gpu_carve"] is None
        client.cancel(whole)
        wait_for(client, whole, {"CANCELLED"}, timeout=60)
        usage = {row["job"]: row for row in client.usage()["jobs"]}
        for job_id in (*halves, whole):
            row = usage[job_id]
            assert row["dollars"] == pytest.approx(row["allocated_gpu_hours"] * 3600, rel=1e-9), row
        for job_id in halves:  # half a GPU over the time it ran (which began and ended between these marks)
            assert (
                0.5 * (cancelled - running) <= usage[job_id]["allocated_gpu_hours"] * 3600 <= 0.5 * (ended - submitted)
            )
        with pytest.raises(ClientError, match="resources: gpu_fraction: a share of one GPU is for one process"):
            client.submit(spec("two", ", gpu_fraction: 0.5, procs_per_node: 2"))
    finally:
        server.stop()
