"""One NaN/Inf gradient policy for every optimizer (``nonfinite="raise" | "skip" | "ignore"``).

Distributed: for one configuration per optimizer class (tests/helpers/cases.py) on every layout of the
parity grid (tests/helpers/parity.py), ONE rank's local gradient of one parameter gets a NaN or an Inf at
step POISON_STEP. Under "raise" every rank raises, naming the parameter and the rank; under
"skip" nothing changes in that step on any rank and the run ends where the single-device run that
never took that step ends (params and full state, 1e-5 relative, parity's tolerance). Both
policies decide with one all-reduce of a flag (plus, on the bad step only, one all_gather_object
of the names). Single device: the same three policies, and option validation.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_optim
from dist_optim import comm
from tests.helpers import parity
from tests.helpers.cases import FAMILIES, PARITY_CASES

#: One configuration per optimizer class: the first of each in PARITY_CASES.
CASES = [case for i, case in enumerate(PARITY_CASES) if all(c.cls is not case.cls for c in PARITY_CASES[:i])]
CLASSES = [case.cls for case in CASES]
POISON_STEP = 3
POISONED = 0  # "col" (8, 6): every rank holds real elements of it on every layout but flat ranges, at flat index 0
POISONED_LABEL = "parameter #0 of param group 0 (shape (8, 6))"
BAD_VALUES = (float("nan"), float("inf"))

#: Minimal valid options per class where the defaults need one (Adafactor: an explicit lr needs
#: relative_step=False; CAME has no default lr).
_MINIMAL: dict[type, dict[str, Any]] = {
    dist_optim.DistributedAdafactor: dict(lr=1e-2, relative_step=False),
    dist_optim.DistributedCAME: dict(lr=1e-2),
}


def _new(cls: type, p: torch.Tensor, **kwargs: Any) -> Any:
    """``cls`` on the one matrix ``p`` (GaLore: in a GaLore group) with minimal valid options."""
    group: dict[str, Any] = {"params": [p]}
    if cls is dist_optim.DistributedGaLore:
        group["rank"] = 2
    return cls([group], **{**_MINIMAL.get(cls, {}), **kwargs})


def _same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of nested states (tensors, dicts, lists, tuples, scalars)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


#: Optimizers that start one all-gather before the check, between refreshes (GaLore: the first
#: bucket's projectors), carrying the check's flag instead of its all-reduce where its group is the
#: whole job; on a bad step it is finished and its result dropped, on every rank alike.
PREFETCHING = {"DistributedGaLore"}


def _snapshot(opt: Any, params: list[torch.Tensor]) -> Any:
    """Everything a step may change on this rank: local params, local state, optimizer-level state."""
    return (
        [p.detach().clone() for p in params],
        [copy.deepcopy(dict(opt.state.get(p, {}))) for p in params],
        copy.deepcopy(opt.extra_state()),
    )


# ---- every layout, on 4 processes -------------------------------------------------------------
def _poisonings(layout_index: int, world: int, zero: int = 0) -> list[tuple[float, int, str]]:
    """(bad value, culprit rank, policy) of one layout: both values under both policies. On flat
    ranges only the ranks holding elements of the poisoned parameter can be culprits."""
    holders = list(range(world))
    if zero == parity.FLAT:
        numels = [math.prod(spec.shape) for spec in parity.SPECS]
        bounds = parity.flat_bounds(numels, world)[POISONED]
        holders = [r for r in range(world) if bounds[r + 1] > bounds[r]]
    return [
        (value, holders[(layout_index + 2 * v) % len(holders)], policy)
        for v, value in enumerate(BAD_VALUES)
        for policy in ("raise", "skip")
    ]


def _poisoned_step(opt: Any, params: list[torch.Tensor], value: float, here: bool) -> dict[str, Any]:
    """Step POISON_STEP, with ``value`` in this rank's piece of the poisoned gradient if ``here``:
    the error (or None), whether nothing changed, the skips counted, the collectives issued."""
    if here:
        params[POISONED].grad.view(-1)[0] = value
    before = _snapshot(opt, params)
    skipped = opt.skipped_steps
    comm.reset_counts()
    error = None
    try:
        opt.step()
    except FloatingPointError as exc:
        error = str(exc)
    after = _snapshot(opt, params)
    # The counter is the only thing a skip may change.
    after[2]["skipped_steps"] = before[2]["skipped_steps"]
    return dict(
        error=error, unchanged=_same(before, after), counted=opt.skipped_steps - skipped, counts=dict(comm.COUNTS)
    )


def nonfinite_worker(cls: type, kwargs: dict[str, Any]) -> list[str]:
    """Every layout of the parity grid under "raise" and "skip" (fp32 masters); returns this
    rank's failures (empty: all good)."""
    failures: list[str] = []
    ref_params, ref_states = parity.reference(cls, kwargs, "fp32", skip={POISON_STEP})
    world = dist.get_world_size()
    for n, (tp, dp, zero) in enumerate(parity.LAYOUTS):
        # NaN and Inf on every layout, each under both policies, from a rank that changes with the
        # layout and the value (NaN from rank n, Inf from rank n + 2).
        for value, culprit, policy in _poisonings(n, world, zero):
            label = f"[tp={tp} dp={dp} zero={zero} {policy} {value} on rank {culprit}]"
            opt, masters, _, local_grad = parity.build(cls, dict(kwargs, nonfinite=policy), tp, dp, zero, "fp32")
            for step in range(parity.STEPS):
                parity.set_grads(masters, step, local_grad)
                if step != POISON_STEP:
                    opt.step()
                    continue
                res = _poisoned_step(opt, masters, value, dist.get_rank() == culprit)
                if not res["unchanged"]:
                    failures.append(f"{label}: the bad step changed something on rank {dist.get_rank()}")
                allowed = [{"all_reduce": 1, "all_gather_object": 1}]
                if cls.__name__ in PREFETCHING:
                    allowed += [{"all_gather": 1, "all_gather_object": 1}, {**allowed[0], "all_gather": 1}]
                if res["counts"] not in allowed:
                    failures.append(f"{label}: the bad step issued {res['counts']}")
                if policy == "raise":
                    want = f"{POISONED_LABEL} on rank {culprit}"
                    if res["error"] is None or want not in res["error"] or "nonfinite='skip'" not in res["error"]:
                        failures.append(f"{label}: expected an error naming {want!r}, got {res['error']!r}")
                    break
                if res["error"] is not None or res["counted"] != 1:
                    failures.append(f"{label}: not skipped ({res})")
            if policy == "skip":
                failures += parity.compare(label, *parity.full_result(opt, masters), ref_params, ref_states)
                if opt.skipped_steps != 1:
                    failures.append(f"{label}: skipped_steps {opt.skipped_steps}")
    # "ignore" checks nothing: its first step issues one all-reduce less than the others'.
    counts = {}
    for policy in ("raise", "ignore"):
        opt, masters, _, local_grad = parity.build(cls, dict(kwargs, nonfinite=policy), 2, 2, 1, "fp32")
        parity.set_grads(masters, 0, local_grad)
        comm.reset_counts()
        opt.step()
        counts[policy] = dict(comm.COUNTS)
    counts["ignore"]["all_reduce"] = counts["ignore"].get("all_reduce", 0) + 1
    if counts["raise"] != counts["ignore"]:
        failures.append(f"[tp=2 dp=2 zero=1] collectives of a step, raise vs ignore + 1 all-reduce: {counts}")
    return failures


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_one_bad_rank_stops_or_skips_every_rank(pool4, case) -> None:
    results = pool4.run(nonfinite_worker, case.cls, case.kwargs)
    failures = sorted({f for rank_failures in results for f in rank_failures})
    assert not failures, "\n".join(failures)


