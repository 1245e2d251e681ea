"""DistributedKron against kron_torch.Kron, its options and schedule, and its work split.

How the unbound optimizer is matched with ``kron_torch.kron.Kron`` (0.3.3): both decide
preconditioner updates with the same deterministic counter (no randomness), and both draw the
balancing decision from ``random.Random(42)`` (ours: ``random.Random(seed)``, seed 42). They
differ in where the probe vectors ``V`` come from: kron_torch calls ``torch.randn_like`` on the
*global* generator, we draw from our own ``torch.Generator(seed)``, in the same order (every
parameter with a gradient, ``param_groups`` order, on every update step). So the tests call
``torch.manual_seed(42)`` right before the kron_torch run (and build data and gradients from
private generators, so nothing else touches the global one), and give ours ``seed=42``: both then
see the same numbers, and the 20-step runs agree to fp32 rounding, at any update probability
(balancing happens at step 20 with this seed, so it is covered too). kron_torch's
``torch.compile`` is switched off (``torch._dynamo.config.disable``): compiling on two shared CPU
cores costs minutes and changes only rounding.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

import dist_optim
from dist_optim import DistributedKron, comm
from dist_optim.kron import ProbabilitySchedule, precond_update_prob_schedule
from dist_optim.layout import ParamLayout
from tests.helpers.collectives import counting_collectives

kron_torch = pytest.importorskip("kron_torch")

STEPS = 20
RTOL = 1e-5
NONE_STEP = 4  # the second Linear's bias gets no gradient at this step


@pytest.fixture(autouse=True)
def _no_compile():
    with torch._dynamo.config.patch(disable=True):
        yield


# ---- a small MLP plus a 3-D parameter, trained on fixed data --------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 4)
        self.conv = torch.nn.Parameter(torch.randn(3, 4, 5, generator=gen) * 0.3)
        with torch.no_grad():
            for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)

    def loss(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(16, 6, generator=gen)
        y = torch.randn(16, 4, generator=gen)
        z = torch.randn(4, 5, generator=gen)
        out = self.fc2(torch.tanh(self.fc1(x)))
        return (out - y).square().mean() + (torch.einsum("abc,bc->a", self.conv, z)).square().mean()


def train(make_opt, steps: int = STEPS, seed_global: int | None = None) -> tuple[Net, torch.optim.Optimizer]:
    net = Net()
    opt = make_opt(net.parameters())
    if seed_global is not None:
        torch.manual_seed(seed_global)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        net.loss(step).backward()
        if step == NONE_STEP:
            net.fc2.bias.grad = None
        with contextlib.redirect_stdout(io.StringIO()):  # kron_torch prints buffer sizes
            opt.step()
    return net, opt


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12)).item()


def assert_matches_kron_torch(net: Net, opt: DistributedKron, ref_net: Net, ref_opt: torch.optim.Optimizer) -> None:
    for (name, p), rp in zip(net.named_parameters(), ref_net.parameters()):
        assert rel_err(p, rp) <= RTOL, f"param {name}: {rel_err(p, rp):.3g}"
        ref_state, state = ref_opt.state[rp], opt.state[p]
        assert int(state["step"]) == ref_state["step"], name
        assert rel_err(state["momentum_buffer"].reshape(-1), ref_state["momentum_buffer"].reshape(-1)) <= RTOL, name
        for k, q in enumerate(ref_state["Q"]):
            assert state[f"Q_{k}"].shape == q.shape, (name, k)
            assert rel_err(state[f"Q_{k}"], q) <= RTOL, f"{name}.Q_{k}: {rel_err(state[f'Q_{k}'], q):.3g}"
        assert f"Q_{len(ref_state['Q'])}" not in state


OPTIONS = {
    "default": dict(lr=1e-2),
    "wd-one_diag": dict(lr=1e-2, weight_decay=0.1, memory_save_mode="one_diag"),
    "all_diag-p0.3": dict(lr=1e-2, memory_save_mode="all_diag", preconditioner_update_probability=0.3),
    "smart-grad-fit": dict(lr=1e-2, memory_save_mode="smart_one_diag", momentum_into_precond_update=False),
    "schedule-nomerge-maxsize": dict(
        lr=1e-2,
        b1=0.5,
        merge_dims=False,
        max_size_triangular=5,
        precond_lr=0.2,
        precond_init_scale=2.0,
        min_ndim_triangular=3,
    ),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_unbound_matches_kron_torch(name: str) -> None:
    options = OPTIONS[name]
    kt_options = dict(options)
    ours_options = dict(options)
    if name.startswith("schedule"):
        # an annealing that leaves the flat start within the 20 steps: updates at p < 1 too
        kt_options["preconditioner_update_probability"] = kron_torch.precond_update_prob_schedule(
            flat_start=3, decay=0.2, min_prob=0.1
        )
        ours_options["preconditioner_update_probability"] = precond_update_prob_schedule(
            flat_start=3, decay=0.2, min_prob=0.1
        )
    ref_net, ref_opt = train(lambda ps: kron_torch.Kron(ps, **kt_options), seed_global=42)
    net, opt = train(lambda ps: DistributedKron(ps, seed=42, **ours_options))
    assert_matches_kron_torch(net, opt, ref_net, ref_opt)


def test_structured_products_match_kron_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocked triangular/Gram products (real factors are hundreds of dims, these are <= 8):
    forced to recurse down to 1x1 blocks, the 20 steps still match kron_torch."""
    from dist_optim.kernels import structured

    monkeypatch.setattr(structured, "MIN_SIZE", 1)
    ref_net, ref_opt = train(lambda ps: kron_torch.Kron(ps, lr=1e-2), seed_global=42)
    net, opt = train(lambda ps: DistributedKron(ps, seed=42, lr=1e-2))
    assert_matches_kron_torch(net, opt, ref_net, ref_opt)


