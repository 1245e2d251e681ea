"""DistributedAdafactor and DistributedCAME against their independent references, conversion from
the classes users have, collectives per step, and bad input.

The parity grid over layouts (TP, ZeRO, padding, 3-D, vocab padding) runs from tests/helpers/cases.py.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim import DistributedAdafactor, DistributedCAME, ParamLayout, TPSplit, ZeroShard, comm

STEPS = 20
NONE_STEP = 7  # the first layer's bias gets no gradient at this step
RTOL = 1e-5


# ---- a small model: an MLP and a 3-D param ------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        self.kernel = torch.nn.Parameter(torch.randn(2, 3, 4) * 0.5)  # 3-D: leading dim kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        return out.square().mean() + torch.einsum("bi,kij->bkj", out, self.kernel).tanh().sum()


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def train(net: Net, opt: torch.optim.Optimizer, steps: int = STEPS, start: int = 0) -> None:
    gen = torch.Generator().manual_seed(123)
    batches = [torch.randn(5, 6, generator=gen) * (1 + i % 3) for i in range(start + steps)]
    for i in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        net(batches[i]).backward()
        if i == NONE_STEP:
            net.mlp[0].bias.grad = None
        opt.step()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def assert_same_training(
    make_ours: Callable[[Net], torch.optim.Optimizer], make_ref: Callable[[Net], torch.optim.Optimizer]
) -> tuple[Net, Net, torch.optim.Optimizer, torch.optim.Optimizer]:
    ours_net, ref_net = make_net(), make_net()
    init = [p.detach().clone() for p in ref_net.parameters()]
    ours, ref = make_ours(ours_net), make_ref(ref_net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(ours_net, ours)
        train(ref_net, ref)
    for (name, p), q, p0 in zip(ours_net.named_parameters(), ref_net.parameters(), init):
        # Compare the change as well as the value: small steps hide in a parameter's magnitude.
        assert rel_err(p - p0, q - p0) <= RTOL, f"{name}: update differs by {rel_err(p - p0, q - p0):.3g}"
        assert rel_err(p, q) <= RTOL, name
    return ours_net, ref_net, ours, ref


def assert_state(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, keys: dict[str, str]) -> None:
    """``keys``: our state key -> reference key; the reference's factored vectors lack the kept dim."""
    ours_params = [p for g in ours.param_groups for p in g["params"]]
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    for p, q in zip(ours_params, ref_params):
        mine, theirs = ours.state[p], ref.state[q]
        assert float(mine["step"]) == float(theirs["step"])
        for ours_key, ref_key in keys.items():
            if ref_key not in theirs:
                continue
            assert ours_key in mine, (ours_key, sorted(mine))
            expected = theirs[ref_key]
            actual = mine[ours_key].reshape(expected.shape)
            assert rel_err(actual, expected) <= RTOL, f"state {ours_key}: {rel_err(actual, expected):.3g}"


HF_KEYS = {"exp_avg": "exp_avg", "row_var": "exp_avg_sq_row", "col_var": "exp_avg_sq_col", "variance": "exp_avg_sq"}
TORCH_KEYS = {"row_var": "row_var", "col_var": "col_var", "variance": "variance"}
CAME_KEYS = {
    **HF_KEYS,
    "res_row_var": "exp_avg_res_row",
    "res_col_var": "exp_avg_res_col",
}

HF_OPTIONS = [
    pytest.param(dict(), id="relative-scale"),
    pytest.param(dict(warmup_init=True), id="warmup"),
    pytest.param(dict(scale_parameter=False), id="relative-noscale"),
    pytest.param(dict(relative_step=False, lr=1e-2), id="lr-scale"),
    pytest.param(dict(relative_step=False, scale_parameter=False, lr=3e-2, clip_threshold=0.5), id="lr-clip"),
    pytest.param(dict(beta1=0.9, weight_decay=0.1), id="beta1-wd"),
    pytest.param(
        dict(relative_step=False, lr=2e-2, beta1=0.5, weight_decay=1e-2, decay_rate=-0.5, eps=(1e-20, 1e-2)),
        id="lr-beta1-wd-decay-eps",
    ),
]


