"""A fleet of several GPU types: the placement rules every policy keeps (a gang on one type unless its job allows
mixing, only on the types it allows), the speed table (seeded by peak FLOP/s, then learned from runs), and the
speed-aware choices of phalanx's policy (the fastest type with room, waiting a bounded time for it, moving a
long run up to faster GPUs), over random fleets (hypothesis) and by example; and the replay's pace per type."""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from phalanx.client import ClientError
from phalanx.control.executors.local import gpu_type_name
from phalanx.control.scheduler import (
    POLICIES,
    Cluster,
    GavelLike,
    GpuType,
    Job,
    Node,
    PredictiveLas,
    Queue,
    Speeds,
    State,
    Tenant,
    place,
)
from phalanx.control.sim.simulator import ReplayCosts, TrueSpeeds, simulate
from phalanx.control.sim.trace import TraceJob
from servers import PhalanxServer
from test_platform import cli, tiny, wait_for

TYPES = (GpuType("fast", 100.0), GpuType("mid", 40.0), GpuType("slow", 10.0))
KINDS = {"a": (10.0, 5.0, 1.0), "b": (3.0, 3.0, 2.0), "c": (4.0, 8.0, 0.5)}  # true rates on fast, mid, slow
RATE = {t.name: {kind: rates[i] for kind, rates in KINDS.items()} for i, t in enumerate(TYPES)}


@st.composite
def fleets(draw: st.DrawFn) -> tuple[Cluster, list[tuple[float, str, Job | str]]]:
    """Racks of one type each, 4- or 8-GPU nodes, and jobs over hours: each of a kind, allowed some types or
    any, some preferring one, some allowed to mix types; some finish early, and then all in turn."""
    nodes = []
    for r in range(draw(st.integers(2, 4))):
        gpu_type, size = draw(st.sampled_from(TYPES)).name, draw(st.sampled_from([4, 8]))
        nodes += [Node(f"r{r}n{n}", f"r{r}", size, gpu_type) for n in range(draw(st.integers(1, 3)))]
    cluster = Cluster(nodes, types=TYPES)
    events: list[tuple[float, str, Job | str]] = []
    now, arrived = 0.0, []
    for i in range(draw(st.integers(1, 25))):
        now += draw(st.sampled_from([0.0, 60.0, 900.0, 3600.0]))
        if arrived and draw(st.integers(0, 2)) == 0:
            events.append((now, "finish", draw(st.sampled_from(arrived))))
            continue
        workers, per_worker = draw(st.sampled_from([(1, 1), (1, 4), (2, 4), (3, 4), (2, 8)]))
        allowed = tuple(draw(st.lists(st.sampled_from([t.name for t in TYPES]), max_size=2, unique=True)))
        prefer = allowed[:1] if allowed and draw(st.booleans()) else ()
        job = Job(f"j{i}", "t", workers, per_worker, now, draw(st.integers(0, 1)),
                  draw(st.sampled_from([60.0, 6000.0, 60000.0])), kind=draw(st.sampled_from(sorted(KINDS))),
                  gpu_types=allowed, prefer=prefer, mix_types=draw(st.integers(0, 2)) == 0)  # fmt: skip
        events.append((now, "arrive", job))
        arrived.append(job.id)
    for job_id in arrived:  # then every job ends, the first come first: GPUs free while later runs go on
        now += 3600.0
        events.append((now, "finish", job_id))
    return cluster, events


