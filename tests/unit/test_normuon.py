"""DistributedNorMuon on one process: against the float64 reference written from the paper
(tests/helpers/muon_reference.py) and against the authors' released ``normuon.py`` (transcribed
below, its iteration in the parameter's dtype), the conversions from the authors' four classes,
the neuron state's full form, bad input. The parity grid and booster columns are in
tests/helpers/cases.py."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim import DistributedMuon, DistributedNorMuon
from tests.helpers.check import assert_close
from tests.helpers.modules import module_of
from tests.helpers.muon_reference import DEFAULTS, MuonReference

STEPS = 12
NONE_STEP = 5
#: Both sides compute in float64. Measured, the smallest rtol that passes: 1.7e-15 against the
#: reference, 1.1e-15 against the authors' code (the same with OMP_NUM_THREADS=1): 1e-12 leaves a
#: margin of 580x. beta2 raised by 1e-4 inside the optimizer (a scratch edit) measured 1.9e7x this
#: tolerance or more.
FLOAT64_RTOL = 1e-12
KEY = "neuron_second_moment"


def make_params() -> list[torch.nn.Parameter]:
    """A tall, a wide, a conv weight (6 x 12 as Muon sees it), a square; then AdamW's vector and
    matrix."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 5), (4, 9), (6, 3, 2, 2), (5, 5), (7,), (10, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64) * 0.3) for s in shapes]


def feed(params: list[torch.nn.Parameter], step: int, none_step: int | None = NONE_STEP) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * (0.1 + 0.05 * step)
        if step == none_step and i in (1, 4):
            p.grad = None


def groups(params: list[torch.nn.Parameter], muon: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"params": params[:4], **muon},
        {"params": params[4:], "use_muon": False, "lr": 3e-3, "weight_decay": 0.05},
    ]