# ---- through the booster, under pipeline parallelism ------------------------------------------------
PIPELINE = dict(tp_size=1, pp_size=2, zero_stage=1, precision="bf16", overlap_communication=False, microbatch_size=1)
PIPELINE_STEPS, PIPELINE_POISON = 3, 1


def pipeline_worker(opt_path: str, opt_kwargs: dict[str, Any], policy: str, value: float) -> dict[str, Any]:
    """A tiny Llama boosted with HybridParallelPlugin(pp=2 x dp=2, ZeRO-1, bf16) and the ordinary
    optimizer ``opt_path``; at step PIPELINE_POISON the first parameter of the last stage gets
    ``value`` in its gradient on that stage's first data-parallel rank only (a tensor hook, before
    ZeRO takes the gradient). Returns what this rank saw of that step."""
    from colossalai.booster import Booster

    from dist_optim import plugins
    from dist_optim.plugins.cpu import install, quiet_colossal
    from dist_optim.testing import tiny_llama
    from tests.helpers.booster import dp_coords, make_optimizer, train_boosted

    install()
    with quiet_colossal():
        model = tiny_llama()
        optimizer = make_optimizer(opt_path, model, opt_kwargs)
        plugin = plugins.HybridParallelPlugin(**PIPELINE)
        booster = Booster(plugin=plugin)
        model, wrapper, *_ = booster.boost(model, optimizer)
        wrapper.optim.nonfinite = policy
        _, dp_rank = dp_coords(plugin)
        culprit = plugin.stage_manager.is_last_stage() and dp_rank == 0
        name, param = next((n, p) for n, p in model.unwrap().named_parameters() if p.requires_grad)
        train_boosted(booster, model, wrapper, plugin, range(PIPELINE_POISON))
        masters = [p for g in wrapper.optim.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in masters]
        state_before = copy.deepcopy({i: dict(wrapper.optim.state.get(p, {})) for i, p in enumerate(masters)})
        hook = param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), value)) if culprit else None
        error = None
        try:
            train_boosted(booster, model, wrapper, plugin, range(PIPELINE_POISON, PIPELINE_POISON + 1))
        except FloatingPointError as exc:
            error = str(exc)
        unchanged = _same([p.detach() for p in masters], before) and _same(
            {i: dict(wrapper.optim.state.get(p, {})) for i, p in enumerate(masters)}, state_before
        )
        finite_after = None
        if error is None:
            if hook is not None:
                hook.remove()
            train_boosted(booster, model, wrapper, plugin, range(PIPELINE_POISON + 1, PIPELINE_STEPS))
            finite_after = all(bool(torch.isfinite(p).all()) for p in masters)
        return dict(
            rank=dist.get_rank(),
            culprit=culprit,
            name=name,
            error=error,
            unchanged=unchanged,
            skipped=wrapper.optim.skipped_steps,
            finite_after=finite_after,
        )


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_pipeline_stage_poisoned_stops_or_skips_every_stage(pool4, family) -> None:
    """A NaN (under "raise") or an Inf (under "skip") in one rank's gradient on the last pipeline
    stage: under "raise" every rank of both stages raises before anything changes, naming the
    parameter and the culprit rank; under "skip" every rank skips that step (masters and state
    bit for bit as before, skipped_steps 1) and the run goes on with finite weights."""
    path, kwargs = family.booster
    nan, inf = BAD_VALUES
    for policy, value in (("raise", nan), ("skip", inf)):
        results = pool4.run(pipeline_worker, path, kwargs, policy, value)
        culprits = [r for r in results if r["culprit"]]
        assert len(culprits) == 1, results
        (bad,) = culprits
        for r in results:
            assert r["unchanged"], f"{policy}: the bad step changed rank {r['rank']}'s masters or state"
            if policy == "raise":
                want = f"parameter {bad['name']!r} on rank {bad['rank']}"
                assert r["error"] is not None and want in r["error"], (r["rank"], want, r["error"])
            else:
                assert r["error"] is None and r["skipped"] == 1 and r["finite_after"], r