# ---- unbound vs independent references ----------------------------------------------------------
@pytest.mark.parametrize("options", HF_OPTIONS)
def test_adafactor_matches_transformers(options: dict[str, Any]) -> None:
    from transformers.optimization import Adafactor

    _, _, ours, ref = assert_same_training(
        lambda n: DistributedAdafactor(n.parameters(), **options), lambda n: Adafactor(n.parameters(), **options)
    )
    assert_state(ours, ref, HF_KEYS)


TORCH_OPTIONS = [
    pytest.param(dict(), id="defaults"),
    pytest.param(dict(lr=5e-2, weight_decay=0.1), id="lr-wd"),
    pytest.param(dict(eps=(1e-8, 1e-2), beta2_decay=-0.5, d=2.0, maximize=True), id="eps-decay-d-maximize"),
]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("options", TORCH_OPTIONS)
def test_adafactor_matches_torch(options: dict[str, Any], foreach: bool) -> None:
    mine = dict(options)
    if "beta2_decay" in mine:
        mine["decay_rate"] = mine.pop("beta2_decay")
    if "d" in mine:
        mine["clip_threshold"] = mine.pop("d")
    _, _, ours, ref = assert_same_training(
        lambda n: DistributedAdafactor(n.parameters(), variant="torch", **mine),
        lambda n: torch.optim.Adafactor(n.parameters(), foreach=foreach, **options),
    )
    assert_state(ours, ref, TORCH_KEYS)


CAME_OPTIONS = [
    pytest.param(dict(lr=1e-3), id="defaults"),
    pytest.param(dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99, 0.999), clip_threshold=0.7), id="wd-betas-clip"),
    pytest.param(dict(lr=3e-3, eps=(1e-20, 1e-10)), id="eps"),
]


@pytest.mark.parametrize("options", CAME_OPTIONS)
def test_came_matches_came_pytorch(options: dict[str, Any]) -> None:
    from came_pytorch import CAME

    _, _, ours, ref = assert_same_training(
        lambda n: DistributedCAME(n.parameters(), **options), lambda n: CAME(n.parameters(), **options)
    )
    assert_state(ours, ref, CAME_KEYS)


def test_param_groups_keep_their_options() -> None:
    from transformers.optimization import Adafactor

    def groups(n: Net) -> list[dict[str, Any]]:
        return [
            {"params": list(n.mlp.parameters()), "lr": 1e-2, "beta1": 0.9},
            {"params": [n.kernel], "lr": 3e-2, "weight_decay": 0.1},
        ]

    assert_same_training(
        lambda n: DistributedAdafactor(groups(n), lr=1e-3, relative_step=False, scale_parameter=False),
        lambda n: Adafactor(groups(n), lr=1e-3, relative_step=False, scale_parameter=False),
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ps: DistributedAdafactor(ps, beta1=0.9), id="adafactor"),
        pytest.param(lambda ps: DistributedAdafactor(ps, variant="torch"), id="adafactor-torch"),
        pytest.param(lambda ps: DistributedCAME(ps, lr=1e-3), id="came"),
    ],
)
def test_state_dict_round_trip(make: Callable[[Any], torch.optim.Optimizer]) -> None:
    """Saved after some steps and loaded into a fresh optimizer, training continues identically."""
    net, other = make_net(), make_net()
    opt = make(net.parameters())
    train(net, opt, steps=4)
    with torch.no_grad():
        for p, q in zip(other.parameters(), net.parameters()):
            p.copy_(q)
    resumed = make(other.parameters())
    # A deep copy, as a checkpoint file would be: load_state_dict keeps the tensors it is given.
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(net, opt, steps=4, start=4)
    train(other, resumed, steps=4, start=4)
    for p, q in zip(other.parameters(), net.parameters()):
        assert torch.equal(p, q)


# ---- conversion from the classes users have -----------------------------------------------------
def _converted(make_ref: Callable[[Net], torch.optim.Optimizer], cls: type) -> Callable[[Net], torch.optim.Optimizer]:
    def make(n: Net) -> torch.optim.Optimizer:
        new = dist_optim.convert(make_ref(n))
        assert type(new) is cls
        return new

    return make


