"""bitsandbytes' block-wise 8-bit format written out by formula, for the tests of the optimizers'
``optim_bits=8`` (tests/unit/test_lamb_8bit.py, tests/unit/test_came_8bit.py,
tests/unit/test_kron_8bit.py, tests/unit/test_muon_adamw_8bit.py): blocks of 256 values
of the flattened tensor, one absmax per block, the nearest entry of bitsandbytes' dynamic map
(signed for first moments, unsigned for second moments). Only the maps come from bitsandbytes; the
blocks, the nearest-code search and the dequantisation are this file's, not the code under test.

Also a reshard worker: an 8-bit run on one layout, its :meth:`full_state` loaded on another."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dist_optim import comm
from tests.helpers import parity

BLOCK = 256
#: The 8-bit tests' parameters: whole blocks (3840 = 15 x 256), a partial last block (561), a vector
#: of 2 blocks (300) and one partial block (35).
SHAPES = [(40, 96), (33, 17), (300,), (5, 7)]
NONE_GRAD = (3, 1)  # at step 3, param 1 gets no gradient


def params(seed: int = 0, shapes: Sequence[tuple[int, ...]] = SHAPES) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` (default :data:`SHAPES`), drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def grads(
    step: int,
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    none: tuple[int, int] = NONE_GRAD,
    growing: bool = True,
) -> list[torch.Tensor | None]:
    """The gradients of ``step`` for :func:`params` of ``shapes``, with ``growing`` scaled by
    ``step + 1`` (so the block absmax changes), None for the (step, parameter) of ``none``."""
    gen = torch.Generator().manual_seed(100 + step)
    scale = step + 1 if growing else 1
    out: list[torch.Tensor | None] = [torch.randn(s, generator=gen) * scale for s in shapes]
    if step == none[0]:
        out[none[1]] = None
    return out


def qmap(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic map in float64."""
    import bitsandbytes.functional as bnbf

    return bnbf.create_dynamic_map(signed=signed).double()


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """float64 values of ``codes`` with the block absmax ``absmax``."""
    flat = qmap(signed)[codes.reshape(-1).long()]
    scale = absmax.double().repeat_interleave(BLOCK)[: flat.numel()]
    return (flat * scale).view(codes.shape)


def nearest(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes of the nearest map entry, absmax per block) of float64 ``values``."""
    table = qmap(signed)
    flat = values.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, BLOCK)
    absmax = blocks.abs().amax(1)
    normed = (blocks / absmax.clamp_min(1e-300)[:, None]).reshape(-1)[: flat.numel()]
    codes = (normed[:, None] - table[None, :]).abs().argmin(1)
    return codes.view(values.shape), absmax


def step_size(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """Per element, the larger gap of the map next to its code, times its block's absmax."""
    gaps = qmap(signed).diff()
    c = codes.reshape(-1).long()
    lower = torch.where(c > 0, gaps[(c - 1).clamp_min(0)], gaps[0])
    upper = torch.where(c < gaps.numel(), gaps[c.clamp_max(gaps.numel() - 1)], gaps[-1])
    scale = absmax.double().repeat_interleave(BLOCK)[: c.numel()]
    return (torch.maximum(lower, upper) * scale).view(codes.shape)


def check_codes(codes: torch.Tensor, absmax: torch.Tensor, expected: torch.Tensor, signed: bool) -> int:
    """Stored ``codes``/``absmax`` against the float64 moment ``expected``: absmax to fp32
    rounding, a code that is the nearest within half a step (plus the fp32 rounding of a moment
    updated in fp32: 2^-20 of its block's absmax), none more than 3 codes from the nearest
    (bitsandbytes' CPU quantiser is not an exact nearest search), except the unsigned map's floor
    below. Returns how many codes are neither the nearest nor at that floor."""
    ref_codes, ref_absmax = nearest(expected, signed)
    torch.testing.assert_close(absmax.double(), ref_absmax, rtol=2**-22, atol=0)
    stored = dequantize(codes, absmax, signed)
    is_nearest = codes.long() == ref_codes
    rounding = ref_absmax.repeat_interleave(BLOCK)[: expected.numel()].view(expected.shape) * 2**-20
    within = (stored - expected).abs() <= step_size(ref_codes, ref_absmax, signed) * 0.5 + rounding
    assert bool(within[is_nearest].all()), "a nearest code further than half a step"
    off = ~is_nearest
    if not signed:
        # bitsandbytes' CPU quantiser gives the unsigned map's code 7 (1.6e-5 of the absmax) to
        # every value below about 3e-5 of it, zero included, where the nearest is one of 0-8.
        off &= ~((codes.long() == 7) & (ref_codes <= 8))
    assert not bool((off & ((codes.long() - ref_codes).abs() > 3)).any()), "a code more than 3 from the nearest"
    return int(off.sum())


def reshard_worker(
    cls: type, kwargs: dict[str, Any], first: tuple[int, int, int], then: tuple[int, int, int]
) -> list[str]:
    """Steps 0-2 of the parity grid's run on layout ``first`` (tp, dp, ZeRO), its
    :meth:`full_state`, :meth:`extra_state` and parameters loaded into an optimizer on layout
    ``then``, steps 3-5 there; the full parameters and state against the single-device run of the
    six steps (codes equal). Collective; returns this rank's failures."""
    half = parity.STEPS // 2
    opt, masters, _, local_grad = parity.build(cls, kwargs, *first, "fp32")
    for step in range(half):
        parity.set_grads(masters, step, local_grad)
        opt.step()
    states = opt.full_state()
    fulls = comm.gather_full([(opt.layout(p), p) for p in masters])
    opt2, masters2, _, local_grad2 = parity.build(cls, kwargs, *then, "fp32")
    with torch.no_grad():
        for p, full in zip(masters2, fulls):
            p.copy_(opt2.layout(p).take_local(full).view_as(p))
    opt2.load_full_state(states)
    # The optimizer-level state (Kron's generators and update counters; the skipped-step counter).
    opt2.load_extra_state(opt.extra_state())
    for step in range(half, parity.STEPS):
        parity.set_grads(masters2, step, local_grad2)
        opt2.step()
    ref_params, ref_states = parity.reference(cls, kwargs, "fp32")
    failures = parity.compare(f"{first} -> {then}", *parity.full_result(opt2, masters2), ref_params, ref_states)
    eight = sum(v.dtype == torch.uint8 for s in ref_states for v in s.values() if isinstance(v, torch.Tensor))
    if not eight:
        failures.append("no 8-bit state in the reference run: the case tests nothing")
    return failures
