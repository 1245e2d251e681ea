"""dist_optim.sharding.owners: the one owner interface (work groups, owners by cost, the routed exchange,
whole results shared).

The geometry under the routes (placement.plan_route) is tested in tests/unit/test_layout.py and
tests/unit/test_plan_route.py; here the exchange itself, on layouts of every kind, against the
full tensors, counting the collectives at torch.distributed (tests/helpers/collectives.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dist_optim import comm
from dist_optim.layout import ParamLayout, TPSplit, ZeroShard
from dist_optim.sharding.owners import (
    ONE_RANK,
    Owner,
    RoutedTensors,
    WorkGroup,
    WorkGroups,
    assign,
    from_owners,
    plan_tasks,
    route_tasks,
    share_results,
    to_owners,
    work_grids,
    work_group,
)


def test_assign_balances_each_work_group_on_its_own() -> None:
    pair, grid = object(), object()  # stand-ins for process groups: assign only compares them
    for rank in range(2):
        wa = WorkGroup(pair, 2, rank)
        wb = WorkGroup(grid, 4, rank)
        owners = assign([(wa, 5.0), (wb, 1.0), (ONE_RANK, 9.0), (wa, 4.0), (wb, 3.0), (wa, 1.0), (ONE_RANK, 1.0)])
        # per work group: assign_owners over its items in their order
        assert [o.rank for o in owners] == [0, 1, 0, 1, 0, 1, 0]
        assert [o.work for o in owners] == [wa, wb, ONE_RANK, wa, wb, wa, ONE_RANK]
        # ONE_RANK: this rank computes and shares nothing
        assert owners[2].mine and not owners[2].shared
        assert [o.mine for o in owners if o.work is wa] == [rank == 0, rank == 1, rank == 1]


def test_work_group_without_process_groups_is_alone() -> None:
    """Unbound, or bound with neither a data-parallel nor a TP group: no split (no collective)."""
    assert work_group(ParamLayout((4, 3)), None, None, {}) is ONE_RANK
    assert WorkGroup.of(None) is ONE_RANK  # the default group of a job of one process


def test_share_results_without_other_ranks_moves_nothing() -> None:
    t = torch.ones(3)
    comm.reset_counts()
    share_results([(Owner(ONE_RANK, 0), [t])], torch.bfloat16)
    assert not comm.COUNTS and torch.equal(t, torch.ones(3))


def _work_groups_worker() -> None:
    """tp=2 x dp=2 (TP fastest): which ranks share a tensor's work, for each kind of layout."""
    from dist_optim.testing import grid_groups

    tp_group, dp_group = grid_groups(2, 2)
    tp_rank, dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)
    tp = TPSplit(0, 2, tp_rank, tp_group)
    zero = ZeroShard(2, dp_rank, 0, dp_group)
    grids = work_grids(tp_group, [dp_group])
    assert len(grids) == 1

    def ranks(work: WorkGroup) -> list[int]:
        members = comm.group_key(work.group)  # the global ranks (None: the whole job)
        assert work.size == len(members) and work.rank == comm.group_rank(work.group)
        return sorted(members)

    # TP x ZeRO, TP-split or replicated over TP: the whole grid
    assert ranks(work_group(ParamLayout((4, 6), tp, zero), None, tp_group, grids)) == [0, 1, 2, 3]
    assert ranks(work_group(ParamLayout((6,), None, zero), None, tp_group, grids)) == [0, 1, 2, 3]
    # data parallel without ZeRO: the optimizer's dp group spans the grid too
    assert ranks(work_group(ParamLayout((4, 6), tp), dp_group, tp_group, grids)) == [0, 1, 2, 3]
    # no grid made: the data-parallel group alone (its TP peers compute the same)
    assert ranks(work_group(ParamLayout((4, 6), tp, zero), None, tp_group, {})) == sorted(
        dist.get_process_group_ranks(dp_group)
    )
    # no data-parallel group: the TP group (the layout's, or the optimizer's for a replicated one)
    tp_ranks = sorted(dist.get_process_group_ranks(tp_group))
    assert ranks(work_group(ParamLayout((4, 6), tp), None, tp_group, grids)) == tp_ranks
    assert ranks(work_group(ParamLayout((5,)), None, tp_group, grids)) == tp_ranks
    assert work_group(ParamLayout((5,)), None, None, {}) is ONE_RANK
    # None as a process group is the default group: the whole job
    assert ranks(WorkGroup.of(None)) == [0, 1, 2, 3]


