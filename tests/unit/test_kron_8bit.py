"""DistributedKron with ``optim_bits=8`` (the momentum as bitsandbytes' block-wise codes).

Kron's preconditioner fit draws random probes, so the whole step is not written out here in
float64 (tests/unit/test_kron.py checks the 32-bit step against kron_torch). What 8 bits changes is
the momentum alone, and that is checked on its own:

* the stored codes against the nearest-code quantisation (by the tests' own formula,
  tests/helpers/blockwise.py) of the float64 momentum update ``b1 m + (1 - b1) g`` from the
  previous codes' values;
* everything else against a 32-bit Kron (same seed, same probes) whose momentum is replaced before
  each step by those values, dequantised by formula: the parameters and the factors equal bit for
  bit, so the direction is computed from the fp32 momentum update, not from its re-quantised value.

Also: a parameter without a gradient, shapes with a partial last block, small tensors staying in
``mu_dtype``, resuming, carrying a state over from the other ``optim_bits``, resharding through
``full_state``, options. The distributed runs equal the single-device one, codes included, in the
parity grid (``kron-8bit`` in tests/helpers/cases.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import dist_optim
from tests.helpers import blockwise
from tests.helpers.cases import PARITY_CASES

pytest.importorskip("bitsandbytes")

# Whole blocks (3840 = 15 x 256) with two triangular factors; a partial last block (561); a vector
# of 2 blocks (a diagonal factor); one partial block (35).
SHAPES = blockwise.SHAPES
KWARGS = dict(lr=1e-2, b1=0.9, weight_decay=1e-2, seed=3)
NONE_GRAD = blockwise.NONE_GRAD
STEPS = 6


_params, _grads = blockwise.params, blockwise.grads


def _momentum(opt: dist_optim.DistributedKron, p: torch.Tensor) -> torch.Tensor:
    """The stored momentum as float64 values (dequantised by formula), zeros before the first step."""
    state = opt.state[p]
    if "momentum_buffer" not in state:
        return torch.zeros(p.shape, dtype=torch.float64)
    return blockwise.dequantize(state["momentum_buffer"], state["momentum_buffer_absmax"], signed=True)


@pytest.mark.parametrize("into_precond", [True, False], ids=["fit-momentum", "fit-gradient"])
def test_each_step_against_32bit_kron_fed_the_dequantised_momentum(into_precond: bool) -> None:
    """Per step: the codes against the nearest-code quantisation of the float64 momentum update
    (absmax to fp32 rounding, a nearest code within half a step, none more than 3 codes away, at
    most 1% not the nearest); the parameters and factors equal to a 32-bit Kron's whose momentum
    was set to the previous codes' values."""
    params8, params32 = _params(), _params()
    opts = dict(KWARGS, momentum_into_precond_update=into_precond)
    opt8 = dist_optim.DistributedKron(params8, optim_bits=8, min_8bit_size=0, **opts)
    opt32 = dist_optim.DistributedKron(params32, **opts)
    b1 = KWARGS["b1"]
    not_nearest = total = 0
    for step in range(STEPS):
        prev = [_momentum(opt8, p) for p in params8]
        for p32, m in zip(params32, prev):
            if opt32.state[p32]:
                opt32.state[p32]["momentum_buffer"] = m.float()
        before = [p.detach().clone() for p in params8]
        grads = _grads(step)
        for p8, p32, g in zip(params8, params32, grads):
            p8.grad = None if g is None else g.clone()
            p32.grad = None if g is None else g.clone()
        opt8.step()
        opt32.step()
        for i, (p8, p32, m_prev, g) in enumerate(zip(params8, params32, prev, grads)):
            state8, state32 = opt8.state[p8], opt32.state[p32]
            if g is None:
                assert torch.equal(p8.detach(), before[i])
                torch.testing.assert_close(_momentum(opt8, p8), m_prev, rtol=0, atol=0)
                continue
            assert torch.equal(p8.detach(), p32.detach()), (step, i)
            factors = sorted(k for k in state32 if k.startswith("Q_"))
            assert factors and all(torch.equal(state8[k], state32[k]) for k in factors), (step, i)
            assert state8["momentum_buffer"].dtype == torch.uint8
            m = b1 * m_prev + (1 - b1) * g.double()
            codes, absmax = state8["momentum_buffer"], state8["momentum_buffer_absmax"]
            not_nearest += blockwise.check_codes(codes, absmax, m, signed=True)
            total += m.numel()
            # The 32-bit run's momentum is the fp32 value the codes quantise.
            assert float((state32["momentum_buffer"].double() - m).abs().max()) <= 2**-20 * float(absmax.max())
    # Codes not the nearest: measured 47 of 27855 (0.17%) either way (bitsandbytes' CPU quantiser).
    assert not_nearest <= 0.01 * total, (not_nearest, total)


