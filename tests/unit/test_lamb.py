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