# ---- one device --------------------------------------------------------------------------------
def _single(case: Any, policy: str, value: float) -> tuple[Any, list[torch.Tensor], dict[str, Any]]:
    """The single-device run with ``value`` in the poisoned gradient at POISON_STEP."""
    params = [p.clone() for p in parity.full_params("fp32")]
    opt = parity.make(case.cls, dict(case.kwargs, nonfinite=policy), params)
    res: dict[str, Any] = {}
    for step in range(parity.STEPS):
        parity.set_grads(params, step, lambda i, g: g.clone())
        if step != POISON_STEP:
            opt.step()
            continue
        res = _poisoned_step(opt, params, value, True)
        if res["error"] is not None:
            break
    return opt, params, res


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_single_device_policies(case) -> None:
    nan, inf = BAD_VALUES
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. Adafactor's "lr ignored under relative_step" of parity's groups
        opt, params, res = _single(case, "raise", nan)
        assert res["error"] and POISONED_LABEL in res["error"] and "nonfinite='ignore'" in res["error"], res
        assert res["unchanged"] and opt.skipped_steps == 0

        opt, params, res = _single(case, "skip", inf)
        assert res["error"] is None and res["unchanged"] and res["counted"] == 1, res
        assert opt.skipped_steps == 1 and opt.extra_state()["skipped_steps"] == 1
        ref_params, ref_states = parity.reference(case.cls, case.kwargs, "fp32", skip={POISON_STEP})
        # Unbound, the skipped run is the run without that step bit for bit.
        assert _same([p.detach() for p in params], ref_params)
        assert _same(parity.ordered_state(opt, params), ref_states)

        opt, params, res = _single(case, "ignore", nan)
        assert res["error"] is None and res["counted"] == 0 and not res["unchanged"], res
        assert not all(bool(torch.isfinite(p).all()) for p in params), "the NaN/Inf should have reached the params"


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_skipped_steps_are_checkpointed(cls: type) -> None:
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = _new(cls, p, nonfinite="skip")
    p.grad = torch.full_like(p, math.nan)
    opt.step()
    extra = opt.extra_state()
    assert opt.skipped_steps == 1 and extra["skipped_steps"] == 1 and not opt.state.get(p)
    fresh = _new(cls, p)
    fresh.load_extra_state(copy.deepcopy(extra))
    assert fresh.skipped_steps == 1
    fresh.load_extra_state({k: v for k, v in extra.items() if k != "skipped_steps"})  # an older checkpoint
    assert fresh.skipped_steps == 0


