"""The scheduling core, property by property over random clusters (hypothesis), against brute-force references.
Over 400 lines on purpose: the worlds, their driver and the judges of every rule are shared by the property
tests of placement, quotas, preemption and both policies; split, each file would rebuild them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from phalanx.control.scheduler import Cluster, Node, place


@st.composite
def gangs(draw: st.DrawFn) -> tuple[Cluster, int, int]:
    """1-4 racks of 1-3 nodes of 0-8 GPUs, some already taken, and a gang sized to what is free: it fits, on
    one node, one rack or several, or (one time in ten) is one worker too many."""
    nodes = [
        Node(f"r{r}n{n}", f"r{r}", draw(st.sampled_from([0, 2, 4, 8, 8, 8])))
        for r in range(draw(st.integers(1, 4)))
        for n in range(draw(st.integers(1, 3)))
    ]
    cluster = Cluster(nodes)
    for node in nodes:
        if 0 < (taken := draw(st.sampled_from([0, 0, 0, 1, 2, 4, node.gpus]))) <= node.gpus:
            cluster.allocate({node.name: taken})
    per_worker = draw(st.sampled_from([1, 2, 4, 8]))
    slots = sum(free // per_worker for free in cluster.free.values())
    too_many = slots == 0 or draw(st.integers(0, 9)) == 0
    return cluster, slots + 1 if too_many else draw(st.integers(1, slots)), per_worker


def _fewest_nodes(slots: list[int], workers: int) -> int | None:
    """Reference: the fewest nodes (given how many workers each holds) that hold ``workers``."""
    held = 0
    for count, s in enumerate(sorted(slots, reverse=True), 1):
        held += s
        if held >= workers:
            return count
    return None


def test_a_gang_is_placed_whole_on_the_fewest_nodes_in_one_rack_where_possible() -> None:
    seen: Counter[str] = Counter()

    @settings(max_examples=400, deadline=None, derandomize=True, database=None)
    @given(gangs())
    def check(gang: tuple[Cluster, int, int]) -> None:
        cluster, workers, per_worker = gang
        slots = {name: free // per_worker for name, free in cluster.free.items()}
        placement = place(cluster, workers, per_worker)
        if placement is None:  # only when the GPUs are not there, in worker-sized pieces
            assert sum(slots.values()) < workers
            seen["none"] += 1
            return
        # whole, fitting, in worker-sized pieces
        assert sum(placement.gpus.values()) == workers * per_worker
        assert all(0 < g <= cluster.free[n] and g % per_worker == 0 for n, g in placement.gpus.items())
        racks = {cluster.nodes[n].rack for n in placement.gpus}
        in_one = {
            rack: _fewest_nodes([slots[n] for n in names], workers)
            for rack, names in cluster.racks.items()
            if _fewest_nodes([slots[n] for n in names], workers) is not None
        }
        if in_one:  # one rack can hold it: one rack, with as few nodes as the best such rack needs
            assert len(racks) == 1 and placement.nodes == min(in_one.values())
        else:
            assert placement.nodes == _fewest_nodes(list(slots.values()), workers)
        seen["one node" if placement.nodes == 1 else "one rack" if len(racks) == 1 else "racks"] += 1
        before = dict(cluster.free)
        cluster.allocate(placement.gpus)  # it fits: allocating it is not an error
        cluster.release(placement.gpus)
        assert cluster.free == before

    check()
    # every branch is reached, often: of the 400 cases, 196, 63, 59 and 82 (2026-12-05); a floor at half that
    assert seen["one node"] >= 100 and seen["one rack"] >= 30 and seen["racks"] >= 30 and seen["none"] >= 40, seen


def test_the_tightest_node_takes_a_small_job_and_big_holes_stay_open() -> None:
    cluster = Cluster([Node("a", "r0", 8), Node("b", "r0", 8), Node("c", "r1", 8)])
    cluster.allocate({"b": 6})
    assert place(cluster, 1, 2).gpus == {"b": 2}  # not a fresh 8-GPU node
    assert place(cluster, 2, 8).gpus == {"a": 8, "c": 8}  # two whole nodes: across racks, the only way
    cluster.allocate({"c": 1})
    assert place(cluster, 2, 8) is None  # 15 GPUs free, but not two whole nodes: never a partial gang


def test_a_gang_spanning_racks_uses_the_fewest_racks() -> None:
    cluster = Cluster.uniform(racks=3, nodes_per_rack=2, gpus_per_node=8)
    cluster.allocate({"r00n000": 8, "r01n000": 8})  # racks 0 and 1 have one free node each, rack 2 two
    placement = place(cluster, 3, 8)
    assert placement is not None and sorted(placement.gpus) in (
        ["r00n001", "r02n000", "r02n001"],
        ["r01n001", "r02n000", "r02n001"],
    )


def test_bad_input_is_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="node 'a' is listed twice"):
        Cluster([Node("a", "r", 8), Node("a", "r", 8)])
    cluster = Cluster([Node("a", "r", 8)])
    with pytest.raises(ValueError, match="cannot allocate 9 GPU\\(s\\) on node 'a': 8 free"):
        cluster.allocate({"a": 9})
    with pytest.raises(ValueError, match="cannot release 1 GPU\\(s\\) on node 'a': not allocated there"):
        cluster.release({"a": 1})
    with pytest.raises(ValueError, match="both must be at least 1"):
        place(cluster, 0, 8)
    assert cluster.free == {"a": 8}  # nothing half-done


# ---- the policies, over random clusters and queues -----------------------------------------------------------

from phalanx.control.scheduler import (  # noqa: E402
    POLICIES,
    Admit,
    Job,
    Policy,
    PredictiveLas,
    Preempt,
    PreemptionCost,
    Queue,
    Round,
    State,
    Tenant,
    TiresiasLike,
)

SHAPES = [(1, 1), (1, 2), (1, 4), (2, 4), (3, 4), (2, 8), (4, 4), (3, 8)]  # workers x GPUs per worker


@st.composite
def worlds(draw: st.DrawFn) -> tuple[Cluster, list[Tenant], list[tuple[float, str, Job | str]]]:
    """A cluster, tenants (some in a cohort, some with a borrowing limit) and what happens, in time: jobs
    arrive and finish over hours (so that runs drop to LAS's second level and new jobs may preempt them); then
    a storm: a long job at low priority, and its tenant's urgent short jobs of its shape, one after another
    (so that a victim is preempted, restarts and is preempted again)."""
    cluster = Cluster.uniform(draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([4, 8])))
    total = cluster.total_gpus
    tenants = []
    for i in range(draw(st.integers(1, 4))):
        nominal = draw(st.integers(0, total // 2))
        cohort = draw(st.sampled_from(["c", "c", None]))
        limit = draw(st.sampled_from([None, 0, 2, 8]))
        tenants.append(Tenant(f"t{i}", nominal, cohort, limit))
    events: list[tuple[float, str, Job | str]] = []
    now, arrived = 0.0, []
    for i in range(draw(st.integers(1, 30))):
        now += draw(st.sampled_from([0.0, 10.0, 60.0, 300.0, 900.0]))
        if arrived and draw(st.integers(0, 2)) == 0:
            events.append((now, "finish", draw(st.sampled_from(arrived))))
            continue
        workers, per_worker = draw(st.sampled_from(SHAPES))
        tenant, priority = draw(st.sampled_from(tenants)).name, draw(st.integers(0, 2))
        predicted = draw(st.sampled_from([60.0, 600.0, 6000.0, 60000.0]))
        events.append((now, "arrive", Job(f"j{i}", tenant, workers, per_worker, now, priority, predicted)))
        arrived.append(f"j{i}")
    urgent = max(tenants, key=lambda t: t.nominal_gpus)
    workers, per_worker = draw(st.sampled_from([s for s in SHAPES if s[0] * s[1] <= max(urgent.nominal_gpus, 1)]))
    now += 1.0
    events.append((now, "arrive", Job("long", urgent.name, workers, per_worker, now, 0, predicted_s=60000.0)))
    for k in range(draw(st.integers(0, 8))):
        now += draw(st.sampled_from([10.0, 60.0, 900.0]))
        events.append((now, "arrive", Job(f"s{k}", urgent.name, workers, per_worker, now, 2, predicted_s=60.0)))
        now += draw(st.sampled_from([10.0, 60.0]))
        events.append((now, "finish", f"s{k}"))
    return cluster, tenants, events


def _drive(
    policy: Policy | str, world: tuple, seen: Callable[[State, Round, float], None] = lambda *_: None
) -> tuple[State, list[Preempt], list[Admit]]:
    """Rounds at each event, applying every decision as the control plane would (victims leave at once),
    checking the quota invariants after every round; ``seen`` is shown each round's decisions before they are
    applied. Returns the state, and every preemption and admission."""
    cluster, tenants, events = world
    policy = POLICIES[policy]() if isinstance(policy, str) else policy
    state, preempts, admits = State(cluster, tenants, Queue(policy.key)), [], []
    for now, kind, what in events:
        if kind == "arrive":
            state.submit(what)
        elif what in state.running:
            state.stop(what, now)
        for _ in range(10):
            decided = policy.schedule(state, now)
            seen(state, decided, now)
            for admit in decided.admit:
                job = state.queue.jobs[admit.job]
                assert sum(admit.placement.values()) == job.gpus
                assert all(g % job.per_worker == 0 for g in admit.placement.values())  # whole workers per node
                state.start(admit.job, admit.placement, now)  # raises if it does not fit
                admits.append(admit)
            for preempt in decided.preempt:
                preempts.append(preempt)
                state.ask_to_evict(preempt.job, preempt.for_job)
                state.requeue(preempt.job, now)
            if policy.name in ("phalanx", "kueue-like"):
                _quotas_hold(state)
            if not decided.admit and not decided.preempt:
                break
    return state, preempts, admits


def _quotas_hold(state: State) -> None:
    for name, tenant in state.tenants.items():
        held = sum(r.job.gpus for r in state.running.values() if r.job.tenant == name)
        assert held == state.held[name]
        limit = 0 if tenant.cohort is None else tenant.borrowing_limit
        if limit is not None:
            assert held <= tenant.nominal_gpus + limit, f"{name} holds {held}: over its quota and borrowing limit"
    for members in state.cohorts.values():
        assert sum(state.held[t] for t in members) <= sum(state.tenants[t].nominal_gpus for t in members)


@settings(max_examples=150, deadline=None)
@given(worlds(), st.sampled_from(sorted(POLICIES)))
def test_every_admission_has_a_placement_that_fits_and_quotas_hold(world: tuple, policy: str) -> None:
    state, _, _ = _drive(policy, world)
    cluster = state.cluster
    assert cluster.free_gpus == cluster.total_gpus - sum(r.job.gpus for r in state.running.values())


def test_phalanx_preempts_only_by_its_rules_never_in_cycles_and_within_its_budget() -> None:
    """Every preemption is one the policy's rules allow, judged from the state the round saw: least attained
    service (the job's level below the victim's), priority (its own tenant's run, or a borrowed one), or a
    reclaim (the job within its quota, the victim borrowed); a plan with victims taken for least service is
    made only while what every preemption so far cost, by the policy's model, stays within its budget of the
    GPU-time given out; no two jobs preempt each other."""
    policy = PredictiveLas(threshold_gpu_s=600.0, budget=0.05)  # levels and a budget these short worlds reach
    levels, seen = policy.levels, Counter()

    def judge(state: State, decided: Round, now: float) -> None:
        spent = policy.cost.gpu_s(state.evicted_gpus, state.evicted_gpus_sq)
        charged: dict[str, tuple[list[int], list[bool]]] = {}
        held = dict(state.held)
        for admit in decided.admit:
            held[state.queue.jobs[admit.job].tenant] += state.queue.jobs[admit.job].gpus
        for p in decided.preempt:
            run, job = state.running[p.job], state.queue.jobs[p.for_job]
            victim, tenant = run.job, state.tenants[job.tenant]
            over = sum(r.job.gpus for r in state.running.values() if r.job.tenant == victim.tenant)
            lent = victim.tenant != job.tenant and over > state.tenants[victim.tenant].nominal_gpus
            job_level, run_level = levels.level(job, now), levels.level(victim, now, run.started)
            if p.reason.startswith("reclaim"):
                assert lent and held[job.tenant] + job.gpus <= tenant.nominal_gpus and job_level <= run_level, p
                seen["reclaim"] += 1
            elif p.reason.startswith("least service"):
                assert job_level < run_level and (victim.tenant != job.tenant or victim.priority <= job.priority), p
                seen["least service"] += 1
            else:
                assert p.reason.startswith("priority") and victim.priority < job.priority, p
                assert victim.tenant == job.tenant or lent, p
                seen["priority"] += 1
            plan = charged.setdefault(p.for_job, ([], []))
            plan[0].append(victim.gpus)
            plan[1].append(p.reason.startswith("least service"))
        for gpus, heuristic in charged.values():  # the plans, in order
            spent += policy.cost.gpu_s(sum(gpus), sum(g * g for g in gpus))
            if any(heuristic):
                assert spent <= policy.budget * state.gpu_s_given(now) + 1e-6

    @seed(1)  # the same worlds whatever the test's text (derandomize seeds from the text)
    @settings(max_examples=150, deadline=None, database=None)
    @given(worlds())
    def check(world: tuple) -> None:
        state, preempts, admits = _drive(policy, world, judge)
        pairs = {(p.for_job, p.job) for p in preempts}
        assert not pairs & {(b, a) for a, b in pairs}, "two jobs preempted each other"
        racks = state.cluster.nodes
        seen["across racks"] += any(len({racks[n].rack for n in a.placement}) > 1 for a in admits)

    check()
    # each path is taken many times over the 150 worlds (2026-12-06, seed 1: least service 318, priority 246,
    # reclaim 99 preemptions, a gang across racks in 17 worlds); a floor at half that
    assert seen["least service"] >= 159 and seen["priority"] >= 123 and seen["reclaim"] >= 49, seen
    assert seen["across racks"] >= 8, seen


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 3))
def test_a_tenant_below_its_quota_gets_it_back(nodes: int, lender_nodes: int, priority: int) -> None:
    """The borrower fills the whole cluster while the lender is idle, and queues twice as many jobs more; when
    the lender asks for up to its quota, behind all of those, it gets it, by reclaim, whatever the borrower's
    priority."""
    lender_nodes = min(lender_nodes, nodes)
    cluster = Cluster.uniform(1, nodes, 8)
    tenants = [Tenant("lender", 8 * lender_nodes, "c"), Tenant("borrower", 8 * (nodes - lender_nodes), "c")]
    policy = PredictiveLas()
    state = State(cluster, tenants, Queue(policy.key))
    for i in range(3 * 8 * nodes):
        state.submit(Job(f"b{i}", "borrower", 1, 1, 0.0, priority=priority, predicted_s=86400))
    for now in (1.0, 2.0):  # the lender submits at t=2, after the borrower took everything
        if now == 2.0:
            for i in range(lender_nodes):
                state.submit(Job(f"l{i}", "lender", 1, 8, now, predicted_s=86400))
        for _ in range(8):
            decided = policy.schedule(state, now)
            for admit in decided.admit:
                state.start(admit.job, admit.placement, now)
            for preempt in decided.preempt:
                assert preempt.reason.startswith("reclaim")
                state.ask_to_evict(preempt.job, preempt.for_job)
                state.requeue(preempt.job, now)
    assert state.held["lender"] == 8 * lender_nodes
    assert state.cluster.free_gpus == 0  # the borrower still has the rest


def test_least_served_first_then_the_shortest_predicted() -> None:
    """With one GPU free: jobs that never ran before jobs that ran their threshold (level 1), and among
    those of a level, the earliest predicted finish, submitted plus predicted duration."""
    policy = PredictiveLas(threshold_gpu_s=100.0)
    state = State(Cluster.uniform(1, 1, 1), [Tenant("t", 1)], Queue(policy.key))
    state.submit(Job("served", "t", 1, 1, 0.0, predicted_s=10, queued_at=500.0, ran=((0.0, 400.0),)))
    state.submit(Job("long", "t", 1, 1, 10.0, predicted_s=5000))
    state.submit(Job("short", "t", 1, 1, 20.0, predicted_s=50))
    assert [a.job for a in policy.schedule(state, 600.0).admit] == ["short"]
    state.withdraw("short")
    assert [a.job for a in policy.schedule(state, 600.0).admit] == ["long"]


def test_a_job_starved_after_running_is_promoted() -> None:
    """A job that ran its threshold and then waits: back to level 0 after promote_knob x what it ran, or
    after starve_s whatever it ran (Tiresias's own reset alone would keep a job that ran for days waiting
    for days more)."""
    levels = PredictiveLas(threshold_gpu_s=100.0, promote_knob=8.0, starve_s=500.0).levels
    short = Job("short", "t", 1, 1, 0.0, ran=((0.0, 40.0),))  # ran 40 s on 1 GPU: level 0 throughout
    ran = Job("ran", "t", 1, 1, 0.0, ran=((0.0, 200.0),))  # ran 200 s: level 1 ...
    assert levels.level(short, 300.0) == 0 and levels.level(ran, 300.0) == 1
    assert levels.level(ran, 699.0) == 1 and levels.level(ran, 700.0) == 0  # ... until 500 s pending
    week = Job("week", "t", 1, 1, 0.0, ran=((0.0, 7 * 86400.0),))
    tiresias = TiresiasLike(threshold_gpu_s=100.0, promote_knob=8.0).levels
    assert tiresias.level(week, 7 * 86400.0 + 86400) == 1  # a day later, Tiresias still waits for 8 weeks
    assert PredictiveLas(threshold_gpu_s=100.0).levels.level(week, 7 * 86400.0 + 86400) == 0


def test_the_budget_holds_preemption_back_but_never_a_reclaim() -> None:
    """Preemption priced far above what the cluster has given out: a short job does not preempt a long run
    (and says why), but a tenant below its quota still reclaims its GPUs from a borrower, and a job of a higher
    priority still takes its own tenant's lower one (what a server just started, with little GPU-time given
    out yet, must do)."""
    policy = PredictiveLas(cost=PreemptionCost(restart_s=10**7))
    cluster = Cluster.uniform(1, 2, 8)
    state = State(cluster, [Tenant("busy", 8, "c"), Tenant("lender", 8, "c")], Queue(policy.key))
    for name in ("mine", "borrowed"):
        state.submit(Job(name, "busy", 1, 8, 0.0, predicted_s=100_000))
        state.start(name, {"r00n000" if name == "mine" else "r00n001": 8}, 0.0)
    state.submit(Job("short", "busy", 1, 8, 5000.0, predicted_s=60))
    decided = policy.schedule(state, 5000.0)
    assert decided.preempt == [] and "the preemption budget is spent" in decided.why("short").reason
    state.submit(Job("back", "lender", 1, 8, 5001.0, predicted_s=100_000))
    decided = policy.schedule(state, 5001.0)
    assert [(p.job, p.for_job) for p in decided.preempt] == [("borrowed", "back")]
    assert decided.preempt[0].reason.startswith("reclaim: tenant lender needs its quota back")
    state.queue.remove("back")
    state.submit(Job("urgent", "busy", 1, 8, 5002.0, priority=5, predicted_s=100_000))
    decided = policy.schedule(state, 5002.0)
    assert [p.for_job for p in decided.preempt] == ["urgent"] and decided.preempt[0].reason.startswith("priority")


def test_victims_are_read_by_what_they_would_lose_whatever_their_size() -> None:
    """GPUs x (time since the last checkpoint + a restart): a 1-GPU run 100 s past its checkpoint loses less
    than an 8-GPU run 10 s past its own (a generator bound its GPUs late, and every size was read as one)."""
    state = State(Cluster.uniform(1, 2, 8), [Tenant("t", 16)], Queue(PredictiveLas().key))
    for name, gpus, node in (("big", 8, "r00n000"), ("small", 1, "r00n001")):
        state.submit(Job(name, "t", 1, gpus, 0.0))
        state.start(name, {node: gpus}, 0.0)
    state.checkpointed("big", 990.0)
    state.checkpointed("small", 900.0)
    assert [run.id for run in state.cheapest(1000.0, restart_s=60.0)] == ["small", "big"]  # 160 < 560


def test_why_pending_names_the_quota() -> None:
    cluster = Cluster.uniform(1, 2, 8)
    policy = PredictiveLas()
    state = State(cluster, [Tenant("a", 4), Tenant("b", 12, "c", borrowing_limit=0)], Queue(policy.key))
    state.submit(Job("a1", "a", 1, 8, 0.0))
    state.submit(Job("b1", "b", 2, 8, 0.0))
    decided = policy.schedule(state, 1.0)
    assert decided.admit == []
    assert decided.why("a1").reason == (
        "tenant a holds 0 of the 4 GPUs of its quota and this job needs 8; it is in no cohort to borrow from"
    )
    assert "over its borrowing limit of 0" in decided.why("b1").reason


def test_the_duration_predictor_uses_the_tenants_history_only() -> None:
    from phalanx.control.scheduler import DurationPredictor

    predictor = DurationPredictor(default_s=1234.0)
    assert predictor.predict("a", 1) == 1234.0
    for d in (100.0, 200.0, 300.0):
        predictor.record("a", 8, d)
    assert predictor.predict("a", 8) == 200.0
    assert predictor.predict("a", 1) == 200.0  # no 1-GPU history: the tenant's, any size
    assert predictor.predict("b", 8) == 1234.0  # never another tenant's


def test_bad_jobs_and_tenants_are_refused_by_name() -> None:
    policy = PredictiveLas()
    with pytest.raises(ValueError, match="tenant 'x': nominal quota -1"):
        Tenant("x", -1)
    with pytest.raises(ValueError, match="job 'j': 0 worker"):
        Job("j", "t", 0, 1, 0.0)
    state = State(Cluster.uniform(1, 1, 8), [Tenant("t", 8)], Queue(policy.key))
    with pytest.raises(ValueError, match="job 'j': tenant 'nope' is not known; tenants: \\['t'\\]"):
        state.submit(Job("j", "nope", 1, 1, 0.0))


def test_a_new_job_preempts_a_long_run_which_checkpoints_first_and_only_once() -> None:
    """The run has had its 7,200 GPU-seconds (8 GPUs, 900 s) before a new job comes: it makes way. Not before:
    two jobs of level 0 wait their turn. (A budget that a run of 1,000 s has given enough for.)"""
    cluster = Cluster.uniform(1, 1, 8)
    policy = PredictiveLas(budget=1.0)
    state = State(cluster, [Tenant("t", 8)], Queue(policy.key))
    state.submit(Job("long", "t", 1, 8, 0.0, predicted_s=100_000))
    state.start("long", {"r00n000": 8}, 0.0)
    state.checkpointed("long", 880.0)
    state.submit(Job("short", "t", 1, 8, 890.0, predicted_s=60))
    assert policy.schedule(state, 890.0).preempt == []  # 7,120 GPU-seconds: still level 0
    decided = policy.schedule(state, 1000.0)
    assert [(p.job, p.for_job) for p in decided.preempt] == [("long", "short")]
    assert decided.preempt[0].reason == (
        "least service: short has run less than 7,200 GPU-seconds; this one 8,000 since its last reset "
        "(predicted 100,000 s in all)"
    )
    state.ask_to_evict("long", "short")
    decided = policy.schedule(state, 1010.0)  # still checkpointing: nothing new, and the reason says so
    assert decided.preempt == [] and decided.admit == []
    assert decided.why("short").kind == "preempting" and decided.why("short").behind == "long"
    state.requeue("long", 1030.0)  # its checkpoint committed: it leaves, and is queued again
    decided = policy.schedule(state, 1030.0)
    assert [a.job for a in decided.admit] == ["short"]  # the room made for it is its own
    assert state.queue.jobs["long"].preemptions == 1 and state.queue.jobs["long"].preempted_by == {"short"}


def _tiresias_counters(gpus: int, runs: list[tuple[int, int]], until: int, threshold: int, knob: int) -> int:
    """Reference: the Tiresias authors' simulator's counters (run_sim.py, dlas-gpu), second by second:
    executed_time grows while running, last_pending_time while pending once the job has run, and a job of
    the second queue whose pending time reaches knob x its executed time has both reset."""
    executed = pending = 0
    running = {t for started, ended in runs for t in range(started, ended)}
    for t in range(runs[0][0] if runs else until, until):
        if t in running:
            executed += 1
        elif executed > 0:
            pending += 1
            if executed * gpus >= threshold and pending >= knob * executed:
                executed = pending = 0
    return executed


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 8]), st.lists(st.tuples(st.integers(0, 60), st.integers(1, 60)), max_size=5),
       st.integers(0, 200))  # fmt: skip
def test_tiresias_resets_a_promoted_jobs_service_as_its_authors_simulator_does(
    gpus: int, spells: list[tuple[int, int]], pending_s: int
) -> None:
    runs, t = [], 0
    for gap, length in spells:
        runs.append((t + gap, t + gap + length))
        t += gap + length
    until = t + pending_s
    policy = TiresiasLike(threshold_gpu_s=40, promote_knob=2)
    job = Job("j", "t", 1, gpus, 0.0, ran=tuple((float(a), float(b)) for a, b in runs))
    executed = _tiresias_counters(gpus, runs, until, 40, 2)
    assert policy.levels.executed_s(job, float(until)) == executed
    assert policy.levels.level(job, float(until)) == int(executed * gpus >= 40)