def test_convert_trains_identically() -> None:
    options = dict(lr=3e-3, b1=0.8, weight_decay=0.05, memory_save_mode="one_diag", precond_lr=0.2)
    ref_net, ref_opt = train(lambda ps: kron_torch.Kron(ps, **options), seed_global=42)

    def converted(ps):
        opt = dist_optim.convert(kron_torch.Kron(ps, **options))
        assert type(opt) is DistributedKron
        group = opt.param_groups[0]
        for key, value in options.items():
            assert group[key] == value, key
        schedule = group["preconditioner_update_probability"]
        # kron_torch keeps the constants as fp32 tensors; ours holds the same fp32 values
        assert isinstance(schedule, ProbabilitySchedule)
        f32 = [float(torch.tensor(v, dtype=torch.float32)) for v in (1.0, 0.03, 0.001, 500.0)]
        assert [schedule.max_prob, schedule.min_prob, schedule.decay, schedule.flat_start] == f32
        return opt

    net, opt = train(converted)
    assert_matches_kron_torch(net, opt, ref_net, ref_opt)


def test_convert_rejects_stepped_and_keeps_custom_schedule() -> None:
    net = Net()
    custom = lambda n: 0.5  # noqa: E731
    opt = dist_optim.convert(kron_torch.Kron(net.parameters(), preconditioner_update_probability=custom))
    assert opt.param_groups[0]["preconditioner_update_probability"] is custom
    src = kron_torch.Kron(net.parameters())
    net.loss(0).backward()
    with contextlib.redirect_stdout(io.StringIO()):
        src.step()
    with pytest.raises(ValueError, match="first step"):
        dist_optim.convert(src)


# ---- schedule and update decision --------------------------------------------------------------------
def test_default_schedule_matches_kron_torch() -> None:
    ours = precond_update_prob_schedule()
    theirs = kron_torch.precond_update_prob_schedule()
    for n in (0, 1, 499, 500, 501, 1000, 2000, 4000, 10000):
        assert torch.equal(ours(n), theirs(torch.tensor(float(n)))), n
    assert float(ours(0)) == 1.0 and float(ours(500)) == 1.0
    assert math.isclose(float(ours(1500)), math.exp(-1.0), rel_tol=1e-6)
    assert float(ours(10**5)) == pytest.approx(0.03)
    # the default when none is given
    assert (
        DistributedKron([torch.zeros(2, requires_grad=True)]).defaults["preconditioner_update_probability"]
        == precond_update_prob_schedule()
    )


def _update_steps(opt: DistributedKron, p: torch.Tensor, steps: int) -> list[int]:
    """1-based steps at which the first factor of ``p`` changed."""
    out = []
    gen = torch.Generator().manual_seed(3)
    for step in range(1, steps + 1):
        p.grad = torch.randn(p.shape, generator=gen)
        before = opt.state[p]["Q_0"].clone() if p in opt.state else None
        opt.step()
        if before is None:  # the factors start at the identity (precond_init_scale 1)
            before = torch.eye(p.shape[0])
        if not torch.equal(before, opt.state[p]["Q_0"]):
            out.append(step)
    return out


def test_constant_probability_updates_every_1_over_p_steps() -> None:
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = DistributedKron([p], preconditioner_update_probability=0.25)
    # the counter reaches 1 / 0.25 at steps 4, 8, 12 (the factors are created at step 1, not updated)
    changed = _update_steps(opt, p, 12)
    assert changed == [4, 8, 12]


def test_custom_schedule_is_called_with_the_step_count() -> None:
    calls: list[int] = []

    def schedule(n: int) -> float:
        calls.append(n)
        return 1.0 if n < 3 else 0.5

    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = DistributedKron([p], preconditioner_update_probability=schedule)
    changed = _update_steps(opt, p, 9)
    assert calls == list(range(9))
    assert changed == [1, 2, 3, 5, 7, 9]


def test_schedule_output_outside_range_is_rejected() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    opt = DistributedKron([p], preconditioner_update_probability=lambda n: 1.5)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="preconditioner_update_probability"):
        opt.step()


def test_seed_makes_runs_deterministic() -> None:
    def run(seed: int) -> torch.Tensor:
        _, opt = train(lambda ps: DistributedKron(ps, lr=1e-2, seed=seed), steps=5)
        return torch.cat([p.detach().reshape(-1) for g in opt.param_groups for p in g["params"]])

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


