"""The tests' own instruments (tests/helpers/collectives.py, tests/helpers/allocated.py) against
values worked out by hand, so that what they measure in other tests is known to be right."""

from __future__ import annotations

import pickle
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tests.helpers.allocated import AllocatedBytes, held_bytes
from tests.helpers.collectives import counting_collectives


def _collectives_worker() -> dict:
    me = dist.get_rank()
    real = dist.all_reduce
    objects: list = [None, None]
    obj = "x" if me == 0 else list(range(100))  # pickles of different sizes: padded to the larger
    with counting_collectives() as seen:
        dist.all_reduce(torch.ones(10))
        # through the module torch defines it in, and with keyword arguments
        c10d.all_gather_into_tensor(output_tensor=torch.empty(20), input_tensor=torch.ones(10))
        # 4 rows of 3 float32: rank 0 sends 1 row to rank 1, rank 1 sends 3 rows to rank 0
        splits = [[3, 1], [3, 1]][me]
        recv = [[3, 3], [1, 1]][me]
        dist.all_to_all_single(
            torch.empty(sum(recv), 3), torch.ones(4, 3), output_split_sizes=recv, input_split_sizes=splits
        )
        dist.all_gather_object(objects, obj)
    dist.all_reduce(torch.ones(1))  # after the block: not counted
    return dict(
        counts=dict(seen.counts),
        sent=dict(seen.sent),
        received=dict(seen.received),
        restored=dist.all_reduce is real and c10d.all_reduce is real,
        largest_pickle=max(len(pickle.dumps(o)) for o in objects),
    )


def test_counting_collectives_follows_its_conventions(pool2) -> None:
    """On 2 ranks: one call counted per collective, under its torch.distributed name, whether looked
    up on torch.distributed or distributed_c10d; bytes sent: all_reduce 2(g-1)/g of the buffer,
    all_gather_into_tensor (g-1) inputs, all_to_all_single the rows to the other rank (split sizes
    count rows), all_gather_object (g-1) x (an int64 size + the largest pickle), its two inner
    all_gathers not counted as calls of their own; received: the output buffers; nothing counted
    after the block, and the real functions restored."""
    for rank, r in enumerate(pool2.run(_collectives_worker)):
        assert r["counts"] == {
            "all_reduce": 1,
            "all_gather_into_tensor": 1,
            "all_to_all_single": 1,
            "all_gather_object": 1,
        }
        rows_to_other = [1, 3][rank]
        assert r["sent"] == {
            "all_reduce": Fraction(40),
            "all_gather_into_tensor": Fraction(40),
            "all_to_all_single": Fraction(rows_to_other * 12),
            "all_gather_object": Fraction(8 + r["largest_pickle"]),
        }, rank
        assert r["received"]["all_reduce"] == 40 and r["received"]["all_gather_into_tensor"] == 80
        assert r["received"]["all_to_all_single"] == [6, 2][rank] * 12
        assert r["received"]["all_gather_object"] == 2 * 8 + 2 * r["largest_pickle"]
        assert r["restored"]


def test_allocated_bytes_follows_storages_not_tensors() -> None:
    """Live and peak bytes of what the block allocates: a temporary counts until it is freed, a view
    keeps its storage alive after its base is deleted, in-place ops and storages from before the
    block count nothing."""
    x = torch.ones(1000)
    with AllocatedBytes() as live:
        y = x * 2  # 4000 bytes, alive after
        z = (y + 1) * 3  # two 4000-byte results, the first freed at once
        del z
        x.add_(1)
        v = (y * 1).view(10, 100)  # a 4000-byte storage kept by its view
        assert live.live == 8000
    assert live.live == 8000 and live.peak == 12000 and live.largest == 4000
    del y, v
    assert live.live == 0


def test_held_bytes_counts_each_storage_once() -> None:
    """Every tensor in nested dicts and lists counts, a storage viewed twice counts once, other
    values nothing."""
    m = torch.ones(10)
    state = {"m": m, "view": m.view(2, 5), "blocks": [torch.zeros(3), (torch.ones(2, dtype=torch.float64),)], "n": 3}
    assert held_bytes([state]) == 40 + 12 + 16