def test_no_gang_mixes_types_unless_allowed_and_required_types_are_honoured() -> None:
    """Every policy, every round: each admission lies on nodes of the types its job allows, one type unless
    the job may mix them (and then only when no one type held it), and no GPU is given twice; phalanx's moves
    to faster GPUs (a run preempted for itself) keep the same rules. Gavel-like solves two linear programs a
    round: fewer fleets of its own."""
    seen: Counter[str] = Counter()

    @seed(2)
    @settings(max_examples=400, deadline=None, database=None)
    @given(fleets(), st.sampled_from(sorted(set(POLICIES) - {"gavel-like"})))
    def check(fleet: tuple, name: str) -> None:
        policy = POLICIES[name]()
        if isinstance(policy, PredictiveLas):  # no waiting for a faster type, and a budget these worlds reach:
            policy = replace(policy, budget=1.0, wait_for_speed=0.0)  # runs on slower types, then moves up
        _rounds(*fleet, policy, seen)

    @seed(2)
    @settings(max_examples=60, deadline=None, database=None)
    @given(fleets())
    def check_gavel(fleet: tuple) -> None:
        _rounds(*fleet, GavelLike(), gavel)

    check()
    # each path is taken often over the 400 fleets (2026-12-07, seed 2: 2,626 gangs on one type, 77 mixed, 134
    # moves up, 508 other preemptions); a floor at half that
    assert seen["on 1 type(s)"] >= 1313 and seen["mixed"] >= 38 and seen["moved up"] >= 67, seen
    gavel: Counter[str] = Counter()
    check_gavel()
    # its rounds move runs between types and preempt (seed 2: 1,034 gangs on one type, 78 moves, 604 other
    # preemptions); a floor at half that
    assert gavel["on 1 type(s)"] >= 517 and gavel["moved up"] >= 39 and gavel["preempted"] >= 302, gavel


def _rounds(cluster: Cluster, events: list, policy, seen: Counter[str]) -> None:
    state = State(cluster, [Tenant("t", cluster.total_gpus)], Queue(policy.key))
    for now, what, job in events:
        if what == "arrive":
            state.submit(job)
        elif job in state.running:
            run = state.stop(job, now)
            if (gpu_type := cluster.type_of(run.placement)) in RATE:
                state.speeds.observe(run.job.kind, gpu_type, RATE[gpu_type][run.job.kind])
        for _ in range(6):
            decided = policy.schedule(state, now)
            for admit in decided.admit:
                job_ = state.queue.jobs[admit.job]
                types = {cluster.nodes[n].gpu_type for n in admit.placement}
                assert not job_.gpu_types or types <= set(job_.gpu_types), (admit, job_.gpu_types)
                if len(types) > 1:
                    assert job_.mix_types, admit
                    allowed = job_.gpu_types or cluster.types
                    assert all(place(cluster, job_.workers, job_.per_worker, (t,)) is None for t in allowed)
                    seen["mixed"] += 1
                state.start(admit.job, admit.placement, now)  # raises if any GPU is taken
                seen[f"on {len(types)} type(s)"] += 1
            for preempt in decided.preempt:
                seen["moved up" if preempt.job == preempt.for_job else "preempted"] += 1
                state.ask_to_evict(preempt.job, preempt.for_job)
                state.requeue(preempt.job, now)
            if not decided.admit and not decided.preempt:
                break
        assert cluster.free_gpus == cluster.total_gpus - sum(r.job.gpus for r in state.running.values())


def test_gavel_like_gives_each_job_its_max_min_share_of_each_type_round_by_round() -> None:
    """One fast and one slow GPU; kind "a" runs 10x as fast on fast, kind "b" 2x. Normalised by its rate with an
    equal share of each type, "a" has 10/11 and 1/11, "b" 2/3 and 1/3; the least of the two is highest (1/2
    each) when each has half of each type, and only then. So its rounds swap them: "a" first on fast (it came
    first), then, 360 s on, each moves to the type it has not had (a run preempted for itself, and the other
    made to leave for it), and when both have left each starts on its new type."""
    policy = GavelLike()
    cluster = Cluster([Node("fast0", "f", 1, "fast"), Node("slow0", "s", 1, "slow")], types=(TYPES[0], TYPES[2]))
    state = State(cluster, [Tenant("t", 2)], Queue(policy.key))
    for kind, fast, slow in (("a", 10.0, 1.0), ("b", 2.0, 1.0)):
        state.speeds.observe(kind, "fast", fast)
        state.speeds.observe(kind, "slow", slow)
    state.submit(Job("a", "t", 1, 1, 0.0, kind="a"))
    state.submit(Job("b", "t", 1, 1, 1.0, kind="b"))
    first = policy.schedule(state, 10.0)
    assert [(a.job, a.placement) for a in first.admit] == [("a", {"fast0": 1}), ("b", {"slow0": 1})]
    for admit in first.admit:
        state.start(admit.job, admit.placement, 10.0)
    assert policy.schedule(state, 300.0).preempt == []  # within the round
    swap = policy.schedule(state, 370.0)
    assert [(p.job, p.for_job) for p in swap.preempt] == [("b", "a"), ("a", "a")]
    assert swap.preempt[0].reason == "round-based max-min: a has slow this round"
    for p in swap.preempt:
        state.ask_to_evict(p.job, p.for_job)
    state.requeue("b", 390.0)
    assert policy.schedule(state, 390.0).admit == []  # the room made for "a" waits for it
    state.requeue("a", 395.0)
    assert [(a.job, a.placement) for a in policy.schedule(state, 395.0).admit] == [
        ("a", {"slow0": 1}), ("b", {"fast0": 1})
    ]  # fmt: skip


