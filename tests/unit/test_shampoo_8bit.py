"""DistributedShampoo with ``optim_bits=8``: every step against the float64 reference of
tests/helpers/shampoo_reference.py started from our state (the 8-bit moments dequantised by the
format's formula in tests/helpers/blockwise.py, the factors and roots copied), then the stored codes
against the nearest-code quantisation of the reference's new moments; SOAP's moments; which blocks
stay 32-bit; memory; resuming; carrying a state over from the other ``optim_bits``; bad options. The
distributed runs equal the single-device one, codes included, in the parity grid (``shampoo-8bit``,
``soap-8bit`` in tests/helpers/cases.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import dist_optim
from tests.helpers import blockwise
from tests.helpers.shampoo_reference import ReferenceShampoo

pytest.importorskip("bitsandbytes")

# 300 x 40: 47 quantisation blocks, the last one partial, and a factor above structured.MIN_SIZE;
# 33 x 17 and the 3-D tensor: partial blocks; the vector: one partial block.
SHAPES = [(300, 40), (33, 17), (17,), (5, 6, 7)]
ADAM = dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8)
KWARGS = dict(lr=1e-2, epsilon=1e-3, precondition_frequency=2, momentum=0.5, preconditioner_dtype=torch.float64)
NONE_STEP = 3  # the first parameter gets no gradient at this step
SIGNED = {"exp_avg": True, "graft_sq": False, "momentum_buffer": True}


def _params() -> list[torch.nn.Parameter]:
    return blockwise.params(shapes=SHAPES)


def _grads(step: int) -> list[torch.Tensor | None]:
    return blockwise.grads(step, SHAPES, (NONE_STEP, 0), growing=False)


def _reference_state(state: dict[str, Any]) -> dict[str, Any]:
    """Our state in the reference's form: 8-bit moments dequantised by formula, matrices as
    float64, the step count as an int."""
    out: dict[str, Any] = {"step": int(state["step"])}
    for key, value in state.items():
        name = key.rsplit(".", 1)[-1]
        if key == "step" or name.endswith("_absmax"):
            continue
        if value.dtype == torch.uint8:
            out[key] = blockwise.dequantize(value, state[key + "_absmax"], SIGNED[name])
        elif name == "failures":
            out[key] = float(value)
        else:
            out[key] = value.double().clone()
    return out


def _check_momentum(codes: torch.Tensor, absmax: torch.Tensor, expected: torch.Tensor) -> None:
    """The 8-bit momentum buffer against the reference's float64 one. The buffer adds the step's
    update, which carries the fp32 error of the whole step (above: up to 2e-5 of its size), not
    only the rounding of an element-wise moment: the absmax within 1e-5; every value, beyond 2e-5
    of its block's absmax (that error, which near zero spans several of the map's fine steps),
    within two quantisation steps of the reference (a code one from the nearest, which
    bitsandbytes' CPU quantiser gives to some, is within 1.5); every code within 3 of the nearest."""
    ref_codes, ref_absmax = blockwise.nearest(expected, True)
    torch.testing.assert_close(absmax.double(), ref_absmax, rtol=1e-5, atol=0)
    stored = blockwise.dequantize(codes, absmax, True)
    per_element = ref_absmax.repeat_interleave(blockwise.BLOCK)[: expected.numel()].view(expected.shape)
    beyond = (stored - expected).abs() - 2e-5 * per_element
    ratio = beyond / blockwise.step_size(ref_codes, ref_absmax, True)
    assert float(ratio.max()) <= 2.0
    assert int((codes.long() - ref_codes).abs().max()) <= 3


@pytest.mark.parametrize("graft", ["adam", "adagrad"])
def test_each_step_against_float64_from_the_dequantised_state(graft: str) -> None:
    """Each step of ours against one float64 reference step from the same state (momentum 0.5: the
    parameter's 8-bit momentum buffer too, in blocks of its full tensor): the parameters,
    beyond their own fp32 rounding, within 2e-5 of the step's size, the stored codes the nearest ones
    of the reference's new moments, except at most 1% within 3 codes of it (bitsandbytes' CPU
    quantiser is not an exact nearest search). The floor, measured: the 32-bit optimizer against
    the same reference lands within 2.1e-6 of the step (1.5e-6 and 2.4e-6 with 8 bits; the same
    with OMP_NUM_THREADS=1); 10x margin. ``epsilon`` 1e-3 keeps the early roots of the rank-deficient
    factors well conditioned: at 1e-6 float64 rounding in their null space moved the 32-bit step
    by up to 9e-5 of its size."""
    config = ADAM if graft == "adam" else dist_optim.AdaGradGraftingConfig(epsilon=1e-8)
    params = _params()
    opt = dist_optim.DistributedShampoo(params, grafting_config=config, optim_bits=8, min_8bit_size=0, **KWARGS)
    graft_tuple = ("adam", 0.99, 1e-8) if graft == "adam" else ("adagrad", 0.0, 1e-8)
    ref_kwargs = {k: v for k, v in KWARGS.items() if k != "preconditioner_dtype"}
    worst = 0.0
    not_nearest = total = 0
    for step in range(7):
        ref = ReferenceShampoo(params, graft=graft_tuple, **ref_kwargs)
        ref.state = [_reference_state(opt.state[p]) if opt.state[p] else {} for p in params]
        before = [p.detach().double().clone() for p in params]
        grads = _grads(step)
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        opt.step()
        ref.step(grads)
        for i, (p, expected, w) in enumerate(zip(params, ref.params, before)):
            if grads[i] is None:
                assert torch.equal(p.detach().double(), w)
                continue
            # Beyond the fp32 rounding of the parameter itself (half an ulp), relative to the step.
            scale = float((expected - w).abs().max())
            beyond = (p.detach().double() - expected).abs() - expected.abs() * 2**-24
            worst = max(worst, float(beyond.max()) / scale)
            state = opt.state[p]
            for key, value in state.items():
                name = key.rsplit(".", 1)[-1]
                if value.dtype != torch.uint8:
                    continue
                if name == "momentum_buffer":
                    _check_momentum(value, state[key + "_absmax"], ref.state[i][key])
                    continue
                not_nearest += blockwise.check_codes(value, state[key + "_absmax"], ref.state[i][key], SIGNED[name])
                total += value.numel()
    assert worst <= 2e-5, worst
    assert total > 0 and not_nearest <= 0.01 * total, (not_nearest, total)


def test_soap_moments_are_8bit_and_follow_the_32bit_run() -> None:
    """SOAP's first moment (in the eigenbasis) and second moment are codes; the run stays within
    a few quantisation steps of the 32-bit one (measured 7e-3 of the parameters' range over 6 steps)."""
    runs = []
    for bits in (32, 8):
        params = _params()
        opt = dist_optim.DistributedShampoo(
            params, eigenvalue_correction=True, optim_bits=bits, min_8bit_size=0, **KWARGS
        )
        for step in range(6):
            for p, g in zip(params, _grads(step)):
                p.grad = g
            opt.step()
        runs.append((params, opt))
    (p32, _), (p8, opt8) = runs
    state = opt8.state[p8[0]]
    assert state["block0.exp_avg_eigen"].dtype == torch.uint8 and state["block0.exp_avg_sq"].dtype == torch.uint8
    assert state["block0.exp_avg_sq_absmax"].shape == (47,)
    for a, b in zip(p32, p8):
        assert float((a - b).abs().max()) <= 0.05 * float(a.abs().max())


def test_small_blocks_stay_32bit_and_state_shrinks() -> None:
    params = _params()
    kwargs = dict(KWARGS, grafting_config=ADAM)
    opt = dist_optim.DistributedShampoo(params, optim_bits=8, min_8bit_size=1000, **kwargs)
    plain = dist_optim.DistributedShampoo(_params(), **kwargs)
    for o in (opt, plain):
        for p, g in zip(o.param_groups[0]["params"], _grads(0)):
            p.grad = g
        o.step()
    assert opt.state[params[0]]["block0.exp_avg"].dtype == torch.uint8  # 12000 elements
    assert opt.state[params[1]]["block0.exp_avg"].dtype == torch.float32  # 561 elements
    assert "block0.exp_avg_absmax" not in opt.state[params[1]]
    # The 300 x 40 block's two moments and the parameter's momentum buffer: 4 bytes per element
    # become 1, plus 4 bytes per 256.
    saved = plain.state_bytes()["other"] - opt.state_bytes()["other"]
    assert saved == 3 * (300 * 40 * 3 - 47 * 4)


def test_without_grafting_the_first_moment_stays_32bit() -> None:
    """Without grafting the roots multiply the first moment and nothing bounds the step: its 8-bit
    error, off the factors' span where the exact moment has none, is amplified by up to
    (lam_max / epsilon)^(1/2), and this least-squares problem (A 10 x 5, the issue's report) went
    to Inf within a few steps on every seed. The first moment stays 32-bit (state.keeps_8bit), so
    the run is the 32-bit one bit for bit; the momentum buffer, applied after the roots, stays 8-bit."""
    for seed in range(5):
        torch.manual_seed(seed)
        a, b = torch.randn(10, 5), torch.randn(10)
        runs = []
        for bits in (32, 8):
            x = torch.nn.Parameter(torch.zeros(5))
            opt = dist_optim.DistributedShampoo([x], lr=1e-3, optim_bits=bits, min_8bit_size=0)
            for _ in range(20):
                opt.zero_grad()
                ((a @ x - b) ** 2).sum().backward()
                opt.step()
            runs.append((x, opt))
        (x32, _), (x8, opt8) = runs
        assert opt8.state[x8]["block0.exp_avg"].dtype == torch.float32
        assert "block0.exp_avg_absmax" not in opt8.state[x8]
        assert torch.isfinite(x8).all() and torch.equal(x8, x32)
    x = torch.nn.Parameter(torch.zeros(5))
    opt = dist_optim.DistributedShampoo([x], momentum=0.5, optim_bits=8, min_8bit_size=0)
    x.grad = torch.ones(5)
    opt.step()
    assert opt.state[x]["momentum_buffer"].dtype == torch.uint8
    assert opt.state[x]["block0.exp_avg"].dtype == torch.float32


def test_resume_from_state_dict_and_full_state_is_exact() -> None:
    kwargs = dict(KWARGS, grafting_config=ADAM, momentum=0.5, optim_bits=8, min_8bit_size=0)

    def run(split: int | None, via_full_state: bool = False) -> list[torch.Tensor]:
        params = _params()
        opt = dist_optim.DistributedShampoo(params, **kwargs)
        for step in range(6):
            if step == split:
                fresh = dist_optim.DistributedShampoo(params, **kwargs)
                if via_full_state:
                    fresh.load_full_state(copy.deepcopy(opt.full_state()))
                else:
                    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
                assert fresh.state[params[0]]["block0.exp_avg"].dtype == torch.uint8
                assert fresh.state[params[0]]["block0.exp_avg_absmax"].dtype == torch.float32
                opt = fresh
            for p, g in zip(params, _grads(step)):
                p.grad = g
            opt.step()
        return [p.detach().clone() for p in params]

    reference = run(None)
    for via_full_state in (False, True):
        for a, b in zip(reference, run(3, via_full_state)):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(optim_bits=4), "optim_bits"),
        (dict(optim_bits=True), "optim_bits"),
        (dict(min_8bit_size=-1), "min_8bit_size"),
        (dict(min_8bit_size=2.5), "min_8bit_size"),
    ],
)
def test_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dist_optim.DistributedShampoo([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


#: Shampoo's carried states (first moment, Adam grafting state, momentum buffer) and SOAP's (first
#: moment in the eigenbasis, second moment): options of each run of the carry-over tests.
CARRIED = {
    "shampoo": dict(KWARGS, grafting_config=ADAM, min_8bit_size=0),
    "soap": dict(KWARGS, eigenvalue_correction=True, min_8bit_size=0),
}
MOMENT_SIGNED = {
    "exp_avg": True,
    "exp_avg_eigen": True,
    "graft_sq": False,
    "exp_avg_sq": False,
    "momentum_buffer": True,
}


def _carried_run(kind: str, saved_bits: int, loaded_bits: int, via_full_state: bool, dequantize: bool = False) -> Any:
    """Two steps with ``optim_bits=saved_bits``, the state loaded by a fresh optimizer with
    ``loaded_bits`` (through ``full_state``, or ``state_dict`` without the saved groups'
    ``optim_bits``), then one step: that optimizer and
    its parameters. ``dequantize``: the saved 8-bit entries replaced by their float64 values by
    formula (tests/helpers/blockwise.py), in the 32-bit state's dtypes, before loading."""
    kwargs = CARRIED[kind]
    params = _params()
    opt = dist_optim.DistributedShampoo(params, optim_bits=saved_bits, **kwargs)
    for step in range(2):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
    fresh = dist_optim.DistributedShampoo(params, optim_bits=loaded_bits, **kwargs)
    if via_full_state:
        saved = copy.deepcopy(opt.full_state())
        states = saved
    else:
        saved = copy.deepcopy(opt.state_dict())
        states = list(saved["state"].values())
        # The saved groups' options win, as for any torch option: a group without optim_bits (a
        # state dict saved before it existed) takes the loading optimizer's.
        for group in saved["param_groups"]:
            del group["optim_bits"]
    if dequantize:
        for state in states:
            for key in [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dtype == torch.uint8]:
                name = key.rsplit(".", 1)[-1]
                dtype = torch.float64 if name == "exp_avg_sq" else torch.float32
                values = blockwise.dequantize(state[key], state.pop(key + "_absmax"), MOMENT_SIGNED[name])
                state[key] = values.to(dtype)
    if via_full_state:
        fresh.load_full_state(saved)
    else:
        fresh.load_state_dict(saved)
    for p, g in zip(params, _grads(2)):
        p.grad = g
    fresh.step()
    return fresh, params


def _moments(opt: Any, params: list[torch.nn.Parameter]) -> dict[tuple[int, str], torch.Tensor]:
    """Every carried entry of every parameter, by (parameter index, key)."""
    return {
        (i, key): value
        for i, p in enumerate(params)
        for key, value in opt.state[p].items()
        if key.rsplit(".", 1)[-1] in MOMENT_SIGNED
    }


@pytest.mark.parametrize("via_full_state", [False, True], ids=["state_dict", "full_state"])
@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_a_32bit_state_is_quantised_at_its_first_step(kind: str, via_full_state: bool) -> None:
    """Moments, grafting state and momentum saved at 32 bits, loaded by an 8-bit optimizer: its
    first step updates their saved values (not zeros, not their codes) and stores the result as
    codes, the nearest ones of the 32-bit optimizer's new values (the same step from the same
    state); the parameters equal that step's within 1e-6 of its size beyond one fp32 ulp of the
    parameter (SOAP's second moment, kept in float64 at 32 bits, is updated from its fp32 value:
    the two steps differ by 0 and 2e-8 of the step before the parameters are rounded, and where
    that straddles a rounding boundary the two parameters land one ulp apart, which one Intel
    Xeon's kernels with OMP_NUM_THREADS=1 showed, 2.4e-7 at a step of 0.18)."""
    eight, p8 = _carried_run(kind, 32, 8, via_full_state)
    plain, p32 = _carried_run(kind, 32, 32, via_full_state)
    expected = _moments(plain, p32)
    got = _moments(eight, p8)
    assert set(got) == set(expected) and len(got) >= 8
    not_nearest = total = 0
    for (i, key), codes in got.items():
        assert codes.dtype == torch.uint8, key
        absmax = eight.state[p8[i]][key + "_absmax"]
        name = key.rsplit(".", 1)[-1]
        not_nearest += blockwise.check_codes(codes, absmax, expected[(i, key)].double(), MOMENT_SIGNED[name])
        total += codes.numel()
    assert not_nearest <= 0.01 * total, (not_nearest, total)
    for a, b, w in zip(p8, p32, _params()):
        scale = float((b - w).abs().max())
        ulp = b.detach().abs() * 2**-23  # at least one fp32 ulp of each element
        assert float(((a - b).abs() - ulp).max()) <= 1e-6 * scale


@pytest.mark.parametrize("via_full_state", [False, True], ids=["state_dict", "full_state"])
@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_an_8bit_state_is_dequantised_by_a_32bit_optimizer(kind: str, via_full_state: bool) -> None:
    """Moments, grafting state and momentum saved at 8 bits, loaded by a 32-bit optimizer: they
    are dequantised into the state (no codes, no absmax left) and the step equals the same
    32-bit step from their values dequantised by formula (tests/helpers/blockwise.py): state and
    parameters within fp32 rounding."""
    carried, params = _carried_run(kind, 8, 32, via_full_state)
    reference, ref_params = _carried_run(kind, 8, 32, via_full_state, dequantize=True)
    got, expected = _moments(carried, params), _moments(reference, ref_params)
    assert set(got) == set(expected) and len(got) >= 8
    for key, value in got.items():
        assert value.dtype != torch.uint8 and value.dtype == expected[key].dtype, key
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7)
    assert not any(k.endswith("_absmax") for p in params for k in carried.state[p])
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("saved_bits", "loaded_bits"), [(32, 8), (8, 32)])
def test_full_state_before_the_first_step_is_in_the_loading_width(saved_bits: int, loaded_bits: int) -> None:
    """A state of the other ``optim_bits`` loaded and exported by ``full_state()`` before any step:
    the owner converts its blocks' moments first (every rank exports the form its group keeps),
    and the export loads into an optimizer of that width."""
    kwargs = CARRIED["shampoo"]
    params = _params()
    opt = dist_optim.DistributedShampoo(params, optim_bits=saved_bits, **kwargs)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.step()
    fresh = dist_optim.DistributedShampoo(params, optim_bits=loaded_bits, **kwargs)
    fresh.load_full_state(copy.deepcopy(opt.full_state()))
    exported = fresh.full_state()
    for state in exported:
        for key, value in state.items():
            name = key.rsplit(".", 1)[-1]
            if key.startswith("block") and name in MOMENT_SIGNED:
                assert (value.dtype == torch.uint8) == (loaded_bits == 8), key
                assert (key + "_absmax" in state) == (loaded_bits == 8), key
    again = dist_optim.DistributedShampoo(params, optim_bits=loaded_bits, **kwargs)
    again.load_full_state(copy.deepcopy(exported))
    for p, g in zip(params, _grads(1)):
        p.grad = g
    again.step()