@pytest.mark.parametrize("options", HF_OPTIONS)
def test_convert_transformers_adafactor(options: dict[str, Any]) -> None:
    from transformers.optimization import Adafactor

    def make_ref(n: Net) -> torch.optim.Optimizer:
        return Adafactor(n.parameters(), **options)

    assert_same_training(_converted(make_ref, DistributedAdafactor), make_ref)


@pytest.mark.parametrize("options", TORCH_OPTIONS)
def test_convert_torch_adafactor(options: dict[str, Any]) -> None:
    def make_ref(n: Net) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(n.parameters(), foreach=True, **options)

    _, _, ours, ref = assert_same_training(_converted(make_ref, DistributedAdafactor), make_ref)
    assert_state(ours, ref, TORCH_KEYS)


@pytest.mark.parametrize("options", CAME_OPTIONS)
def test_convert_came_pytorch(options: dict[str, Any]) -> None:
    from came_pytorch import CAME

    def make_ref(n: Net) -> torch.optim.Optimizer:
        return CAME(n.parameters(), **options)

    assert_same_training(_converted(make_ref, DistributedCAME), make_ref)


@pytest.mark.parametrize(
    "make_ref",
    [
        pytest.param(
            lambda ps: __import__("transformers.optimization", fromlist=["Adafactor"]).Adafactor(ps, beta1=0.9),
            id="transformers",
        ),
        pytest.param(lambda ps: torch.optim.Adafactor(ps, lr=3e-2), id="torch"),
        pytest.param(lambda ps: __import__("came_pytorch").CAME(ps, lr=1e-2), id="came_pytorch"),
    ],
)
def test_convert_after_steps_carries_state(make_ref: Callable[[Any], torch.optim.Optimizer]) -> None:
    """An optimizer that already stepped converts with its state and continues identically."""
    ref_net, ours_net = make_net(), make_net()
    ref, before = make_ref(ref_net.parameters()), make_ref(ours_net.parameters())
    train(ref_net, ref, steps=5)
    train(ours_net, before, steps=5)
    ours = dist_optim.convert(before)
    train(ref_net, ref, steps=5, start=5)
    train(ours_net, ours, steps=5, start=5)
    for p, q in zip(ours_net.parameters(), ref_net.parameters()):
        assert rel_err(p, q) <= RTOL


