"""DistributedShampoo: single-device semantics against tests/helpers/shampoo_reference.py, bad input,
failure paths, and the distributed extras the parity grid does not cover (bf16 communication,
memory per rank, collectives per step)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dist_optim
from dist_optim import comm
from dist_optim.kernels import structured
from dist_optim.shampoo.blocking import Block
from dist_optim.shampoo.preconditioner.factors import kl_soap_whiteners
from dist_optim.shampoo.state import BlockState
from dist_optim.sharding.runtime import OwnerRuntime
from tests.helpers import parity
from tests.helpers.check import excess
from tests.helpers.collectives import counting_collectives
from tests.helpers.shampoo_reference import ReferenceShampoo

STEPS = 8
NONE_STEP = 2  # fc2.weight gets no gradient at this step


class TinyModel(nn.Module):
    """An embedding, a 3-D conv weight and linears."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.conv = nn.Conv1d(4, 5, 3)  # weight (5, 4, 3)
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 3, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).transpose(1, 2)
        x = torch.tanh(self.conv(x)).mean(-1)
        return self.fc2(torch.tanh(self.fc1(x)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    # Every token appears, so no embedding row has an all-zero gradient.
    idx = torch.cat([torch.arange(10), torch.randint(0, 10, (14,), generator=gen)])
    idx = idx[torch.randperm(24, generator=gen)].view(4, 6)
    return idx, torch.randn(4, 3, generator=gen, dtype=torch.float64)


def _model() -> TinyModel:
    torch.manual_seed(0)
    return TinyModel().double()


def _graft_tuple(cfg: object) -> tuple[str, float, float] | None:
    if cfg is None:
        return None
    if isinstance(cfg, dist_optim.SGDGraftingConfig):
        return ("sgd", 0.0, 0.0)
    if isinstance(cfg, dist_optim.AdaGradGraftingConfig):
        return ("adagrad", 1.0, cfg.epsilon)
    if isinstance(cfg, dist_optim.RMSpropGraftingConfig):
        return ("rmsprop", cfg.beta2, cfg.epsilon)
    return ("adam", cfg.beta2, cfg.epsilon)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


ADAM = dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8)
# Before the start, Adam grafting without momentum is one fused kernel on the parameter itself
# (contiguous blocks; the others compute the direction first): checked with both kinds of decay.
GRAFTING_ONLY_START = dict(
    grafting_config=ADAM,
    precondition_frequency=2,
    start_preconditioning_step=4,
    weight_decay=0.1,
    max_preconditioner_dim=4,
)
SEMANTICS = {
    "default": dict(),
    "sgd-blocks": dict(grafting_config=dist_optim.SGDGraftingConfig(), max_preconditioner_dim=4),
    "adagrad-sum-coupled-wd": dict(
        betas=(0.0, 1.0),
        grafting_config=dist_optim.AdaGradGraftingConfig(epsilon=1e-10),
        weight_decay=0.1,
        use_decoupled_weight_decay=False,
    ),
    "rmsprop-nesterov": dict(
        grafting_config=dist_optim.RMSpropGraftingConfig(beta2=0.95, epsilon=1e-8),
        momentum=0.9,
        use_nesterov=True,
    ),
    "adam-pf3-start3-decoupled-wd-momentum": dict(
        grafting_config=ADAM,
        precondition_frequency=3,
        start_preconditioning_step=3,
        weight_decay=0.1,
        momentum=0.5,
        max_preconditioner_dim=3,
    ),
    "adam-pf2-start4-nobc-exponents": dict(
        grafting_config=ADAM,
        precondition_frequency=2,
        start_preconditioning_step=4,
        use_bias_correction=False,
        exponent_override=3,
        exponent_multiplier=1.5,
    ),
    "adam-pf2-start4-decoupled-wd": GRAFTING_ONLY_START,
    "adam-pf2-start4-coupled-wd": {**GRAFTING_ONLY_START, "use_decoupled_weight_decay": False},
    "merge-small-dims": dict(grafting_config=ADAM, merge_small_dims=True, max_preconditioner_dim=12),
    "coupled-newton": dict(grafting_config=ADAM, root_inverse="coupled_newton", epsilon=1e-3),
    "higher-order": dict(grafting_config=ADAM, root_inverse="higher_order", epsilon=1e-3, max_preconditioner_dim=4),
    "soap-eigh": dict(
        eigenvalue_correction=True,
        epsilon=1e-8,
        max_preconditioner_dim=4,
        precondition_frequency=2,
        start_preconditioning_step=4,  # full-rank factors at the first basis: WELL_POSED_GAP
    ),
    # Meta's eigh basis: eigh's increasing column order, which S's coordinates follow
    "soap-eigh-ascending": dict(
        eigenvalue_correction=True,
        eigenbasis="eigh-ascending",
        epsilon=1e-8,
        max_preconditioner_dim=4,
        precondition_frequency=2,
        start_preconditioning_step=4,
    ),
    "soap-qr-adam-wd": dict(
        eigenvalue_correction=True,
        eigenbasis="qr",
        epsilon=1e-8,
        max_preconditioner_dim=4,
        precondition_frequency=2,
        start_preconditioning_step=4,
        grafting_config=ADAM,
        weight_decay=0.1,
        use_decoupled_weight_decay=False,
    ),
    "soap-qr-pf1": dict(
        eigenvalue_correction=True,
        eigenbasis="qr",
        epsilon=1e-8,
        max_preconditioner_dim=4,
        start_preconditioning_step=4,
        betas=(0.9, 0.95),
    ),
}
# KL-Shampoo: each factor's statistics from the gradient preconditioned along the other dims by
# their current roots (the identity until the first refresh at step 4), a 3-D conv weight in blocks.
SEMANTICS["kl-adam-pf2-start4-blocks"] = dict(
    grafting_config=ADAM,
    precondition_frequency=2,
    start_preconditioning_step=4,
    max_preconditioner_dim=4,
    kl_statistics=True,
)
# Vyas et al.'s variant on the same problem as Meta's qr.
SEMANTICS["soap-qr-eigh-start"] = dict(SEMANTICS["soap-qr-pf1"], eigenbasis="qr-eigh-start")
# KL-SOAP: each factor's statistics from the gradient whitened along the other dims by their
# inverse factors in SOAP's basis (the identity before the first refresh at step 4, so from step 2
# on the statistics differ from SOAP's already), a 3-D conv weight in blocks of 3-D and vectors.
_KL_SOAP = dict(
    eigenvalue_correction=True,
    kl_statistics=True,
    epsilon=1e-8,
    max_preconditioner_dim=4,
    precondition_frequency=2,
    start_preconditioning_step=4,
)
SEMANTICS["kl-soap-eigh-blocks"] = _KL_SOAP
# Without bias correction (of the factors, so of the eigenvalues the statistics read, too).
SEMANTICS["kl-soap-qr-adam-coupled-wd-nobc"] = dict(
    _KL_SOAP,
    eigenbasis="qr",
    grafting_config=ADAM,
    weight_decay=0.1,
    use_decoupled_weight_decay=False,
    use_bias_correction=False,
)
# Merged dims ("conv" as 5 x 12), whole blocks; the first basis at step 6, when the vectors'
# factors have full rank (WELL_POSED_GAP).
SEMANTICS["kl-soap-qr-eigh-start-merged"] = dict(
    _KL_SOAP,
    eigenbasis="qr-eigh-start",
    merge_small_dims=True,
    max_preconditioner_dim=12,
    start_preconditioning_step=6,
    betas=(0.9, 0.95),
)
# The iterative roots stop at an error of 1e-10 in float64; everything else is the same formula.
TOLERANCE = {"coupled-newton": 1e-6, "higher-order": 1e-6}
# The rest: the same formulas in float64, but the tiny model's factors are nearly singular in the
# first steps (rank-one sums plus epsilon 1e-12), so inverse roots amplify rounding: the reference
# itself moves by up to 6.6e-9 when its gradients get relative noise of 1e-15 (measured for
# "sgd-blocks"). 1e-7 is above that and still 100x tighter than the fp32 parity standard; a
# tighter bound would test the order of floating-point operations, not the semantics.
DEFAULT_TOLERANCE = 1e-7
# SOAP's eigenbases are pinned down only where a factor's eigenvalues are apart: within a repeated
# eigenvalue (the null space of a factor of fewer gradients than its side, e.g. a vector's block
# after two steps) eigh may return any basis, SOAP's update depends on which, and the machine's
# LAPACK decides. With "soap-eigh"'s first basis at step 2 one CPU (AMD EPYC) agreed with the
# reference and another (Intel Xeon, AVX-512) differed by 8.4e-5 (smallest gap 2.8e-17). Each case
# asserts the reference's smallest relative gap is above this (measured 6.1e-4 or more in the
# cases here): an eigenvector then moves by about n * 1e-16 / gap < 1e-10 under rounding.
WELL_POSED_GAP = 1e-5


@pytest.mark.parametrize("name", list(SEMANTICS))
def test_semantics_against_reference(name: str) -> None:
    _check_against_reference(name)


def _five_steps(configs: dict[str, dict[str, Any]], **common: Any) -> dict[str, tuple[list[torch.Tensor], Any]]:
    """Each configuration (``common`` options beside it) stepped 5 times on the same small model and
    batches, first roots or bases at step 2: its parameters and ``full_state()`` by name."""
    runs = {}
    for name, options in configs.items():
        model = _model()
        opt = dist_optim.DistributedShampoo(
            model.parameters(), lr=0.05, preconditioner_dtype=torch.float64, precondition_frequency=2,
            start_preconditioning_step=2, **common, **options,
        )  # fmt: skip
        for step in range(5):
            idx, target = _batch(step)
            opt.zero_grad(set_to_none=True)
            ((model(idx) - target) ** 2).sum().backward()
            opt.step()
        runs[name] = ([p.detach().clone() for p in model.parameters()], opt.full_state())
    return runs


def test_kl_statistics_change_the_factors_and_pack_bit_for_bit() -> None:
    """KL-Shampoo's factors differ from Shampoo's once a refresh made roots (the reference test
    above could not tell a KL run that never preconditions its statistics), and packed factors
    and roots give the same steps bit for bit."""
    runs = _five_steps(
        {
            "shampoo": dict(),
            "kl": dict(kl_statistics=True),
            "kl-packed": dict(kl_statistics=True, use_symmetric_packing=True),
        },
        grafting_config=ADAM,
    )
    weight = 3  # fc1.weight: a 6 x 5 matrix, one block
    assert _rel(runs["kl"][1][weight]["block0.factor0"], runs["shampoo"][1][weight]["block0.factor0"]) > 1e-3
    for a, b in zip(runs["kl"][0], runs["kl-packed"][0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(preconditioner_bits=8, root_inverse="eigh"), "reads whole roots .* use preconditioner_bits=32"),
        (dict(preconditioner_bits=4, eigenvalue_correction=True), "reads whole bases .* use preconditioner_bits=32"),
        (dict(preconditioner_bits=8, eigenvalue_correction=True), "reads whole bases .* use preconditioner_bits=32"),
    ],
)
def test_kl_statistics_refuse_what_keeps_no_whole_matrices(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        dist_optim.DistributedShampoo([nn.Parameter(torch.zeros(4, 3))], kl_statistics=True, **options)
    assert "\n" not in str(info.value)


def test_kl_soap_runs_where_soap_does() -> None:
    """KL-SOAP (``eigenvalue_correction`` with ``kl_statistics``) is built, not refused: the
    combination Lin et al. 2025 call KL-SOAP."""
    opt = dist_optim.DistributedShampoo(
        [nn.Parameter(torch.zeros(4, 3))], eigenvalue_correction=True, kl_statistics=True
    )
    assert opt.param_groups[0]["kl_statistics"] and opt.param_groups[0]["eigenvalue_correction"]


def test_kl_soap_changes_the_factors_packs_and_runs_in_8bit() -> None:
    """KL-SOAP's factors differ from SOAP's (the reference cases above compare both to a reference
    that could be wrong alike), packed factors give the same steps bit for bit, and 8-bit moments
    (SOAP's first moment in the eigenbasis and second moment as codes) run beside its statistics."""
    runs = _five_steps(
        {
            "soap": dict(),
            "kl": dict(kl_statistics=True),
            "kl-packed": dict(kl_statistics=True, use_symmetric_packing=True),
            "kl-8bit": dict(kl_statistics=True, optim_bits=8, min_8bit_size=0),
        },
        eigenvalue_correction=True,
        epsilon=1e-8,
    )
    weight = 3  # fc1.weight: a 6 x 5 matrix, one block
    assert _rel(runs["kl"][1][weight]["block0.factor0"], runs["soap"][1][weight]["block0.factor0"]) > 1e-3
    for a, b in zip(runs["kl"][0], runs["kl-packed"][0]):
        assert torch.equal(a, b)
    eight = runs["kl-8bit"][1][weight]
    assert eight["block0.exp_avg_sq"].dtype == torch.uint8 and eight["block0.exp_avg_eigen"].dtype == torch.uint8
    # The 8-bit moments move the parameters, so the later gradients, by a few percent (4.4e-2 of
    # fc1.weight's scale here): its factors stay near the 32-bit run's (1.7e-2).
    assert _rel(eight["block0.factor1"], runs["kl"][1][weight]["block0.factor1"]) < 0.05


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("basis", ["random", "singular-eigenbasis"])
def test_kl_soap_eigenvalues_of_the_kept_triangle(k: int, basis: str) -> None:
    """KL-SOAP's whitener of a factor against the formula on the symmetric matrix, ``W W^T = Q
    diag(d lam)^-1 Q^T``, ``lam = max(diag(Q^T A Q), epsilon)``, ``A`` bias-corrected. The factor
    is above MIN_SIZE, so that it keeps one triangle current between refreshes (the lower one of
    dim 0, the upper one of a matrix's dim 1): the eigenvalues read the matrix that triangle
    stands for, not the stale other one. In its own eigenbasis a singular factor's null space has
    eigenvalues of rounding size, which epsilon bounds."""
    d = structured.MIN_SIZE + 44
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(d, d // 2 if basis == "singular-eigenbasis" else 2 * d, generator=gen, dtype=torch.float64)
    a = rows @ rows.T / rows.shape[1]
    if basis == "random":
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    else:
        q = torch.linalg.eigh(a).eigenvectors
    kept = torch.tril(a) + torch.triu(torch.randn(d, d, generator=gen, dtype=torch.float64), 1)  # dim 0's form
    factor = kept if k == 0 else kept.T.contiguous()
    other = torch.eye(5, dtype=torch.float64)
    factors, bases = ([factor, other], [q, other]) if k == 0 else ([other, factor], [other, q])
    epsilon = 1e-6
    group = dict(betas=(0.9, 0.99), statistics_compute_steps=1, use_bias_correction=True, epsilon=epsilon)
    block = Block((), (d, 5) if k == 0 else (5, d), True)
    t = 4  # three factor updates before: A = L / (1 - 0.99^3)
    ws = kl_soap_whiteners(BlockState(factors=factors, bases=bases), block, group, t)
    lam = (torch.diagonal(q.T @ a @ q) / (1 - 0.99**3)).clamp(min=epsilon)
    if basis == "singular-eigenbasis":
        assert int((lam == epsilon).sum()) == d - d // 2
    expected = q @ torch.diag(1 / (d * lam)) @ q.T
    assert _rel(ws[k] @ ws[k].T, expected) < 1e-12


def _parameter_basis(state: dict) -> dict:
    """``state`` with SOAP's first moment kept in the eigenbasis (``exp_avg_eigen``, ``Mr = M x_k
    Q_k^T``) rotated back by formula, ``M = Mr x_k Q_k``, under the reference's key ``exp_avg``."""
    out = dict(state)
    for key in [k for k in state if k.endswith(".exp_avg_eigen")]:
        prefix = key[: -len("exp_avg_eigen")]
        m = out.pop(key).double()
        k = 0
        while f"{prefix}basis{k}" in state:
            m = torch.movedim(torch.tensordot(state[f"{prefix}basis{k}"].double(), m, dims=([1], [k])), 0, k)
            k += 1
        out[prefix + "exp_avg"] = m.to(state[key].dtype)
    return out


def _check_against_reference(name: str, **overrides: object) -> dist_optim.DistributedShampoo:
    kwargs = dict(lr=0.05, preconditioner_dtype=torch.float64, **{**SEMANTICS[name], **overrides})
    model = _model()
    params = list(model.parameters())
    opt = dist_optim.DistributedShampoo(params, **kwargs)
    ref_kwargs = {
        k: v for k, v in kwargs.items() if k not in ("grafting_config", "root_inverse", "preconditioner_dtype")
    }
    ref = ReferenceShampoo(params, graft=_graft_tuple(kwargs.get("grafting_config")), **ref_kwargs)
    tol = TOLERANCE.get(name, DEFAULT_TOLERANCE)
    for step in range(STEPS):
        idx, target = _batch(step)
        opt.zero_grad(set_to_none=True)
        ((model(idx) - target) ** 2).sum().backward()
        if step == NONE_STEP:
            model.fc2.weight.grad = None
        opt.step()
        ref.step([None if p.grad is None else p.grad.clone() for p in params])
        assert ref.min_eigen_gap > WELL_POSED_GAP, f"{name}: step {step} made a SOAP basis of a repeated eigenvalue"
        for i, (p, rp) in enumerate(zip(params, ref.params)):
            assert _rel(p, rp) < tol, f"{name}: step {step} param {i} differs by {_rel(p, rp):.3g}"
    assert opt.root_failures() == 0
    for i, (state, rstate) in enumerate(zip(map(_parameter_basis, opt.full_state()), ref.state)):
        assert set(state) == set(rstate), f"param {i}: {sorted(state)} != {sorted(rstate)}"
        for key, expected in rstate.items():
            if key == "step" or key.endswith("failures"):
                assert float(state[key]) == float(expected), key
                continue
            err = _rel(state[key], expected)
            assert err < max(tol, 1e-8), f"{name}: param {i} state {key} differs by {err:.3g}"
    # Blocking really happened where asked.
    if kwargs.get("max_preconditioner_dim", 1024) <= 4:
        assert any(k.startswith("block1.") for k in opt.state[model.conv.weight])
    return opt


# ---- SOAP with eigenbasis="qr": Meta's DefaultSOAPConfig -----------------------------------------
# Meta's refresh (shampoo_reference.qr_algorithm_refresh) sorts the columns by estimated eigenvalue
# and keeps the second moment per column. A factor that is singular at a refresh has a null space
# whose estimates all equal epsilon: rounding orders them, and so decides which second moment each
# of those columns gets. With the first refresh at step 2 (start = precondition_frequency = 2,
# rank-2 factors) the reference itself moves by 2e5 times the bound below when its gradients get
# relative noise of 1e-15 (measured). From step 4 on, the factors of these blocks (at most 4 x 4)
# are full rank and the same noise moves the reference by at most 7.4e-7 of the bound (params and
# state, three noise draws per case, epsilon 1e-8 and Meta's default 1e-12 alike): the bound has a
# margin of 10^6 over that floor.
SOAP_QR_META = {
    "pf2-start4": dict(betas=(0.9, 0.95), epsilon=1e-8),
    "pf2-start4-eps1e-12-l2": dict(epsilon=1e-12, weight_decay=0.1, use_decoupled_weight_decay=False),
}
SOAP_QR_COMMON = dict(
    lr=0.05,
    eigenvalue_correction=True,
    eigenbasis="qr",
    max_preconditioner_dim=4,
    precondition_frequency=2,
    start_preconditioning_step=4,
)


@pytest.mark.parametrize("name", list(SOAP_QR_META))
def test_soap_qr_follows_metas_default_soap(name: str) -> None:
    """Params and every state tensor after every step, element-wise against the float64 reference
    of Meta's semantics; the bases change exactly at the refresh steps of each parameter."""
    kwargs = {**SOAP_QR_COMMON, **SOAP_QR_META[name]}
    model = _model()
    params = list(model.parameters())
    opt = dist_optim.DistributedShampoo(params, preconditioner_dtype=torch.float64, **kwargs)
    ref = ReferenceShampoo(params, **kwargs)
    watched = {"fc1.weight": model.fc1.weight, "fc2.weight": model.fc2.weight}
    changed: dict[str, list[int]] = {n: [] for n in watched}
    for step in range(1, STEPS + 1):
        before = {n: opt.state[w].get("block0.basis0") for n, w in watched.items()}
        before = {n: None if q is None else q.clone() for n, q in before.items()}
        idx, target = _batch(step - 1)
        opt.zero_grad(set_to_none=True)
        ((model(idx) - target) ** 2).sum().backward()
        if step - 1 == NONE_STEP:
            model.fc2.weight.grad = None
        opt.step()
        ref.step([None if p.grad is None else p.grad.clone() for p in params])
        for i, (p, rp) in enumerate(zip(params, ref.params)):
            err = excess(p, rp, 1e-5, atol_scale=0.01)
            assert err <= 1, f"{name}: step {step} param {i} exceeds the bound {err:.3g}x"
        for i, (state, rstate) in enumerate(zip(map(_parameter_basis, opt.full_state()), ref.state)):
            assert set(state) == set(rstate), f"param {i}: {sorted(state)} != {sorted(rstate)}"
            for key, expected in rstate.items():
                if key == "step" or key.endswith("failures"):
                    assert float(state[key]) == float(expected), key
                    continue
                err = excess(state[key], expected, 1e-5, atol_scale=0.01)
                assert err <= 1, f"{name}: step {step} param {i} state {key} exceeds the bound {err:.3g}x"
        for n, w in watched.items():
            now = opt.state[w]["block0.basis0"]
            if before[n] is None:  # made in the first step: the identity
                assert torch.equal(now, torch.eye(now.shape[0], dtype=now.dtype)), n
            elif not torch.equal(before[n], now):
                changed[n].append(step)
    # Refreshes at t = 4, 6, 8; fc2.weight has no gradient at step 3, so its t lags by one.
    assert changed == {"fc1.weight": [4, 6, 8], "fc2.weight": [5, 7]}, changed
    assert opt.root_failures() == 0


def test_soap_qr_is_adam_before_the_first_refresh() -> None:
    """Identity bases until the first refresh: SOAP is then Adam on the raw gradient."""
    lr, betas, eps = 0.05, (0.9, 0.95), 1e-8
    model = _model()
    params = list(model.parameters())
    adam_params = [nn.Parameter(p.detach().clone()) for p in params]
    soap = dist_optim.DistributedShampoo(
        params,
        lr=lr,
        betas=betas,
        epsilon=eps,
        precondition_frequency=3,
        eigenvalue_correction=True,
        eigenbasis="qr",
        preconditioner_dtype=torch.float64,
    )
    adam = torch.optim.Adam(adam_params, lr=lr, betas=betas, eps=eps)
    for step in range(1, 4):
        idx, target = _batch(step - 1)
        soap.zero_grad(set_to_none=True)
        ((model(idx) - target) ** 2).sum().backward()
        for p, q in zip(params, adam_params):
            q.grad = p.grad.clone()
        soap.step()
        adam.step()
        if step < 3:
            for p in params:
                for key, value in soap.state[p].items():
                    if ".basis" in key:
                        assert torch.equal(value, torch.eye(value.shape[0], dtype=value.dtype)), (step, key)
            for p, q in zip(params, adam_params):
                # sqrt(V / c) against Adam's sqrt(V) / sqrt(c): the same value up to rounding.
                torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    # Step 3 refreshed the bases (the first QR step from the identity): no longer Adam.
    assert max(_rel(p, q) for p, q in zip(params, adam_params)) > 1e-6


def test_soap_qr_refresh_is_one_qr_step_from_the_previous_basis() -> None:
    """Each refresh, computed directly: ``B = Q^T (A + eps I) Q``, ``Q'R = qr(B)``, ``Q <- Q Q'``,
    columns by increasing ``diag(R Q')``; the second moment is not permuted with them."""
    b1, b2, eps = 0.9, 0.95, 1e-8
    gen = torch.Generator().manual_seed(3)
    w = nn.Parameter(torch.randn(5, 4, generator=gen, dtype=torch.float64))
    opt = dist_optim.DistributedShampoo(
        [w],
        lr=0.05,
        betas=(b1, b2),
        epsilon=eps,
        precondition_frequency=2,
        eigenvalue_correction=True,
        eigenbasis="qr",
        preconditioner_dtype=torch.float64,
    )
    state = opt.state
    for t in range(1, 8):
        w.grad = torch.randn(5, 4, generator=gen, dtype=torch.float64)
        prev = [state[w][f"block0.basis{k}"].clone() for k in range(2)] if t > 1 else [torch.eye(5), torch.eye(4)]
        prev = [q.double() for q in prev]
        s_prev = state[w]["block0.exp_avg_sq"].clone() if t > 1 else torch.zeros(5, 4, dtype=torch.float64)
        opt.step()
        new = [state[w][f"block0.basis{k}"] for k in range(2)]
        for k in range(2):
            if t % 2:  # no refresh
                assert torch.equal(new[k], prev[k]), (t, k)
                continue
            a = state[w][f"block0.factor{k}"] / (1 - b2**t) + eps * torch.eye(new[k].shape[0], dtype=torch.float64)
            q_step, r = torch.linalg.qr(prev[k].T @ a @ prev[k])
            expected = (prev[k] @ q_step)[:, torch.argsort(torch.diagonal(r @ q_step), stable=True)]
            torch.testing.assert_close(new[k], expected, rtol=1e-10, atol=1e-12)
            assert not torch.allclose(new[k], prev[k])
        rotated = new[0].T @ w.grad @ new[1]
        torch.testing.assert_close(state[w]["block0.exp_avg_sq"], b2 * s_prev + (1 - b2) * rotated**2)


# Shampoo (not SOAP: its update depends on the last bits of degenerate factors, see
# dist_optim.shampoo.preconditioner.grafting.update_moments)
# configurations with steps between refreshes, each a different grafting, root method or blocking.
# The panel products round differently from the reference's plain ones, and epsilon 1e-12 on the
# tiny model's rank-deficient factors amplifies that (3e-5 measured): a damping that keeps the
# roots well conditioned makes 1e-7 a test of the formula again.
EVERY_2 = dict(precondition_frequency=2, start_preconditioning_step=2, epsilon=1e-4)
LARGE_FACTOR_CASES = {
    "sgd-blocks": EVERY_2,
    "adam-pf3-start3-decoupled-wd-momentum": dict(epsilon=1e-4),
    "merge-small-dims": EVERY_2,
    "coupled-newton": {**EVERY_2, "epsilon": 1e-3},
}


@pytest.mark.parametrize("name", list(LARGE_FACTOR_CASES))
def test_large_factors_keep_lower_triangles_between_refreshes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Factors above structured.MIN_SIZE are updated in one triangle only and mirrored
    at refreshes and exports. With MIN_SIZE lowered to 1 every factor of the tiny model takes that
    path: the reference still agrees, and exported factors are symmetric."""
    from dist_optim.kernels import structured

    monkeypatch.setattr(structured, "MIN_SIZE", 1)
    monkeypatch.setattr(structured, "PANEL", 2)
    stale: list[bool] = []
    real_step = dist_optim.DistributedShampoo.step

    def step(self: dist_optim.DistributedShampoo, closure: object = None) -> object:
        out = real_step(self, closure)
        stale.extend(
            not torch.equal(v, v.T)
            for st in self.state.values()
            for k, v in st.items()
            if isinstance(v, torch.Tensor) and ".factor" in k
        )
        return out

    monkeypatch.setattr(dist_optim.DistributedShampoo, "step", step)
    opt = _check_against_reference(name, **LARGE_FACTOR_CASES[name])
    assert any(stale), "between refreshes some factor's upper triangle should not be maintained"
    for exported in (opt.state_dict()["state"].values(), opt.full_state()):
        for st in exported:
            for k, v in st.items():
                if ".factor" in k:
                    assert torch.equal(v, v.T), k


@pytest.mark.parametrize("fused", [True, False])
def test_adam_grafting_with_and_without_the_fused_kernel(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adam grafting's moments come from torch's fused Adam kernel where it applies and from
    separate operations otherwise; both follow the reference. Before the start (no momentum,
    bias correction), a contiguous block's whole update is that kernel run on the parameter
    itself (AdamW's for decoupled decay); the other blocks get the direction, then the update."""
    from dist_optim.kernels import fused_adam

    calls: dict[str, list[bool]] = {"_fused_adam_": [], "_fused_adamw_": []}
    param_ptrs: set[int] = set()

    def counting(name: str) -> object:
        real = getattr(torch, name)

        def run(params: list[torch.Tensor], *args: object, **kwargs: object) -> None:
            calls[name].append(params[0].untyped_storage().data_ptr() in param_ptrs)
            real(params, *args, **kwargs)

        return run

    for name in calls:
        monkeypatch.setattr(torch, name, counting(name))
    monkeypatch.setattr(fused_adam, "FUSED", fused)
    real_check = dist_optim.DistributedShampoo.__init__

    def init(self: object, params: list[torch.Tensor], *args: object, **kwargs: object) -> None:
        params = list(params)
        param_ptrs.update(p.untyped_storage().data_ptr() for p in params)
        real_check(self, params, *args, **kwargs)

    monkeypatch.setattr(dist_optim.DistributedShampoo, "__init__", init)
    names = (
        "adam-pf3-start3-decoupled-wd-momentum",
        "adam-pf2-start4-nobc-exponents",
        "adam-pf2-start4-decoupled-wd",
        "adam-pf2-start4-coupled-wd",
    )
    for name in names:
        _check_against_reference(name)
    if not fused:
        assert calls == {"_fused_adam_": [], "_fused_adamw_": []}
        return
    # Directions into scratch memory, and whole updates on parameters (both kernels: the coupled
    # case has its decay in the gradient); never AdamW's kernel on a direction.
    assert False in calls["_fused_adam_"] and True in calls["_fused_adam_"]
    assert calls["_fused_adamw_"] and all(calls["_fused_adamw_"])


def test_iterative_roots_match_eigh() -> None:
    from dist_optim.kernels.matrix_functions import matrix_inverse_root

    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-8), (torch.float32, 1e-3)):
        x = torch.randn(7, 20, generator=gen, dtype=torch.float64)
        a = (x @ x.T / 20).to(dtype)
        for root in (2, 4, 6):
            before = a.clone()
            exact, err, ok = matrix_inverse_root(a, root, 1e-3, "eigh")
            assert bool(ok) and float(err) == 0 and torch.equal(a, before)
            # An exactly symmetric matrix handed over to be overwritten: the same bits, no copies.
            mirrored = (a + a.T) * 0.5
            same, _, _ = matrix_inverse_root(mirrored.clone(), root, 1e-3, "eigh")
            handed, _, ok = matrix_inverse_root(mirrored, root, 1e-3, "eigh", overwrite=True)
            assert bool(ok) and torch.equal(handed, same)
            assert not torch.equal(mirrored, (a + a.T) * 0.5)  # its diagonal took the damping
            for method, order in (("coupled_newton", 2), ("higher_order", 3), ("higher_order", 5)):
                approx, err, ok = matrix_inverse_root(a, root, 1e-3, method, order=order)
                assert bool(ok) and float(err) < 1e-3, (method, root, float(err))
                assert _rel(approx, exact) < tol, (dtype, method, root, _rel(approx, exact))


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(precondition_frequency=10, start_preconditioning_step=5), "start_preconditioning_step"),
        (dict(precondition_frequency=10, start_preconditioning_step=2), "start_preconditioning_step"),
        (dict(epsilon=0.0), "epsilon"),
        (dict(epsilon=-1e-3), "epsilon"),
        (dict(betas=(1.0, 0.999)), "betas[0]"),
        (dict(betas=(-0.1, 0.999)), "betas[0]"),
        (dict(betas=(0.9, 0.0)), "betas[1]"),
        (dict(betas=(0.9, 1.5)), "betas[1]"),
        (dict(root_inverse="newton"), "root_inverse"),
        (dict(eigenvalue_correction=True, eigenbasis="svd"), "eigenbasis"),
        (dict(grafting_config="adam"), "grafting_config"),
        (dict(root_inverse="coupled_newton", exponent_multiplier=1.82), "exponent_multiplier"),
        (dict(max_preconditioner_dim=0), "max_preconditioner_dim"),
        (dict(precondition_frequency=0), "precondition_frequency"),
        (dict(preconditioner_dtype=torch.float16), "preconditioner_dtype"),
        (dict(communication_dtype=torch.int8), "communication_dtype"),
        (dict(nonfinite="never"), "nonfinite"),
    ],
)
def test_bad_input(kwargs: dict, option: str) -> None:
    with pytest.raises(ValueError, match=option.replace("[", r"\[").replace("]", r"\]")):
        dist_optim.DistributedShampoo([nn.Parameter(torch.zeros(3, 2))], lr=0.1, **kwargs)


