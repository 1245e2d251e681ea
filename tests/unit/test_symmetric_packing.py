"""``use_symmetric_packing``: Shampoo's factors and roots and SOAP's factors kept as packed lower
triangles. The packing itself against this file's own enumeration of a triangle; the packed
optimizer against the unpacked one bit for bit (parameters and every state entry, the packed
matrices unpacked by this file's formula) over several steps with a ``None`` gradient, on shapes
above and below ``structured.MIN_SIZE``, a vector and a 3-D tensor; the symmetric form both keep;
the memory; resuming; bad input. The distributed runs equal the single-device one in the parity grid
(``shampoo-packed``, ``soap-packed`` in tests/helpers/cases.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim.kernels import structured

# 300 rows: a factor above structured.MIN_SIZE (256), updated in one triangle; the others below it.
SHAPES = [(300, 40), (33, 17), (17,), (5, 6, 7)]
GRAFT = dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8)
CONFIGS = {
    "eigh": dict(),
    "warm": dict(root_inverse="warm", refresh_tolerance=0.05),
    "coupled-newton": dict(root_inverse="coupled_newton", epsilon=1e-6),
    "graft-momentum-pf2": dict(grafting_config=GRAFT, momentum=0.5, precondition_frequency=2),
    "stats-every-2-fp64": dict(
        statistics_compute_steps=2, precondition_frequency=2, preconditioner_dtype=torch.float64
    ),
    "blocks-16": dict(max_preconditioner_dim=16),
    "soap": dict(eigenvalue_correction=True),
    "soap-qr": dict(eigenvalue_correction=True, eigenbasis="qr", grafting_config=GRAFT),
}


def _lower(m: torch.Tensor) -> torch.Tensor:
    """The lower triangle row by row, enumerated here element by element."""
    n = m.shape[0]
    return torch.stack([m[i, j] for i in range(n) for j in range(i + 1)])


def _whole(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The symmetric matrix of a packed lower triangle, by this file's formula."""
    out = torch.empty(n, n, dtype=packed.dtype)
    pos = 0
    for i in range(n):
        for j in range(i + 1):
            out[i, j] = out[j, i] = packed[pos]
            pos += 1
    assert pos == packed.numel()
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_pack_and_unpack_by_formula(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    assert torch.equal(structured.pack_lower(a), _lower(a))
    assert torch.equal(structured.pack_lower(a.T), _lower(a.T))  # a transposed view: its own lower triangle
    packed = _lower(a)
    assert torch.equal(structured.unpack_symmetric(packed, n), _whole(packed, n))
    out = torch.full((n, n), float("nan"), dtype=torch.float64)
    assert structured.unpack_symmetric(packed, n, out=out) is out and torch.equal(out, _whole(packed, n))
    mirrored = structured.mirror_lower_(a.clone(), panel=3)
    assert torch.equal(mirrored, _whole(packed, n))
    # The GPU's form (the packing's round trip instead of panels), run here on CPU tensors; a transposed
    # view (how a factor's kept triangle can be stored) mirrors its own lower triangle.
    monkeypatch.setattr(structured, "blocked", lambda t: False)
    assert torch.equal(structured.mirror_lower_(a.clone()), _whole(packed, n))
    base = a.clone()
    assert torch.equal(structured.mirror_lower_(base.T), _whole(_lower(a.T), n))
    assert torch.equal(base.T, _whole(_lower(a.T), n))
    monkeypatch.undo()
    assert structured.packed_size(n) == packed.numel()
    meta = torch.empty(n, n, device="meta")  # the planner's simulation: shapes only
    assert structured.pack_lower(meta).shape == (n * (n + 1) // 2,)


@pytest.mark.parametrize("n", [5, 300])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed-view"])
def test_mirror_is_the_packings_round_trip_to_the_bit(n: int, transposed: bool) -> None:
    """On the CPU (panels of 128, the last one partial at n=300; panels of 2 at n=5) the mirror is
    pure copies, as ``unpack_symmetric(pack_lower(c))``: the same bits, a negative zero on the
    diagonal, in a diagonal tile's lower part or below the tiles staying negative on both sides."""
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen)
    for i, j in ((0, 0), (4, 1), (n - 1, 2), (n - 1, n - 1)):
        a[i, j] = -0.0
    c = a.T.contiguous().T if transposed else a.clone()
    expected = structured.unpack_symmetric(structured.pack_lower(c), n)
    got = structured.mirror_lower_(c, panel=2 if n == 5 else None)
    assert torch.equal(got.contiguous().view(torch.int32), expected.view(torch.int32))
    assert bool(torch.signbit(got[1, 4])) and bool(torch.signbit(got[n - 1, n - 1]))


def test_pack_refuses_a_strided_view() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        structured.pack_lower(torch.zeros(8, 8)[::2, ::2])


def _run(pack: bool, steps: int = 7, **kwargs: Any) -> tuple[list[torch.nn.Parameter], Any]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = dist_optim.DistributedShampoo(params, lr=1e-2, use_symmetric_packing=pack, **kwargs)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g)
            p.grad = None if (step == 3 and i == 0) else grad
        opt.step()
    return params, opt