CONFIGS = {
    "defaults": dict(),
    "ema-add-rms": dict(momentum_ema=True, eps_form="add", adjust_lr_fn="match_rms_adamw", beta2=0.9),
    "stacked-no-nesterov": dict(stacked=True, nesterov=False, beta2=0.99, normalization_eps=1e-8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_float64_reference(name: str) -> None:
    """12 steps in float64 against the reference written from the paper's statement: both
    Nesterov settings, both lr adjustments, a conv weight whole and as a stack of matrices (each
    with its own rows' second moment), AdamW groups, None gradients; parameters and state
    element-wise at FLOAT64_RTOL."""
    opts = CONFIGS[name]
    ours_params, ref_params = make_params(), make_params()
    opt = DistributedNorMuon(groups(ours_params, opts), lr=2e-2, weight_decay=0.01)
    normuon = dict(beta2=0.95, normalization_eps=1e-10)
    ref_groups = [
        {**DEFAULTS, "use_muon": True, **normuon, "lr": 2e-2, "weight_decay": 0.01, **g}
        for g in groups(ref_params, opts)
    ]
    ref_groups[1] = {k: v for k, v in ref_groups[1].items() if k not in normuon}  # the AdamW group
    ref = MuonReference(ref_groups)
    for step in range(STEPS):
        feed(ours_params, step)
        feed(ref_params, step)
        opt.step()
        ref.step()
    for i, (a, b) in enumerate(zip(ours_params, ref_params)):
        assert_close(a.detach(), b.detach(), rtol=FLOAT64_RTOL, msg=f"{name} param {i}")
        for key, value in ref.state[id(b)].items():
            if isinstance(value, torch.Tensor):
                assert_close(opt.state[a][key], value, rtol=FLOAT64_RTOL, msg=f"{name} param {i} {key}")
    stacked = opts.get("stacked", False)
    assert opt.state[ours_params[2]][KEY].shape == ((6, 3) if stacked else (6,))
    assert all(not torch.equal(a.detach(), b) for a, b in zip(ours_params, make_params()))


def test_normalization_changes_muons_step() -> None:
    """The same run under DistributedMuon differs (the comparison above is not Muon's own)."""
    a, b = make_params(), make_params()
    nor, muon = DistributedNorMuon(groups(a, {}), lr=2e-2), DistributedMuon(groups(b, {}), lr=2e-2)
    for step in range(3):
        feed(a, step)
        feed(b, step)
        nor.step()
        muon.step()
    rel = (a[0] - b[0]).norm() / (b[0] - make_params()[0]).norm()
    assert float(rel) > 0.05, float(rel)


# ---- the authors' normuon.py (github.com/zichongli5/NorMuon), transcribed ---------------------------------
def _authors_update(grad: torch.Tensor, momentum: torch.Tensor, v: torch.Tensor, beta: float, beta2: float) -> Any:
    """Their ``normuon_update`` (nesterov, 5 iterations of KellerJordan's, 1e-7 added), the
    iteration in the parameter's dtype instead of bfloat16."""
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta)
    x = update
    if x.size(-2) > x.size(-1):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        a_mat = x @ x.mT
        b_mat = -4.7750 * a_mat + 2.0315 * a_mat @ a_mat
        x = 3.4445 * x + b_mat @ x
    if update.size(-2) > update.size(-1):
        x = x.mT
    update = x
    vnorm = update.norm(dim=(-2, -1), keepdim=True)
    v_mean = torch.mean(update * update, dim=-1, keepdim=True)
    v.lerp_(v_mean, 1 - beta2)
    step_size = 1 / v.sqrt().add_(1e-10)
    update.mul_(step_size)
    vnorm_new = update.norm(dim=(-2, -1), keepdim=True)
    update.mul_(vnorm / (vnorm_new.add_(1e-10)))
    return update * max(1, grad.size(-2) / grad.size(-1)) ** 0.5


def _authors_adam(grad: torch.Tensor, st: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
    if not st:
        st.update(exp_avg=torch.zeros_like(grad), exp_avg_sq=torch.zeros_like(grad), step=0)
    st["step"] += 1
    b1, b2 = group["betas"]
    st["exp_avg"].lerp_(grad, 1 - b1)
    st["exp_avg_sq"].lerp_(grad.square(), 1 - b2)
    return (st["exp_avg"] / (1 - b1 ** st["step"])) / (
        (st["exp_avg_sq"] / (1 - b2 ** st["step"])).sqrt() + group["eps"]
    )


def _authors_module() -> types.ModuleType:
    """The ``normuon`` module's four classes: constructors (group defaults filled, keys asserted
    as theirs) and the single-device steps (a parameter without a gradient skipped, where theirs
    steps it with zeros: ours skips it, as Muon's)."""

    class NorMuon(torch.optim.Optimizer):
        def __init__(
            self, params: Any, lr: float = 0.02, weight_decay: float = 0, momentum: float = 0.95, beta2: float = 0.95
        ) -> None:
            super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, beta2=beta2))

        @torch.no_grad()
        def step(self) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if "use_muon" not in group or group["use_muon"]:
                        if not st:
                            st["momentum_buffer"] = torch.zeros_like(p)
                            st["second_momentum_buffer"] = torch.zeros_like(p[..., 0:1])
                        update = _authors_update(
                            p.grad,
                            st["momentum_buffer"],
                            st["second_momentum_buffer"],
                            group["momentum"],
                            group["beta2"],
                        )
                    else:
                        update = _authors_adam(p.grad, st, group)
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update.reshape(p.shape), alpha=-group["lr"])

    class SingleDeviceNorMuon(NorMuon):
        pass

    class NorMuonWithAuxAdam(NorMuon):
        def __init__(self, param_groups: Any) -> None:
            for group in param_groups:
                assert "use_muon" in group
                if group["use_muon"]:
                    for k, v in dict(lr=0.02, momentum=0.95, beta2=0.95, weight_decay=0).items():
                        group.setdefault(k, v)
                    assert set(group) == {"params", "lr", "momentum", "beta2", "weight_decay", "use_muon"}
                else:
                    for k, v in dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0).items():
                        group.setdefault(k, v)
                    assert set(group) == {"params", "lr", "betas", "eps", "weight_decay", "use_muon"}
            torch.optim.Optimizer.__init__(self, param_groups, dict())

    class SingleDeviceNorMuonWithAuxAdam(NorMuonWithAuxAdam):
        pass

    return module_of("normuon", (NorMuon, SingleDeviceNorMuon, NorMuonWithAuxAdam, SingleDeviceNorMuonWithAuxAdam))