@pytest.mark.parametrize(
    "make, option",
    [
        (lambda: dist_optim.AdamGraftingConfig(beta2=0.0), "beta2"),
        (lambda: dist_optim.AdamGraftingConfig(beta2=1.0), "AdaGradGraftingConfig"),
        (lambda: dist_optim.RMSpropGraftingConfig(epsilon=0.0), "epsilon"),
        (lambda: dist_optim.AdaGradGraftingConfig(epsilon=-1.0), "epsilon"),
    ],
)
def test_bad_grafting_config(make, option: str) -> None:
    with pytest.raises(ValueError, match=option):
        make()


@pytest.mark.parametrize(
    "config",
    [dist_optim.SGDGraftingConfig(), dist_optim.AdaGradGraftingConfig(), dist_optim.RMSpropGraftingConfig(), ADAM],
)
def test_grafting_configs_are_saved_as_their_fields(config: object) -> None:
    """Saved param groups (state_dict, checkpoints) hold a grafting config as plain data (its class
    name and fields: no pickled class, so the files load with weights_only=True) and load back
    to an equal config."""
    p = [nn.Parameter(torch.zeros(3, 2))]
    saved = dist_optim.DistributedShampoo(p, lr=0.1, grafting_config=config).state_dict()
    plain = saved["param_groups"][0]["grafting_config"]
    assert plain == {"dist_optim_option": type(config).__name__, "fields": dataclasses.asdict(config)}
    new = dist_optim.DistributedShampoo([nn.Parameter(torch.zeros(3, 2))], lr=0.1, grafting_config=config)
    new.load_state_dict(saved)
    assert new.param_groups[0]["grafting_config"] == config


