"""The scheduling core, property by property over random clusters (hypothesis), against brute-force references."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.control.scheduler import Cluster, Node, place


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    """1-3 racks of 1-4 nodes of 0-8 GPUs, each node with some GPUs already taken."""
    nodes = [
        Node(f"r{r}n{n}", f"r{r}", draw(st.integers(0, 8)))
        for r in range(draw(st.integers(1, 3)))
        for n in range(draw(st.integers(1, 4)))
    ]
    cluster = Cluster(nodes)
    for node in nodes:
        if (taken := draw(st.integers(0, node.gpus))) > 0:
            cluster.allocate({node.name: taken})
    return cluster


def _fewest_nodes(slots: list[int], workers: int) -> int | None:
    """Reference: the fewest nodes (given how many workers each holds) that hold ``workers``."""
    held = 0
    for count, s in enumerate(sorted(slots, reverse=True), 1):
        held += s
        if held >= workers:
            return count
    return None


@settings(max_examples=400, deadline=None)
@given(clusters(), st.integers(1, 6), st.sampled_from([1, 2, 4, 8]))
def test_a_gang_is_placed_whole_on_the_fewest_nodes_in_one_rack_where_possible(
    cluster: Cluster, workers: int, per_worker: int
) -> None:
    slots = {name: free // per_worker for name, free in cluster.free.items()}
    placement = place(cluster, workers, per_worker)
    if placement is None:  # only when the GPUs are not there, in worker-sized pieces
        assert sum(slots.values()) < workers
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
    before = dict(cluster.free)
    cluster.allocate(placement.gpus)  # it fits: allocating it is not an error
    cluster.release(placement.gpus)
    assert cluster.free == before


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
