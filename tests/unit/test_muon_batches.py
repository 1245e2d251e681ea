"""Muon's Newton-Schulz iteration in batches (``newton_schulz.newton_schulz_many``): on a GPU the
matrices of one shape iterate as one stack, since a step of small matrices is bound by its kernel
launches there, and so do bfloat16 iterations on the CPU, whose batched products are faster there
(``newton_schulz.CPU_BATCHED_DTYPES``). The batched path is forced on this CPU in the other dtypes
(``batch=True``, or ``batches`` monkeypatched for the optimizer); the CPU's fp32 and Gram-space
paths must stay the per-matrix iteration bit for bit. Launches are counted at torch
(``torch.bmm`` and friends), accuracy against float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dist_optim import DistributedMuon
from dist_optim.kernels import newton_schulz
from dist_optim.muon import DEFAULT_NS_COEFFICIENTS
from tests.helpers.check import assert_close
from tests.helpers.muon_reference import DEFAULTS, MuonReference

COEFFS = [DEFAULT_NS_COEFFICIENTS] * 5
#: Both sides in float64: the batched and the per-matrix iteration measured within 2e-16 of each
#: other and of the reference (tests/unit/test_muon.py's FLOAT64_RTOL, 1e-12, leaves 75x or more).
FLOAT64_RTOL = 1e-12
#: A batched matrix's relative Frobenius distance to the float64 iteration, against the per-matrix
#: iteration's own in the same dtype: measured 0.86-1.06x in fp32 (tall matrices, stored
#: transposed in the stack) and 1.00x in bfloat16 on this CPU; 1.5 leaves a margin for other BLAS.
ACCURACY_RATIO = 1.5
#: Wide, tall (the same matrix transposed), square, and shapes of one matrix each.
SHAPES = [(24, 40), (40, 24), (24, 40), (32, 32), (32, 32), (20, 70), (48, 20)]


class _Calls(TorchFunctionMode):
    """The calls of each torch function, by name, at torch (``x @ y`` counts as ``matmul``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        self.count[name] = self.count.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _matrices(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]


def _products(calls: _Calls) -> dict[str, int]:
    names = ("bmm", "baddbmm", "mm", "addmm", "matmul")
    return {n: calls.count.get(n, 0) for n in names if calls.count.get(n, 0)}


def test_which_iterations_go_in_batches() -> None:
    """``batches``: on a GPU every iteration; on the CPU and meta tensors (the planner's, which
    follow the CPU) the bfloat16 iteration of the formula (``dtype``, else the matrix's own), not
    fp32/fp64/float16 nor Gram space (whose blocked products a batch would give up)."""
    for device in ("cpu", "meta"):
        f32 = torch.empty(4, 6, device=device)
        bf16 = torch.empty(4, 6, device=device, dtype=torch.bfloat16)
        assert newton_schulz.iterates_batched(bf16) and newton_schulz.iterates_batched(f32, torch.bfloat16)
        assert not newton_schulz.iterates_batched(f32) and not newton_schulz.iterates_batched(bf16, torch.float32)
        assert not newton_schulz.iterates_batched(f32, torch.float16)
        assert not newton_schulz.iterates_batched(f32, torch.float64)
        assert not newton_schulz.iterates_batched(bf16, gram_space=True)
    if torch.cuda.is_available():
        on_gpu = torch.empty(4, 6, device="cuda")
        assert newton_schulz.iterates_batched(on_gpu) and newton_schulz.iterates_batched(on_gpu, torch.bfloat16, True)


def test_the_cpus_path_is_each_matrix_on_its_own_bit_for_bit_but_in_bfloat16() -> None:
    """Without ``batch``, on the CPU: in fp32, float16, and with Gram space in bfloat16, every
    matrix is ``newton_schulz``'s bit for bit and no batched product runs; the bfloat16 formula
    runs in batches (three batched products per iteration for each stack of one shape) and is as
    accurate as one matrix at a time (test_batched_matrices_are_as_accurate_as_one_at_a_time)."""
    cs = _matrices() + [torch.randn(300, 200)]  # 200 rows: blocked symmetric products
    for dtype, gram_space in ((None, False), (None, True), (torch.float16, False), (torch.bfloat16, True)):
        with _Calls() as calls:
            got = newton_schulz.newton_schulz_many(cs, COEFFS, 1e-7, "max", dtype, gram_space)
        assert "bmm" not in calls.count and "baddbmm" not in calls.count, (dtype, gram_space)
        for c, x in zip(cs, got):
            assert torch.equal(x, newton_schulz.newton_schulz(c, COEFFS, 1e-7, "max", dtype, gram_space))
    with _Calls() as calls:
        got = newton_schulz.newton_schulz_many(cs, COEFFS, 1e-7, "max", torch.bfloat16)
    # two stacks (the two wide 24 x 40, the two 32 x 32; the tall 40 x 24 alone on a CPU): a bmm and
    # two baddbmm per iteration each
    assert calls.count.get("bmm") == 2 * len(COEFFS) and calls.count.get("baddbmm") == 4 * len(COEFFS)
    assert [x.shape for x in got] == [c.shape for c in cs] and all(x.dtype == torch.bfloat16 for x in got)
    # Each matrix's own dtype decides (no ns_dtype): the fp32 ones of a mixed list stay per matrix
    # whichever comes first, the bfloat16 ones form one stack.
    mixed = [cs[0], cs[2].bfloat16(), cs[2], cs[0].bfloat16()]  # two of each dtype, 24 x 40
    for order in (mixed, mixed[::-1]):
        with _Calls() as calls:
            got = newton_schulz.newton_schulz_many(order, COEFFS, 1e-7, "max")
        assert calls.count.get("bmm") == len(COEFFS)
        for c, x in zip(order, got):
            if c.dtype == torch.float32:
                assert torch.equal(x, newton_schulz.newton_schulz(c, COEFFS, 1e-7, "max"))


@pytest.mark.parametrize("like_a_gpu", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps_form", ["max", "add"])
def test_batched_matrices_are_as_accurate_as_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, eps_form: str, like_a_gpu: bool
) -> None:
    """Forced batches, SHAPES and a second 40 x 24 (a CPU stacks the tall pair in its own
    orientation and iterates its transposed view; ``like_a_gpu``, ``blocked`` patched False, the
    tall ones are stored transposed among the wide 24 x 40): each matrix's result (its own shape,
    tall ones transposed back) is within ACCURACY_RATIO of the per-matrix iteration's relative
    Frobenius distance to the float64 iteration, over three draws; in float64 both agree
    element-wise at FLOAT64_RTOL."""
    if like_a_gpu:
        monkeypatch.setattr(newton_schulz, "blocked", lambda t: False)
    for seed in range(3):
        cs = _matrices(seed=seed)
        cs.append(torch.randn(40, 24, generator=torch.Generator().manual_seed(50 + seed)))
        ref = [newton_schulz.newton_schulz(c.double(), COEFFS, 1e-7, eps_form) for c in cs]
        one = [newton_schulz.newton_schulz(c, COEFFS, 1e-7, eps_form, dtype) for c in cs]
        got = newton_schulz.newton_schulz_many(cs, COEFFS, 1e-7, eps_form, dtype, batch=True)
        assert [tuple(x.shape) for x in got] == [*SHAPES, (40, 24)] and all(x.dtype == dtype for x in got)
        for c, r, o, x in zip(cs, ref, one, got):
            err = float((x.double() - r).norm() / r.norm())
            bound = ACCURACY_RATIO * float((o.double() - r).norm() / r.norm())
            assert err <= bound, (tuple(c.shape), err, bound)
        wide = newton_schulz.newton_schulz_many([c.double() for c in cs], COEFFS, 1e-7, eps_form, batch=True)
        for r, x in zip(ref, wide):
            assert_close(x, r, rtol=FLOAT64_RTOL)


class _Copies(TorchDispatchMode):
    """The aten ``copy_`` calls whose source is a transposed matrix (not contiguous in its last two
    dims), counted at torch's dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.transposing = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default and args[1].dim() >= 2 and args[1].stride(-1) != 1:
            self.transposing += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("like_a_gpu", [False, True])
def test_batches_are_the_matrices_of_one_shape(monkeypatch: pytest.MonkeyPatch, like_a_gpu: bool) -> None:
    """Forced batches of SHAPES: one stack for the two 32 x 32, and for the 24 x 40: like a GPU
    (``blocked`` patched False) one of all three, the tall 40 x 24 stored transposed; on a CPU,
    whose transposing copies are slow, one of the two wide ones, the tall one alone (two tall ones
    stack in their own orientation: no copy reads a transposed matrix, counted at torch's
    dispatcher). Three batched products per iteration per stack (bfloat16: ``A``, then two
    ``baddbmm``); the 20 x 70 and the 48 x 20 alone, three products per iteration each. A stack
    over BATCH_BYTES splits; with Gram space a wide 20 x 70 (ratio 3.5) still goes alone."""
    if like_a_gpu:
        monkeypatch.setattr(newton_schulz, "blocked", lambda t: False)
    cs = _matrices()
    steps = len(COEFFS)
    alone = 2 if like_a_gpu else 3
    with _Calls() as calls:
        newton_schulz.newton_schulz_many(cs, COEFFS, 1e-7, "max", torch.bfloat16, batch=True)
    assert _products(calls) == {
        "bmm": 2 * steps,
        "baddbmm": 4 * steps,
        "matmul": alone * steps,
        "addmm": 2 * alone * steps,
    }
    # fp32: the polynomial as a product, a scale and a sum (as the per-matrix fp32 iteration)
    with _Calls() as calls:
        newton_schulz.newton_schulz_many(cs, COEFFS, 1e-7, "max", None, batch=True)
    assert calls.count["bmm"] == 4 * steps and calls.count["baddbmm"] == 2 * steps
    tall = [cs[1], cs[1] * 0.5]
    with _Calls() as calls, _Copies() as copies:
        newton_schulz.newton_schulz_many(tall, COEFFS, 1e-7, "max", torch.bfloat16, batch=True)
    assert calls.count.get("bmm") == steps and (copies.transposing > 0) == like_a_gpu
    # two 24 x 40 fp32 matrices fill a batch: the third goes alone (a run of one), on a CPU too
    monkeypatch.setattr(newton_schulz, "BATCH_BYTES", 2 * 24 * 40 * 4)
    with _Calls() as calls:
        newton_schulz.newton_schulz_many([cs[0], cs[2], cs[0]], COEFFS, 1e-7, "max", torch.bfloat16, batch=True)
    assert _products(calls) == {"bmm": steps, "baddbmm": 2 * steps, "matmul": steps, "addmm": 2 * steps}
    monkeypatch.undo()
    with _Calls() as calls:
        newton_schulz.newton_schulz_many(cs[5:6] * 2, COEFFS, 1e-7, "max", torch.bfloat16, True, batch=True)
    assert "bmm" not in calls.count and "baddbmm" not in calls.count


def _feed(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(200 + step)
    for i, p in enumerate(params):
        p.grad = None if (step == 3 and i == 1) else torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1


@pytest.mark.parametrize("stacked", [False, True])
def test_batched_steps_match_the_float64_reference(monkeypatch: pytest.MonkeyPatch, stacked: bool) -> None:
    """DistributedMuon with batches forced (``batches`` True, as on a GPU) over 8 float64 steps,
    one with a ``None`` gradient: parameters and momenta element-wise at FLOAT64_RTOL against the
    reference (tests/helpers/muon_reference.py); the step ran batched products (counted at torch)."""
    monkeypatch.setattr(newton_schulz, "iterates_batched", lambda t, dtype=None, gram_space=False: True)
    shapes = [(6, 10), (10, 6), (6, 10), (4, 3, 2, 2), (4, 3, 2, 2), (7, 7), (5,)]
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen, dtype=torch.float64) * 0.3 for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]

    def groups(ps: list[torch.Tensor]) -> list[dict[str, Any]]:
        return [
            {"params": ps[:5], "stacked": stacked},
            {"params": ps[5:6], "lr": 2e-3},
            {"params": ps[6:], "use_muon": False, "lr": 3e-3},
        ]

    opt = DistributedMuon(groups(ours))
    ref = MuonReference([{**DEFAULTS, "use_muon": True, **g} for g in groups(theirs)])
    batched = 0
    for step in range(8):
        _feed(ours, step)
        _feed(theirs, step)
        with _Calls() as calls:
            opt.step()
        batched += calls.count.get("bmm", 0)
        ref.step()
    assert batched > 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a.detach(), b.detach(), rtol=FLOAT64_RTOL, msg=f"param {i}")
        rs = ref.state[id(b)]
        key = "momentum_buffer" if "momentum_buffer" in rs else "exp_avg"
        assert_close(opt.state[a][key], rs[key], rtol=FLOAT64_RTOL, msg=f"param {i} {key}")
    assert all(not torch.equal(a.detach(), t) for a, t in zip(ours, init))


DTYPE_PAIRS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, None)]


@pytest.mark.parametrize(("param_dtype", "ns_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize(("ema", "nesterov_sum"), [(False, False), (True, False), (True, True), (False, True)])
def test_momenta_and_updates_together_are_the_per_matrix_step_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
    param_dtype: torch.dtype,
    ns_dtype: torch.dtype | None,
    ema: bool,
    nesterov_sum: bool,
) -> None:
    """On the CPU the momenta (``torch._foreach_*`` per param group) and the updates (per factor
    and step size) give each matrix's own step bit for bit: momentum, Newton-Schulz, weight decay
    and ``-adjusted_lr`` times the update, a narrower update added by promotion and a wider one
    rounded to the parameter's dtype first. Written per matrix from public pieces, 3 steps."""
    from dist_optim.muon import adjusted_lr
    from dist_optim.muon.momentum import momentum_direction

    # The batches' rounding (bfloat16 on the CPU) is test_batched_matrices_are_as_accurate_as_one_at_a_time's.
    monkeypatch.setattr(newton_schulz, "iterates_batched", lambda t, dtype=None, gram_space=False: False)
    gen = torch.Generator().manual_seed(2)
    shapes = [(6, 10), (10, 6), (7, 7)]
    init = [torch.randn(s, generator=gen).to(param_dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(param_dtype) for s in shapes] for _ in range(3)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    options = dict(
        lr=0.02,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=True,
        momentum_ema=ema,
        nesterov_sum=nesterov_sum,
        ns_dtype=ns_dtype,
    )
    opt = DistributedMuon(params, **options)  # type: ignore[arg-type]
    want = [t.clone() for t in init]
    bufs = [torch.zeros_like(t) for t in init]
    group = dict(opt.param_groups[0])
    for step in range(3):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
        for i, (w, g) in enumerate(zip(want, grads[step])):
            c = momentum_direction(bufs[i], g, group)
            x = newton_schulz.newton_schulz(c, COEFFS, 1e-7, "max", ns_dtype)
            w.mul_(1 - 0.02 * 0.1)
            w.add_(x.to(w.dtype), alpha=-adjusted_lr(0.02, None, *w.shape))
    for i, (p, w) in enumerate(zip(params, want)):
        assert torch.equal(p.detach(), w), i
        assert torch.equal(opt.state[p]["momentum_buffer"], bufs[i]), i