def test_small_tensors_stay_in_mu_dtype_and_state_is_8bit() -> None:
    params = _params()
    opt = dist_optim.DistributedKron(params, optim_bits=8, min_8bit_size=1000, mu_dtype=torch.bfloat16, **KWARGS)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.step()
    big, small = opt.state[params[0]], opt.state[params[1]]  # 3840 and 561 elements
    assert big["momentum_buffer"].dtype == torch.uint8
    assert big["momentum_buffer"].shape == params[0].shape
    assert big["momentum_buffer_absmax"].dtype == torch.float32 and big["momentum_buffer_absmax"].shape == (15,)
    assert small["momentum_buffer"].dtype == torch.bfloat16
    assert "momentum_buffer_absmax" not in small
    assert big["Q_0"].dtype == big["Q_1"].dtype == torch.float32  # the factors stay in precond_dtype


def _run(bits: list[int], split: int | None, through_full_state: bool = False) -> list[torch.Tensor]:
    """Six steps, the optimizer rebuilt at step ``split`` with ``bits[1]`` (``bits[0]`` before) from
    the old one's state_dict (or full_state and extra_state)."""
    params = _params()
    opt = dist_optim.DistributedKron(params, optim_bits=bits[0], min_8bit_size=0, **KWARGS)
    for step in range(STEPS):
        if step == split:
            new = dist_optim.DistributedKron(params, optim_bits=bits[1], min_8bit_size=0, **KWARGS)
            if through_full_state:
                new.load_full_state(copy.deepcopy(opt.full_state()))
                new.load_extra_state(copy.deepcopy(opt.extra_state()))
            else:
                new.load_state_dict(copy.deepcopy(opt.state_dict()))
            if bits[0] == 8:
                assert new.state[params[0]]["momentum_buffer"].dtype == torch.uint8
                assert new.state[params[0]]["momentum_buffer_absmax"].dtype == torch.float32
            opt = new
        grads = _grads(step)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        if step == split:  # converted at the parameter's next step with a gradient
            want = torch.uint8 if bits[1] == 8 else torch.float32
            assert all(opt.state[p]["momentum_buffer"].dtype == want for p, g in zip(params, grads) if g is not None)
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("through_full_state", [False, True], ids=["state_dict", "full_state"])
def test_resume_is_exact(through_full_state: bool) -> None:
    for a, b in zip(_run([8, 8], None), _run([8, 8], 3, through_full_state)):
        assert torch.equal(a, b)


def test_a_state_saved_with_the_other_optim_bits_is_carried_over() -> None:
    """A 32-bit momentum loaded by an 8-bit optimizer is quantised at its next step (its values, not
    zeros); an 8-bit one loaded by a 32-bit optimizer is dequantised. Either way the run stays within
    the quantisation's reach of the all-32-bit run, and far from one whose momentum restarts."""
    plain = _run([32, 32], None)
    restarted = _run_momentum_restarted()
    for bits in ([32, 8], [8, 32]):
        mixed = _run(bits, 3)
        for a, b, r in zip(mixed, plain, restarted):
            # Measured 0.007-0.019 of the restart's distance.
            assert float((a - b).abs().max()) < 0.1 * float((r - b).abs().max()), bits