def test_convert_colossalai_came_and_adafactor() -> None:
    optim = pytest.importorskip("colossalai.nn.optimizer")
    from transformers.optimization import Adafactor

    # CAME: ColossalAI's copy of the authors' algorithm, same math.
    def make_came(n: Net) -> torch.optim.Optimizer:
        return optim.CAME(n.parameters(), lr=1e-2, weight_decay=1e-2)

    assert_same_training(_converted(make_came, DistributedCAME), make_came)
    assert type(dist_optim.convert(optim.DistributedCAME(make_net().parameters(), lr=1e-2))) is DistributedCAME

    # Adafactor: converted to the algorithm it documents (transformers'), with a warning that
    # ColossalAI 0.5.0 itself never updates the RMS behind scale_parameter.
    with pytest.warns(UserWarning, match="RMS"):
        dist_optim.convert(optim.Adafactor(make_net().parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same_training(
            _converted(lambda n: optim.Adafactor(n.parameters(), beta1=0.9), DistributedAdafactor),
            lambda n: Adafactor(n.parameters(), beta1=0.9),
        )
        assert type(dist_optim.convert(optim.DistributedAdaFactor(make_net().parameters()))) is DistributedAdafactor
    # ColossalAI's Adafactor drops the lr it is given: with relative_step=False nothing is left to convert.
    with pytest.raises(ValueError, match="relative_step=False"):
        dist_optim.convert(optim.Adafactor(make_net().parameters(), lr=1e-2, relative_step=False))


def test_convert_refuses_what_it_cannot_honour() -> None:
    net = make_net()
    # torch accepts eps2=0; we require eps > 0 and say which option.
    with pytest.raises(ValueError, match=r"eps\[1\]"):
        dist_optim.convert(torch.optim.Adafactor(net.parameters(), eps=(None, 0.0)))
    # Groups are validated after translation, also when edited after construction.
    opt = torch.optim.Adafactor(net.parameters())
    opt.param_groups[0]["d"] = 0.0
    with pytest.raises(ValueError, match="clip_threshold"):
        dist_optim.convert(opt)


# ---- collectives per step -----------------------------------------------------------------------
def _count_worker(cls: type, kwargs: dict[str, Any], n_params: int) -> dict[str, int]:
    """Bind ``n_params`` mixed params at tp=2 x zero=2 and count the collectives of one step."""
    from dist_optim.testing import grid_groups

    tp_group, dp_group = grid_groups(2, 2)
    tp_rank, dp_rank = comm.group_rank(tp_group), comm.group_rank(dp_group)
    shapes = [((8, 6), 0), ((6, 8), 1), ((5, 3), None), ((7,), None), ((3, 4, 2), 1)]
    params, layouts = [], {}
    for i in range(n_params):
        shape, dim = shapes[i % len(shapes)]
        tp = TPSplit(dim, 2, tp_rank, tp_group) if dim is not None else None
        probe = ParamLayout(shape, tp)
        zero = ZeroShard(2, dp_rank, (-probe.local_numel) % 2, dp_group)
        layout = ParamLayout(shape, tp, zero)
        p = torch.zeros(layout.chunk_numel)
        p.grad = torch.ones_like(p)
        params.append(p)
        layouts[p] = layout
    opt = cls(params, **kwargs)
    opt.bind(layouts, dp_group=dp_group)
    opt.step()  # first step allocates state
    comm.reset_counts()
    opt.step()
    return dict(comm.COUNTS)


@pytest.mark.parametrize(
    "cls, kwargs, flushes",
    [
        (DistributedAdafactor, dict(beta1=0.9), 2),
        (DistributedAdafactor, dict(variant="torch"), 2),
        (DistributedCAME, dict(lr=1e-2), 3),
    ],
    ids=["adafactor", "adafactor-torch", "came"],
)
def test_collectives_per_step_do_not_grow_with_params(pool4, cls: type, kwargs: dict[str, Any], flushes: int) -> None:
    small = pool4.run(_count_worker, cls, kwargs, 5)
    large = pool4.run(_count_worker, cls, kwargs, 40)
    assert small == large, (small, large)
    for counts in small:
        # Each flush: one all-reduce over the ZeRO group, one over the TP group; one more for the
        # NaN/Inf check's flag over the job. No gathers.
        assert counts == {"all_reduce": 2 * flushes + 1}, counts


# ---- statistics partitioned over the ranks that share a parameter ---------------------------------
def _partition_worker(cls: type, kwargs: dict[str, Any]) -> tuple[list[tuple[str, int, int, int, bool]], torch.Tensor]:
    """tp=2 x zero=2: every factored statistic a rank keeps is its 1/n partition of the full one
    (what full_state() returns; n = 4 for a TP-split parameter, 2 for a TP-replicated one, which
    its TP replicas keep alike), and load_full_state() of that full state cuts the same partition."""
    from dist_optim.factored.statistics import STAT_KEYS
    from dist_optim.testing import tp_zero_chunks

    tp_group, dp_group = grid_groups_22()
    tp_rank, dp_rank = comm.group_rank(tp_group), comm.group_rank(dp_group)
    gen = torch.Generator().manual_seed(1)
    shapes = [((8, 6), 0), ((6, 8), 1), ((5, 3), None), ((3, 4, 2), 1), ((7,), None)]
    fulls = [torch.randn(shape, generator=gen) for shape, _ in shapes]
    params, layouts = tp_zero_chunks(fulls, [dim for _, dim in shapes], tp_group, dp_group)
    opt = cls(params, **kwargs)
    opt.bind(layouts, dp_group=dp_group)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    full_states = opt.full_state()
    kept = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    opt.load_full_state(full_states)
    out = []
    # The TP-replicated vector (7,): its ZeRO chunk (4 elements, padding included) is split over the
    # 2 TP replicas, each keeping 2 elements of the variance.
    vector, layout = params[-1], layouts[params[-1]]
    chunk = layout.take_local(full_states[-1]["variance"]).reshape(-1)
    chunk = torch.nn.functional.pad(chunk, (0, layout.chunk_numel - chunk.numel()))
    expected = chunk[2 * tp_rank : 2 * tp_rank + 2]
    # ZeRO padding (the last element of the second chunk) is not in the full form: compare the rest.
    real = max(0, min(2, layout.valid_numel - 2 * tp_rank))
    same = torch.equal(kept[-1]["variance"][:real], expected[:real])
    same = same and torch.equal(opt.state[vector]["variance"], expected)
    out.append(("variance", kept[-1]["variance"].numel(), 2, 7, same))
    for (_, dim), p, before, full in zip(shapes, params, kept, full_states):
        # The partition index: ZeRO rank, then TP rank (TP-split parameters only).
        n, me = (4, dp_rank * 2 + tp_rank) if dim is not None else (2, dp_rank)
        for key in STAT_KEYS:
            if key not in full:
                continue
            flat = full[key].reshape(-1)
            size = -(-flat.numel() // n)
            expected = flat[me * size : (me + 1) * size]
            same = torch.equal(before[key], expected) and torch.equal(opt.state[p][key], expected)
            out.append((key, before[key].numel(), expected.numel(), flat.numel(), same))
    return out, full_states[-1]["variance"]


def grid_groups_22() -> tuple[Any, Any]:
    from dist_optim.testing import grid_groups

    return grid_groups(2, 2)


@pytest.mark.parametrize(
    "cls, kwargs",
    [(DistributedAdafactor, dict(beta1=0.9)), (DistributedCAME, dict(lr=1e-2))],
    ids=["adafactor", "came"],
)
def test_statistics_are_partitioned(pool4, cls: type, kwargs: dict[str, Any]) -> None:
    returned = pool4.run(_partition_worker, cls, kwargs)
    results = [r for r, _ in returned]
    # The vector's full-form variance, assembled from the TP replicas' parts, is the same everywhere.
    assert all(torch.equal(v, returned[0][1]) for _, v in returned), [v for _, v in returned]
    keys = 8 if cls is DistributedAdafactor else 16  # 4 factored params, 2 or 4 statistics each
    for rank in results:
        assert len(rank) == keys + 1, rank
        _, vector_kept, vector_expected, _, vector_same = rank.pop(0)  # the vector's variance
        assert vector_kept == vector_expected and vector_same, rank
        for key, kept, expected, full, same in rank:
            assert kept == expected and same, (key, kept, expected, full)
    # Together the ranks keep each statistic once (its TP replicas twice), not once per rank.
    for i in range(keys):
        replicas = 2 if results[0][i][3] in (5, 3) else 1  # the (5, 3) parameter: rows 5, columns 3
        assert sum(rank[i][1] for rank in results) == replicas * results[0][i][3], [rank[i] for rank in results]


# ---- bad input ----------------------------------------------------------------------------------
def test_bad_input() -> None:
    w = torch.nn.Parameter(torch.randn(3, 4))
    with pytest.raises(TypeError, match="floating"):
        DistributedAdafactor([torch.zeros(3, dtype=torch.long)])
    with pytest.raises(TypeError, match="floating"):
        DistributedCAME([torch.zeros(3, dtype=torch.int32)], lr=1e-3)
    for beta1 in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="beta1"):
            DistributedAdafactor([w], beta1=beta1)
        with pytest.raises(ValueError, match=r"betas\[0\]"):
            DistributedCAME([w], lr=1e-3, betas=(beta1, 0.999, 0.9999))
    for eps in ((0.0, 1e-3), (-1e-30, 1e-3), (1e-30, 0.0)):
        with pytest.raises(ValueError, match="eps"):
            DistributedAdafactor([w], eps=eps)
        with pytest.raises(ValueError, match="eps"):
            DistributedCAME([w], lr=1e-3, eps=eps)
    with pytest.raises(ValueError, match="relative_step"):
        DistributedAdafactor([w], lr=1e-3)  # transformers semantics: lr with relative_step=True
    with pytest.raises(ValueError, match="relative_step"):
        DistributedAdafactor([w], relative_step=False)  # ... and no lr without it
    with pytest.raises(ValueError, match="warmup_init"):
        DistributedAdafactor([w], lr=1e-3, relative_step=False, warmup_init=True)
    with pytest.raises(ValueError, match="beta1"):
        DistributedAdafactor([w], variant="torch", beta1=0.9)
    with pytest.raises(ValueError, match="variant"):
        DistributedAdafactor([w], variant="fairseq")
    with pytest.raises(ValueError, match="decay_rate"):
        DistributedAdafactor([w], decay_rate=0.5)
    with pytest.raises(ValueError, match="lr"):
        DistributedCAME([w])
    with pytest.raises(ValueError, match="clip_threshold"):
        DistributedCAME([w], lr=1e-3, clip_threshold=0.0)
    # A bad group added later is refused and not kept.
    opt = DistributedAdafactor([w])
    with pytest.raises(ValueError, match="beta1"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "beta1": 2.0})
    assert len(opt.param_groups) == 1
    # A group lr under relative_step is ignored, as in transformers: say so.
    with pytest.warns(UserWarning, match="ignored"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "lr": 1e-3})
    # Sparse gradients (the base class raises for every dist_optim optimizer).
    for opt in (DistributedAdafactor([w]), DistributedCAME([w], lr=1e-3)):
        w.grad = torch.randn(3, 4).to_sparse()
        with pytest.raises(TypeError, match="sparse"):
            opt.step()
        w.grad = None