def _symmetric_names(key: str) -> bool:
    return key.rsplit(".", 1)[-1].startswith(("factor", "root"))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_packed_equals_unpacked_bit_for_bit(config: str) -> None:
    """Parameters after every step, then every state entry: the packed matrices, unpacked by this
    file's formula, equal the unpacked optimizer's, which are exactly symmetric."""
    kwargs = CONFIGS[config]
    plain_params, plain = _run(False, **kwargs)
    packed_params, packed = _run(True, **kwargs)
    for a, b in zip(plain_params, packed_params):
        assert torch.equal(a, b)
    plain_state, packed_state = plain.state_dict()["state"], packed.state_dict()["state"]
    compared = 0
    for pid, entries in plain_state.items():
        assert set(entries) == set(packed_state[pid])
        for key, value in entries.items():
            other = packed_state[pid][key]
            if _symmetric_names(key):
                assert other.dim() == 1 and value.dim() == 2, key
                assert torch.equal(value, value.T), f"{key}: the unpacked matrix is not exactly symmetric"
                assert torch.equal(_whole(other, value.shape[0]), value), key
                compared += 1
            else:
                assert torch.equal(value, other), key
    assert compared >= 4


def test_packing_halves_the_matrices() -> None:
    """Packed bytes of the matrices are d (d + 1) / 2 per d x d one, from the unpacked state's own
    shapes; Shampoo with the default options keeps about half the preconditioner's memory."""
    _, plain = _run(False, steps=2)
    _, packed = _run(True, steps=2)
    expected = 0
    for entries in plain.state_dict()["state"].values():
        for key, value in entries.items():
            if _symmetric_names(key):
                d = value.shape[0]
                expected += d * (d + 1) // 2 * value.element_size()
    assert packed.state_bytes()["preconditioner"] == expected
    assert packed.state_bytes()["other"] == plain.state_bytes()["other"]
    assert packed.state_bytes()["preconditioner"] < 0.51 * plain.state_bytes()["preconditioner"]


def test_resume_from_state_dict_and_full_state_is_exact() -> None:
    reference, _ = _run(True, steps=6, grafting_config=GRAFT)

    def resumed(via_full_state: bool) -> list[torch.Tensor]:
        params, opt = _run(True, steps=3, grafting_config=GRAFT)
        fresh = dist_optim.DistributedShampoo(params, lr=1e-2, use_symmetric_packing=True, grafting_config=GRAFT)
        if via_full_state:
            fresh.load_full_state(copy.deepcopy(opt.full_state()))
        else:
            fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
        for step in range(3, 6):
            g = torch.Generator().manual_seed(100 + step)
            for i, p in enumerate(params):
                grad = torch.randn(p.shape, generator=g)
                p.grad = None if (step == 3 and i == 0) else grad
            fresh.step()
        return [p.detach() for p in params]

    for via_full_state in (False, True):
        for a, b in zip(reference, resumed(via_full_state)):
            assert torch.equal(a, b)


def test_a_packed_checkpoint_into_an_unpacked_optimizer_is_refused_by_name() -> None:
    params, packed = _run(True, steps=2)
    plain = dist_optim.DistributedShampoo(params, lr=1e-2)
    with pytest.raises(ValueError, match="use_symmetric_packing"):
        plain.load_full_state(packed.full_state())


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_option_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="use_symmetric_packing"):
        dist_optim.DistributedShampoo([torch.nn.Parameter(torch.zeros(4, 4))], use_symmetric_packing=value)


def test_a_state_dict_of_the_other_form_is_refused_before_loading() -> None:
    """A state dict saved before the option existed (its groups lack it) takes the loading
    optimizer's value: whole matrices into a packed optimizer are refused by name, and nothing
    of the optimizer's own state changes."""
    params, plain = _run(False, steps=2)
    saved = copy.deepcopy(plain.state_dict())
    for group in saved["param_groups"]:
        del group["use_symmetric_packing"]
    _, packed = _run(True, steps=2)
    before = copy.deepcopy(packed.state_dict())
    with pytest.raises(ValueError, match="use_symmetric_packing=True"):
        packed.load_state_dict(saved)
    after = packed.state_dict()
    for pid, entries in before["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, after["state"][pid][key]) if isinstance(value, torch.Tensor) else True
