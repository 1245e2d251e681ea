"""DistributedLamb on one process against independent LAMB implementations, conversion, bad input."""

from __future__ import annotations

import copy

import pytest
import torch

import dist_optim
from dist_optim import DistributedLamb
from tests.helpers.check import assert_close

STEPS = 8
NONE_STEP = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3), torch.nn.LayerNorm(3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = STEPS, start: int = 0) -> None:
    """Feed seeded gradients (not a loss): the comparison then measures the optimizers' math, not
    how a model amplifies 1-ulp differences over steps."""
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, generator=gen) * (0.1 + 0.05 * step)
            if step == NONE_STEP and i == 0:
                p.grad = None  # a param that got no gradient this step
        opt.step()


def _assert_same(
    m1: torch.nn.Module, m2: torch.nn.Module, o1: torch.optim.Optimizer, o2: torch.optim.Optimizer
) -> None:
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert_close(b, a, msg=n)
        s1, s2 = o1.state[a], o2.state[b]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(s2[key], s1[key], msg=f"{n}.{key}")
        assert float(s1["step"]) == float(s2["step"])


REFERENCES = [
    ("colossalai.nn.optimizer.Lamb", dict(lr=1e-2, weight_decay=0.01, bias_correction=True), {}),
    ("colossalai.nn.optimizer.Lamb", dict(lr=1e-2, bias_correction=False), {"bias_correction": False}),
    ("colossalai.nn.optimizer.Lamb", dict(lr=1e-2, adam=True), {"adam": True, "bias_correction": False}),
    (
        "torch_optimizer.Lamb",
        dict(lr=1e-2, weight_decay=0.01, clamp_value=0.5, debias=True),
        {"clamp_value": 0.5, "bias_correction": True},
    ),
    ("torch_optimizer.Lamb", dict(lr=1e-2), {"clamp_value": 10.0, "bias_correction": False}),
]


def _make(path: str, params, kwargs):
    module, name = path.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)(params, **kwargs)


@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
@pytest.mark.parametrize("path,kwargs,ours", REFERENCES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(REFERENCES)])
def test_unbound_matches_reference(path, kwargs, ours, foreach) -> None:
    ref_model = _model()
    our_model = copy.deepcopy(ref_model)
    ref = _make(path, ref_model.parameters(), kwargs)
    mine = DistributedLamb(
        our_model.parameters(),
        lr=kwargs["lr"],
        weight_decay=kwargs.get("weight_decay", 0.0),
        eps=1e-6,
        foreach=foreach,
        **ours,
    )
    _train(ref_model, ref)
    _train(our_model, mine)
    _assert_same(ref_model, our_model, ref, mine)


@pytest.mark.parametrize("path,kwargs,ours", REFERENCES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(REFERENCES)])
def test_convert_trains_like_the_original(path, kwargs, ours) -> None:
    """Converted before and after stepping: same trajectory as the original optimizer."""
    ref_model = _model()
    our_model = copy.deepcopy(ref_model)
    ref = _make(path, ref_model.parameters(), kwargs)
    half = _make(path, our_model.parameters(), kwargs)
    _train(ref_model, ref, 3)
    _train(our_model, half, 3)
    converted = dist_optim.convert(half)  # carries the stepped state over
    assert isinstance(converted, DistributedLamb)
    for key, value in ours.items():
        assert converted.param_groups[0][key] == value
    _train(ref_model, ref, 5, start=3)
    _train(our_model, converted, 5, start=3)
    _assert_same(ref_model, our_model, ref, converted)


def test_convert_keeps_groups_and_scheduler_keys() -> None:
    model = _model()
    from colossalai.nn.optimizer import Lamb

    opt = Lamb(
        [{"params": model[0].parameters(), "lr": 0.1, "name": "first"}, {"params": model[2].parameters()}], lr=0.01
    )
    torch.optim.lr_scheduler.StepLR(opt, 1)  # adds initial_lr to every group
    new = dist_optim.convert(opt)
    assert [g["lr"] for g in new.param_groups] == [0.1, 0.01]
    assert new.param_groups[0]["name"] == "first"
    assert [g["initial_lr"] for g in new.param_groups] == [0.1, 0.01]
    assert [p for g in new.param_groups for p in g["params"]] == [p for g in opt.param_groups for p in g["params"]]
    assert dist_optim.convert(new) is new