@pytest.fixture
def authors(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = _authors_module()
    monkeypatch.setitem(sys.modules, "normuon", mod)
    return mod


def _aux_groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [
        {"params": [params[0], params[1], params[3]], "use_muon": True, "lr": 0.02, "weight_decay": 0.01, "beta2": 0.9},
        {"params": params[4:], "use_muon": False, "lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.05},
    ]


@pytest.mark.parametrize("name", ["NorMuonWithAuxAdam", "SingleDeviceNorMuonWithAuxAdam"])
def test_convert_authors_aux_trains_like_it(authors: types.ModuleType, name: str) -> None:
    """The conversion's options are the authors' math: 12 steps side by side, one with a None
    gradient (both iterating in float64: the conversion's bfloat16 ns_dtype replaced after
    converting), parameters, momenta and second moments at FLOAT64_RTOL."""
    src_params, our_params = make_params(), make_params()
    src = getattr(authors, name)(_aux_groups(src_params))
    ours = dist_optim.convert(getattr(authors, name)(_aux_groups(our_params)))
    assert isinstance(ours, DistributedNorMuon)
    muon, aux = ours.param_groups
    assert muon["ns_dtype"] is torch.bfloat16 and muon["momentum_ema"] and muon["eps_form"] == "add"
    assert (muon["lr"], muon["weight_decay"], muon["momentum"], muon["beta2"]) == (0.02, 0.01, 0.95, 0.9)
    assert muon["normalization_eps"] == 1e-10 and muon["adjust_lr_fn"] == "original" and muon["nesterov"]
    assert not aux["use_muon"] and aux["adamw_betas"] == (0.8, 0.95) and aux["adamw_eps"] == 1e-10
    muon["ns_dtype"] = None
    for step in range(STEPS):
        feed(src_params, step)
        feed(our_params, step)
        src.step()
        ours.step()
    for i, (a, b) in enumerate(zip(our_params, src_params)):
        if i == 2:
            continue  # the conv weight is in neither optimizer
        assert_close(a.detach(), b.detach(), rtol=FLOAT64_RTOL, msg=f"param {i}")
        if i in (0, 1, 3):
            st, theirs = ours.state[a], src.state[b]
            assert_close(st["momentum_buffer"], theirs["momentum_buffer"], rtol=FLOAT64_RTOL, msg=f"param {i}")
            assert_close(st[KEY], theirs["second_momentum_buffer"].reshape(-1), rtol=FLOAT64_RTOL, msg=f"{i} v")


@pytest.mark.parametrize("name", ["NorMuon", "SingleDeviceNorMuon"])
def test_convert_authors_normuon_with_state(authors: types.ModuleType, name: str) -> None:
    """A stepped source converts with its momentum and its second moment (``rows x 1`` there,
    ``rows`` here), and the next steps continue its trajectory."""
    src_params, our_params = make_params()[:2], make_params()[:2]
    src = getattr(authors, name)(src_params, lr=0.05, weight_decay=0.1, beta2=0.9)
    twin = getattr(authors, name)(our_params, lr=0.05, weight_decay=0.1, beta2=0.9)
    for step in range(2):
        feed(src_params, step, None)
        feed(our_params, step, None)
        src.step()
        twin.step()
    ours = dist_optim.convert(twin)
    g = ours.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["momentum"], g["beta2"], g["eps"]) == (0.05, 0.1, 0.95, 0.9, 1e-7)
    assert torch.equal(ours.state[our_params[0]][KEY], src.state[src_params[0]]["second_momentum_buffer"].reshape(-1))
    g["ns_dtype"] = None
    for step in range(2, 5):
        feed(src_params, step, None)
        feed(our_params, step, None)
        src.step()
        ours.step()
    for a, b in zip(our_params, src_params):
        assert_close(a.detach(), b.detach(), rtol=FLOAT64_RTOL)
    with pytest.raises(ValueError, match=r"normuon\.\w+ holds a parameter of shape \(6, 3, 2, 2\).*2-D parameters"):
        dist_optim.convert(getattr(authors, name)([make_params()[2]]))


def test_unknown_authors_option_is_refused(authors: types.ModuleType) -> None:
    src = authors.SingleDeviceNorMuon(make_params()[:1])
    src.param_groups[0]["ns_steps"] = 7  # not one of theirs: no silent drop
    src.defaults["ns_steps"] = 5
    with pytest.raises(ValueError, match="ns_steps"):
        dist_optim.convert(src)


# ---- options and state -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(beta2=1.0), r"beta2 must be a finite number in \[0\.0, 1\.0\), got 1\.0"),
        (dict(beta2=-0.1), "beta2"),
        (dict(normalization_eps=0.0), "normalization_eps"),
    ],
)
def test_bad_options_are_refused_in_one_line(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        DistributedNorMuon(make_params()[:1], **kwargs)
    assert "\n" not in str(info.value)


def _stepped(stacked: bool, dtype: torch.dtype = torch.float64) -> tuple[DistributedNorMuon, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in make_params()]
    opt = DistributedNorMuon(groups(params, dict(stacked=stacked)), lr=2e-2)
    for step in range(3):
        feed(params, step, None)
        opt.step()
    return opt, params


def test_full_state_round_trips_and_checks_the_neuron_shape() -> None:
    """full_state has each matrix's rows whole; load_full_state restores them into a fresh
    optimizer (the next steps equal); a state of the other ``stacked`` form is refused, naming it."""
    opt, params = _stepped(stacked=True)
    full = opt.full_state()
    assert full[2][KEY].shape == (6, 3) and full[0][KEY].shape == (8,)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = DistributedNorMuon(groups(twin_params, dict(stacked=True)), lr=2e-2)
    twin.load_full_state(full)
    for step in range(3, 5):
        feed(params, step, None)
        feed(twin_params, step, None)
        opt.step()
        twin.step()
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)
    flat = DistributedNorMuon(groups([torch.nn.Parameter(p.detach().clone()) for p in params], {}), lr=2e-2)
    with pytest.raises(ValueError, match=r"neuron_second_moment of shape \(6, 3\).*shape \(6,\)") as info:
        flat.load_full_state(full)
    assert "\n" not in str(info.value)