def test_start_rules_like_meta() -> None:
    p = [nn.Parameter(torch.zeros(3, 2))]
    for start in (0, 1, 10, 20):  # 0 and 1 always mean "from the first step"
        dist_optim.DistributedShampoo(p, lr=0.1, precondition_frequency=10, start_preconditioning_step=start)
    opt = dist_optim.DistributedShampoo(p, lr=0.1, precondition_frequency=10)
    assert opt.param_groups[0]["start_preconditioning_step"] == 10


# ---- failure paths --------------------------------------------------------------------------------
def _simple(**kwargs):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
    return params, dist_optim.DistributedShampoo(params, lr=0.1, grafting_config=ADAM, **kwargs)


def _grads(params, step):
    gen = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_failed_root_keeps_previous_and_is_counted(monkeypatch) -> None:
    params, opt = _simple()
    for step in range(2):
        _grads(params, step)
        opt.step()
    roots = {k: v.clone() for k, v in opt.state[params[0]].items() if ".root" in k}
    real_eigh = torch.linalg.eigh

    def broken(a: torch.Tensor, *args, **kwargs):
        lam, q = real_eigh(a, *args, **kwargs)
        return lam * float("nan"), q

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    _grads(params, 2)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert opt.root_failures() == 3  # two factors of the matrix, one of the vector
    for k, v in roots.items():
        assert torch.equal(opt.state[params[0]][k], v), k
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(params, before))

    def raising(a: torch.Tensor, *args, **kwargs):
        raise torch.linalg.LinAlgError("eigh did not converge")

    monkeypatch.setattr(torch.linalg, "eigh", raising)
    _grads(params, 3)
    opt.step()
    assert opt.root_failures() == 6
    assert opt.full_state()[0]["block0.failures"].item() == 4


