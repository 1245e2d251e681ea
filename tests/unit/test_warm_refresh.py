"""The warm-started refresh (``root_inverse="warm"`` / ``eigenbasis="warm"``,
:func:`dist_optim.kernels.matrix_functions.warm_eigh`): the criterion and the roots checked with this
file's own float64 formulas (which form ``B = Q^T A Q``; the code does not), the recomputation
against ``eigh`` bit for bit, skipped ``eigh`` calls counted at ``torch.linalg``, resuming, and bad
options. The distributed runs
equal the single-device one in the parity grid (``shampoo-warm``, ``soap-warm`` in
tests/helpers/cases.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import dist_optim
from dist_optim.kernels import matrix_functions

SHAPES = {"w": (12, 7), "v": (9,), "t": (3, 4, 5)}


def _psd(d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(d, 2 * d, generator=gen, dtype=torch.float64)
    return g @ g.T / d


def _ratio(b: torch.Tensor) -> float:
    """||B - diag(B)||_F / ||B||_F, written out."""
    off = b - torch.diag(torch.diagonal(b))
    return float(off.square().sum().sqrt() / b.square().sum().sqrt())


def _perturbed(a: torch.Tensor, size: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(a.shape, generator=gen, dtype=a.dtype)
    return a + size * (e @ e.T) / a.shape[0]


def test_previous_eigenvectors_kept_within_the_tolerance() -> None:
    a = _psd(40, 0)
    _, q = torch.linalg.eigh(a)
    a2 = _perturbed(a, 0.02, 1)
    measured = _ratio(q.T @ a2 @ q)
    assert 0 < measured < 0.5
    kept = matrix_functions.warm_eigh(a2, q, tolerance=measured * 1.01, max_iterations=3)
    assert kept.iterations == 0 and not kept.recomputed and kept.perm is None
    assert torch.equal(kept.eigenvectors, q)
    torch.testing.assert_close(kept.eigenvalues, torch.diagonal(q.T @ a2 @ q), rtol=1e-13, atol=0)


def test_criteria_read_together_decide_as_each_alone() -> None:
    """warm_criteria over pairs of two dtypes and three sizes, two kept and one not at one
    tolerance (between their ratios by this file's float64 formula): the decisions that formula
    makes, each pair's ``d`` bit for bit that of warm_criteria on the pair alone, and a kept pair's
    warm_eigh given its criterion returns it as it is."""
    pairs, ratios = [], []
    for i, (d, dtype, size) in enumerate(
        ((40, torch.float64, 0.005), (30, torch.float32, 0.1), (50, torch.float32, 0.005))
    ):
        a = _psd(d, 10 + i)
        _, q = torch.linalg.eigh(a)
        a2 = _perturbed(a, size, 20 + i)
        ratios.append(_ratio(q.T @ a2 @ q))
        pairs.append((a2.to(dtype), q.to(dtype)))
    assert max(ratios[0], ratios[2]) < ratios[1] / 2, ratios
    tol = (max(ratios[0], ratios[2]) + ratios[1]) / 2
    together = matrix_functions.warm_criteria(pairs, tol)
    assert [c.keep for c in together] == [True, False, True]
    for pair, c in zip(pairs, together):
        (alone,) = matrix_functions.warm_criteria([pair], tol)
        assert alone.keep == c.keep and torch.equal(alone.eigenvalues, c.eigenvalues)
        res = matrix_functions.warm_eigh(*pair, tolerance=tol, max_iterations=0, criterion=c)
        assert res.kept == c.keep
        if c.keep:
            assert res.eigenvalues is c.eigenvalues and res.eigenvectors is pair[1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_criterion_is_the_off_diagonal_ratio_of_q_t_a_q(dtype: torch.dtype) -> None:
    """Kept exactly when ``||B - diag B||_F <= tol ||B||_F`` for ``B = Q^T A Q`` (this file's
    float64 formula, which forms ``B``; the code tests ``||A Q - Q diag(d)||_F <= tol ||A||_F``
    without it): a tolerance 1% above the measured ratio keeps, 1% below recomputes, in float64 and
    fp32, at a size past the blocked products and at a ratio near the default tolerance."""
    for d, size, seed in ((40, 0.02, 1), (300, 0.004, 2)):
        a = _psd(d, seed)
        _, q = torch.linalg.eigh(a)
        a2 = _perturbed(a, size, seed + 10)
        measured = _ratio(q.T @ a2 @ q)
        assert 1e-3 < measured < 0.2
        for factor, kept in ((1.01, True), (0.99, False)):
            res = matrix_functions.warm_eigh(a2.to(dtype), q.to(dtype), tolerance=measured * factor, max_iterations=0)
            assert res.kept == kept and res.recomputed != kept, (d, factor)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_criterion_of_a_shifted_matrix_is_that_of_the_matrix_formed(dtype: torch.dtype) -> None:
    """``Shifted(M, s, e)`` (a refresh's ``s L + e I``, not formed; the code drops the shift from the
    residual and takes ``||A||_F`` from ``M``'s norm and trace) decides as this file's float64
    formula on ``B = Q^T (s M + e I) Q`` formed: a tolerance 1% above the measured ratio keeps, 1%
    below recomputes; ``d`` is ``diag(B)`` (float64: to 1e-12 relative; fp32: to 1e-5); with work
    tensors the same bits as without. The shift is large enough that leaving it out of the ratio
    (the ratio of ``M`` alone) moves the ratio by more than 5% (asserted); leaving the scale out of
    the residual moves it by the factor ``s`` (2.5 and 0.4)."""
    for d, size, seed, scale, shift in ((40, 0.02, 1, 2.5, 3.0), (300, 0.01, 2, 0.4, 0.8)):
        m = _psd(d, seed)
        _, q = torch.linalg.eigh(m)
        m2 = _perturbed(m, size, seed + 10)
        a = scale * m2 + shift * torch.eye(d, dtype=torch.float64)
        b = q.T @ a @ q
        measured = _ratio(b)
        assert 1e-3 < measured < 0.2 and abs(_ratio(q.T @ m2 @ q) / measured - 1) > 0.05
        shifted = matrix_functions.Shifted(m2.to(dtype), scale, shift)
        for factor, kept in ((1.01, True), (0.99, False)):
            (c,) = matrix_functions.warm_criteria([(shifted, q.to(dtype))], measured * factor)
            assert c.keep == kept, (d, factor)
        d_plain, ratio = matrix_functions.residual_ratio(shifted, q.to(dtype))
        rtol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(d_plain.double(), torch.diagonal(b), rtol=rtol, atol=0)
        work = (torch.empty(d, d, dtype=dtype), torch.empty(d, d, dtype=dtype))
        d_work, ratio_work = matrix_functions.residual_ratio(shifted, q.to(dtype), work)
        assert torch.equal(d_work, d_plain) and torch.equal(ratio_work, ratio)


def test_a_root_made_in_work_tensors_is_the_root_made_without() -> None:
    """inverse_root_from_eigen with ``work`` (a warm root refresh's scratch) returns its first
    tensor holding the bits of the root made without it (fp32, past the blocked products)."""
    a = _psd(300, 7).float()
    lam, q = torch.linalg.eigh(a)
    work = (torch.empty(300, 300), torch.empty(300, 300))
    got = matrix_functions.inverse_root_from_eigen(lam, q, 1e-6, 0.25, work)
    assert got is work[0]
    assert torch.equal(got, matrix_functions.inverse_root_from_eigen(lam, q, 1e-6, 0.25))


@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_symmetric_eigh_is_eigh_in_lapacks_layout(n: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """symmetric_eigh of an exactly symmetric matrix is ``torch.linalg.eigh``'s result bit for bit,
    row-major or column-major, and eigh is handed the column-major one (its copy of the input into
    the eigenvector buffer then straight); the eigenvectors come back column-major."""
    a = matrix_functions.symmetric_part(_psd(n, 11).to(dtype))
    lam, vec = torch.linalg.eigh(a)
    seen: list[tuple[int, ...]] = []
    eigh = torch.linalg.eigh

    def recording(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(x.stride())
        return eigh(x)

    monkeypatch.setattr(torch.linalg, "eigh", recording)
    for given in (a, a.mT.contiguous().mT):
        got_lam, got_vec = matrix_functions.symmetric_eigh(given)
        assert torch.equal(got_lam, lam) and torch.equal(got_vec, vec)
        assert got_vec.mT.is_contiguous()
    assert seen == [(1, n), (1, n)]


def test_column_major_eigenvectors_are_read_in_their_own_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """all_finite reads a column-major matrix through its transpose (same entries) and finds a NaN
    or an infinity anywhere in it; inverse_root_from_eigen writes ``Q diag(s)`` in ``q``'s layout:
    column-major for eigh's eigenvectors, row-major for a row-major basis."""
    a = _psd(50, 3).float()
    lam, q = torch.linalg.eigh(a)
    assert matrix_functions.column_major(q) and not matrix_functions.column_major(q.contiguous())
    assert not matrix_functions.column_major(torch.ones(1, 1).mT) and not matrix_functions.column_major(lam)
    seen: list[bool] = []
    aminmax = torch.aminmax

    def recording(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(x.is_contiguous())
        return aminmax(x)

    monkeypatch.setattr(torch, "aminmax", recording)
    assert bool(matrix_functions.all_finite(q))
    assert seen == [True]
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = q.clone(memory_format=torch.preserve_format)
        assert matrix_functions.column_major(broken)
        broken[17, 3] = bad
        assert not bool(matrix_functions.all_finite(broken))
    spectrum = matrix_functions.inverse_root_spectrum(lam, 1e-6, 0.25)
    for basis in (q, q.contiguous()):
        work = (torch.empty(50, 50), torch.empty(50, 50))
        matrix_functions.inverse_root_from_eigen(lam, basis, 1e-6, 0.25, work)
        laid = work[1].mT if matrix_functions.column_major(basis) else work[1]
        assert torch.equal(laid, basis * spectrum)


def test_qr_steps_meet_the_tolerance_they_report() -> None:
    a = _psd(40, 2)
    _, q = torch.linalg.eigh(a)
    a2 = _perturbed(a, 0.05, 3)
    start = _ratio(q.T @ a2 @ q)
    tol = start / 3
    res = matrix_functions.warm_eigh(a2, q, tolerance=tol, max_iterations=50)
    assert not res.recomputed and 1 <= res.iterations <= 50
    v = res.eigenvectors
    torch.testing.assert_close(v.T @ v, torch.eye(40, dtype=torch.float64), rtol=0, atol=1e-12)
    b = v.T @ a2 @ v
    assert _ratio(b) <= tol * (1 + 1e-9)
    torch.testing.assert_close(res.eigenvalues, torch.diagonal(b), rtol=1e-10, atol=1e-12)
    # The columns were sorted by decreasing diag(Q^T A Q) before the steps (eigh's q is increasing).
    assert res.perm is not None
    assert torch.equal(res.perm, torch.argsort(torch.diagonal(q.T @ a2 @ q), descending=True, stable=True))


def test_unmet_tolerance_recomputes_by_eigh_bit_for_bit() -> None:
    a = matrix_functions.symmetric_part(_psd(30, 4))  # exactly symmetric, as a refresh's target is
    basis = torch.linalg.qr(torch.randn(30, 30, generator=torch.Generator().manual_seed(5), dtype=torch.float64))[0]
    for steps in (0, 2):
        res = matrix_functions.warm_eigh(a, basis, tolerance=1e-12, max_iterations=steps)
        lam, vec = torch.linalg.eigh(a)
        assert res.recomputed and res.iterations == steps and res.perm is None
        assert torch.equal(res.eigenvalues, lam) and torch.equal(res.eigenvectors, vec)


def _grads(steps: int, drift: float, none_at: int | None = 2) -> list[dict[str, torch.Tensor | None]]:
    """A persistent gradient plus fresh noise of relative size ``drift`` each step (the factors'
    eigenvectors move a little between refreshes); "w" has none at step ``none_at``."""
    gen = torch.Generator().manual_seed(11)
    base = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    return [
        {
            k: None if (k == "w" and t == none_at) else b + drift * torch.randn(b.shape, generator=gen, dtype=b.dtype)
            for k, b in base.items()
        }
        for t in range(steps)
    ]


def _run(kwargs: dict, grads: list, *, resume_at: int | None = None, dtype: torch.dtype = torch.float64):
    gen = torch.Generator().manual_seed(3)
    params = {k: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for k, s in SHAPES.items()}
    opt = dist_optim.DistributedShampoo(list(params.values()), **kwargs)
    for t, g in enumerate(grads):
        if resume_at is not None and t == resume_at:
            saved = copy.deepcopy(opt.state_dict())
            opt = dist_optim.DistributedShampoo(list(params.values()), **kwargs)
            opt.load_state_dict(saved)
        for k, p in params.items():
            p.grad = g[k]
        opt.step()
    return params, opt


SHAMPOO = dict(
    lr=1e-2,
    epsilon=1e-6,
    max_preconditioner_dim=6,
    precondition_frequency=2,
    grafting_config=dist_optim.AdamGraftingConfig(),
    preconditioner_dtype=torch.float64,
)
SOAP = dict(
    lr=1e-2,
    epsilon=1e-8,
    max_preconditioner_dim=6,
    precondition_frequency=2,
    eigenvalue_correction=True,
    preconditioner_dtype=torch.float64,
)


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_zero_tolerance_without_steps_is_eigh_bit_for_bit(kind: str) -> None:
    """Every refresh recomputes: the trajectory and the state are ``"eigh"``'s exactly."""
    grads = _grads(8, 0.3)
    if kind == "shampoo":
        ref_kwargs, warm_kwargs = dict(SHAMPOO), dict(SHAMPOO, root_inverse="warm")
    else:
        ref_kwargs, warm_kwargs = dict(SOAP, eigenbasis="eigh"), dict(SOAP, eigenbasis="warm")
    ref, ref_opt = _run(ref_kwargs, grads)
    warm, warm_opt = _run(dict(warm_kwargs, refresh_tolerance=0.0, refresh_iterations=0), grads)
    for k in SHAPES:
        assert torch.equal(ref[k], warm[k]), k
        for name, value in ref_opt.state[ref[k]].items():
            assert torch.equal(value, warm_opt.state[warm[k]][name]), (k, name)


def _damped_factors(state: dict[str, torch.Tensor], group: dict, steps: int) -> list[tuple[str, torch.Tensor, int]]:
    """(root key, A + epsilon I, order of the block) of every factor in a parameter's state, by the
    package docstring's formula (bias correction 1 / (1 - b2^n), n factor updates)."""
    scale = 1.0 / (1 - group["betas"][1] ** steps)
    out = []
    for key, value in state.items():
        if ".factor" in key:
            block = key.split(".")[0] + ".factor"
            order = sum(1 for k in state if k.startswith(block))
            damped = value * scale + group["epsilon"] * torch.eye(value.shape[0], dtype=value.dtype)
            out.append((key.replace("factor", "root"), damped, order))
    return out


@pytest.mark.parametrize("iterations", [0, 2])
def test_every_root_is_the_exact_root_of_a_matrix_within_the_tolerance(iterations: int) -> None:
    """Right after a refresh, per factor (this file's formulas, float64): the root is
    ``Q diag(B)^(-1/r) Q^T`` for the kept eigenvectors ``Q``, ``B = Q^T (A + eps I) Q``, and
    ``||B - diag B||_F <= tol ||B||_F`` (a recomputed ``Q`` diagonalises ``A + eps I`` to
    round-off). With QR steps some factor's eigenvectors are off by more than round-off."""
    tol = 0.005
    grads = _grads(8, 0.2, none_at=None)  # refreshes at steps 2, 4, 6 and 8, the last step
    kwargs = dict(SHAMPOO, root_inverse="warm", refresh_tolerance=tol, refresh_iterations=iterations)
    params, opt = _run(kwargs, grads)
    ratios = []
    for p in params.values():
        state = opt.state[p]
        for key, damped, order in _damped_factors(state, opt.param_groups[0], 8):
            root, q = state[key], state[key.replace("root", "basis")]
            b = q.T @ damped @ q
            ratios.append(_ratio(b))
            assert ratios[-1] <= tol, key
            from_basis = (q * torch.diagonal(b).pow(-1.0 / (2.0 * order))) @ q.T
            torch.testing.assert_close(root, from_basis, rtol=0, atol=1e-12 * float(root.abs().max()))
    if iterations:  # QR steps left a factor within the criterion, not round-off (measured: 0.003)
        assert max(ratios) > tol / 10


def test_eigh_is_skipped_when_the_eigenvectors_have_not_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted at torch.linalg.eigh, per step: ``"eigh"`` calls it at every refresh; ``"warm"``
    only at the first (from the identity) of factors the identity does not diagonalise, the
    factors then moving too little to need another."""
    calls: list[int] = []
    real = torch.linalg.eigh

    def counting(*args, **kwargs):
        calls[-1] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", counting)
    grads = _grads(12, 1e-3, none_at=None)
    gen = torch.Generator().manual_seed(3)
    for root_inverse, expect_later in (("eigh", True), ("warm", False)):
        params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES.values()]
        opt = dist_optim.DistributedShampoo(params, **dict(SHAMPOO, root_inverse=root_inverse))
        calls.clear()
        for g in grads:
            for p, k in zip(params, SHAPES):
                p.grad = g[k]
            calls.append(0)
            opt.step()
        later = calls[3::2]  # refreshes at steps 4, 6, ..., 12
        if expect_later:
            assert calls[1] > 0 and all(n == calls[1] for n in later)
        else:
            assert calls[1] > 0 and all(n == 0 for n in later), calls


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_resume_from_state_dict_is_exact(kind: str) -> None:
    kwargs = (
        dict(SHAMPOO, root_inverse="warm") if kind == "shampoo" else dict(SOAP, eigenbasis="warm", refresh_iterations=3)
    )
    grads = _grads(9, 0.05)
    straight, _ = _run(kwargs, grads)
    resumed, _ = _run(kwargs, grads, resume_at=5)
    for k in SHAPES:
        assert torch.equal(straight[k], resumed[k]), k


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        (dict(root_inverse="warm", refresh_tolerance=1.5), "refresh_tolerance"),
        (dict(root_inverse="warm", refresh_tolerance=-0.1), "refresh_tolerance"),
        (dict(root_inverse="warm", refresh_tolerance=float("nan")), "refresh_tolerance"),
        (dict(root_inverse="warm", refresh_iterations=-1), "refresh_iterations"),
        (dict(root_inverse="warm", refresh_iterations=1.5), "refresh_iterations"),
        (dict(root_inverse="warmer"), "root_inverse"),
        (dict(eigenvalue_correction=True, eigenbasis="warmer"), "eigenbasis"),
    ],
)
def test_bad_options_are_refused_by_name(kwargs: dict, option: str) -> None:
    with pytest.raises(ValueError, match=option):
        dist_optim.DistributedShampoo([torch.nn.Parameter(torch.zeros(3, 3))], **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_all_finite_is_isfinite_all(dtype: torch.dtype, bad: float | None) -> None:
    """The refreshes' finiteness flag (one min/max reduction) is ``torch.isfinite(t).all()``,
    wherever the non-finite entry is, and true for an empty tensor."""
    for where in (0, 517, 1023):
        t = torch.randn(32, 32, dtype=dtype)
        if bad is not None:
            t.view(-1)[where] = bad
        flag = matrix_functions.all_finite(t)
        assert flag.dtype == torch.bool and flag.dim() == 0
        assert bool(flag) == bool(torch.isfinite(t).all()) == (bad is None)
    assert bool(matrix_functions.all_finite(torch.empty(0, 3, dtype=dtype)))
