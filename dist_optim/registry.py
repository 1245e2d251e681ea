"""Which ordinary optimizer becomes which dist_optim optimizer, and how its options translate.

A :class:`Conversion` names a source class by its import path (so optional packages are never
imported just to register them), the dist_optim class it becomes, and an explicit translation of
each parameter group's hyperparameters. Options that the translation does not honour raise a
``ValueError`` naming the option; keys that are not hyperparameters of the source (e.g.
``initial_lr`` set by an LR scheduler, a user's ``name``) are carried over unchanged.

:func:`convert` is the public entry point; the plugins call it on whatever optimizer a user
passes to ``booster.boost``. Each optimizer module also registers its planner entry
(:class:`PlanEntry`); the registered optimizers are the set every list of optimizers must cover
(tests/unit/test_registry.py checks each list, CONTRIBUTING.md names them).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import DistOptimizer, class_path

__all__ = [
    "Conversion",
    "ANY",
    "register",
    "lookup",
    "convert",
    "entries",
    "class_path",
    "PlanEntry",
    "register_plan",
    "plan_entries",
]

logger = logging.getLogger("dist_optim")


class _Any:
    def __repr__(self) -> str:
        return "ANY"


#: In :attr:`Conversion.neutral`, a source option that is accepted with any value (it does not
#: change the math, e.g. ``foreach``).
ANY: Any = _Any()


@dataclass(frozen=True)
class Conversion:
    """How one ordinary optimizer class becomes a dist_optim optimizer.

    Attributes:
        source: ``module.QualName`` of the source class, as ``class_path`` prints it.
        target: the dist_optim class.
        options: ``(source optimizer, source group) -> our group options``. It may read
            optimizer attributes that the source keeps outside its groups (e.g. ``adam`` of
            ``colossalai.nn.optimizer.Lamb``) and raises ``ValueError`` for values it cannot honour.
        reads: the source group keys ``options`` translates.
        neutral: source group keys that are accepted only at the given value (or at any value
            with :data:`ANY`); any other source hyperparameter is refused.
        state: ``source state of one param -> our state`` for an optimizer that already stepped.
    """

    source: str
    target: type[DistOptimizer]
    options: Callable[[torch.optim.Optimizer, Mapping[str, Any]], dict[str, Any]]
    reads: frozenset[str]
    neutral: Mapping[str, Any] = field(default_factory=dict)
    state: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None


_REGISTRY: dict[str, Conversion] = {}


def register(conversion: Conversion) -> Conversion:
    _REGISTRY[conversion.source] = conversion
    return conversion


def entries() -> list[Conversion]:
    return list(_REGISTRY.values())


def lookup(optimizer_or_cls: torch.optim.Optimizer | type) -> Conversion | None:
    """The conversion registered for this exact class (subclasses may change the math, so they are
    not matched)."""
    cls = optimizer_or_cls if isinstance(optimizer_or_cls, type) else type(optimizer_or_cls)
    return _REGISTRY.get(class_path(cls))


def _convert_group(conv: Conversion, optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> dict[str, Any]:
    name = conv.source.rsplit(".", 1)[-1]
    hyper = set(optimizer.defaults)
    carried: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params" or key in conv.reads:
            continue
        if key in conv.neutral:
            want = conv.neutral[key]
            if want is not ANY and value != want:
                raise ValueError(
                    f"convert: {name} option {key}={value!r} has no equivalent in {conv.target.__name__}; "
                    f"only {key}={want!r} can be converted"
                )
            continue
        if key in hyper:
            raise ValueError(
                f"convert: {name} option {key}={value!r} is not supported by {conv.target.__name__}; "
                "remove it or use the optimizer unconverted"
            )
        carried[key] = value
    options = conv.options(optimizer, group)
    return {**carried, **options}


def convert(optimizer: torch.optim.Optimizer, *, strict: bool = True) -> torch.optim.Optimizer:
    """The dist_optim equivalent of ``optimizer``: same parameter groups, hyperparameters and
    (if it already stepped) state.

    A dist_optim optimizer is returned unchanged. With ``strict`` (the default) an optimizer
    without an equivalent raises ``TypeError``; with ``strict=False`` it is returned unchanged
    (plugins do that: element-wise optimizers such as AdamW are correct under TP/ZeRO as they are).
    Options that cannot be honoured raise ``ValueError``.
    """
    if isinstance(optimizer, DistOptimizer):
        return optimizer
    conv = lookup(optimizer)
    if conv is None:
        if not strict:
            return optimizer
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise TypeError(f"convert: no dist_optim equivalent for {class_path(type(optimizer))} (registered: {known})")
    groups = [{"params": list(g["params"]), **_convert_group(conv, optimizer, g)} for g in optimizer.param_groups]
    # The new optimizer's defaults (used by add_param_group later) come from the source's
    # defaults; converting them must not warn twice or refuse a default no group uses.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            defaults = _convert_group(conv, optimizer, optimizer.defaults)
    except (ValueError, KeyError, TypeError):
        defaults = {k: v for k, v in groups[0].items() if k != "params"} if groups else {}
    new = conv.target(groups, **{k: v for k, v in defaults.items() if k in _init_args(conv.target)})
    if optimizer.state:
        if conv.state is None:
            raise ValueError(
                f"convert: {conv.source} has already stepped and its state cannot be carried over; "
                "convert before the first step"
            )
        for p, st in optimizer.state.items():
            converted = conv.state(st) if st else None
            if converted:  # a source that builds its state before the first step has nothing to carry
                new.state[p] = converted
    logger.info("dist_optim: converted %s to %s", conv.source, class_path(type(new)))
    return new


def _init_args(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls).parameters) - {"params"}


# ---- how dist_optim.plan builds each optimizer --------------------------------------------------
@dataclass(frozen=True)
class PlanEntry:
    """How ``python -m dist_optim.plan`` builds an optimizer, registered by the optimizer's own
    module next to its conversions: its ``--optimizer`` name, its class, the constructor options the
    planner uses, the options that bring a rare refresh (Shampoo's roots, GaLore's projectors) inside
    a few simulated steps (a refresh costs the same whatever its period), and the param-group
    builder of ``dist_optim`` it needs (its name and default options), if any."""

    name: str
    target: type
    defaults: Mapping[str, Any] = field(default_factory=dict)
    refresh: Mapping[str, Any] = field(default_factory=dict)
    group_builder: tuple[str, Mapping[str, Any]] | None = None


_PLAN_ENTRIES: dict[str, PlanEntry] = {}


def register_plan(entry: PlanEntry) -> None:
    """Add ``entry`` to the planner's optimizers (called at import of the optimizer's module)."""
    _PLAN_ENTRIES[entry.name] = entry


def plan_entries() -> dict[str, PlanEntry]:
    """The planner's optimizers by name, in registration order."""
    return dict(_PLAN_ENTRIES)
