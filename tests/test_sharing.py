"""GPU sharing (scheduler/sharing.py): fractions never overcommit a GPU or a node's CPUs and honour GPU types,
over random fleets and tasks (hypothesis), whatever the packing choice; FGD's measure and best fit by example;
and the fill of a fleet as FGD's paper measures it (sim/sharing.py), on a fleet small enough to know."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from phalanx.control.scheduler.sharing import MILLI, Ask, BestFit, Fragmentation, Packing, Room, Workload
from phalanx.control.sim.sharing import CHOICES, fill, score_for
from phalanx.control.sim.trace import TraceError, alibaba_2023

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


def test_fgd_keeps_whole_gpus_whole_where_best_fit_breaks_one() -> None:
    """A 0.4-GPU task, with whole-GPU and 0.4-GPU tasks equally expected. Best fit takes the node with the
    least room, n1, and breaks one of its whole GPUs; FGD's measure says that costs 300 thousandths of
    fragmentation, and filling n2's 600-thousandth GPU lowers it by 100: it goes there."""
    packing = Packing([("n1", "A", 4000, 2), ("n2", "A", 64000, 2)])
    packing.take("n2", Ask(0, 1, 400), (1,))
    task, whole = Ask(2000, 1, 400), Ask(2000, 1)
    fgd = Fragmentation(Workload([task, whole]))
    assert fgd.of(packing.rooms["n1"]) == 0 and fgd.of(packing.rooms["n2"]) == 300  # 600 left: no whole GPU
    assert packing.place(task, BestFit(packing)) == ("n1", (0,))
    assert packing.place(task, fgd) == ("n2", (1,))
    assert fgd(packing.rooms["n2"], task, (1,)) == (-100.0,)
    # FGD finds the two GPUs of n1 alike; best fit, as the tie-break, takes the fuller of otherwise equal nodes
    packing = Packing([("n1", "A", 64000, 2), ("n2", "A", 8000, 2)])
    assert packing.place(whole, Fragmentation(Workload([whole]))) == ("n1", (0,))
    assert packing.place(whole, Fragmentation(Workload([whole]), tie_break=BestFit(packing))) == ("n2", (0,))


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