def test_state_dict_resumes_the_same_trajectory() -> None:
    net_a, opt_a = train(lambda ps: DistributedKron(ps, lr=1e-2, preconditioner_update_probability=0.5), steps=10)
    net_b, opt_b = train(lambda ps: DistributedKron(ps, lr=1e-2, preconditioner_update_probability=0.5), steps=5)
    saved = opt_b.state_dict()
    net_c = Net()
    net_c.load_state_dict(net_b.state_dict())
    opt_c = DistributedKron(net_c.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    opt_c.load_state_dict(saved)
    for step in range(5, 10):
        opt_c.zero_grad(set_to_none=True)
        net_c.loss(step).backward()
        if step == NONE_STEP:
            net_c.fc2.bias.grad = None
        opt_c.step()
    for a, c in zip(net_a.parameters(), net_c.parameters()):
        assert torch.equal(a, c)


# ---- preconditioner structure ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(), {(8, 6): [(8, 8), (6, 6)], (6, 6): [(6, 6), (6, 6)], (3, 4, 5): [(12, 12), (5, 5)], (8,): [(8,)]}),
        (
            dict(memory_save_mode="one_diag"),
            {(8, 6): [(8,), (6, 6)], (6, 6): [(6, 6), (6,)], (3, 4, 5): [(12,), (5, 5)], (8,): [(8,)]},
        ),
        (
            dict(memory_save_mode="smart_one_diag"),
            {(8, 6): [(8,), (6, 6)], (6, 6): [(6, 6), (6, 6)], (3, 4, 5): [(12,), (5, 5)], (8,): [(8,)]},
        ),
        (
            dict(memory_save_mode="all_diag"),
            {(8, 6): [(8,), (6,)], (6, 6): [(6,), (6,)], (3, 4, 5): [(12,), (5,)], (8,): [(8,)]},
        ),
        (
            dict(max_size_triangular=7, merge_dims=False),
            {(8, 6): [(8,), (6, 6)], (6, 6): [(6, 6), (6, 6)], (3, 4, 5): [(3, 3), (4, 4), (5, 5)], (8,): [(8,)]},
        ),
        (
            dict(min_ndim_triangular=1, precond_dtype=torch.float64),
            {(8, 6): [(8, 8), (6, 6)], (6, 6): [(6, 6), (6, 6)], (3, 4, 5): [(12, 12), (5, 5)], (8,): [(8, 8)]},
        ),
    ],
)
def test_memory_save_modes_and_factor_shapes(options, expected) -> None:
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in expected]
    opt = DistributedKron(params, lr=1e-2, **options)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    for p, shapes in zip(params, expected.values()):
        got = [tuple(opt.state[p][f"Q_{k}"].shape) for k in range(len(shapes))]
        assert got == shapes, (tuple(p.shape), got)
        assert f"Q_{len(shapes)}" not in opt.state[p]
        assert opt.state[p]["Q_0"].dtype == options.get("precond_dtype", torch.float32)
        assert torch.isfinite(p).all()


def test_scalar_parameter() -> None:
    # kron_torch fails on 0-dim tensors; ours fits a scalar (diagonal) factor.
    p = torch.nn.Parameter(torch.tensor(1.5))
    opt = DistributedKron([p], lr=1e-1)
    for _ in range(3):
        p.grad = torch.tensor(0.7)
        opt.step()
    assert opt.state[p]["Q_0"].shape == () and torch.isfinite(p) and p.item() < 1.5