# ---- index math of the factored statistics, all ranks simulated in one process ------------------
@pytest.mark.parametrize(
    "shape, tp_dim",
    [((6, 4), 0), ((6, 4), 1), ((5, 3), None), ((4, 6, 3), 0), ((3, 4, 3), 1), ((3, 2, 4), 2), ((2, 2, 3, 4), 1)],
)
@pytest.mark.parametrize("tp, zero", [(1, 1), (2, 1), (1, 4), (2, 3), (2, 5)])
def test_factored_layout_sums_and_expansion(shape: tuple[int, ...], tp_dim: int | None, tp: int, zero: int) -> None:
    """Partial row/column sums over every (TP rank, ZeRO rank) add up to the full tensor's, and
    expansion puts row i's and column j's values on every element, padding left at zero."""
    from dist_optim.factored.layout import FactoredLayout

    gen = torch.Generator().manual_seed(0)
    full = torch.rand(shape, generator=gen, dtype=torch.float64) + 0.1
    row = torch.rand(shape[:-1] + (1,), generator=gen, dtype=torch.float64)
    col = torch.rand(shape[:-2] + (1, shape[-1]), generator=gen, dtype=torch.float64)
    rows = torch.zeros_like(row)
    cols = torch.zeros_like(col)
    tp = tp if tp_dim is not None else 1
    for tr in range(tp):
        split = TPSplit(tp_dim, tp, tr) if tp_dim is not None else None
        local_numel = ParamLayout(shape, split).local_numel
        for zr in range(zero):
            layout = ParamLayout(shape, split, ZeroShard(zero, zr, (-local_numel) % zero) if zero > 1 else None)
            fac = FactoredLayout(layout)
            local = layout.take_local(full)
            r, c = fac.partial_sums(fac.to_work(local))
            rows += r
            cols += c
            er, ec = fac.expand(row, col)
            product = fac.from_work(er * ec * fac.to_work(local))
            expected = layout.take_local(row * col * full)
            assert torch.allclose(product, expected), (tr, zr)
            assert tuple(product.shape) == tuple(local.shape)
    assert torch.allclose(rows, full.sum(-1, keepdim=True))
    assert torch.allclose(cols, full.sum(-2, keepdim=True))


# Through a real ColossalAI booster: tests/distributed/test_booster.py (every optimizer x every layout column).