def test_the_speed_table_starts_from_peak_flops_and_learns_from_runs() -> None:
    speeds = Speeds({t.name: t for t in TYPES})
    assert speeds.relative("a", ["fast", "mid", "slow"]) == pytest.approx({"fast": 1.0, "mid": 0.4, "slow": 0.1})
    speeds.observe("a", "fast", 10.0)
    speeds.observe("a", "slow", 5.0)  # measured: the slow type is half as fast for "a", not a tenth
    assert speeds.relative("a", ["fast", "slow"]) == pytest.approx({"fast": 1.0, "slow": 0.5})
    assert speeds.rate("b", "slow") / speeds.rate("b", "fast") == pytest.approx(0.5)  # taught by "a"
    assert speeds.rate("a", "mid") == pytest.approx((10.0 * 0.4 * 5.0 * 4.0) ** 0.5)  # from both, by peak FLOP/s
    assert speeds.rate("a", "fast+slow") == 5.0  # a mixed gang: the slowest
    speeds.observe("a", "fast", 20.0)  # smoothed, not replaced
    assert speeds.rate("a", "fast") == pytest.approx(13.0)
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        speeds.observe("a", "fast", bad)  # never learned from
    assert speeds.rate("a", "fast") == pytest.approx(13.0)


def test_a_type_named_only_by_the_machine_is_seeded_by_its_data_sheet() -> None:
    """The local executor names a GPU by its model, from the driver's name; a type nobody described gets its
    peak from the data sheets (Slurm's gres types are lower case), an unknown one none: all alike then."""
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "AMD Instinct MI300X", "NVIDIA GeForce RTX 4090"]
    assert [gpu_type_name(n) for n in names] == ["H100", "A100", "MI300X", "RTX-4090"]
    cluster = Cluster([Node("a", "r", 8, "h100"), Node("b", "r", 8, "A100"), Node("c", "r", 8, "RTX-4090")])
    assert {t: g.tflops for t, g in cluster.types.items()} == {"h100": 989.0, "A100": 312.0, "RTX-4090": 0.0}
    assert Speeds(cluster.types).relative("", ["h100", "A100"]) == pytest.approx({"h100": 1.0, "A100": 312 / 989})


def _one_of_each(policy: PredictiveLas) -> State:
    cluster = Cluster([Node(f"{t.name}0", t.name, 8, t.name) for t in TYPES], types=TYPES)
    state = State(cluster, [Tenant("t", 24)], Queue(policy.key))
    for t, rate in zip(("fast", "mid", "slow"), KINDS["a"], strict=True):
        state.speeds.observe("a", t, rate)
    return state