def _carried_layout_worker(case_id: str, saved_bits: int, loaded_bits: int) -> list[str]:
    """The parity grid's run of ``case_id``: steps 0-2 with ``optim_bits=saved_bits`` at tp=2 x
    ZeRO-2, its ``full_state`` loaded by an optimizer with ``loaded_bits`` on the same layout and
    exported again before any step (the owners convert their blocks' moments first), that loaded
    once more, steps 3-5; the full parameters and state against the same sequence on one device
    (codes equal). Collective; returns this rank's failures."""
    import warnings

    from dist_optim import comm
    from tests.helpers import parity
    from tests.helpers.cases import PARITY_CASES

    case = next(c for c in PARITY_CASES if c.id == case_id)
    half = parity.STEPS // 2
    saved, loaded = dict(case.kwargs, optim_bits=saved_bits), dict(case.kwargs, optim_bits=loaded_bits)

    ref_params = [p.clone() for p in parity.full_params("fp32")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the single-device run inside a multi-process job
        ref = parity.make(case.cls, saved, ref_params)
        for step in range(half):
            parity.set_grads(ref_params, step, lambda i, g: g.clone())
            ref.step()
        for _ in range(2):
            states = ref.full_state()
            ref = parity.make(case.cls, loaded, ref_params)
            ref.load_full_state(states)
        for step in range(half, parity.STEPS):
            parity.set_grads(ref_params, step, lambda i, g: g.clone())
            ref.step()
    ref_states = parity.ordered_state(ref, ref_params)

    opt, masters, _, local_grad = parity.build(case.cls, saved, 2, 2, 1, "fp32")
    for step in range(half):
        parity.set_grads(masters, step, local_grad)
        opt.step()
    for _ in range(2):
        states = opt.full_state()
        fulls = comm.gather_full([(opt.layout(p), p) for p in masters])
        opt, masters, _, local_grad = parity.build(case.cls, loaded, 2, 2, 1, "fp32")
        with torch.no_grad():
            for p, full in zip(masters, fulls):
                p.copy_(opt.layout(p).take_local(full).view_as(p))
        opt.load_full_state(states)
    for step in range(half, parity.STEPS):
        parity.set_grads(masters, step, local_grad)
        opt.step()
    label = f"{case_id} {saved_bits} -> {loaded_bits}"
    return parity.compare(label, *parity.full_result(opt, masters), ref_params, ref_states)


@pytest.mark.parametrize(("saved_bits", "loaded_bits"), [(32, 8), (8, 32)])
@pytest.mark.parametrize("case_id", ["shampoo-8bit", "soap-8bit"])
def test_carry_over_on_a_layout_equals_one_device(pool4, case_id: str, saved_bits: int, loaded_bits: int) -> None:
    failures = sorted({f for rank in pool4.run(_carried_layout_worker, case_id, saved_bits, loaded_bits) for f in rank})
    assert not failures, "\n".join(failures)
