"""Collectives: correctness and a constant number per step, whatever the number of params. The
worker functions run on every rank of the session's process pool (dist_optim/testing/pools.py)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_optim
from dist_optim import ParamLayout, TPSplit, ZeroShard, comm
from dist_optim.sharding.placement import assign_owners
from dist_optim.testing import grid_groups


# ---- workers (every rank) ----------------------------------------------------------------------
def _layouts(n: int, tp: int, dp: int, zero: bool) -> tuple[list[ParamLayout], list[torch.Tensor]]:
    tg, dg = grid_groups(tp, dp)
    shapes = [((4 * (i % 3 + 1), 6), 0 if i % 2 == 0 else -1) for i in range(n)] + [((5,), None)]
    layouts, fulls = [], []
    for i, (shape, dim) in enumerate(shapes):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        split = TPSplit(dim, tp, dist.get_rank(tg), tg) if dim is not None else None
        lay = ParamLayout(shape, split)
        zs = ZeroShard(dp, dist.get_rank(dg), (-lay.local_numel) % dp, dg) if zero else None
        layouts.append(ParamLayout(shape, split, zs))
        fulls.append(full)
    return layouts, fulls


def gather_and_sum(n: int) -> dict[str, Any]:
    layouts, fulls = _layouts(n, 2, 2, True)
    pieces = [lay.take_local(f) for lay, f in zip(layouts, fulls)]
    comm.reset_counts()
    gathered = comm.gather_full(list(zip(layouts, pieces)))
    gathers = comm.COUNTS["all_gather"]
    for i, (g, f) in enumerate(zip(gathered, fulls)):
        assert torch.equal(g, f), f"gather_full: tensor {i} differs from the full tensor"
    comm.reset_counts()
    bucket = comm.SumBucket()
    sums = [bucket.add(p.square().sum().reshape(1), lay.sum_groups) for lay, p in zip(layouts, pieces)]
    bucket.flush()
    reduces = comm.COUNTS["all_reduce"]
    for i, (s, f) in enumerate(zip(sums, fulls)):
        torch.testing.assert_close(s, f.square().sum().reshape(1), msg=f"SumBucket: tensor {i}'s sum")
    # bf16 communication keeps the result dtype
    half = comm.gather_full(list(zip(layouts, pieces)), dtype=torch.bfloat16)
    for i, (h, f) in enumerate(zip(half, fulls)):
        assert h.dtype == torch.float32, f"gather_full(dtype=bf16): tensor {i} came back as {h.dtype}"
        torch.testing.assert_close(h, f, rtol=1e-2, atol=1e-2)
    return dict(gathers=gathers, reduces=reduces)


def share_and_broadcast() -> dict[str, Any]:
    _, dg = grid_groups(1, 4)
    rank = dist.get_rank(dg)
    shapes = [(3, 3), (5,), (2, 4), (1,), (4, 4), (2,)]
    owners = assign_owners([torch.Size(s).numel() ** 1.5 for s in shapes], 4)
    tensors = [torch.full(s, float(o if o == rank else -1)) for s, o in zip(shapes, owners)]
    comm.reset_counts()
    comm.share_owned(tensors, owners, dg)
    for i, (t, o) in enumerate(zip(tensors, owners)):
        assert torch.equal(t, torch.full(t.shape, float(o))), f"share_owned: tensor {i} is not its owner's ({o})"
    shared = comm.COUNTS["all_gather"]
    b = [torch.full((2,), float(rank)), torch.full((3,), float(rank))]
    comm.broadcast_from(b, 2, dg)
    for t in b:
        assert torch.equal(t, torch.full(t.shape, 2.0)), f"broadcast_from rank 2: got {t}"
    return dict(shared=shared)


def exchange_pieces() -> dict[str, Any]:
    """comm.exchange over the 4 ranks: rank s sends rank r pieces of uneven sizes (none at all
    from rank 3 to odd ranks, nothing to rank 0 from anyone but itself), written into strided
    views on arrival; with bf16 the values arrive rounded, the rank's pieces to itself too."""
    world = dist.group.WORLD
    me = dist.get_rank()

    def value(src: int, dst: int, k: int, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32) / 3 + 100 * src + 10 * dst + k

    def sizes(src: int, dst: int) -> list[int]:
        if (src == 3 and dst % 2) or (dst == 0 and src != 0):
            return []
        return [src + dst + 1, 2 * src + 1]

    from tests.helpers.collectives import counting_collectives

    out: dict[str, Any] = {}
    for rounds in (1, 2, 3, 4, 9):
        for dtype in (torch.float32, torch.bfloat16):
            send = [[value(me, r, k, n) for k, n in enumerate(sizes(me, r))] for r in range(4)]
            targets = [[torch.zeros(n, 2)[:, 1] for n in sizes(s, me)] for s in range(4)]  # strided views
            with counting_collectives() as seen:
                comm.exchange(send, targets, world, dtype, torch.device("cpu"), rounds=rounds)
            out[f"{dtype} rounds={rounds}"] = all(
                torch.equal(t, value(s, me, k, t.numel()).to(dtype).float())
                for s in range(4)
                for k, t in enumerate(targets[s])
            )
            out[f"count rounds={rounds}"] = dict(seen.counts)
    return out


