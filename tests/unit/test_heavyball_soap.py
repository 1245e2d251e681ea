"""heavyball's SOAP and KL-SOAP converted by ``dist_optim.convert``, stepped beside heavyball itself.

heavyball 3.2.1 runs eagerly on this torch with ``compile_mode = None``. It rounds one scalar to
float32: the factors' average weight ``1 - beta_debias(shampoo_beta, step)`` (a Python float raised
to its int64 step tensor), a deviation docs/optimizers.md states. The exact comparisons compute
that weight in float64 (``float64_weights``, the same formula in Python floats); then the converted
optimizer's parameters and moments agree to float64 rounding and its factors and bases are
heavyball's bit for bit (null spaces of rank-deficient factors included, which depend on the last
bits of the factor). ``test_float32_weight_is_the_only_difference`` runs heavyball unpatched.
The learning rate passes through a float32 tensor in heavyball, so it is exact in float32 here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dist_optim
from dist_optim.kernels import matrix_functions
from dist_optim.shampoo.preconditioner.heavyball import refreshes

heavyball = pytest.importorskip("heavyball")

#: Square (no padding, two of it: heavyball stacks them on its bucket axis), odd and rank-deficient,
#: wide, a 3-D weight (merged to (3, 20) with merge_dims) and a vector.
SHAPES = [(12, 12), (12, 12), (7, 9), (8, 24), (3, 4, 5), (6,)]
#: (step, parameter) without a gradient: the second matrix misses a step, and the vector starts
#: late (its first step only seeds while the others step: heavyball decays it then).
NONE_AT = ((2, 0), (0, 5))
LR = 2.0**-6  # exact in float32 (module docstring)


@pytest.fixture(autouse=True)
def eager_heavyball(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)


@pytest.fixture
def float64_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """heavyball's ``beta_debias`` of a Python float beta at an int64 step tensor in float64 (module
    docstring); its tensor-beta form (Adam's, already float64) is left alone."""
    original = heavyball.utils.beta_debias

    def beta_debias(beta: Any, step: Any) -> Any:
        if isinstance(beta, float) and isinstance(step, torch.Tensor) and not step.is_floating_point():
            return 1 - (1 - beta) / (1 - beta ** int(step))
        return original(beta, step)

    monkeypatch.setattr(heavyball.utils, "beta_debias", beta_debias)


def _params(dtype: torch.dtype = torch.float64, shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]


def _theirs(hb: Any, p: torch.Tensor) -> dict[str, Any]:
    """heavyball's state of ``p`` by name (its keys carry the transform and its index)."""
    out: dict[str, Any] = {}
    for key, value in hb.state.get(p, {}).get(0, {}).items():
        for name in ("exp_avg_sq", "exp_avg", "GG", "Q"):
            if key.startswith(("scale_by_soap_", "scale_by_kl_soap_")) and key.rsplit("_", 1)[0].endswith(f"_{name}"):
                out[name] = value
    return out


def _close(mine: torch.Tensor, ref: torch.Tensor, msg: str) -> None:
    # float64 rounding of a few hundred operations on values of order 1
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-13 * max(ref.abs().max().item(), 1e-300), msg=msg)


def _compare(hb: Any, ours: Any, theirs: list[torch.Tensor], mine: list[torch.Tensor], step: int, exact: bool) -> None:
    for i, (a, b) in enumerate(zip(theirs, mine)):
        where = f"step {step} param {i}"
        _close(b, a, where)
        ref, st = _theirs(hb, a), ours.state[b]
        if "exp_avg" not in ref:
            continue
        _close(st["block0.exp_avg_eigen"], ref["exp_avg"][0], f"{where} exp_avg")
        _close(st["block0.exp_avg_sq"], ref["exp_avg_sq"][0], f"{where} exp_avg_sq")
        for k, (gg, q) in enumerate(zip(ref["GG"], ref["Q"])):
            if gg is None:  # heavyball's vector without precondition_1d: Adam in the identity basis
                assert f"block0.factor{k}" not in st
                continue
            for name, r in ((f"factor{k}", gg[0]), (f"basis{k}", q[0])):
                if exact:
                    assert torch.equal(st[f"block0.{name}"], r), f"{where} {name}"
                else:
                    _close(st[f"block0.{name}"], r, f"{where} {name}")


CASES = {
    "soap": dict(cls="SOAP", kwargs=dict(precondition_frequency=2), steps=7),
    "kl-soap": dict(cls="KLSOAP", kwargs=dict(precondition_frequency=3, shampoo_beta=0.9), steps=7),
    # 1 / 10 summed ten times is 0.999...: heavyball's first refresh is at step 11
    "soap-pf10-unmerged-1d": dict(
        cls="SOAP", kwargs=dict(precondition_frequency=10, merge_dims=False, precondition_1d=True), steps=13
    ),
}


