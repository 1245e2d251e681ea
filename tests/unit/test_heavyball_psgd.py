"""heavyball's PSGDKron converted by ``dist_optim.convert`` (``DistributedKron(variant="heavyball")``),
stepped beside heavyball itself (issue 57, point 5).

heavyball 3.2.1's ``PSGDKron`` is not kron_torch's Kron with other defaults: :func:`_reference_steps`
below writes out its step (float64, eager, ``compile_mode = None``), checked against heavyball
element-wise, so that every difference from kron_torch's algorithm (``dist_optim.kron``) is stated as
code, what ``dist_optim.kron.variant`` implements; then the converted optimizer is stepped beside
heavyball (parameters, momenta, factors and lower bounds within 1e-12):

* update decision: a running float sum of the probability, updating when its integer part grows
  (``psgd_should_update``), the schedule called with the 1-based step ``max(min_prob, max_prob *
  decay ** max(n - flat_start, 0))`` (0.999, 1000 steps flat); kron_torch: a counter reaching
  ``1 / p``, its schedule ``exp`` from step 0 (0.001, 500 steps);
* momentum: a bias-corrected average ``m <- lerp(m, g, (1 - b) / (1 - b^t))`` counted in the
  optimizer's steps (a parameter that missed a step moves differently), the un-noised average
  preconditioned; kron_torch: ``m / (1 - b^t)`` in the parameter's steps, the noised one;
* initial scale (``precond_init_scale=None``, the default): ``(scale_scale mean(|g|^4)^(-1/8)) **
  0.5`` of the raw first gradient, the stacked gradients of same-shape parameters together
  (``multi_tensor=True``); dims of size 1 dropped (``SqueezeGrad``);
* fit: noise ``(dampening + eps_f32 |G|) V`` element-wise (kron_torch: ``sqrt(eps_f32) mean|G| V``),
  the factors balanced (common max-abs) on every update (kron_torch: 1% of them), the step divided
  by a running lower bound ``ell <- max(ell_t, lb + (ell_t - lb)(1 - lower_bound_beta))`` of
  ``||T1 + T2||`` (triangular: ``precond_update_power_iterations`` power steps from the row of
  largest norm; diagonal: ``max(T1 + T2)``), a state per factor; kron_torch: a one-step bound,
  no state;
* direction: ``trust_region_clip_`` (``clamp(1.5 (0.9 tanh(x/1.5) + 0.1 sgn(x) log1p|x/1.5|), -2,
  2)``) instead of kron_torch's RMS clip at 1.1; weight decay ``p (1 - lr wd)`` on every tensor
  (kron_torch: tensors of >= 2 dims).

heavyball rounds the momentum's weight to float32 (a Python float raised to its int64 step tensor);
the fixture computes it in float64, as tests/unit/test_heavyball_soap.py does. The probes are
heavyball's own (``dampen_grad`` recorded).
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

import dist_optim

heavyball = pytest.importorskip("heavyball")

#: Distinct shapes (heavyball stacks same-shape parameters on its bucket axis): a matrix, a 3-D
#: weight, a vector, and a (1, 5) weight heavyball squeezes to a vector.
SHAPES = [(6, 5), (3, 4, 2), (7,), (1, 5)]
STEPS = 6
NONE_AT = ((2, 1), (0, 2))  # (step, parameter) without a gradient; the vector starts late
LR, WD, B1, PROB, PRECOND_LR = 2.0**-6, 0.1, 0.9, 0.4, 0.2
#: heavyball.PSGDKron's options in the exact comparisons (its defaults otherwise), float64 throughout.
HB_OPTIONS: dict[str, Any] = dict(
    lr=LR,
    weight_decay=WD,
    betas=(B1, 0.999),
    preconditioner_update_probability=PROB,
    precond_lr=PRECOND_LR,
    q_dtype="float64",
    storage_dtype="float64",
)


@pytest.fixture(autouse=True)
def eager_heavyball(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)


@pytest.fixture
def float64_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    original = heavyball.utils.beta_debias

    def beta_debias(beta: Any, step: Any) -> Any:
        if isinstance(beta, float) and isinstance(step, torch.Tensor) and not step.is_floating_point():
            return 1 - (1 - beta) / (1 - beta ** int(step))
        return original(beta, step)

    monkeypatch.setattr(heavyball.utils, "beta_debias", beta_debias)


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """heavyball's probe vectors, in the order it draws them."""
    drawn: list[torch.Tensor] = []
    original = heavyball.utils.dampen_grad

    def dampen_grad(g: torch.Tensor, damp: float = 1e-9) -> Any:
        v, noised = original(g, damp)
        drawn.append(v.clone())
        return v, noised

    monkeypatch.setattr(heavyball.utils, "dampen_grad", dampen_grad)
    return drawn