def test_iterative_root_above_threshold_fails() -> None:
    params, opt = _simple(root_inverse="coupled_newton", inverse_failure_threshold=1e-30, epsilon=1e-3)
    for step in range(3):
        _grads(params, step)
        opt.step()
    assert opt.root_failures() == 9
    eye = torch.eye(4)
    assert torch.equal(opt.state[params[0]]["block0.root0"], eye)  # never replaced
    assert all(torch.isfinite(p).all() for p in params)


def test_nonfinite_raises_naming_the_param() -> None:
    params, opt = _simple()
    _grads(params, 0)
    opt.step()
    _grads(params, 1)
    params[1].grad[2] = float("nan")
    with pytest.raises(FloatingPointError, match=r"parameter #1 of param group 0 \(shape \(5,\)\)"):
        opt.step()
    named = dist_optim.DistributedShampoo([{"params": params, "param_names": ["w", "b"]}], lr=0.1)
    params[0].grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="parameter 'w'"):
        named.step()


def test_finite_grad_whose_sum_overflows_is_not_refused() -> None:
    """The check takes each gradient's 2-norm first; a finite gradient whose fp32 norm overflows
    (its squares, at 1e20) goes through the exact per-element check and is stepped, not refused
    or skipped."""
    params, opt = _simple(nonfinite="skip")
    _grads(params, 0)
    params[1].grad.fill_(1e20)
    assert not torch.isfinite(torch._foreach_norm([params[1].grad], 2)[0])
    opt.step()
    assert opt.skipped_steps == 0 and int(opt.state[params[1]]["step"]) == 1


