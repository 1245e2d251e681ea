"""Checkpoint workers (run on every rank of a DistPool): train, save through the booster, load
under the same or another plugin/layout, continue."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from tests._colossal_cpu import install, quiet_colossal
from tests.booster import make_optimizer, master_weights, model_for, train_boosted


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
) -> None:
    with quiet_colossal():
        booster, model, wrapper, plugin = _boost(plugin_name, plugin_kwargs, opt_path, opt_kwargs)
        train_boosted(booster, model, wrapper, plugin, range(steps))
        booster.save_model(model, os.path.join(path, "model"), shard=True)
        booster.save_optimizer(wrapper, os.path.join(path, "optim" if shard else "optim.pt"), shard=shard)
    dist.barrier()


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
) -> dict[str, torch.Tensor]:
    """Load at ``start``, train ``steps`` more; full fp32 master weights by name (all ranks)."""
    with quiet_colossal():
        booster, model, wrapper, plugin = _boost(plugin_name, plugin_kwargs, opt_path, opt_kwargs)
        booster.load_model(model, os.path.join(path, "model"))
        booster.load_optimizer(wrapper, os.path.join(path, "optim" if shard else "optim.pt"))
        if resave:
            booster.save_optimizer(wrapper, resave, shard=False)
        train_boosted(booster, model, wrapper, plugin, range(start, start + steps))
        return master_weights(model, wrapper)


def uninterrupted(
    plugin_name: str, plugin_kwargs: dict[str, Any], opt_path: str, opt_kwargs: dict[str, Any], steps: int
) -> dict[str, torch.Tensor]:
    with quiet_colossal():
        booster, model, wrapper, plugin = _boost(plugin_name, plugin_kwargs, opt_path, opt_kwargs)
        train_boosted(booster, model, wrapper, plugin, range(steps))
        return master_weights(model, wrapper)


def single_process(opt_path: str, opt_kwargs: dict[str, Any], steps: int) -> dict[str, torch.Tensor]:
    from tests.booster import reference_run

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
        out["unchanged"] = str(
            all(
                set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
                for a, b in zip(before, after)
            )
        )
        return out