@pytest.mark.parametrize("memory_save_mode", [None, "one_diag"])
def test_initial_scale_from_the_first_gradient(memory_save_mode: str | None) -> None:
    """precond_init_scale=None: each parameter's factors start as if precond_init_scale were
    mean(|G|^4)^(-1/8) of its own first gradient (computed here by formula, in float64, and given
    per param group, so that the probes are drawn in the same order): the same trajectory (the
    optimizer reads the debiased first momentum, equal to the gradient up to a rounding that the
    fp32 factors do not keep here); a parameter whose first gradient is zero starts at 1."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(6, 4), (5,), (3, 2)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * c for c, s in zip((10.0, 0.1, 1.0), shapes)] for _ in range(4)]
    grads[0][2] = torch.zeros(shapes[2])  # no signal at the first step: the fallback scale 1
    auto = [torch.nn.Parameter(x.clone()) for x in init]
    opt = DistributedKron(auto, lr=1e-2, memory_save_mode=memory_save_mode, precond_init_scale=None)
    scales = []
    for g in grads[0]:
        g0 = g.double()
        scales.append(float(g0.abs().pow(4).mean() ** (-1 / 8)) if g0.abs().max() > 0 else 1.0)
    fixed = [torch.nn.Parameter(x.clone()) for x in init]
    groups = [{"params": [p], "precond_init_scale": scale} for p, scale in zip(fixed, scales)]
    ref = DistributedKron(groups, lr=1e-2, memory_save_mode=memory_save_mode)
    for step in range(4):
        for p, q, g in zip(auto, fixed, grads[step]):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for p, q in zip(auto, fixed):
            assert torch.equal(p, q), step
    assert scales[0] < 0.5 and scales[1] > 2 and scales[2] == 1.0  # the rule, not the default 1, decides


# ---- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, option",
    [
        (dict(memory_save_mode="two_diag"), "memory_save_mode"),
        (dict(preconditioner_update_probability=0.0), "preconditioner_update_probability"),
        (dict(preconditioner_update_probability=1.5), "preconditioner_update_probability"),
        (dict(preconditioner_update_probability=-0.1), "preconditioner_update_probability"),
        (dict(lr=-1e-3), "lr"),
        (dict(b1=1.0), "b1"),
        (dict(b1=-0.1), "b1"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(precond_lr=-0.1), "precond_lr"),
        (dict(precond_init_scale=0.0), "precond_init_scale"),
        (dict(max_size_triangular=-1), "max_size_triangular"),
        (dict(precond_dtype=torch.int32), "precond_dtype"),
        (dict(seed=1.5), "seed"),
        (dict(communication_dtype=torch.int8), "communication_dtype"),
    ],
)
def test_bad_input(options, option) -> None:
    with pytest.raises(ValueError, match=option):
        DistributedKron([torch.nn.Parameter(torch.zeros(2, 2))], **options)


def test_bad_param_group() -> None:
    opt = DistributedKron([torch.nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="memory_save_mode"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "memory_save_mode": "x"})
    with pytest.raises(ValueError, match="b1"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "b1": 1.5})


def test_convert_rejects_unknown_option() -> None:
    src = kron_torch.Kron([torch.nn.Parameter(torch.zeros(2, 2))])
    src.param_groups[0]["partition_grads"] = True
    src.defaults["partition_grads"] = False
    with pytest.raises(ValueError, match="partition_grads"):
        dist_optim.convert(src)


# ---- distribution: work split and collectives -------------------------------------------------------------
WORK_SHAPES = [(32, 24), (24, 32), (16, 16), (16, 16), (40, 8), (8, 40), (20, 20), (12, 30), (30, 12), (24,), (16,)]
WORK_SHAPES += [(4, 6, 5), (18, 18), (28, 10), (10, 28), (22, 14)]


def _local_params(shapes, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 0.5 for s in shapes]


def _full_grads(shapes, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in shapes]


def _work_worker(shapes, steps: int) -> dict:
    """dp=4 replicated (plain data parallel, owner split over dp) and dp=4 ZeRO chunks."""
    from dist_optim.testing import grid_groups, zero_chunks

    _, dp_group = grid_groups(1, 4)
    out: dict = {}
    ref_params = _local_params(shapes)
    ref = DistributedKron(ref_params, lr=1e-2, weight_decay=1e-2)
    out["work_1"] = ref.precond_work()
    for step in range(steps):
        for p, g in zip(ref_params, _full_grads(shapes, step)):
            p.grad = g
        ref.step()

    for mode in ("replicated", "zero"):
        fulls = _local_params(shapes)
        if mode == "zero":
            params, layouts = zero_chunks(fulls, dp_group)
        else:
            params = [full.clone() for full in fulls]
            layouts = {p: ParamLayout(tuple(p.shape)) for p in params}
        opt = DistributedKron(params, lr=1e-2, weight_decay=1e-2)
        opt.bind(layouts, dp_group=dp_group)
        out[f"work_{mode}"] = opt.precond_work()
        counts = []
        for step in range(steps):
            for p, g in zip(params, _full_grads(shapes, step)):
                p.grad = opt.layout(p).take_local(g)
            comm.reset_counts()
            opt.step()
            counts.append(dict(comm.COUNTS))
        out[f"counts_{mode}"] = counts
        full_now = comm.gather_full([(opt.layout(p), p) for p in params])
        out[f"err_{mode}"] = max(rel_err(a, b) for a, b in zip(full_now, ref_params))
        states = opt.full_state()
        ref_states = ref.full_state()
        out[f"state_err_{mode}"] = max(
            rel_err(s[k], r[k]) for s, r in zip(states, ref_states) for k in r if isinstance(r[k], torch.Tensor)
        )
        assert set().union(*states) == set().union(*ref_states)
    return out


def test_work_split_and_collectives_at_dp4(pool4) -> None:
    results = pool4.run(_work_worker, WORK_SHAPES, 3)
    total = results[0]["work_1"]
    for mode in ("replicated", "zero"):
        per_rank = [r[f"work_{mode}"] for r in results]
        assert sum(per_rank) == pytest.approx(total)
        assert max(per_rank) <= 0.3 * total, (mode, [w / total for w in per_rank])
        for r in results:
            assert r[f"err_{mode}"] <= RTOL and r[f"state_err_{mode}"] <= RTOL, (mode, r)
    # Every step: the NaN/Inf check's all-reduce over the job, then per work group (dp here) one
    # all_to_all each way: pieces of the momenta to the owners (none for replicated params, which
    # every owner holds whole: nothing is sent) and pieces of the directions back. Once, at the
    # first step, the work group tells each other their pieces (one all_gather_object).
    flag = {"all_reduce": 1}
    first = {"all_gather_object": 1}
    replicated = [{**flag, **first, "all_to_all": 1}] + [{**flag, "all_to_all": 1}] * 2
    zero = [{**flag, **first, "all_to_all": 2}] + [{**flag, "all_to_all": 2}] * 2
    for r in results:
        assert r["counts_replicated"] == replicated, r["counts_replicated"]
        assert r["counts_zero"] == zero, r["counts_zero"]


def _tp_count_worker(n_params: int, communication_dtype: torch.dtype | None = torch.bfloat16) -> dict:
    """tp=2 x zero=2: TP-split and replicated params; collectives per step must not depend on
    the number of parameters. Returns the counts, the full params after 2 steps and the unbound
    run's."""
    from dist_optim.testing import grid_groups, tp_zero_chunks

    tp_group, dp_group = grid_groups(2, 2)
    shapes = [((8, 6), 0), ((6, 8), 1), ((6,), None), ((5, 3), None)] * n_params
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=gen) for shape, _ in shapes]
    params, layouts = tp_zero_chunks(fulls, [dim for _, dim in shapes], tp_group, dp_group)
    ref_params = [f.clone() for f in fulls]
    ref = DistributedKron(ref_params, lr=1e-2)
    opt = DistributedKron(params, lr=1e-2, communication_dtype=communication_dtype)
    opt.bind(layouts, dp_group=dp_group)
    counts = []
    for step in range(2):
        for p, rp, full in zip(params, ref_params, fulls):
            p.grad = opt.layout(p).take_local(full * (step + 1))
            rp.grad = full * (step + 1)
        comm.reset_counts()
        opt.step()
        counts.append(dict(comm.COUNTS))
        ref.step()
    final = comm.gather_full([(opt.layout(p), p) for p in params])
    return dict(counts=counts, final=final, ref=[p.detach() for p in ref_params])