def test_nonfinite_skip_changes_nothing() -> None:
    params, opt = _simple(nonfinite="skip", momentum=0.9)
    for step in range(2):
        _grads(params, step)
        opt.step()
    before_p = [p.detach().clone() for p in params]
    before_s = copy.deepcopy(opt.full_state())
    _grads(params, 2)
    params[0].grad[1, 1] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(params, before_p))
    for s, b in zip(opt.full_state(), before_s):
        assert set(s) == set(b) and all(torch.equal(s[k], b[k]) for k in b)


def test_skip_preconditioning_and_statistics_steps() -> None:
    params, opt = _simple(skip_preconditioning_dim_size_gt=4, statistics_compute_steps=2, precondition_frequency=2)
    for step in range(4):
        _grads(params, step)
        opt.step()
    assert "block0.factor0" in opt.state[params[0]]  # (4, 3): preconditioned
    assert "block0.factor0" not in opt.state[params[1]]  # (5,): grafting only
    assert all(torch.isfinite(p).all() for p in params)


def test_state_dict_round_trip_keeps_preconditioner_dtype() -> None:
    kwargs = dict(preconditioner_dtype=torch.float64, momentum=0.9, eigenvalue_correction=True, eigenbasis="qr")
    params, opt = _simple(**kwargs)
    for step in range(3):
        _grads(params, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    clones = [nn.Parameter(p.detach().clone()) for p in params]
    other = dist_optim.DistributedShampoo(clones, lr=0.1, grafting_config=ADAM, **kwargs)
    other.load_state_dict(saved)
    assert other.state[clones[0]]["block0.factor0"].dtype == torch.float64
    for step in range(3, 6):
        _grads(params, step)
        _grads(clones, step)
        opt.step()
        other.step()
    assert all(torch.equal(a, b) for a, b in zip(params, clones))


# ---- distributed extras (4 gloo processes) ------------------------------------------------------
RESUME_KWARGS = dict(
    lr=1e-2,
    epsilon=1e-6,
    max_preconditioner_dim=3,
    precondition_frequency=2,
    momentum=0.5,
    grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
)


def _resume_worker(kwargs: dict, split: int = 3) -> float:
    """The unbound run saved (full_state + extra_state) after ``split`` steps resumes at dp=4 ZeRO
    with the same trajectory as the uninterrupted unbound run."""

    from dist_optim.testing import grid_groups, zero_chunks

    _, dp_group = grid_groups(1, 4)
    ref_params = [p.clone() for p in parity.full_params("fp32")]
    ref = dist_optim.DistributedShampoo(ref_params, **kwargs)
    saved = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unbound inside a 4-process job, on purpose
        for step in range(parity.STEPS):
            if step == split:
                saved = (ref.full_state(), ref.extra_state(), [p.detach().clone() for p in ref_params])
            for p, g in zip(ref_params, parity.full_grads(step)):
                p.grad = g
            ref.step()
    states, extra, fulls = saved
    params, layouts = zero_chunks(fulls, dp_group)
    opt = dist_optim.DistributedShampoo(params, **kwargs)
    opt.bind(layouts, dp_group=dp_group)
    opt.load_full_state(states)
    opt.load_extra_state(extra)
    held = sum(k.startswith("block") for p in params for k in opt.state[p])
    total = sum(k.startswith("block") for s in states for k in s)
    assert 0 < held < total  # only the owned blocks were kept
    for step in range(split, parity.STEPS):
        for p, g in zip(params, parity.full_grads(step)):
            p.grad = None if g is None else opt.layout(p).take_local(g)
        opt.step()
    got = comm.gather_full([(opt.layout(p), p) for p in params])
    err = max(_rel(a, b) for a, b in zip(got, ref_params))
    for a, b in zip(opt.full_state(), ref.full_state()):
        assert set(a) == set(b)
        err = max([err] + [_rel(a[k], b[k]) for k in b if isinstance(b[k], torch.Tensor) and b[k].numel()])
    return err


@pytest.mark.parametrize(
    "extra", [dict(), dict(eigenvalue_correction=True, eigenbasis="qr", epsilon=1e-8)], ids=["eigh", "soap-qr"]
)
def test_resume_from_full_state_under_another_layout(pool4, extra) -> None:
    errors = pool4.run(_resume_worker, dict(RESUME_KWARGS, **extra))
    assert max(errors) <= 1e-5, errors


def test_load_full_state_refuses_other_blocking() -> None:
    params, opt = _simple()
    _grads(params, 0)
    opt.step()
    states = opt.full_state()
    clones = [nn.Parameter(p.detach().clone()) for p in params]
    other = dist_optim.DistributedShampoo(clones, lr=0.1, grafting_config=ADAM, max_preconditioner_dim=2)
    with pytest.raises(ValueError, match="blocking options"):
        other.load_full_state(states)
    assert not other.state


def test_soap_moment_basis_follows_grafting_and_an_old_checkpoint_is_refused() -> None:
    """SOAP without grafting keeps ``exp_avg_eigen`` (the eigenbasis), with grafting ``exp_avg``; a
    state with the parameter-basis key where the eigenbasis one is expected (an earlier version's
    checkpoint) is refused, naming that cause, not read as the other basis."""
    soap = dict(eigenvalue_correction=True, eigenbasis="qr", precondition_frequency=2)
    graft_params, grafted = _simple(**soap)  # Adam grafting
    params = [nn.Parameter(p.detach().clone()) for p in graft_params]
    opt = dist_optim.DistributedShampoo(params, lr=0.1, **soap)
    for step in range(3):
        _grads(params, step)
        _grads(graft_params, step)
        opt.step()
        grafted.step()
    assert "block0.exp_avg_eigen" in opt.state[params[0]] and "block0.exp_avg" not in opt.state[params[0]]
    assert "block0.exp_avg" in grafted.state[graft_params[0]]
    assert "block0.exp_avg_eigen" not in grafted.state[graft_params[0]]
    old = [{k.replace("exp_avg_eigen", "exp_avg"): v for k, v in state.items()} for state in opt.full_state()]
    clones = [nn.Parameter(p.detach().clone()) for p in params]
    other = dist_optim.DistributedShampoo(clones, lr=0.1, **soap)
    with pytest.raises(ValueError, match="kept the first moment in the parameter's basis"):
        other.load_full_state(old)


BF16_KWARGS = dict(
    lr=1e-2,
    epsilon=1e-6,
    max_preconditioner_dim=3,
    precondition_frequency=2,
    grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8),
    momentum=0.5,
)
BF16_TOL = 1e-3  # max |param - unbound fp32 param| / max |param| after 6 steps
BF16_LAYOUTS = [(2, 2, 2), (1, 4, 0), (1, 4, 1), (4, 1, 0)]


