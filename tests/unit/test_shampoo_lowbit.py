"""DistributedShampoo with ``preconditioner_bits`` 8 and 4 (quantised eigenvectors).

The format (dist_optim/states/lowbit.py) against this file's own formulas: codes ``round(x / absmax * h) +
h`` per block, two to a byte at 4 bits, values ``(c - h) / h * absmax``, the Björck step. The
optimizer against a float64 reference written here (on tests/helpers/shampoo_reference.py's moments,
factors and grafting): each step from our state, the stored codes decoded by formula, rectified and
made into ``R_k = Q_k diag(s_k) Q_k^T`` (SOAP: its bases) in float64, the parameters element-wise
within 2e-5 of the step; at each refresh the stored spectra against the float64 eigenvalues of the
factors and the decoded eigenvectors against the float64 ones within half a quantisation step
(columns with separated eigenvalues). Several steps, one ``None`` gradient, sides whose squares fill
whole quantisation blocks (64 x 64 at 4 and 8 bits, 40 x 40 at 4) or need padding (odd sides: a half
byte too), a 3-D tensor, and a vector, whose root stays fp32 (``quantises_bases``). Then the memory,
resuming, and bad input. The distributed runs equal the single-device one in the parity grid
(``shampoo-4bit``, ``soap-4bit`` in tests/helpers/cases.py) and through the booster's checkpoints
(tests/distributed/test_checkpoint.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim.states import lowbit
from tests.helpers import blockwise
from tests.helpers.shampoo_reference import ReferenceShampoo, mode_product

SHAPES = [(64, 40), (33, 17), (17,), (5, 6, 7)]
ADAM = dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8)
KWARGS = dict(lr=1e-2, epsilon=1e-3, precondition_frequency=2, momentum=0.5, grafting_config=ADAM)
NONE_STEP = 3  # the first parameter gets no gradient at this step
H = {4: 7, 8: 127}
BLOCK = {4: 64, 8: 256}


# ---- the format, by formula ----------------------------------------------------------------------
def _codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """One code per element: at 4 bits element 2i is byte i's low nibble, 2i + 1 its high one."""
    b = packed.long()
    if bits == 8:
        return b[:n]
    return torch.stack([b % 16, b // 16], dim=1).reshape(-1)[:n]


def _decode(packed: torch.Tensor, absmax: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """float64 values ``(c - h) / h * absmax`` of the blocks of consecutive elements."""
    c = _codes(packed, bits, n).double()
    scale = absmax.double().repeat_interleave(BLOCK[bits])[:n]
    return (c - H[bits]) / H[bits] * scale


def _rectify(q: torch.Tensor) -> torch.Tensor:
    return q @ (3 * torch.eye(q.shape[0], dtype=q.dtype) - q.T @ q) / 2


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [1, 9, 64, 65, 256, 300, 1600])
def test_quantize_and_dequantize_by_formula(bits: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen)
    x[:3] = 0.0  # zeros are exact
    codes, absmax = lowbit.quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.numel() == (n if bits == 8 else (n + 1) // 2)
    blocks = -(-n // BLOCK[bits])
    padded = torch.zeros(blocks * BLOCK[bits], dtype=torch.float64)
    padded[:n] = x.double()
    assert torch.equal(absmax.double(), padded.view(blocks, -1).abs().amax(1))
    got = _codes(codes, bits, n)
    scale = absmax.double().repeat_interleave(BLOCK[bits])[:n]
    exact = x.double() / torch.where(scale > 0, scale, 1.0) * H[bits]  # a zero block: zero codes
    expected = torch.round(exact).long() + H[bits]
    tie = (exact - exact.floor() - 0.5).abs() < 1e-5  # fp32 and float64 may round a tie apart
    assert torch.equal(got[~tie], expected[~tie]) and int((got - expected).abs().max()) <= 1
    assert int(got.min()) >= 0 and int(got.max()) <= 2 * H[bits]
    if bits == 4 and n % 2:
        assert int(codes[-1]) >> 4 == H[bits]  # the pad is the zero code
    values = lowbit.dequantize_lowbit(codes, absmax, bits, n)
    # The format's two fp32 roundings, (c - h) / h and the product with absmax:
    in_fp32 = (got.float() - H[bits]) / H[bits] * absmax.repeat_interleave(BLOCK[bits])[:n]
    assert torch.equal(values, in_fp32)
    assert bool(((values.double() - x.double()).abs() <= scale / H[bits] / 2 * (1 + 1e-6)).all())
    assert torch.equal(values[:3], torch.zeros(min(n, 3)))


@pytest.mark.parametrize("bits", [4, 8])
def test_identity_round_trips_and_rectification(bits: int) -> None:
    eye = torch.eye(17)
    assert torch.equal(lowbit.dequantize_lowbit(*lowbit.quantize(eye, bits), bits, 289).view(17, 17), eye)
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen, dtype=torch.float64))
    noisy = (q + 0.01 * torch.randn(40, 40, generator=gen, dtype=torch.float64)).float()
    rect = lowbit.rectify(noisy)
    torch.testing.assert_close(rect.double(), _rectify(noisy.double()), rtol=0, atol=1e-5)
    eye64 = torch.eye(40, dtype=torch.float64)
    departure = float((noisy.double().T @ noisy.double() - eye64).norm())
    assert float((rect.double().T @ rect.double() - eye64).norm()) < 0.1 * departure


# ---- the optimizer against float64 ---------------------------------------------------------------
def _params() -> list[torch.nn.Parameter]:
    return blockwise.params(shapes=SHAPES)


def _grads(step: int) -> list[torch.Tensor | None]:
    return blockwise.grads(step, SHAPES, (NONE_STEP, 0), growing=False)


def _blocks(state: dict[str, Any]) -> list[str]:
    return sorted({k.split(".")[0] + "." for k in state if k.startswith("block")})


def _order(state: dict[str, Any], prefix: str) -> int:
    return sum(1 for k in state if k.startswith(prefix + "factor"))


def _decoded_bases(state: dict[str, Any], prefix: str, bits: int) -> list[torch.Tensor]:
    """The stored eigenvectors of a block, decoded and rectified in float64 by this file's formulas."""
    out = []
    for k in range(_order(state, prefix)):
        d = state[f"{prefix}factor{k}"].shape[0]
        raw = _decode(state[f"{prefix}basis{k}"], state[f"{prefix}basis{k}_absmax"], bits, d * d).view(d, d)
        out.append(_rectify(raw))
    return out


class _Quantised(ReferenceShampoo):
    """The reference's moments, factors, grafting and update, with the preconditioner of each
    block given: Shampoo's roots, or SOAP's bases (what our step stored, decoded here)."""

    given: dict[int, dict[str, list[torch.Tensor]]]

    def _shampoo(self, st, key, g, t, mhat, d, refresh, corr):  # type: ignore[no-untyped-def]
        if t < self.start:
            return d
        p = mhat
        for k, r in enumerate(self.given[id(st)][key]):
            p = mode_product(p, r, k)
        return self._graft(p, d)

    def _soap(self, st, key, g, t, mhat, d, refresh, corr):  # type: ignore[no-untyped-def]
        for k, q in enumerate(self.given[id(st)][key]):
            st[f"{key}basis{k}"] = q
        return super()._soap(st, key, g, t, mhat, d, False, corr)


def _check_refresh(state: dict[str, Any], ref_state: dict[str, Any], prefix: str, bits: int, soap: bool) -> int:
    """The refreshed eigen-pairs of a block against float64 ``eigh`` of the reference's factors
    (bias-corrected, damped for Shampoo): Shampoo's spectra as eigenvalues ``s^(-1/alpha)`` within
    1e-5 of the largest, and the decoded eigenvectors of separated eigenvalues (gap above 1% of
    the largest), signs aligned, within half a quantisation step (plus 1e-5). Returns the columns
    compared."""
    order = _order(state, prefix)
    t = int(state["step"])
    compared = 0
    for k, q in enumerate(_decoded_bases(state, prefix, bits)):
        d = q.shape[0]
        raw = _decode(state[f"{prefix}basis{k}"], state[f"{prefix}basis{k}_absmax"], bits, d * d).view(d, d)
        a = ref_state[f"{prefix}factor{k}"] / (1 - 0.999**t)
        if not soap:
            a = a + 1e-3 * torch.eye(d, dtype=torch.float64)
        lam, vec = torch.linalg.eigh(a)
        if soap:
            lam, vec = lam.flip(0), vec.flip(1)  # decreasing, as eigenbasis() orders them
        else:
            got = state[f"{prefix}spectrum{k}"].double().pow(-2.0 * order)  # alpha = 1 / (2 order)
            assert float((got - lam).abs().max()) <= 1e-5 * float(lam.abs().max()), (prefix, k)
        step = state[f"{prefix}basis{k}_absmax"].double().repeat_interleave(BLOCK[bits])[: d * d].view(d, d) / H[bits]
        gaps = torch.diff(lam).abs()
        gap = torch.minimum(torch.cat([gaps, gaps[-1:]]), torch.cat([gaps[:1], gaps])) if d > 1 else lam.abs()
        for j in torch.nonzero(gap > 1e-2 * lam.abs().max()).flatten().tolist():
            ref = vec[:, j] * torch.sign(vec[:, j] @ raw[:, j])
            assert bool(((raw[:, j] - ref).abs() <= step[:, j] / 2 + 1e-5).all()), (prefix, k, j)
            compared += 1
    return compared


@pytest.mark.parametrize(
    ("bits", "extra"),
    [(4, {}), (8, {}), (4, dict(eigenvalue_correction=True)), (8, dict(eigenvalue_correction=True))],
    ids=["shampoo-4", "shampoo-8", "soap-4", "soap-8"],
)
def test_each_step_against_float64_from_our_state(bits: int, extra: dict[str, Any]) -> None:
    """Each step of ours against one float64 step of the quantised algorithm from the same state
    (momentum 0.5 and Adam grafting: the whole update): the parameters, beyond their own fp32
    rounding, within 2e-5 of the step's size; the state of a parameter without a gradient
    untouched; refreshes as :func:`_check_refresh` says (measured: 1e-6 of the step)."""
    soap = bool(extra)
    params = _params()
    opt = dist_optim.DistributedShampoo(params, preconditioner_bits=bits, **KWARGS, **extra)
    ref_kwargs = {k: v for k, v in KWARGS.items() if k != "grafting_config"}
    worst, columns = 0.0, 0
    for step in range(6):
        ref = _Quantised(params, graft=("adam", 0.99, 1e-8), eigenvalue_correction=soap, **ref_kwargs)
        ref.state = [
            {k: (int(v) if k == "step" else v.double().clone()) for k, v in opt.state[p].items()} for p in params
        ]
        before = [p.detach().double().clone() for p in params]
        grads = _grads(step)
        untouched = copy.deepcopy(opt.state[params[0]])
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        opt.step()
        ref.given = {}
        for p, st in zip(params, ref.state):
            state = opt.state[p]
            mats = {}
            for prefix in _blocks(state):
                if _order(state, prefix) == 1:  # a vector's root / basis stays whole (quantises_bases)
                    mats[prefix] = [state[prefix + ("basis0" if soap else "root0")].double()]
                    continue
                bases = _decoded_bases(state, prefix, bits)
                spectra = [state[f"{prefix}spectrum{k}"].double() for k in range(len(bases))] if not soap else []
                mats[prefix] = [q @ torch.diag(s) @ q.T for q, s in zip(bases, spectra)] if not soap else bases
            ref.given[id(st)] = mats
        ref.step(grads)
        for i, (p, expected, w) in enumerate(zip(params, ref.params, before)):
            state = opt.state[p]
            if grads[i] is None:
                assert torch.equal(p.detach().double(), w)
                assert all(torch.equal(v, untouched[k]) for k, v in state.items())
                continue
            scale = float((expected - w).abs().max())
            beyond = (p.detach().double() - expected).abs() - expected.abs() * 2**-24
            worst = max(worst, float(beyond.max()) / scale)
            t = int(state["step"])
            if t >= 2 and t % 2 == 0:  # a refresh step
                for prefix in _blocks(state):
                    if _order(state, prefix) > 1:
                        columns += _check_refresh(state, ref.state[i], prefix, bits, soap)
    assert worst <= 2e-5, worst
    assert columns >= 100, columns


def test_warm_refresh_keeps_the_codes_of_kept_eigenvectors() -> None:
    """``root_inverse="warm"`` starts from the decoded eigenvectors; where it keeps them the codes
    are not quantised again (no drift), and its steps follow the ``eigh`` run closely."""
    params = _params()
    opt = dist_optim.DistributedShampoo(
        params, preconditioner_bits=4, root_inverse="warm", refresh_tolerance=0.5, **KWARGS
    )
    kept = 0
    for step in range(6):
        codes = {k: v.clone() for k, v in opt.state[params[1]].items() if k.endswith("basis0")}
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
        if step >= 2 and step % 2 == 1 and codes:  # t = step + 1 even: a refresh
            kept += int(all(torch.equal(v, opt.state[params[1]][k]) for k, v in codes.items()))
    assert kept >= 1
    assert all(bool(torch.isfinite(p).all()) for p in params)


# ---- state -----------------------------------------------------------------------------------------
def _run(steps: int, split: int | None = None, via_full_state: bool = False, **kwargs: Any) -> list[torch.Tensor]:
    params = _params()
    opt = dist_optim.DistributedShampoo(params, **kwargs)
    for step in range(steps):
        if step == split:
            fresh = dist_optim.DistributedShampoo(params, **kwargs)
            if via_full_state:
                fresh.load_full_state(copy.deepcopy(opt.full_state()))
            else:
                fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
            opt = fresh
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("soap", [False, True])
def test_resume_from_state_dict_and_full_state_is_exact(soap: bool) -> None:
    kwargs = dict(
        KWARGS,
        preconditioner_bits=4,
        use_symmetric_packing=True,
        optim_bits=8,
        min_8bit_size=0,
        eigenvalue_correction=soap,
    )
    reference = _run(6, **kwargs)
    for via_full_state in (False, True):
        for a, b in zip(reference, _run(6, 3, via_full_state, **kwargs)):
            assert torch.equal(a, b)


def test_the_state_holds_codes_and_shrinks() -> None:
    """The stored form, entry by entry, and its bytes against the 32-bit roots."""
    states = {}
    for bits in (32, 8, 4):
        params = _params()
        opt = dist_optim.DistributedShampoo(params, preconditioner_bits=bits, **KWARGS)
        for p, g in zip(params, _grads(0)):
            p.grad = g
        opt.step()
        states[bits] = (opt.state[params[0]], opt.state_bytes()["preconditioner"])
        vector = opt.state[params[2]]
        assert vector["block0.root0"].dtype == torch.float32 and "block0.spectrum0" not in vector
    st4 = states[4][0]
    assert "block0.root0" not in st4 and st4["block0.basis0"].dtype == torch.uint8
    assert st4["block0.basis0"].shape == (64 * 64 // 2,) and st4["block0.basis0_absmax"].shape == (64,)
    assert st4["block0.basis1"].shape == (800,) and st4["block0.basis1_absmax"].shape == (25,)
    assert st4["block0.spectrum0"].shape == (64,) and torch.equal(st4["block0.spectrum0"], torch.ones(64))
    assert states[8][0]["block0.basis1"].shape == (1600,) and states[8][0]["block0.basis1_absmax"].shape == (7,)
    matrices = [s for s in SHAPES if len(s) > 1]  # the vector keeps its fp32 root (quantises_bases)
    roots = sum(d * d * 4 for shape in matrices for d in shape)
    for bits in (8, 4):
        quantised = sum(
            lowbit.codes_numel(d * d, bits) + 4 * lowbit.absmax_numel(d * d, bits) + 4 * d for s in matrices for d in s
        )
        assert states[32][1] - states[bits][1] == roots - quantised


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(preconditioner_bits=16), "preconditioner_bits must be 32, 8 or 4, got 16"),
        (dict(preconditioner_bits=True), "preconditioner_bits must be 32, 8 or 4, got True"),
        (dict(preconditioner_bits="4"), "preconditioner_bits must be 32, 8 or 4"),
        (dict(preconditioner_bits=4, root_inverse="coupled_newton"), "root_inverse='eigh' or 'warm'"),
        (dict(preconditioner_bits=8, root_inverse="higher_order"), "or preconditioner_bits=32"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dist_optim.DistributedShampoo([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_a_state_of_the_other_form_is_refused_before_loading() -> None:
    """A state dict saved before the option existed (its groups lack it) takes the loading
    optimizer's value: fp32 roots into a 4-bit optimizer are refused by name, nothing changes; a
    full state of another width fails on the shapes, naming the option."""
    runs = {}
    for bits in (32, 4):
        params = _params()
        opt = dist_optim.DistributedShampoo(params, preconditioner_bits=bits, **KWARGS)
        for p, g in zip(params, _grads(0)):
            p.grad = g
        opt.step()
        runs[bits] = opt
    saved = copy.deepcopy(runs[32].state_dict())
    for group in saved["param_groups"]:
        del group["preconditioner_bits"]
    before = copy.deepcopy(runs[4].state_dict())
    with pytest.raises(ValueError, match="preconditioner_bits=4; build the optimizer with preconditioner_bits=32"):
        runs[4].load_state_dict(saved)
    after = runs[4].state_dict()
    assert all(torch.equal(v, after["state"][pid][k]) for pid, e in before["state"].items() for k, v in e.items())
    saved = copy.deepcopy(runs[4].state_dict())
    for group in saved["param_groups"]:
        del group["preconditioner_bits"]
    with pytest.raises(ValueError, match="the preconditioner_bits it was saved with"):
        runs[32].load_state_dict(saved)
    for src, dst in ((32, 4), (4, 32)):
        with pytest.raises(ValueError, match="preconditioner_bits"):
            runs[dst].load_full_state(runs[src].full_state())