def _run_momentum_restarted() -> list[torch.Tensor]:
    params = _params()
    opt = dist_optim.DistributedKron(params, min_8bit_size=0, **KWARGS)
    for step in range(STEPS):
        if step == 3:
            for p in params:
                opt.state[p]["momentum_buffer"].zero_()
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params]


def test_reshard_through_full_state(pool4) -> None:
    """tp=2 x ZeRO over 2 for three steps, full_state (and the generators) loaded on ZeRO over 4 for
    three more: the single-device run's parameters and state (codes and factors included)."""
    case = next(c for c in PARITY_CASES if c.id == "kron-8bit")
    results = pool4.run(blockwise.reshard_worker, case.cls, case.kwargs, (2, 2, 1), (1, 4, 1))
    failures = sorted({f for rank in results for f in rank})
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(optim_bits=4), "optim_bits must be 32 or 8 .*got 4"),
        (dict(optim_bits=True), "optim_bits must be 32 or 8 .*got True"),
        (dict(optim_bits="8"), "optim_bits must be 32 or 8 .*got '8'"),
        (dict(min_8bit_size=-1), "min_8bit_size must be an integer >= 0, got -1"),
        (dict(min_8bit_size=1.5), "min_8bit_size must be an integer >= 0, got 1.5"),
        (dict(min_8bit_size=False), "min_8bit_size must be an integer >= 0, got False"),
    ],
)
def test_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dist_optim.DistributedKron([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


def _absmax_reductions_worker(repeats: int, bucket_bytes: int | None, optim_bits: int) -> list[list[str]]:
    """tp=2 x ZeRO over 2, ``repeats`` copies of two TP-split matrices and two replicated tensors
    (ZeRO chunks) with 8-bit momenta: per step, the process group ("tp"/"zero") of every
    max-reduction this rank issues, counted where ``torch.distributed`` is called
    (:func:`tests.helpers.collectives.counting_collectives`; the absmax of blocks held in pieces are
    the only maxima Kron reduces)."""
    import torch.distributed as dist

    from dist_optim.testing import grid_groups, tp_zero_chunks
    from tests.helpers.collectives import counting_collectives

    tp_group, dp_group = grid_groups(2, 2)
    shapes = [((8, 6), 0), ((6, 8), 1), ((6,), None), ((5, 3), None)] * repeats
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=gen) for shape, _ in shapes]
    params, layouts = tp_zero_chunks(fulls, [dim for _, dim in shapes], tp_group, dp_group)
    opt = dist_optim.DistributedKron(params, lr=1e-2, optim_bits=optim_bits, min_8bit_size=0, bucket_bytes=bucket_bytes)
    opt.bind(layouts, dp_group=dp_group)
    names = {id(tp_group): "tp", id(dp_group): "zero"}
    steps = []
    for step in range(2):
        for p, full in zip(params, fulls):
            p.grad = opt.layout(p).take_local(full * (step + 1))
        with counting_collectives() as seen:
            opt.step()
        maxima = [c for c in seen.issued if c.name == "all_reduce" and c.op == dist.ReduceOp.MAX]
        steps.append([names.get(id(c.group), "other") for c in maxima])
    return steps


def test_absmax_is_max_reduced_once_per_process_group_and_bucket(pool4) -> None:
    """With ``optim_bits=8`` the block absmax of the momenta held in pieces is max-reduced once
    per process group per bucket, not once per parameter: one bucket makes two reductions (over
    the ZeRO group, then over the TP group) whatever the number of parameters; a bucket per
    parameter (``bucket_bytes=1``) makes two for a TP-split matrix and one for a replicated tensor
    (ZeRO group only). The 32-bit run reduces no maximum."""
    for repeats in (1, 3):
        for rank in pool4.run(_absmax_reductions_worker, repeats, None, 8):
            assert rank == [["zero", "tp"]] * 2, rank
        for rank in pool4.run(_absmax_reductions_worker, repeats, 1, 8):
            assert rank == [["zero", "tp", "zero", "tp", "zero", "zero"] * repeats] * 2, rank
    for rank in pool4.run(_absmax_reductions_worker, 3, None, 32):
        assert rank == [[], []], rank