def _gradients() -> list[list[torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(5)
    out: list[list[torch.Tensor | None]] = []
    for step in range(STEPS):
        row: list[torch.Tensor | None] = []
        for i, s in enumerate(SHAPES):
            g = torch.randn(s, generator=gen, dtype=torch.float64)
            row.append(None if (step, i) in NONE_AT else g)
        out.append(row)
    return out


def _along(t: torch.Tensor, k: int, fn: Any) -> torch.Tensor:
    moved = t.movedim(k, -1)
    return fn(moved.reshape(-1, moved.shape[-1])).reshape(moved.shape).movedim(-1, k)


def _scale(t: torch.Tensor, k: int, vec: torch.Tensor) -> torch.Tensor:
    view = [1] * t.dim()
    view[k] = -1
    return t * vec.view(view)


def _gram(t: torch.Tensor, k: int, diagonal: bool) -> torch.Tensor:
    rows = t.movedim(k, 0).reshape(t.shape[k], -1)
    return (rows * rows).sum(1) if diagonal else rows @ rows.T


def _top_eigenvalue(a: torch.Tensor, iterations: int = 2) -> torch.Tensor:
    """heavyball's ``max_eigenvalue_spd``: power steps from the row of largest norm."""
    norms = a.norm(dim=-1)
    x_norm, idx = norms.max(dim=-1)
    x_norm = x_norm.clamp(min=torch.finfo(torch.float32).tiny)
    scaled, x = a / x_norm, a[idx] / x_norm
    for _ in range(iterations):
        x = torch.nn.functional.normalize(scaled @ (scaled @ x), dim=-1)
    return (x * (scaled @ (scaled @ x))).sum().sqrt() * x_norm


def _trust_region_clip(x: torch.Tensor, lerp: float = 0.9, scale: float = 1.5) -> torch.Tensor:
    x = x / scale
    tanh = x.tanh()
    return ((x.abs().log1p().copysign(tanh) * (1 - lerp) + tanh * lerp) * scale).clamp(-2, 2)


def _fit(state: dict[str, Any], noised: torch.Tensor, v: torch.Tensor) -> None:
    """One update of the factors from the noised input and its probe (``psgd_update_precond``)."""
    qs, bounds = state["Q"], state["lb"]
    logs = [q.abs().max().log() for q in qs]
    mean = sum(logs) / len(qs)
    for q, n in zip(qs, logs):
        q.mul_((mean - n).exp())  # balanced on every update
    a, b = noised, v
    for k, q in enumerate(qs):
        if q.dim() < 2:
            a, b = _scale(a, k, q), _scale(b, k, q.reciprocal())
        else:
            a = _along(a, k, lambda r, q=q: r @ q.T)
            b = _along(b, k, lambda r, q=q: torch.linalg.solve_triangular(q, r, upper=True, left=False))
    for k, q in enumerate(qs):
        t1, t2 = _gram(a, k, q.dim() < 2), _gram(b, k, q.dim() < 2)
        ell = (t1 + t2).max() if q.dim() < 2 else _top_eigenvalue(t1 + t2)
        ell = torch.maximum(ell, bounds[k] + (ell - bounds[k]) * (1 - 0.9))  # lower_bound_beta
        bounds[k] = ell
        step = q * (t1 - t2) if q.dim() < 2 else (t1 - t2).triu() @ q
        q.copy_(q - step / ell * PRECOND_LR)


def _reference_steps(params: list[torch.Tensor], probes: list[torch.Tensor]) -> tuple[list[dict[str, Any]], list[int]]:
    """heavyball.PSGDKron's step (module docstring) on ``params`` with :func:`_gradients`; returns
    the states and the (1-based) steps that updated the factors."""
    states: list[dict[str, Any]] = [{} for _ in params]
    updates: list[int] = []
    cumulative = 0.0
    drawn = iter(probes)
    for t, grads in enumerate(_gradients(), start=1):
        before, cumulative = cumulative, cumulative + PROB
        update = int(cumulative) > int(before)
        if update:
            updates.append(t)
        for p, g, st in zip(params, grads, states):
            if g is None:
                continue
            shape = [n for n in g.shape if n != 1]
            x = g.reshape(shape)
            if not st:
                scale = float(x.abs().pow(4).mean().pow(-1 / 8)) ** 0.5
                per = scale ** (1 / len(shape))
                tri = len(shape) >= 2
                st["Q"] = [per * (torch.eye(n, dtype=x.dtype) if tri else torch.ones(n, dtype=x.dtype)) for n in shape]
                st["lb"] = [torch.zeros((), dtype=torch.float64) for _ in shape]
                st["m"] = torch.zeros_like(x)
            beta = 1 - (1 - B1) / (1 - B1**t)  # the optimizer's step, not the parameter's
            st["m"] = st["m"] * beta + x * (1 - beta)
            if update:
                v = next(drawn).reshape(shape)
                _fit(st, st["m"] + (1e-9 + torch.finfo(torch.float32).eps * st["m"].abs()) * v, v)
            u = st["m"]
            for k, q in enumerate(st["Q"]):
                u = _scale(u, k, q * q) if q.dim() < 2 else _along(u, k, lambda r, q=q: r @ q.T @ q)
            p.copy_(p * (1 - WD * LR) - LR * _trust_region_clip(u).reshape(p.shape))
    assert next(drawn, None) is None
    return states, updates


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES]


def _assert_params_close(theirs: list[torch.nn.Parameter], mine: list[torch.nn.Parameter], what: str) -> None:
    """Ours within 1e-12 of the largest magnitude of heavyball's parameter, element-wise (float64
    on both sides: the rounding of the same operations in another order)."""
    for i, (a, b) in enumerate(zip(theirs, mine)):
        ref = a.detach()
        tol = 1e-12 * max(ref.abs().max().item(), 1e-300)
        torch.testing.assert_close(b.detach(), ref, rtol=0, atol=tol, msg=f"{what}param {i}")


def _step_side_by_side(
    hb: torch.optim.Optimizer,
    ours: torch.optim.Optimizer,
    theirs: list[torch.nn.Parameter],
    mine: list[torch.nn.Parameter],
    grads: list[torch.Tensor | None],
) -> None:
    """One step of heavyball's optimizer and ours on copies of the same gradients (None: none)."""
    for a, b, g in zip(theirs, mine, grads):
        a.grad, b.grad = (None, None) if g is None else (g.clone(), g.clone())
    hb.step()
    ours.step()


def test_reference_is_heavyballs_psgdkron(float64_weights: None, probes: list[torch.Tensor]) -> None:
    theirs = _params()
    hb = heavyball.PSGDKron(theirs, **HB_OPTIONS)
    for grads in _gradients():
        for p, g in zip(theirs, grads):
            p.grad = None if g is None else g.clone()
        hb.step()
    mine = _params()
    with torch.no_grad():
        states, updates = _reference_steps(mine, probes)
    assert updates == [3, 5]  # kron_torch's counter (1 / 0.4 = 2.5 steps) updates at steps 3 and 6
    _assert_params_close(theirs, mine, "")
    for i, a in enumerate(theirs):
        hb_state = hb.state[a][0]
        (m,) = [v for k, v in hb_state.items() if k.startswith("exp_avg")]
        torch.testing.assert_close(states[i]["m"], m.reshape(states[i]["m"].shape), rtol=1e-12, atol=0)
        (qs,) = [v for k, v in hb_state.items() if re.fullmatch(r"scale_by_psgd_Q_\d+", k)]
        (bounds,) = [v for k, v in hb_state.items() if k.startswith("scale_by_psgd_running_lower_bound_")]
        full = heavyball.utils.line_to_triu(qs)
        assert len(full) == len(states[i]["Q"])  # the (1, 5) weight: one factor, its unit dim dropped
        for k, (q_ref, q_mine, lb) in enumerate(zip(full, states[i]["Q"], bounds)):
            torch.testing.assert_close(q_mine, q_ref.reshape(q_mine.shape), rtol=1e-12, atol=1e-300, msg=f"Q {i}.{k}")
            torch.testing.assert_close(states[i]["lb"][k], lb.reshape(()), rtol=1e-12, atol=0, msg=f"bound {i}.{k}")
    assert math.isfinite(sum(float(p.sum()) for p in mine))


@pytest.mark.parametrize(
    "kwargs,shapes,match",
    [
        (dict(delayed=True), [(3, 3)], "delayed=True"),
        (dict(merge_dims=True), [(2, 3, 4)], "use merge_dims=False"),
        (dict(preconditioner_update_probability=lambda n: 0.5), [(3, 3)], "only a float or heavyball's"),
        (dict(caution=True), [(3, 3)], "caution=True"),
        (dict(update_clipping="l2_clip_"), [(3, 3)], "update_clipping heavyball's default or None"),
        (dict(storage_dtype="bfloat16"), [(3, 3)], "storage_dtype='bfloat16'"),
    ],
    ids=["delayed", "merge_dims", "schedule", "caution", "clipping", "storage"],
)
def test_psgdkron_options_without_an_equivalent_are_refused_in_one_line(
    kwargs: dict[str, Any], shapes: list[tuple[int, ...]], match: str
) -> None:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    with pytest.raises(ValueError, match=re.escape(match)) as caught:
        dist_optim.convert(heavyball.PSGDKron(params, **kwargs))
    assert "\n" not in str(caught.value) and "PSGDKron" in str(caught.value)


@pytest.mark.parametrize("multi_tensor", [False, True])
def test_initial_scale_is_shared_by_stacked_parameters(multi_tensor: bool) -> None:
    """``precond_init_scale=None``: ``mean(|g|^4)^(-1/16)`` of the first gradient, of the two same-shape
    parameters' stacked gradients with ``multi_tensor=True`` (a per-parameter conversion must refuse it)."""
    params = [torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64)) for _ in range(2)]
    hb = heavyball.PSGDKron(
        params,
        lr=LR,
        preconditioner_update_probability=PROB,
        q_dtype="float64",
        storage_dtype="float64",
        multi_tensor=multi_tensor,
    )
    grads = [torch.full((4, 3), 1.0, dtype=torch.float64), torch.full((4, 3), 100.0, dtype=torch.float64)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    hb.step()  # no update at step 1 (0.4 < 1): the factors are the initial ones
    stacked = torch.stack(grads)
    for p, g in zip(params, grads):
        (qs,) = [v for k, v in hb.state[p][0].items() if re.fullmatch(r"scale_by_psgd_Q_\d+", k)]
        q0 = heavyball.utils.line_to_triu(qs)[0].reshape(4, 4)
        source = stacked if multi_tensor else g
        scale = float(source.abs().pow(4).mean().pow(-1 / 8)) ** 0.5
        torch.testing.assert_close(q0, scale ** (1 / 2) * torch.eye(4, dtype=torch.float64), rtol=1e-12, atol=0)


def _heavyball_and_converted(**kwargs: Any) -> tuple[Any, Any, list[torch.Tensor], list[torch.Tensor]]:
    options = dict(
        lr=LR, weight_decay=WD, betas=(B1, 0.999), precond_lr=PRECOND_LR, q_dtype="float64", storage_dtype="float64"
    )
    options.update(kwargs)
    theirs, mine = _params(), _params()
    hb = heavyball.PSGDKron(theirs, **options)
    ours = dist_optim.convert(heavyball.PSGDKron(mine, **options))
    assert isinstance(ours, dist_optim.DistributedKron)
    return hb, ours, theirs, mine


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(preconditioner_update_probability=PROB),
        dict(update_clipping=None, lower_bound_beta=0.5, precond_update_power_iterations=3, dampening=1e-6),
        dict(momentum_into_precond_update=False, memory_save_mode="one_diag", precond_init_scale=0.7),
        dict(exp_avg_input=False, precond_init_scale_power=0.3, precond_init_scale_scale=2.0, multi_tensor=False),
    ],
    ids=["p0.4", "default-schedule-unclipped", "grad-one_diag-fixed", "no-momentum-init"],
)
def test_converted_psgdkron_steps_as_heavyball_in_float64(float64_weights: None, kwargs: dict[str, Any]) -> None:
    hb, ours, theirs, mine = _heavyball_and_converted(**kwargs)
    torch.manual_seed(ours.seed)  # heavyball's probes from torch's generator, ours from the optimizer's
    for step, grads in enumerate(_gradients()):
        _step_side_by_side(hb, ours, theirs, mine, grads)
        _assert_params_close(theirs, mine, f"step {step} ")
        for a, b in zip(theirs, mine):
            st, hb_state = ours.state.get(b, {}), hb.state.get(a, {}).get(0, {})
            if "momentum_buffer" not in st:
                continue
            ms = [v for k, v in hb_state.items() if k.startswith("exp_avg")]
            for m in ms:
                torch.testing.assert_close(st["momentum_buffer"], m.view_as(b), rtol=1e-12, atol=1e-300)
            (qs,) = [v for k, v in hb_state.items() if re.fullmatch(r"scale_by_psgd_Q_\d+|update_by_psgd_Q_\d+", k)]
            for k, q in enumerate(heavyball.utils.line_to_triu(qs)):
                torch.testing.assert_close(st[f"Q_{k}"], q.view_as(st[f"Q_{k}"]), rtol=1e-12, atol=1e-300)
            (lb,) = [v for k, v in hb_state.items() if "running_lower_bound" in k]
            torch.testing.assert_close(st["Q_lower_bound"], torch.cat([x.reshape(1) for x in lb]), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(use_symmetric_packing=True), "use_symmetric_packing=False"),
        (dict(preconditioner_bits=8), "preconditioner_bits=32"),
        (dict(optim_bits=8), "optim_bits=32"),
    ],
)
def test_heavyball_variant_refuses_compact_states_it_was_not_checked_with(options: dict[str, Any], match: str) -> None:
    """The heavyball variant is compared with heavyball on whole float factors and momenta only."""
    from dist_optim import DistributedKron

    with pytest.raises(ValueError, match=re.escape(match)) as caught:
        DistributedKron([torch.nn.Parameter(torch.randn(4, 4))], variant="heavyball", **options)
    assert "\n" not in str(caught.value)


