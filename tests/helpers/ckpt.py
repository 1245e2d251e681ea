"""Checkpoint workers (run on every rank of a DistPool): train, save through the booster, load
under the same or another plugin/layout, continue."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from dist_optim.plugins.cpu import install, quiet_colossal
from tests.helpers.booster import boosted_states, make_optimizer, master_weights, model_for, record_steps, train_boosted


def _boost(plugin_name: str, plugin_kwargs: dict[str, Any], opt_path: str, opt_kwargs: dict[str, Any]) -> tuple:
    install()
    from colossalai.booster import Booster

    from dist_optim import plugins

    model = model_for(plugin_name)
    optimizer = make_optimizer(opt_path, model, opt_kwargs)
    plugin = getattr(plugins, plugin_name)(**plugin_kwargs)
    booster = Booster(plugin=plugin)
    model, wrapper, *_ = booster.boost(model, optimizer)
    return booster, model, wrapper, plugin


def train_and_save(
    plugin_name: str,
    plugin_kwargs: dict[str, Any],
    opt_path: str,
    opt_kwargs: dict[str, Any],
    steps: int,
    path: str,
    shard: bool,
    with_state: bool = False,
) -> dict[str, Any] | None:
    """Train ``steps``, save model and optimizer; with ``with_state`` return what was saved, as
    :func:`everything` sees it."""
    with quiet_colossal():
        booster, model, wrapper, plugin = _boost(plugin_name, plugin_kwargs, opt_path, opt_kwargs)
        train_boosted(booster, model, wrapper, plugin, range(steps))
        booster.save_model(model, os.path.join(path, "model"), shard=True)
        booster.save_optimizer(wrapper, os.path.join(path, "optim" if shard else "optim.pt"), shard=shard)
        saved = everything(model, wrapper) if with_state else None
    dist.barrier()
    return saved


def load_and_train(
    plugin_name: str,
    plugin_kwargs: dict[str, Any],
    opt_path: str,
    opt_kwargs: dict[str, Any],
    start: int,
    steps: int,
    path: str,
    shard: bool,
    resave: str | None = None,
    with_state: bool = False,
    record: bool = False,
) -> Any:
    """Load at ``start``, train ``steps`` more; full fp32 master weights by name of this rank's
    parameters, and with ``with_state`` also everything the optimizer holds (:func:`everything`).
    ``record``: that, plus the optimizer's full state right after loading (``loaded``) and what it
    was handed at each step after it (``records``, tests/helpers/booster.py ``record_steps``)."""
    with quiet_colossal():
        booster, model, wrapper, plugin = _boost(plugin_name, plugin_kwargs, opt_path, opt_kwargs)
        booster.load_model(model, os.path.join(path, "model"))
        booster.load_optimizer(wrapper, os.path.join(path, "optim" if shard else "optim.pt"))
        if resave:
            booster.save_optimizer(wrapper, resave, shard=False)
        loaded = None
        if record:
            loaded = {"state": boosted_states(model, wrapper), "extra": wrapper.optim.extra_state()}
            records = record_steps(wrapper, model)
        train_boosted(booster, model, wrapper, plugin, range(start, start + steps))
        if record:
            return dict(everything(model, wrapper), loaded=loaded, records=records)
        return everything(model, wrapper) if with_state else master_weights(model, wrapper)


def everything(model: Any, wrapper: Any) -> dict[str, Any]:
    """This rank's view after training: full fp32 master weights and full optimizer state by
    parameter name (its pipeline stage's, its experts'), the optimizer-level state (generators,
    counters), and the working weights the model computes with."""
    return {
        "weights": master_weights(model, wrapper),
        "state": boosted_states(model, wrapper),
        "extra": wrapper.optim.extra_state(),
        "working": working_weights(model),
    }


def working_weights(model: Any) -> dict[str, torch.Tensor]:
    """The weights the boosted model computes with, by name: Gemini's live in chunks that are
    gathered only around their use, so it is asked for them (every rank gets them all)."""
    from colossalai.zero.gemini.gemini_ddp import GeminiDDP

    if isinstance(model, GeminiDDP):
        return {n: t.clone() for n, t in model.state_dict(only_rank_0=False).items()}
    return {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}


def uninterrupted(
    plugin_name: str,
    plugin_kwargs: dict[str, Any],
    opt_path: str,
    opt_kwargs: dict[str, Any],
    steps: int,
    with_state: bool = False,
) -> Any:
    with quiet_colossal():
        booster, model, wrapper, plugin = _boost(plugin_name, plugin_kwargs, opt_path, opt_kwargs)
        train_boosted(booster, model, wrapper, plugin, range(steps))
        return everything(model, wrapper) if with_state else master_weights(model, wrapper)


def single_process(opt_path: str, opt_kwargs: dict[str, Any], steps: int) -> dict[str, torch.Tensor]:
    from tests.helpers.booster import reference_run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return reference_run(opt_path, opt_kwargs, steps)


def bad_loads(
    plugin_name: str, plugin_kwargs: dict[str, Any], opt_path: str, opt_kwargs: dict[str, Any], path: str
) -> dict[str, str]:
    """Loading a corrupted / foreign checkpoint raises a clear error and leaves the state alone."""
    with quiet_colossal():
        booster, model, wrapper, plugin = _boost(plugin_name, plugin_kwargs, opt_path, opt_kwargs)
        train_boosted(booster, model, wrapper, plugin, range(2))
        before = wrapper.optim.full_state()
        out = {}
        for label, target in (
            ("corrupted", os.path.join(path, "corrupted.pt")),
            ("foreign", os.path.join(path, "foreign.pt")),
            ("folder", os.path.join(path, "not_a_checkpoint")),
        ):
            try:
                booster.load_optimizer(wrapper, target)
                out[label] = "no error"
            except ValueError as e:
                out[label] = str(e)
        after = wrapper.optim.full_state()
        for a, b in zip(before, after):
            assert set(a) == set(b), "a refused checkpoint changed the optimizer's state keys"
            for k in a:
                if isinstance(a[k], torch.Tensor):
                    assert torch.equal(a[k], b[k]), f"a refused checkpoint changed state {k!r}"
        return out