def test_a_job_takes_the_fastest_type_with_room_and_waits_a_bounded_time_for_it() -> None:
    """Kind "a" runs at 10, 5 and 1 on fast, mid and slow. With fast taken, a job predicted to run 1,000 s
    waits for it: on mid it would take 1,000 s more, and it takes mid once it has waited a tenth of that (ski
    rental, at the policy's ``wait_for_speed``); slow costs 9,000 s more: it would wait 900 s before that."""
    policy = PredictiveLas()
    state = _one_of_each(policy)
    state.submit(Job("first", "t", 1, 8, 0.0, kind="a", predicted_s=1000.0))
    assert [(a.job, a.placement) for a in policy.schedule(state, 0.0).admit] == [("first", {"fast0": 8})]
    state.start("first", {"fast0": 8}, 0.0)
    state.submit(Job("next", "t", 1, 8, 0.0, kind="a", predicted_s=1000.0, queued_at=0.0))
    decided = policy.schedule(state, 99.0)
    assert decided.admit == [] and decided.why("next").reason == (
        "no room for 8 GPUs on fast; it waits before taking a slower type: mid (50% of its speed), "
        "slow (10% of its speed)"
    )
    assert [(a.job, a.placement) for a in policy.schedule(state, 100.0).admit] == [("next", {"mid0": 8})]
    state.submit(Job("elsewhere", "t", 1, 1, 0.0, kind="a", gpu_types=("MI300X",)))
    assert policy.schedule(state, 99.0).why("elsewhere").reason == "the cluster has none of its GPU types: MI300X"
    state.withdraw("elsewhere")
    impatient = PredictiveLas(wait_for_speed=0.0)  # never waits: the fastest type with room at once
    assert [a.placement for a in impatient.schedule(state, 1.0).admit] == [{"mid0": 8}]


def test_a_gang_never_waits_for_a_type_too_small_to_hold_it() -> None:
    """Two 8-GPU workers: the one fast node could never hold them, so they take the two mid nodes at once."""
    policy = PredictiveLas()
    cluster = Cluster([Node("fast0", "f", 8, "fast"), Node("mid0", "m", 8, "mid"), Node("mid1", "m", 8, "mid")])
    state = State(cluster, [Tenant("t", 24)], Queue(policy.key))
    state.speeds.observe("a", "fast", 10.0)
    state.speeds.observe("a", "mid", 1.0)
    state.submit(Job("wide", "t", 2, 8, 0.0, kind="a", predicted_s=1000.0, queued_at=0.0))
    assert [a.placement for a in policy.schedule(state, 0.0).admit] == [{"mid0": 8, "mid1": 8}]


def test_a_long_run_moves_up_to_faster_gpus_when_they_free_and_takes_them_first() -> None:
    policy = PredictiveLas(budget=0.1)  # a move costs 720 GPU-seconds: 3%
    state = _one_of_each(policy)
    state.submit(Job("long", "t", 1, 8, 0.0, kind="a", predicted_s=100_000.0))
    state.start("long", {"slow0": 8}, 0.0)  # it had only slow GPUs then
    state.submit(Job("short", "t", 1, 8, 0.0, kind="a", predicted_s=10.0))
    state.start("short", {"fast0": 8}, 0.0)
    state.submit(Job("mid", "t", 1, 8, 0.0, kind="a", predicted_s=100_000.0))
    state.start("mid", {"mid0": 8}, 0.0)
    assert policy.schedule(state, 900.0).preempt == []  # nothing faster is free
    state.stop("short", 1000.0)
    decided = policy.schedule(state, 1000.0)
    assert [(p.job, p.for_job) for p in decided.preempt] == [("long", "long")]  # it gains 10x; "mid" only 2x
    assert decided.preempt[0].reason == "faster GPUs: fast is free and runs it 10.0x as fast as slow; it moves there"
    assert replace(policy, move_gain=1e9).schedule(state, 1000.0).preempt == []  # never worth it: no move
    state.ask_to_evict("long", "long")
    state.submit(Job("rival", "t", 1, 8, 1010.0, kind="a", predicted_s=10.0))
    state.requeue("long", 1030.0)  # its checkpoint committed
    decided = policy.schedule(state, 1030.0)  # the room made for "long" is its own; "rival" gets what is left
    assert [(a.job, a.placement) for a in decided.admit] == [("long", {"fast0": 8}), ("rival", {"slow0": 8})]