# ---- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_bad_policy_is_refused(cls: type) -> None:
    p = torch.nn.Parameter(torch.zeros(4, 3))
    for bad in ("never", "Skip", None, True):
        with pytest.raises(ValueError, match=r"nonfinite must be one of 'raise', 'skip', 'ignore'"):
            _new(cls, p, nonfinite=bad)
    opt = _new(cls, p)
    assert opt.nonfinite == "raise"
    opt.nonfinite = "skip"
    assert opt.nonfinite == "skip"
    with pytest.raises(ValueError, match="nonfinite"):
        opt.nonfinite = "warn"
    assert opt.nonfinite == "skip"
    with pytest.raises(TypeError, match="nonfinite_grad"):  # Shampoo's old name is gone everywhere
        _new(cls, p, nonfinite_grad="skip")


@pytest.mark.parametrize("lr", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_lr_must_be_finite(cls: type, lr: float) -> None:
    p, q = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"lr must be a finite number"):
        _new(cls, p, lr=lr)
    opt = _new(cls, p)
    with pytest.raises(ValueError, match=r"lr must be a finite number"):
        opt.add_param_group({"params": [q], "lr": lr})


def test_nonfinite_survives_conversion() -> None:
    ours = dist_optim.DistributedLamb([torch.nn.Parameter(torch.zeros(3))], nonfinite="skip")
    assert dist_optim.convert(ours) is ours and ours.nonfinite == "skip"
    import torch_optimizer

    converted = dist_optim.convert(torch_optimizer.Lamb([torch.nn.Parameter(torch.zeros(3))], lr=1e-3))
    assert isinstance(converted, dist_optim.DistributedLamb) and converted.nonfinite == "raise"