def grids() -> dict[str, Any]:
    """comm.spanning_groups on a 2 x 2 mesh: the TP x DP grid is the world; a group paired with itself
    (not orthogonal) or with a world-sized base (larger than the grid) gets None."""
    tg, dg = grid_groups(2, 2)
    made = comm.spanning_groups(tg, [dg, tg, dist.group.WORLD])
    again = comm.spanning_groups(tg, [dg])  # cached: no second group for the same ranks
    return dict(
        grid=None if made[0] is None else dist.get_process_group_ranks(made[0]),
        self_pair=made[1],
        world_base=made[2],
        same=again[0] is made[0],
    )


def lamb_collectives(n: int) -> int:
    """Collectives issued by one bound DistributedLamb step at tp=2 x dp=2 with ZeRO."""
    layouts, fulls = _layouts(n, 2, 2, True)
    params = [lay.take_local(f) for lay, f in zip(layouts, fulls)]
    opt = dist_optim.DistributedLamb(params, lr=0.1)
    opt.bind(dict(zip(params, layouts)))
    for p in params:
        p.grad = torch.ones_like(p)
    comm.reset_counts()
    opt.step()
    return sum(comm.COUNTS.values())


# ---- tests ---------------------------------------------------------------------------------------
def test_gather_and_bucketed_sums(pool4) -> None:
    small = pool4.run(gather_and_sum, 3)
    large = pool4.run(gather_and_sum, 30)
    # one collective per group (ZeRO group, TP group), independent of the number of params
    assert {r["gathers"] for r in small + large} == {2}
    assert {r["reduces"] for r in small + large} == {2}


def test_share_owned_and_broadcast(pool4) -> None:
    for res in pool4.run(share_and_broadcast):
        assert res["shared"] == 1


def test_lamb_collectives_per_step_are_constant(pool4) -> None:
    few = pool4.run(lamb_collectives, 4)
    many = pool4.run(lamb_collectives, 40)
    # one all-reduce per group (ZeRO, TP) per step, plus the NaN/Inf check's flag over the job
    assert set(few) == set(many) == {3}


def test_spanning_groups(pool4) -> None:
    for res in pool4.run(grids):
        assert res["grid"] == [0, 1, 2, 3], res
        assert res["self_pair"] is None and res["world_base"] is None, res
        assert res["same"], res


def test_exchange_moves_uneven_pieces(pool4) -> None:
    """The same pieces arrive whether in one all_to_all or in rounds (at most one per rank of the
    group: 9 asks for more than the 4 ranks have), counted at torch.distributed."""
    for res in pool4.run(exchange_pieces):
        for rounds in (1, 2, 3, 4, 9):
            assert res[f"torch.float32 rounds={rounds}"] and res[f"torch.bfloat16 rounds={rounds}"], (rounds, res)
            assert res[f"count rounds={rounds}"] == {"all_to_all_single": min(rounds, 4)}, (rounds, res)


@pytest.mark.parametrize("size", [1, 2, 4, 7, 64])
def test_exchange_rounds_split_the_pairs(size: int) -> None:
    """Every (source, target) pair moves in exactly one round; both ends compute the same one; with
    as many rounds as ranks, each rank sends to one rank per round (and so holds 1/size of an
    owner's pieces to all); rounds hold consecutive offsets of about size/rounds targets each."""
    from dist_optim.comm.chunks import exchange_round

    for rounds in range(1, size + 1):
        per_round = collections.Counter()
        for source in range(size):
            for target in range(size):
                k = exchange_round(source, target, size, rounds)
                assert 0 <= k < rounds
                per_round[(source, k)] += 1
        for source in range(size):
            counts = [per_round[(source, k)] for k in range(rounds)]
            assert sum(counts) == size and max(counts) - min(counts) <= 1, (size, rounds, counts)