def test_collectives_per_step_are_constant_under_tp_and_zero(pool4) -> None:
    small = pool4.run(_tp_count_worker, 1)
    large = pool4.run(_tp_count_worker, 4)
    # The NaN/Inf flag, then one all_to_all each way over the TP x ZeRO grid (pieces of the momenta
    # to their owners, pieces of the directions back); at the first step the grid's ranks tell
    # each other their pieces (one all_gather_object).
    steady = {"all_reduce": 1, "all_to_all": 2}
    expected = [{**steady, "all_gather_object": 1}, steady]
    assert all(r["counts"] == expected for r in small + large), [r["counts"] for r in small + large]
    # bf16 communication: every rank ends with the same full params (the owner's own piece of a
    # direction goes through bf16 as well, so replicas do not drift), close to the fp32
    # single-device run
    for results in (small, large):
        for r in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r["final"], results[0]["final"]))
        assert max(rel_err(a, b) for a, b in zip(results[0]["final"], results[0]["ref"])) <= 1e-2


def test_fp32_communication_is_exact_under_tp_and_zero(pool4) -> None:
    for r in pool4.run(_tp_count_worker, 1, None):
        assert max(rel_err(a, b) for a, b in zip(r["final"], r["ref"])) <= RTOL


def _routed_bytes_worker(layout: tuple[int, int, int], route: bool, comm_dtype: torch.dtype | None) -> dict:
    """The parity harness's parameters at ``layout`` (tp, dp, ZeRO), stepped with pieces routed to
    the owners (``route``) or every full tensor gathered: the bytes this rank receives (every
    all_to_all's and all_gather's output, its own pieces included), the collectives of each step
    and the full params at the end."""
    from tests.helpers import parity

    kwargs = dict(lr=1e-2, weight_decay=1e-2, communication_dtype=comm_dtype)
    opt, masters, _, local_grad = parity.build(DistributedKron, kwargs, *layout, "fp32")
    opt.owner_runtime.route_pieces = route
    counts = []
    with counting_collectives() as seen:
        for step in range(parity.STEPS):
            parity.set_grads(masters, step, local_grad)
            comm.reset_counts()
            opt.step()
            counts.append(dict(comm.COUNTS))
    full, _ = parity.full_result(opt, masters)
    numel = [math.prod(spec.shape) for spec in parity.SPECS]
    return dict(
        received=seen.received_bytes("all_to_all_single", "all_gather_into_tensor"),
        counts=counts,
        full=full,
        numel=numel,
    )


@pytest.mark.parametrize("layout", [(2, 2, 1), (1, 4, 1)], ids=["tp2xzero2", "zero4"])
def test_pieces_go_to_owners(pool4, layout: tuple[int, int, int]) -> None:
    """Each rank sends its pieces of the momenta to their owners and receives its pieces of the
    directions (one all_to_all per work group each way, after the NaN/Inf flag): what a rank
    receives per step is at most 0.55x of gathering every full momentum and every full direction
    in fp32 (about 1/4 here: an owner receives the whole momenta it owns, every rank its quarter of
    the directions). In fp32 the result is bit for bit the gathering path's (the same math on the
    same full tensor on the owner); in bf16 every rank ends with the same parameters."""
    from tests.helpers import parity

    routed = pool4.run(_routed_bytes_worker, layout, True, None)
    gathered = pool4.run(_routed_bytes_worker, layout, False, None)
    numel = routed[0]["numel"]
    none_grad = numel[[spec.name for spec in parity.SPECS].index("row")]
    # Every full momentum and every full direction in fp32, every step but the "row" param's
    # gradient-less one.
    gather_all = 2 * 4 * (parity.STEPS * sum(numel) - none_grad)
    steady = {"all_reduce": 1, "all_to_all": 2}
    for r, g in zip(routed, gathered):
        assert r["counts"] == [{**steady, "all_gather_object": 1}] + [steady] * (parity.STEPS - 1), r["counts"]
        assert r["received"] <= 0.55 * gather_all, (r["received"], gather_all)
        assert r["received"] < 0.6 * g["received"], (r["received"], g["received"])
        assert all(torch.equal(a, b) for a, b in zip(r["full"], g["full"])), "routing changed the fp32 result"
    print(f"received / gathering every full tensor: {[r['received'] / gather_all for r in routed]}")
    low = pool4.run(_routed_bytes_worker, layout, True, torch.bfloat16)
    for r in low[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["full"], low[0]["full"])), "ranks disagree"
    assert max(rel_err(a, b) for a, b in zip(low[0]["full"], routed[0]["full"])) <= 1e-2


# Through a real ColossalAI booster (kron_torch.Kron passed to booster.boost): tests/distributed/test_booster.py.


