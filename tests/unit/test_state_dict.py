"""torch's ``state_dict()`` / ``load_state_dict()`` for every optimizer of the parity grid (one case per
optimizer class and variant): a round trip resumes the same trajectory bit for bit and keeps the
skipped-step counter and every state tensor's dtype; a state dict of another optimizer, or one
without the options this optimizer needs, is refused with one line before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch

import dist_optim
from tests.helpers.cases import PARITY_CASES
from tests.helpers.check import differences
from tests.helpers.parity import full_grads, full_params, make

#: One case per (class, variant): every PARITY_CASES entry, they are tiny.
CASES = {c.id: c for c in PARITY_CASES}
STEPS_BEFORE, STEPS_AFTER = 4, 3


def _feed(params: list[torch.Tensor], step: int, poison: bool = False) -> None:
    for p, g in zip(params, full_grads(step)):
        p.grad = None if g is None else g.clone()
    if poison:
        params[0].grad[0] = float("nan")  # type: ignore[index]


def _trained(case_id: str) -> tuple[list[torch.Tensor], object]:
    case = CASES[case_id]
    params = [p.clone() for p in full_params("fp32")]
    opt = make(case.cls, {**case.kwargs, "nonfinite": "skip"}, params)
    for step in range(STEPS_BEFORE):
        _feed(params, step, poison=step == 1)  # one skipped step, counted
        opt.step()
    return params, opt


@pytest.mark.parametrize("case_id", list(CASES))
def test_round_trip_resumes_the_same_trajectory(case_id: str) -> None:
    params, opt = _trained(case_id)
    assert opt.skipped_steps == 1
    saved = copy.deepcopy(opt.state_dict())
    copies = [p.detach().clone() for p in params]
    case = CASES[case_id]
    resumed = make(case.cls, {**case.kwargs, "nonfinite": "skip"}, copies)
    resumed.load_state_dict(saved)
    assert resumed.skipped_steps == 1, "the skipped-step counter is lost through state_dict()"
    for a, b in zip(opt.param_groups, resumed.param_groups):
        for key in a:
            if key != "params":
                assert differences(b[key], a[key]) == [], f"param group option {key!r}"
    order_a = [p for g in opt.param_groups for p in g["params"]]
    order_b = [p for g in resumed.param_groups for p in g["params"]]
    for i, (pa, pb) in enumerate(zip(order_a, order_b)):
        sa, sb = opt.state.get(pa, {}), resumed.state.get(pb, {})
        assert sorted(sa) == sorted(sb), f"param {i}: state keys"
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert sb[key].dtype == sa[key].dtype, f"param {i} {key!r}: dtype {sb[key].dtype} != {sa[key].dtype}"
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        _feed(params, step)
        _feed(copies, step)
        opt.step()
        resumed.step()
    for i, (a, b) in enumerate(zip(copies, params)):
        assert torch.equal(a, b), f"{case_id}: param {i} differs after resuming from state_dict()"
    assert differences(resumed.full_state(), opt.full_state()) == []


def test_a_state_dict_of_another_optimizer_is_refused() -> None:
    _, lamb = _trained("lamb")
    params = [p.clone() for p in full_params("fp32")]
    shampoo = make(dist_optim.DistributedShampoo, CASES["shampoo-adam-eigh-blocks-pf2"].kwargs, params)
    before = copy.deepcopy(shampoo.state_dict())
    saved = lamb.state_dict()
    assert saved["dist_optim"]["optimizer"] == "DistributedLamb"
    with pytest.raises(ValueError, match=r"saved by DistributedLamb; load it into a"):
        shampoo.load_state_dict(saved)
    assert differences(shampoo.state_dict(), before) == [], "a refused state dict changed the optimizer"


def test_a_state_dict_naming_its_optimizer_by_module_path_still_loads() -> None:
    """States saved before optimizers were named by class alone carry ``module.ClassName``, whose
    module has since moved; they still load, and resume the same trajectory (another class's path
    is still refused)."""
    _, opt = _trained("lamb")
    saved = copy.deepcopy(opt.state_dict())
    saved["dist_optim"]["optimizer"] = "dist_optim.lamb.DistributedLamb"
    params = [p.clone() for p in full_params("fp32")]
    fresh = make(CASES["lamb"].cls, CASES["lamb"].kwargs, params)
    fresh.load_state_dict(saved)
    assert differences(fresh.full_state(), opt.full_state()) == []
    saved["dist_optim"]["optimizer"] = "dist_optim.came.DistributedCAME"
    with pytest.raises(ValueError, match=r"saved by dist_optim\.came\.DistributedCAME; load it into a"):
        make(CASES["lamb"].cls, CASES["lamb"].kwargs, [p.clone() for p in full_params("fp32")]).load_state_dict(saved)


def test_a_plain_torch_state_dict_without_our_options_is_refused() -> None:
    params = [p.clone() for p in full_params("fp32")]
    adamw = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)
    shampoo = make(dist_optim.DistributedShampoo, CASES["shampoo-adam-eigh-blocks-pf2"].kwargs, params)
    with pytest.raises(ValueError, match=r"param group 0 of the state dict lacks .*max_preconditioner_dim"):
        shampoo.load_state_dict(adamw.state_dict())


def test_other_groups_and_bad_options_are_refused() -> None:
    _, lamb = _trained("lamb")
    params = [p.clone() for p in full_params("fp32")]
    one_group = dist_optim.DistributedLamb(params, lr=1e-2)
    with pytest.raises(ValueError, match="has 2 param groups, this optimizer 1"):
        one_group.load_state_dict(lamb.state_dict())
    saved = lamb.state_dict()
    saved["param_groups"][0]["lr"] = -1.0
    other = make(dist_optim.DistributedLamb, CASES["lamb"].kwargs, [p.clone() for p in full_params("fp32")])
    with pytest.raises(ValueError, match="lr must be"):
        other.load_state_dict(saved)


@pytest.mark.parametrize(
    "case_id",
    [
        "adafactor-lr-beta1-wd-clip",
        "came",
        "kron",
        "galore-left-8bit",
        "lamb-8bit",
        "came-8bit",
        "kron-8bit",
        "muon-8bit",
    ],
)
def test_state_kept_wider_than_bf16_params_keeps_its_dtype(case_id: str) -> None:
    """Statistics an optimizer keeps in fp32 for bf16 parameters (factored statistics, Kron's factors,
    8-bit codes and their absmax) come back in their saved dtype, not cast to bf16 by torch's loader."""
    case = CASES[case_id]
    params = [p.bfloat16() for p in full_params("bf16")]
    opt = make(case.cls, case.kwargs, params)
    for step in range(2):
        for p, g in zip(params, full_grads(step)):
            p.grad = None if g is None else g.bfloat16()
        opt.step()
    resumed = make(case.cls, case.kwargs, [p.detach().clone() for p in params])
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    order_a = [p for g in opt.param_groups for p in g["params"]]
    order_b = [p for g in resumed.param_groups for p in g["params"]]
    wider = 0
    for i, (pa, pb) in enumerate(zip(order_a, order_b)):
        for key, value in opt.state.get(pa, {}).items():
            if isinstance(value, torch.Tensor) and key != "step":
                assert resumed.state[pb][key].dtype == value.dtype, f"param {i} {key!r}"
                assert torch.equal(resumed.state[pb][key], value), f"param {i} {key!r}"
                wider += value.dtype != torch.bfloat16
    assert wider > 0, "the case keeps no state wider than its bf16 parameters: it tests nothing"


def test_an_option_added_since_the_save_keeps_the_built_value() -> None:
    """A state dict saved by the same optimizer before an option existed (here Muon's ns_gram_space,
    removed from the saved groups) loads, the option keeping the value the optimizer was built with;
    one not saved by a dist_optim optimizer is still refused for the missing option."""
    _, opt = _trained("muon")
    saved = copy.deepcopy(opt.state_dict())
    for g in saved["param_groups"]:
        g.pop("ns_gram_space")
    params = [p.clone() for p in full_params("fp32")]
    fresh = make(CASES["muon"].cls, {**CASES["muon"].kwargs, "nonfinite": "skip"}, params)
    fresh.load_state_dict(copy.deepcopy(saved))
    assert all(g["ns_gram_space"] is False for g in fresh.param_groups)
    assert fresh.skipped_steps == 1
    saved.pop("dist_optim")
    with pytest.raises(ValueError, match="lacks ns_gram_space .not saved by a dist_optim optimizer"):
        make(CASES["muon"].cls, CASES["muon"].kwargs, [p.clone() for p in full_params("fp32")]).load_state_dict(saved)
