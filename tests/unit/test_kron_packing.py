"""``use_symmetric_packing`` for DistributedKron: its upper-triangular factors kept as packed upper
triangles (for Kron the packed matrices are triangular, not symmetric). The packing itself against
this file's own enumeration of a triangle; the packed optimizer against the unpacked one bit for bit
(parameters after every step, then every state entry, the packed factors unpacked by this file's
formula) over several steps with a ``None`` gradient, on triangular factors above and below
``structured.MIN_SIZE``, a dim above ``max_size_triangular`` (diagonal), a vector, a 3-D tensor, a
scalar, balancing, steps without a fit, the fit to the raw gradient, the blocked path of large
tensors (:mod:`dist_optim.kron.blocks`) and 8-bit momenta; the unpacked factors' strict lower
triangle exactly zero at every step; the memory; resuming; bad input. The distributed runs equal
the single-device one in the parity grid (``kron-packed`` in tests/helpers/cases.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim.kernels import structured

# 300: a triangular factor above structured.MIN_SIZE (256), worked on by the recursive products;
# 40, 33, 17 below it; a vector and a scalar (diagonal factors); a 3-D tensor (merged to 30 x 7).
SHAPES = [(300, 40), (33, 17), (17,), (5, 6, 7), ()]
NONE_GRAD = (3, 0)  # at step 3, param 0 gets no gradient
STEPS = 6
CONFIGS: dict[str, dict[str, Any]] = {
    "default": dict(),
    "balanced": dict(balance=True),  # balancing on every update step (kron_torch: 1% of them)
    "diag-above-max-size": dict(max_size_triangular=100, weight_decay=1e-2),
    "p0.5-grad-one_diag": dict(
        preconditioner_update_probability=0.5, momentum_into_precond_update=False, memory_save_mode="one_diag"
    ),
    "init-from-grad-fp64": dict(precond_init_scale=None, precond_dtype=torch.float64),
    "blocked": dict(blocked=True, max_size_triangular=100),
    "8bit": dict(optim_bits=8, min_8bit_size=0),
}


def _upper(m: torch.Tensor) -> torch.Tensor:
    """The upper triangle column by column, enumerated here element by element."""
    n = m.shape[0]
    return torch.stack([m[i, j] for j in range(n) for i in range(j + 1)])


def _whole(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The upper-triangular matrix of a packed upper triangle, by this file's formula."""
    out = torch.zeros(n, n, dtype=packed.dtype)
    pos = 0
    for j in range(n):  # column j's rows 0..j
        out[: j + 1, j] = packed[pos : pos + j + 1]
        pos += j + 1
    assert pos == packed.numel()
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_pack_and_unpack_upper_by_formula(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    packed = structured.pack_upper(a)
    assert torch.equal(packed, _upper(a))
    assert torch.equal(structured.pack_upper(a.triu()), packed)  # the lower triangle is not read
    assert torch.equal(structured.unpack_upper_triangular(packed, n), _whole(packed, n))
    out = torch.full((n, n), float("nan"), dtype=torch.float64)
    assert structured.unpack_upper_triangular(packed, n, out=out) is out
    assert torch.equal(out, a.triu()) and not out.tril(-1).signbit().any()  # +0 below the diagonal
    assert structured.packed_size(n) == packed.numel()
    meta = torch.empty(n, n, device="meta")  # the planner's simulation: shapes only
    assert structured.pack_upper(meta).shape == (n * (n + 1) // 2,)
    assert structured.unpack_upper_triangular(structured.pack_upper(meta), n).shape == (n, n)


def test_pack_upper_refuses_a_strided_view() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        structured.pack_upper(torch.zeros(8, 8).T)


def _triangular(key: str, value: torch.Tensor, plain: torch.Tensor) -> bool:
    return key.startswith("Q_") and plain.dim() == 2


def _lockstep(config: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, list[Any], list[Any]]:
    """The unpacked and the packed optimizer, stepped together; parameters compared after every
    step and the unpacked factors' strict lower triangle checked to be exactly +0."""
    kwargs = dict(CONFIGS[config])
    if kwargs.pop("balance", False):
        from dist_optim.kron import randomness

        monkeypatch.setattr(randomness, "BALANCE_PROBABILITY", 1.0)
    shapes = SHAPES
    if kwargs.pop("blocked", False):
        from dist_optim.kron import blocks

        monkeypatch.setattr(blocks, "ROW_BLOCK_MIN_BYTES", 1)
        monkeypatch.setattr(blocks, "ROW_BLOCK_BYTES", 40 * 4 * 64)  # 64 rows of 40 float32 a block
        shapes = [(600, 40), (300, 24, 2), *SHAPES[1:]]
    if kwargs.get("optim_bits") == 8:
        pytest.importorskip("bitsandbytes")
    runs = []
    for pack in (False, True):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = dist_optim.DistributedKron(params, lr=1e-2, seed=3, use_symmetric_packing=pack, **kwargs)
        runs.append((params, opt))
    (plain_params, plain), (packed_params, packed) = runs
    for step in range(STEPS):
        for params, opt in runs:
            gen = torch.Generator().manual_seed(100 + step)
            for i, p in enumerate(params):
                grad = torch.randn(p.shape, generator=gen)
                p.grad = None if (step, i) == NONE_GRAD else grad
            opt.step()
        for a, b in zip(plain_params, packed_params):
            assert torch.equal(a, b), f"step {step}"
        for p in plain_params:
            for key, q in plain.state[p].items():
                if key.startswith("Q_") and q.dim() == 2:
                    below = q.tril(-1)
                    assert torch.equal(below, torch.zeros_like(below)) and not below.signbit().any(), key
    return plain, packed, plain_params, packed_params


@pytest.mark.parametrize("config", list(CONFIGS))
def test_packed_equals_unpacked_bit_for_bit(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters after every step, then every state entry: the packed factors, unpacked by this
    file's formula, equal the unpacked optimizer's; the full states too."""
    plain, packed, _, _ = _lockstep(config, monkeypatch)
    plain_state, packed_state = plain.state_dict()["state"], packed.state_dict()["state"]
    compared = 0
    for pid, entries in plain_state.items():
        assert set(entries) == set(packed_state[pid])
        for key, value in entries.items():
            other = packed_state[pid][key]
            if _triangular(key, other, value):
                assert other.dim() == 1 and other.numel() == structured.packed_size(value.shape[0]), key
                assert torch.equal(_whole(other, value.shape[0]), value), key
                compared += 1
            else:
                assert torch.equal(value, other), key
    assert compared >= 3
    gens = [opt._random.generator(torch.device("cpu")).get_state() for opt in (plain, packed)]
    assert torch.equal(*gens)  # the same random numbers drawn
    for a, b in zip(plain.full_state(), packed.full_state()):
        for key, value in a.items():
            other = _whole(b[key], value.shape[0]) if _triangular(key, b[key], value) else b[key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


def test_packing_stores_triangles_of_the_factors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored bytes of every triangular factor are d (d + 1) / 2 * itemsize (d from the unpacked
    state's own shapes); diagonal factors and momenta unchanged."""
    plain, packed, plain_params, packed_params = _lockstep("default", monkeypatch)
    expected = actual = other_plain = other_packed = 0
    for p, q in zip(plain_params, packed_params):
        for key, value in plain.state[p].items():
            stored = packed.state[q][key]
            if key.startswith("Q_") and value.dim() == 2:
                d = value.shape[0]
                expected += d * (d + 1) // 2 * value.element_size()
                actual += stored.untyped_storage().nbytes()
            else:
                other_plain += value.untyped_storage().nbytes()
                other_packed += stored.untyped_storage().nbytes()
    assert actual == expected == (300 * 301 + 40 * 41 + 33 * 34 + 17 * 18 + 30 * 31 + 7 * 8) // 2 * 4
    assert other_packed == other_plain


def _train(opt: dist_optim.DistributedKron, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=gen)
            p.grad = None if (step, i) == NONE_GRAD else grad
        opt.step()


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def test_resume_from_state_dict_and_full_state_is_exact() -> None:
    kwargs = dict(lr=1e-2, seed=3, use_symmetric_packing=True, preconditioner_update_probability=0.5)
    reference = _params()
    _train(dist_optim.DistributedKron(reference, **kwargs), reference, range(STEPS))
    for via_full_state in (False, True):
        params = _params()
        opt = dist_optim.DistributedKron(params, **kwargs)
        _train(opt, params, range(3))
        fresh = dist_optim.DistributedKron(params, **kwargs)
        if via_full_state:
            fresh.load_full_state(copy.deepcopy(opt.full_state()))
            fresh.load_extra_state(copy.deepcopy(opt.extra_state()))
        else:
            fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
        _train(fresh, params, range(3, STEPS))
        for a, b in zip(reference, params):
            assert torch.equal(a, b), via_full_state


@pytest.mark.parametrize("saved_packed", [True, False])
def test_a_checkpoint_of_the_other_form_is_refused_by_name(saved_packed: bool) -> None:
    params = _params()
    saved = dist_optim.DistributedKron(params, use_symmetric_packing=saved_packed)
    _train(saved, params, range(2))
    other = dist_optim.DistributedKron(params, use_symmetric_packing=not saved_packed)
    with pytest.raises(ValueError, match=f"use_symmetric_packing={saved_packed}") as err:
        other.load_full_state(saved.full_state())
    assert "\n" not in str(err.value)
    assert not other.state  # nothing replaced


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_option_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="use_symmetric_packing"):
        dist_optim.DistributedKron([torch.nn.Parameter(torch.zeros(4, 4))], use_symmetric_packing=value)


def test_an_older_state_dict_with_whole_factors_is_refused_before_loading() -> None:
    """A state dict saved before the option existed (its groups lack it) takes the loading
    optimizer's value: its whole factors into a packed optimizer are refused by name, before
    anything is loaded."""
    params = _params()
    plain = dist_optim.DistributedKron(params)
    _train(plain, params, range(2))
    saved = copy.deepcopy(plain.state_dict())
    for group in saved["param_groups"]:
        del group["use_symmetric_packing"]
    packed = dist_optim.DistributedKron(params, use_symmetric_packing=True)
    with pytest.raises(ValueError, match="use_symmetric_packing=True") as err:
        packed.load_state_dict(saved)
    assert "\n" not in str(err.value)
    assert not packed.state
