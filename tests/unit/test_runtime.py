"""The owner runtime (dist_optim.sharding.runtime) on its own, without an optimizer.

Each tensor's work is a function of whole boxes that no piece can compute alone (every element
plus the box's sum), so a holder's result is right only if the whole box reached its owner and the
owner's result came back to the right place. The expected local results are cut from the full
result by this file's own slicing (TP chunk, then the flat ZeRO chunk with zero padding), and the
collectives are counted at torch.distributed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dist_optim.comm.chunks import chunk_span
from dist_optim.layout import ParamLayout, TPSplit, ZeroShard
from dist_optim.sharding.runtime import OwnedWork, OwnerRuntime, Transport
from dist_optim.testing import grid_groups
from tests.helpers.collectives import counting_collectives

#: (full shape, TP split dim or None, rows per box or None: one box)
TENSORS = [((8, 6), 0, 4), ((6, 5), None, 3), ((3, 4, 3), 1, None), ((5,), None, None), ((4, 8), 1, 2)]


def _f(box: torch.Tensor) -> torch.Tensor:
    return box * 2 + box.sum()


def _boxes(shape: tuple[int, ...], rows: int | None) -> list[tuple[tuple[int, int], ...]]:
    if rows is None:
        return [tuple((0, n) for n in shape)]
    return [((lo, lo + rows),) + tuple((0, n) for n in shape[1:]) for lo in range(0, shape[0], rows)]


def _expected_full(full: torch.Tensor, boxes: list[tuple[tuple[int, int], ...]]) -> torch.Tensor:
    out = torch.empty_like(full)
    for box in boxes:
        sl = tuple(slice(lo, hi) for lo, hi in box)
        out[sl] = _f(full[sl])
    return out


def _local(full: torch.Tensor, tp_dim: int | None, tp: int, tp_rank: int, dp: int, dp_rank: int, zero: bool):
    piece = full.chunk(tp, dim=tp_dim)[tp_rank] if tp_dim is not None and tp > 1 else full
    if not zero:
        return piece.clone()
    flat = piece.reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % dp))
    return flat.chunk(dp)[dp_rank].clone()


def _setup(tp: int, dp: int, zero: bool):
    tp_group, dp_group = grid_groups(tp, dp)
    tp_rank, dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)
    gen = torch.Generator().manual_seed(0)
    fulls, layouts, locals_ = [], [], []
    for shape, tp_dim, _ in TENSORS:
        full = torch.randint(-8, 8, shape, generator=gen).double()  # sums exact in any order
        dim = tp_dim if tp > 1 and tp_dim is not None else None
        split = TPSplit(dim, tp, tp_rank, tp_group) if dim is not None else None
        local_numel = math.prod(shape) // (tp if dim is not None else 1)
        shard = ZeroShard(dp, dp_rank, (-local_numel) % dp, dp_group) if zero else None
        fulls.append(full)
        layouts.append(ParamLayout(shape, split, shard))
        locals_.append(_local(full, dim, tp, tp_rank, dp, dp_rank, zero))
    return tp_group, dp_group, (tp_rank, dp_rank), fulls, layouts, locals_


def _runtime_worker(tp: int, dp: int, zero: bool, route: bool, budget: int | None, in_order: bool) -> dict:
    tp_group, dp_group, (tp_rank, dp_rank), fulls, layouts, locals_ = _setup(tp, dp, zero)
    runtime = OwnerRuntime()
    runtime.route_pieces = route
    runtime.bind(layouts, dp_group if dp > 1 else None, tp_group if tp > 1 else None)
    keys = [torch.empty(0) for _ in TENSORS]  # stand-ins for the parameters
    specs = [
        (layout, shape, _boxes(shape, rows), [1.0] * len(_boxes(shape, rows)))
        for layout, (shape, _, rows) in zip(layouts, TENSORS)
    ]
    runtime.plan(keys, specs)
    computed: list[tuple[int, int]] = []
    calls: list[list[int]] = []
    got: dict[int, torch.Tensor] = {}
    paths: dict[int, Transport] = {}

    def prepare(bucket):
        return [OwnedWork(i, runtime.tasks[keys[i]], [locals_[i]], torch.float64) for i in bucket]

    def compute(works):
        calls.append([w.entry for w in works])
        for w in works:
            for b, (box,) in w.owned.items():
                computed.append((w.entry, b))
                w.results[b] = _f(box)

    def deliver(works):
        for w in works:
            got[w.entry] = w.local().clone()
            paths[w.entry] = w.transport

    with counting_collectives() as seen:
        runtime.run(
            list(range(len(TENSORS))),
            [8 * math.prod(s) for s, _, _ in TENSORS],
            prepare,
            compute,
            deliver,
            comm_dtype=None,
            budget=budget,
            in_order=in_order,
        )
    failures = []
    for i, ((shape, tp_dim, rows), full) in enumerate(zip(TENSORS, fulls)):
        dim = tp_dim if tp > 1 and tp_dim is not None else None
        want = _local(_expected_full(full, _boxes(shape, rows)), dim, tp, tp_rank, dp, dp_rank, zero)
        have = got[i].reshape(-1) if zero else got[i].reshape(want.shape)
        if not torch.equal(have.reshape(want.shape), want):
            failures.append(f"tensor {i} ({paths[i]}): wrong local result")
    return dict(failures=failures, computed=computed, calls=calls, paths=paths, counts=dict(seen.counts))


LAYOUTS = [(2, 2, True), (1, 4, True), (4, 1, False), (2, 2, False)]


@pytest.mark.parametrize("route", [True, False])
@pytest.mark.parametrize("budget", [None, 400])
def test_every_holder_gets_its_part_of_each_owners_result(pool4, route: bool, budget: int | None) -> None:
    for tp, dp, zero in LAYOUTS:
        results = pool4.run(_runtime_worker, tp, dp, zero, route, budget, False)
        for r in results:
            assert not r["failures"], ((tp, dp, zero), r["failures"])
            want = Transport.ROUTED if route else Transport.GATHERED
            assert set(r["paths"].values()) == {want}, ((tp, dp, zero), r["paths"])
        # every box of every tensor computed by exactly one rank of the job (all work groups span it)
        computed = sorted(c for r in results for c in r["computed"])
        boxes = sorted((i, b) for i, (shape, _, rows) in enumerate(TENSORS) for b in range(len(_boxes(shape, rows))))
        assert computed == boxes, (tp, dp, zero)
        counts = results[0]["counts"]
        if route:
            assert "all_gather" not in counts and "all_gather_into_tensor" not in counts, counts
            assert counts.get("all_to_all_single", 0) >= 2, counts
        else:
            assert "all_to_all_single" not in counts, counts


def test_in_order_computes_each_bucket_once_in_order(pool4) -> None:
    for r in pool4.run(_runtime_worker, 2, 2, True, True, 400, True):
        assert not r["failures"], r["failures"]
        flat = [i for call in r["calls"] for i in call]
        assert flat == list(range(len(TENSORS))), r["calls"]
        assert len(r["calls"]) > 1  # the budget made several buckets


def _partitions_worker() -> list[str]:
    tp_group, dp_group, _, fulls, layouts, locals_ = _setup(2, 2, True)
    runtime = OwnerRuntime()
    runtime.bind(layouts, dp_group, tp_group)
    keys = [torch.empty(0) for _ in TENSORS]
    runtime.plan(keys, [(layout, shape, _boxes(shape, None), [1.0]) for layout, (shape, _, _) in zip(layouts, TENSORS)])
    got: dict[int, torch.Tensor] = {}

    def prepare(bucket):
        return [OwnedWork(i, runtime.tasks[keys[i]], [locals_[i]], torch.float64) for i in bucket]

    def compute(works):
        for w in works:
            if 0 in w.owned:
                w.outputs = [_f(w.owned[0][0])]
            lo, hi = chunk_span(w.layout.full_numel, w.task.work.size, w.task.work.rank)
            w.parts = [torch.empty(hi - lo, dtype=torch.float64)]

    def deliver(works):
        for w in works:
            assert not w.owned and not w.inputs  # the whole inputs dropped before the outputs travel
            got[w.entry] = w.parts[0]

    runtime.run(
        list(range(len(TENSORS))),
        [1] * len(TENSORS),
        prepare,
        compute,
        deliver,
        comm_dtype=None,
        budget=None,
        partitions=True,
    )
    me, size = dist.get_rank(), dist.get_world_size()
    failures = []
    for i, full in enumerate(fulls):
        lo, hi = chunk_span(full.numel(), size, me)  # the grid is the whole job, in rank order
        if not torch.equal(got[i], _f(full).reshape(-1)[lo:hi]):
            failures.append(f"tensor {i}: wrong partition")
    return failures


def test_partitions_hand_each_rank_its_part(pool4) -> None:
    for failures in pool4.run(_partitions_worker):
        assert not failures, failures


def test_unbound_work_is_alone_and_may_be_applied_by_compute() -> None:
    runtime = OwnerRuntime()
    full = torch.arange(48, dtype=torch.float64).reshape(8, 6)
    keys = [torch.empty(0), torch.empty(0)]
    boxes = _boxes((8, 6), 4)
    runtime.plan(keys, [(ParamLayout((8, 6)), (8, 6), boxes, [1.0, 1.0])] * 2)
    got: dict[int, torch.Tensor] = {}
    applied: list[int] = []

    def compute(works):
        for w in works:
            assert w.transport == Transport.HERE and sorted(w.owned) == [0, 1]
            if w.entry == 1:  # applied here: nothing comes back
                applied.append(1)
                continue
            for b, (box,) in w.owned.items():
                w.results[b] = _f(box)

    def deliver(works):
        got.update({w.entry: w.local() for w in works if w.delivered})

    runtime.run(
        [0, 1],
        [1, 1],
        lambda b: [OwnedWork(i, runtime.tasks[keys[i]], [full], full.dtype) for i in b],
        compute,
        deliver,
        comm_dtype=None,
        budget=1,
    )
    assert applied == [1] and set(got) == {0}
    assert torch.equal(got[0], _expected_full(full, boxes))