def test_the_replay_runs_each_job_at_its_kinds_true_pace_on_its_type() -> None:
    """A job of 1,000 s on the reference type runs 500 s where it is twice as fast, 4,000 s where it is a
    quarter; a job of a kind that cannot run on a type never lands there."""
    truth = TrueSpeeds({("a", "fast"): 2.0, ("a", "ref"): 1.0, ("a", "slow"): 0.25, ("c", "fast"): 0.0,
                        ("c", "ref"): 1.0, ("c", "slow"): 1.0}, reference="ref")  # fmt: skip
    cluster = Cluster([Node("f", "r", 1, "fast"), Node("s", "r", 1, "slow")])
    jobs = [TraceJob("one", "t", 1, 0.0, 1000.0, "a"), TraceJob("two", "t", 1, 0.0, 1000.0, "a"),
            TraceJob("three", "t", 1, 0.0, 1000.0, "c", ("ref", "slow"))]  # fmt: skip
    out = simulate(PredictiveLas(wait_for_speed=0.0), jobs, cluster, [Tenant("t", 2)], ReplayCosts(), jitter_s=0.0,
                   truth=truth)  # fmt: skip
    records = out.records
    by_type = sorted((r.id, *r.gpu_s_by_type) for r in records.values())
    assert by_type == [("one", "fast"), ("three", "slow"), ("two", "slow")] or by_type[2] == ("two", "fast")
    assert {r.id: r.jct for r in records.values() if set(r.gpu_s_by_type) == {"fast"}}.get("one") == 500.0
    assert records["three"].gpu_s_by_type == {"slow": 1000.0}  # never on "fast"


