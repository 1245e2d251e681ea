"""torch.optim's contract, for every registered optimizer (``dist_optim.registry.catalogue``) with
its default options and each configuration of the parity grid (grafting configs, schedules,
8-bit states, packing, low-bit eigenvectors): a new optimizer gets these tests by registering.

What torch's own optimizers do and ours must too: a ``copy.deepcopy`` or a pickle round trip is an
optimizer that steps exactly as the original; a state dict loads twice, loads from
``torch.load(..., weights_only=True)`` (plain data only) and with ``step`` counters saved as plain
numbers; hooks run; ``add_param_group`` works after steps; ``zero_grad`` both ways; a step with no
gradient changes nothing; a one-element tensor ``lr`` gives the float's step, also when an LR
scheduler updates it in place. Every comparison is bit for bit (the same arithmetic on the same
machine): parameters and the full optimizer state."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim.registry import catalogue
from tests.helpers.cases import PARITY_CASES, Case
from tests.helpers.check import differences
from tests.helpers.parity import full_grads, full_params, make

#: Every registered optimizer with its defaults (the planner's lr where it has no default; those that
#: need groups of their own, built by a group builder, by their parity cases), then every
#: parity-grid configuration.
CASES: dict[str, Case] = {
    **{
        f"{n}-defaults": Case(f"{n}-defaults", e.target, dict(e.plan_options))
        for n, e in catalogue().items()
        if e.param_groups is None and e.planned
    },
    **{c.id: c for c in PARITY_CASES},
}
#: Adafactor's relative step: an explicit lr (a tensor one too) is refused there.
NO_EXPLICIT_LR = {"adafactor-relative", "adafactor-noscale-warmup"}
BEFORE, AFTER = 3, 3  # steps before the copy / save, and after it (NONE_GRAD_STEP=3 is among them)


def test_every_registered_optimizer_is_here() -> None:
    assert {e.target for e in catalogue().values()} <= {c.cls for c in CASES.values()}


def _feed(params: list[torch.Tensor], step: int) -> None:
    for p, g in zip(params, full_grads(step)):
        p.grad = None if g is None else g.clone()


def _ordered(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _build(case: Case, **extra: Any) -> tuple[list[torch.Tensor], Any]:
    params = [p.clone() for p in full_params("fp32")]
    return params, make(case.cls, {**case.kwargs, **extra}, params)


def _trained(case: Case, **extra: Any) -> tuple[list[torch.Tensor], Any]:
    params, opt = _build(case, **extra)
    for step in range(BEFORE):
        _feed(params, step)
        opt.step()
    return params, opt


def _continue_both(a: Any, params: list[torch.Tensor], b: Any) -> None:
    """Step ``a`` (its parameters ``params``, in the harness's order) and ``b`` (a copy of ``a``, or
    an optimizer of the same groups) on the same gradients; then their parameters and full states
    must be identical bit for bit."""
    order = [next(i for i, q in enumerate(_ordered(a)) if q is p) for p in params]
    mirrored = [_ordered(b)[i] for i in order]
    for step in range(BEFORE, BEFORE + AFTER):
        for opt, ps in ((a, params), (b, mirrored)):
            _feed(ps, step)
            opt.step()
    bad = [f"param {i}" for i, (x, y) in enumerate(zip(params, mirrored)) if not torch.equal(x, y)]
    assert not bad, f"parameters differ: {bad}"
    assert differences(b.full_state(), a.full_state()) == []


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_a_copy_steps_as_the_original(case_id: str, how: str) -> None:
    params, opt = _trained(CASES[case_id])
    clone = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert all(p is not q for p, q in zip(_ordered(clone), _ordered(opt))), "the copy shares parameters"
    assert differences(clone.full_state(), opt.full_state()) == []
    _continue_both(opt, params, clone)


def _fresh_like(case: Case, opt: Any, **extra: Any) -> Any:
    """A new optimizer of ``case`` whose parameters hold ``opt``'s current values."""
    _, new = _build(case, **extra)
    with torch.no_grad():
        for p, q in zip(_ordered(new), _ordered(opt)):
            p.copy_(q)
    return new


@pytest.mark.parametrize("case_id", list(CASES))
def test_the_same_state_dict_loads_twice(case_id: str) -> None:
    case = CASES[case_id]
    params, opt = _trained(case)
    saved = copy.deepcopy(opt.state_dict())
    new = _fresh_like(case, opt)
    new.load_state_dict(saved)
    new.load_state_dict(saved)  # a retry, or a rollback to the same checkpoint
    _continue_both(opt, params, new)


@pytest.mark.parametrize("case_id", list(CASES))
def test_a_state_dict_is_plain_data_and_loads_with_weights_only(case_id: str) -> None:
    case = CASES[case_id]
    params, opt = _trained(case)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    new = _fresh_like(case, opt)
    new.load_state_dict(loaded)
    for a, b in zip(new.param_groups, opt.param_groups):
        assert (
            differences({k: v for k, v in a.items() if k != "params"}, {k: v for k, v in b.items() if k != "params"})
            == []
        )
    _continue_both(opt, params, new)