def _bf16_worker() -> list:
    kwargs = dict(BF16_KWARGS, communication_dtype=torch.bfloat16)
    ref_params, _ = parity.reference(dist_optim.DistributedShampoo, kwargs, "fp32")
    out = []
    for tp, dp, zero in BF16_LAYOUTS:
        opt, masters, _ = parity.distributed(dist_optim.DistributedShampoo, kwargs, tp, dp, zero, "fp32")
        full = comm.gather_full([(opt.layout(p), p) for p in masters])
        errs = [_rel(a, b) for a, b in zip(full, ref_params)]
        out.append(((tp, dp, zero), max(errs), [f.clone() for f in full]))
    return out


def test_bf16_communication_within_tolerance(pool4) -> None:
    results = pool4.run(_bf16_worker)
    for layout_idx, (layout, err, _) in enumerate(results[0]):
        assert err < BF16_TOL, f"{layout}: bf16 communication error {err:.3g} >= {BF16_TOL}"
        assert err > 0, f"{layout}: bf16 communication should round something"
        # Every rank (replicas of one dp position included) holds the same full params.
        for rank_result in results[1:]:
            for a, b in zip(rank_result[layout_idx][2], results[0][layout_idx][2]):
                assert torch.equal(a, b), f"{layout}: ranks disagree"


