"""DistributedMuon with ``optim_bits=8``: each step against a float64 step written from the
algorithm's statement, with the 8-bit format quantised and dequantised by this file's own formula
(blocks of 256 values of the flattened tensor, absmax per block, bitsandbytes' signed dynamic map);
resuming; options. The distributed runs equal the single-device one, codes included, in the parity
grid (``muon-8bit`` in tests/helpers/cases.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import dist_optim
from dist_optim.muon import DEFAULT_NS_COEFFICIENTS
from tests.helpers.muon_reference import _orthogonalize

pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbf  # noqa: E402

BLOCK = 256
SHAPES = [(40, 96), (96, 40), (33, 17)]  # 15 blocks with a partial last one; tall; 561 elements
MAP = bnbf.create_dynamic_map(signed=True).double()
GAPS = MAP.diff()


def _dequantize(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    flat = MAP[codes.reshape(-1).long()]
    scale = absmax.double().repeat_interleave(BLOCK)[: flat.numel()]
    return (flat * scale).view(codes.shape)


def _nearest(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes of the nearest map entry, absmax per block) of float64 ``values``, by formula."""
    flat = values.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, BLOCK)
    absmax = blocks.abs().amax(1)
    normed = (blocks / absmax.clamp_min(1e-300)[:, None]).reshape(-1)[: flat.numel()]
    codes = (normed[:, None] - MAP[None, :]).abs().argmin(1)
    return codes.view(values.shape), absmax


def _step_size(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Per element, the larger gap of the map next to its code, times its block's absmax."""
    c = codes.reshape(-1).long()
    lower = torch.where(c > 0, GAPS[(c - 1).clamp_min(0)], GAPS[0])
    upper = torch.where(c < MAP.numel() - 1, GAPS[c.clamp_max(GAPS.numel() - 1)], GAPS[-1])
    scale = absmax.double().repeat_interleave(BLOCK)[: c.numel()]
    return (torch.maximum(lower, upper) * scale).view(codes.shape)


KWARGS = dict(lr=2e-2, weight_decay=1e-2, momentum=0.95, nesterov=True)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def test_each_step_against_float64_with_the_format_by_formula() -> None:
    """From this step's stored codes (dequantised by formula): the float64 momentum update, ``C``
    and the orthogonalized update of the parameter; then the stored codes against the nearest-code
    quantisation of the float64 momentum: absmax to fp32 rounding; a code that is the nearest
    stands for the value within half a quantisation step; at most 1% of the codes are not the
    nearest and none is more than 3 codes from it (bitsandbytes' CPU kernel is not an exact
    nearest search: measured here 0.1-0.2% of the codes one away, one code two away in 6 steps;
    docs/gpu_smoke.md measured up to 3 away for the signed map)."""
    params = _params()
    opt = dist_optim.DistributedMuon([{"params": params}], optim_bits=8, min_8bit_size=0, **KWARGS)
    mu, lr, wd = KWARGS["momentum"], KWARGS["lr"], KWARGS["weight_decay"]
    worst_param = 0.0
    not_nearest = total = 0
    for step in range(6):
        before = [p.detach().double().clone() for p in params]
        prev = [
            _dequantize(opt.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer_absmax"])
            if opt.state[p]
            else torch.zeros(p.shape, dtype=torch.float64)
            for p in params
        ]
        grads = _grads(step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for p, m_prev, g, w in zip(params, prev, grads, before):
            m = mu * m_prev + g.double()
            c = g.double() + mu * m
            x = _orthogonalize(c, [DEFAULT_NS_COEFFICIENTS] * 5, 1e-7, add=False)
            rows, cols = p.shape
            expected = w * (1 - lr * wd) - lr * max(1.0, rows / cols) ** 0.5 * x
            scale = float((expected - w).abs().max())
            worst_param = max(worst_param, float((p.detach().double() - expected).abs().max()) / scale)
            codes, absmax = opt.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer_absmax"]
            ref_codes, ref_absmax = _nearest(m)
            torch.testing.assert_close(absmax.double(), ref_absmax, rtol=2**-23, atol=0)
            stored = _dequantize(codes, absmax)
            nearest = codes.long() == ref_codes
            # Half a step, plus fp32 rounding of the momentum (ours is updated in fp32): 2^-20 of
            # its block's absmax (measured excess over half a step: 9e-6 of the step, 1e-7 of absmax).
            rounding = ref_absmax.repeat_interleave(BLOCK)[: m.numel()].view(m.shape) * 2**-20
            within = (stored - m).abs() <= _step_size(ref_codes, ref_absmax) * 0.5 + rounding
            assert bool(within[nearest].all())  # the nearest code is within half a step
            assert int((codes.long() - ref_codes).abs().max()) <= 3
            not_nearest += int((~nearest).sum())
            total += codes.numel()
    # fp32 against float64 through the fp32 Newton-Schulz iteration: measured 7.4e-5 of the
    # update's scale (the same with OMP_NUM_THREADS=1); about 10x margin.
    assert worst_param <= 1e-3, worst_param
    assert not_nearest <= 0.01 * total, (not_nearest, total)


def test_small_matrices_stay_32bit_and_state_is_8bit() -> None:
    params = _params()
    opt = dist_optim.DistributedMuon([{"params": params}], optim_bits=8, min_8bit_size=1000, **KWARGS)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.step()
    assert opt.state[params[0]]["momentum_buffer"].dtype == torch.uint8  # 3840 elements
    assert opt.state[params[0]]["momentum_buffer_absmax"].shape == (15,)
    assert opt.state[params[2]]["momentum_buffer"].dtype == torch.float32  # 561 elements
    assert "momentum_buffer_absmax" not in opt.state[params[2]]


def test_resume_from_state_dict_is_exact() -> None:
    def run(split: int | None) -> list[torch.Tensor]:
        params = _params()
        opt = dist_optim.DistributedMuon([{"params": params}], optim_bits=8, min_8bit_size=0, **KWARGS)
        for step in range(6):
            if step == split:
                saved = copy.deepcopy(opt.state_dict())
                opt = dist_optim.DistributedMuon([{"params": params}], optim_bits=8, min_8bit_size=0, **KWARGS)
                opt.load_state_dict(saved)
                assert opt.state[params[0]]["momentum_buffer"].dtype == torch.uint8
            for p, g in zip(params, _grads(step)):
                p.grad = g
            opt.step()
        return [p.detach().clone() for p in params]

    for a, b in zip(run(None), run(3)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(optim_bits=4), "optim_bits"),
        (dict(optim_bits=True), "optim_bits"),
        (dict(min_8bit_size=-1), "min_8bit_size"),
        (dict(min_8bit_size=1.5), "min_8bit_size"),
    ],
)
def test_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dist_optim.DistributedMuon([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)