def _pair(cls: str, kwargs: dict[str, Any], dtype: torch.dtype = torch.float64) -> tuple[Any, Any, list, list]:
    kwargs = dict(dict(lr=LR, betas=(0.9, 0.95), weight_decay=0.05, storage_dtype=str(dtype)[6:]), **kwargs)
    theirs, mine = _params(dtype), _params(dtype)
    hb = getattr(heavyball, cls)(theirs, **kwargs)
    ours = dist_optim.convert(getattr(heavyball, cls)(mine, **kwargs))
    assert isinstance(ours, dist_optim.DistributedShampoo)
    return hb, ours, theirs, mine


def _run(hb: Any, ours: Any, theirs: list, mine: list, steps: int, exact: bool | None) -> float:
    """Steps both with the same gradients; compares every step (``exact`` None: returns the largest
    relative parameter difference instead)."""
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for step in range(steps):
        for i, (a, b) in enumerate(zip(theirs, mine)):
            g = torch.randn(a.shape, generator=gen, dtype=a.dtype)
            a.grad, b.grad = (None, None) if (step, i) in NONE_AT else (g.clone(), g.clone())
        hb.step()
        ours.step()
        if exact is None:
            worst = max(worst, *(((b - a).abs().max() / a.abs().max()).item() for a, b in zip(theirs, mine)))
        else:
            _compare(hb, ours, theirs, mine, step, exact)
    return worst


@pytest.mark.usefixtures("float64_weights")
@pytest.mark.parametrize("case", CASES)
def test_converted_soap_steps_as_heavyball_in_float64(case: str) -> None:
    c = CASES[case]
    hb, ours, theirs, mine = _pair(c["cls"], c["kwargs"])
    _run(hb, ours, theirs, mine, c["steps"], exact=True)


def test_float32_weight_is_the_only_difference() -> None:
    """Unpatched, heavyball's float32 weight (relative error up to 6e-8) moves its factors by as much;
    measured: parameters within 6.2e-9 of their scale after 7 steps (bounded here at 1e-6)."""
    hb, ours, theirs, mine = _pair("SOAP", dict(precondition_frequency=2))
    worst = _run(hb, ours, theirs, mine, 7, exact=None)
    assert 1e-12 < worst < 1e-6


def test_fp32_parameters_step_as_heavyball() -> None:
    """In fp32 (heavyball's factors and bases in fp32 too) the two agree to fp32 rounding, amplified by
    the refreshes of near-degenerate bases: measured 9.3e-6 of the parameters' scale after 7 steps."""
    hb, ours, theirs, mine = _pair("SOAP", dict(precondition_frequency=2), torch.float32)
    assert ours.param_groups[0]["preconditioner_dtype"] == torch.float32
    assert _run(hb, ours, theirs, mine, 7, exact=None) < 1e-4


@pytest.mark.usefixtures("float64_weights")
def test_a_resumed_run_counts_the_optimizers_steps() -> None:
    """The step count heavyball's step reads (``steps_taken``) travels in the state dict."""
    hb, ours, theirs, mine = _pair("SOAP", dict(precondition_frequency=2))
    _run(hb, ours, theirs, mine, 3, exact=True)
    resumed = dist_optim.DistributedShampoo(mine, **{k: v for k, v in ours.defaults.items() if k != "params"})
    resumed.load_state_dict(ours.state_dict())
    assert resumed.steps_taken == 3
    gen = torch.Generator().manual_seed(7)
    for step in range(3, 6):
        for a, b in zip(theirs, mine):
            g = torch.randn(a.shape, generator=gen, dtype=a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        hb.step()
        resumed.step()
        for a, b in zip(theirs, mine):
            _close(b, a, f"resumed step {step}")


def test_converted_options() -> None:
    hb = heavyball.KLSOAP(
        _params(torch.float32, [(8, 6)]), lr=0.01, betas=(0.8, 0.9), shampoo_beta=0.7, eps=1e-7, weight_decay=0.1
    )
    (group,) = dist_optim.convert(hb).param_groups
    want = dict(
        lr=0.01,
        betas=(0.8, 0.9),
        shampoo_beta=0.7,
        epsilon=1e-7,
        weight_decay=0.1,
        use_decoupled_weight_decay=True,
        max_preconditioner_dim=2048,
        precondition_frequency=2,
        eigenvalue_correction=True,
        eigenbasis="qr-lifted",
        soap_step="heavyball",
        precondition_1d=False,
        merge_small_dims="trailing",
        preconditioner_dtype=torch.float32,
        kl_statistics=True,
        grafting_config=None,
    )
    assert {k: group[k] for k in want} == want


@pytest.mark.parametrize(
    "cls,kwargs,params,match",
    [
        ("SOAP", dict(caution=True), None, "caution=True"),
        ("SOAP", dict(cautious_weight_decay=True), None, "cautious_weight_decay=True"),
        ("SOAP", dict(warmup_steps=10), None, "warmup_steps=10"),
        ("SOAP", dict(mars=True), None, "mars=True"),
        ("SOAP", dict(palm=True), None, "palm=True"),
        ("SOAP", dict(gradient_clipping=heavyball.utils.l2_clip_), None, "transforms"),
        ("SOAP", dict(split=True), None, "split=True"),
        ("SOAP", dict(multi_tensor=False), None, "multi_tensor=False"),
        ("SOAP", dict(use_precond_schedule=True), None, "use_precond_schedule=True"),
        ("SOAP", dict(precondition_frequency=2.5), None, "precondition_frequency=2.5"),
        ("SOAP", dict(storage_dtype="float64"), None, "storage_dtype='float32'"),
        ("SOAP", {}, [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))], "rounds stochastically"),
        (
            "SOAP",
            {},
            [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))],
            "mixes",
        ),
        ("SOAP", dict(max_precond_dim=16), [torch.nn.Parameter(torch.zeros(4, 20))], "max_precond_dim >= 20"),
        ("SOAP", dict(max_precond_dim=16), [torch.nn.Parameter(torch.zeros(4, 5, 20))], r"merged: \(4, 5, 20\)"),
        (
            "SOAP",
            dict(eps=1e-6, storage_dtype="float64"),
            [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))],
            "eps=1e-06",
        ),
        ("KLSOAP", {}, [torch.nn.Parameter(torch.zeros(1, 6))], "a dim of 1"),
    ],
    ids=[
        "caution",
        "cautious-wd",
        "warmup",
        "mars",
        "palm",
        "clipping",
        "split",
        "single-tensor",
        "precond-schedule",
        "fractional-frequency",
        "storage",
        "bf16",
        "mixed-dtypes",
        "dim-above-max",
        "merged-dim-above-max",
        "lift-floor",
        "kl-dim-of-1",
    ],
)
def test_what_has_no_equivalent_is_refused_by_name(cls: str, kwargs: dict[str, Any], params: Any, match: str) -> None:
    hb = getattr(heavyball, cls)(params if params is not None else _params(torch.float32, [(4, 4)]), **kwargs)
    with pytest.raises(ValueError, match=match) as caught:
        dist_optim.convert(hb)
    assert "\n" not in str(caught.value)