def test_unsupported_conversions_are_refused() -> None:
    model = _model()
    with pytest.raises(TypeError, match="no dist_optim equivalent"):
        dist_optim.convert(torch.optim.SGD(model.parameters(), lr=0.1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert dist_optim.convert(sgd, strict=False) is sgd
    from colossalai.nn.optimizer import Lamb

    opt = Lamb(model.parameters(), lr=0.1)
    opt.param_groups[0]["maximize"] = True  # a hyperparameter LAMB's conversion does not know
    opt.defaults["maximize"] = False
    with pytest.raises(ValueError, match="maximize"):
        dist_optim.convert(opt)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
        (dict(betas=(0.9, -0.1)), r"betas\[1\]"),
        (dict(betas=(0.9,)), "betas"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(clamp_value=-1.0), "clamp_value"),
    ],
)
def test_bad_hyperparameters(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedLamb(_model().parameters(), **kwargs)


def test_bad_group_hyperparameters() -> None:
    opt = DistributedLamb(_model()[0].parameters())
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": _model()[2].parameters(), "lr": -1})


def test_sparse_gradients_are_refused() -> None:
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = DistributedLamb(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()


def test_zero_norms_give_trust_ratio_one() -> None:
    w = torch.nn.Parameter(torch.zeros(4))
    opt = DistributedLamb([w], lr=0.1, bias_correction=False)
    w.grad = torch.ones(4)
    opt.step()
    # ||w|| = 0 -> ratio 1: plain Adam-form step m/(sqrt(v)+eps) = 0.1/(0.0316+1e-6)
    expected = -0.1 * (0.1 / (0.001**0.5 + 1e-6))
    torch.testing.assert_close(w.detach(), torch.full((4,), expected))


# ---- the step-memory budget (bucket_bytes) ---------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "256"])
def test_bad_bucket_bytes(value) -> None:
    with pytest.raises(ValueError, match=rf"bucket_bytes={value!r}") as info:
        DistributedLamb(_model().parameters(), bucket_bytes=value)
    assert "\n" not in str(info.value)


#: (full shape, TP dim or None) of the bucketed test's parameters, in two param groups.
BUCKET_SHAPES = [((8, 6), 0), ((6, 10), 1), ((7,), None), ((40, 6), 0), ((3, 4, 2), 1), ((5,), None)]


def _bucket_worker(budgets: list[int | None], foreach: bool) -> list[tuple[list[torch.Tensor], int, int, int]]:
    """tp=2 x zero=2, fp32: train the same parameters under each budget (a None gradient at step
    2); per budget, every parameter and state tensor after the steps, the all-reduces of the last
    step (counted at torch.distributed), the number of buckets and the process groups summed over
    per bucket (a TP-replicated vector's bucket: its ZeRO group only)."""
    from dist_optim.sharding.budget import buckets
    from dist_optim.testing import grid_groups, tp_zero_chunks
    from tests.helpers.collectives import counting_collectives

    tp_group, dp_group = grid_groups(2, 2)
    out = []
    for budget in budgets:
        gen = torch.Generator().manual_seed(3)
        fulls = [torch.randn(shape, generator=gen) for shape, _ in BUCKET_SHAPES]
        params, layouts = tp_zero_chunks(fulls, [dim for _, dim in BUCKET_SHAPES], tp_group, dp_group)
        groups = [{"params": params[:3]}, {"params": params[3:], "lr": 3e-2, "weight_decay": 0.1}]
        opt = DistributedLamb(groups, lr=1e-2, foreach=foreach, bucket_bytes=budget)
        opt.bind(layouts, dp_group=dp_group)
        for step in range(4):
            for i, p in enumerate(params):
                p.grad = None if (step == 2 and i == 1) else torch.randn(p.shape, generator=gen)
            if step == 3:
                with counting_collectives() as seen:
                    opt.step()
            else:
                opt.step()
        tensors = [t.clone() for p in params for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
        spans = list(buckets([p.numel() * p.element_size() for p in params], budget))
        groups_per_bucket = sum(len({id(g) for p in params[a:b] for g in layouts[p].sum_groups}) for a, b in spans)
        out.append((tensors, seen.counts["all_reduce"], len(spans), groups_per_bucket))
        assert set(seen.counts) == {"all_reduce"}, dict(seen.counts)
    return out


@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
def test_buckets_are_bit_identical_and_count_collectives(pool4, foreach: bool) -> None:
    """Any bucket_bytes gives the same parameters and state, bit for bit, as one bucket (None), on
    a tp=2 x zero=2 layout in fp32; budgets smaller than one parameter (each its own bucket), a few
    parameters, everything. The collectives of a step: the NaN/Inf flag's all-reduce, then one
    all-reduce per process group (ZeRO, TP) per bucket, whatever the parameters in it."""
    budgets = [None, 4, 100, 256, 10**9]  # the largest chunk is 240 bytes (40 x 6 / 4 ranks, fp32)
    for rank in pool4.run(_bucket_worker, budgets, foreach):
        reference = rank[0][0]
        counts = [(n, per_bucket, count) for _, count, n, per_bucket in rank]
        assert [n for n, _, _ in counts] == [1, 6, 4, 3, 1], counts
        for budget, (tensors, count, _, per_bucket) in zip(budgets, rank):
            assert count == 1 + per_bucket, (budget, counts)
            assert all(torch.equal(a, b) for a, b in zip(tensors, reference)), budget
        # One bucket: ZeRO and TP once; one parameter per bucket: 4 TP-split (2 each) + 2 vectors (1).
        assert [c[1] for c in counts] == [2, 10, 8, 6, 2], counts
