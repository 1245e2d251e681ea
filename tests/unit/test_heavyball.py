"""heavyball's Muon converted by ``dist_optim.convert``, stepped beside heavyball itself.

heavyball 3.2.1 runs eagerly on this torch with ``compile_mode = None`` (its compiled step needs a
newer one). In float64 its Muon is deterministic (it rounds stochastically only below float64), so
the converted optimizer must give its parameters and momenta to float64 precision. Its learning
rate passes through a float32 tensor (``base_lr * step / step`` with an integer step tensor), so the
rates here are exact in float32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dist_optim
from dist_optim.muon.heavyball import HEAVYBALL_NS_COEFFICIENTS

heavyball = pytest.importorskip("heavyball")

#: Shapes: square, wide, tall, and a 3-D weight heavyball flattens to ``shape[0] x rest`` as we do.
SHAPES = [(12, 12), (8, 24), (20, 6), (4, 3, 5)]
STEPS = 5
NONE_AT = (2, 1)  # (step, parameter) without a gradient
LR = 2.0**-6  # exact in float32 (module docstring)


@pytest.fixture(autouse=True)
def eager_heavyball(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)


def _params(dtype: torch.dtype = torch.float64) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in SHAPES]


def _momentum(hb: Any, p: torch.Tensor) -> torch.Tensor:
    """heavyball's momentum of ``p`` (kept under a transform-indexed key of its state)."""
    (value,) = [v for k, v in hb.state[p][0].items() if "momentum" in k]
    return value


def test_converted_muon_steps_as_heavyball_in_float64() -> None:
    theirs, mine = _params(), _params()
    hb = heavyball.Muon(theirs, lr=LR, betas=(0.9, 0.99), weight_decay=0.05, storage_dtype="float64")
    ours = dist_optim.convert(
        heavyball.Muon(mine, lr=LR, betas=(0.9, 0.99), weight_decay=0.05, storage_dtype="float64")
    )
    assert isinstance(ours, dist_optim.DistributedMuon)
    gen = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        for i, (a, b) in enumerate(zip(theirs, mine)):
            g = torch.randn(a.shape, generator=gen, dtype=torch.float64)
            a.grad, b.grad = (None, None) if (step, i) == NONE_AT else (g.clone(), g.clone())
        hb.step()
        ours.step()
        for i, (a, b) in enumerate(zip(theirs, mine)):
            # float64 rounding of a few hundred operations on values of order 1
            torch.testing.assert_close(b, a, rtol=0, atol=1e-13 * a.abs().max().item(), msg=f"step {step} param {i}")
            buf, ref = ours.state[b]["momentum_buffer"], _momentum(hb, a)
            torch.testing.assert_close(buf, ref, rtol=0, atol=1e-13 * ref.abs().max().item())


def test_converted_options() -> None:
    ours = dist_optim.convert(heavyball.Muon(_params(torch.float32), lr=0.02, betas=(0.95, 0.99), weight_decay=0.1))
    (group,) = ours.param_groups
    assert group["lr"] == 0.02 and group["weight_decay"] == 0.1 and group["momentum"] == 0.95
    assert group["nesterov"] and group["nesterov_sum"] and group["momentum_ema"]
    assert [tuple(t) for t in group["ns_coefficients"]] == list(HEAVYBALL_NS_COEFFICIENTS)
    assert (group["eps"], group["eps_form"], group["adjust_lr_fn"]) == (1e-7, "max", "original")
    # heavyball iterates fp32 parameters in bfloat16 (after a stochastic rounding)
    assert group["ns_dtype"] == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs,params,match",
    [
        (dict(caution=True), None, "caution=True"),
        (dict(warmup_steps=10), None, "warmup_steps=10"),
        (dict(mars=True), None, "mars=True"),
        (dict(palm=True), None, "palm=True"),
        (dict(gradient_clipping=heavyball.utils.l2_clip_), None, "transforms"),
        (dict(heavyball_momentum=True), None, "heavyball_momentum=True"),
        (dict(nesterov=False), None, "nesterov=False"),
        (dict(storage_dtype="float64"), None, "storage_dtype='float32'"),
        ({}, [torch.nn.Parameter(torch.zeros(8))], "steps vectors with AdamW"),
        ({}, [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))], "rounds stochastically"),
    ],
    ids=[
        "caution",
        "warmup",
        "mars",
        "palm",
        "clipping",
        "heavyball-momentum",
        "no-nesterov",
        "storage",
        "vector",
        "bf16",
    ],
)
def test_what_has_no_equivalent_is_refused_by_name(kwargs: dict[str, Any], params: Any, match: str) -> None:
    hb = heavyball.Muon(params if params is not None else _params(torch.float32), **kwargs)
    with pytest.raises(ValueError, match=match) as caught:
        dist_optim.convert(hb)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "name,fix",
    [
        ("MuonAdamW", "build DistributedMuon"),
        ("Scion", "build DistributedMuon"),
        ("SOAPNAdam", "convert heavyball.SOAP or heavyball.KLSOAP"),
        ("KLShampoo", "build dist_optim.DistributedShampoo"),
        ("PSGDPRO", "convert heavyball.PSGDKron"),
    ],
)
def test_heavyballs_classes_without_an_equivalent_are_refused_not_passed_through(name: str, fix: str) -> None:
    """Passed through by a plugin they would precondition TP slices and ZeRO chunks as whole tensors."""
    with pytest.raises(ValueError, match=fix) as caught:
        dist_optim.convert(getattr(heavyball, name)(_params(torch.float32)), strict=False)
    assert "\n" not in str(caught.value) and f"heavyball.{name}" in str(caught.value)


def test_a_heavyball_muon_that_stepped_is_refused() -> None:
    params = _params()
    hb = heavyball.Muon(params, lr=LR, storage_dtype="float64")
    for p in params:
        p.grad = torch.ones_like(p)
    hb.step()
    with pytest.raises(ValueError, match="convert before the first step"):
        dist_optim.convert(hb)