def _resume_worker(shapes, steps: int, split: int) -> float:
    """The unbound run saved (full_state + extra_state) after ``split`` steps resumes at dp=4 ZeRO
    with the same trajectory as the uninterrupted unbound run."""
    from dist_optim.testing import grid_groups, zero_chunks

    _, dp_group = grid_groups(1, 4)
    ref_params = _local_params(shapes)
    ref = DistributedKron(ref_params, lr=1e-2, preconditioner_update_probability=0.5)
    saved = None
    for step in range(steps):
        if step == split:
            saved = (ref.full_state(), ref.extra_state(), [p.detach().clone() for p in ref_params])
        for p, g in zip(ref_params, _full_grads(shapes, step)):
            p.grad = g
        ref.step()
    states, extra, fulls = saved
    params, layouts = zero_chunks(fulls, dp_group)
    opt = DistributedKron(params, lr=1e-2, preconditioner_update_probability=0.5)
    opt.bind(layouts, dp_group=dp_group)
    opt.load_full_state(states)
    opt.load_extra_state(extra)
    assert all(any(k.startswith("Q_") for k in opt.state[p]) == opt._mine(p) for p in params)
    for step in range(split, steps):
        for p, g in zip(params, _full_grads(shapes, step)):
            p.grad = opt.layout(p).take_local(g)
        opt.step()
    full_now = comm.gather_full([(opt.layout(p), p) for p in params])
    return max(rel_err(a, b) for a, b in zip(full_now, ref_params))


def test_resume_from_full_state_under_another_layout(pool4) -> None:
    errors = pool4.run(_resume_worker, WORK_SHAPES[:6], 6, 3)
    assert max(errors) <= RTOL, errors


def _train_subset(params: list[torch.Tensor], names: dict[torch.Tensor, str], probe_rng: str) -> None:
    opt = DistributedKron(params, lr=1e-2, probe_rng=probe_rng, seed=3)
    opt.param_names = names
    for step in range(6):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 7 + p.numel()))
        opt.step()


def test_per_parameter_probes_do_not_depend_on_the_other_parameters() -> None:
    """What a pipeline stage needs: a parameter's trajectory is the same whether or not the
    optimizer also holds other parameters (sequential draws shift with them)."""
    gen = torch.Generator().manual_seed(0)
    a0, b0 = torch.randn(6, 5, generator=gen), torch.randn(4, 3, generator=gen)
    results = {}
    for rng in ("per_parameter", "sequential"):
        a, b, b_alone = a0.clone(), b0.clone(), b0.clone()
        _train_subset([a, b], {a: "stage0.w", b: "stage1.w"}, rng)
        _train_subset([b_alone], {b_alone: "stage1.w"}, rng)
        results[rng] = rel_err(b_alone, b)
    assert results["per_parameter"] == 0.0
    assert results["sequential"] > 1e-6  # the test can tell the two apart


def test_per_parameter_probes_are_keyed_by_name() -> None:
    x0 = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    x, y = x0.clone(), x0.clone()
    _train_subset([x], {x: "one"}, "per_parameter")
    _train_subset([y], {y: "two"}, "per_parameter")
    assert rel_err(x, y) > 1e-6


def test_bad_probe_rng() -> None:
    with pytest.raises(ValueError, match="probe_rng"):
        DistributedKron([torch.nn.Parameter(torch.zeros(2, 2))], probe_rng="global")


# ---- row blocks: the owner's work on a large tensor (the step-memory budget) --------------------
def _block_specs():
    """Tensors with a diagonal factor (max_size_triangular=100) on dim 0 (tall: split by rows and by
    columns under TP, 449 x 10 per TP rank needing ZeRO padding) or dim 1 (wide, 40 x 301 per TP
    rank, padded too)."""
    from tests.helpers.parity import Spec

    return [
        Spec("tallcol", (600, 40), 0),
        Spec("tallrow", (449, 20), -1),
        Spec("wide", (40, 602), -1),
        Spec("vec", (40,), None),
    ]


BLOCK_KWARGS = dict(lr=1e-2, weight_decay=1e-2, max_size_triangular=100, seed=7)


def _blocked_run(kwargs: dict, blocked: bool, monkeypatch: pytest.MonkeyPatch, dtype=torch.float64):
    from dist_optim.kron import blocks

    monkeypatch.setattr(blocks, "ROW_BLOCK_MIN_BYTES", 1 if blocked else 2**60)
    monkeypatch.setattr(blocks, "ROW_BLOCK_BYTES", 40 * 8 * 64)  # 64 rows of 40 float64 a block
    gen = torch.Generator().manual_seed(5)
    shapes = ((600, 40), (300, 24, 2))
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]
    opt = DistributedKron(params, **kwargs, precond_dtype=dtype)
    for step in range(4):
        for p in params:
            p.grad = None if step == 2 and p.dim() == 3 else torch.randn(p.shape, generator=gen, dtype=dtype)
        opt.step()
    return (
        [p.detach().clone() for p in params],
        opt.full_state(),
        torch.randn(3, generator=opt._random.generator(torch.device("cpu"))),
    )