def test_work_groups(pool4) -> None:
    pool4.run(_work_groups_worker)


def _share_worker(dtype: torch.dtype | None) -> None:
    """Items in three work groups (the two dp pairs of tp=2 x dp=2, the whole job, this rank
    alone): every rank of each work group ends with the owner's tensors, in one all_gather per
    work group, whatever the number of items."""
    from dist_optim.testing import grid_groups

    _, dp_group = grid_groups(2, 2)
    pair, world = WorkGroup.of(dp_group), WorkGroup.of(None)
    me = dist.get_rank()
    # The pair's members are (r, r + 2): the same item values on both, as a work group needs.
    pair_id = dist.get_process_group_ranks(dp_group)[0]
    for n in (2, 7):
        items = [(pair, float(i + 1)) for i in range(n)] + [(world, float(n - i)) for i in range(n)]
        items.append((ONE_RANK, 1.0))
        owners = assign(items)
        truth = [torch.full((i % 3 + 1, 2), 10.0 * i + 0.1, dtype=torch.float32) for i in range(len(items))]
        for i in range(n):
            truth[i] = truth[i] + pair_id  # differs between the two pairs
        results = []
        for owner, value in zip(owners, truth):
            results.append((owner, [value.clone() if owner.mine else torch.full_like(value, float("nan"))]))
        comm.reset_counts()
        share_results(results, dtype)
        assert dict(comm.COUNTS) == {"all_gather": 2}, (n, dict(comm.COUNTS))
        for (owner, (got,)), want in zip(results, truth):
            # every rank of a work group, the owner included, holds the values as they travel
            # through ``dtype`` (replicas stay equal); alone, nothing travels
            expected = want if dtype is None or not owner.shared else want.to(dtype).float()
            assert torch.equal(got, expected), (me, owner, got, expected)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_share_results_one_collective_per_work_group(pool4, dtype: torch.dtype | None) -> None:
    pool4.run(_share_worker, dtype)


def _share_pool2_worker() -> None:
    """Two ranks, one work group (the job): the owners' results, including the ones of ranks that
    own nothing in a call (an empty share still takes part in the collective)."""
    world = WorkGroup.of(None)
    owners = assign([(world, 1.0)])  # rank 0 owns the only item
    t = torch.arange(4.0) if owners[0].mine else torch.zeros(4)
    share_results([(owners[0], [t])])
    assert torch.equal(t, torch.arange(4.0))


def test_share_results_with_an_idle_rank(pool2) -> None:
    pool2.run(_share_pool2_worker)


