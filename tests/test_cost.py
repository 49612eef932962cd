"""Money: what runs cost at their GPU types' prices, budgets that hold a tenant's new work once spent (the
scheduling core's rule, kept by the simulator as the server keeps it), and the operator's price file. The
server's side (usage, spend, the counter, a job held and released) is in test_gpu_types.py's server test."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from phalanx.control.scheduler import Cluster, GpuType, Job, Node, PredictiveLas, Queue, State, Tenant, enforce_budgets
from phalanx.control.server import cluster_config
from phalanx.control.sim.fleet import gavel_fleet
from phalanx.control.sim.scenario import Scenario, replay
from test_sim import _trace

# 10 values, each level 8 of the one before: 2.6 million values from 300 bytes
ALIAS_BOMB = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 8)}]\n" for p, c in zip("abcdef", "bcdefg", strict=True)
)
PER_SECOND = 3600.0  # a price per GPU-hour of $1 per GPU-second: the figures below are plain seconds


def _job(job_id: str, tenant: str, gpus: int) -> Job:
    return Job(job_id, tenant, 1, gpus, submitted=0.0)


def test_a_tenant_over_budget_starts_nothing_until_the_period_turns_and_its_running_jobs_go_on() -> None:
    cluster = Cluster([Node("a", "r", 8, "A100")], types=[GpuType("A100", price_per_gpu_h=PER_SECOND)])
    policy = PredictiveLas()
    state = State(cluster, [Tenant("t", 8, budget=100.0), Tenant("u", 8)], Queue(policy.key))
    state.new_period(0.0)
    state.submit(_job("first", "t", 2))
    state.start("first", {"a": 2}, 0.0)
    state.submit(_job("second", "t", 1))
    enforce_budgets(state, 40.0)  # $80 of $100: not held
    assert [a.job for a in policy.schedule(state, 40.0).admit] == ["second"]
    state.start("second", {"a": 1}, 40.0)

    state.submit(_job("third", "t", 1))
    state.submit(_job("other", "u", 1))
    assert state.dollars("t", 50.0) == pytest.approx(2 * 50 + 1 * 10)
    enforce_budgets(state, 50.0)
    assert list(state.on_hold) == ["third"] and "tenant t has spent $110.00 of its $100.00" in state.holding["t"]
    assert [a.job for a in policy.schedule(state, 50.0).admit] == ["other"]  # another tenant is not held
    state.submit(_job("fourth", "t", 1))  # submitted while held: held
    assert list(state.on_hold) == ["third", "fourth"] and "fourth" not in state.queue.jobs
    state.withdraw("fourth")  # cancelled while held
    assert set(state.running) == {"first", "second"}  # the running go on

    state.stop("first", 60.0)
    assert state.dollars("t", 60.0) == pytest.approx(120 + 20)
    state.new_period(100.0)  # the period turns: only what runs from now counts
    assert state.dollars("t", 110.0) == pytest.approx(10)
    enforce_budgets(state, 110.0)
    assert not state.on_hold and not state.holding
    assert [a.job for a in policy.schedule(state, 110.0).admit] == ["other", "third"]


def test_in_the_simulator_budgets_hold_and_the_money_adds_up(tmp_path: Path) -> None:
    """Gavel's fleet, priced: each job's dollars are its GPU-seconds on each type at that type's price. With a
    budget of a third of what the busiest tenant spent without one, that tenant spends less, some of its jobs
    never start, and the other tenants' jobs all finish."""
    scenario = Scenario(_trace(tmp_path / "t.csv"), "2017-10-01", "2017-10-03", racks=2, fleet=gavel_fleet(128))
    prices = {t.name: t.price_per_gpu_h for t in scenario.fleet.types}
    free = replay(scenario, ["phalanx"], workers=1)["phalanx"].shared
    spent: dict[str, float] = {}
    for r in free.records.values():
        assert r.dollars == pytest.approx(sum(s * prices[t] / 3600 for t, s in r.gpu_s_by_type.items())), r
        spent[r.tenant] = spent.get(r.tenant, 0.0) + r.dollars
    busiest = max(spent, key=spent.__getitem__)
    budget = spent[busiest] / 3
    held = replay(replace(scenario, budgets={busiest: budget}), ["phalanx"], workers=1)["phalanx"].shared
    by_tenant: dict[str, float] = {}
    for r in held.records.values():
        by_tenant[r.tenant] = by_tenant.get(r.tenant, 0.0) + r.dollars
        assert r.finish is not None or (r.held and r.tenant == busiest), r
    assert budget <= by_tenant[busiest] < spent[busiest]  # it reached its budget, and stopped starting work
    assert any(r.held for r in held.records.values())


def test_the_price_file_is_read_and_bad_values_are_named(tmp_path: Path) -> None:
    good = tmp_path / "cluster.yaml"
    good.write_text("gpu_types:\n  H100: {price_per_gpu_h: 2.49, spot_price_per_gpu_h: 1.1, memory_gib: 80}\n")
    (h100,) = cluster_config.load(good)
    assert (h100.name, h100.price_per_gpu_h, h100.spot_price_per_gpu_h, h100.tflops) == ("H100", 2.49, 1.1, 989.0)
    for text, said in [
        ("gpu_types:\n  H100: {price_per_gpu_h: .nan}\n", "gpu_types.H100.price_per_gpu_h"),
        ("gpu_types:\n  H100: {price_per_gpu_h: -1}\n", "gpu_types.H100.price_per_gpu_h"),
        ("gpu_types:\n  H100: {price: 2}\n", "gpu_types.H100.price"),
        ("gpu_types:\n  'bad name': {price_per_gpu_h: 1}\n", "gpu_types.bad name"),
        ("a: &x [1]\nb: *x\n", "gpu_types: Field required"),
        ("[1, 2]\n", "(top): Input should be a valid dictionary"),
        ("gpu_types: [\n", "not valid YAML"),
        (ALIAS_BOMB, "more than 100,000 values once aliases are expanded"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=rf"--cluster-config {bad}: .*{re.escape(said)}"):
            cluster_config.load(bad)
    with pytest.raises(ValueError, match="cannot read it"):
        cluster_config.load(tmp_path / "missing.yaml")
    slurm = [Node("n0", "r", 8, "h100")]  # Slurm's gres type, in lower case: the file's H100 prices it
    (priced,) = cluster_config.as_found([h100], slurm)
    assert Cluster(slurm, types=[priced]).dollars_per_h({"n0": 8}) == pytest.approx(8 * 2.49)