#: Same-shape parameters in the order heavyball steps its buckets (a shape's first appearance), so
#: that its per-member probes come in our order; (1, 7) is a bucket of its own, not (7,)'s.
STACKED = [(6, 5), (6, 5), (6, 5), (5, 3), (7,), (1, 7)]
#: The second (6, 5) weight has no gradient at the first step: it starts alone at the second.
STACKED_NONE_AT = ((0, 1),)


def _stacked_gradients() -> list[list[torch.Tensor | None]]:
    """Gradients of :data:`STACKED` whose same-shape members differ in size (x1, x30, x900), so that
    a scale shared by shape and one per parameter differ."""
    gen = torch.Generator().manual_seed(7)
    return [
        [
            None if (step, i) in STACKED_NONE_AT else torch.randn(s, generator=gen, dtype=torch.float64) * 30.0**i
            for i, s in enumerate(STACKED)
        ]
        for step in range(STEPS)
    ]


def _member_probes(g: torch.Tensor, damp: float = 1e-9) -> Any:
    """heavyball's ``dampen_grad`` with one probe per member of a stacked slab, drawn member after
    member (heavyball draws the slab's at once, another order of torch's normal numbers)."""
    v = torch.stack([torch.randn_like(x) for x in g])
    return v, g + (damp + torch.finfo(torch.float32).eps * g.abs()) * v