def test_exchange_rounds_from_bytes() -> None:
    from dist_optim.sharding.budget import exchange_rounds

    assert exchange_rounds(10, None) == 1 and exchange_rounds(10, 10) == 1 and exchange_rounds(11, 10) == 2
    assert exchange_rounds(1_048_576_000, 256 * 2**20) == 4  # Kron's 70B embedding direction, fp32


def reduce_scatter_reused_buffers() -> list[str]:
    """comm.reduce_scatter of tensors of more than a MiB (its send and receive buffers then kept
    and reused on the CPU, chunks.scratch) and of small ones: each rank's chunk is the exact sum
    (small integers in fp32), and a result stays what it was after the next call reuses the buffers."""
    world = dist.group.WORLD
    me = dist.get_rank()

    def tensors(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(-8, 8, (n,), generator=g).float() for n in (2**19 + 3, 1000, 5)]

    failures = []
    kept = None
    for call in range(3):
        mine = tensors(100 * call + me)
        total = [sum(ts) for ts in zip(*(tensors(100 * call + r) for r in range(4)))]
        got = comm.reduce_scatter(mine, world)
        for i, (part, whole) in enumerate(zip(got, total)):
            w = -(-whole.numel() // 4)
            if not torch.equal(part, whole[me * w : (me + 1) * w]):
                failures.append(f"call {call}: tensor {i}'s chunk is not the sum")
        if kept is not None and not torch.equal(kept[0], kept[1]):
            failures.append(f"call {call}: the previous call's result changed")
        kept = (got[0], got[0].clone())
    return failures


def test_reduce_scatter_with_reused_buffers(pool4) -> None:
    """(Broken on purpose, a result that is a view of the reused receive buffer fails.)"""
    failures = [f for res in pool4.run(reduce_scatter_reused_buffers) for f in res]
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("rows", [1, 3])
def test_pack_and_unpack_chunks(rows: int) -> None:
    """chunks.pack_chunks puts chunk r of each tensor in row r, zeros past a tensor's end whatever
    the buffer held (rows that hold nothing, a chunk cut short, a tensor of no elements), and
    chunks.unpack_chunks gives each tensor back whole, in a buffer of its own when there are rows."""
    from dist_optim.comm.chunks import chunk_numel, pack_chunks, unpack_chunks

    flats = [torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate((12, 7, 1, 0, 9))]
    widths = [chunk_numel(f.numel(), rows, 2) for f in flats] if rows > 1 else [f.numel() + 3 for f in flats]
    out = torch.full((rows, sum(widths)), float("nan"))
    pack_chunks(flats, widths, out)
    offset = 0
    for f, w in zip(flats, widths):
        padded = torch.zeros(rows * w)
        padded[: f.numel()] = f
        assert torch.equal(out[:, offset : offset + w], padded.view(rows, w)), (f, w)
        offset += w
    back = unpack_chunks(out, [f.numel() for f in flats], widths)
    assert all(torch.equal(b, f) for b, f in zip(back, flats))
    if rows > 1:
        storages = {b.untyped_storage().data_ptr() for b in back if b.numel()}
        assert len(storages) == sum(1 for b in back if b.numel()), "results share a buffer"


def test_scratch_is_reused_on_the_cpu_from_a_mib() -> None:
    from dist_optim.comm.chunks import SCRATCH_MIN_BYTES, scratch

    cpu = torch.device("cpu")
    big = SCRATCH_MIN_BYTES // 4
    a = scratch("test", big + 10, torch.float32, cpu)
    b = scratch("test", big, torch.float32, cpu)
    assert a.numel() == big + 10 and b.numel() == big and a.data_ptr() == b.data_ptr()
    c = scratch("test", 2 * big, torch.float32, cpu)  # grown: a new one, kept from then on
    assert c.numel() == 2 * big and scratch("test", big, torch.float32, cpu).data_ptr() == c.data_ptr()
    small = scratch("test", 100, torch.float32, cpu)
    assert small.data_ptr() != c.data_ptr(), "a buffer under SCRATCH_MIN_BYTES is new"
    meta = scratch("test", big, torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and meta.numel() == big