@pytest.mark.parametrize(
    "extra",
    [{}, {"momentum_into_precond_update": False}, {"preconditioner_update_probability": 0.5}],
    ids=["fit-momentum", "fit-gradient", "every-other-step"],
)
def test_row_blocks_give_the_whole_tensor_result(monkeypatch: pytest.MonkeyPatch, extra: dict) -> None:
    """In float64, the owner's work in blocks (forced down to 64 rows: 10 blocks of 600 x 40, 5 of
    a 3-D tensor) gives the whole-tensor
    work's parameters and factors within 1e-12 element-wise, relative, or 1e-12 of the tensor's
    largest magnitude (the two sums over blocks add in another order; measured: parameters
    3.2e-13 relative at most, state 4.4e-16 of its largest magnitude: 3x and 2000x margin), the
    probes drawn block by block leave the generator where one whole draw does, and the blocked
    path really ran (results not bit-identical)."""
    kwargs = dict(BLOCK_KWARGS, **extra)
    whole = _blocked_run(kwargs, False, monkeypatch)
    blocked = _blocked_run(kwargs, True, monkeypatch)
    for a, b in zip(blocked[0], whole[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    for s, t in zip(blocked[1], whole[1]):
        assert set(s) == set(t)
        for k in t:
            if isinstance(t[k], torch.Tensor):
                scale = float(t[k].abs().max())
                torch.testing.assert_close(s[k], t[k], rtol=1e-12, atol=1e-12 * scale)
    assert torch.equal(blocked[2], whole[2])  # the generator drew the same numbers
    assert any(not torch.equal(a, b) for a, b in zip(blocked[0], whole[0]))


@pytest.mark.parametrize("into_m", [True, False])
def test_column_blocks_give_the_whole_tensor_result(monkeypatch: pytest.MonkeyPatch, into_m: bool) -> None:
    """Blocks along dim 1 (a 40 x 600 float64 tensor whose dim 1 has the diagonal factor: 15
    blocks of 40 columns) draw the probe block by block in another order than one whole draw, so
    the whole-tensor work is given the same numbers (the blocks joined): the direction and the
    factors within 1e-12 relative, or 1e-12 of the tensor's largest magnitude, over 3 steps."""
    from dist_optim.kron import blocks
    from dist_optim.kron.preconditioner import owner_direction
    from dist_optim.kron.structure import plan_factors

    shape = (40, 600)
    group = DistributedKron(
        [torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))],
        max_size_triangular=100,
        precond_dtype=torch.float64,
        momentum_into_precond_update=into_m,
    ).param_groups[0]
    plan = plan_factors(shape, group)
    monkeypatch.setattr(blocks, "ROW_BLOCK_BYTES", 40 * 8 * 40)
    gen = torch.Generator().manual_seed(8)
    states: dict[str, dict] = {"whole": {}, "blocks": {}}
    for step in range(1, 4):
        m, g = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2))
        got = {}
        for label in ("blocks", "whole"):
            monkeypatch.setattr(blocks, "ROW_BLOCK_MIN_BYTES", 1 if label == "blocks" else 2**60)
            state = states[label]
            state["step"] = torch.tensor(float(step))
            probe_gen = torch.Generator().manual_seed(step)
            if label == "blocks":
                assert blocks.block_plan(plan, torch.float64) == blocks.Blocks(1, 40, 600)
                probes = blocks.draw_probe(probe_gen, plan, torch.float64, "cpu")
            else:
                monkeypatch.setattr(blocks, "ROW_BLOCK_MIN_BYTES", 1)
                joined = torch.cat(list(blocks.draw_probe(probe_gen, plan, torch.float64, "cpu")), dim=1)
                monkeypatch.setattr(blocks, "ROW_BLOCK_MIN_BYTES", 2**60)
                probes = iter([joined])
            got[label] = owner_direction(state, group, plan, m.clone(), g, probes, False, True)
        scale = float(got["whole"].abs().max())
        torch.testing.assert_close(got["blocks"], got["whole"], rtol=1e-12, atol=1e-12 * scale)
        assert not torch.equal(got["blocks"], got["whole"])
        for key in ("Q_0", "Q_1"):
            want = states["whole"][key]
            torch.testing.assert_close(states["blocks"][key], want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


def test_block_plans_and_probe_chunks() -> None:
    """Blocks of ROW_BLOCK_BYTES along the first diagonal dim (dim 0 if diagonal: a multiple of 16
    elements, the probe's chunks too); whole below ROW_BLOCK_MIN_BYTES, for vectors and tensors
    without a diagonal factor; every large probe drawn in chunks of at most ROW_BLOCK_BYTES."""
    from dist_optim.kron.blocks import ROW_BLOCK_BYTES, Blocks, block_plan, probe_chunks
    from dist_optim.kron.structure import FactorPlan

    emb = FactorPlan((32000, 8192), (True, False))
    rows = ROW_BLOCK_BYTES // (8192 * 4)
    assert block_plan(emb, torch.float32) == Blocks(0, rows, 32000) and rows % 16 == 0
    assert Blocks(0, rows, 32000).spans()[-1] == (32000 // rows * rows, 32000)
    assert probe_chunks(emb, torch.float32)[:2] == [rows * 8192] * 2
    assert sum(probe_chunks(emb, torch.float32)) == 32000 * 8192
    down = FactorPlan((8192, 28672), (False, True))
    cols = ROW_BLOCK_BYTES // (8192 * 4)
    assert block_plan(down, torch.float32) == Blocks(1, cols, 28672)
    assert probe_chunks(down, torch.float32) == [cols * 8192] * (28672 // cols)
    square = FactorPlan((8192, 8192), (False, False))
    assert block_plan(square, torch.float32) is None
    assert probe_chunks(square, torch.float32) == [ROW_BLOCK_BYTES // 4] * 8
    assert block_plan(FactorPlan((1000, 64), (True, False)), torch.float32) is None  # 256 KB
    assert probe_chunks(FactorPlan((1000, 64), (True, False)), torch.float32) == [64000]
    assert block_plan(FactorPlan((2**26,), (True,)), torch.float32) is None
    assert len(probe_chunks(FactorPlan((2**26,), (True,)), torch.float32)) == 8
    odd = block_plan(FactorPlan((300000, 101), (True, False)), torch.float32)
    assert odd is not None and odd.size * 101 % 16 == 0


def test_chunked_probes_are_one_whole_draw() -> None:
    """On the CPU generator, a probe drawn in blocks of rows, or in chunks into the whole tensor, is
    one whole draw; blocks along dim 1 are one whole draw of the tensor with dim 1 moved to the
    front; discarding chunk by chunk consumes the same numbers as drawing."""
    from dist_optim.kron import blocks
    from dist_optim.kron.structure import FactorPlan

    old = blocks.ROW_BLOCK_MIN_BYTES, blocks.ROW_BLOCK_BYTES
    try:
        blocks.ROW_BLOCK_MIN_BYTES, blocks.ROW_BLOCK_BYTES = 1, 4 * 40 * 7
        plans = [  # rows blocked, columns blocked, chunked whole (no diagonal factor)
            (FactorPlan((100, 33), (True, False)), 0),
            (FactorPlan((30, 101), (False, True)), 1),
            (FactorPlan((30, 101), (False, False)), None),
        ]
        for plan, dim in plans:
            for dtype in (torch.float32, torch.bfloat16, torch.float64):
                moved = plan.shape if not dim else (plan.shape[dim], plan.shape[0])
                want = torch.randn(moved, generator=torch.Generator().manual_seed(2), dtype=dtype)
                gen = torch.Generator().manual_seed(2)
                got = torch.cat(list(blocks.draw_probe(gen, plan, dtype, "cpu")), dim=dim or 0)
                assert torch.equal(got, want if not dim else want.T), (plan, dtype)
                after = torch.randn(3, generator=gen)
                gen = torch.Generator().manual_seed(2)
                blocks.discard_probe(gen, plan, dtype, "cpu")
                assert torch.equal(torch.randn(3, generator=gen), after)
                assert len(blocks.probe_chunks(plan, dtype)) > 1
    finally:
        blocks.ROW_BLOCK_MIN_BYTES, blocks.ROW_BLOCK_BYTES = old


def test_row_blocks_bound_the_owners_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's peak of allocated bytes in one update step (tests/helpers/allocated.py) on a
    4096 x 64 fp32 tensor (1 MiB) with a diagonal first factor: whole-tensor work holds several
    full-size temporaries; in blocks of 64 KiB, working in the received (scratch) momentum, at
    most the small factors, their statistics and a few blocks."""
    from dist_optim.kron import blocks
    from dist_optim.kron.preconditioner import owner_direction
    from dist_optim.kron.structure import plan_factors
    from tests.helpers.allocated import AllocatedBytes

    gen = torch.Generator().manual_seed(0)
    shape, block_bytes = (4096, 64), 64 * 1024
    full = torch.randn(shape, generator=gen).numel() * 4
    group = DistributedKron([torch.nn.Parameter(torch.zeros(shape))], max_size_triangular=100).param_groups[0]
    plan = plan_factors(shape, group)
    peaks = {}
    for label, min_bytes in (("whole", 2**60), ("blocks", 1)):
        monkeypatch.setattr(blocks, "ROW_BLOCK_MIN_BYTES", min_bytes)
        monkeypatch.setattr(blocks, "ROW_BLOCK_BYTES", block_bytes)
        state = {"step": torch.tensor(3.0)}
        m = torch.randn(shape, generator=gen)
        owner_direction(state, group, plan, m.clone(), m, None, False)  # makes the factors
        probes = blocks.draw_probe(torch.Generator().manual_seed(1), plan, torch.float32, "cpu")
        scratch = m.clone()
        with AllocatedBytes() as live:
            owner_direction(state, group, plan, scratch, scratch, probes, False, True)
        peaks[label] = live.peak
    small = 4 * 64 * 64 * 4 + 8 * 4096 * 4  # the factor's statistics and products, the diagonal's
    assert peaks["whole"] >= 4 * full, peaks
    assert peaks["blocks"] <= small + 8 * block_bytes, (peaks, small)


def _blocked_parity_worker() -> list[str]:
    from dist_optim.kron import blocks
    from tests.helpers import parity

    old = blocks.ROW_BLOCK_MIN_BYTES, blocks.ROW_BLOCK_BYTES
    blocks.ROW_BLOCK_MIN_BYTES, blocks.ROW_BLOCK_BYTES = 1, 40 * 4 * 64
    try:
        return parity.parity_worker(
            DistributedKron,
            dict(BLOCK_KWARGS, bucket_bytes=50_000),
            [(2, 2, 1), (1, 4, 1), (1, 4, 0)],
            ("fp32",),
            _block_specs(),
        )
    finally:
        blocks.ROW_BLOCK_MIN_BYTES, blocks.ROW_BLOCK_BYTES = old


def test_row_blocks_keep_parity_on_every_layout(pool4) -> None:
    """With row blocks forced small on every rank, tp2 x ZeRO, ZeRO-4 and DDP-4 give the
    single-device result (the parity grid's element-wise tolerance, a None gradient at step 3):
    owners work in the momenta they received, and non-owners draw and discard the sequential
    probes block by block, keeping every generator in step."""
    failures = [f for res in pool4.run(_blocked_parity_worker) for f in res]
    assert not failures, "\n".join(failures[:10])
