"""dist_optim.owners: the owner mechanism for whole results (work groups, owners, sharing).

The routing half of owners.py (plan_routes, to_owners, from_owners) is tested through
work.plan_route in tests/unit/test_layout.py and by Shampoo's and Muon's distributed tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_optim import comm
from dist_optim.layout import ParamLayout, TPSplit, ZeroShard
from dist_optim.owners import ALONE, Owner, WorkGroup, assign, share_results, work_grids, work_group


def test_assign_balances_each_work_group_on_its_own() -> None:
    pair, grid = object(), object()  # stand-ins for process groups: assign only compares them
    for rank in range(2):
        wa = WorkGroup(pair, 2, rank)
        wb = WorkGroup(grid, 4, rank)
        owners = assign([(wa, 5.0), (wb, 1.0), (ALONE, 9.0), (wa, 4.0), (wb, 3.0), (wa, 1.0), (ALONE, 1.0)])
        # per work group: assign_owners over its items in their order
        assert [o.rank for o in owners] == [0, 1, 0, 1, 0, 1, 0]
        assert [o.work for o in owners] == [wa, wb, ALONE, wa, wb, wa, ALONE]
        # ALONE: this rank computes and shares nothing
        assert owners[2].mine and not owners[2].shared
        assert [o.mine for o in owners if o.work is wa] == [rank == 0, rank == 1, rank == 1]


def test_work_group_without_process_groups_is_alone() -> None:
    """Unbound, or bound with neither a data-parallel nor a TP group: no split (no collective)."""
    assert work_group(ParamLayout((4, 3)), None, None, {}) is ALONE
    assert WorkGroup.of(None) is ALONE  # the default group of a job of one process


def test_share_results_without_other_ranks_moves_nothing() -> None:
    t = torch.ones(3)
    comm.reset_counts()
    share_results([(Owner(ALONE, 0), [t])], torch.bfloat16)
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
    assert work_group(ParamLayout((5,)), None, None, {}) is ALONE
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
        items.append((ALONE, 1.0))
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
            # the owner keeps its own values; the others receive them through ``dtype``
            expected = want if dtype is None or owner.mine else want.to(dtype).float()
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