BYTES_KWARGS = dict(lr=1e-2, max_preconditioner_dim=3, grafting_config=dist_optim.SGDGraftingConfig())


def _bytes_worker() -> dict:
    params = [p.clone() for p in parity.full_params("fp32")]
    ref = dist_optim.DistributedShampoo(parity.param_groups(params, BYTES_KWARGS), **BYTES_KWARGS)
    for p, g in zip(params, parity.full_grads(0)):
        p.grad = g
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unbound inside a 4-process job, on purpose
        ref.step()
    comm.reset_counts()
    opt, _, _ = parity.distributed(dist_optim.DistributedShampoo, BYTES_KWARGS, 1, 4, 1, "fp32")
    counts = dict(comm.COUNTS)
    comm.reset_counts()
    opt222, _, _ = parity.distributed(dist_optim.DistributedShampoo, BYTES_KWARGS, 2, 2, 2, "fp32")
    counts222 = dict(comm.COUNTS)
    return dict(
        single=ref.state_bytes()["preconditioner"],
        per_rank=opt.state_bytes()["preconditioner"],
        per_rank222=opt222.state_bytes()["preconditioner"],
        counts=counts,
        counts222=counts222,
    )


def test_memory_split_and_collectives_per_step(pool4) -> None:
    results = pool4.run(_bytes_worker)
    single = results[0]["single"]
    per_rank = [r["per_rank"] for r in results]
    assert sum(per_rank) == single  # every block lives on exactly one rank
    assert max(per_rank) <= 0.4 * single, (per_rank, single)
    # tp=2 x dp=2: the blocks are split over all 4 ranks of the grid, not over each TP rank's
    # dp pair (which would put half of them on every rank).
    per_rank222 = [r["per_rank222"] for r in results]
    assert sum(per_rank222) == single, (per_rank222, single)
    assert max(per_rank222) <= 0.4 * single, (per_rank222, single)
    # Per step: one all-reduce of the gradient checks, one all_to_all of gradient pieces to the
    # block owners and one of the directions' pieces back; once, the ranks of the work group tell
    # each other their pieces (and binding under TP gathers every rank's groups to make the grid).
    steps = parity.STEPS
    for r in results:
        assert r["counts"] == {"all_reduce": steps, "all_to_all": 2 * steps, "all_gather_object": 1}, r["counts"]
        expected = {"all_reduce": steps, "all_to_all": 2 * steps, "all_gather_object": 2}
        assert r["counts222"] == expected, r["counts222"]
    assert math.isfinite(single)


