"""DistributedShampoo's owner work in batches (dist_optim.shampoo.work, .preconditioner): a block's
result does not depend on the batch it is computed in, the batches are real (one fused Adam call
and one foreach call per batch, counted at torch), and the list forms equal their one-element ones
bit for bit (gram_updates_, apply_updates, Scratch.split)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import dist_optim
from dist_optim.kernels import structured
from dist_optim.shampoo.preconditioner import warm
from dist_optim.shampoo.state import ALIGN_BYTES, Scratch
from dist_optim.shampoo.update import apply_updates

# Blocks of at most 16: (30, 40) splits along its columns (strided block gradients), (5, 3, 4) is a
# 3-D block, (7,) a vector whose 7 elements put the next block of a packed buffer off a 64-byte
# boundary, (64, 10) four contiguous blocks, (300,) a vector of 19 blocks.
SHAPES = [(20, 12), (7,), (30, 40), (5, 3, 4), (64, 10), (16, 16), (300,)]
NONE_STEP, NONE_PARAM = 3, 1  # the vector gets no gradient at this step
STEPS = 6
ADAM = dist_optim.AdamGraftingConfig(beta2=0.999, epsilon=1e-8)

CONFIGS: dict[str, dict[str, Any]] = {
    "adam": dict(grafting_config=ADAM),
    "adam-momentum-nesterov-wd": dict(grafting_config=ADAM, momentum=0.9, use_nesterov=True, weight_decay=0.1),
    "adam-coupled-wd-stats2": dict(
        grafting_config=ADAM, weight_decay=0.1, use_decoupled_weight_decay=False, statistics_compute_steps=2
    ),
    "adagrad": dict(grafting_config=dist_optim.AdaGradGraftingConfig(epsilon=1e-8)),
    "no-grafting": dict(),
    "packed": dict(grafting_config=ADAM, use_symmetric_packing=True),
    "8bit-moments": dict(grafting_config=ADAM, optim_bits=8, min_8bit_size=16, momentum=0.9),
    "8bit-eigenvectors": dict(grafting_config=ADAM, preconditioner_bits=8),
    "soap-grafted": dict(grafting_config=ADAM, eigenvalue_correction=True),
    "soap": dict(eigenvalue_correction=True),
    # warm refreshes at steps 4 and 6 (2 is the first): some factors kept, some refined, some recomputed
    "warm": dict(grafting_config=ADAM, root_inverse="warm", refresh_tolerance=0.05, refresh_iterations=2),
    "warm-packed": dict(
        grafting_config=ADAM,
        root_inverse="warm",
        refresh_tolerance=0.05,
        refresh_iterations=2,
        use_symmetric_packing=True,
    ),
    "warm-8bit-eigenvectors": dict(
        grafting_config=ADAM, root_inverse="warm", refresh_tolerance=0.05, refresh_iterations=2, preconditioner_bits=8
    ),
    "soap-warm": dict(eigenvalue_correction=True, eigenbasis="warm", refresh_tolerance=0.05, refresh_iterations=2),
}


def _run(config: dict[str, Any], bucket_bytes: int | None) -> tuple[list[torch.Tensor], dict[str, Any]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    kw: dict[str, Any] = dict(
        lr=1e-2, max_preconditioner_dim=16, precondition_frequency=2, start_preconditioning_step=2
    )
    opt = dist_optim.DistributedShampoo(params, **{**kw, **config}, bucket_bytes=bucket_bytes)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = None if (step, i) == (NONE_STEP, NONE_PARAM) else torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


def _flat(state: Any) -> list[tuple[str, Any]]:
    if isinstance(state, dict):
        return [(f"{k}.{n}", v) for k in state for n, v in _flat(state[k])]
    if isinstance(state, (list, tuple)):
        return [(f"{i}.{n}", v) for i, s in enumerate(state) for n, v in _flat(s)]
    return [("", state)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_blocks_result_does_not_depend_on_its_batch(name: str) -> None:
    """One block per batch (bucket_bytes=1), every block of the step in one batch (None) and
    batches cut in between (700 bytes): the same parameters and state, bit for bit."""
    params, state = _run(CONFIGS[name], 1)
    for budget in (None, 700):
        other_params, other_state = _run(CONFIGS[name], budget)
        for i, (a, b) in enumerate(zip(params, other_params)):
            assert torch.equal(a, b), f"{name}: parameter {i} {tuple(a.shape)}, bucket_bytes={budget}"
        mine, theirs = _flat(state["state"]), _flat(other_state["state"])
        assert [k for k, _ in mine] == [k for k, _ in theirs]
        for (key, a), (_, b) in zip(mine, theirs):
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            assert same, f"{name}: state {key}, bucket_bytes={budget}"


def test_a_step_is_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preconditioned step of the parameters above makes one fused Adam call and one call of each
    grafting norm for all 34 blocks (counted at torch), and one per block with one
    block per batch."""
    calls: dict[str, list[int]] = {"_fused_adam_": [], "_foreach_norm": []}
    for name in calls:
        real = getattr(torch, name)

        def counting(tensors: list[torch.Tensor], *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls[_name].append(len(tensors))
            return _real(tensors, *a, **k)

        monkeypatch.setattr(torch, name, counting)
    blocks = 2 + 1 + 2 * 3 + 1 + 4 + 1 + 19
    for budget, batches in ((None, 1), (1, blocks)):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = dist_optim.DistributedShampoo(
            params, max_preconditioner_dim=16, grafting_config=ADAM, momentum=0.9, bucket_bytes=budget
        )
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()  # preconditioned from the first step (start = frequency = 1)
        for name in calls:
            calls[name].clear()
        opt.step()
        assert calls["_fused_adam_"] == [blocks // batches] * batches, budget
        # the gradients' finiteness check over the parameters, then ||D|| and ||P|| per batch
        assert calls["_foreach_norm"] == [len(SHAPES)] + [blocks // batches] * 2 * batches, budget


class _Calls(TorchFunctionMode):
    """Counts the calls of ``funcs``, at torch."""

    def __init__(self, funcs: set[Any]) -> None:
        super().__init__()
        self.funcs = funcs
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in self.funcs
        return func(*args, **(kwargs or {}))


#: The reads of tensor values by the host: each is a synchronisation on a GPU.
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
}


def _before_refresh(config: dict[str, Any], bucket_bytes: int | None) -> torch.optim.Optimizer:
    """The optimizer ready for its second refresh (step 4, its gradients set; the first, step 2,
    has no previous eigenvectors)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = dist_optim.DistributedShampoo(
        params,
        max_preconditioner_dim=16,
        precondition_frequency=2,
        start_preconditioning_step=2,
        bucket_bytes=bucket_bytes,
        **config,
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if step < 4:
            opt.step()
    return opt


def _refresh_step_reads(config: dict[str, Any], bucket_bytes: int | None) -> int:
    """Host reads of the second refresh."""
    opt = _before_refresh(config, bucket_bytes)
    with _Calls(HOST_READS) as reads:
        opt.step()
    return reads.count


# Blocks that read their own criteria: none where factors and bases are whole in state, every
# block where factors are packed, the 14 blocks of 2 or more dims where eigenvectors are quantised
# (vectors' are not: state.quantises_bases).
@pytest.mark.parametrize(
    "name, own", [("warm", 0), ("soap-warm", 0), ("warm-packed", 34), ("warm-8bit-eigenvectors", 14)]
)
def test_a_warm_refresh_reads_its_criteria_once_per_batch(name: str, own: int) -> None:
    """A warm refresh's host reads beyond those of the same step refreshed by ``eigh`` (its
    criteria; no QR steps here): one for a batch's blocks whose factors and bases are whole in
    state, one per block for the others (unpacked / decoded one block at a time); not one per
    factor (49 factors in the 34 blocks)."""
    config = {**CONFIGS[name], "refresh_iterations": 0}
    mode = "eigenbasis" if config.get("eigenvalue_correction") else "root_inverse"
    blocks = 2 + 1 + 2 * 3 + 1 + 4 + 1 + 19
    for budget in (None, 1):  # one batch; one block per batch
        extra = _refresh_step_reads(config, budget) - _refresh_step_reads({**config, mode: "eigh"}, budget)
        assert extra == (own + (own < blocks) if budget is None else blocks), (name, budget, extra)


@pytest.mark.parametrize("name", ["warm", "soap-warm", "warm-packed", "warm-8bit-eigenvectors"])
def test_a_warm_refresh_builds_only_a_recomputed_factors_matrix(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm refresh builds the matrix it decomposes (:func:`warm.target`) only for a factor that
    is recomputed (no QR steps here: by ``eigh``, counted at torch), once; the criterion multiplies
    the factor itself: at tolerance 1 (every factor kept), 0.3 (some kept) and 0 (none)."""
    factors = 2 * 2 + 1 + 6 * 2 + 3 + 4 * 2 + 2 + 19  # a 2-D block has two factors, a 3-D one three
    built = []
    real = warm.target
    monkeypatch.setattr(warm, "target", lambda *a: built.append(1) or real(*a))
    eighs = {}
    for tolerance in (1.0, 0.3, 0.0):
        opt = _before_refresh({**CONFIGS[name], "refresh_iterations": 0, "refresh_tolerance": tolerance}, None)
        built.clear()
        with _Calls({torch.linalg.eigh}) as counted:
            opt.step()
        assert len(built) == counted.count, (name, tolerance, len(built), counted.count)
        eighs[tolerance] = counted.count
    assert eighs[1.0] == 0 and 0 < eighs[0.3] < factors and eighs[0.0] == factors, (name, eighs)


def test_gram_updates_round_as_each_factors_own_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """gram_updates_ over factors updated whole (at most min_size 8) and in column panels (larger;
    panels of 4), in chunks of at most two products (PRODUCT_BYTES lowered): a whole factor holds
    exactly ``c * beta + (rows @ rows.T) * alpha``, a panelled one's lower triangle exactly the
    panels' ``addmm_`` (both written out here), whatever its chunk."""
    gen = torch.Generator().manual_seed(0)
    sizes = [3, 12, 5, 8, 17, 2, 6]
    cs = [torch.randn(n, n, generator=gen) for n in sizes]
    rows = [torch.randn(n, 6, generator=gen) for n in sizes]
    want = []
    for c, r in zip(cs, rows):
        n = c.shape[0]
        if n <= 8:
            want.append(c * 0.9 + (r @ r.T) * 0.1)
            continue
        w = c.clone()
        for i in range(0, n, 4):
            w[i:, i : i + 4].addmm_(r[i:], r[i : i + 4].T, beta=0.9, alpha=0.1)
        want.append(w)
    monkeypatch.setattr(structured, "PRODUCT_BYTES", 2 * 8 * 8 * 4)
    structured.gram_updates_(cs, rows, 0.9, 0.1, min_size=8, panel=4)
    for n, a, b in zip(sizes, cs, want):
        assert torch.equal(a.tril(), b.tril()), n
        if n <= 8:
            assert torch.equal(a, b), n


@pytest.mark.parametrize(
    "case", ["plain", "decoupled-wd", "coupled-wd", "momentum", "nesterov", "momentum-one-buffer-missing"]
)
def test_apply_updates_follow_the_formula(case: str) -> None:
    """apply_updates over pieces of three shapes against the update written out here, piece by
    piece: ``P = D + wd W`` (decoupled), ``B <- mom B + P`` and ``P = P + mom B`` (Nesterov) or
    ``P = B`` where a piece has a buffer, ``W <- W - lr P``; the same bits."""
    group: dict[str, Any] = dict(
        lr=0.1, weight_decay=0.0, use_decoupled_weight_decay=True, momentum=0.0, use_nesterov=False
    )
    group.update(
        {
            "plain": {},
            "decoupled-wd": dict(weight_decay=0.01),
            "coupled-wd": dict(weight_decay=0.01, use_decoupled_weight_decay=False),
            "momentum": dict(momentum=0.9, weight_decay=0.01),
            "nesterov": dict(momentum=0.9, use_nesterov=True),
            "momentum-one-buffer-missing": dict(momentum=0.9, use_nesterov=True, weight_decay=0.01),
        }[case]
    )
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 5), (7,), (3, 3)]
    ps = [torch.randn(s, generator=gen) for s in shapes]
    ds = [torch.randn(s, generator=gen) for s in shapes]
    bufs: list[torch.Tensor | None] = [torch.randn(s, generator=gen) for s in shapes]
    if case == "momentum-one-buffer-missing":
        bufs[1] = None
    want_p = [p.clone() for p in ps]
    want_b = [None if b is None else b.clone() for b in bufs]
    wd, mom, lr = group["weight_decay"], group["momentum"], group["lr"]
    for i, d in enumerate(ds):  # each ``x + a y`` as torch's scaled add, which rounds it once
        u = d.add(want_p[i], alpha=wd) if group["use_decoupled_weight_decay"] else d.clone()
        b = want_b[i]
        if mom > 0 and b is not None:
            b.mul_(mom).add_(u)
            u = u.add(b, alpha=mom) if group["use_nesterov"] else b
        want_p[i].add_(u, alpha=-lr)
    apply_updates(ps, ds, list(bufs), group)
    for i in range(len(shapes)):
        assert torch.equal(ps[i], want_p[i]), (case, i)
        b, wb = bufs[i], want_b[i]
        assert (b is None and wb is None) or (b is not None and wb is not None and torch.equal(b, wb)), (case, i)


def test_scratch_split_aligns_and_reuses() -> None:
    """Each tensor of a split starts on a 64-byte boundary of one buffer; the same shapes get the
    same views; a larger request regrows the buffer and the views follow it."""
    scratch = Scratch()
    shapes = [(7,), (3, 5), (1,), (16, 16)]
    views = scratch.split(shapes, torch.float32, torch.device("cpu"), "outs")
    assert [tuple(v.shape) for v in views] == shapes and all(v.is_contiguous() for v in views)
    base = views[0].data_ptr()
    assert all((v.data_ptr() - base) % ALIGN_BYTES == 0 for v in views)
    ends = [(v.data_ptr() - base) // 4 + v.numel() for v in views]
    starts = [(v.data_ptr() - base) // 4 for v in views]
    assert all(e <= s for e, s in zip(ends, starts[1:])), "views overlap"
    assert scratch.split(shapes, torch.float32, torch.device("cpu"), "outs") is views
    bigger = scratch.split([(64, 64)], torch.float32, torch.device("cpu"), "outs")[0]
    again = scratch.split(shapes, torch.float32, torch.device("cpu"), "outs")
    assert again is not views and again[0].data_ptr() == bigger.data_ptr()
