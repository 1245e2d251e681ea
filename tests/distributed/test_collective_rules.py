"""NCCL's rules on the collectives dist_optim issues (dist_optim/comm/rules.py), on CPU processes.

The suite runs with ``DIST_OPTIM_COLLECTIVE_RULES=nccl`` (tests/conftest.py): every gloo group is
treated as an NCCL group on a simulated accelerator. Here each refusal NCCL would make is provoked
and must be refused, on every rank, with a one-line error naming what differs; and an optimizer
whose masters live in host memory (ZeRO's ``cpu_offload``) must step exactly as without the rules
while staging every collective through the group's device, and must fail with the staging removed
(what ColossalAI's own optimizers do on NCCL, hpcaitech/ColossalAI#6400).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist


def _refusal(fn: Any) -> str:
    """The rule error ``fn()`` raises, or "" if it raises none."""
    from dist_optim.comm.rules import CollectiveRuleError

    try:
        fn()
    except CollectiveRuleError as e:
        return str(e)
    return ""


def refusals() -> dict[str, str]:
    """Every rank runs each mismatch (a different per-rank input) and reports the error it got."""
    from dist_optim import comm
    from dist_optim.comm import rules

    assert rules.MODE == "nccl", rules.MODE
    me, group = dist.get_rank(), None
    out: dict[str, str] = {}

    def sizes() -> None:
        bucket = comm.SumBucket()
        bucket.add(torch.ones(3 + me), [group])
        bucket.flush()

    def dtypes() -> None:
        bucket = comm.SumBucket()
        bucket.add(torch.ones(3, dtype=torch.float64 if me == 1 else torch.float32), [group])
        bucket.flush()

    def splits() -> None:
        # rank 0 sends 2 elements to rank 1, which expects 3
        send = [[torch.ones(1)], [torch.ones(2 if me == 0 else 1)]] + [[] for _ in range(dist.get_world_size() - 2)]
        recv = [[torch.empty(3 if me == 1 else 1)], [torch.empty(1)]] + [[] for _ in range(dist.get_world_size() - 2)]
        comm.exchange(send, recv, group, torch.float32, torch.device("cpu"))

    def order() -> None:
        if me == 0:
            comm.gather_full([(_replicated_chunk(), torch.ones(2))])
        else:
            bucket = comm.SumBucket()
            bucket.add(torch.ones(4), [group])
            bucket.flush()

    def host_tensor() -> None:
        saved = rules.STAGE
        rules.STAGE = False  # what the staging prevents: a host tensor handed to the collective
        try:
            bucket = comm.SumBucket()
            bucket.add(torch.ones(4), [group])
            bucket.flush()
        finally:
            rules.STAGE = saved

    for name, fn in [("sizes", sizes), ("dtypes", dtypes), ("splits", splits), ("order", order)]:
        out[name] = _refusal(fn)
    out["host"] = _refusal(host_tensor)
    out["non_contiguous"] = _refusal(
        lambda: rules.check("all_reduce", group, [torch.ones(3, 4).t()], [torch.ones(3, 4).t()])
    )
    # the same collectives, matching on every rank: no refusal, staged both ways
    rules.reset_staged()
    bucket = comm.SumBucket()
    t = bucket.add(torch.full((5,), float(me)), [group])
    bucket.flush()
    out["sum_ok"] = str(t.tolist())
    out["staged"] = str(dict(rules.STAGED))
    return out


def _replicated_chunk() -> Any:
    """A layout whose gather_full is one all_gather over the world (ZeRO chunks of 2 elements)."""
    from dist_optim import ParamLayout, ZeroShard

    n = dist.get_world_size()
    return ParamLayout((2 * n,), None, ZeroShard(n, dist.get_rank(), 0, None))


def test_refused_as_nccl_would(pool2) -> None:
    results = pool2.run(refusals)
    for rank, out in enumerate(results):
        assert "sizes differ across ranks (3, 4 elements, by rank)" in out["sizes"], (rank, out["sizes"])
        assert "dtypes differ across ranks (torch.float32, torch.float64, by rank)" in out["dtypes"], out["dtypes"]
        assert "rank 0 sends 2 elements to rank 1, which expects 3" in out["splits"], (rank, out["splits"])
        assert "the ranks issue different collectives (all_gather, all_reduce, by rank)" in out["order"], out["order"]
        host = "a cpu tensor ((4,), torch.float32) on a group that communicates from a simulated accelerator"
        assert host in out["host"], out["host"]
        assert "non-contiguous" in out["non_contiguous"], out["non_contiguous"]
        for name in ("sizes", "dtypes", "splits", "order", "host", "non_contiguous"):
            assert "\n" not in out[name] and "group of ranks (0, 1)" in out[name], (name, out[name])
        assert out["sum_ok"] == str([1.0] * 5), out["sum_ok"]
        # the 5 fp32 elements went to the (simulated) device and back
        assert out["staged"] == str({"in": 20, "out": 20}), out["staged"]


def offloaded_lamb(stage: bool) -> dict[str, Any]:
    """DistributedLamb on ZeRO chunks over the world, masters in host memory as ZeRO's cpu_offload
    keeps them, 3 steps (the second without a gradient for one parameter): the error the step
    raises, or the chunks and the bytes staged."""
    from dist_optim import DistributedLamb
    from dist_optim.comm import rules
    from dist_optim.testing import zero_chunks

    shapes = [(6, 5), (6, 5), (7,)]  # two matrices and a vector that needs padding over 2 ranks
    fulls = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    chunks, layouts = zero_chunks(fulls, None)
    params = [torch.nn.Parameter(c.clone()) for c in chunks]
    opt = DistributedLamb(params, lr=0.01)
    opt.bind({p: layouts[c] for p, c in zip(params, chunks)})
    saved, rules.STAGE = rules.STAGE, stage
    rules.reset_staged()
    try:
        for step in range(3):
            for i, p in enumerate(params):
                g = torch.randn(fulls[i].shape, generator=torch.Generator().manual_seed(100 * step + i))
                p.grad = None if (step == 1 and i == 0) else layouts[chunks[i]].take_local(g).clone()
            opt.step()
    except rules.CollectiveRuleError as e:
        return dict(error=str(e))
    finally:
        rules.STAGE = saved
    return dict(error="", params=[p.detach().clone() for p in params], staged=dict(rules.STAGED))


def test_offloaded_masters_are_staged_and_fail_without(pool2) -> None:
    """With staging: the same chunks as the rules switched off would give (the single-device
    parity of DistributedLamb is test_parity's), every collective staged. Without: refused at the
    first collective of the step, the NaN/Inf check's all-reduce."""
    staged = pool2.run(offloaded_lamb, True)
    plain = pool2.run(_without_rules)
    for rank, (a, b) in enumerate(zip(staged, plain)):
        assert not a["error"], a["error"]
        for i, (x, y) in enumerate(zip(a["params"], b["params"])):
            assert torch.equal(x, y), f"rank {rank} parameter {i}: staging changed the result"
        assert a["staged"]["in"] > 0 and a["staged"]["out"] > 0, a["staged"]
    unstaged = pool2.run(offloaded_lamb, False)
    for out in unstaged:
        assert out["error"].startswith("all_reduce on the group of ranks (0, 1): a cpu tensor"), out["error"]


def _without_rules() -> dict[str, Any]:
    from dist_optim.comm import rules

    saved, rules.MODE = rules.MODE, ""
    try:
        return offloaded_lamb(True)
    finally:
        rules.MODE = saved


@pytest.mark.parametrize(
    "backend,expected",
    [("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", None), ("gloo", None), ("mpi", None)],
)
def test_group_device(monkeypatch, backend: str, expected: str | None) -> None:
    """The device a group communicates from, read from its backend (without the simulation)."""
    from dist_optim.comm import rules

    monkeypatch.setattr(rules, "MODE", "")
    monkeypatch.setattr(rules.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    got = rules.group_device(None)
    assert (str(got) if got is not None else None) == expected