def test_soaps_in_fp32_take_any_small_eps() -> None:
    """In fp32 heavyball's lift is its noise term 64 d eps_fp32 (>= 1.5e-5), whatever the floor."""
    dist_optim.convert(heavyball.SOAP(_params(torch.float32, [(4, 4)]), eps=1e-6))


def test_a_stepped_soap_is_refused() -> None:
    params = _params(torch.float64, [(4, 4)])
    hb = heavyball.SOAP(params, storage_dtype="float64")
    params[0].grad = torch.ones_like(params[0])
    hb.step()
    with pytest.raises(ValueError, match="convert before the first step"):
        dist_optim.convert(hb)


@pytest.mark.parametrize("frequency", [1, 2, 3, 7, 10])
def test_the_refresh_schedule_is_heavyballs(frequency: int) -> None:
    """``refreshes`` against heavyball's own ``psgd_should_update`` over 300 steps."""
    group: dict[str, Any] = {}
    theirs = [heavyball.utils.psgd_should_update(group, 1 / frequency) for _ in range(300)]
    assert [refreshes(n, frequency) for n in range(1, 301)] == theirs
    if frequency == 10:
        assert theirs.index(True) == 10  # the 11th step: 0.1 summed ten times is below 1


def test_the_lifted_refresh_is_heavyballs_bit_for_bit() -> None:
    """``eigenbasis="qr-lifted"``'s kernels against heavyball's, on a rank-deficient factor (a wide
    gradient's right Gram matrix) whose null space is rounding noise."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        g1, g2 = (torch.randn(1, 4, 15, generator=gen, dtype=dtype) for _ in range(2))
        first = torch.einsum("...ab,...aB->...bB", g1, g1)
        (q,) = heavyball.utils.get_orthogonal_matrix([first])
        mine, ok = matrix_functions.lifted_eigh_start(first[0])
        assert bool(ok) and torch.equal(mine, q[0])
        second = 0.5 * first + 0.5 * torch.einsum("...ab,...aB->...bB", g2, g2)
        qs = [q.clone()]
        heavyball.utils.get_orthogonal_matrix_QR([second], qs, floor=1e-8)
        mine, ok = matrix_functions.lifted_qr_step(second[0], mine, 1e-8)
        assert bool(ok) and torch.equal(mine, qs[0][0])


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(soap_step="heavyball"), "eigenvalue_correction=True"),
        (
            dict(soap_step="heavyball", eigenvalue_correction=True, grafting_config=dist_optim.SGDGraftingConfig()),
            "grafting_config=None",
        ),
        (
            dict(soap_step="heavyball", eigenvalue_correction=True, use_symmetric_packing=True),
            "use_symmetric_packing=False",
        ),
        (dict(soap_step="heavyball", eigenvalue_correction=True, betas=(0.9, 1.0)), r"betas\[1\] < 1"),
        (dict(soap_step="lagged"), "soap_step must be one of"),
        (dict(shampoo_beta=1.0), "shampoo_beta must be"),
        (dict(merge_small_dims="leading"), "merge_small_dims must be"),
        (dict(eigenbasis="qr-lift"), "eigenbasis must be one of"),
    ],
)
def test_the_options_are_checked(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as caught:
        dist_optim.DistributedShampoo(_params(torch.float32, [(4, 4)]), **options)
    assert "\n" not in str(caught.value)