def _exchange_worker(wire: torch.dtype | None) -> dict[str, int]:
    """tp=2 x dp=2 with ZeRO over dp: a matrix cut into two row boxes, a matrix whose ZeRO chunks
    need padding and a vector, each owned in the TP x DP grid. The owners receive exactly the
    boxes of the full tensors; every rank receives exactly its piece of the owners' results
    (``2 * box + 1``, rounded through ``wire``), ZeRO padding zero; one all_to_all each way."""
    from dist_optim.testing import grid_groups
    from tests.helpers.collectives import counting_collectives

    tp_group, dp_group = grid_groups(2, 2)
    tp_rank, dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)
    tp = TPSplit(0, 2, tp_rank, tp_group)

    def zero(local: int) -> ZeroShard:
        return ZeroShard(2, dp_rank, (-local) % 2, dp_group)

    layouts = [
        ParamLayout((6, 4), tp, zero(12)),
        ParamLayout((2, 3), tp, zero(3)),  # a TP slice of 3 elements: padded ZeRO chunks
        ParamLayout((7,), None, zero(7)),
    ]
    works = WorkGroups()
    works.bind(layouts, None, tp_group)
    boxes = [[((0, 3), (0, 4)), ((3, 6), (0, 4))], [((0, 2), (0, 3))], [((0, 7),)]]
    tasks = plan_tasks([(works.of(lay), lay, lay.full_shape, bx, [1.0] * len(bx)) for lay, bx in zip(layouts, boxes)])
    assert all(t.work.size == 4 for t in tasks)
    route_tasks(tasks)
    assert all(t.route is not None for t in tasks)
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(lay.full_shape, generator=gen, dtype=torch.float64) for lay in layouts]

    def through(t: torch.Tensor) -> torch.Tensor:
        return t if wire is None else t.to(wire).double()

    moved = [RoutedTensors(t, [lay.take_local(f)], torch.float64) for t, lay, f in zip(tasks, layouts, fulls)]
    with counting_collectives() as sent:
        to_owners(moved, wire)
    owned = 0
    for m, f in zip(moved, fulls):
        for i, (box,) in m.boxes.items():
            sl = tuple(slice(lo, hi) for lo, hi in m.task.boxes[i])
            assert torch.equal(box, through(f[sl])), (i, box, f[sl])
            m.results[i] = box * 2 + 1
            owned += 1
    with counting_collectives() as back:
        from_owners(moved, wire)
    for m, lay, f in zip(moved, layouts, fulls):
        want = lay.take_local(through(through(f) * 2 + 1)).reshape(-1)
        want[lay.valid_numel :] = 0
        assert m.out is not None and torch.equal(m.out, want), (m.out, want)
        assert not m.boxes and not m.results  # the owners' boxes are dropped
    return {"to": sum(sent.counts.values()), "back": sum(back.counts.values()), "owned": owned}


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_routed_exchange_moves_exactly_the_pieces(pool4, wire: torch.dtype | None) -> None:
    res = pool4.run(_exchange_worker, wire)
    assert all(r["to"] == 1 and r["back"] == 1 for r in res), res
    assert sum(r["owned"] for r in res) == 4  # every box has exactly one owner


def _replicated_worker() -> dict[str, int]:
    """DDP: every rank holds the whole tensors. Nothing travels to the owners (each uses its own
    copy); the results come back in one all_to_all to every rank."""
    from tests.helpers.collectives import counting_collectives

    layouts = [ParamLayout((4, 3)), ParamLayout((5,))]
    unbound = WorkGroups()
    assert all(unbound.of(lay) is ONE_RANK for lay in layouts)
    world = WorkGroup.of(None)
    whole = [[tuple((0, n) for n in lay.full_shape)] for lay in layouts]
    tasks = plan_tasks([(world, lay, lay.full_shape, bx, [1.0]) for lay, bx in zip(layouts, whole)])
    route_tasks(tasks)
    fulls = [torch.arange(float(math.prod(lay.full_shape))).reshape(lay.full_shape) for lay in layouts]
    moved = [RoutedTensors(t, [f], torch.float32) for t, f in zip(tasks, fulls)]
    with counting_collectives() as sent:
        to_owners(moved, None)
    for m, f in zip(moved, fulls):
        for i, (box,) in m.boxes.items():
            assert torch.equal(box, f)
            m.results[i] = -box
    with counting_collectives() as back:
        from_owners(moved, None)
    for m, f in zip(moved, fulls):
        assert m.out is not None and torch.equal(m.out, -f.reshape(-1))
    return {"to": sum(sent.counts.values()), "back": sum(back.counts.values())}


def test_replicated_tensors_are_not_sent(pool4) -> None:
    res = pool4.run(_replicated_worker)
    assert all(r == {"to": 0, "back": 1} for r in res), res
