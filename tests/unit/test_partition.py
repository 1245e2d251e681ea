"""dist_optim/sharding/partition.py on its own: 1/n parts of tensors shared over process groups, their
reduce-scatter and all-gather, on a tp=2 x dp=2 grid of 4 processes.

The expected values are measured without the code under test: every rank's input is gathered
with ``torch.distributed.all_gather_object`` and summed here, and the parts are cut by ZeRO's rule
written out below (``ceil(numel / n)`` rounded up to the alignment, part ``index = r_0 s_1 + r_1``).
Inputs are small integers in float32, so every sum is exact whatever its order and the
comparisons are ``torch.equal``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

#: (numel, align): divisible by 4, needing padding, fewer elements than ranks, aligned blocks with
#: an empty last part.
SIZES = [(24, 1), (10, 1), (3, 1), (37, 4), (8, 8)]


def _expected_span(numel: int, index: int, n: int, align: int) -> tuple[int, int]:
    part = -(-numel // n)
    part = -(-part // align) * align
    lo = min(numel, index * part)
    return lo, min(numel, lo + part)


def _worker(fused: bool) -> list[str]:
    """The cases below, with the ZeRO x TP grid made and used (``fused``: one collective over the
    grid for a tensor summed over both groups) or set aside (two stages, group by group)."""
    from dist_optim import comm
    from dist_optim.sharding import partition
    from dist_optim.testing import grid_groups

    tp_group, dp_group = grid_groups(2, 2)
    comm.spanning_groups(tp_group, [dp_group])  # what a bound optimizer does; idempotent
    saved = partition.grid_of
    if not fused:
        partition.grid_of = lambda base, tp: None  # type: ignore[assignment]
    try:
        failures = _cases(tp_group, dp_group)
        failures += _collectives(tp_group, dp_group, fused)
    finally:
        partition.grid_of = saved
    return failures


def _collectives(tp_group: Any, dp_group: Any, fused: bool) -> list[str]:
    """The collectives of one tensor partitioned over (ZeRO, TP), counted at torch.distributed:
    one all-to-all and one all-gather over the 4-rank grid when fused, one per 2-rank group
    otherwise; with TP replicas the reduce-scatter sums over ZeRO alone either way."""
    from dist_optim.sharding.partition import all_gather_parts, reduce_scatter_parts
    from tests.helpers.collectives import counting_collectives

    t = torch.ones(37)
    failures = []
    for label, groups, replicas, rs_expected in [
        ("dp,tp", [dp_group, tp_group], [], 1 if fused else 2),
        ("dp + tp replicas", [dp_group], [tp_group], 1),
    ]:
        with counting_collectives() as rs:
            (part,) = reduce_scatter_parts([(t, groups, 1, replicas)])
        with counting_collectives() as ag:
            all_gather_parts([(part, groups + replicas, 37, 1)])
        ag_expected = 1 if fused else 2
        if rs.counts != {"all_to_all_single": rs_expected}:
            failures.append(f"{label} fused={fused}: reduce-scatter issued {dict(rs.counts)}")
        if ag.counts != {"all_gather_into_tensor": ag_expected}:
            failures.append(f"{label} fused={fused}: all-gather issued {dict(ag.counts)}")
    return failures


def _cases(tp_group: Any, dp_group: Any) -> list[str]:
    from dist_optim import comm
    from dist_optim.sharding.partition import all_gather_parts, partition_span, reduce_scatter_parts

    tp_rank, dp_rank = comm.group_rank(tp_group), comm.group_rank(dp_group)
    me = dist.get_rank()
    failures: list[str] = []
    gen = torch.Generator().manual_seed(100 + me)
    # Per case: the groups summed over, the replica groups (already equal), the index of this
    # rank's part and the number of parts by the rule written out.
    cases: list[tuple[str, list[Any], list[Any], int, int]] = [
        ("dp", [dp_group], [], dp_rank, 2),
        ("dp,tp", [dp_group, tp_group], [], dp_rank * 2 + tp_rank, 4),
        ("tp", [tp_group], [], tp_rank, 2),
        ("dp + tp replicas", [dp_group], [tp_group], dp_rank * 2 + tp_rank, 4),
    ]
    requests, expected, spans = [], [], []
    for label, groups, replicas, index, n in cases:
        for numel, align in SIZES:
            t = torch.randint(-8, 9, (numel,), generator=gen).float()
            if replicas:  # the same on the TP peers: the TP rank 0's values, sent by hand
                t = t if tp_rank == 0 else torch.zeros_like(t)
                got = [None] * dist.get_world_size()
                dist.all_gather_object(got, (tp_rank, dp_rank, t))
                t = next(x for r, d, x in got if r == 0 and d == dp_rank).clone()
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (tp_rank, dp_rank, t))
            summed_over = {"dp": "dp", "dp,tp": "all", "tp": "tp", "dp + tp replicas": "dp"}[label]
            total = torch.zeros(numel)
            for r, d, x in everyone:
                same_tp, same_dp = r == tp_rank, d == dp_rank
                if (summed_over == "dp" and same_tp) or (summed_over == "tp" and same_dp) or summed_over == "all":
                    total += x
            lo, hi = _expected_span(numel, index, n, align)
            span = partition_span(numel, groups + replicas, align)
            if span != (lo, hi):
                failures.append(f"{label} numel={numel} align={align}: span {span} != {(lo, hi)}")
            spans_all: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(spans_all, span)
            # the n distinct parts (TP peers of a ZeRO-only partition hold the same part) tile it
            distinct = sorted(set(spans_all))
            gaps = [a[1] != b[0] for a, b in zip(distinct, distinct[1:])]
            if distinct[0][0] != 0 or distinct[-1][1] != numel or any(gaps):
                failures.append(f"{label} numel={numel} align={align}: spans {distinct} do not tile [0, {numel})")
            requests.append((t, groups, align, replicas))
            expected.append(total)
            spans.append((label, numel, align, lo, hi))
    parts = reduce_scatter_parts(requests)
    for part, total, (label, numel, align, lo, hi) in zip(parts, expected, spans):
        if not torch.equal(part.reshape(-1)[: hi - lo], total[lo:hi]) or part.numel() < hi - lo:
            failures.append(f"{label} numel={numel} align={align}: part of the sum differs")
    # The inverse: every rank's part back to the whole sum (over the groups + replicas).
    gathered = all_gather_parts(
        [
            (part.reshape(-1)[: hi - lo], groups + replicas, numel, align)
            for part, (_, groups, replicas, _, _), (label, numel, align, lo, hi) in zip(
                parts, [c for c in cases for _ in SIZES], spans
            )
        ]
    )
    for whole, total, (label, numel, align, _, _) in zip(gathered, expected, spans):
        if not torch.equal(whole.reshape(-1)[:numel], total):
            failures.append(f"{label} numel={numel} align={align}: all_gather_parts did not restore the sum")
    return failures


@pytest.mark.parametrize("fused", [False, True], ids=["staged", "grid"])
def test_parts_tile_and_collectives_invert(pool4, fused: bool) -> None:
    """On every layout of groups (ZeRO alone, ZeRO then TP, TP alone, ZeRO with TP replicas), each
    rank's span is ZeRO's rule and the ranks' spans tile the tensor, its reduce-scattered part is
    its slice of the exact sum over the groups, and the all-gather of every rank's part gives the
    whole sum back; group by group, or in one collective over the ZeRO x TP grid, whose count is
    asserted. (Broken on purpose, a part index ignoring the earlier groups' ranks fails, and so
    does a grid used for a replica stage.)"""
    failures = [f for res in pool4.run(_worker, fused) for f in res]
    assert not failures, "\n".join(failures[:10])


def _order_worker() -> list[str]:
    """A grid is one stage only for groups given in the order of its ranks: the ZeRO group, then
    TP (grid rank ``r_dp * 2 + r_tp`` with TP innermost), not TP then ZeRO."""
    from dist_optim import comm
    from dist_optim.testing import grid_groups

    tp_group, dp_group = grid_groups(2, 2)
    (grid,) = comm.spanning_groups(tp_group, [dp_group])
    comm.spanning_groups(dp_group, [tp_group])  # the same ranks with the roles swapped: not in part order
    failures = []
    if comm.grid_of(dp_group, tp_group) is not grid:
        failures.append("no grid for (ZeRO, TP)")
    if comm.grid_of(tp_group, dp_group) is not None:
        failures.append("a grid for (TP, ZeRO), whose part index r_tp * 2 + r_dp is not its rank")
    index = comm.group_rank(dp_group) * 2 + comm.group_rank(tp_group)
    if comm.group_rank(grid) != index:
        failures.append(f"grid rank {comm.group_rank(grid)} != part index {index}")
    return failures


def test_grid_only_in_part_order(pool4) -> None:
    failures = [f for res in pool4.run(_order_worker) for f in res]
    assert not failures, "\n".join(failures[:10])