def test_second_moment_stays_float32_for_bf16_parameters() -> None:
    """The second moment is float32 beside bfloat16 parameters, and keeps it through
    state_dict() / load_state_dict() (torch's loader casts floating state to the parameter's)."""
    opt, params = _stepped(stacked=False, dtype=torch.bfloat16)
    assert opt.state[params[0]][KEY].dtype == torch.float32
    twin = DistributedNorMuon(groups([torch.nn.Parameter(p.detach().clone()) for p in params], {}), lr=2e-2)
    twin.load_state_dict(opt.state_dict())
    loaded = twin.state[twin.param_groups[0]["params"][0]][KEY]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, opt.state[params[0]][KEY])


def _bf16_error(cls: type) -> float:
    """The largest distance of a bfloat16-iteration run from the float64 one, over 3 steps, as a
    share of the float64 run's largest move (the matrices)."""
    runs = []
    for ns_dtype in (None, torch.bfloat16):
        params = make_params()
        opt = cls(groups(params, dict(ns_dtype=ns_dtype)), lr=2e-2)
        for step in range(3):
            feed(params, step, None)
            opt.step()
        runs.append(params)
    start = make_params()
    return max(float((a - b).abs().max() / (b - s).abs().max()) for a, b, s in zip(runs[1][:4], runs[0][:4], start))


def test_a_bfloat16_iteration_normalizes_in_float32() -> None:
    """With the converted optimizers' ns_dtype=bfloat16 the normalization runs in the second
    moment's dtype (float64 beside float64 parameters) on the bfloat16 iteration's result: NorMuon's
    distance from its float64 run stays near Muon's own bfloat16 error (measured 0.058 of the move
    against Muon's 0.038: dividing a row by its root second moment scales that row's rounding too;
    2x bounds it)."""
    params = make_params()
    opt = DistributedNorMuon(groups(params, dict(ns_dtype=torch.bfloat16)), lr=2e-2)
    feed(params, 0, None)
    opt.step()
    assert opt.state[params[0]][KEY].dtype == torch.float64
    assert _bf16_error(DistributedNorMuon) < 2 * _bf16_error(DistributedMuon)