@pytest.mark.parametrize("case_id", list(CASES))
def test_step_counters_saved_as_numbers_load(case_id: str) -> None:
    case = CASES[case_id]
    params, opt = _trained(case)
    saved = copy.deepcopy(opt.state_dict())
    converted = 0
    for state in saved["state"].values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = float(state["step"])
            converted += 1
    assert converted, "no step counter in the state dict"
    new = _fresh_like(case, opt)
    new.load_state_dict(saved)
    _continue_both(opt, params, new)


def test_a_callable_option_is_kept_out_of_the_state_dict() -> None:
    """A user's callable (Kron's update probability) cannot be data: the state dict holds its name,
    and a load keeps the callable the loading optimizer was built with, as torch's LambdaLR does."""
    case = Case("kron-callable", dist_optim.DistributedKron, dict(lr=1e-2))

    def schedule(n: Any) -> float:
        return 1.0 if int(n) < 2 else 0.5

    params, opt = _trained(case, preconditioner_update_probability=schedule)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    new = _fresh_like(case, opt, preconditioner_update_probability=schedule)
    new.load_state_dict(loaded)
    assert new.param_groups[0]["preconditioner_update_probability"] is schedule
    _continue_both(opt, params, new)
    other = _fresh_like(case, opt, preconditioner_update_probability=0.5)
    with pytest.raises(ValueError, match=r"saved as the callable .*schedule.*build the optimizer with that callable"):
        other.load_state_dict(loaded)


@pytest.mark.parametrize("case_id", list(CASES))
def test_hooks_param_groups_zero_grad_and_empty_steps(case_id: str) -> None:
    case = CASES[case_id]
    params, opt = _trained(case)
    calls: list[str] = []
    handles = [
        opt.register_step_pre_hook(lambda *_: calls.append("pre")),
        opt.register_step_post_hook(lambda *_: calls.append("post")),
        opt.register_state_dict_post_hook(lambda *_: calls.append("state_dict")),
        opt.register_load_state_dict_pre_hook(lambda *_: calls.append("load")),
    ]
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.full_state())
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    opt.step()  # no gradient at all: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(params, before)), "a step without gradients moved parameters"
    assert differences(opt.full_state(), state) == [], "a step without gradients changed the state"
    _feed(params, BEFORE)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is None or not p.grad.any() for p in params)
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "state_dict", "load"], calls
    for h in handles:
        h.remove()
    # A new group after steps (a layer unfrozen mid-run) steps with the others.
    extra = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(5)))
    opt.add_param_group({"params": [extra]})
    start = extra.detach().clone()
    # heavyball's SOAP step seeds a parameter at its first step (alone in its group: no decay either).
    for step in range(2 if case.kwargs.get("soap_step") == "heavyball" else 1):
        _feed(params, BEFORE + 1 + step)
        extra.grad = torch.ones_like(extra)
        opt.step()
    assert not torch.equal(extra, start), "a group added after steps did not move"


@pytest.mark.parametrize("case_id", [c for c in CASES if c not in NO_EXPLICIT_LR])
def test_a_tensor_lr_steps_as_the_float(case_id: str) -> None:
    """``lr=torch.tensor(x)`` as torch takes it: the same steps as ``lr=x``, and an LR scheduler
    that updates the tensor in place (torch's do) changes the steps as it changes the float."""
    case = CASES[case_id]
    lr = case.kwargs.get("lr", 1e-3)
    pa, a = _build(case, lr=lr)
    pb, b = _build(case, lr=torch.tensor(lr, dtype=torch.float64))  # holds the float exactly
    assert isinstance(b.param_groups[0]["lr"], torch.Tensor)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (a, b)]
    for step in range(BEFORE + AFTER):
        _feed(pa, step)
        _feed(pb, step)
        a.step()
        b.step()
        for s in scheds:
            s.step()
    assert isinstance(b.param_groups[0]["lr"], torch.Tensor), "the tensor lr was replaced"
    assert float(b.param_groups[0]["lr"]) == a.param_groups[0]["lr"]
    bad = [i for i, (x, y) in enumerate(zip(pa, pb)) if not torch.equal(x, y)]
    assert not bad, f"params {bad} differ between a tensor lr and the float"
    assert differences(b.full_state(), a.full_state()) == []


@pytest.mark.parametrize("cls", sorted({e.target for e in catalogue().values()}, key=lambda c: c.__name__))
@pytest.mark.parametrize(
    "lr,match",
    [
        (torch.tensor([1e-3, 2e-3]), r"lr must be a number or a one-element floating-point tensor"),
        (torch.tensor(1), r"lr must be a number or a one-element floating-point tensor"),
        (torch.tensor(float("nan")), r"lr must be a finite number"),
        (torch.tensor(-1.0), r"lr must be a finite number"),
    ],
)
def test_a_bad_tensor_lr_is_refused_in_one_line(cls: type, lr: torch.Tensor, match: str) -> None:
    extra = {"relative_step": False} if cls is dist_optim.DistributedAdafactor else {}
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.zeros(3, 2))], lr=lr, **extra)