# ---- pieces straight to the block owners ------------------------------------------------------
ROUTE_KWARGS = dict(lr=1e-2, max_preconditioner_dim=3, grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99))
ROUTE_LAYOUTS = ((1, 4, 1), (2, 2, 2), (2, 2, 0), (4, 1, 0))


@contextlib.contextmanager
def _pieces_routed(routed: bool) -> Iterator[None]:
    """Optimizers built and stepped inside move pieces to block owners (True, the default) or
    gather full gradients (False)."""
    OwnerRuntime.route_pieces = routed
    try:
        yield
    finally:
        OwnerRuntime.route_pieces = True


def _route_worker(comm_dtype: torch.dtype) -> dict:
    out: dict = {}
    kwargs = dict(ROUTE_KWARGS, communication_dtype=comm_dtype)
    for layout in ROUTE_LAYOUTS:
        runs = {}
        for routed in (True, False):
            comm.reset_counts()
            with _pieces_routed(routed), counting_collectives() as seen:
                opt, params, _ = parity.distributed(dist_optim.DistributedShampoo, kwargs, *layout, "fp32")
            received = seen.received_bytes("all_gather_into_tensor", "all_to_all_single")
            runs[routed] = (opt, params, received, dict(comm.COUNTS))
        (opt_r, params_r, bytes_r, counts_r), (opt_g, params_g, bytes_g, counts_g) = runs[True], runs[False]
        out[layout] = dict(
            same=_identical(params_r, params_g, opt_r.full_state(), opt_g.full_state()),
            routed=bytes_r,
            gathered=bytes_g,
            counts_routed=counts_r,
            counts_gathered=counts_g,
        )
    return out


@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16])
def test_pieces_go_straight_to_block_owners(pool4, comm_dtype: torch.dtype) -> None:
    """Under ZeRO and TP every rank sends its gradient pieces to the owners of their blocks and
    receives its pieces of the directions (two all_to_all per step), instead of gathering every
    full gradient and every direction: the same parameters and state bit for bit (also with
    bf16 communication), and a fraction of the bytes received per rank."""
    # Received bytes per rank, routed / gathered, measured on every rank (the same with fp32 and
    # bf16 communication): ZeRO over 4 0.22-0.25, TP x ZeRO 2 x 2 0.20-0.22, TP over 4 0.35-0.36
    # (the tiny test shapes' blocks do not split evenly over 4 owners), TP 2 x dp 2 without ZeRO
    # 0.39-0.43 (each rank needs the directions of its TP half). The counts depend only on shapes
    # and layout (no noise); the bounds are the largest ratio plus ~5%.
    bound = {(1, 4, 1): 0.26, (2, 2, 2): 0.23, (2, 2, 0): 0.45, (4, 1, 0): 0.38}
    for res in pool4.run(_route_worker, comm_dtype):
        for layout, r in res.items():
            assert r["same"], layout
            assert r["counts_routed"].get("all_to_all", 0) == 2 * parity.STEPS, (layout, r)
            assert "all_to_all" not in r["counts_gathered"], (layout, r)
            assert r["routed"] <= bound[layout] * r["gathered"], (layout, r["routed"], r["gathered"])


def _fallback_worker() -> dict:
    kwargs = dict(ROUTE_KWARGS, merge_small_dims=True, max_preconditioner_dim=12)
    opt, params, _ = parity.distributed(dist_optim.DistributedShampoo, kwargs, 2, 2, 2, "fp32")
    gathered = [i for i, p in enumerate(params) if opt.owner_runtime.tasks[p].route is None]
    with _pieces_routed(False):
        ref, ref_params, _ = parity.distributed(dist_optim.DistributedShampoo, kwargs, 2, 2, 2, "fp32")
    return dict(gathered=gathered, same=_identical(params, ref_params, opt.full_state(), ref.full_state()))


def test_pieces_that_are_no_boxes_of_the_blocking_are_gathered(pool4) -> None:
    """merge_small_dims merges the TP-split dim of "conv" (3, 4, 3) into (12, 3): that parameter's
    full gradient is gathered, the others move pieces, in the same step, with the same result."""
    conv = next(i for i, spec in enumerate(parity.SPECS) if spec.name == "conv")
    for res in pool4.run(_fallback_worker):
        assert res["gathered"] == [conv], res
        assert res["same"], res


# Through a real ColossalAI booster (DistributedShampoo passed to booster.boost): tests/distributed/test_booster.py.


# Booster checkpoints (exact resume, resharding, layout-independent files) are covered for every
# optimizer, Shampoo included, in tests/distributed/test_checkpoint.py.


# ---- moving in buckets (bucket_bytes) --------------------------------------------------
BUCKET_KWARGS = dict(lr=1e-2, max_preconditioner_dim=3, grafting_config=dist_optim.AdamGraftingConfig(beta2=0.99))


def _identical(params_a: list, params_b: list, states_a: list[dict], states_b: list[dict]) -> bool:
    """Bit-identical parameters and full states (same keys, same values)."""
    return all(torch.equal(a, b) for a, b in zip(params_a, params_b)) and all(
        set(s) == set(b) and all(torch.equal(torch.as_tensor(s[k]), torch.as_tensor(b[k])) for k in s)
        for s, b in zip(states_a, states_b)
    )


# Any bucket_bytes gives the same step bit for bit, with collectives growing only with the
# buckets: tests/unit/test_budget.py (Shampoo, SOAP, Muon, Kron).


def _bucket_nan_worker(mode: str, bucket_bytes: int | None) -> dict:
    kwargs = dict(BUCKET_KWARGS, bucket_bytes=bucket_bytes, nonfinite=mode)
    opt, params, _ = parity.distributed(dist_optim.DistributedShampoo, kwargs, 2, 2, 2, "fp32")
    before = [p.detach().clone() for p in params]
    state_before = opt.full_state()
    for p in params:
        p.grad = torch.zeros_like(p)
    if dist.get_rank() == 3:  # one rank's piece of a late parameter (a later bucket than the first)
        last = max(i for i, p in enumerate(params) if p.numel() > 0)
        params[last].grad.view(-1)[0] = float("nan")
    try:
        opt.step()
        error = None
    except FloatingPointError as exc:
        error = str(exc)
    unchanged = _identical(before, params, state_before, opt.full_state())
    return dict(error=error, unchanged=unchanged, skipped=opt.skipped_steps)


@pytest.mark.parametrize("mode", ["raise", "skip"])
@pytest.mark.parametrize("bucket_bytes", [None, 64])
def test_pieces_are_checked_before_anything_changes(pool4, mode: str, bucket_bytes: int | None) -> None:
    """A NaN in one rank's piece of a late parameter (a late bucket with bucket_bytes) stops
    the step on every rank before anything changes (pieces moved to owners or not)."""
    for res in pool4.run(_bucket_nan_worker, mode, bucket_bytes):
        assert res["unchanged"], res
        if mode == "raise":
            assert res["error"] and "NaN or Inf" in res["error"], res
        else:
            assert res["error"] is None and res["skipped"] == 1, res