def test_the_server_places_jobs_by_type_prices_their_runs_and_holds_a_tenant_over_budget(tmp_path: Path) -> None:
    """`phalanx server --gpu-types H100:1,A100:2 --cluster-config prices.yaml`: the local executor offers a node
    of each declared type. A job that requires A100s runs on the A100 node, one that prefers H100s on the H100
    node; a job asking for a type the cluster lacks, or for more of one type than it has, is refused naming the
    field. Each run costs its GPU-hours at its type's price (usage, spend and the counter agree), a recipe job
    costs so much per million tokens and teaches the speed table its kind's tokens/s on its type (the other
    type estimated by peak FLOP/s), and a tenant over its monthly budget starts nothing until it is raised."""
    prices = tmp_path / "prices.yaml"  # $2 and $1 per GPU-second: the money is the seconds held
    prices.write_text("gpu_types:\n  H100: {price_per_gpu_h: 7200}\n  A100: {price_per_gpu_h: 3600}\n")
    server = PhalanxServer(tmp_path, slots=None, args=("--gpu-types", "H100:1,A100:2", "--cluster-config", str(prices)))
    try:
        client = server.member("team", 3, "alice")
        assert client.cluster()["types"] == {"H100": 1, "A100": 2}

        def spec(name: str, procs: int, resources: str) -> str:
            return (f"name: {name}\nresources: {{procs_per_node: {procs}, device: cpu, {resources}}}\n"
                    f"command: [{sys.executable}, -c, 'import time; time.sleep(60)']\n")  # fmt: skip

        a100 = client.submit(spec("needs-a100", 2, "gpu_types: [A100, MI300X]"))["id"]
        h100 = client.submit(spec("likes-h100", 1, "prefer_gpu_types: [H100]"))["id"]
        for job_id, node in ((a100, "local-A100"), (h100, "local-H100")):
            job = wait_for(client, job_id, {"RUNNING"}, timeout=60)
            assert job["placement"] == {node: job["gpus"]}, job
            client.cancel(job_id)
        with pytest.raises(ClientError, match=r"resources.gpu_types: \['MI300X'\]: this cluster has none of them; "
                                              r"its types: \['A100', 'H100'\]"):  # fmt: skip
            client.submit(spec("needs-mi300x", 1, "gpu_types: [MI300X]"))
        with pytest.raises(ClientError, match=r"resources.mix_gpu_types: the job needs 3 slots of one type; A100, "
                                              r"the largest of its types, has 2"):  # fmt: skip
            client.submit(spec("too-big", 3, "mix_gpu_types: false"))

        recipe = client.submit(tiny("priced", 4))["id"]  # two workers: the A100 node
        for job_id in (a100, h100):
            wait_for(client, job_id, {"CANCELLED"}, timeout=60)
        wait_for(client, recipe, {"SUCCEEDED"}, timeout=180)
        usage = client.usage()
        jobs = {row["job"]: row for row in usage["jobs"]}
        for job_id, per_gpu_s in ((a100, 1.0), (h100, 2.0), (recipe, 1.0)):
            row = jobs[job_id]
            assert row["dollars"] == pytest.approx(row["allocated_gpu_hours"] * 3600 * per_gpu_s, rel=1e-9), row
        (team,) = usage["tenants"]
        assert team["dollars"] == pytest.approx(sum(row["dollars"] for row in jobs.values()), rel=1e-9)
        priced = jobs[recipe]
        assert priced["tokens"] == pytest.approx(4 * 8 * 32, rel=0.01)  # 4 steps of 8 sequences of 32 tokens
        assert priced["dollars_per_million_tokens"] == pytest.approx(priced["dollars"] / priced["tokens"] * 1e6)
        assert jobs[a100]["dollars_per_million_tokens"] is None  # a script that reports no tokens
        speeds = {k["kind"]: k for k in client.speeds()["kinds"]}  # learned from the recipe's run on A100
        learned = speeds["llama-tiny-seq32"]
        a100_rate = priced["tokens"] / (priced["productive_gpu_hours"] * 3600)  # tokens/s per GPU, productive
        assert learned["measured"] == ["A100"] and learned["fastest"] == "H100", learned
        assert learned["tokens_per_gpu_s"]["A100"] == pytest.approx(a100_rate, rel=1e-6)
        assert learned["tokens_per_gpu_s"]["H100"] == pytest.approx(a100_rate * 989 / 312, rel=1e-6)  # peaks
        assert learned["relative"] == {"H100": 1.0, "A100": pytest.approx(312 / 989)}
        script = speeds[Path(sys.executable).name]  # the scripts report no tokens: only the peaks' ratio
        assert script["measured"] == [] and script["tokens_per_gpu_s"] == {} and script["fastest"] == "H100"
        env = {"PHALANX_CONFIG": str(tmp_path / "cli.json")}  # the CLI's table: the admin sees every kind
        assert cli(env, "login", server.url, "--token", server.token_file.read_text().strip()).returncode == 0
        shown = cli(env, "speeds")
        row = next(line.split() for line in shown.stdout.splitlines() if line.split()[:1] == ["llama-tiny-seq32"])
        assert row[2] == f"{a100_rate:,.1f}*" and float(row[1].replace(",", "")) > a100_rate, shown  # H100, A100
        spend = client.spend()
        assert spend["dollars"] == pytest.approx(team["dollars"]) and spend["tenants"][0]["monthly_budget"] is None
        metrics = httpx.get(
            f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.token_file.read_text().strip()}"}
        ).text
        counter = re.search(r'^phalanx_tenant_cost_dollars_total\{tenant="team"\} (\S+)$', metrics, re.M)
        assert counter is not None and float(counter[1]) == pytest.approx(team["dollars"])

        server.admin.update_tenant("team", monthly_budget=team["dollars"] / 2)
        waits = client.submit(spec("over-budget", 1, "gpu_types: [H100]"))["id"]
        deadline = time.monotonic() + 30
        while not (job := client.job(waits))["reason"].startswith("budget: tenant team has spent $"):
            assert job["state"] == "PENDING" and time.monotonic() < deadline, job
            time.sleep(0.1)
        assert "its jobs start when the period turns or the budget is raised" in job["reason"]
        over = client.spend()["tenants"][0]
        assert over["over_budget"] and over["left"] == pytest.approx(-team["dollars"] / 2)
        server.admin.update_tenant("team", monthly_budget=1e6)
        wait_for(client, waits, {"RUNNING"}, timeout=60)
        client.cancel(waits)
        wait_for(client, waits, {"CANCELLED"}, timeout=60)
    finally:
        server.stop()
