"""DistributedShampoo with ``optim_bits=8``: every step against the float64 reference of
tests/helpers/shampoo_reference.py started from our state (the 8-bit moments dequantised by the
format's formula in tests/helpers/blockwise.py, the factors and roots copied), then the stored codes
against the nearest-code quantisation of the reference's new moments; SOAP's moments; which blocks
stay 32-bit; memory; resuming; bad options. The distributed runs equal the single-device one, codes
included, in the parity grid (``shampoo-8bit``, ``soap-8bit`` in tests/helpers/cases.py)."""

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


def test_a_state_dict_of_the_other_width_is_refused_before_loading() -> None:
    """8-bit moments saved by a group that lacks ``optim_bits`` (an older state dict) loaded into a
    32-bit optimizer, and 32-bit moments into an 8-bit one, are refused by name."""
    kwargs = dict(KWARGS, grafting_config=ADAM, min_8bit_size=0)
    runs = {}
    for bits in (8, 32):
        params = _params()
        opt = dist_optim.DistributedShampoo(params, optim_bits=bits, **kwargs)
        for p, g in zip(params, _grads(0)):
            p.grad = g
        opt.step()
        runs[bits] = opt
    for saved_bits, loading_bits in ((8, 32), (32, 8)):
        saved = copy.deepcopy(runs[saved_bits].state_dict())
        for group in saved["param_groups"]:
            del group["optim_bits"]
        with pytest.raises(ValueError, match=f"optim_bits={loading_bits}"):
            runs[loading_bits].load_state_dict(saved)