def test_converted_default_psgdkron_shares_initial_scales_by_shape(
    float64_weights: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """heavyball's defaults (``multi_tensor=True``, ``precond_init_scale=None``) on parameters of
    shared shapes: the converted optimizer starts same-shape parameters that start together from
    one scale, and steps as heavyball (its probes drawn per member) within 1e-12."""
    monkeypatch.setattr(heavyball.utils, "dampen_grad", _member_probes)
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in STACKED]
    theirs = [torch.nn.Parameter(x.clone()) for x in start]
    mine = [torch.nn.Parameter(x.clone()) for x in start]
    hb = heavyball.PSGDKron(theirs, **HB_OPTIONS)
    ours = dist_optim.convert(heavyball.PSGDKron(mine, **HB_OPTIONS))
    assert ours.param_groups[0]["precond_init_scale_by_shape"] is True
    torch.manual_seed(ours.seed)
    for step, grads in enumerate(_stacked_gradients()):
        _step_side_by_side(hb, ours, theirs, mine, grads)
        _assert_params_close(theirs, mine, f"step {step} ")


def test_heavyballs_stacked_step_is_each_members_own_apart_from_the_scale() -> None:
    """What the conversion relies on: with a fixed initial scale and probes element-wise in the
    gradient (so the same per member, stacked or not), heavyball's ``multi_tensor=True`` step of
    same-shape parameters equals its ``multi_tensor=False`` step, bit for bit."""

    def element_wise(g: torch.Tensor, damp: float = 1e-9) -> Any:
        v = torch.sin(g * 1000.0)
        return v, g + (damp + torch.finfo(torch.float32).eps * g.abs()) * v

    def run(multi_tensor: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(6, 5, generator=gen, dtype=torch.float64)) for _ in range(3)]
        hb = heavyball.PSGDKron(
            params,
            lr=LR,
            precond_lr=PRECOND_LR,
            preconditioner_update_probability=1.0,
            precond_init_scale=0.7,
            q_dtype="float64",
            storage_dtype="float64",
            multi_tensor=multi_tensor,
        )
        grads = torch.Generator().manual_seed(5)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads, dtype=torch.float64)
            hb.step()
        return [p.detach() for p in params]

    original = heavyball.utils.dampen_grad
    heavyball.utils.dampen_grad = element_wise
    try:
        stacked, alone = run(True), run(False)
    finally:
        heavyball.utils.dampen_grad = original
    for a, b in zip(stacked, alone):
        assert torch.equal(a, b)
